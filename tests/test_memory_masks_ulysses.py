"""Ulysses' memory estimate with sinks and with an uneven head split under a mask (seqpar.memory.attention.
_ulysses_peak: the inner attention at P = 1 replayed by seqpar.memory.masked, one GQA piece after another when the
split is uneven) against the largest rank's measured peak (MemTracker, exact CPU tensor accounting, the lowest of 3
steps; measured as tests/test_memory_masks.py measures). Until session 28 the estimate refused both by name. head_dim
16, batch 1, head_chunks 1 unless a case's shape says otherwise.

Measured (2-core VM), bytes, and the estimate:

- sinks, even split: P = 4 fp32 causal 1380416 +0.30%; P = 4 bf16 full 692256 +0.59%; P = 2 fp32 causal, 2 head
  chunks 2564160 +0.32%; P = 4 bf16 causal window 48 990104 +0.41%; P = 2 bf16 full window 40, 2 head chunks 1553960
  +0.53% (+4.74% until est29b: the next chunk's dout all-to-all counted at the last chunk); P = 4 fp32 causal chunk 96, 8 / 4 heads 1171264 +0.35%; P = 4 bf16 causal documents, MQA 491552 +0.00% (+0.83% until est30: the sequence-layout lse at sink_grad)
- uneven split under a mask: P = 4 fp32 causal window 48, 6 / 6 heads 1543224 +0.20%; bf16 full documents 6 / 6
  610304 +0.50% (+5.87% until est28b sized an uneven split per rank, +3.19% until est29); fp32 causal chunk 96, 6 / 3 1023744 +0.30%;
  bf16 causal window 64, 6 / 3 681160 +0.45%; fp32 causal documents + window 64 + sinks, 6 / 6 1250832 +0.25%; bf16
  causal window 64 + sinks, 6 / 6, head_chunks=2 (an uneven split runs one pass) 889632 +0.35%; P = 2 fp32 full
  chunk 80, 3 / 3 1330944 +0.23%; two GQA pieces: fp32 causal window 48, 10 / 5 1626296 +0.31%; bf16 causal chunk
  96, 6 / 2 573184 +0.54% (+6.25% until est28b); bf16 full documents + sinks, 10 / 5 725032 +0.71% (+4.38%, +3.25%)
- three head chunks (P = 2, 6 / 6 heads, one head a chunk on each rank; est30b, for mut30's survivor U2: a middle
  chunk's inner backward has both neighbours' all-to-alls beside it, the previous chunk's packed grads and the next
  chunk's dout): fp32 causal window 48 1938972 +0.32%; bf16 full documents 890880 +0.69%; bf16 full window 40 + sinks
  1008412 +0.61%
"""

from __future__ import annotations

import pytest
from test_memory_masks import DOCS, masked_estimate, measure_masked_peak

