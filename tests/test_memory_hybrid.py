"""The hybrid attention's memory estimate (seqpar.memory.attention._hybrid_peak) against the measured peak of the
largest rank (MemTracker: exact CPU tensor accounting, the lowest of 3 steps), within -2% .. +10% like the Ulysses
and ring estimates (tests/test_bench.py): an estimate users size jobs by must never be under, and one 10% over
leaves a tenth of the memory unused. Cases the 2 x 2 test in test_bench.py does not reach: GQA (the inner ring's
travelling dK/dV at a ring of 2), two head chunks (the neighbouring chunks' all-to-alls), a ring of 4 super-ranks
(P = 8) and an uneven GQA split run as two pieces.

Measured (2-core VM under load), fp32, head_dim 16, non-causal, bytes: measured peak, estimate before -> after
this session's model:

- P = 4, 8 / 2 heads, auto chunks (1): 395264, 446464 (+13.0%) -> 397312 (+0.5%)
- P = 4, 8 / 8 heads, ``head_chunks=2``: 657408, 724992 (+10.3%) -> 659456 (+0.3%)
- P = 8 (a ring of 4), 8 / 8, ``head_chunks=1``, S = 512: 886784, 856064 (-3.5%, under) -> 888832 (+0.2%)
- P = 4, 6 / 3 heads (uneven: two GQA pieces on each rank): 378368, 420864 (+11.2%) -> 379904 (+0.4%)
"""

from __future__ import annotations

import pytest

from seqpar.memory.attention import estimate_attention_memory

CASES = [(4, 256, 8, 2, "auto"), (4, 256, 8, 8, 2), (8, 512, 8, 8, 1), (4, 256, 6, 3, "auto")]


@pytest.mark.parametrize("world,seq_len,q_heads,kv_heads,head_chunks", CASES,
                         ids=["P4_8_2_gqa", "P4_8_8_hc2", "P8_8_8_hc1", "P4_6_3_uneven_pieces"])
