"""The all-gather's memory estimate under documents, windows, chunked attention and sinks (seqpar.memory.attention.
_masked_allgather_peak: the dense moments of the gathers, the fp32 dK/dV slots of all ranks and the scatters in
flight, with each K/V block's kernel transients replayed by seqpar.memory.masked.allgather_block_peaks) against the
largest rank's measured peak (MemTracker, exact CPU tensor accounting, the lowest of 3 steps; measured as
tests/test_memory_masks.py measures). Until session 28 the estimate refused masks and sinks with the all-gather.
head_dim 16, 8 / 8 heads, batch 1, head_chunks 1 unless a case's shape says otherwise.

Measured (2-core VM), bytes; every estimate is the measured peak to the byte: causal documents 1712128, full
documents 1708032, causal window 48 1712096, bf16 full window 48 1544192, bf16 causal chunk 80 with 2 head chunks
1085440, P = 2 causal sinks 2367520, bf16 full documents + sinks 8 / 2 512016, causal window 64 with 2 head chunks
1427696, P = 2 full chunk 96 8 / 2 batch 2 2813952, bf16 causal window 48 MQA 415744, P = 2 causal short documents
MQA S = 256 430080.
"""

from __future__ import annotations

import pytest
from test_memory_masks import DOCS, masked_estimate, measure_masked_peak

# (id, world, seq_len, dtype, causal, masks); masks may carry "shape": (batch, q_heads, kv_heads, head_chunks)
CASES = [
    ("P4_fp32_causal_docs", 4, 512, "float32", True, {"cu_seqlens": DOCS}),
    ("P4_fp32_full_docs", 4, 512, "float32", False, {"cu_seqlens": DOCS}),
    ("P4_fp32_causal_window", 4, 512, "float32", True, {"window": 48}),
    ("P4_bf16_full_window", 4, 512, "bfloat16", False, {"window": 48}),
    ("P4_bf16_causal_chunked_hc2", 4, 512, "bfloat16", True, {"chunk_size": 80, "shape": (1, 8, 8, 2)}),
    ("P2_fp32_causal_sinks", 2, 512, "float32", True, {"sinks": True}),
    ("P4_bf16_full_docs_sinks_gqa", 4, 512, "bfloat16", False, {"cu_seqlens": DOCS, "sinks": True, "shape": (1, 8, 2, 1)}),
    ("P4_fp32_causal_window_hc2", 4, 512, "float32", True, {"window": 64, "shape": (1, 8, 8, 2)}),
    ("P2_fp32_full_chunked_gqa_b2", 2, 512, "float32", False, {"chunk_size": 96, "shape": (2, 8, 2, 1)}),
    ("P4_bf16_causal_window_mqa", 4, 512, "bfloat16", True, {"window": 48, "shape": (1, 8, 1, 1)}),
    ("P2_fp32_causal_docs_mqa_s256", 2, 256, "float32", True,
     {"cu_seqlens": (0, 43, 123, 256), "shape": (1, 8, 1, 1)}),
]


@pytest.mark.parametrize("world,seq_len,dtype,causal,masks", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_masked_allgather_estimate_is_the_measured_peak(dist_pool, world: int, seq_len: int, dtype: str,  # noqa: ANN001
                                                        causal: bool, masks: dict) -> None:
    """Every case is exact to the byte; held to 0 .. +1% (never under), as the ring's masked cases are.

    Seen failing: the dense kernel terms kept (one call's dq, dk, dv per block, no replay): P2_fp32_full_chunked_gqa_b2
    -24.9%, P4_bf16_causal_window_mqa -18.2%, P4_fp32_causal_window_hc2 -5.6%, P4_fp32_causal_docs and
    P4_fp32_causal_window -0.24%; the own block's and
    a remote block's transients not told apart (the largest of both at every kernel moment): P4_fp32_causal_docs
    +15.3%, P4_fp32_causal_window +12.4%, P4_fp32_causal_window_hc2 +6.0%. (Not seen failing: the forward's replayed
    pieces and merges, and the sink gradient's moment, each dropped: the backward is the peak in every case; the sink
    logits' own bytes, 16 .. 32, are inside the band.)"""
    peak = max(dist_pool.pools.run(world, measure_masked_peak, seq_len, dtype, causal, None, masks, 0, "allgather",
                                   timeout=600))
    est = masked_estimate(world, seq_len, dtype, causal, None, masks, mode="allgather")
    assert 0 <= est / peak - 1 <= 0.01, (masks, peak, est, est / peak - 1)
