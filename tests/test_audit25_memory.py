"""Audit 25: session 24's memory estimate terms (the Ulysses send moment, the ring's forward merge in fp64) held to the
measured peak.

``test_bench.py``'s estimator tests allow -2% .. +10% (the uneven and hybrid paths over-count by design); the even
Ulysses path is +0.3% of the measured peak there, so a term counted at the wrong number of head passes hides inside
that band. Here the even path at two head passes is held to +2%.
"""

from __future__ import annotations

import pytest

from seqpar.memory.attention import estimate_attention_memory


@pytest.mark.timeout(600)
def test_ulysses_estimate_at_two_head_passes_is_the_measured_peak(dist_pool) -> None:
    """Plain Ulysses, P = 4, 8 / 8 heads (2 K/V heads a rank), ``head_chunks=2``, fp32, head_dim 16, S = 256,
    non-causal: the estimate within -2% .. +2% of the largest rank's measured peak (MemTracker; 641024 bytes
    measured, estimate 643072, +0.3%). With two passes the send moment holds the previous pass's grads in flight
    but no next pass's dout all-to-all. Seen failing: ``_ulysses_peak``'s ``at_send`` counting the next pass's dout
    all-to-all from G > 1 instead of G > 2 (675840, +5.4%, inside test_bench's +10% band)."""
    from seqpar.bench.attention import BenchShape
    from seqpar.bench.memory import measure_peak

    shape = BenchShape(batch=1, q_heads=8, kv_heads=8, head_dim=16, dtype="float32", head_chunks=2)
    peak = max(dist_pool.pools.run(4, measure_peak, "seqpar_ulysses", 256, False, shape, 0))
    est = estimate_attention_memory(256, world_size=4, mode="ulysses", batch=1, q_heads=8, kv_heads=8, head_dim=16,
                                    causal=False, head_chunks=2)
    assert -0.02 <= est / peak - 1 <= 0.02, (peak, est, est / peak - 1)


@pytest.mark.timeout(600)
def test_ring_estimate_with_float64_inputs_is_the_measured_peak(dist_pool) -> None:
    """The ring with MQA (8 / 1 heads), P = 4, float64 inputs, head_dim 16, S = 64, non-causal, one head pass: the
    forward merge is the peak, and with fp64 accumulators the CPU merge upcasts nothing (the accumulator and the
    block are fp64 already) and keeps fewer lse temporaries. The estimate within -2% .. +10% of the largest rank's
    measured peak (MemTracker; 111616 bytes measured and estimated). Seen failing: ``estimate_attention_memory``
    passing ``acc_bytes=4`` to the ring whatever the dtype (fp32's fp64 pieces counted: 153856, +38%); test_bench's
    ring tests are fp32 only."""
    from seqpar.bench.attention import BenchShape
    from seqpar.bench.memory import measure_peak

    shape = BenchShape(batch=1, q_heads=8, kv_heads=1, head_dim=16, dtype="float64", head_chunks=1)
    peak = max(dist_pool.pools.run(4, measure_peak, "ring", 64, False, shape, 0))
    est = estimate_attention_memory(64, world_size=4, mode="ring", batch=1, q_heads=8, kv_heads=1, head_dim=16,
                                    causal=False, head_chunks=1, dtype="float64")
    assert -0.02 <= est / peak - 1 <= 0.10, (peak, est, est / peak - 1)
