"""Sequence-parallel Mamba2 / SSD (seqpar.mixers.ssd, seqpar.mixers.mamba2): the sharded scan alone against
transformers' own torch ``mamba2_chunk_scan`` run on each document (float64 inputs, every gradient; shards
spanning several scan chunks and ending mid-chunk), its summary bytes against theory, the mamba_ssm
dispatch (a fake module on CPU), and tiny Falcon-H1, Bamba, Nemotron-H, Granite-4 hybrid and Zamba2 models
(one Mamba2 layer, one attention layer) swapped by swap_attention at SP=2 and SP=4 in every attention mode, on a
packed batch of 5 documents (one crossing shard edges), against each document run alone in one process without
seqpar. Every model at SP=2 and SP=4 with contiguous and zigzag sharding: tests/test_mixers_matrix.py."""

from __future__ import annotations

import functools
import inspect
from typing import Any

import pytest
import torch
import torch.distributed as dist
from mixer_parity import (
    VOCAB,
    assert_clear_call_errors,
    assert_left_out_refused,
    assert_modes_run,
    assert_summary_bytes_flat,
    assert_swap_keeps_state,
    checkpointed_parity,
    layer_bf16_errors,
    layer_parity,
    one_process_parity,
    relative_to_largest,
    scan_parity,
    scan_traffic,
    sharded_parity,
)

from seqpar.config import SeqParConfig
from seqpar.mixers.mamba2 import MAMBA2_CLASSES, SeqParMamba2Mixer
from seqpar.mixers.scan_layout import ScanLayout
from seqpar.mixers.ssd import ssd_shard
from seqpar.mixers.state_passing import summary_bytes
from seqpar.swap import swap_attention
from seqpar.testing.deepspeed_teardown import releases_deepspeed_engines

transformers = pytest.importorskip("transformers")
falcon_module = pytest.importorskip("transformers.models.falcon_h1.modeling_falcon_h1")
torch_scan = inspect.unwrap(falcon_module.mamba2_chunk_scan)  # the torch path, whatever kernel is installed
WORLD = dist.group.WORLD

HEADS, HEAD_DIM, GROUPS, STATE = 4, 3, 2, 5
SEQ_NAMES = ("x", "dt", "B", "C")


# ----------------------------------------------------------------------------- the scan alone
def _scan_inputs(batch: int, seq: int, dtype=torch.float64) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    return {"x": r(batch, seq, HEADS, HEAD_DIM), "dt": r(batch, seq, HEADS) - 1, "A": -r(HEADS).exp().float(),
            "B": r(batch, seq, GROUPS, STATE), "C": r(batch, seq, GROUPS, STATE), "D": r(HEADS),
            "dt_bias": r(HEADS), "grad": r(batch, seq, HEADS, HEAD_DIM)}


SCAN_OPTIONS = dict(dt_limit=(0.05, 3.0))


def reference_scan(t: dict[str, torch.Tensor], cu: list[int] | None, chunk_size: int) -> torch.Tensor:
    """transformers' torch scan on each document alone, from a zero state: ``(batch, seq, heads, head_dim)``."""
    bounds = cu if cu is not None else [0, t["x"].shape[1]]
    return torch.cat([
        torch_scan(t["x"][:, a:b], t["dt"][:, a:b], t["A"], t["B"][:, a:b], t["C"][:, a:b], chunk_size, D=t["D"],
                   dt_bias=t["dt_bias"], dt_softplus=True, **SCAN_OPTIONS)
        for a, b in zip(bounds, bounds[1:])], dim=1)


# transformers' torch scan computes in fp32 whatever its inputs (x.float(), B.float()), and the sharded
# scan sums the same terms in another order: agreement to fp32 rounding of each tensor's largest entry
_close = relative_to_largest(2e-6)


def _sharded_scan(t: dict[str, torch.Tensor], layout: ScanLayout | None, group: Any, *, sharding: str,
                  chunk_size: int, mixer_kernels: str = "torch") -> torch.Tensor:
    return ssd_shard(torch_scan, t["x"], t["dt"], t["A"], t["B"], t["C"], t["D"], t["dt_bias"], chunk_size=chunk_size,
                     layout=layout, group=group, sharding=sharding, mixer_kernels=mixer_kernels, **SCAN_OPTIONS)


