"""Peak memory per rank of one attention call, forward + backward: ``estimate_attention_memory(...)``.

The estimate is the live set of tensors at the step's peak moment, read off the algorithms in
:mod:`seqpar.attn` and checked against exact CPU tensor accounting (MemTracker) by
``python -m seqpar.bench memory`` and ``tests/test_bench.py`` (within 15%). Units, per rank, with
``L = seq_len / world_size`` local rows, ``e`` the input element size and ``a`` the accumulator's
(4 bytes, 8 for float64)::

    Q   = batch * q_heads  * L * head_dim * e      K   = batch * kv_heads * L * head_dim * e
    Q32 = batch * q_heads  * L * head_dim * a      K32 = batch * kv_heads * L * head_dim * a
                                                   Kw  = batch * kv_heads * L * head_dim * w

``w`` is the element size of the ring's travelling dK/dV accumulators (``dkv_wire_dtype``): ``a`` with
``"fp32"`` (the default), 2 with ``"bf16"`` (:func:`seqpar.attn.common.dkv_wire_dtype`: they are sent and
received in bfloat16, each hop adding its fp32 share in place). Only the ring's (and the hybrid's inner
ring's) travelling accumulators are ``Kw``; dq and the own block's dk, dv stay in ``a``.

MLA (``v_head_dim`` != ``head_dim``): K/V come in pairs (k and v, dk and dv, their buffers), so ``K``
and ``K32`` use the mean of the two head dims, which is exact for every pair; ``Q``-sized terms use
that mean too (q and dq have ``head_dim`` columns, out and dout ``v_head_dim``: within
``|head_dim - v_head_dim| / (head_dim + v_head_dim)`` of those terms, 20% for DeepSeek-V3's 192/128).

Always live: ``q, out, dout`` (3 Q) and ``k, v`` (2 K), plus the row log-sum-exp (``batch * q_heads
* L * a``). On top of that, at the peak:

- ``single`` (one process, ``F.scaled_dot_product_attention`` on the whole sequence): the gradients
  ``dq, dk, dv`` (Q + 2 K) and one Q-sized kernel workspace.
- ``ring``, as the hybrid's inner ring counts it (the ring itself is replayed: "The ring, every mask", below; this closed form
  was up to +9.3% high for it) (P >= 3, at a remote block's backward kernel): fp32 accumulators ``dq, dk_own, dv_own``
  (Q32 + 2 K32), two K/V receive buffers (4 K, double-buffered), the travelling dK/dV accumulator being
  sent and the one being received (4 K32), and the kernel's outputs ``dq, dk, dv`` (Q + 2 K, in the
  input dtype: dq is added into its accumulator in place, dk and dv are the block's share as they are).
  The travelling accumulators are 4 Kw (4 K32 with the default fp32 wire, 2 K32 on a bf16 wire with fp32
  inputs). Under causal zigzag a call over half a key block makes less; the block's widened first hop
  (2 Kw) is made when nothing travels yet and is then the pair sent on. P = 2 has a single remote step:
  one K/V buffer (2 K), and at its end the accumulator's first hop out and our own block's coming home.
- ``allgather`` (pipelined over G head chunks): one chunk's gathered K/V of all ranks (2 P K / G) and
  their fp32 dK/dV (2 P K32 / G), the next chunk's gather in flight and the previous chunk's
  reduce-scatter in flight (each about as large), the fp32 dq accumulator and the kernel's outputs;
  the final dk, dv once the first chunk is scattered. G = 1 holds all heads' gathered K/V and dK/dV.

- ``ulysses`` (u = P) and ``hybrid`` (u = ``ulysses_size``): the head-layout tensors the backward reuses
  (q, k, v, out and lse for H/u heads over u L rows: 2 Q + 2 Kh, Kh = K when u divides kv_heads, K u /
  kv_heads when K/V heads are replicated), the gradients (Q + 2 K; fp32 dK/dV when replicated), and per
  head chunk (G = head chunks of each rank's K/V heads) at a kernel: the head-layout dout, the kernel's
  outputs and their ~2 Q workspace, the previous chunk's packed dq/dk/dv all-to-all in flight (send +
  receive) and the next chunk's dout all-to-all (send + receive): (8 Q + 6 Kh) / G for G > 1; or, often
  larger (the even path's peak at G = 1), the start of a chunk's return all-to-all: its kernel outputs,
  their packed send buffer and the receive buffer (3 (Q + 2 Kh) / G), beside the previous chunk's pair in
  flight (G > 1) and the next chunk's dout all-to-all (G > 2). Uneven heads (``u`` does not split the
  heads evenly, :mod:`seqpar.attn.ulysses`): the largest of each rank's own peak, on its own shares
  ``Qh = Q u q_r / Hq`` and ``Kh = K u kv_r / Hkv`` (the largest query share and the largest K/V union can
  sit on different ranks: counted together they were up to +17% over), one head pass, fp32 dK/dV (a K/V
  head may be shared by two ranks), and dout's all-to-all send buffer (Q) held throughout. Packing: the
  pieces' dq/dk/dv, their concatenation (two or more GQA pieces) and the packed send buffer; placing: the
  send buffer beside the receive buffer (every peer's share of this rank's rows, ``Q + 2 K sum(kv_j) /
  Hkv``), dq and the zeroed fp32 dK/dV, then, low precision, their casts (by which dout's send buffer is
  gone: the larger of Q and 2 K); the forward keeps the q/k/v send buffer (``Q + 2 K sum(kv_j) / Hkv``)
  beside the receive buffer or the output's pair. 11 measured dense and documents splits, +0.3% to +0.6%
  (fp32 +0.3% to +0.4%, bf16 +0.5% to +0.6%; tests/test_memory_uneven.py).
- ``hybrid``: the same all-to-alls around an inner ring over P/u super-ranks, whose transients are the
  ring's own (above: accumulators, K/V receive buffers, travelling dK/dV in the wire dtype ``Kw``, kernel
  outputs; at the forward, its merge) on one head chunk's head-layout tensors, counted beside what is in
  flight while that chunk's ring runs: its head-layout dout, the next chunk's dout all-to-all (not at the
  last chunk) and the previous chunk's dq/dk/dv all-to-all (not at the first). The inner ring's
  accumulators become the chunk's dq/dk/dv (no second set), and no kernel workspace is added (the CPU
  kernels' are not tensors). Uneven heads run one pass, one inner ring per GQA-regular piece in turn (the
  earlier pieces' outputs kept for the concatenation), and keep dout's all-to-all send buffer (gloo's
  worker thread frees it, not the wait). Measured at P = 4 and 8 (fp32, bf16, GQA, uneven, causal, head
  chunks 1 to 4): +0.2% to +0.8% (tests/test_memory_hybrid.py); causal +0.2% to +0.5% since the even split's inner
  ring is replayed as the ring's own estimate is (its closed form, above, was +2.1% at P = 8).

The ring, every mask (plain causal / full too), and one process under masks (``cu_seqlens``, ``window``,
``chunk_size``) or ``sinks`` (it runs the ring's planner alone): not sized by the closed forms above but by
replaying the plan it runs,
statement by statement (:mod:`seqpar.memory.masked`): each block's hops, the K/V a rank receives only while it
or a rank further on needs them, blocks it skips (an empty share), blocks in pieces (zeroed fp32 dK/dV, the
pieces' outputs one group at a time, small pieces stacked into one call, anti-causal pieces flipped), the own
block in pieces (zeroed accumulators), dK/dV accumulators that go home early (their sends held until the end of
the backward), the forward's merges over rows already reached, and the sink logits' merge and gradient. The
closed forms above assume every block is one kernel call making P - 1 hops; under masks that was -28% to +36% off
the measured peak, the replay is exact to the byte on CPU (19 cases, tests/test_memory_masks.py; and 14 plain
cases, where the closed form was -0.5% to +9.3% off). Ulysses under documents, a window or chunked attention runs
the ring's planner at P = 1 on each rank's heads over the sorted sequence: that inner attention is replayed on one
head chunk's head-layout sizes, beside the all-to-alls' moments above (+0.2% to +0.5% on 8 measured cases). An
uneven head split under a mask runs it once per GQA-regular piece, in turn (replayed as the uneven hybrid's inner
rings are, the earlier pieces' outputs kept, dout's and q/k/v's all-to-all send buffers too). Sinks with Ulysses:
the inner forward is that planner with the sink merge even on a dense mask (its backward the dense kernel's there),
``sink_grad`` runs before each chunk's inner backward (p and ``dout * out`` in the accumulation dtype, with dout's
and out's upcasts in low precision), and the sink logits and their zeroed gradient are counted. 20 measured sinks or
uneven cases are 0 to +0.7% over (tests/test_memory_masks_ulysses.py). The hybrid under masks or sinks:
the super-ranks' masked ring (the same sharding over P/u super-ranks of u L rows) is replayed, forward and backward,
on one head chunk's head-layout sizes (per GQA piece when uneven), with the sink terms as for Ulysses: 10 measured
cases within 0 to +0.8% (tests/test_memory_masks_hybrid.py); ``sharding='balanced'`` is refused with it as
:func:`seqpar.attention` refuses it. The all-gather under masks or sinks keeps its closed-form moments (the
gathers, the fp32 dK/dV slots of all ranks, the scatters in flight) with each K/V block's kernel transients
replayed (:func:`seqpar.memory.masked.allgather_block_peaks`: the pieces' dq/dk/dv, stacked and flipped copies; the
own block's apart from a remote one's, since they run beside different buffers), and the forward's pieces and merges
replayed: 11 measured cases exact to the byte (tests/test_memory_masks_allgather.py).

Head chunks (``head_chunks = G > 1``): the ring runs once per chunk of kv_heads / G heads. The
gradients ``dq, dk, dv`` are then full-size tensors filled chunk by chunk (Q + 2 K, fixed) and every
transient above (accumulators, buffers, kernel outputs) is one chunk's, i.e. divided by G (the ring's
fp32 accumulators are the gradients' own head slices when the inputs are in the accumulation dtype:
then none beside them). A strided slice is copied contiguous by each ring pass: its ``dout, k, v`` ((Q + 2 K) / G)
with ``layout="bshd"`` (Hugging Face's projections seen transposed: at every G, one pass included) or at batch > 1
in ``bhsd``, and its lse (lse / G) at batch > 1 (:func:`_pass_copies`).

All three include the inputs, the output and their gradients, i.e. what a training step holds for
the attention call. The forward peaks lower, except with few K/V heads (GQA), where the ring's backward
is small: there a forward merge (``q, k, v, dout``, the fp32 output accumulator, the block's output, the
K/V buffers, and the CPU merge's fp64 pieces of the accumulator and the block, at least 4 K elements
each, and its fp64 lse temporaries) can be the step's peak. The model describes the CPU
kernels; on CUDA the kernels' workspaces (and GQA's expanded K/V in the flash backend) add to it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from seqpar.attn.checks import check_dkv_wire, resolve_head_chunks
from seqpar.attn.common import AttentionOptions, dkv_wire_dtype
from seqpar.attn.masks import document_bounds, host_boundaries
from seqpar.attn.resolve import LAYOUTS
from seqpar.kernels.merge import cpu_merge_piece
from seqpar.memory.masked import (
    RowBytes,
    allgather_block_peaks,
    masked_ring_peak,
    ring_backward_peak,
    ring_forward_peak,
    ring_options,
)
from seqpar.memory.search import largest_fitting
from seqpar.sequence.sharding import num_chunks

__all__ = ["estimate_attention_memory", "ESTIMATOR_MODES", "max_seq_len", "as_dtype"]

ESTIMATOR_MODES = ("single", "ring", "allgather", "ulysses", "hybrid")


def as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A torch dtype from a dtype or its name (``"bf16"``, ``"bfloat16"``, ...)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp64": "float64"}.get(dtype, dtype)
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"dtype={dtype!r} is not a torch dtype; pass e.g. torch.bfloat16 or 'bfloat16'")
    return value


def estimate_attention_memory(
    seq_len: int,
    *,
    world_size: int,
    mode: str,
    batch: int,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype | str = torch.float32,
    causal: bool = True,
    head_chunks: int | str = "auto",
    ulysses_size: int | None = None,
    v_head_dim: int | None = None,
    dkv_wire_dtype: str = "fp32",
    cu_seqlens: object = None,
    window: int | None = None,
    chunk_size: int | None = None,
    sinks: bool = False,
    sharding: str | None = None,
    layout: str = "bhsd",
) -> int:
    """Peak bytes per rank of one attention forward + backward, inputs, output and gradients included.

    Args:
        seq_len: total sequence length S (over the whole SP group).
        world_size: SP group size P (``mode="single"`` ignores it: one process holds all of S).
        mode: ``"single"`` (alias ``"sdpa"``), ``"ring"``, ``"allgather"``, ``"ulysses"`` or ``"hybrid"``.
        batch, q_heads, kv_heads, head_dim: the attention shape (q_heads a multiple of kv_heads).
        dtype: the inputs' dtype (accumulators are fp32, fp64 for fp64 inputs).
        causal: causal attention (zigzag sharding for the distributed modes).
        head_chunks: :func:`seqpar.attention`'s ``head_chunks`` (an int dividing kv_heads, or "auto").
        ulysses_size: the hybrid's Ulysses degree u (divides world_size); required for ``"hybrid"``.
        v_head_dim: V's head dim where it differs from ``head_dim`` (MLA; see the module docstring).
        dkv_wire_dtype: :func:`seqpar.attention`'s ``dkv_wire_dtype`` (``"fp32"`` or ``"bf16"``): what the
            ring's (and the hybrid's inner ring's) travelling dK/dV accumulators are held and sent in.
        cu_seqlens, window, chunk_size: :func:`seqpar.attention`'s masks (global document boundaries
            ``(0, ..., seq_len)`` as ints or a tensor, a sliding window, chunked attention). With any of them,
            or ``sinks``, every mode (and one process) is sized by replaying the plan it runs
            (:mod:`seqpar.memory.masked`): which blocks each rank receives, skips, or runs in pieces.
        sinks: the call passes ``sinks`` (per-head sink logits).
        sharding: how the sequence is cut (``"contiguous"``, ``"zigzag"``, ``"balanced"``); ``None``: zigzag
            when causal on more than one rank, else contiguous (the plan, and so the peak, depend on it).
        layout: how q, k, v and the output's gradient lie in memory, as :func:`seqpar.attention`'s ``layout``:
            ``"bhsd"`` (contiguous ``(batch, heads, seq, dim)``) or ``"bshd"`` (``(batch, seq, heads, dim)``
            buffers, e.g. Hugging Face's projections seen transposed): the ring's contiguous copies of a pass's
            inputs depend on it (:func:`_pass_copies`); the other modes' estimates do not read it.
    Returns:
        bytes, an estimate of the per-rank peak (the largest over the ranks).
    Raises:
        ValueError: unknown mode, a sequence that does not split over the ranks, bad sizes, or a
            ``dkv_wire_dtype`` that :func:`seqpar.attention` refuses (``"bf16"`` with allgather / ulysses);
            the hybrid with ``sharding="balanced"``, or bad masks.
    """
    _check_sizes(mode, seq_len=seq_len, world_size=world_size, batch=batch, q_heads=q_heads, kv_heads=kv_heads,
                 head_dim=head_dim, v_head_dim=head_dim if v_head_dim is None else v_head_dim)
    check_dkv_wire(dkv_wire_dtype, mode)
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is invalid: pass 'bhsd' (batch, heads, seq, dim) or 'bshd' (batch, seq, "
                         "heads, dim), as seqpar.attention takes it")
    dt = as_dtype(dtype)
    mode, world, u, chunks = _effective_run(mode, seq_len=seq_len, world_size=world_size, causal=causal,
                                            q_heads=q_heads, kv_heads=kv_heads, head_chunks=head_chunks,
                                            ulysses_size=ulysses_size)
    sizes = _tensor_sizes(dt, rows=batch * (seq_len // world), q_heads=q_heads, kv_heads=kv_heads,
                          head_dim=head_dim if v_head_dim is None else (head_dim + v_head_dim) / 2,
                          wire=dkv_wire_dtype)
    masks = _mask_options(seq_len, world=world, causal=causal, cu_seqlens=cu_seqlens, window=window,
                          chunk_size=chunk_size, sinks=sinks, sharding=sharding, mode=mode)
    if masks is not None and mode in ("ulysses", "hybrid"):  # masks and / or sinks: the inner attention replayed
        inner = _InnerRing(causal=causal, seq_len=seq_len, batch=batch, dt=dt, wire=dkv_wire_dtype,
                           head_dim=head_dim if v_head_dim is None else v_head_dim, opts=masks, sinks=sinks)
        # the sink logits (q_heads,) throughout, and in the backward their zeroed gradient beside them
        sink_bytes = 2 * q_heads * torch.tensor([], dtype=dt).element_size() if sinks else 0
        return sink_bytes + _ulysses_peak(sizes, world=world, u=u, q_heads=q_heads, kv_heads=kv_heads, chunks=chunks,
                                          acc_bytes=8 if dt == torch.float64 else 4, inner=inner)
    if masks is not None and mode == "allgather":
        return _masked_allgather_peak(sizes, masks, dt=dt, world=world, seq_len=seq_len, chunks=chunks, batch=batch,
                                      q_heads=q_heads, head_dim=head_dim if v_head_dim is None else v_head_dim,
                                      sinks=sinks)
    if masks is not None:
        return _masked_peak(sizes, masks, dt=dt, world=world, seq_len=seq_len, chunks=chunks, batch=batch,
                            q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim if v_head_dim is None else v_head_dim,
                            wire=dkv_wire_dtype, sinks=sinks, layout=layout)
    if mode == "single":
        return _single_peak(sizes)
    if mode in ("ulysses", "hybrid"):
        inner = _InnerRing(causal=causal, seq_len=seq_len, batch=batch, dt=dt, wire=dkv_wire_dtype,
                           head_dim=head_dim if v_head_dim is None else v_head_dim)
        return _ulysses_peak(sizes, world=world, u=u, q_heads=q_heads, kv_heads=kv_heads, chunks=chunks,
                             acc_bytes=8 if dt == torch.float64 else 4, inner=inner)
    return _allgather_peak(sizes, world=world, chunks=chunks)  # the ring is replayed, above


class _Sizes(NamedTuple):
    """The per-rank tensor sizes in bytes the peaks are sums of (see the module docstring): ``Q`` and ``K``
    in the input dtype, ``Q32`` and ``K32`` in the accumulator's, the row log-sum-exp, ``low`` when
    the inputs are low precision (fp32 copies appear where the algorithms upcast), and ``Kw``: ``K`` in
    the dtype the ring's travelling dK/dV accumulators are held in (``dkv_wire_dtype``)."""

    Q: int
    K: int
    Q32: int
    K32: int
    lse: int
    low: bool
    Kw: int

    @property
    def base(self) -> int:
        """Always live: q, out, dout, k, v and the saved lse."""
        return 3 * self.Q + 2 * self.K + self.lse


def _check_sizes(mode: str, **sizes: int) -> None:
    if mode not in ESTIMATOR_MODES and mode != "sdpa":
        raise ValueError(f"mode={mode!r} is invalid: choose one of {list(ESTIMATOR_MODES)}")
    for name, value in sizes.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} is invalid: a positive integer is needed")
    if sizes["q_heads"] % sizes["kv_heads"]:
        raise ValueError(f"q_heads={sizes['q_heads']} is not a multiple of kv_heads={sizes['kv_heads']}")


