"""Sequence-parallel Gated DeltaNet and KDA (seqpar.mixers.delta_rule, seqpar.mixers.gdn): the sharded delta
rule alone against transformers' own torch kernels run on each document (float64 inputs, every gradient; shards
spanning several 64-token kernel chunks and ending mid-chunk), its summary bytes against theory (flat in S), and
tiny Qwen3-Next / Qwen3.5 / Qwen3.5-MoE / OLMo-hybrid / Kimi-Linear models (one delta-rule layer, one attention
layer) swapped by swap_attention at SP=2 and SP=4, every attention mode, contiguous, zigzag and balanced, on a
packed batch of 5 documents (one crossing shard edges), against each document run alone in one process."""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.distributed as dist
from mixer_parity import WORLD, assert_bytes_as_theory

import seqpar
from seqpar.mixers.delta_rule import delta_rule_kernel, delta_rule_shard
from seqpar.mixers.scan_layout import scan_layout
from seqpar.mixers.state_passing import summary_bytes
from seqpar.sequence.sharding import gather_sequence, shard_sequence
from seqpar.testing.deepspeed_teardown import releases_deepspeed_engines
from seqpar.testing.traffic import counting

transformers = pytest.importorskip("transformers")
qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
kimi = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")

TORCH_KERNELS = {"gdn": qwen3_next.torch_chunk_gated_delta_rule.__wrapped__,
                 "kda": kimi.chunk_kimi_delta_attention.__wrapped__}
# the kernels compute in fp32 whatever their inputs (they cast): float64 in, fp32 arithmetic inside
SCAN_TOL = {"rtol": 2e-5, "atol": 2e-6}
CHUNK = 8


# ----------------------------------------------------------------------------- the scan alone
def _scan_inputs(rule: str, seq: int) -> dict[str, torch.Tensor]:
    """batch 2, 2 key heads of d_k 8, 4 value heads of d_v 4 (grouped), float64."""
    g = torch.Generator().manual_seed(5)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    decay_shape = (2, seq, 4) if rule == "gdn" else (2, seq, 4, 8)
    heads_k = 2 if rule == "gdn" else 4  # KDA's torch kernel has no grouped heads
    return {"q": r(2, seq, heads_k, 8), "k": r(2, seq, heads_k, 8), "v": r(2, seq, 4, 4),
            "g": -0.1 * r(*decay_shape).exp(), "beta": torch.sigmoid(r(2, seq, 4)), "grad": r(2, seq, 4, 4)}


