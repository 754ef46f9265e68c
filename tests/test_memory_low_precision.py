"""The ring's memory estimate with bf16 inputs (seqpar.memory.attention._ring_backward_moments, also the hybrid's inner
ring) against the largest rank's measured peak (MemTracker), within -2% .. +10% as in fp32 (tests/test_bench.py).

Measured (2-core VM under load), 8 / 8 heads, head_dim 16, ``head_chunks=1``, S = 256 at P = 4, bytes: measured peak,
estimate before -> after: non-causal 428032, 493568 (+15.3%) -> 428032 (+0.0%); causal (zigzag) 419840, 493568
(+17.6%) -> 428032 (+2.0%). The peak is at a remote block's backward kernel: the fp32 accumulators, four bf16 K/V
buffers, the travelling fp32 dK/dV pair out and in, and the kernel's dq, dk, dv in bf16; the estimate also counted
fp32 copies of the kernel's dk, dv (never made for a dense block: dq is added in place, dk, dv are the share) and,
causal, the half block's widened first hop a second time beside the travelling pair it becomes.
"""

from __future__ import annotations

import pytest

from seqpar.memory.attention import estimate_attention_memory


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_ring_bf16_estimate_within_band_of_the_measured_peak(dist_pool, causal: bool) -> None:  # noqa: ANN001
    """Ring, bf16, 8 / 8 heads at P = 4: the estimate within -1% .. +1% of the largest rank's measured peak (exact to
    the byte since session 27, which replays the ring's plan on plain masks too; the closed form was +2.0% causal).

    Seen failing: the estimate before (``kernel_out = Q + 2 K + (2 K32 if low else 0)`` and, causal, ``max(kernel_out,
    2 Kw + Q + K + K32 / 2)``): +15.3% and +17.6%; the closed form of session 25 (``_mask_options`` returning None
    for a plain ring call), causal: +2.0%, out of the -1% .. +1% band."""
    from seqpar.bench.attention import BenchShape
    from seqpar.bench.memory import measure_peak

    shape = BenchShape(batch=1, q_heads=8, kv_heads=8, head_dim=16, dtype="bfloat16", head_chunks=1)
    peak = max(dist_pool.pools.run(4, measure_peak, "ring", 256, causal, shape, 0, timeout=600))
    est = estimate_attention_memory(256, world_size=4, mode="ring", batch=1, q_heads=8, kv_heads=8, head_dim=16,
                                    dtype="bfloat16", causal=causal, head_chunks=1)
    assert -0.01 <= est / peak - 1 <= 0.01, (causal, peak, est, est / peak - 1)
