"""The ring's memory estimate under documents, windows, chunks and sinks (seqpar.memory.masked, replaying the plan the
ring runs) against the largest rank's measured peak (MemTracker: exact CPU tensor accounting), never under and at
most 10% over: tests/test_memory_masks.py's band (-2% .. +10%) let estimate terms worth up to 1.5% go, though every
one of its cases is exact to the byte; an estimate users size jobs by must not be under. Plus a case none of its 19
reach: GQA at batch 2 with the bf16 dK/dV wire and sinks, P = 2, S = 64 (the forward's receive buffers decide it).

Measured (2-core VM under load), bytes: see each case's id in CASES; every one equals its estimate to the byte.
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
    forward's receive buffers made one hop short (``step + 1 < hops[prev]``: the GQA batch-2 case -6.5%)."""
    batch, q_heads, kv_heads, head_chunks = shape
    peak = max(dist_pool.pools.run(world, measure, seq_len, dtype, causal, sharding, shape, masks, wire, timeout=540))
    est = estimate_attention_memory(seq_len, world_size=world, mode="ring", batch=batch, q_heads=q_heads,
                                    kv_heads=kv_heads, head_dim=16, dtype=dtype, causal=causal,
                                    head_chunks=head_chunks, sharding=sharding, dkv_wire_dtype=wire, **masks)
    assert 0 <= est / peak - 1 <= 0.10, (peak, est, est / peak - 1)



def test_one_process_stacked_documents_estimate_is_exact() -> None:
    """One process (``seqpar.attention``'s "single" algorithm: the ring's planner alone) over 65 documents of 64 tokens
    (S = 4160, fp32 causal, 2 / 2 heads, head_dim 8, ``head_chunks=1``): the pieces of one shape are stacked into
    kernel calls of at most ``BATCH_ROWS`` (4096) query rows, so 63 pieces a call and a second call of 2; no case of
    tests/test_memory_masks.py has enough rows to fill one. The estimate equals the measured peak to the byte
    (4305408), as the masked replay is documented to (exact on CPU).

    Seen failing: the stacking rule's bound off by one piece (``len(group) * n > BATCH_ROWS``: 64 pieces a call,
    4326400, +0.49%, inside every band the other tests use)."""
    import seqpar
    from seqpar.bench.attention import BenchShape, make_inputs
    from seqpar.bench.runner import peak_memory

    seq_len, documents = 4160, tuple(range(0, 4160, 64)) + (4160,)
    bench = BenchShape(batch=1, q_heads=2, kv_heads=2, head_dim=8, dtype="float32", head_chunks=1)
    device = torch.device("cpu")

    def step() -> None:
        q, k, v, dout = make_inputs(bench, seq_len, device, 0)
        seqpar.attention(q, k, v, causal=True, head_chunks=1, cu_seqlens=documents).backward(dout)

    peak = peak_memory(step, device, repeats=3)
    est = estimate_attention_memory(seq_len, world_size=1, mode="single", batch=1, q_heads=2, kv_heads=2, head_dim=8,
                                    dtype="float32", causal=True, head_chunks=1, cu_seqlens=documents)
    assert est == peak, (peak, est, est / peak - 1)