def _effective_run(mode: str, *, seq_len: int, world_size: int, causal: bool, q_heads: int, kv_heads: int,
                   head_chunks: int | str, ulysses_size: int | None) -> tuple[str, int, int | None, int]:
    """The run the call really makes, ``(mode, world, ulysses degree u, head chunks)``: one rank runs plain
    SDPA, a hybrid with u = 1 is the ring and with u = P is Ulysses; Ulysses chunks its local K/V heads.
    Raises ValueError where the sequence or the heads do not split."""
    if mode == "sdpa":
        mode = "single"
    chunks = resolve_head_chunks(head_chunks, kv_heads)
    world = 1 if mode == "single" else world_size
    seq_chunks = 2 * world if (causal and world > 1) else world
    if seq_len % seq_chunks:
        raise ValueError(f"seq_len={seq_len} does not split into {seq_chunks} equal chunks for world_size={world}")
    if mode != "single" and world == 1:  # seqpar.attention runs plain SDPA on one rank
        mode = "single"
    u = world if mode == "ulysses" else ulysses_size
    if mode == "hybrid":
        if not isinstance(u, int) or u < 1 or world % u:
            raise ValueError(f"mode='hybrid' needs ulysses_size, a divisor of world_size={world}; got {u!r}")
        if u == 1:
            mode = "ring"
        elif u == world:
            mode = "ulysses"
    if mode in ("ulysses", "hybrid"):
        from seqpar.runtime.grid import ulysses_heads_problem, ulysses_shares, ulysses_split_even

        if problem := ulysses_heads_problem(q_heads, kv_heads, u):
            raise ValueError(f"{q_heads} query / {kv_heads} K/V heads cannot be split over {u} Ulysses ranks: {problem}")
        kv_max = max(share[3] for share in ulysses_shares(q_heads, kv_heads, u))
        chunks = resolve_head_chunks(head_chunks, kv_max)
        if not ulysses_split_even(q_heads, kv_heads, u):
            chunks = 1  # an uneven split runs one head pass (seqpar.attn.ulysses.UlyssesPlan)
    return mode, world, u, chunks


