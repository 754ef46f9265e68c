"""The ring's memory estimate under documents, windows, chunked attention and sinks (seqpar.memory.masked: the plan
the ring runs, replayed) against the largest rank's measured peak (MemTracker: exact CPU tensor accounting, the lowest
of 3 steps): the ring's within 0 .. +1% (every case is exact), Ulysses' within 0 .. +5% (the dense estimates' band
is -2% .. +10%: tests/test_memory_low_precision.py, tests/test_memory_hybrid.py): an estimate users size jobs by must never be under, and one 10% over leaves a tenth of
the memory unused. head_dim 16; 8 / 8 heads, batch 1, ``head_chunks=1`` unless a case says otherwise.

Measured (2-core VM under load), bytes: measured peak, the estimate before (the unmasked figure) -> after. Every
case is now exact to the byte; before, 13 of 19 were out of the band:

- P = 4 fp32 causal documents (0, 40, 200, 230, 512): 1187840, +5.2% -> 0; full: 1197056, +4.4% -> 0
- P = 4 fp32 causal window 48: 1318880, -5.3% -> 0; bf16 full window 48: 921600, -7.1% -> 0
- P = 4 fp32 causal window 32, contiguous: 1296800, -3.7% -> 0; P = 2 fp32 causal chunk 96: 2209792, -16.6% -> 0
- P = 4 bf16 causal documents + window 64: 1002720, -14.6% -> 0; balanced, head chunks 4: 778496, -9.0% -> 0
- P = 2 fp32 full window 40, 8 / 2 heads, batch 2, head chunks 2: 2488128, -28.2% -> 0
- P = 4 fp32 causal short documents, contiguous, sinks: 921632, +35.6% -> 0
- P = 4 bf16 causal window 64, S = 256: 526848, -18.8% -> 0; P = 2 bf16 full documents, MQA, sinks: 704528, -22.1% -> 0
- sinks on dense masks: P = 2 bf16 causal head chunks 2: 1056784, +9.3% -> 0; full, 4 chunks: 933904, -9.7% -> 0
"""

from __future__ import annotations

import pytest
import torch

from seqpar.memory.attention import estimate_attention_memory

DOCS = (0, 40, 200, 230, 512)  # packed documents over S = 512: one crosses rank edges, two sit inside a shard

# (id, world, seq_len, dtype, causal, sharding, masks); the shape is 8 / 8 heads, batch 1, head_chunks 1 unless
# masks carries "shape": (batch, q_heads, kv_heads, head_chunks)
CASES = [
    ("P4_fp32_causal_docs", 4, 512, "float32", True, None, {"cu_seqlens": DOCS}),
    ("P4_fp32_full_docs", 4, 512, "float32", False, None, {"cu_seqlens": DOCS}),
    ("P4_fp32_causal_window", 4, 512, "float32", True, None, {"window": 48}),
    ("P4_bf16_full_window", 4, 512, "bfloat16", False, None, {"window": 48}),
    ("P4_fp32_causal_window_contiguous", 4, 512, "float32", True, "contiguous", {"window": 32}),
    ("P2_fp32_causal_chunked", 2, 512, "float32", True, None, {"chunk_size": 96}),
    ("P2_bf16_causal_docs_sinks", 2, 512, "bfloat16", True, None, {"cu_seqlens": DOCS, "sinks": True}),
    ("P4_bf16_causal_docs_window", 4, 512, "bfloat16", True, None, {"cu_seqlens": DOCS, "window": 64}),
    ("P4_fp32_causal_docs_balanced_hc4", 4, 512, "float32", True, "balanced",
     {"cu_seqlens": DOCS, "shape": (1, 8, 8, "auto")}),
    ("P2_fp32_full_window_gqa_b2_hc2", 2, 512, "float32", False, None, {"window": 40, "shape": (2, 8, 2, 2)}),
    ("P4_bf16_causal_chunked_hc2", 4, 512, "bfloat16", True, None, {"chunk_size": 80, "shape": (1, 8, 8, 2)}),
    ("P4_fp32_causal_short_docs_contiguous_sinks", 4, 512, "float32", True, "contiguous",
     {"cu_seqlens": (0, 100, 128, 300, 384, 512), "sinks": True}),
    ("P4_bf16_causal_window_s256", 4, 256, "bfloat16", True, None, {"window": 64}),
    ("P4_bf16_full_docs_mqa_s256", 4, 256, "bfloat16", False, None,
     {"cu_seqlens": (0, 43, 123, 256), "shape": (1, 8, 1, 1)}),
    ("P2_bf16_full_docs_mqa_sinks", 2, 512, "bfloat16", False, None,
     {"cu_seqlens": DOCS, "sinks": True, "shape": (1, 8, 1, 1)}),
    ("P2_bf16_causal_sinks_hc2", 2, 512, "bfloat16", True, None, {"sinks": True, "shape": (1, 8, 8, 2)}),
    ("P2_bf16_full_sinks_hc4", 2, 512, "bfloat16", False, None, {"sinks": True, "shape": (1, 8, 8, "auto")}),
    ("P4_fp32_causal_sinks", 4, 512, "float32", True, None, {"sinks": True}),
    ("P2_fp32_causal_sinks_gqa", 2, 512, "float32", True, None, {"sinks": True, "shape": (1, 8, 2, 1)}),
]