def test_hybrid_estimate_within_band_of_the_measured_peak(dist_pool, world: int, seq_len: int, q_heads: int,  # noqa: ANN001
                                                          kv_heads: int, head_chunks) -> None:
    """The (P/2) x 2 hybrid (Ulysses pairs, a ring of P/2 super-ranks): the estimate within -2% .. +10% of the
    largest rank's measured peak. The peaks, read storage by storage (``TensorMemoryTracker(record_peak=True)``):
    GQA 8 / 2 at the inner ring's remote kernel (its fp32 accumulators, the kernel's dq/dk/dv, one K/V buffer: a
    ring of 2 has no travelling dK/dV at the kernel); ``head_chunks=2`` at the last chunk's ring, the previous
    chunk's dq/dk/dv all-to-all in flight and no next dout's; P = 8 at a remote kernel with the accumulators, the
    kernel's outputs, four K/V buffers and the travelling dK/dV pair; 6 / 3 at sending the grads back (the pieces'
    dq/dk/dv, their concatenation, the packed send buffer, and dout's all-to-all send buffer, which gloo's worker
    thread frees late).

    Seen failing: the estimate before (the inner ring's travelling dK/dV counted at a ring of 2, a ~2 Q kernel
    workspace and both neighbours' all-to-alls at every chunk; the kernel's outputs not counted beside the ring's
    accumulators; an uneven split's inner ring over its whole share with the earlier pieces' outputs): P4_8_2_gqa
    +13.0%, P4_8_8_hc2 +10.3%, P4_6_3_uneven_pieces +11.2% (over) and P8_8_8_hc1 -3.5% (under)."""
    from seqpar.bench.attention import BenchShape
    from seqpar.bench.memory import measure_peak

    shape = BenchShape(batch=1, q_heads=q_heads, kv_heads=kv_heads, head_dim=16, dtype="float32",
                       head_chunks=head_chunks)
    peak = max(dist_pool.pools.run(world, measure_peak, "hybrid", seq_len, False, shape, 0, timeout=600))
    est = estimate_attention_memory(seq_len, world_size=world, mode="hybrid", batch=1, q_heads=q_heads,
                                    kv_heads=kv_heads, head_dim=16, causal=False, head_chunks=head_chunks,
                                    ulysses_size=2)
    assert -0.02 <= est / peak - 1 <= 0.10, (world, q_heads, kv_heads, head_chunks, peak, est, est / peak - 1)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_uneven_hybrid_counts_the_earlier_pieces(dist_pool, dtype: str) -> None:  # noqa: ANN001
    """The uneven 6 / 3 hybrid at P = 4 (u = 2: each rank runs two GQA pieces, one inner ring of 2 each, in turn): the
    estimate at least the largest rank's measured peak and at most 3% over. In bf16 the peak is the inner backward
    of the second piece beside the first piece's dq/dk/dv; the estimate was +9.1% over (238464 against 218624),
    from a forward moment counting one inner ring over the whole head share, so dropping the earlier pieces'
    dq/dk/dv stayed in the band (audit 26's survivor A13). Both inner rings, forward and backward, are replayed
    piece by piece now: 220160 (+0.7%); fp32 379904 against 378368 (+0.4%).

    Seen failing: the earlier pieces' dq/dk/dv (and, forward, out and lse) dropped (``done += 0`` in
    ``_uneven_inner_backward``): bf16 212736, -2.7%; the estimate before (the whole share's closed-form forward):
    bf16 +9.1%."""
    from seqpar.bench.attention import BenchShape
    from seqpar.bench.memory import measure_peak

    shape = BenchShape(batch=1, q_heads=6, kv_heads=3, head_dim=16, dtype=dtype, head_chunks=1)
    peak = max(dist_pool.pools.run(4, measure_peak, "hybrid", 256, False, shape, 0, timeout=540))
    est = estimate_attention_memory(256, world_size=4, mode="hybrid", batch=1, q_heads=6, kv_heads=3, head_dim=16,
                                    dtype=dtype, causal=False, head_chunks=1, ulysses_size=2)
    assert 0 <= est / peak - 1 <= 0.03, (dtype, peak, est, est / peak - 1)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world,seq_len,q_heads,kv_heads,head_chunks,dtype",
                         [(4, 256, 8, 8, 1, "float32"), (4, 256, 8, 2, "auto", "float32"), (8, 512, 8, 8, 1, "float32"),
                          (4, 256, 8, 8, 2, "bfloat16")],
                         ids=["P4_8_8_hc1", "P4_8_2_gqa", "P8_8_8_hc1", "P4_8_8_hc2_bf16"])
def test_causal_hybrid_estimate_is_the_measured_peak(dist_pool, world: int, seq_len: int, q_heads: int,  # noqa: ANN001
                                                     kv_heads: int, head_chunks, dtype: str) -> None:
    """Causal (zigzag over the super-ranks) hybrids, u = 2: the estimate at least the largest rank's measured peak
    and at most 1% over. The even split's inner ring is replayed as the ring's own estimate is (session 27).
    Measured (2-core VM), bytes, estimate: P4_8_8_hc1 722944, +0.3%; P4_8_2_gqa 395264, +0.5%; P8_8_8_hc1 870400,
    +0.2% (the closed-form inner ring: 888832, +2.1%); P4_8_8_hc2_bf16 411648, +0.5%.

    Seen failing: the closed-form inner ring (``_ring_backward_moments`` for the even split, the estimate before
    session 27): P8_8_8_hc1 +2.1%."""
    from seqpar.bench.attention import BenchShape
    from seqpar.bench.memory import measure_peak

    shape = BenchShape(batch=1, q_heads=q_heads, kv_heads=kv_heads, head_dim=16, dtype=dtype, head_chunks=head_chunks)
    peak = max(dist_pool.pools.run(world, measure_peak, "hybrid", seq_len, True, shape, 0, timeout=540))
    est = estimate_attention_memory(seq_len, world_size=world, mode="hybrid", batch=1, q_heads=q_heads,
                                    kv_heads=kv_heads, head_dim=16, dtype=dtype, causal=True, head_chunks=head_chunks,
                                    ulysses_size=2)
    assert 0 <= est / peak - 1 <= 0.01, (world, q_heads, kv_heads, head_chunks, dtype, peak, est, est / peak - 1)
