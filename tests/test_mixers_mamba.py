"""Sequence-parallel Mamba (v1) selective scans (seqpar.mixers.mamba): the sharded scan alone against
transformers' own torch scan run on each document (float64, every gradient), its summary bytes against
theory, and tiny Jamba and Zamba models (one Mamba layer, one attention layer) swapped by swap_attention at
SP=2 and SP=4, every attention mode, contiguous and zigzag (and balanced), on a packed batch of 5 documents
(one crossing shard edges), against each document run alone in one process without seqpar."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from mixer_parity import (
    RING_AND_ULYSSES,
    VOCAB,
    assert_clear_call_errors,
    assert_left_out_refused,
    assert_modes_run,
    assert_summary_bytes_flat,
    assert_swap_keeps_state,
    check,
    checkpointed_parity,
    documents,
    elementwise,
    layer_bf16_errors,
    layer_parity,
    one_process_parity,
    packed_batch,
    per_document_reference,
    relative_to_largest,
    scan_parity,
    scan_traffic,
    sharded_parity,
)

from seqpar.mixers.mamba import SeqParMambaMixer, selective_scan_shard
from seqpar.mixers.scan_layout import ScanLayout
from seqpar.mixers.state_passing import summary_bytes
from seqpar.swap import swap_attention

transformers = pytest.importorskip("transformers")
jamba_module = pytest.importorskip("transformers.models.jamba.modeling_jamba")
torch_scan = jamba_module.mamba_selective_scan


# ----------------------------------------------------------------------------- the scan alone
def _scan_inputs(heads: int, batch: int, d: int, n: int, seq: int, dtype=torch.float64) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    return {"u": r(heads, batch, d, seq), "dt": r(heads, batch, d, seq), "A": -r(heads, d, n).exp(),
            "B": r(heads, batch, n, seq), "C": r(heads, batch, n, seq), "D": r(heads, d), "z": r(heads, batch, d, seq),
            "bias": r(heads, d), "grad": r(heads, batch, d, seq)}


def reference_scan(t: dict[str, torch.Tensor], cu: list[int] | None) -> torch.Tensor:
    """transformers' torch selective scan on each document alone, per head: ``(heads, batch, d, seq)``."""
    bounds = cu if cu is not None else [0, t["u"].shape[-1]]
    heads = []
    for h in range(t["u"].shape[0]):
        heads.append(torch.cat([
            torch_scan(t["u"][h, ..., a:b], t["dt"][h, ..., a:b], t["A"][h], t["B"][h, ..., a:b], t["C"][h, ..., a:b],
                       D=t["D"][h], z=t["z"][h, ..., a:b], delta_bias=t["bias"][h], delta_softplus=True)
            for a, b in zip(bounds, bounds[1:])], dim=-1))
    return torch.stack(heads)


SEQ_NAMES = ("u", "dt", "B", "C", "z")  # the inputs cut along the sequence (the last dim)


def _sharded_scan(t: dict[str, torch.Tensor], layout: ScanLayout | None, group: Any, *, sharding: str) -> torch.Tensor:
    return selective_scan_shard(torch_scan, t["u"], t["dt"], t["A"], t["B"], t["C"], t["D"], t["z"], t["bias"],
                                layout=layout, group=group, sharding=sharding)


def _scan_parity(rank: int, world: int, sharding: str, seq: int, cu: list[int] | None) -> None:
    data = _scan_inputs(2, 2, 3, 4, seq)
    inputs = {k: data[k] for k in ("u", "dt", "A", "B", "C", "D", "z", "bias")}
    scan_parity(world, inputs, data["grad"], SEQ_NAMES, -1, lambda t: reference_scan(t, cu),
                functools.partial(_sharded_scan, sharding=sharding), sharding, cu, elementwise(1e-10),
                f"{world} ranks {sharding}, cu_seqlens {cu}")


# (seq, cu_seqlens): documents starting strictly inside chunks and exactly at chunk starts (chunks of 24,
# 12 and 6 at 2/4 ranks, contiguous and zigzag), one crossing several chunks.
SCAN_CASES = [(48, None), (48, [0, 5, 12, 13, 30, 48]), (48, [0, 24, 47, 48])]