def _scan_parity(rank: int, world: int, sharding: str, seq: int, cu: list[int] | None, chunk_size: int,
                 mixer_kernels: str = "torch") -> None:
    data = _scan_inputs(2, seq)
    inputs = {k: data[k] for k in ("x", "dt", "A", "B", "C", "D", "dt_bias")}
    sharded = functools.partial(_sharded_scan, sharding=sharding, chunk_size=chunk_size, mixer_kernels=mixer_kernels)
    scan_parity(world, inputs, data["grad"], SEQ_NAMES, 1, lambda t: reference_scan(t, cu, chunk_size), sharded,
                sharding, cu, _close, f"{world} ranks {sharding}, chunk_size {chunk_size}, cu_seqlens {cu}")


# (seq, cu_seqlens, chunk_size): documents starting strictly inside shard chunks and exactly at their starts
# (shard chunks of 40, 20 and 10 at 2/4 ranks contiguous/zigzag), one crossing several; scan chunks of 8 make
# a shard span several scan chunks and end mid-chunk (40 = 5 x 8, 20 = 2.5 x 8, 10 = 1.25 x 8).
SCAN_CASES = [(80, None, 8), (80, [0, 5, 12, 13, 47, 80], 8), (80, [0, 40, 79, 80], 8), (80, [0, 7, 50, 80], 64)]


def test_scan_one_process():
    """One process, declared contiguous or zigzag (a run's SP=1 under a zigzag config): one chunk scanned
    through, whatever the sharding.

    Seen failing: scan_layout cutting one rank's sequence into zigzag's two chunks at SP=1 (the second
    scanned from a zero state; no state passing at world 1): the zigzag cases whose document crosses the
    middle (position 40) fail."""
    for seq, cu, chunk in SCAN_CASES:
        for sharding in ("contiguous", "zigzag"):
            _scan_parity(0, 1, sharding, seq, cu, chunk)


@pytest.mark.parametrize("world,sharding,cases", [(2, "contiguous", SCAN_CASES[::3]),
                                                 (2, "zigzag", SCAN_CASES[1:3]), (2, "balanced", SCAN_CASES[1:2]),
                                                 (4, "zigzag", SCAN_CASES[1:3]), (4, "contiguous", SCAN_CASES[3:])])
def test_scan_sharded_equals_each_document_alone(dist_pool, world, sharding, cases):
    for seq, cu, chunk in cases:
        dist_pool.run(world, _scan_parity, sharding, seq, cu, chunk, timeout=300)


def test_scan_real_chunk_size_and_position_wise():
    # the real chunk size (256) over a sequence shorter than one chunk, with documents; and the probe's
    # position-wise mode: every position its own sequence
    _scan_parity(0, 1, "contiguous", 80, [0, 30, 80], 256)
    data = _scan_inputs(2, 6)
    got = ssd_shard(torch_scan, data["x"], data["dt"], data["A"], data["B"], data["C"], data["D"], data["dt_bias"],
                    chunk_size=4, layout=None, group=None, sharding="contiguous", **SCAN_OPTIONS)
    want = reference_scan(data, list(range(7)), 4)
    _close(got, want, "position-wise")


def _summary_traffic(rank: int, world: int, sharding: str, seq: int) -> tuple[int, int, int, dict]:
    data = _scan_inputs(2, seq, torch.float32)
    traffic, layout = scan_traffic(world, data, SEQ_NAMES, 1, sharding,
                                   functools.partial(_sharded_scan, sharding=sharding, chunk_size=8))
    # by hand: one chunk of the document per rank (contiguous) or two (zigzag); per chunk the transition
    # (batch 2, heads) and the state (batch 2, heads, head_dim, d_state), fp32, forwarded once to each other rank
    chunks = 2 if sharding == "zigzag" else 1
    assert layout.chunks == chunks, layout
    theory = (world - 1) * chunks * (2 * HEADS + 2 * HEADS * HEAD_DIM * STATE) * 4
    transition = torch.empty(chunks, 2, HEADS, dtype=torch.float32)
    state = torch.empty(chunks, 2, HEADS, HEAD_DIM, STATE, dtype=torch.float32)
    assert summary_bytes(transition, state, world) == theory  # the library's formula, on the same shapes
    return traffic.collective_bytes, traffic.p2p_bytes, theory, dict(traffic.calls)


@pytest.mark.parametrize("world,sharding", [(2, "contiguous"), (4, "zigzag")])
def test_summary_bytes_flat_in_sequence_length(dist_pool, world, sharding):
    assert_summary_bytes_flat(dist_pool, world, _summary_traffic, sharding, (8 * world, 64 * world))