def reference_scan(rule: str, t: dict[str, torch.Tensor], cu: list[int], chunk: int) -> torch.Tensor:
    """transformers' torch kernel on each document alone: ``(batch, seq, v_heads, d_v)``."""
    kernel = TORCH_KERNELS[rule]
    # grouped heads repeated as transformers' layer repeats them: 5.17's kernel (the floor) takes equal counts only
    q, k = (t[n].repeat_interleave(t["v"].shape[2] // t[n].shape[2], dim=2) for n in "qk")
    return torch.cat([kernel(q[:, a:b], k[:, a:b], t["v"][:, a:b], g=t["g"][:, a:b], beta=t["beta"][:, a:b],
                             use_qk_l2norm_in_kernel=True, chunk_size=chunk)[0] for a, b in zip(cu, cu[1:])], dim=1)


def _scan_parity(rank: int, world: int, rule: str, sharding: str, cu: list[int], chunk: int = CHUNK,
                 recompute: int | None | str = "default", calls: list[str] | None = None,
                 mixer_kernels: str = "torch") -> tuple[int, int]:
    """Sharded scan vs the per-document reference (output and every input's gradient); returns the counted
    collective bytes and their theory. ``calls``: each kernel call is appended (``"forward"`` or
    ``"backward"``: a checkpointed piece recomputed)."""
    data = _scan_inputs(rule, cu[-1])
    names = ("q", "k", "v", "g", "beta")
    ref_in = {n: data[n].clone().requires_grad_() for n in names}
    ref = reference_scan(rule, ref_in, cu, chunk)
    (ref * data["grad"]).sum().backward()

    group = WORLD if world > 1 else None
    ins = {n: data[n].clone().requires_grad_() for n in names}
    local = {n: shard_sequence(t, 1, group=group, sharding=sharding, cu_seqlens=cu) for n, t in ins.items()}
    layout = scan_layout(cu[-1] // world, group=group, sharding=sharding, cu_seqlens=cu)
    kernel = delta_rule_kernel(rule, TORCH_KERNELS[rule], torch.device("cpu"), mixer_kernels)
    phase = ["forward"]
    if calls is not None:
        torch_kernel = kernel

        @functools.wraps(torch_kernel)  # keeps __module__: still transformers' torch path for the default
        def kernel(*args, **kwargs):
            calls.append(phase[0])
            return torch_kernel(*args, **kwargs)

    with counting(world) as traffic:
        out = delta_rule_shard(kernel, local["q"], local["k"], local["v"], local["g"], local["beta"], layout=layout,
                               group=group, sharding=sharding, recompute=recompute, use_qk_l2norm_in_kernel=True,
                               chunk_size=chunk)
        phase[0] = "backward"
        (out * shard_sequence(data["grad"], 1, group=group, sharding=sharding, cu_seqlens=cu)).sum().backward()
    case = f"{rule}: {world} ranks {sharding}, cu_seqlens {cu}"
    full = gather_sequence(out.detach(), 1, group=group, sharding=sharding, cu_seqlens=cu)
    torch.testing.assert_close(full, ref.detach(), **SCAN_TOL, msg=lambda m: f"{case}: {m}")
    for n in names:
        grad = ins[n].grad
        if world > 1:
            dist.all_reduce(grad)
        torch.testing.assert_close(grad, ref_in[n].grad, **SCAN_TOL, msg=lambda m, n=n: f"{case}: grad {n}: {m}")
    # theory: one all-gather (forward) and its reduce-scatter (backward) of each local chunk's summary:
    # transition (batch, v_heads, d_k, d_k) and state (batch, v_heads, d_k, d_v), fp32 -- whatever S is
    chunks = layout.chunks
    transition, state = torch.empty(chunks, 2, 4, 8, 8), torch.empty(chunks, 2, 4, 8, 4)
    return traffic.collective_bytes, 2 * summary_bytes(transition, state, world)


# The kernels' chunk is 64 positions; the tests run them with chunk_size=8 (a kernel argument) to stay small:
# shard chunks of 48 / 24 / 12 positions (2 / 4 ranks, contiguous / zigzag) span several kernel chunks and end
# mid-chunk. Documents start at chunk starts, strictly inside chunks, and one crosses several chunks.
SCAN_CASES = [[0, 96], [0, 5, 30, 31, 61, 96], [0, 24, 95, 96]]


@pytest.mark.parametrize("rule", ["gdn", "kda"])
def test_scan_one_process(rule):
    assert_bytes_as_theory(None, 1, _scan_parity, rule, "contiguous", cases=SCAN_CASES)


@pytest.mark.parametrize("rule,world,sharding", [("gdn", 2, "contiguous"), ("gdn", 2, "zigzag"),
                                                 ("gdn", 4, "zigzag"), ("gdn", 2, "balanced"),
                                                 ("kda", 2, "zigzag"), ("kda", 4, "contiguous")])
def test_scan_sharded_equals_each_document_alone(dist_pool, rule, world, sharding):
    assert_bytes_as_theory(dist_pool, world, _scan_parity, rule, sharding, cases=SCAN_CASES)


def test_scan_with_the_kernels_own_64_position_chunks(dist_pool):
    # shards of 100 positions: a whole 64-position kernel chunk, then one cut mid-way
    for counted, theory in dist_pool.run(2, _scan_parity, "gdn", "contiguous", [0, 5, 150, 200], 64, timeout=300):
        assert counted == theory > 0


def _one_scan_per_run(rank: int, world: int, rule: str, sharding: str, recompute: int | None) -> None:
    # The correction path: a chunk without a document start inside is scanned once (wide, in pieces of
    # `recompute` positions, each but the last repeated in the backward) and its output is o_zero + O_I h;
    # a chunk with one runs each of its segments once (the lead from h). No re-run of any position.
    for cu in SCAN_CASES:
        calls: list[str] = []
        _scan_parity(rank, world, rule, sharding, cu, recompute=recompute, calls=calls)
        layout = scan_layout(cu[-1] // world, group=WORLD, sharding=sharding, cu_seqlens=cu)
        forward = backward = 0
        for j in range(layout.chunks):
            if len(layout.segments(j)) > 1:
                forward += len(layout.segments(j))
            else:
                pieces = math.ceil(layout.chunk_len / recompute) if recompute else 1
                forward, backward = forward + pieces, backward + pieces - 1
        assert (calls.count("forward"), calls.count("backward")) == (forward, backward), (cu, calls)


# local chunks of 48 (contiguous) / 24 (zigzag) / 12 (4 ranks) positions, kernel chunks of 8: pieces of 20 or 5
# positions end mid-kernel-chunk, and the last piece is shorter
@pytest.mark.parametrize("rule,world,sharding,recompute", [
    ("gdn", 2, "contiguous", 20), ("gdn", 2, "zigzag", 20), ("gdn", 2, "zigzag", None), ("gdn", 4, "zigzag", 5),
    ("kda", 2, "zigzag", 5),
])
def test_scan_corrects_from_one_wide_scan_with_recompute(dist_pool, rule, world, sharding, recompute):
    dist_pool.run(world, _one_scan_per_run, rule, sharding, recompute, timeout=300)


def test_summary_bytes_are_flat_in_the_sequence_length(dist_pool):
    # the same layer at S = 640 and S = 1280: the same bytes (chunk summaries, not positions)
    short = dist_pool.run(2, _scan_parity, "gdn", "zigzag", [0, 96], timeout=300)
    long = dist_pool.run(2, _scan_parity, "gdn", "zigzag", [0, 192], timeout=300)
    assert short == long and short[0][0] > 0


# ----------------------------------------------------------------------------- tiny models
# tests/all_models.py's tiny configs, with one delta-rule layer and one attention layer, and the router loss
# off (a router loss over the packed row is not a per-document quantity; tests/test_moe.py checks it under SP).
MODELS = {
    "qwen3_next": ({}, "model.layers.0.linear_attn", "Qwen3NextGatedDeltaNet"),
    "qwen3_5_text": ({}, "model.layers.0.linear_attn", "Qwen3_5GatedDeltaNet"),
    "qwen3_5_moe_text": ({}, "model.layers.0.linear_attn", "Qwen3_5MoeGatedDeltaNet"),
    "olmo_hybrid": ({}, "model.layers.0.linear_attn", "OlmoHybridGatedDeltaNet"),
    "kimi_linear": ({"layer_types": ["linear_attention", "full_attention"], "mlp_layer_types": ["dense", "sparse"],
                     "num_hidden_layers": 2}, "model.layers.0.self_attn", "KimiLinearDeltaAttention"),
}


def tiny(model_type: str, dtype: torch.dtype) -> torch.nn.Module:
    import transformers
    from all_models import tiny_kwargs
    from transformers.models.auto import modeling_auto as auto

    fields, _, _ = MODELS[model_type]
    config = transformers.CONFIG_MAPPING[model_type](
        experts_implementation="eager", **{**tiny_kwargs(model_type), "output_router_logits": False, **fields})
    torch.manual_seed(0)
    model = getattr(transformers, auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])(config)
    with torch.no_grad():  # fresh random values, never zeros or ones (norm weights, dt_bias start constant)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model.to(dtype).train()


def routes(model_type: str) -> dict[str, str]:
    path = MODELS[model_type][1]
    other = path.replace("layers.0", "layers.1").replace("linear_attn", "self_attn")
    return {path: "mixer", other: "hf"}


def _small_kda_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    # KDA's torch kernel solves its 64-position chunks with a 63-step Python loop: chunks of 8 keep the
    # tests fast (the reference and the swapped model both call the module's function: the same kernel)
    import functools

    if not isinstance(kimi.chunk_kimi_delta_attention, functools.partial):
        small = functools.partial(kimi.chunk_kimi_delta_attention, chunk_size=8)
        monkeypatch.setattr(kimi, "chunk_kimi_delta_attention", small)


def _model_parity(rank: int, world: int, model_type: str, sharding: str,
                  mode_list: list[dict] | None = None) -> list[str]:
    from mixer_parity import sharded_parity

    with pytest.MonkeyPatch.context() as patch:  # undone after the task: the pool's ranks are shared
        _small_kda_chunks(patch)
        return sharded_parity(lambda dtype: tiny(model_type, dtype), routes(model_type), world, sharding, mode_list)


@pytest.mark.parametrize("model_type", list(MODELS))
def test_packed_one_process_equals_each_document_alone(monkeypatch, model_type):
    from mixer_parity import one_process_parity

    _small_kda_chunks(monkeypatch)
    one_process_parity(lambda dtype: tiny(model_type, dtype))


@pytest.mark.parametrize("model_type,world,sharding", [
    ("qwen3_5_text", 2, "contiguous"), ("qwen3_5_text", 2, "zigzag"), ("qwen3_5_text", 4, "zigzag"),
    ("qwen3_5_text", 4, "contiguous"), ("qwen3_next", 2, "zigzag"), ("qwen3_next", 4, "contiguous"),
    ("qwen3_5_moe_text", 2, "zigzag"), ("qwen3_5_moe_text", 4, "contiguous"), ("olmo_hybrid", 2, "contiguous"),
    ("olmo_hybrid", 4, "zigzag"), ("kimi_linear", 2, "zigzag"), ("kimi_linear", 4, "contiguous"),
])
def test_sharded_equals_each_document_alone(dist_pool, model_type, world, sharding):
    from mixer_parity import assert_modes_run

    assert_modes_run(dist_pool, world, _model_parity, model_type, sharding)


def test_balanced(dist_pool):
    from mixer_parity import RING_AND_ULYSSES, assert_modes_run

    assert_modes_run(dist_pool, 2, _model_parity, "qwen3_5_text", "balanced", mode_list=RING_AND_ULYSSES)


def _checkpointed(rank: int, world: int) -> None:
    from mixer_parity import checkpointed_parity

    from seqpar.mixers import delta_rule

    # the wide scan's own pieces (delta_rule.RECOMPUTE, 5 positions here) are checkpoints nested inside the
    # layer's (the float64 reference is transformers' own layer: RECOMPUTE does not reach it)
    saved, delta_rule.RECOMPUTE = delta_rule.RECOMPUTE, 5
    try:
        checkpointed_parity(lambda dtype: tiny("qwen3_5_text", dtype), world)
    finally:
        delta_rule.RECOMPUTE = saved


def test_with_activation_checkpointing(dist_pool):
    dist_pool.run(2, _checkpointed, timeout=600)


# ----------------------------------------------------------------------------- bf16, errors, swap
def _bf16(rank: int, world: int, model_type: str) -> tuple[float, float]:
    from mixer_parity import layer_bf16_errors

    from seqpar.mixers.gdn import SeqParGatedDeltaNet

    with pytest.MonkeyPatch.context() as patch:  # undone after the task: the pool's ranks are shared
        _small_kda_chunks(patch)
        layer = tiny(model_type, torch.float64).get_submodule(MODELS[model_type][1])
        return layer_bf16_errors(world, rank, layer, SeqParGatedDeltaNet,
                                 lambda m, x, pos, **kw: m(x, None, None, **kw), [0, 5, 29, 48], 32)


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "kimi_linear"])
def test_bf16_no_worse_than_one_process_bf16(dist_pool, model_type):
    for ours, own in dist_pool.run(2, _bf16, model_type, timeout=300):
        assert 0 < ours <= 1.5 * own, (ours, own)


def test_swap_keeps_parameters_and_state_dict_and_refuses_a_cache():
    from mixer_parity import assert_swap_keeps_state

    model = tiny("qwen3_next", torch.float32)
    report = assert_swap_keeps_state(model, "model.layers.0.linear_attn", "Qwen3NextGatedDeltaNet")
    assert report.routes == routes("qwen3_next")
    layer = model.model.layers[0].linear_attn
    with pytest.raises(ValueError, match="cache"):
        layer(torch.randn(1, 5, 32), cache=object())
    with pytest.raises(ValueError, match=r"cu_seqlens \[0, 4, 9\] must not decrease, running from 0 to the global"):
        layer(torch.randn(1, 10, 32), cu_seq_lens_q=torch.tensor([0, 4, 9]))


# ----------------------------------------------------------------------------- the kernel dispatch
@pytest.mark.parametrize("rule", ["gdn", "kda"])
def test_flash_linear_attention_kernels_are_used_where_importable(monkeypatch, rule):
    # On CUDA with flash-linear-attention importable, each run goes to its chunk_gated_delta_rule / chunk_kda
    # (the same signature as transformers' torch kernels, which the fake module here forwards to, counting calls).
    import sys
    import types

    from seqpar.mixers import delta_rule

    calls = []

    def fake(q, k, v, g, beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
             chunk_size=64):
        calls.append((q.shape[1], initial_state is not None))
        return TORCH_KERNELS[rule](q, k, v, g=g, beta=beta, initial_state=initial_state, chunk_size=chunk_size,
                                   output_final_state=output_final_state,
                                   use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)

    module, name = delta_rule.FLA_KERNELS[rule]
    parts = module.split(".")
    for i in range(1, len(parts) + 1):
        monkeypatch.setitem(sys.modules, ".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    setattr(sys.modules[module], name, fake)
    cpu = torch.device("cpu")
    assert delta_rule.delta_rule_kernel(rule, TORCH_KERNELS[rule], cpu, "auto") is TORCH_KERNELS[rule]
    monkeypatch.setattr(delta_rule, "KERNEL_DEVICES", {"cpu"})
    # opt-in (issue 28): the default ("torch") keeps the torch path with the kernel importable
    assert delta_rule.delta_rule_kernel(rule, TORCH_KERNELS[rule], cpu) is TORCH_KERNELS[rule]
    _scan_parity(0, 1, rule, "contiguous", SCAN_CASES[1])
    assert calls == []
    assert delta_rule.delta_rule_kernel(rule, TORCH_KERNELS[rule], cpu, "auto") is fake
    _scan_parity(0, 1, rule, "contiguous", SCAN_CASES[1], mixer_kernels="auto")
    assert len(calls) == 5  # one per document run (5 documents)


# ----------------------------------------------------------------------------- engines
ENGINE_STEPS, ENGINE_LR, ENGINE_SEQ = 3, 0.1, 48


def _engine_batch(step: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, 96, (1, ENGINE_SEQ), generator=torch.Generator().manual_seed(100 + step))
    return {"input_ids": ids, "labels": ids.clone()}


def _engine_reference() -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One process, no seqpar, fp32: SGD steps on the full sequence; the losses, the first step's gradients
    and the parameters after the last step."""
    model = tiny("qwen3_5_text", torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=ENGINE_LR)
    losses, grads = [], {}
    for step in range(ENGINE_STEPS):
        loss = model(**_engine_batch(step)).loss
        loss.backward()
        if step == 0:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _engine_check(what: str, losses, grads, params) -> None:
    ref_losses, ref_grads, ref_params = _engine_reference()
    for i, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
        assert abs(a - b) <= 1e-5 * abs(b), f"{what} step {i}: loss {a} vs one process {b}"
    assert set(grads) == set(ref_grads) == set(params), sorted(set(grads) ^ set(ref_grads))
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-6,
                                   msg=lambda m, name=name: f"{what}: step 0 grad of {name}: {m}")
        torch.testing.assert_close(params[name], ref_params[name], rtol=1e-4, atol=1e-6,
                                   msg=lambda m, name=name: f"{what}: parameter {name} after the steps: {m}")


@releases_deepspeed_engines
def _zero3(rank: int, world: int) -> None:
    pytest.importorskip("deepspeed")
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    from seqpar.integrations.deepspeed import initialize
    from seqpar.sequence.batch import shard_batch

    config = {
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": 1,
        "optimizer": {"type": "SGD", "params": {"lr": ENGINE_LR}}, "zero_optimization": {"stage": 3},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0, "steps_per_print": 10**6,
        "sequence_parallel": {"size": world, "mode": "ring", "sharding": "zigzag", "swap": "auto"},
    }
    engine, _, _, _ = initialize(model=tiny("qwen3_5_text", torch.float32), config=config)
    manager = engine.seqpar_manager
    losses, grads = [], {}
    for step in range(ENGINE_STEPS):
        loss = engine(**shard_batch(_engine_batch(step), group=manager.sp_group, sharding="zigzag")).loss
        engine.backward(loss)
        if step == 0:  # ZeRO-3 with seqpar's mpu: summed over the SP ranks (DP is 1): one process's gradient
            grads = {n: safe_get_full_grad(p).detach().clone() for n, p in engine.module.named_parameters()}
        engine.step()
        losses.append(loss.item())
    params = {n: safe_get_full_fp32_param(p).detach().clone() for n, p in engine.module.named_parameters()}
    _engine_check("ZeRO-3", losses, grads, params)


def _fsdp2(rank: int, world: int) -> None:
    from seqpar.config import SeqParConfig
    from seqpar.integrations import fsdp
    from seqpar.sequence.batch import shard_batch

    cfg = SeqParConfig(size=world, mode="ring", sharding="zigzag")
    manager = seqpar.init_process_groups(config=cfg)
    model = fsdp.wrap(tiny("qwen3_5_text", torch.float32), cfg, manager=manager, fsdp={"version": 2})
    opt = torch.optim.SGD(model.parameters(), lr=ENGINE_LR)
    losses, grads = [], {}
    for step in range(ENGINE_STEPS):
        loss = model(**shard_batch(_engine_batch(step), group=manager.sp_group, sharding="zigzag")).loss
        loss.backward()
        if step == 0:
            grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    _engine_check("FSDP2", losses, grads, params)


@pytest.mark.timeout(900)  # DeepSpeed's start-up and the one-process reference on a loaded 2-core machine
@pytest.mark.parametrize("engine", [
    "zero3",
    "fsdp2",
])
def test_three_sgd_steps_under_an_engine_equal_one_process(dist_pool, engine):
    dist_pool.run(2, {"zero3": _zero3, "fsdp2": _fsdp2}[engine], timeout=850)
