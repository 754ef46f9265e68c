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
