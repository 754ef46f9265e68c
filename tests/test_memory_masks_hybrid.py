"""The hybrid's memory estimate under documents, windows, chunked attention and sinks (seqpar.memory.attention.
_hybrid_peak: the super-ranks' masked inner ring replayed, forward and backward, on one head chunk's head-layout
sizes; the sink gradient's moment) against the largest rank's measured peak (MemTracker, exact CPU tensor
accounting, the lowest of 3 steps). Until session 28 the estimate refused masks and sinks with the hybrid by name.
(P/2) x 2 grids (Ulysses pairs, a ring of P/2 super-ranks), head_dim 16, batch 1, head_chunks 1 unless a case's
shape says otherwise.
"""

from __future__ import annotations

import pytest
import torch
from test_memory_masks import DOCS, masked_estimate


def measure_hybrid_masked_peak(ctx, seq_len: int, dtype: str, causal: bool, masks: dict, seed: int) -> int:  # noqa: ANN001
    """Peak tensor bytes on this rank over one masked (P/2) x 2 hybrid forward + backward (inputs and gradients
    included), zigzag when causal."""
    import seqpar
    from seqpar.bench.attention import BenchShape, hybrid_manager, make_inputs
    from seqpar.bench.runner import peak_memory

    batch, q_heads, kv_heads, head_chunks = masks.get("shape", (1, 8, 8, 1))
    shape = BenchShape(batch=batch, q_heads=q_heads, kv_heads=kv_heads, head_dim=16, dtype=dtype,
                       head_chunks=head_chunks)
    manager = hybrid_manager(ctx.world_size)
    kw = {k: v for k, v in masks.items() if k not in ("sinks", "shape")}

    def step() -> None:
        q, k, v, dout = make_inputs(shape, seq_len // ctx.world_size, ctx.device, seed + ctx.rank)
        sinks = torch.zeros(q_heads, dtype=q.dtype, requires_grad=True) if masks.get("sinks") else None
        out = seqpar.attention(q, k, v, causal=causal, mode="hybrid", group=manager.sp_group, head_chunks=head_chunks,
                               sharding="zigzag" if causal else "contiguous", sinks=sinks, **kw)
        out.backward(dout)

    return peak_memory(step, ctx.device, repeats=3)


def hybrid_estimate(world: int, seq_len: int, dtype: str, causal: bool, masks: dict) -> int:
    """The estimate for a case of :data:`CASES`."""
    return masked_estimate(world, seq_len, dtype, causal, None, masks, mode="hybrid", ulysses_size=2)


# (id, world, seq_len, dtype, causal, masks); masks may carry "shape": (batch, q_heads, kv_heads, head_chunks)
CASES = [
    ("P4_fp32_causal_docs", 4, 512, "float32", True, {"cu_seqlens": DOCS}),
    ("P4_fp32_full_docs", 4, 512, "float32", False, {"cu_seqlens": DOCS}),
    ("P4_fp32_causal_window", 4, 512, "float32", True, {"window": 48}),
    ("P4_bf16_full_window", 4, 512, "bfloat16", False, {"window": 48}),
    ("P4_bf16_causal_chunked_hc2", 4, 512, "bfloat16", True, {"chunk_size": 80, "shape": (1, 8, 8, 2)}),
    ("P4_fp32_causal_sinks", 4, 512, "float32", True, {"sinks": True}),
    ("P4_bf16_full_docs_sinks_gqa", 4, 512, "bfloat16", False, {"cu_seqlens": DOCS, "sinks": True, "shape": (1, 8, 2, 1)}),
    ("P4_fp32_causal_window_6_3", 4, 512, "float32", True, {"window": 64, "shape": (1, 6, 3, 1)}),
    ("P4_bf16_causal_docs_window_6_3_sinks", 4, 512, "bfloat16", True,
     {"cu_seqlens": DOCS, "window": 64, "sinks": True, "shape": (1, 6, 3, 1)}),
    ("P8_fp32_causal_window", 8, 512, "float32", True, {"window": 40}),
]


@pytest.mark.parametrize("world,seq_len,dtype,causal,masks", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_masked_hybrid_estimate_is_the_measured_peak(dist_pool, world: int, seq_len: int, dtype: str, causal: bool,  # noqa: ANN001
                                                     masks: dict) -> None:
    """The hybrid under documents, windows, chunked attention and sinks: the super-ranks run the masked ring across
    them on each head chunk's head-layout tensors (u L rows a super-rank, zigzag over P/u when causal), replayed
    forward and backward as the ring's own plan is (an uneven split: per GQA piece, in turn), beside the all-to-alls'
    moments of the dense estimate; sinks add the sink merge, sink_grad's moment and the logits with their gradient.
    Within 0 .. +1% of the largest rank's measured peak, never under. Measured (2-core VM), bytes, estimate: causal /
    full documents 1445888 +0.28%; causal window 48 1823680 +0.22%; bf16 full window 48 1052672 +0.39%; bf16 causal
    chunk 80, 2 head chunks 823296 +0.50%; causal sinks 1445952 +0.28%; bf16 full documents + sinks, 8 / 2 heads
    512032 +0.80%; causal window 64, 6 / 3 (uneven) 856552 +0.36%; bf16 causal documents + window 64 + sinks, 6 / 3
    437272 +0.70%; P = 8 (a ring of 4) causal window 40 898928 +0.23%. Before session 28 the estimate refused them.

    Seen failing: the mask not passed to the inner ring (the plain causal / full ring replayed instead):
    P4_fp32_causal_window -20.5%, P4_fp32_causal_window_6_3 -11.3%, P8_fp32_causal_window -3.0%. (Not seen failing:
    the masked inner forward's replay (the closed-form merge instead) and the sink gradient's moment, each dropped:
    the peak is the inner backward in every case.)"""
    peak = max(dist_pool.pools.run(world, measure_hybrid_masked_peak, seq_len, dtype, causal, masks, 0, timeout=600))
    est = hybrid_estimate(world, seq_len, dtype, causal, masks)
    assert 0 <= est / peak - 1 <= 0.01, (masks, peak, est, est / peak - 1)