# ----------------------------------------------------------------------------- the mamba_ssm dispatch
def test_mamba_ssm_kernel_is_used_where_importable(monkeypatch):
    # On CUDA with mamba_ssm importable, each local chunk goes to its mamba_chunk_scan_combined in one call,
    # its documents kept apart by seq_idx. Here: a fake mamba_ssm on "cpu" that runs transformers' torch scan
    # on each run of equal seq_idx (what the kernel computes), returning the last run's final state.
    import sys
    import types

    from seqpar.mixers import ssd

    calls = []

    def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, dt_bias=None, seq_idx=None, dt_softplus=False,
                                  dt_limit=(0.0, float("inf")), return_final_states=False):
        calls.append(seq_idx is not None)
        assert return_final_states and dt_softplus
        idx = torch.zeros(x.shape[1], dtype=torch.int32) if seq_idx is None else seq_idx[0]
        assert seq_idx is None or bool((seq_idx == seq_idx[:1]).all())
        edges = [0, *[t for t in range(1, x.shape[1]) if idx[t] != idx[t - 1]], x.shape[1]]
        outs = []
        for a, b in zip(edges, edges[1:]):
            out, state = torch_scan(x[:, a:b], dt[:, a:b], A, B[:, a:b], C[:, a:b], chunk_size, D=D, dt_bias=dt_bias,
                                    dt_softplus=True, dt_limit=dt_limit, return_final_states=True)
            outs.append(out)
        return torch.cat(outs, dim=1), state

    tiny("bamba", torch.float32)  # transformers binds mamba_ssm at import: import Bamba's module before the fake
    names = ("mamba_ssm", "mamba_ssm.ops", "mamba_ssm.ops.triton", "mamba_ssm.ops.triton.ssd_combined")
    modules = [types.ModuleType(n) for n in names]
    modules[-1].mamba_chunk_scan_combined = mamba_chunk_scan_combined
    for name, module in zip(names, modules):
        monkeypatch.setitem(sys.modules, name, module)
    assert ssd.ssd_kernel(torch.device("cpu"), "auto") is None  # not a kernel device
    monkeypatch.setattr(ssd, "KERNEL_DEVICES", {"cpu"})
    # opt-in (issue 28): the default ("torch") keeps the torch path with the kernel importable
    assert ssd.ssd_kernel(torch.device("cpu")) is None
    _scan_parity(0, 1, "contiguous", 80, [0, 5, 12, 13, 47, 80], 8)
    one_process_parity(functools.partial(tiny, "bamba"))
    assert calls == []
    assert ssd.ssd_kernel(torch.device("cpu"), "auto") is mamba_chunk_scan_combined
    _scan_parity(0, 1, "contiguous", 80, [0, 5, 12, 13, 47, 80], 8, "auto")
    assert calls == [True]  # one call for the whole shard, its five documents told apart by seq_idx
    one_process_parity(functools.partial(tiny, "bamba"), {"mixer_kernels": "auto"})
    assert len(calls) > 1


# ----------------------------------------------------------------------------- tiny hybrid models
COMMON = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_attention_heads=4, num_key_value_heads=4,
              use_cache=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
MAMBA = dict(mamba_n_heads=2, mamba_n_groups=2, mamba_d_state=4, mamba_d_conv=4, mamba_chunk_size=8)


def config(family: str):
    """One Mamba2 layer and one attention layer (Falcon-H1: one layer running both side by side; Zamba2: a
    Mamba2 layer, then a hybrid layer of the shared attention block and a second Mamba2 layer); two groups of
    B / C, scan chunks of 8 (shards span several and end mid-chunk)."""
    if family == "falcon_h1":  # with its muP multipliers and a time-step clamp
        return transformers.FalconH1Config(
            num_hidden_layers=1, head_dim=8, mamba_d_head=8, mamba_d_ssm=16, mamba_rms_norm=True, ssm_in_multiplier=0.7,
            ssm_multipliers=[0.9, 1.1, 0.8, 1.2, 0.6], time_step_limit=(0.01, 5.0), **MAMBA, **COMMON)
    if family == "bamba":
        return transformers.BambaConfig(num_hidden_layers=2, attn_layer_indices=[1], mamba_d_head=16, mamba_expand=2,
                                        **MAMBA, **COMMON)
    if family == "nemotron_h":
        return transformers.NemotronHConfig(num_hidden_layers=2, layers_block_type=["mamba", "attention"], head_dim=8,
                                            mamba_num_heads=2, mamba_head_dim=8, ssm_state_size=4, n_groups=2,
                                            conv_kernel=4, chunk_size=8, **COMMON)
    if family == "granitemoehybrid":
        return transformers.GraniteMoeHybridConfig(num_hidden_layers=2, layer_types=["mamba", "attention"],
                                                   mamba_d_head=16, mamba_expand=2, num_local_experts=2,
                                                   num_experts_per_tok=1, shared_intermediate_size=32, **MAMBA,
                                                   **COMMON)
    if family == "zamba2":
        return transformers.Zamba2Config(num_hidden_layers=2, layers_block_type=["mamba", "hybrid"], n_mamba_heads=2,
                                         mamba_headdim=16, mamba_expand=2, mamba_ngroups=2, mamba_d_state=4,
                                         mamba_d_conv=4, chunk_size=8, attention_head_dim=8, num_mem_blocks=1,
                                         **COMMON)
    raise ValueError(family)


