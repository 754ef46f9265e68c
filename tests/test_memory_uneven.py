"""The attention memory estimator on Ulysses with uneven heads (seqpar.memory.attention._ulysses_peak): sized on
the rank with the largest share, with fp32 dK/dV accumulators. Integer arithmetic only, one process; the measured
check is tests/test_bench.py::test_memory_suite_estimator_on_uneven_ulysses_heads (3/1 on 2 ranks only)."""

from __future__ import annotations

import torch

from seqpar.memory.attention import estimate_attention_memory


def _ulysses(heads: int, dtype: torch.dtype) -> int:
    return estimate_attention_memory(4096, world_size=4, mode="ulysses", batch=1, q_heads=heads, kv_heads=heads,
                                     head_dim=16, dtype=dtype, causal=True, head_chunks=1)


def test_uneven_estimate_follows_the_largest_share_and_its_fp32_dkv() -> None:
    """MHA with 5 to 8 heads on 4 Ulysses ranks: the largest share is 2 heads for each (shares 2111, 2211, 2221,
    2222), so in fp32 the head-layout terms do not change and the estimate grows by the same bytes per head (the
    sequence-layout tensors). In bf16 the uneven splits (5-7) hold zeroed fp32 dK/dV that the even 8/8 does not
    (each K/V head is one rank's there): 8 heads need less than 7.

    Seen failing: the smallest share used (``max(s[1] ...)`` / ``max(s[3] ...)`` -> ``min`` in _ulysses_peak: the
    step from 7 to 8 heads 7x the others; the measured 3/1 test passed it), the uneven split's fp32 dK/dV
    dropped (``fp32_dkv = uneven or kv_heads < u`` -> ``kv_heads < u``: 8 heads needed more than 7)."""
    fp32 = [_ulysses(h, torch.float32) for h in (5, 6, 7, 8)]
    steps = {b - a for a, b in zip(fp32, fp32[1:])}
    assert len(steps) == 1 and steps.pop() > 0, fp32
    bf16 = [_ulysses(h, torch.bfloat16) for h in (6, 7, 8)]
    assert bf16[2] < bf16[1] and bf16[1] - bf16[0] > 0, bf16
