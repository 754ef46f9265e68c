"""The attention memory estimator on Ulysses with uneven heads (seqpar.memory.attention._ulysses_peak): sized on
the rank with the largest share, with fp32 dK/dV accumulators. Integer arithmetic only, one process; the measured
checks are tests/test_bench.py::test_memory_suite_estimator_on_uneven_ulysses_heads (3/1 on 2 ranks) and
test_memory_estimator_ulysses_tight (7/7 and 8/8 on 4 ranks, within -2% .. +10%)."""

from __future__ import annotations

import torch

from seqpar.memory.attention import estimate_attention_memory


def _ulysses(heads: int, dtype: torch.dtype, seq_len: int = 4096) -> int:
    return estimate_attention_memory(seq_len, world_size=4, mode="ulysses", batch=1, q_heads=heads, kv_heads=heads,
                                     head_dim=16, dtype=dtype, causal=True, head_chunks=1)


def test_uneven_estimate_follows_the_largest_share_and_its_fp32_dkv() -> None:
    """MHA with 5 to 7 heads on 4 Ulysses ranks: the largest share is 2 heads for each (shares 2111, 2211, 2221),
    so in fp32 the head-layout terms do not change and the estimate grows by the same bytes per head (the
    sequence-layout tensors). The even 8 / 8 runs the even path (no fp32 dK/dV; its peak the start of the
    grads' return all-to-all): its estimate is the live set counted off the measured peak's storages (P = 4,
    S = 256: 21 Q + lse, 690176 bytes) plus the base's sequence-layout lse, 21 Q + 2 lse, here Q = 1024 rows x
    8 heads x 16 x 4 bytes. 7 / 7 at S = 256 is not below its measured peaks (the largest rank's, MemTracker,
    ``python -m seqpar.bench memory --tiny --q-heads 7 --kv-heads 7 --worlds 4 --seq-lens 256 --head-chunks 1
    [--dtype bfloat16]``: 575488 bytes in fp32, 331776 in bf16, which holds the zeroed fp32 dK/dV).

    Seen failing: the smallest share used (``max(s[1] ...)`` / ``max(s[3] ...)`` -> ``min`` in _ulysses_peak: 7/7
    under both measured peaks, 428800 bytes in fp32; the measured 3/1 test passed it), the uneven split's fp32
    dK/dV dropped (``fp32_dkv = uneven or kv_heads < u`` -> ``kv_heads < u``: bf16 7/7 5% under its measured
    peak), the even path's send moment left out (``max(at_kernel, at_place, at_send)`` -> ``max(at_kernel,
    at_place)``: 8/8 1.5 Q under its hand count). (This test asserted that bf16 8 / 8 needs less than 7 / 7;
    measured at P = 4, S = 256 it needs more: 346112 bytes against 331776.)"""
    fp32 = [_ulysses(h, torch.float32) for h in (5, 6, 7)]
    steps = {b - a for a, b in zip(fp32, fp32[1:])}
    assert len(steps) == 1 and steps.pop() > 0, fp32
    q, lse = 1024 * 8 * 16 * 4, 1024 * 8 * 4
    assert _ulysses(8, torch.float32) == 21 * q + 2 * lse
    assert _ulysses(7, torch.float32, 256) >= 575488 and _ulysses(7, torch.bfloat16, 256) >= 331776