def tiny(family: str, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    # grouped_mm (the MoE default) has no float64
    model = transformers.AutoModelForCausalLM.from_config(config(family), experts_implementation="eager")
    with torch.no_grad():  # random (not constant) D, dt bias, decay rates, conv bias and norm, drawn before the cast
        for m in model.modules():
            if type(m).__name__ in MAMBA2_CLASSES:
                m.D.normal_()
                m.dt_bias.normal_()
                m.A_log.uniform_(-1.0, 1.0)
                m.conv1d.bias.normal_()
                m.norm.weight.uniform_(0.5, 1.5)
    return model.to(dtype)


ROUTES = {
    "falcon_h1": {"model.layers.0.mamba": "mixer", "model.layers.0.self_attn": "hf"},
    "bamba": {"model.layers.0.mamba": "mixer", "model.layers.1.self_attn": "hf"},
    "nemotron_h": {"model.layers.0.mixer": "mixer", "model.layers.1.mixer": "hf"},
    "granitemoehybrid": {"model.layers.0.mamba": "mixer", "model.layers.1.self_attn": "hf"},
    "zamba2": {"model.layers.0.mamba": "mixer", "model.layers.1.mamba_decoder.mamba": "mixer",
               "model.layers.1.shared_transformer.self_attn": "hf"},
}
FAMILIES = sorted(ROUTES)


def _parity(rank: int, world: int, family: str, sharding: str, mode_list: list[dict] | None = None) -> list[str]:
    return sharded_parity(functools.partial(tiny, family), ROUTES[family], world, sharding, mode_list)


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_one_process_equals_each_document_alone(family):
    # transformers' own torch path scans across the documents of a packed batch; the swapped one does not.
    one_process_parity(functools.partial(tiny, family))


# Every model at SP=2 and SP=4, contiguous and zigzag: tests/test_mixers_matrix.py (with the other families'
# models, one pool task per SP size). Here: every attention mode for some.
@pytest.mark.timeout(900)
@pytest.mark.parametrize("world,family,sharding", [(4, "falcon_h1", "zigzag"), (4, "bamba", "contiguous"),
                                                   (2, "nemotron_h", "balanced")])
def test_every_attention_mode(dist_pool, world, family, sharding):
    assert_modes_run(dist_pool, world, _parity, family, sharding)


# ----------------------------------------------------------------------------- the pure Mamba2 layer
def _layer_parity(rank: int, world: int) -> None:
    """Mamba2Mixer (its model has no attention; the swap's walk refuses such a model): the layer alone."""
    cfg = transformers.Mamba2Config(hidden_size=16, num_heads=4, head_dim=8, state_size=4, n_groups=2, expand=2,
                                    conv_kernel=4, chunk_size=8, num_hidden_layers=1, use_cache=False)
    torch.manual_seed(0)
    layer = transformers.AutoModelForCausalLM.from_config(cfg).backbone.layers[0].mixer.double().eval()
    assert type(layer).__name__ == "Mamba2Mixer"
    with torch.no_grad():
        layer.D.normal_()
        layer.conv1d.bias.normal_()
    layer_parity(world, rank, layer, SeqParMamba2Mixer, lambda m, x, pos, **kw: m(x, **kw), "zigzag", [0, 5, 19, 32],
                 1, 16, _close, "Mamba2Mixer")


@pytest.mark.timeout(600)
def test_pure_mamba2_layer_sharded(dist_pool):
    dist_pool.run(2, _layer_parity, timeout=300)


# ----------------------------------------------------------------------------- errors, swap, bf16, checkpointing
def test_swap_keeps_parameters_buffers_and_state_dict():
    model = tiny("falcon_h1", torch.float32)
    mup = model.model.layers[0].mamba.mup_vector  # a non-persistent buffer, taken over as the same object
    report = assert_swap_keeps_state(model, "model.layers.0.mamba", "FalconH1Mixer")
    assert report.routes["model.layers.0.mamba"] == "mixer"
    layer = model.model.layers[0].mamba
    assert isinstance(layer, SeqParMamba2Mixer) and layer.mup_vector is mup


def test_mamba2_left_out_of_the_swap_is_still_refused():
    assert_left_out_refused(tiny("bamba", torch.float32), ("*self_attn",), "model.layers.0.mamba", "BambaMixer")


def test_cache_and_bad_documents_are_clear_errors():
    model = tiny("bamba", torch.float32)
    swap_attention(model)
    assert_clear_call_errors(model.model.layers[0].mamba, lambda m, x, pos, **kw: m(x, **kw), 16, {"cache": object()})


def _bf16(rank: int, world: int) -> list[tuple[float, float]]:
    out = []
    for family in ("falcon_h1", "bamba"):  # Falcon-H1's multipliers and norm, and the shared forward
        layer = tiny(family, torch.float64).model.layers[0].mamba
        out.append(layer_bf16_errors(world, rank, layer, SeqParMamba2Mixer, lambda m, x, pos, **kw: m(x, **kw),
                                     [0, 5, 29, 48], 16))
    return out


@pytest.mark.timeout(600)
def test_bf16_no_worse_than_one_process_bf16(dist_pool):
    for per_family in dist_pool.run(2, _bf16, timeout=600):
        for ours, own in per_family:
            assert 0 < ours <= 1.5 * own, (ours, own)


def _checkpointed(rank: int, world: int) -> None:
    checkpointed_parity(functools.partial(tiny, "zamba2"), world)


@pytest.mark.timeout(600)
def test_zamba2_with_activation_checkpointing(dist_pool):
    dist_pool.run(2, _checkpointed, timeout=600)


# ----------------------------------------------------------------------------- engines
STEPS, LR = 3, 0.1


def _engine_batch(step: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, VOCAB, (1, 48), generator=torch.Generator().manual_seed(100 + step))
    return {"input_ids": ids, "labels": ids.clone()}


def _engine_reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process without seqpar, float64: 3 SGD steps of tiny Falcon-H1 on the full sequence."""
    model = tiny("falcon_h1", torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        loss = model(**_engine_batch(step)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


@releases_deepspeed_engines
def _engine_run(rank: int, world: int, engine: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    import seqpar
    from seqpar.sequence.batch import shard_batch

    model = tiny("falcon_h1", torch.float32)
    block = {"size": world, "mode": "ring", "sharding": "zigzag"}
    if engine == "fsdp2":
        from seqpar.integrations import fsdp

        cfg = SeqParConfig.from_dict(block)
        manager = seqpar.init_process_groups(config=cfg)
        model = fsdp.wrap(model, cfg, manager=manager, fsdp={"version": 2})
        opt = torch.optim.SGD(model.parameters(), lr=LR)
    else:
        from seqpar.integrations.deepspeed import initialize

        config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
                  "optimizer": {"type": "SGD", "params": {"lr": LR}}, "zero_allow_untested_optimizer": True,
                  "zero_optimization": {"stage": 3}, "gradient_clipping": 0.0, "sequence_parallel": block}
        model, _, _, _ = initialize(model=model, config=config)
        manager = model.seqpar_manager
    assert any(isinstance(m, SeqParMamba2Mixer) for m in model.modules())
    losses = []
    for step in range(STEPS):
        loss = model(**shard_batch(_engine_batch(step), group=manager.sp_group, sharding="zigzag")).loss
        if engine == "fsdp2":
            loss.backward()
            opt.step()
            opt.zero_grad()
        else:
            model.backward(loss)
            model.step()
        losses.append(loss.item())
    if engine == "fsdp2":
        params = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    else:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(model.module.parameters())):
            params = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    seqpar.destroy_process_groups(manager)
    return losses, params


@pytest.mark.timeout(900)  # DeepSpeed's start-up on a loaded 2-core machine
@pytest.mark.parametrize("engine", ["deepspeed_zero3", "fsdp2"])
def test_falcon_h1_trains_under_engines_as_one_process(dist_pool, engine):
    if engine.startswith("deepspeed"):
        pytest.importorskip("deepspeed")
    ref_losses, ref_params = _engine_reference()
    for losses, params in dist_pool.run(2, _engine_run, engine, timeout=600):
        for step, (got, want) in enumerate(zip(losses, ref_losses, strict=True)):
            assert abs(got - want) <= 1e-5 * abs(want), (engine, step, got, want)
        assert set(params) == set(ref_params)
        for name, p in params.items():
            torch.testing.assert_close(p.double(), ref_params[name], rtol=1e-4, atol=1e-6,
                                       msg=lambda m, name=name: f"{engine}: {name} after {STEPS} steps: {m}")
