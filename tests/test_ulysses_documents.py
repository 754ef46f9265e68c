"""Packed documents, sliding windows and sinks (issue 10) in the Ulysses and hybrid modes (issue 11),
against test_documents' float64 dense masked reference on the full sequence.

Ulysses at P = 2, 3 and 4 (contiguous, zigzag, balanced) and hybrid at P = 4 as 2 x 2 (contiguous,
zigzag); causal or not; documents of length 1, shorter than a chunk and spanning shards; a window
smaller than a chunk and one larger than a shard; sinks (summed over the ranks, the usual reduction of
a replicated weight); GQA, MQA with fewer K/V heads than Ulysses ranks, and two head chunks with sinks
(each chunk's sink slice); bf16 within SDPA's own rounding. Plus the clear refusal of hybrid with the balanced sharding.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from test_documents import check, check_low_precision, make_case
from test_documents import run_cases as _run_cases

import seqpar
from seqpar.attn.choose import MODE_FEATURES, CallShape, Links, rank_modes

# (q_heads, kv_heads, head_dim) per Ulysses degree: GQA with an odd head dim, MQA with fewer K/V heads
# than ranks, two head chunks per rank (8 / 4 at u = 2: two K/V heads each)
HEADS = {2: ((4, 2, 12), (2, 1, 8), (8, 4, 6)), 3: ((6, 3, 12), (3, 1, 8), (6, 6, 6)), 4: ((4, 2, 12), (4, 1, 8), (8, 4, 6))}
# (window, docs, sinks): test_documents.boundaries variant 0 has a length-1 document, one shorter than
# a chunk and one spanning the rest; variant 1 only short documents; shard = 24 tokens per rank
VARIANTS = ((None, 0, False), (3, 0, True), (29, 1, True), (29, None, False))


def run_cases(rank: int, world: int, cases: list[dict], ulysses_size: int | None = None) -> list[list[torch.Tensor]]:
    """Worker: the (Ulysses x ring) groups for hybrid cases, then test_documents' worker."""
    if ulysses_size is not None:
        seqpar.init_process_groups(sp_size=world, ulysses_size=ulysses_size)
    return _run_cases(rank, world, cases)


def _cases(world: int, mode: str, shardings: tuple[str, ...], u: int, seed: int) -> list[dict]:
    cases = []
    for i, (sharding, causal, (window, docs, sinks)) in enumerate(
        itertools.product(shardings, (False, True), VARIANTS)
    ):
        cases.append(make_case(seed + i, world, HEADS[u][i % len(HEADS[u])], mode=mode, sharding=sharding,
                               causal=causal, window=window, docs=docs, sinks=sinks))
    return cases


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ulysses_documents_windows_sinks_exact(dist_pool, world: int) -> None:
    cases = _cases(world, "ulysses", ("contiguous", "zigzag", "balanced"), world, 3000 + 100 * world)
    check(dist_pool.run(world, run_cases, cases, timeout=300), cases, world)


def test_hybrid_documents_windows_sinks_exact(dist_pool) -> None:
    """P = 4 as 2 x 2: the masked ring across the two super-ranks (its hop plan included)."""
    cases = _cases(4, "hybrid", ("contiguous", "zigzag"), 2, 3900)
    check(dist_pool.run(4, run_cases, cases, 2, timeout=300), cases, 4)


def run_cases_in(rank: int, world: int, cases: list[dict], dtype: torch.dtype,
                 ulysses_size: int | None = None) -> list[list[torch.Tensor]]:
    """:func:`run_cases` in ``dtype`` (the inputs rounded from the float64 case)."""
    cast = [{**c, **{n: c[n].to(dtype) for n in ("q", "k", "v", "dout")}} for c in cases]
    return run_cases(rank, world, cast, ulysses_size)