# (id, world, seq_len, dtype, causal, masks); masks may carry "shape": (batch, q_heads, kv_heads, head_chunks)
CASES = [
    ("P4_fp32_causal_sinks", 4, 512, "float32", True, {"sinks": True}),
    ("P4_bf16_full_sinks", 4, 512, "bfloat16", False, {"sinks": True}),
    ("P2_fp32_causal_sinks_hc2", 2, 512, "float32", True, {"sinks": True, "shape": (1, 8, 8, 2)}),
    ("P4_bf16_causal_window_sinks", 4, 512, "bfloat16", True, {"window": 48, "sinks": True}),
    ("P2_bf16_full_window_sinks_hc2", 2, 512, "bfloat16", False, {"window": 40, "sinks": True, "shape": (1, 8, 8, 2)}),
    ("P4_fp32_causal_chunked_gqa_sinks", 4, 512, "float32", True,
     {"chunk_size": 96, "sinks": True, "shape": (1, 8, 4, 1)}),
    ("P4_bf16_causal_docs_sinks_mqa", 4, 512, "bfloat16", True, {"cu_seqlens": DOCS, "sinks": True, "shape": (1, 8, 1, 1)}),
    ("P4_fp32_causal_window_6_6", 4, 512, "float32", True, {"window": 48, "shape": (1, 6, 6, 1)}),
    ("P4_bf16_full_docs_6_6", 4, 512, "bfloat16", False, {"cu_seqlens": DOCS, "shape": (1, 6, 6, 1)}),
    ("P4_fp32_causal_chunked_6_3", 4, 512, "float32", True, {"chunk_size": 96, "shape": (1, 6, 3, 1)}),
    ("P4_bf16_causal_window_6_3", 4, 512, "bfloat16", True, {"window": 64, "shape": (1, 6, 3, 1)}),
    ("P4_fp32_causal_docs_window_6_6_sinks", 4, 512, "float32", True,
     {"cu_seqlens": DOCS, "window": 64, "sinks": True, "shape": (1, 6, 6, 1)}),
    ("P4_bf16_causal_window_6_6_sinks_hc2", 4, 512, "bfloat16", True,
     {"window": 64, "sinks": True, "shape": (1, 6, 6, 2)}),
    ("P2_fp32_full_chunked_3_3", 2, 512, "float32", False, {"chunk_size": 80, "shape": (1, 3, 3, 1)}),
    # two GQA pieces on ranks 0 and 1 (a K/V head read partly there): the earlier piece's outputs beside the next
    ("P4_fp32_causal_window_10_5", 4, 512, "float32", True, {"window": 48, "shape": (1, 10, 5, 1)}),
    ("P4_bf16_causal_chunked_6_2", 4, 512, "bfloat16", True, {"chunk_size": 96, "shape": (1, 6, 2, 1)}),
    ("P4_bf16_full_docs_sinks_10_5", 4, 512, "bfloat16", False,
     {"cu_seqlens": DOCS, "sinks": True, "shape": (1, 10, 5, 1)}),
    # three head chunks: a middle chunk has both neighbours' all-to-alls beside its inner backward
    ("P2_fp32_causal_window_hc3", 2, 512, "float32", True, {"window": 48, "shape": (1, 6, 6, 3)}),
    ("P2_bf16_full_docs_hc3", 2, 512, "bfloat16", False, {"cu_seqlens": DOCS, "shape": (1, 6, 6, 3)}),
    ("P2_bf16_full_window_sinks_hc3", 2, 512, "bfloat16", False, {"window": 40, "sinks": True, "shape": (1, 6, 6, 3)}),
]


# cases over the 1% band, and their bands (est29b brought the last one, P2_bf16_full_window_sinks_hc2, from +4.74%
# to +0.53%)
LOOSER: dict[str, float] = {}


@pytest.mark.parametrize("case_id,world,seq_len,dtype,causal,masks", CASES, ids=[c[0] for c in CASES])
def test_ulysses_sinks_and_uneven_masked_estimate_is_never_under(dist_pool, case_id: str, world: int, seq_len: int,  # noqa: ANN001
                                                                 dtype: str, causal: bool, masks: dict) -> None:
    """Sinks with Ulysses (the inner forward runs the ring's planner at P = 1 with the sink merge even on a dense mask;
    the backward's sink_grad before each chunk's inner backward; the sink logits and their zeroed gradient) and an
    uneven head split under a mask (one pass; one inner attention per GQA-regular piece in turn, replayed, the earlier
    pieces' outputs kept; dout's and q/k/v's all-to-all send buffers kept): within 0 .. +1% of the largest rank's
    measured peak, never under (figures in the module docstring; the sinks case at 2 head chunks was +4.74%, 0 .. +5%,
    until est29b counted the neighbouring chunks' all-to-alls of the last chunk only; the band was +7% until est28b sized an uneven split per rank: bf16 causal chunk 96, 6 / 2 +6.25% ->
    +0.54%, bf16 full documents 6 / 6 +5.87% -> +3.19%, bf16 full documents + sinks, 10 / 5 +4.38% -> +3.25%; +5%
    until est29 counted dout's send buffer as gone by the casts of dK/dV: +3.19% -> +0.50%, +3.25% -> +0.71%).

    Seen failing: the uneven split's masked replay dropped (``if masked:`` -> ``if False:`` for the uneven pieces,
    leaving the dense path's kernel moment): 8 of the 10 uneven cases under, -5.1% (documents + window + sinks) to
    -35.2% (bf16 window 64, 6 / 3); the earlier pieces' outputs not kept (``done += 0`` in _uneven_inner_backward):
    P4_fp32_causal_window_10_5 -5.7%; the refusal of sinks with Ulysses restored: the 10 sinks cases raise. (Not seen
    failing: the sink gradient's moment, the sink logits and their gradient, and the forward's sink merge each dropped
    on their own: the peak is at the inner backward's kernel or the dense moments in every measured case, the terms
    add 16 .. 64 bytes; the uneven forward's kept q/k/v send buffer dropped: the backward is the peak.) est29's band
    (+1%) on the placing moment before it (dout's send buffer beside the casts): P4_bf16_full_docs_6_6 +3.19% and
    P4_bf16_full_docs_sinks_10_5 +3.25%. The band at 1% on the estimate before est29b (both neighbours' all-to-alls
    beside each of 2 chunks): P2_bf16_full_window_sinks_hc2 +4.74%. The next chunk's dout all-to-all (send + receive)
    not counted at a middle chunk (``beside`` without ``2 Qh`` for G > 2, mut30's U2): the three 3-chunk cases under,
    -3.06% (fp32 causal window), -1.15% (bf16 full documents), -2.64% (bf16 full window + sinks)."""
    peak = max(dist_pool.pools.run(world, measure_masked_peak, seq_len, dtype, causal, None, masks, 0, "ulysses",
                                   timeout=600))
    est = masked_estimate(world, seq_len, dtype, causal, None, masks, mode="ulysses")
    band = LOOSER.get(case_id, 0.01)
    assert 0 <= est / peak - 1 <= band, (masks, peak, est, est / peak - 1)