@pytest.mark.parametrize("sharding", ["contiguous", "zigzag"])
@pytest.mark.parametrize("seq,cu", SCAN_CASES)
def test_scan_one_process(seq, cu, sharding):
    """One process, declared contiguous or zigzag (SP=1 under a zigzag config): one chunk scanned through.

    Seen failing: scan_layout cutting the sequence into zigzag's two chunks at SP=1 (the second from a zero
    state): the zigzag cases whose first or only document crosses the middle (position 24)."""
    _scan_parity(0, 1, sharding, seq, cu)


@pytest.mark.parametrize("world,sharding,cases", [(2, "contiguous", SCAN_CASES), (2, "zigzag", SCAN_CASES[1:]),
                                                 (2, "balanced", SCAN_CASES[1:2]), (4, "zigzag", SCAN_CASES[1:])])
def test_scan_sharded_equals_each_document_alone(dist_pool, world, sharding, cases):
    for seq, cu in cases:
        dist_pool.run(world, _scan_parity, sharding, seq, cu, timeout=300)


def _summary_traffic(rank: int, world: int, sharding: str, seq: int) -> tuple[int, int, int, dict]:
    data = _scan_inputs(2, 2, 3, 4, seq, torch.float32)
    traffic, layout = scan_traffic(world, data, SEQ_NAMES, -1, sharding,
                                   functools.partial(_sharded_scan, sharding=sharding))
    # by hand: a rank holds one chunk of the document (contiguous) or two (zigzag), and its all-gather forwards
    # each other rank's (transition, state) summaries once: (P - 1) x chunks x 2 x (heads 2 x batch 2 x d 3 x
    # d_state 4) fp32 values (the layout the scan ran with must agree)
    chunks = 2 if sharding == "zigzag" else 1
    assert layout.chunks == chunks, layout
    theory = (world - 1) * chunks * 2 * (2 * 2 * 3 * 4) * 4
    summary = torch.empty(chunks, 2, 2, 3, 4, dtype=torch.float32)
    assert summary_bytes(summary, summary, world) == theory  # the library's formula, on the same shapes
    return traffic.collective_bytes, traffic.p2p_bytes, theory, dict(traffic.calls)


@pytest.mark.parametrize("world,sharding", [(2, "contiguous"), (4, "zigzag")])
def test_summary_bytes_flat_in_sequence_length(dist_pool, world, sharding):
    assert_summary_bytes_flat(dist_pool, world, _summary_traffic, sharding, (4 * world, 16 * world))