@pytest.mark.parametrize("mode, u", [("ulysses", None), ("hybrid", 2)])
def test_bf16_documents_no_worse_than_sdpa(dist_pool, mode: str, u: int | None) -> None:
    """bf16 at P = 4 with documents and a window, causal or not: norm-relative error vs the float64
    reference within twice single-process bf16 SDPA's own with the same mask."""
    world, dtype = 4, torch.bfloat16
    shardings = ("zigzag", "balanced") if mode == "ulysses" else ("zigzag", "contiguous")
    cases = [make_case(3950 + i, world, (4, 2, 16), mode=mode, sharding=sharding, causal=causal, window=13,
                       docs=i % 2, sinks=False)
             for i, (sharding, causal) in enumerate(itertools.product(shardings, (False, True)))]
    check_low_precision(dist_pool.run(world, run_cases_in, cases, dtype, u, timeout=300), cases, world, dtype)


def _hybrid_ring_bytes(rank: int, world: int, cu: list[int]) -> int:
    """Bytes this rank sends over the ring axis (point-to-point) in one causal hybrid forward + backward."""
    import torch.distributed as dist

    seqpar.init_process_groups(sp_size=world, ulysses_size=2)
    sent = [0]
    original = dist.batch_isend_irecv

    def p2p(ops):  # noqa: ANN001, ANN202
        sent[0] += sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
        return original(ops)

    torch.manual_seed(rank)
    q, k, v = (torch.randn(1, 4, 8, 8, requires_grad=True) for _ in range(3))
    dist.batch_isend_irecv = p2p
    try:
        out = seqpar.attention(q, k, v, causal=True, mode="hybrid", cu_seqlens=torch.tensor(cu))
        out.backward(torch.randn_like(out))
    finally:
        dist.batch_isend_irecv = original
    return sent[0]


def test_hybrid_ring_sends_only_what_is_seen(dist_pool) -> None:
    """P = 4 as 2 x 2, contiguous, causal, S = 32: super-rank 0 holds [0, 16). Documents that stop at 16:
    no super-rank sees the other's keys, so the ring axis sends nothing; a document across 16: super-rank
    0's block makes its one hop (K and V, in the forward and again in the backward) and its dK/dV
    accumulator comes home from super-rank 1; super-rank 1's block travels nowhere."""
    assert dist_pool.run(4, _hybrid_ring_bytes, [0, 5, 16, 20, 32], timeout=60) == [0] * 4
    block = 4 * 16 * 8 * 2  # one K/V tensor of a super-rank: 2 heads per Ulysses rank, 16 rows, head_dim 8, fp32
    sent = dist_pool.run(4, _hybrid_ring_bytes, [0, 5, 20, 32], timeout=60)
    assert sent == [2 * 2 * block, 2 * 2 * block, 2 * block, 2 * block], sent


def _hybrid_balanced(rank: int, world: int) -> str | None:
    seqpar.init_process_groups(sp_size=world, ulysses_size=2)
    q = torch.randn(1, 4, 16, 8)
    try:
        seqpar.attention(q, q, q, causal=True, mode="hybrid", sharding="balanced",
                         cu_seqlens=torch.tensor([0, 5, 64]))
    except ValueError as e:
        return str(e)
    return None


def test_hybrid_refuses_balanced_on_every_rank(dist_pool) -> None:
    for rank, msg in enumerate(dist_pool.run(4, _hybrid_balanced, timeout=60)):
        assert msg is not None, f"rank {rank} did not raise"
        assert "sharding='balanced'" in msg and "zigzag" in msg and "ulysses" in msg, msg


def test_auto_may_pick_ulysses_and_hybrid_for_masked_calls() -> None:
    """Llama-3-8B heads (32 / 8), causal, default links: the modes auto ranks first for dense calls stay
    first with documents, a window and sinks; with the balanced sharding hybrid drops out (refused)."""
    for p, u, best in ((8, 8, "ulysses"), (16, 8, "hybrid")):
        c = CallShape(1, 32, 8, 32768 // p, 128, 2, True, p, u)
        assert rank_modes(c, Links())[0].mode == best
        assert rank_modes(c, Links(), ("documents", "window", "sinks"))[0].mode == best
        ranked = [m.mode for m in rank_modes(c, Links(), ("documents", "balanced"))]
        assert ranked[0] == "ulysses" and "hybrid" not in ranked, ranked
    assert "balanced" not in MODE_FEATURES["hybrid"]
