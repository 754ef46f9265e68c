"""The hybrid attention's memory estimate (seqpar.memory.attention, the hybrid's inner ring on one head chunk's
head-layout tensors) against the largest rank's measured peak (MemTracker: exact CPU tensor accounting), in the cases
tests/test_memory_hybrid.py and tests/test_bench.py do not reach: bf16 inputs (the inner ring's final casts, and the
wire dtype's dK/dV), a K/V head replicated over the Ulysses pair (4 / 1 heads: the head-layout K twice K), a GQA
split run as several pieces per rank in fp32 (12 / 3) and four head chunks. The band is never under .. +10% over
(the others' -2% lower edge let terms worth 1-2% go: an estimate users size jobs by must not be under).

Measured (2-core VM under load), P = 4 (u = 2, a ring of 2), head_dim 16, S = 256, non-causal, bytes, measured peak
and estimate: 8 / 8 bf16 526336, 528384 (+0.4%); 4 / 1 bf16 168960, 169984 (+0.6%); 12 / 3 fp32 601088, 604160
(+0.5%); 8 / 8 fp32 ``head_chunks=4`` 542720, 544768 (+0.4%); 7 / 7 fp32 auto chunks 632832 (tests/test_bench.py),
+0.3%.
"""

from __future__ import annotations

import pytest

from seqpar.memory.attention import estimate_attention_memory

CASES = [(8, 8, "bfloat16", 1), (4, 1, "bfloat16", 1), (12, 3, "float32", 1), (8, 8, "float32", 4),
         (7, 7, "float32", "auto")]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("q_heads,kv_heads,dtype,head_chunks", CASES,
                         ids=["8_8_bf16", "4_1_bf16_replicated_kv", "12_3_pieces", "8_8_hc4", "7_7_uneven"])
def test_hybrid_estimate_is_never_under_the_measured_peak(dist_pool, q_heads: int, kv_heads: int, dtype: str,  # noqa: ANN001
                                                          head_chunks) -> None:
    """The 2 x 2 hybrid at P = 4: the estimate at least the largest rank's measured peak and at most 10% over.

    Seen failing (each estimate under the peak): the inner ring's final casts of its fp32 accumulators dropped for
    low-precision inputs (``convert = 0``: 8 / 8 bf16 -8.9%, 4 / 1 bf16 -8.3%); the travelling dK/dV of one chunk not
    scaled to the head layout (``Kw=sizes.Kw / G``: 4 / 1 -8.3%); the replicated K/V head's fp32 dK/dV taken in the
    input dtype (``fp32_dkv = uneven``: 4 / 1 -1.8%); the several pieces' send moment counting one concatenation
    (``3 if _pieces(...) > 1 else 2`` -> ``2``: 12 / 3 -3.6%); only the last head chunk's moments (``{G - 1}``: 8 / 8
    ``head_chunks=4`` -1.1%); an uneven split's busiest rank without its head-layout dout (7 / 7 -1.0%)."""
    from seqpar.bench.attention import BenchShape
    from seqpar.bench.memory import measure_peak

    shape = BenchShape(batch=1, q_heads=q_heads, kv_heads=kv_heads, head_dim=16, dtype=dtype, head_chunks=head_chunks)
    peak = max(dist_pool.pools.run(4, measure_peak, "hybrid", 256, False, shape, 0, timeout=540))
    est = estimate_attention_memory(256, world_size=4, mode="hybrid", batch=1, q_heads=q_heads, kv_heads=kv_heads,
                                    head_dim=16, dtype=dtype, causal=False, head_chunks=head_chunks, ulysses_size=2)
    assert 0 <= est / peak - 1 <= 0.10, (q_heads, kv_heads, dtype, head_chunks, peak, est, est / peak - 1)