# ----------------------------------------------------------------------------- tiny Jamba / Zamba
def tiny(family: str, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_attention_heads=4,
                  num_key_value_heads=4, mamba_d_state=4, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4,
                  use_cache=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "jamba":
        cfg = transformers.JambaConfig(num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1,
                                       expert_layer_period=2, expert_layer_offset=1, num_experts=1, **common)
    else:
        cfg = transformers.ZambaConfig(num_hidden_layers=3, layers_block_type=["linear_attention", "hybrid", "hybrid"],
                                       attention_hidden_size=32, attention_head_dim=8, n_mamba_heads=2, **common)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # random (not constant) D and conv biases, drawn before the cast: same in every dtype
        for m in model.modules():
            if type(m).__name__.endswith("MambaMixer"):
                m.D.normal_()
                m.conv1d.bias.normal_()
    return model.to(dtype)


def mixer_routes(family: str) -> dict[str, str]:
    if family == "jamba":
        return {"model.layers.0.mamba": "mixer", "model.layers.1.self_attn": "hf"}
    # Zamba: a Mamba layer, then two hybrid layers (a Mamba mixer beside one shared, tied attention block)
    return {"model.layers.0.mamba": "mixer", "model.layers.1.mamba_decoder.mamba": "mixer",
            "model.layers.2.mamba_decoder.mamba": "mixer", "model.layers.1.shared_transf.self_attn": "hf",
            "model.layers.2.shared_transf.self_attn": "hf"}


def _parity(rank: int, world: int, family: str, sharding: str, mode_list: list[dict] | None = None) -> list[str]:
    return sharded_parity(functools.partial(tiny, family), mixer_routes(family), world, sharding, mode_list)


@pytest.mark.parametrize("family", ["jamba", "zamba"])
def test_packed_one_process_equals_each_document_alone(family):
    # transformers' own torch path scans across the documents of a packed batch; the swapped one does not.
    one_process_parity(functools.partial(tiny, family))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("sharding", ["contiguous", "zigzag"])
def test_jamba_sharded_equals_each_document_alone(dist_pool, world, sharding):
    assert_modes_run(dist_pool, world, _parity, "jamba", sharding)


@pytest.mark.parametrize("world,family,sharding", [(2, "zamba", "zigzag"), (4, "zamba", "contiguous"),
                                                   (2, "jamba", "balanced")])
def test_zamba_and_balanced(dist_pool, world, family, sharding):
    assert_modes_run(dist_pool, world, _parity, family, sharding, mode_list=RING_AND_ULYSSES)


# ----------------------------------------------------------------------------- the pure Mamba models
def tiny_pure(name: str, dtype: torch.dtype) -> torch.nn.Module:
    """A MambaForCausalLM / FalconMambaForCausalLM of two Mamba layers and no attention at all."""
    torch.manual_seed(0)
    cfg = getattr(transformers, f"{name}Config")(vocab_size=VOCAB, hidden_size=16, state_size=4, expand=2,
                                                 conv_kernel=4, time_step_rank=4, num_hidden_layers=2,
                                                 use_cache=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__.endswith("MambaMixer"):
                m.D.normal_()
                m.conv1d.bias.normal_()
    return model.to(dtype)


def _pure_parity(rank: int, world: int, name: str, sharding: str) -> list[str]:
    routes = {"backbone.layers.0.mixer": "mixer", "backbone.layers.1.mixer": "mixer"}
    # no attention: the attention mode is moot, the mixers alone carry the sequence across the ranks
    return sharded_parity(functools.partial(tiny_pure, name), routes, world, sharding, [{"mode": "ring"}])


@pytest.mark.parametrize("name,world,sharding", [("Mamba", 2, "zigzag"), ("FalconMamba", 4, "contiguous")])
def test_pure_mamba_models_sharded(dist_pool, name, world, sharding):
    # a model of Mamba layers alone (no attention to swap) is swapped, probed and trained like a hybrid
    assert dist_pool.run(world, _pure_parity, name, sharding, timeout=600)[0] == ["ring"]


def test_pure_mamba_model_one_process():
    one_process_parity(functools.partial(tiny_pure, "Mamba"))


# ----------------------------------------------------------------------------- the pure Mamba layers
def _layer_parity(rank: int, world: int, name: str) -> None:
    """MambaMixer / FalconMambaMixer (their models have no attention, which the swap refuses): the layer alone."""
    cfg = getattr(transformers, f"{name}Config")(hidden_size=16, state_size=4, expand=2, conv_kernel=4,
                                                 time_step_rank=4, num_hidden_layers=1, use_cache=False)
    torch.manual_seed(0)
    layer = transformers.AutoModelForCausalLM.from_config(cfg).backbone.layers[0].mixer.double().eval()
    assert type(layer).__name__ == f"{name}Mixer"
    with torch.no_grad():
        layer.D.normal_()
        layer.conv1d.bias.normal_()
    # The layer itself runs parts in fp32 even in float64 (A_log.float(), B.float() in the scan), so the
    # gradients reaching A_log and B go through fp32 roundings that depend on the summation order.
    # So: agreement to 1e-6 of each tensor's largest entry (fp32 rounding), not elementwise.
    layer_parity(world, rank, layer, SeqParMambaMixer, lambda m, x, pos, **kw: m(x, **kw), "zigzag", [0, 5, 19, 32],
                 1, 16, relative_to_largest(1e-6), name)


@pytest.mark.parametrize("name", ["Mamba", "FalconMamba"])
def test_pure_mamba_layers_sharded(dist_pool, name):
    dist_pool.run(2, _layer_parity, name, timeout=300)


# ----------------------------------------------------------------------------- kernels, errors, swap
def test_kernel_of_the_transformers_module_is_used(monkeypatch):
    # On CUDA transformers binds mamba_ssm's selective_scan_fn to mamba_selective_scan when it is importable;
    # the swapped layer calls whatever the model's module holds (here a fake kernel running the torch path).
    calls = []

    def fake_kernel(*args, **kwargs):
        calls.append(kwargs["return_last_state"])
        return torch_scan(*args, **kwargs)

    docs = documents()
    ref_loss, ref_grads = per_document_reference(functools.partial(tiny, "jamba"), docs)
    model = tiny("jamba", torch.float32)
    swap_attention(model)
    monkeypatch.setattr(jamba_module, "mamba_selective_scan", fake_kernel)
    out = model(**packed_batch(docs))
    out.loss.backward()
    assert calls and all(calls)  # one call per document run inside the shard, each returning its state
    check(model, out.loss, ref_loss, ref_grads, 1, "fake kernel")


def test_swap_keeps_parameters_and_state_dict():
    report = assert_swap_keeps_state(tiny("zamba", torch.float32), "model.layers.0.mamba", "ZambaMambaMixer")
    assert report.routes["model.layers.0.mamba"] == "mixer"


def test_mamba_left_out_of_the_swap_is_still_refused():
    assert_left_out_refused(tiny("jamba", torch.float32), ("*self_attn",), "model.layers.0.mamba", "JambaMambaMixer")


def test_cache_and_bad_documents_are_clear_errors():
    model = tiny("jamba", torch.float32)
    swap_attention(model)
    assert_clear_call_errors(model.model.layers[0].mamba, lambda m, x, pos, **kw: m(x, **kw), 16, {"cache": object()})


def _bf16(rank: int, world: int) -> tuple[float, float]:
    layer = tiny("jamba", torch.float64).model.layers[0].mamba
    return layer_bf16_errors(world, rank, layer, SeqParMambaMixer, lambda m, x, pos, **kw: m(x, **kw),
                             [0, 5, 29, 48], 16)


def test_bf16_no_worse_than_one_process_bf16(dist_pool):
    for ours, own in dist_pool.run(2, _bf16, timeout=300):
        assert 0 < ours <= 1.5 * own, (ours, own)


def _checkpointed(rank: int, world: int) -> None:
    # the recompute sees the documents the batch's forward fed to the Mamba layer (Jamba's decoder layer
    # does not pass them)
    checkpointed_parity(functools.partial(tiny, "jamba"), world)


def test_jamba_with_activation_checkpointing(dist_pool):
    dist_pool.run(2, _checkpointed, timeout=300)


def _pure_checkpointed(rank: int, world: int) -> None:
    checkpointed_parity(functools.partial(tiny_pure, "Mamba"), world)


def test_pure_mamba_with_activation_checkpointing(dist_pool):
    """MambaModel calls each MambaBlock with the hidden states alone: the block's carrier adds the batch's
    documents to the call, so transformers' checkpoint saves them and the backward's recompute (when the
    model holds nothing any more) scans each document alone again.

    Seen failing: the carrier's forward reading the documents held on the thread when it runs instead of
    its call's: the recompute, with no documents held, scanned across them (torch's CheckpointError: a
    different number of tensors saved than in the forward); Jamba's and Qwen3-Next's checkpointed tests, whose
    layers get cu_seq_lens_q from their caller, passed."""
    dist_pool.run(2, _pure_checkpointed, timeout=300)


def test_documents_reach_the_mixers_of_a_deep_copy():
    # Jamba's decoder layer does not pass cu_seq_lens_q to its Mamba layer: the swap makes that layer carry
    # them (seqpar.mixers.documents), and a deep copy of the swapped model (DeepSpeed, EMA copies) carries its own
    # batches; the original, called in between with one sequence, leaves them alone.
    import copy

    model = tiny("jamba", torch.float32)
    swap_attention(model)
    twin = copy.deepcopy(model)
    docs = documents()
    batch = packed_batch(docs)
    twin(**batch)
    model(input_ids=batch["input_ids"])
    ref_loss, ref_grads = per_document_reference(functools.partial(tiny, "jamba"), docs)
    out = twin(**batch)
    out.loss.backward()
    check(twin, out.loss, ref_loss, ref_grads, 1, "deep copy")