def measure_masked_peak(ctx, seq_len: int, dtype: str, causal: bool, sharding: str | None, masks: dict,  # noqa: ANN001
                        seed: int, mode: str = "ring") -> int:
    """Peak tensor bytes on this rank over one masked ring forward + backward (inputs and gradients included)."""
    import torch.distributed as dist

    import seqpar
    from seqpar.bench.attention import BenchShape, make_inputs
    from seqpar.bench.runner import peak_memory

    batch, q_heads, kv_heads, head_chunks = masks.get("shape", (1, 8, 8, 1))
    shape = BenchShape(batch=batch, q_heads=q_heads, kv_heads=kv_heads, head_dim=16, dtype=dtype,
                       head_chunks=head_chunks)
    seq_local = seq_len // ctx.world_size
    kw = {k: v for k, v in masks.items() if k not in ("sinks", "shape")}

    def step() -> None:
        q, k, v, dout = make_inputs(shape, seq_local, ctx.device, seed + ctx.rank)
        sinks = torch.zeros(q_heads, dtype=q.dtype, requires_grad=True) if masks.get("sinks") else None
        out = seqpar.attention(q, k, v, causal=causal, mode=mode, group=dist.group.WORLD, head_chunks=head_chunks,
                               sharding=sharding or ("zigzag" if causal else "contiguous"), sinks=sinks, **kw)
        out.backward(dout)

    return peak_memory(step, ctx.device, repeats=3)


def masked_estimate(world: int, seq_len: int, dtype: str, causal: bool, sharding: str | None, masks: dict,
                    mode: str = "ring", **options: object) -> int:
    """The estimate for a case of these tables (and the other modes' tables, tests/test_memory_masks_*.py): ``masks``
    may carry ``"shape": (batch, q_heads, kv_heads, head_chunks)`` (default ``(1, 8, 8, 1)``), head_dim 16;
    ``options`` go to :func:`estimate_attention_memory` as they are (the hybrid's ``ulysses_size``)."""
    batch, q_heads, kv_heads, head_chunks = masks.get("shape", (1, 8, 8, 1))
    kw = {k: v for k, v in masks.items() if k != "shape"}
    return estimate_attention_memory(seq_len, world_size=world, mode=mode, batch=batch, q_heads=q_heads,
                                     kv_heads=kv_heads, head_dim=16, dtype=dtype, causal=causal,
                                     head_chunks=head_chunks, sharding=sharding, **kw, **options)