def _tensor_sizes(dt: torch.dtype, *, rows: int, q_heads: int, kv_heads: int, head_dim: float,
                  wire: str = "fp32") -> _Sizes:
    """The unit sizes over ``rows = batch * L`` local rows (``head_dim``: the mean of Q/K's and V's;
    ``wire``: the ``dkv_wire_dtype`` option, which sizes ``Kw``)."""
    e = torch.tensor([], dtype=dt).element_size()
    a = 8 if dt == torch.float64 else 4
    w = 2 if wire == "bf16" else a  # seqpar.attn.common.dkv_wire_dtype: bf16, else the accumulation dtype
    return _Sizes(Q=rows * q_heads * head_dim * e, K=rows * kv_heads * head_dim * e,
                  Q32=rows * q_heads * head_dim * a, K32=rows * kv_heads * head_dim * a,
                  lse=rows * q_heads * a, low=e != a, Kw=rows * kv_heads * head_dim * w)


def _mask_options(seq_len: int, *, world: int, causal: bool, cu_seqlens: object, window: int | None,
                  chunk_size: int | None, sinks: bool, sharding: str | None, mode: str) -> AttentionOptions | None:
    """The ring's options for a masked (or sinks) call, checked as :func:`seqpar.attention` checks them, and for
    every ring call (a plain causal / full mask is replayed too: the closed form it had, ``_ring_peak`` until
    session 27, was up to +9.3% high for causal, bf16 and head-chunked calls); None for a dense call of another mode without sinks (the
    closed forms)."""
    if cu_seqlens is None and window is None and chunk_size is None and not sinks and mode != "ring":
        return None  # one process runs plain SDPA; the other modes' closed forms
    if mode not in ("ring", "single", "ulysses", "hybrid", "allgather"):
        raise ValueError(
            f"the memory estimate models documents, windows, chunked attention and sinks for mode='ring', "
            f"'ulysses', 'hybrid' and one process, not mode={mode!r}: pass mode='ring', or leave out "
            f"cu_seqlens / window / chunk_size / sinks for the dense figure")
    bounds = None if cu_seqlens is None else host_boundaries(cu_seqlens)
    if bounds is not None:
        bounds = document_bounds(bounds, seq_len)
    for name, value in (("window", window), ("chunk_size", chunk_size)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{name}={value!r} is invalid: pass an int >= 1, or None")
    if sharding is None:
        sharding = "zigzag" if causal and world > 1 else "contiguous"
    if world == 1 or mode == "ulysses":
        sharding = "contiguous"  # one process (Ulysses: each rank's heads) holds the sequence in order
    if sharding not in ("contiguous", "zigzag", "balanced"):
        raise ValueError(f"sharding={sharding!r} is invalid: choose 'contiguous', 'zigzag' or 'balanced'")
    if mode == "hybrid" and sharding == "balanced":  # as seqpar.attention refuses it
        raise ValueError("mode='hybrid' does not take sharding='balanced' (its Ulysses groups' chunks are no "
                         "balanced layout over the super-ranks): pass sharding='zigzag' or 'contiguous'")
    if sharding != "contiguous":
        seq_chunks = num_chunks(world, sharding, seq_len=seq_len)
        if seq_len % seq_chunks:
            raise ValueError(f"seq_len={seq_len} does not split into {seq_chunks} equal chunks for "
                             f"sharding={sharding!r} and world_size={world}")
    return ring_options(causal=causal, sharding=sharding, window=window, cu_seqlens=bounds, chunk_size=chunk_size)


def _masked_peak(sizes: _Sizes, opts: AttentionOptions, *, dt: torch.dtype, world: int, seq_len: int, chunks: int,
                 batch: int, q_heads: int, kv_heads: int, head_dim: int, wire: str, sinks: bool,
                 layout: str = "bhsd") -> int:
    """The ring (or one process) under masks / sinks: :func:`seqpar.memory.masked.masked_ring_peak` on one head
    chunk's row sizes, plus what the closed forms add around a pass (the always-live tensors; with G > 1 the
    full-size gradients, out and lse; the pass's contiguous copies of strided inputs, :func:`_pass_copies`) and the
    sink gradient's moment."""
    Q, K, Q32, lse, base, low = sizes.Q, sizes.K, sizes.Q32, sizes.lse, sizes.base, sizes.low
    G, L = chunks, seq_len // world
    acc_dt = torch.float64 if dt == torch.float64 else torch.float32
    wire_dt = dkv_wire_dtype(wire, acc_dt)
    per = L * G
    units = RowBytes(q=Q / per, k=K / per, qa=Q32 / per, ka=sizes.K32 / per, kw=sizes.Kw / per, la=lse / per,
                     q_elems=batch * q_heads * head_dim / G, heads=batch * q_heads / G, acc8=acc_dt == torch.float64,
                     low=low, wire_is_acc=wire_dt == acc_dt, wire_is_input=wire_dt == dt,
                     kernel_grads_contiguous=kv_heads == G)
    into = G > 1 and not low
    bwd, fwd = masked_ring_peak(world=world, seq_local=L, opts=opts, units=units, into=into, cast=G == 1 and low,
                                sinks=sinks)
    moments = [2 * Q + 2 * K + fwd + ((Q + lse) if G > 1 else 0)]
    copies = _pass_copies(sizes, layout=layout, batch=batch, q_heads=q_heads, kv_heads=kv_heads, chunks=G)
    # G > 1: the gradients written chunk by chunk (Q + 2 K) beside the pass
    moments.append(base + (Q + 2 * K if G > 1 else 0) + bwd + copies)
    if sinks:  # seqpar.kernels.merge.sink_grad after the ring: the gradients, p, dout * out (and their upcasts)
        moments.append(base + Q + 2 * K + Q32 * (3 if low else 1) + lse)
    # the sink logits themselves, (q_heads,) in the inputs' dtype, alive throughout
    sink_param = q_heads * torch.tensor([], dtype=dt).element_size() if sinks else 0
    return int(max(moments) + sink_param)


def _pass_copies(sizes: _Sizes, *, layout: str, batch: int, q_heads: int, kv_heads: int, chunks: int) -> float:
    """The contiguous copies a ring backward pass (of G = ``chunks``, on its head chunk's slices) makes of strided
    inputs, alive through the pass (:func:`seqpar.attn.ring.ring_backward`): ``backward_layout`` copies ``dout``
    dense on CPU (Q / G), ``k, v = k.contiguous(), v.contiguous()`` copies k and v (2 K / G), and
    :func:`seqpar.attn.ring.ring_attention_backward` hands each pass ``lse[:, qs].contiguous()`` (lse / G). A
    ``(batch, heads, seq, dim)`` slice is strided when its tensor is ``bshd`` in memory with more than one head
    (a chunk of heads, or all of them, seen transposed: Hugging Face's q, k, v and o_proj's input gradient), or, in
    ``bhsd``, when G > 1 cuts its heads at batch > 1; lse (``(batch, heads, seq)``, made contiguous by the forward) only
    in the latter case. Recorded at the peak of tests/test_training_memory.py's FSDP2 ring setting (Hugging Face Llama,
    8 / 8 heads of 16, 4096 rows, G = 4, fp32): dout's copy (524,288 B) and k's and v's (2 x 524,288 B) beside the
    pass's buffers, which the estimate had left out (tests/test_est37_ring_copies.py)."""
    def strided(heads: int) -> bool:
        return heads > 1 if layout == "bshd" else batch > 1 and chunks > 1

    lse = sizes.lse if batch > 1 and chunks > 1 else 0
    return ((sizes.Q if strided(q_heads) else 0) + (2 * sizes.K if strided(kv_heads) else 0) + lse) / chunks


def _single_peak(sizes: _Sizes) -> int:
    """One process, SDPA on the whole sequence: + dq, dk, dv and one Q-sized kernel workspace."""
    Q, K = sizes.Q, sizes.K
    return int(sizes.base + (Q + 2 * K) + Q)


def _forward_merge_bytes(sizes: _Sizes, *, chunks: int = 1, acc_bytes: int = 4) -> float:
    """Forward, at a block's merge into one head chunk's accumulators (of G = ``chunks``; the K/V buffers
    apart): q, k, v, dout, and over the chunk's heads the fp32 out and lse accumulators, the block's output and
    lse, and the CPU merge's temporaries (:func:`seqpar.kernels.merge.merge_into`): the two lse in fp64 and
    the two softmax weights (fp64: 2 lse / G each when ``acc_bytes`` = 4), the empty-row mask (1 byte a row),
    and the accumulator's and the block's pieces upcast to fp64 (2 x 8 bytes a piece element; fp64
    accumulators are used as they are). A piece is 1/64 of the merged rows, but never under
    4 K elements nor over 16 K (:func:`seqpar.kernels.merge.cpu_merge_piece`): a chunk of at most 4 K output elements is
    upcast whole, one of up to 256 K in 4 K-element pieces (2 x 32 KiB), a larger one in pieces of up to 16 K
    (2 x 128 KiB). At S = 256 that was 27% of a GQA rank's peak (8 / 2 heads, P = 4, fp32: with few K/V heads
    the forward's merge, not the backward, is the peak; the estimate was 7.7% under with it left out)."""
    Q, K, Q32, lse = sizes.Q, sizes.K, sizes.Q32, sizes.lse
    G = chunks
    elems = Q32 / acc_bytes / G  # the chunk's output elements: a full-block merge covers all its rows
    piece = min(elems, cpu_merge_piece(int(elems)))
    upcast = 0 if acc_bytes == 8 else 2 * 8 * piece
    lse_tmp = (2 if acc_bytes == 8 else 4) * 8 / acc_bytes * lse / G + lse / acc_bytes / G
    return 2 * Q + 2 * K + (Q32 + Q + 2 * lse) / G + lse_tmp + upcast


def _masked_allgather_peak(sizes: _Sizes, opts: AttentionOptions, *, dt: torch.dtype, world: int, seq_len: int,
                           chunks: int, batch: int, q_heads: int, head_dim: int, sinks: bool) -> int:
    """All-gather under masks / sinks: :func:`_allgather_peak`'s moments (the gathers, the fp32 dK/dV slots of all
    ranks, the scatters in flight) with the per-block kernel terms replayed (:func:`seqpar.memory.masked.
    allgather_block_peaks`: a block's pieces, stacked and flipped copies; the forward's pieces and merges over rows
    reached before), plus sinks: the forward's sink merge, sink_grad after the backward beside the gradients (as for
    the ring), and the logits."""
    G, L = chunks, seq_len // world
    acc_dt = torch.float64 if dt == torch.float64 else torch.float32
    per = L * G
    units = RowBytes(q=sizes.Q / per, k=sizes.K / per, qa=sizes.Q32 / per, ka=sizes.K32 / per, kw=sizes.K32 / per,
                     la=sizes.lse / per, q_elems=batch * q_heads * head_dim / G, heads=batch * q_heads / G,
                     acc8=acc_dt == torch.float64, low=sizes.low, wire_is_acc=True, wire_is_input=not sizes.low)
    own, remote, fwd_block = allgather_block_peaks(world=world, seq_local=L, opts=opts, units=units)
    peak = _allgather_peak(sizes, world=world, chunks=chunks, kern=(own, remote), fwd_block=fwd_block)
    if not sinks:
        return peak
    e = torch.tensor([], dtype=dt).element_size()
    Q, K, lse = sizes.Q, sizes.K, sizes.lse
    sink_grad = sizes.base + Q + 2 * K + sizes.Q32 * (3 if sizes.low else 1) + lse
    return int(max(peak, sink_grad) + q_heads * e)  # the logits, alive throughout


def _allgather_peak(sizes: _Sizes, *, world: int, chunks: int, kern: tuple[float, float] | None = None,
                    fwd_block: float | None = None) -> int:
    """All-gather pipelined over G head chunks: the largest of the forward and each chunk's backward moments.
    ``kern``: ``(own, remote)``, the largest backward kernel transients of the own block and of a remote one
    (default: one call's dq, dk, dv each); ``fwd_block``: the forward's block output and merge temporaries (default:
    one call's output and 4 lse-sized temporaries); both replayed under masks (:func:`_masked_allgather_peak`)."""
    Q, K, Q32, K32, lse, low, base = sizes.Q, sizes.K, sizes.Q32, sizes.K32, sizes.lse, sizes.low, sizes.base
    # one chunk's gathered K/V (all ranks), its fp32 dK/dV (all ranks) and kernel outputs
    G = chunks
    Kc, K32c, Qc = K / G, K32 / G, Q / G
    gath, dkv = 2 * world * Kc, 2 * world * K32c
    kern_own, kern_remote = (Qc + 2 * Kc, Qc + 2 * Kc) if kern is None else kern
    fwd_block = Qc + 4 * lse / G if fwd_block is None else fwd_block
    grads = 2 * K  # dk, dv in the input dtype, made when chunk 0's scatter is done
    nxt = gath + 2 * Kc  # the next chunk's gather in flight: receive + packed send buffer
    prev = dkv + 2 * K32c  # the previous chunk's scatter in flight: input + output
    acc_b = base + Q32  # + the fp32 dq accumulator
    peaks = [2 * Q + 2 * K + Q32 + lse + gath + (nxt if G > 1 else 2 * Kc)
             + fwd_block]  # forward (the merge converts a block piece by piece: no upcast copies)
    for c in range(G):
        done = grads if c >= 2 else 0
        ahead = nxt if c < G - 1 else 0
        peaks.append(acc_b + done + gath + ahead + dkv + (prev if c >= 1 else 0) + kern_remote)  # a remote kernel
        if c < G - 1:  # the own block first, this chunk's gather (receive + send) in flight
            peaks.append(acc_b + done + gath + 2 * Kc + dkv + (prev if c >= 1 else 0) + kern_own)
        if c >= 1:  # waiting for the previous scatter (gloo copies its input meanwhile)
            peaks.append(acc_b + done + ahead + 3 * dkv + 2 * K32c)
    own = grads if G >= 2 else 0
    peaks.append(acc_b + own + dkv + 4 * K32c + kern_own)  # last chunk's own block, scatter in flight
    peaks.append(acc_b + own + 2 * dkv + 4 * K32c)
    peaks.append(acc_b + grads + 2 * K32c + (Q if low else 0))
    return int(max(peaks))


def _kv_buffers(K: float, world: int) -> float:
    """The ring's K/V receive buffers: double-buffered (the block in use and the next one in flight), but a
    single one at P = 2 (one remote step)."""
    return 2 * K if world == 2 else 4 * K


def _ring_backward_moments(sizes: _Sizes, *, world: int) -> tuple[float, float, float]:
    """The ring backward's transients beside the always-live tensors, for one pass over ``sizes``' heads:
    ``(accumulators, at a remote block's kernel, at the end)``. The accumulators ``dq_acc, dk_own, dv_own``
    (Q32 + 2 K32) are part of both moments; at a kernel, the K/V receive buffers, the travelling dK/dV
    accumulators (the pair sent and the pair received, wire dtype; none at P = 2, whose one remote block's
    share goes straight home after the kernel) and the kernel's outputs (plus their fp32 copies for low
    precision inputs); at the end, the K/V buffers, the last hop's dK/dV pair out and in (at P = 2: the
    remote block's share on its way home and our own block's coming home), and the final casts."""
    Q, K, Q32, K32, low, Kw = sizes.Q, sizes.K, sizes.Q32, sizes.K32, sizes.low, sizes.Kw
    acc = Q32 + 2 * K32  # dq_acc, dk_own, dv_own
    # one kernel call per block (dense masks): its dq is added into dq_acc in place, its dk, dv become the
    # block's share as they are, low precision too (no fp32 copies: those were +15% at 8 / 8 heads in bf16, P =
    # 4 and 8). Causal zigzag's calls over half a key block make less; their share's widened first hop (2 Kw) is
    # made at step 1, when no accumulator travels yet, and then is the pair sent on: counted in 4 Kw (it was
    # counted twice: +17.6% causal bf16, P = 4)
    kernel_out = Q + 2 * K
    convert = (Q + 2 * K) if low else 0  # final casts of the accumulators to the input dtype
    kv_bufs = _kv_buffers(K, world)
    at_kernel = acc + kv_bufs + (0 if world == 2 else 4 * Kw) + kernel_out
    at_end = acc + kv_bufs + 4 * Kw + convert
    return acc, at_kernel, at_end


class _InnerRing(NamedTuple):
    """What the hybrid's inner ring needs to be replayed (:func:`_inner_ring_backward`) beside the unit sizes."""

    causal: bool
    seq_len: int
    batch: int
    dt: torch.dtype
    wire: str
    head_dim: int
    opts: AttentionOptions | None = None  # the mask (Ulysses' inner attention at P = 1); None: plain
    sinks: bool = False  # the forward's sink merge (Ulysses' inner attention)


def _inner_ring(piece: _Sizes, inner: _InnerRing, *, ring: int, q_heads: float, kv_heads: float,
                forward: bool = False) -> float:
    """The inner ring's backward (``forward``: its forward) over ``piece``'s heads (``q_heads`` / ``kv_heads`` of them,
    in head layout: each over ``seq_len / ring`` rows), replayed as the ring's own plan is
    (:func:`seqpar.memory.masked.ring_backward_peak`, ``ring_forward_peak``): the largest live bytes beside its q, k,
    v, out, dout and lse (forward: beside q, k, v); the final casts of its accumulators and output included."""
    L = inner.seq_len // ring
    acc_dt = torch.float64 if inner.dt == torch.float64 else torch.float32
    wire_dt = dkv_wire_dtype(inner.wire, acc_dt)
    units = RowBytes(q=piece.Q / L, k=piece.K / L, qa=piece.Q32 / L, ka=piece.K32 / L, kw=piece.Kw / L,
                     la=piece.lse / L, q_elems=inner.batch * q_heads * inner.head_dim, heads=inner.batch * q_heads,
                     acc8=acc_dt == torch.float64, low=piece.low, wire_is_acc=wire_dt == acc_dt,
                     wire_is_input=wire_dt == inner.dt, kernel_grads_contiguous=kv_heads == 1)
    opts = inner.opts or ring_options(causal=inner.causal, sharding="zigzag" if inner.causal else "contiguous",
                                      window=None, cu_seqlens=None, chunk_size=None)
    if forward:
        return ring_forward_peak(world=ring, seq_local=L, opts=opts, units=units, sinks=inner.sinks)
    return ring_backward_peak(world=ring, seq_local=L, opts=opts, units=units, cast=piece.low)


def _ulysses_peak(sizes: _Sizes, *, world: int, u: int, q_heads: int, kv_heads: int, chunks: int,
                  acc_bytes: int = 4, inner: _InnerRing | None = None, rank: int | None = None) -> int:
    """Ulysses / hybrid peak (see the module docstring): at a backward kernel of the last head chunks, on
    the rank with the largest head share; an uneven split: the largest of each rank's own (``rank``), its query
    and K/V shares together (the largest query share and the largest K/V share can sit on different ranks).
    ``sizes.Kw``: ``K`` in the inner ring's dK/dV wire dtype. A hybrid (a ring of ``world / u`` super-ranks
    inside) is :func:`_hybrid_peak`."""
    from seqpar.runtime.grid import ulysses_split_even

    if world // u > 1:
        return _hybrid_peak(sizes, world=world, u=u, q_heads=q_heads, kv_heads=kv_heads, chunks=chunks,
                            acc_bytes=acc_bytes, inner=inner)
    uneven = not ulysses_split_even(q_heads, kv_heads, u)
    if uneven and rank is None:
        return max(_ulysses_peak(sizes, world=world, u=u, q_heads=q_heads, kv_heads=kv_heads, chunks=chunks,
                                 acc_bytes=acc_bytes, inner=inner, rank=r) for r in range(u))
    from seqpar.runtime.grid import ulysses_shares

    Q, K32, lse, base = sizes.Q, sizes.K32, sizes.lse, sizes.base
    G = chunks
    Qh, Kh, lse_h = _head_layout(sizes, u=u, q_heads=q_heads, kv_heads=kv_heads, rank=rank)[:3]
    # a rank's K/V heads over its L rows as every peer reads them (uneven: a K/V head two ranks read comes twice)
    kv_recv = sum(share[3] for share in ulysses_shares(q_heads, kv_heads, u)) / kv_heads
    fp32_dkv = uneven or kv_heads < u  # zeroed fp32 dK/dV, a K/V head's replicas summed into them
    saved = 2 * Qh + 2 * Kh + lse_h  # q, k, v, out (head layout) and lse
    grads = Q + (2 * K32 if fp32_dkv else 2 * sizes.K)
    grads_h = Qh + 2 * Kh  # one chunk's dq, dk, dv in head layout (times G)
    # at a kernel: dout (head layout), the kernel's outputs and its workspace (~2 Q), and with G > 1 the
    # previous chunk's packed grads all-to-all (send + receive) and, at a middle chunk (G > 2), the next chunk's
    # dout all-to-all: at G = 2 the first chunk has only the next dout's, the last only the previous grads', as in
    # the masked path's ``beside`` (both counted was +4.0% .. +9.9% over in P = 2 dense GQA at 2 head chunks, where
    # this moment is the peak: 8 / 4 and 16 / 4 heads, est31)
    at_kernel = (Qh + grads_h + 2 * Qh + (2 * grads_h + (2 * Qh if G > 2 else 0) if G > 1 else 0)) / G
    masked_fwd = 0.0
    if inner is not None and inner.opts is not None:  # a mask or sinks: the inner attention is the ring's planner
        # at P = 1 (a dense mask with sinks: its forward only, the backward is the dense kernel's)
        masked = not inner.opts.mask.dense
        Qh32, Kh32 = _head_layout(sizes, u=u, q_heads=q_heads, kv_heads=kv_heads, rank=rank)[3:]
        chunk = _Sizes(Q=Qh / G, K=Kh / G, Q32=Qh32 / G, K32=Kh32 / G, lse=lse_h / G, low=sizes.low, Kw=Kh32 / G)
        heads_q, heads_k = q_heads / u / G, kv_heads / u / G
        # dout (head layout), G > 1: the neighbours' all-to-alls, the previous chunk's packed grads (send + receive)
        # and the next chunk's dout (send + receive); both only at a middle chunk (G > 2). At G = 2 the first chunk
        # has only the next dout's, the last only the previous grads' (recorded at the measured peak, the last
        # chunk's inner backward: counting both was +4.74% over in P = 2 bf16 full window 40 + sinks, 2 chunks)
        beside = (Qh + (2 * grads_h + (2 * Qh if G > 2 else 0) if G > 1 else 0)) / G
        if uneven:  # one pass, one inner attention per GQA piece in turn (replayed), the earlier pieces' outputs
            # kept; dout's all-to-all send buffer (sequence layout) is freed by gloo's worker, not the wait
            if masked:
                at_kernel = Q + _uneven_inner_backward(sizes, u=u, q_heads=q_heads, kv_heads=kv_heads, ring=1,
                                                       inner=inner, rank=rank)
            masked_fwd = Q + 2 * sizes.K + _uneven_inner_backward(sizes, u=u, q_heads=q_heads, kv_heads=kv_heads,
                                                                   ring=1, inner=inner, forward=True, rank=rank)
        else:
            if masked:
                # beside the chunk's q, k, v, out, dout, lse: its accumulators, pieces and the final casts
                # (replayed); the chunk's head-layout dout and, G > 1, the neighbouring chunks' all-to-alls
                at_kernel = beside + _inner_ring(chunk, inner, ring=1, q_heads=heads_q, kv_heads=heads_k)
            # forward, at chunk c's inner attention: the saved chunks before it, its q, k, v, the next chunk's
            # q/k/v all-to-all (send + receive) and the previous chunk's output's, and its accumulators and pieces
            inner_fwd = _inner_ring(chunk, inner, ring=1, q_heads=heads_q, kv_heads=heads_k, forward=True)
            for c in sorted({0, min(1, G - 1), G - 1}):
                a2a = (2 * (Qh + 2 * Kh) if c < G - 1 else 0) + (2 * Qh if c >= 1 else 0)
                masked_fwd = max(masked_fwd, saved * c / G + (Qh + 2 * Kh + a2a) / G + inner_fwd)
        if inner.sinks:  # sink_grad before the chunk's inner backward: p (lse-sized), dout * out in the
            # accumulation dtype (and, low precision, dout's and out's upcasts), beside what a kernel has beside it
            # (even split: less the sequence-layout lse ``base`` counts, which Ulysses never makes: its lse is the
            # head layout's, in ``saved``; recorded at the measured peak, sink_grad's multiply, in P = 4 bf16 causal
            # documents + sinks MQA: +0.83% -> 0, est30)
            sink = ((Q + Qh if uneven else beside - lse * G) + (Qh32 * (3 if sizes.low else 1) + lse_h) / G)
            at_kernel = max(at_kernel, sink)
    if uneven:  # _uneven_backward on this rank (G = 1), dout's all-to-all send buffer (Q) held throughout
        # packing: the pieces' dq/dk/dv, their concatenation (more than one piece) and the packed send buffer
        at_pack = Q + grads_h * (3 if _pieces(q_heads, kv_heads, u, rank) > 1 else 2)
        # placing: dq, dk, dv made (grads) beside the send buffer and the receive buffer, every peer's share of
        # this rank's rows in sequence layout (a K/V head two ranks read comes twice). dout's send buffer is still
        # alive as dk, dv are zeroed, but gone by their casts (low precision: recorded at the measured peaks, fp32
        # at the zeroing and bf16 at the casts; counting both together was +3.2% .. +4.9% over in bf16 MHA)
        at_place = grads + grads_h + Q + 2 * sizes.K * kv_recv + max(Q, 2 * sizes.K if sizes.low else 0)
        bwd = max(at_place, at_pack, at_kernel)
    else:
        at_place, at_send = _grads_back_moments(Qh, Kh, G)
        bwd = grads + max(at_kernel, at_place, at_send)
    # forward: q, k, v, out + saved + the all-to-alls in flight
    a2a_fwd = (2 * Qh + 4 * Kh + 3 * Qh) / G
    if uneven:  # _uneven_forward: the q/k/v send buffer (every peer's share of this rank's rows) kept beside the
        # receive buffer as q_h, k_h, v_h are copied out, then beside the output's send and receive buffers
        a2a_fwd = Q + 2 * sizes.K * kv_recv + max(Qh + 2 * Kh, Qh + Q)
    fwd = max(base - Q - lse + saved + a2a_fwd, base - Q - lse + masked_fwd)
    return int(max(base + saved + bwd, fwd))


def _head_layout(sizes: _Sizes, *, u: int, q_heads: int, kv_heads: int,
                 rank: int | None = None) -> tuple[float, float, float, float, float]:
    """``(Qh, Kh, lse_h, Qh32, Kh32)``: the head-layout units of the rank with the largest share, its q_max
    query heads and kv_max K/V heads over u L rows (even: Q and K, or K u / kv_heads for a replicated K/V
    head), or of ``rank``'s own share; ``Qh32``, ``Kh32`` in the accumulation dtype."""
    from seqpar.runtime.grid import ulysses_shares

    shares = ulysses_shares(q_heads, kv_heads, u)
    if rank is not None:
        shares = shares[rank:rank + 1]
    qs, ks = u * max(s[1] for s in shares) / q_heads, u * max(s[3] for s in shares) / kv_heads
    return sizes.Q * qs, sizes.K * ks, sizes.lse * qs, sizes.Q32 * qs, sizes.K32 * ks


def _grads_back_moments(Qh: float, Kh: float, G: int) -> tuple[float, float]:
    """The even path's moments after a head chunk's inner backward, beside the gradients (of G chunks):
    ``(placing, sending)``. Placing a chunk's received grads: send + receive, and the K/V grads reordered
    for index_add (the next chunk's dout all-to-all in flight for G > 1). Sending a chunk's grads back
    (start_heads_back): the inner backward's outputs are still referenced while their packed send buffer
    and the all-to-all's receive buffer are made (3 grads_h), beside the previous chunk's pair still in
    flight (G > 1; it is placed after this start) and, but at the last chunk, the next chunk's dout
    all-to-all (G > 2: a middle chunk has both). The Ulysses even path's peak at head_chunks=1 (was left
    out: 8 / 8 heads, P = 4, -4.5% under the measured peak)."""
    grads_h = Qh + 2 * Kh
    at_place = (2 * grads_h + 2 * Kh + (2 * Qh if G > 1 else 0)) / G
    at_send = (3 * grads_h + (2 * grads_h if G > 1 else 0) + (2 * Qh if G > 2 else 0)) / G
    return at_place, at_send


def _hybrid_peak(sizes: _Sizes, *, world: int, u: int, q_heads: int, kv_heads: int, chunks: int,
                 acc_bytes: int = 4, inner: _InnerRing | None = None) -> int:
    """The hybrid's peak: Ulysses over u ranks around a ring of ``world / u`` super-ranks, run once per head
    chunk (G = ``chunks``) on that chunk's head-layout tensors. The inner ring's transients are the ring's own
    (:func:`_ring_backward_moments`, :func:`_forward_merge_bytes`) on one chunk's head-layout sizes, counted
    beside the all-to-alls that are in flight while it runs:

    - backward, at the inner ring's peak (a remote block's kernel, or its last dK/dV exchange) for chunk c:
      the chunk's head-layout dout, the next chunk's dout all-to-all (send + receive; c < G - 1) and the
      previous chunk's packed dq/dk/dv all-to-all (send + receive; c >= 1). The inner ring's fp32
      accumulators become the chunk's dq/dk/dv, so they are not counted again as kernel outputs, and there
      is no kernel workspace beside the ring's (the CPU kernels' are not tensors). An uneven split runs one
      pass whose dq, dk, dv are made after it; its dout all-to-all's send buffer (sequence layout, all query
      heads) is freed by gloo's worker thread, not at the wait (seen alive at the peak at P = 4, 7 / 7), so it
      counts, and with several GQA pieces the earlier pieces' outputs (at most one chunk's dq/dk/dv) too.
    - then the Ulysses moments of placing and sending a chunk's grads (:func:`_grads_back_moments`).
    - forward, for chunk c: the saved head-layout tensors of the chunks before it, this chunk's q, k, v, the
      next chunk's q/k/v all-to-all (c < G - 1), the previous chunk's output all-to-all (c >= 1), and the inner
      ring's K/V buffers and merge (fp32 output accumulator, block output, the CPU merge's fp64 pieces); or,
      after the ring, this chunk's saved tensors and its output's all-to-all (send + receive). An uneven split
      also keeps its q/k/v all-to-all's send buffer (as its dout's, above), and its pieces' inner rings, forward and
      backward, are replayed (:func:`_inner_ring`; a closed-form forward over the whole share was +9.1% in bf16).

    (Before: the inner ring's travelling dK/dV counted at a ring of 2, which sends its one remote share home
    after the kernel, a ~2 Q kernel workspace, and both neighbours' all-to-alls at every chunk: +13% at 8 / 2
    heads, P = 4, and +10% at 8 / 8, ``head_chunks=2``; and the kernel's outputs beside the accumulators left
    out: -3.5% at 8 / 8, P = 8, ``head_chunks=1``.)"""
    from seqpar.runtime.grid import ulysses_split_even

    Q, K, K32, base, low = sizes.Q, sizes.K, sizes.K32, sizes.base, sizes.low
    G, ring = chunks, world // u
    uneven = not ulysses_split_even(q_heads, kv_heads, u)
    Qh, Kh, lse_h, Qh32, Kh32 = _head_layout(sizes, u=u, q_heads=q_heads, kv_heads=kv_heads)
    fp32_dkv = uneven or kv_heads < u  # zeroed fp32 dK/dV, a K/V head's replicas summed into them
    saved = 2 * Qh + 2 * Kh + lse_h  # q, k, v, out (head layout) and lse, all chunks
    grads = Q + (2 * K32 if fp32_dkv else 2 * K)
    grads_h = Qh + 2 * Kh  # dq, dk, dv in head layout, all chunks
    # one chunk's head-layout tensors, as the inner ring sees them (its own q, k, v, ... and accumulators)
    ks = Kh / K
    chunk = _Sizes(Q=Qh / G, K=Kh / G, Q32=Qh32 / G, K32=Kh32 / G, lse=lse_h / G, low=low, Kw=sizes.Kw * ks / G)
    inner_bwd = max(_ring_backward_moments(chunk, world=ring)[1:])
    if inner is not None and not uneven:  # replayed, as the ring's own estimate is
        q_max, kv_max = Qh / sizes.Q * q_heads / u, Kh / K * kv_heads / u
        inner_bwd = _inner_ring(chunk, inner, ring=ring, q_heads=q_max / G, kv_heads=kv_max / G)
    # the forward merge's terms less the ring's own q, dout, k, v (counted as the chunk's, below)
    inner_fwd = (_kv_buffers(chunk.K, ring) + _forward_merge_bytes(chunk, acc_bytes=acc_bytes)
                 - 2 * chunk.Q - 2 * chunk.K)
    masked = inner is not None and inner.opts is not None  # a mask or sinks: the inner forward replayed too
    if masked and not uneven:
        q_max, kv_max = Qh / sizes.Q * q_heads / u, Kh / K * kv_heads / u
        inner_fwd = _inner_ring(chunk, inner, ring=ring, q_heads=q_max / G, kv_heads=kv_max / G, forward=True)
    sinks = masked and inner.sinks
    # sink_grad before a chunk's inner backward: p (lse-sized) and dout * out in the accumulation dtype (with
    # dout's and out's upcasts in low precision), beside the chunk's head-layout dout
    sink = (Qh + Qh32 * (3 if low else 1) + lse_h) / G
    bwd, fwd = [], []
    if uneven:  # one pass (G = 1); the grads are made after it, dout's send buffer is still alive
        bwd.append(Q + _uneven_inner_backward(sizes, u=u, q_heads=q_heads, kv_heads=kv_heads, ring=ring,
                                              inner=inner))
        # the pieces' dq/dk/dv, their concatenation (one piece: the same tensors) and the packed send buffer
        bwd.append(Q + (3 if _pieces(q_heads, kv_heads, u) > 1 else 2) * grads_h)
        if sinks:
            bwd.append(Q + sink)
    for c in sorted({0, min(1, G - 1), G - 1}):  # the first, a middle and the last chunk
        nxt, prev = c < G - 1, c >= 1
        if not uneven:
            around = (Qh + (2 * Qh if nxt else 0) + (2 * grads_h if prev else 0)) / G
            bwd.append(grads + around + inner_bwd)
            if sinks:
                bwd.append(grads + around - Qh / G + sink)
        a2a = (2 * (Qh + 2 * Kh) if nxt else 0) + (2 * Qh if prev else 0)  # next q/k/v, previous output
        kept = (Q + 2 * K) if uneven else 0  # the uneven q/k/v all-to-all's send buffer
        if uneven and inner is not None:  # one inner ring per GQA piece, in turn, replayed
            fwd.append(kept + _uneven_inner_backward(sizes, u=u, q_heads=q_heads, kv_heads=kv_heads, ring=ring,
                                                     inner=inner, forward=True))
        else:
            fwd.append(saved * c / G + (Qh + 2 * Kh + a2a) / G + kept + inner_fwd)
        fwd.append(saved * (c + 1) / G + (2 * Qh + a2a) / G + kept)
    at_place, at_send = _grads_back_moments(Qh, Kh, G)
    bwd.append(grads + (at_place if uneven else max(at_place, at_send)))
    return int(max(base + saved + max(bwd), base + max(fwd)))


def _uneven_inner_backward(sizes: _Sizes, *, u: int, q_heads: int, kv_heads: int, ring: int,
                           inner: _InnerRing | None = None, forward: bool = False, rank: int | None = None) -> float:
    """An uneven hybrid's inner backward on its busiest rank: the head-layout dout beside, per GQA-regular
    piece (:meth:`seqpar.attn.ulysses.HeadSplit.segments`, one inner ring each, in turn), the earlier pieces'
    dq/dk/dv and this piece's ring transients (replayed: :func:`_inner_ring`; without ``inner``,
    :func:`_ring_backward_moments` on the piece's heads). ``forward``: its inner forward instead, the head-layout
    q, k, v beside the earlier pieces' out and lse and this piece's ring forward (replayed). ``rank``: that rank's
    only (else the busiest)."""
    from seqpar.attn.ulysses import HeadSplit

    split = HeadSplit(q_heads, kv_heads, u)
    # one head over u L rows: query-sized and K/V-sized, in the input and the accumulation dtypes
    per_q, per_k = u / q_heads, u / kv_heads
    worst = 0.0
    for r in range(u) if rank is None else (rank,):
        done, peak = 0.0, 0.0
        for _, qn, _, kn in split.segments(r):
            piece = _Sizes(Q=sizes.Q * per_q * qn, K=sizes.K * per_k * kn, Q32=sizes.Q32 * per_q * qn,
                           K32=sizes.K32 * per_k * kn, lse=sizes.lse * per_q * qn, low=sizes.low,
                           Kw=sizes.Kw * per_k * kn)
            if inner is None:
                transients = max(_ring_backward_moments(piece, world=ring)[1:])
            else:
                transients = _inner_ring(piece, inner, ring=ring, q_heads=qn, kv_heads=kn, forward=forward)
            peak = max(peak, done + transients)
            # its dq, dk, dv (forward: out, lse) wait for the concatenation
            done += piece.Q + (piece.lse if forward else 2 * piece.K)
        _, qn, _, kn = split.share(r)
        held = sizes.Q * per_q * qn + (2 * sizes.K * per_k * kn if forward else 0)  # dout; forward: q, k, v
        worst = max(worst, held + peak)
    return worst


def _pieces(q_heads: int, kv_heads: int, u: int, rank: int | None = None) -> int:
    """The most kernel pieces a rank's uneven head share runs as (:meth:`seqpar.attn.ulysses.HeadSplit.segments`:
    a K/V head only partly read on a rank is a piece of its own), or ``rank``'s; one piece needs no
    concatenation."""
    from seqpar.attn.ulysses import HeadSplit

    split = HeadSplit(q_heads, kv_heads, u)
    return max(len(split.segments(r)) for r in (range(u) if rank is None else (rank,)))


def max_seq_len(
    budget_bytes: int,
    *,
    world_size: int,
    mode: str,
    batch: int,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype | str = torch.float32,
    causal: bool = True,
    multiple: int = 1,
    head_chunks: int | str = "auto",
    ulysses_size: int | None = None,
    v_head_dim: int | None = None,
    dkv_wire_dtype: str = "fp32",
    window: int | None = None,
    chunk_size: int | None = None,
    sinks: bool = False,
    sharding: str | None = None,
) -> int:
    """The largest S (a multiple of ``multiple`` and of the chunk count) whose :func:`estimate_attention_memory`
    fits ``budget_bytes`` per rank; 0 when even the smallest does not. ``window``, ``chunk_size``, ``sinks``,
    ``sharding``: as there (documents are not an option here: their boundaries fix S)."""
    world = 1 if mode in ("single", "sdpa") else world_size
    step = (2 * world if causal and world > 1 else world) * multiple

    def cost(n: int) -> int:
        return estimate_attention_memory(n * step, world_size=world_size, mode=mode, batch=batch, q_heads=q_heads,
                                         kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, causal=causal,
                                         head_chunks=head_chunks, ulysses_size=ulysses_size,
                                         v_head_dim=v_head_dim, dkv_wire_dtype=dkv_wire_dtype, window=window,
                                         chunk_size=chunk_size, sinks=sinks, sharding=sharding)

    return largest_fitting(cost, budget_bytes) * step
