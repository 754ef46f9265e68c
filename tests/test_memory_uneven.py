"""The attention memory estimator on Ulysses with uneven heads (seqpar.memory.attention._ulysses_peak): the largest
of each rank's own peak (its query and K/V shares), with fp32 dK/dV accumulators. The first test is integer
arithmetic, one process; test_uneven_estimate_is_each_ranks_own_peak measures 11 splits (0 .. +1%), and
tests/test_bench.py::test_memory_suite_estimator_on_uneven_ulysses_heads (3/1 on 2 ranks) and
test_memory_estimator_ulysses_tight (7/7 and 8/8 on 4 ranks, within -2% .. +10%) measure through the bench."""

from __future__ import annotations

import pytest
import torch
from test_memory_masks import DOCS

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
    8 heads x 16 x 4 bytes. 7 / 7 at S = 256 is not below its measured peaks, and fp32 within 0.5% of it (the largest rank's, MemTracker,
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
    # since est28b (per rank, _uneven_backward's own moments) 577280 (+0.31%) and 347904 (+4.86%); 626432 (+8.85%)
    # and 343808 (+3.63%) before; bf16 333568 (+0.54%) since est29 (dout's send buffer gone by the dK/dV casts)
    assert 575488 <= _ulysses(7, torch.float32, 256) <= 1.005 * 575488
    assert 331776 <= _ulysses(7, torch.bfloat16, 256) <= 1.01 * 331776


# (id, world, seq_len, dtype, causal, masks) as tests/test_memory_masks.py measures them; head_dim 16, batch 1, one
# head pass (an uneven split runs one)
MEASURED = [
    ("P4_fp32_causal_6_6", 4, 512, "float32", True, {"shape": (1, 6, 6, 1)}),
    ("P4_bf16_causal_6_6", 4, 512, "bfloat16", True, {"shape": (1, 6, 6, 1)}),
    ("P4_fp32_full_7_7_s256", 4, 256, "float32", False, {"shape": (1, 7, 7, 1)}),
    ("P4_bf16_full_7_7_s256", 4, 256, "bfloat16", False, {"shape": (1, 7, 7, 1)}),
    ("P4_fp32_causal_9_3", 4, 512, "float32", True, {"shape": (1, 9, 3, 1)}),
    ("P4_fp32_causal_docs_9_3", 4, 512, "float32", True, {"cu_seqlens": DOCS, "shape": (1, 9, 3, 1)}),
    ("P4_fp32_causal_6_3", 4, 512, "float32", True, {"shape": (1, 6, 3, 1)}),
    ("P4_fp32_causal_10_5", 4, 512, "float32", True, {"shape": (1, 10, 5, 1)}),
    ("P4_bf16_causal_6_2", 4, 512, "bfloat16", True, {"shape": (1, 6, 2, 1)}),
    ("P4_fp32_causal_5_5", 4, 512, "float32", True, {"shape": (1, 5, 5, 1)}),
    ("P2_fp32_full_3_1_s256", 2, 256, "float32", False, {"shape": (1, 3, 1, 1)}),
]


@pytest.mark.parametrize("world,seq_len,dtype,causal,masks", [c[1:] for c in MEASURED], ids=[c[0] for c in MEASURED])
def test_uneven_estimate_is_each_ranks_own_peak(dist_pool, world: int, seq_len: int, dtype: str, causal: bool,  # noqa: ANN001
                                                masks: dict) -> None:
    """The uneven split sized per rank, on its own query and K/V shares (the largest query share and the largest K/V
    share can sit on different ranks: 9 / 3 over 4 puts 3 query heads on rank 0 and 2 K/V heads on rank 2), with
    _uneven_backward's moments (recorded at the peak: dout's send buffer still held; placing, the packed send buffer
    beside the sequence-layout receive buffer and dq with the zeroed fp32 dK/dV; packing, 2 or more GQA pieces:
    the pieces' dq/dk/dv, their concatenation and the send buffer; low precision, the casts of dK/dV, by which
    dout's send buffer is gone): within 0 .. +1% of the largest rank's measured peak, never under. fp32 is +0.3% ..
    +0.4%, bf16 +0.5% .. +0.6% (the sequence-layout lse the base counts, relatively larger beside bf16 tensors).

    Measured (2-core VM), bytes, estimate before -> after: 6 / 6 fp32 1052672, +12.74% -> +0.29%; bf16 602112,
    +7.31% -> +4.59%; 7 / 7 fp32 575488, +8.85% -> +0.31%; bf16 331776, +3.63% -> +4.86%; 9 / 3 (dense and
    documents) 1200128, +10.11% -> +0.38%; 6 / 3 790528, +4.53% -> +0.39%; 10 / 5 1431552, -0.79% -> +0.36%;
    6 / 2 bf16 544768, +0.56% -> +0.56%; 5 / 5 954368, +17.44% -> +0.27%; 3 / 1 P = 2 378880, +4.73% -> +0.41%.
    est29: bf16 6 / 6 +4.59% -> +0.51% and 7 / 7 +4.86% -> +0.54% (recorded at the peak, TensorMemoryTracker
    record_peak: fp32's is at the zeroing of dK/dV with dout's send buffer alive, bf16's at their casts without it;
    the estimate counted both together); 6 / 2 bf16 keeps +0.56% (its K/V casts, 2 K, are smaller than the send
    buffer, Q: its peak is the zeroing's).

    Seen failing: the estimate before (the largest query share and the largest K/V share together, the even
    path's grads-back moments): 7 of 11 cases out of the band (6 over +5%, 10 / 5 under -0.79%), and the 7 / 7 pins
    above; the largest shares together with the new moments (the per-rank ``max`` skipped): 9 / 3 +14.2%, both; dout's
    send buffer left out: 9 of 11 under, -3.9% to -6.1%; the concatenation left out (2 grads_h at packing with two
    pieces): 9 / 3, 10 / 5 and 6 / 2 under, -7.7% to -10.0%; est29's band (+1%) on the placing moment before it
    (dout's send buffer counted beside the casts): 6 / 6 bf16 +4.59% and 7 / 7 bf16 +4.86%, and the 7 / 7 pin."""
    from test_memory_masks import masked_estimate, measure_masked_peak

    peak = max(dist_pool.pools.run(world, measure_masked_peak, seq_len, dtype, causal, None, masks, 0, "ulysses",
                                   timeout=600))
    est = masked_estimate(world, seq_len, dtype, causal, None, masks, mode="ulysses")
    assert 0 <= est / peak - 1 <= 0.01, (masks, peak, est, est / peak - 1)