@pytest.mark.parametrize("world,seq_len,dtype,causal,sharding,masks", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_masked_ring_estimate_within_band_of_the_measured_peak(dist_pool, world: int, seq_len: int, dtype: str,  # noqa: ANN001
                                                               causal: bool, sharding, masks: dict) -> None:
    """The largest rank's measured peak against the estimate, which replays the ring's plan for these masks (which
    blocks each rank receives, skips or runs in pieces). Every case is exact to the byte.

    Seen failing: the unmasked figure (before): 13 of 19 cases out of the band, -28.2% (P2_fp32_full_window_gqa_b2_hc2)
    to +35.6% (P4_fp32_causal_short_docs_contiguous_sinks); the home-going dK/dV sends not kept until the end of the
    backward: P4_bf16_causal_window_s256 -11.3%; a one-call share over every key row counted as travelling as it is
    (the CPU kernel's dk, dv are (batch, len, heads, dim) ordered, so it is copied): P4_fp32_causal_short_docs_
    contiguous_sinks -7.1%; the sink gradient's moment left out: P2_bf16_full_docs_mqa_sinks -22.1%; the generator's
    last stacked inputs not held while the next group stacks: P2_fp32_causal_chunked -13.3%; the CPU merge's fp64
    temporaries left out: P4_bf16_full_docs_mqa_s256 -19.5% (one lse-sized temporary too few: -2.3%); the
    anti-causal pieces' flipped copies left out: P4_fp32_causal_window_contiguous -19.5%. (Not seen failing, within the
    band: the sink logits' own (q_heads,) tensor left out, -16 / -32 bytes; a head-chunk pass's accumulators counted as
    cast at its end, P4_bf16_causal_chunked_hc2 +2.9%.) Since audit 27 the band is 0 .. +1%: 16 bytes taken off
    the backward's peak fail 16 of the 19 cases (the old band passed them)."""
    peak = max(dist_pool.pools.run(world, measure_masked_peak, seq_len, dtype, causal, sharding, masks, 0,
                                   timeout=600))
    est = masked_estimate(world, seq_len, dtype, causal, sharding, masks)
    # every case is exact to the byte: never under, at most 1% over (the old -2% .. +10% band let terms of 1.5%
    # under and 9% over pass: audit 27)
    assert 0 <= est / peak - 1 <= 0.01, (masks, peak, est, est / peak - 1)


# plain causal / full masks, no sinks: (id, world, seq_len, dtype, causal, shape (batch, q_heads, kv_heads, head_chunks))
PLAIN = [
    ("P4_fp32_causal", 4, 256, "float32", True, (1, 8, 8, 1)),
    ("P4_fp32_full", 4, 256, "float32", False, (1, 8, 8, 1)),
    ("P4_bf16_causal", 4, 256, "bfloat16", True, (1, 8, 8, 1)),
    ("P8_bf16_causal", 8, 256, "bfloat16", True, (1, 8, 8, 1)),
    ("P2_bf16_causal_hc2", 2, 512, "bfloat16", True, (1, 8, 8, 2)),
    ("P2_bf16_full_hc8", 2, 512, "bfloat16", False, (1, 8, 8, "auto")),
    ("P4_fp32_causal_s512", 4, 512, "float32", True, (1, 8, 8, 1)),
    ("P4_fp32_causal_gqa_hc1", 4, 256, "float32", True, (1, 8, 2, 1)),
    ("P2_fp32_causal_gqa", 2, 512, "float32", True, (1, 8, 2, 1)),
    ("P2_fp32_full_gqa_b2_hc2", 2, 512, "float32", False, (2, 8, 2, 2)),
    ("P4_bf16_causal_hc2", 4, 512, "bfloat16", True, (1, 8, 8, 2)),
    ("P4_fp32_causal_b2_hc2", 4, 256, "float32", True, (2, 8, 8, 2)),
    ("P8_fp32_causal_hc4", 8, 512, "float32", True, (1, 8, 8, 4)),
    ("P2_bf16_causal_mqa", 2, 512, "bfloat16", True, (1, 8, 1, 1)),
]


@pytest.mark.parametrize("world,seq_len,dtype,causal,shape", [c[1:] for c in PLAIN], ids=[c[0] for c in PLAIN])
def test_plain_ring_estimate_is_the_measured_peak(dist_pool, world: int, seq_len: int, dtype: str, causal: bool,  # noqa: ANN001
                                                  shape: tuple) -> None:
    """Plain causal (zigzag) and full (contiguous) masks: the ring's estimate replays its plan as under masks (the
    closed form, ``_ring_peak`` until session 27, is gone) and is the largest rank's measured peak: every case
    is exact to the byte (measured on the 2-core VM), held to -1% .. +1%.

    Seen failing: the closed form (the estimate before session 27: ``_mask_options`` returning None for a plain
    ring call) on 11 of 14, from P2_bf16_causal_hc2 +9.3%, P2_bf16_full_hc8 +6.2%, P2_fp32_causal_gqa +3.7% and
    P4_fp32_causal_gqa_hc1 +3.0% to P8_fp32_causal_hc4 +1.2% (from the recorded figures); run under the brief's -2% .. +3%: 4 failed."""
    peak = max(dist_pool.pools.run(world, measure_masked_peak, seq_len, dtype, causal, None, {"shape": shape}, 0,
                                   timeout=600))
    est = masked_estimate(world, seq_len, dtype, causal, None, {"shape": shape})
    assert -0.01 <= est / peak - 1 <= 0.01, (shape, peak, est, est / peak - 1)


# Ulysses under masks: (id, world, seq_len, dtype, causal, masks); 8 / 8 heads, batch 1, head_chunks 1 unless "shape"
ULYSSES = [
    ("P4_fp32_causal_docs", 4, 512, "float32", True, {"cu_seqlens": DOCS}),
    ("P4_fp32_full_docs", 4, 512, "float32", False, {"cu_seqlens": DOCS}),
    ("P4_fp32_causal_window", 4, 512, "float32", True, {"window": 48}),
    ("P4_fp32_full_window", 4, 512, "float32", False, {"window": 48}),
    ("P4_bf16_causal_window", 4, 512, "bfloat16", True, {"window": 48}),
    ("P2_fp32_causal_docs_window_hc4", 2, 512, "float32", True,
     {"cu_seqlens": DOCS, "window": 64, "shape": (1, 8, 8, "auto")}),
    ("P4_fp32_causal_chunked_gqa", 4, 512, "float32", True, {"chunk_size": 96, "shape": (1, 8, 4, 1)}),
    ("P2_bf16_full_window_hc2", 2, 512, "bfloat16", False, {"window": 40, "shape": (1, 8, 8, 2)}),
]


@pytest.mark.parametrize("world,seq_len,dtype,causal,masks", [c[1:] for c in ULYSSES], ids=[c[0] for c in ULYSSES])
def test_masked_ulysses_estimate_within_band_of_the_measured_peak(dist_pool, world: int, seq_len: int, dtype: str,  # noqa: ANN001
                                                                  causal: bool, masks: dict) -> None:
    """Ulysses under documents, windows and chunked attention: each rank attends its heads over the whole sorted
    sequence with the ring's planner at P = 1 (seqpar.attn.ulysses._inner_forward / _inner_backward), replayed on
    one head chunk's head-layout sizes, beside the all-to-alls' moments of the dense estimate. Within 0 .. +1% of
    the largest rank's measured peak, never under (session 28: the -2% .. +10% band it had let a term 2% under
    through, on cases that sit at +0.2% .. +4.7%; +5% until est29b counted, at 2 head chunks, the next chunk's dout
    all-to-all at the first chunk only, not beside the previous chunk's packed grads at the last). Measured (2-core VM), bytes, estimate: causal / full
    documents 1380352, +0.3%; causal / full window 48 1772600 / 1688480, +0.2%; bf16 causal window 990072, +0.4%;
    P = 2 documents + window 64, 4 head chunks 2188016, +0.4%; chunked 96, 8 / 4 heads 1171200, +0.3%; P = 2 bf16 full
    window 40, 2 head chunks 1553928, +0.53% (+4.7% before est29b). Before session 27 the estimate refused masks with mode='ulysses'.

    Seen failing: the replayed inner backward dropped (the masked kernel moment ``0 * (...)``, leaving the dense
    all-to-all moments): P4_fp32_causal_window -21.9%, P4_fp32_full_window -18.0%, P4_bf16_causal_window -29.7%,
    P4_fp32_causal_chunked_gqa -15.4%, P2_bf16_full_window_hc2 -16.7%. (Not seen failing: the replayed inner
    forward dropped; in these cases the backward is the peak.) The 1% band on the estimate before est29b (both
    neighbours' all-to-alls beside each of 2 head chunks): P2_bf16_full_window_hc2 +4.7%."""
    peak = max(dist_pool.pools.run(world, measure_masked_peak, seq_len, dtype, causal, None, masks, 0, "ulysses",
                                   timeout=600))
    est = masked_estimate(world, seq_len, dtype, causal, None, masks, mode="ulysses")
    assert 0 <= est / peak - 1 <= 0.01, (masks, peak, est, est / peak - 1)


def test_training_estimate_takes_the_masks() -> None:
    """The whole-step model passes the data's masks to its attention term: ``attention_transients`` is the masked
    call's estimate in Hugging Face's layout (``bshd``) less q, k, v, the output and the lse (since est37: the layer's
    saved tensors count the lse) (a model whose MLP transient is smaller).

    Seen failing: estimate_training_memory without the masks' arguments (TypeError), and with them not passed on to
    the attention term (the unmasked figure: 3555328 against 4257992 with window 64)."""
    from seqpar.memory.training import estimate_training_memory

    model = {"vocab_size": 256, "hidden_size": 256, "intermediate_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 8, "num_key_value_heads": 8}
    qkvo = 512 * 32 * (2 * 8 + 2 * 8) * 4 + 512 * 8 * 4  # 512 local rows, head_dim 32, fp32; the fp32 lse (est37)
    seen = set()
    for masks in ({"window": 64}, {"cu_seqlens": (0, 300, 1100, 2048), "sinks": True}, {"chunk_size": 200}):
        got = estimate_training_memory(model, seq_len=2048, sp_size=4, mode="ring", **masks)["attention_transients"]
        attn = estimate_attention_memory(2048, world_size=4, mode="ring", batch=1, q_heads=8, kv_heads=8,
                                         head_dim=32, causal=True, layout="bshd", **masks)
        assert got == attn - qkvo, (masks, got, attn - qkvo)
        seen.add(got)
    dense = estimate_training_memory(model, seq_len=2048, sp_size=4, mode="ring")["attention_transients"]
    assert dense not in seen and len(seen) == 3


@pytest.mark.parametrize("kwargs,needle", [
    ({"mode": "hybrid", "ulysses_size": 2, "window": 64, "sharding": "balanced"}, "sharding='balanced'"),
    ({"cu_seqlens": (0, 100, 500)}, "cu_seqlens"),
    ({"window": 0}, "window=0"),
    ({"chunk_size": 1.5}, "chunk_size=1.5"),
    ({"window": 8, "sharding": "striped"}, "sharding='striped'"),
], ids=["hybrid_balanced", "docs_not_ending_at_S", "window_0", "chunk_float", "bad_sharding"])
def test_masked_estimate_refuses_what_it_cannot_size(kwargs: dict, needle: str) -> None:
    """Masks for a mode the estimate does not replay, or masks seqpar.attention would refuse, raise naming them (never
    the unmasked figure).

    Seen failing: before session 26, the masks' arguments were not taken (TypeError); the uneven Ulysses split's
    refusal removed (``if False:``): ulysses_uneven (no error; its inner pieces were not replayed under a mask). Since
    session 28 sinks with Ulysses and an uneven Ulysses split under a mask are modelled (measured:
    tests/test_memory_masks_ulysses.py) and so is the hybrid under masks (tests/test_memory_masks_hybrid.py): no
    longer refused; the hybrid with ``sharding='balanced'`` is, as seqpar.attention refuses it. Masks with the
    all-gather are modelled too (tests/test_memory_masks_allgather.py)."""
    args = {"world_size": 4, "mode": "ring", "batch": 1, "q_heads": 8, "kv_heads": 8, "head_dim": 16, "causal": True}
    args.update(kwargs)
    with pytest.raises(ValueError, match=__import__("re").escape(needle)):
        estimate_attention_memory(1024, **args)


def test_masked_estimate_single_process_and_max_seq_len() -> None:
    """One process with a window runs the ring's planner alone (seqpar.attention's "single" algorithm): the estimate
    replays it at P = 1; max_seq_len takes the window and returns a length whose estimate fits.

    Seen failing: max_seq_len without ``window`` (TypeError)."""
    from seqpar.memory.attention import max_seq_len

    one = estimate_attention_memory(1024, world_size=1, mode="single", batch=1, q_heads=8, kv_heads=8, head_dim=16,
                                    causal=True, window=64)
    dense = estimate_attention_memory(1024, world_size=1, mode="single", batch=1, q_heads=8, kv_heads=8, head_dim=16,
                                      causal=True)
    assert one > 0 and one != dense
    kw = {"world_size": 4, "mode": "ring", "batch": 1, "q_heads": 8, "kv_heads": 8, "head_dim": 16, "causal": True}
    best = max_seq_len(2 ** 24, multiple=64, window=256, **kw)
    assert best > 0 and estimate_attention_memory(best, window=256, **kw) <= 2 ** 24
