"""The ring's memory estimate under documents, windows, chunks and sinks (seqpar.memory.masked, replaying the plan the
ring runs) against the largest rank's measured peak (MemTracker: exact CPU tensor accounting), never under and at
most 10% over: tests/test_memory_masks.py's band (-2% .. +10%) let estimate terms worth up to 1.5% go, though every
one of its cases is exact to the byte; an estimate users size jobs by must not be under. Plus two cases none of its
19 reach (GQA at batch 2 with the bf16 dK/dV wire and sinks, P = 2, S = 64, where the forward's receive buffers decide
the peak; GQA with automatic head chunks under documents and chunks, where the forward's full-size out does), and
three cases asserted exact to the byte (one process over stacked documents, one process in bf16 with two head chunks,
two ranks with two head chunks), where the band let over-counts of +0.5% to +9% through.

Measured (2-core VM under load), bytes, each equal to its estimate: 1296800, 180736, 250400, 84096 (CASES' order).
"""

from __future__ import annotations

import pytest
import torch

from seqpar.memory.attention import estimate_attention_memory

DOCS = (0, 40, 200, 230, 512)

# (id, world, seq_len, dtype, causal, sharding, (batch, q_heads, kv_heads, head_chunks), masks, dkv_wire_dtype)
CASES = [
    ("P4_fp32_causal_window_contiguous", 4, 512, "float32", True, "contiguous", (1, 8, 8, 1), {"window": 32}, "fp32"),
    ("P4_bf16_full_docs_mqa_s256", 4, 256, "bfloat16", False, None, (1, 8, 1, 1), {"cu_seqlens": (0, 43, 123, 256)},
     "fp32"),
    ("P2_fp32_causal_sinks_gqa_b2_bf16_wire_s64", 2, 64, "float32", True, None, (2, 8, 2, 1), {"sinks": True}, "bf16"),
    ("P4_bf16_full_docs_chunked_gqa_auto_s128", 4, 128, "bfloat16", False, None, (1, 8, 2, "auto"),
     {"cu_seqlens": (0, 17, 88, 105, 106, 110, 119, 128), "chunk_size": 49}, "bf16"),
]


def measure(ctx, seq_len: int, dtype: str, causal: bool, sharding: str | None, shape: tuple, masks: dict,  # noqa: ANN001
            wire: str) -> int:
    """Peak tensor bytes on this rank over one ring forward + backward (inputs and gradients included), the lowest of
    3 steps."""
    import torch.distributed as dist

    import seqpar
    from seqpar.bench.attention import BenchShape, make_inputs
    from seqpar.bench.runner import peak_memory

    batch, q_heads, kv_heads, head_chunks = shape
    bench = BenchShape(batch=batch, q_heads=q_heads, kv_heads=kv_heads, head_dim=16, dtype=dtype,
                       head_chunks=head_chunks)
    seq_local = seq_len // ctx.world_size
    kw = {k: v for k, v in masks.items() if k != "sinks"}

    def step() -> None:
        q, k, v, dout = make_inputs(bench, seq_local, ctx.device, 7 + ctx.rank)
        sinks = torch.zeros(q_heads, dtype=q.dtype, requires_grad=True) if masks.get("sinks") else None
        out = seqpar.attention(q, k, v, causal=causal, mode="ring", group=dist.group.WORLD, head_chunks=head_chunks,
                               sharding=sharding or ("zigzag" if causal else "contiguous"), sinks=sinks,
                               dkv_wire_dtype=wire, **kw)
        out.backward(dout)

    return peak_memory(step, ctx.device, repeats=3)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world,seq_len,dtype,causal,sharding,shape,masks,wire", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_masked_ring_estimate_is_never_under_the_measured_peak(dist_pool, world: int, seq_len: int, dtype: str,  # noqa: ANN001
                                                               causal: bool, sharding, shape: tuple, masks: dict,
                                                               wire: str) -> None:
    """The largest rank's measured peak against the estimate: at least the peak, at most 10% over.

    Seen failing (each estimate under the peak): a stacked group's inputs without their lse rows
    (``_group_sizes``' ``n * u.la`` dropped: P4_fp32_causal_window_contiguous -0.47%); the forward's first piece
    taken as the accumulators in low precision too (``not u.low`` dropped: P4_bf16_full_docs_mqa_s256 -1.53%); the
    forward's receive buffers made one hop short (``step + 1 < hops[prev]``: the GQA batch-2 case -6.5%); the
    forward moment of head-chunk passes without the full-size out and lse (``(Q + lse) if G > 1``, memory/attention.py:
    the GQA auto-chunked case -10.8%); the sink logits' own ``(q_heads,)`` tensor left out (``sink_param = 0``: the
    GQA batch-2 case 250368 against 250400, 32 bytes under; tests/test_memory_masks.py's band lets it go)."""
    batch, q_heads, kv_heads, head_chunks = shape
    peak = max(dist_pool.pools.run(world, measure, seq_len, dtype, causal, sharding, shape, masks, wire, timeout=540))
    est = estimate_attention_memory(seq_len, world_size=world, mode="ring", batch=batch, q_heads=q_heads,
                                    kv_heads=kv_heads, head_dim=16, dtype=dtype, causal=causal,
                                    head_chunks=head_chunks, sharding=sharding, dkv_wire_dtype=wire, **masks)
    assert 0 <= est / peak - 1 <= 0.10, (peak, est, est / peak - 1)