def test_sink_grad_moment_is_the_recorded_peak() -> None:
    """P = 4 bf16 causal documents + sinks, 8 / 1 heads (``P4_bf16_causal_docs_sinks_mqa``): the measured peak
    (491,552 bytes on every rank, lowest of 3 runs; est30's TensorMemoryTracker ``record_peak``) is sink_grad's
    multiply: p (lse-sized), dout's and out's fp32 upcasts and their product (3 x 65,536 + 4,096) beside q, dout, out,
    k, v in head layout, the head layout's lse, the inputs, the output, dq and the fp32 dK/dV (kv_heads < P), and the
    sink logits and their gradient. No sequence-layout lse: Ulysses' lse is the head layout's. The estimate is that
    moment, to the byte.

    Seen failing: the estimate before (the sink moment beside the sequence-layout lse ``base`` counts): 495,648 bytes,
    +0.83%. (Not seen failing: the sink moment zeroed, audit 29's survivor E12: the inner kernel's moment models the
    same 491,552 bytes.)"""
    case = next(c for c in CASES if c[0] == "P4_bf16_causal_docs_sinks_mqa")
    assert masked_estimate(*case[1:5], None, case[5], mode="ulysses") == 491_552


# dense Ulysses at two head chunks, GQA (q heads > 4/3 K/V heads a rank): the estimate's largest backward moment is a
# chunk's kernel (at_kernel), not the sending of its grads back as with 8 / 8 heads
DENSE_HC2 = [
    ("P2_fp32_causal_dense_16_4_hc2", 2, 512, "float32", True, {"shape": (1, 16, 4, 2)}),
    ("P2_bf16_full_dense_16_4_hc2", 2, 512, "bfloat16", False, {"shape": (1, 16, 4, 2)}),
    ("P2_fp32_causal_dense_8_4_hc2", 2, 512, "float32", True, {"shape": (1, 8, 4, 2)}),
]


@pytest.mark.parametrize("case_id,world,seq_len,dtype,causal,masks", DENSE_HC2, ids=[c[0] for c in DENSE_HC2])
def test_ulysses_dense_two_head_chunks_kernel_moment(dist_pool, case_id: str, world: int, seq_len: int,  # noqa: ANN001
                                                     dtype: str, causal: bool, masks: dict) -> None:
    """Dense Ulysses at two head chunks with GQA (16 / 4 and 8 / 4 heads, P = 2): the estimate's peak is a chunk's
    kernel (``at_kernel``; with 8 / 8 heads it is the sending of a chunk's grads back, so no case before measured it).
    At G = 2 the first chunk has only the next chunk's dout all-to-all beside its kernel and the last only the
    previous chunk's packed grads', as the masked path's ``beside`` counts. Measured (est31): fp32 causal 16 / 4
    2,965,504 B, estimate +0.55%; bf16 full 16 / 4 1,490,944 B, +1.10% (16,384 B over, not traced); fp32 causal 8 / 4
    1,843,200 B, +0.44%. Within 0 .. +1.5%, never under.

    Seen failing: the estimate before (both neighbours' all-to-alls beside each of 2 chunks): +9.39%, +9.89%, +4.00%."""
    peak = max(dist_pool.pools.run(world, measure_masked_peak, seq_len, dtype, causal, None, masks, 0, "ulysses",
                                   timeout=600))
    est = masked_estimate(world, seq_len, dtype, causal, None, masks, mode="ulysses")
    print(f"\n{case_id}: measured {peak:,} estimate {est:,} ({est / peak - 1:+.2%})")
    assert 0 <= est / peak - 1 <= 0.015, (masks, peak, est, f"{est / peak - 1:+.2%}")
