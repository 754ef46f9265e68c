"""Sequence-parallel Gated DeltaNet and KDA (seqpar.mixers.delta_rule, seqpar.mixers.gdn): the sharded delta
rule alone against transformers' own torch kernels run on each document (float64 inputs, every gradient; shards
spanning several 64-token kernel chunks and ending mid-chunk), its summary bytes against theory (flat in S), and
tiny Qwen3-Next / Qwen3.5 / Qwen3.5-MoE / OLMo-hybrid / Kimi-Linear models (one delta-rule layer, one attention
layer) swapped by swap_attention at SP=2 and SP=4, every attention mode, contiguous, zigzag and balanced, on a
packed batch of 5 documents (one crossing shard edges), against each document run alone in one process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from mixer_parity import WORLD

from seqpar.mixers.delta_rule import delta_rule_kernel, delta_rule_shard
from seqpar.mixers.scan_layout import scan_layout
from seqpar.mixers.state_passing import summary_bytes
from seqpar.sequence.sharding import gather_sequence, shard_sequence
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
    return torch.cat([kernel(t["q"][:, a:b], t["k"][:, a:b], t["v"][:, a:b], g=t["g"][:, a:b], beta=t["beta"][:, a:b],
                             use_qk_l2norm_in_kernel=True, chunk_size=chunk)[0] for a, b in zip(cu, cu[1:])], dim=1)


def _scan_parity(rank: int, world: int, rule: str, sharding: str, cu: list[int], chunk: int = CHUNK) -> tuple[int, int]:
    data = _scan_inputs(rule, cu[-1])
    names = ("q", "k", "v", "g", "beta")
    ref_in = {n: data[n].clone().requires_grad_() for n in names}
    ref = reference_scan(rule, ref_in, cu, chunk)
    (ref * data["grad"]).sum().backward()

    group = WORLD if world > 1 else None
    ins = {n: data[n].clone().requires_grad_() for n in names}
    local = {n: shard_sequence(t, 1, group=group, sharding=sharding, cu_seqlens=cu) for n, t in ins.items()}
    layout = scan_layout(cu[-1] // world, group=group, sharding=sharding, cu_seqlens=cu)
    kernel = delta_rule_kernel(rule, TORCH_KERNELS[rule], torch.device("cpu"))
    with counting(world) as traffic:
        out = delta_rule_shard(kernel, local["q"], local["k"], local["v"], local["g"], local["beta"], layout=layout,
                               group=group, sharding=sharding, use_qk_l2norm_in_kernel=True, chunk_size=chunk)
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
    for cu in SCAN_CASES:
        assert _scan_parity(0, 1, rule, "contiguous", cu) == (0, 0)


@pytest.mark.parametrize("rule,world,sharding", [("gdn", 2, "contiguous"), ("gdn", 2, "zigzag"),
                                                 ("gdn", 4, "zigzag"), ("gdn", 2, "balanced"),
                                                 ("kda", 2, "zigzag"), ("kda", 4, "contiguous")])
def test_scan_sharded_equals_each_document_alone(dist_pool, rule, world, sharding):
    for cu in SCAN_CASES:
        for counted, theory in dist_pool.run(world, _scan_parity, rule, sharding, cu, timeout=300):
            assert counted == theory > 0, (counted, theory)


def test_scan_with_the_kernels_own_64_position_chunks(dist_pool):
    # shards of 100 positions: a whole 64-position kernel chunk, then one cut mid-way
    for counted, theory in dist_pool.run(2, _scan_parity, "gdn", "contiguous", [0, 5, 150, 200], 64, timeout=300):
        assert counted == theory > 0


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


def _small_kda_chunks() -> None:
    # KDA's torch kernel solves its 64-position chunks with a 63-step Python loop: chunks of 8 keep the
    # tests fast (the reference and the swapped model both call the module's function: the same kernel)
    import functools

    if not isinstance(kimi.chunk_kimi_delta_attention, functools.partial):
        kimi.chunk_kimi_delta_attention = functools.partial(kimi.chunk_kimi_delta_attention, chunk_size=8)


def _model_parity(rank: int, world: int, model_type: str, sharding: str,
                  mode_list: list[dict] | None = None) -> list[str]:
    from mixer_parity import sharded_parity

    _small_kda_chunks()
    return sharded_parity(lambda dtype: tiny(model_type, dtype), routes(model_type), world, sharding, mode_list)


@pytest.mark.parametrize("model_type", list(MODELS))
def test_packed_one_process_equals_each_document_alone(model_type):
    from mixer_parity import one_process_parity

    _small_kda_chunks()
    one_process_parity(lambda dtype: tiny(model_type, dtype))


@pytest.mark.parametrize("model_type,world,sharding", [
    ("qwen3_5_text", 2, "contiguous"), ("qwen3_5_text", 2, "zigzag"), ("qwen3_5_text", 4, "zigzag"),
    ("qwen3_next", 2, "zigzag"), ("qwen3_next", 4, "contiguous"),
])
def test_sharded_equals_each_document_alone(dist_pool, model_type, world, sharding):
    from mixer_parity import modes

    done = dist_pool.run(world, _model_parity, model_type, sharding, timeout=600)[0]
    assert done == [m["mode"] for m in modes(world)]