# (id, seq_len, dtype, (q_heads, kv_heads, head_dim, head_chunks), documents)
ONE_PROCESS = [
    ("stacked_docs_fp32_s4160", 4160, "float32", (2, 2, 8, 1), tuple(range(0, 4160, 64)) + (4160,)),
    ("docs_bf16_hc2_s512", 512, "bfloat16", (8, 8, 16, 2), DOCS),
]


@pytest.mark.parametrize("seq_len,dtype,heads,documents", [c[1:] for c in ONE_PROCESS], ids=[c[0] for c in ONE_PROCESS])
def test_one_process_documents_estimate_is_exact(seq_len: int, dtype: str, heads: tuple, documents: tuple) -> None:
    """One process (``seqpar.attention``'s "single" algorithm: the ring's planner alone), causal, batch 1, with packed
    documents: the estimate equals the measured peak to the byte, as the masked replay is documented to (exact on
    CPU); tests/test_memory_masks.py measures no one-process case. 65 documents of 64 tokens (S = 4160, fp32, 2 / 2
    heads, head_dim 8): the pieces of one shape are stacked into kernel calls of at most ``BATCH_ROWS`` (4096) query
    rows, 63 pieces a call and a second of 2 (no other case has rows enough to fill one); bf16 with two head chunks
    (8 / 8 heads, head_dim 16, S = 512): each pass's accumulators copied into the gradients' slices, not cast.

    Seen failing: the stacking rule's bound off by one piece (``len(group) * n > BATCH_ROWS``: 64 pieces a call,
    4326400 against 4305408, +0.49%); the final cast counted for head-chunk passes too (``cast=low`` in
    memory/attention.py: 1654784 against 1577984, +4.9%); both inside every band the other tests use."""
    import seqpar
    from seqpar.bench.attention import BenchShape, make_inputs
    from seqpar.bench.runner import peak_memory

    q_heads, kv_heads, head_dim, head_chunks = heads
    bench = BenchShape(batch=1, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                       head_chunks=head_chunks)
    device = torch.device("cpu")

    def step() -> None:
        q, k, v, dout = make_inputs(bench, seq_len, device, 0)
        seqpar.attention(q, k, v, causal=True, head_chunks=head_chunks, cu_seqlens=documents).backward(dout)

    peak = peak_memory(step, device, repeats=3)
    est = estimate_attention_memory(seq_len, world_size=1, mode="single", batch=1, q_heads=q_heads, kv_heads=kv_heads,
                                    head_dim=head_dim, dtype=dtype, causal=True, head_chunks=head_chunks,
                                    cu_seqlens=documents)
    assert est == peak, (peak, est, est / peak - 1)


@pytest.mark.timeout(600)
def test_masked_ring_estimate_with_head_chunks_is_exact(dist_pool) -> None:  # noqa: ANN001
    """P = 2, fp32, causal (zigzag), window 190, 8 / 8 heads, ``head_chunks=2``, S = 512: each pass's accumulators are
    copied into the gradients' slices and freed before the ring's hops; the estimate equals the largest rank's
    measured peak to the byte (1912832), as the masked replay is documented to (exact on CPU).

    Seen failing: the own block's accumulators kept through the hops in head-chunk passes (``if into:`` ``acc``
    release dropped in seqpar/memory/masked.py's backward): 1956592, +2.3%, inside every band the other tests use
    (P4_fp32_causal_docs_balanced_hc4 of tests/test_memory_masks.py: +6.3%)."""
    shape, masks = (1, 8, 8, 2), {"window": 190}
    peak = max(dist_pool.pools.run(2, measure, 512, "float32", True, None, shape, masks, "fp32", timeout=540))
    est = estimate_attention_memory(512, world_size=2, mode="ring", batch=1, q_heads=8, kv_heads=8, head_dim=16,
                                    dtype="float32", causal=True, head_chunks=2, **masks)
    assert est == peak, (peak, est, est / peak - 1)
