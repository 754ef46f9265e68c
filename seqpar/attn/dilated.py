"""LongNet dilated attention (Ding et al., 2023, arXiv:2307.02486), exact and sequence-parallel.

Definition (the tests check it against explicit float64 masks)
----------------------------------------------------------------
A pattern ``(w, r)`` cuts the *global* sequence into segments of length ``w``; inside a segment the
positions ``o, o + r, o + 2r, ...`` (``o``: the head's offset, ``0 <= o < r``) take part, attention is
dense (causal: causal) over that sparsified subsequence, and each output row goes back to the
position it came from. Since ``r`` divides ``w`` and segments start at multiples of ``w``, the rows of
offset ``o`` are exactly the global positions ``p`` with ``p % r == o``.

Several patterns are mixed with weights proportional to their softmax denominators::

    lse_i = log sum_p exp(lse_{p,i}),    out_i = sum_p exp(lse_{p,i} - lse_i) * out_{p,i}

which is the log-sum-exp merge of :mod:`seqpar.kernels`. A row that pattern ``p`` does not select has
``lse_{p,i} = -inf`` and gets nothing from it; a row that no pattern selects gives 0 (and no gradient).
A key selected by two patterns counts once in each (the patterns' denominators add up).

Head layouts
------------
- ``"mixed"`` (the LongNet paper): every head mixes every pattern; in pattern ``(w, r)`` query head
  ``h`` uses offset ``h % r``, so together the heads cover every position.
- ``"grouped"`` (the layout of fkodom/dilated-attention-pytorch): the ``H`` query heads are split into
  ``len(patterns)`` equal groups; group ``i`` (heads ``[i*H/n, (i+1)*H/n)``) uses pattern ``i`` only,
  every head of the group with offset ``i % r_i`` -- the same heads, rows and segments as that
  library, so its checkpoints see the same pattern. Its output *scaling* is not reproduced: that
  library divides each group's output by a sum over the sequence and by the number of groups, whereas
  here each head returns the plain softmax attention of its pattern (0 on rows the pattern skips).

GQA: query head ``h`` reads kv head ``h // (q_heads // kv_heads)``; the offset follows the query head.

Algorithm
---------
For each pattern and offset the selected rows of a local shard are the strided view
``x[:, :, start::r]``; cut into segments it becomes ``(batch, heads, n_seg, w/r, head_dim)``, which is
gathered (one copy) into a compact ``(batch * n_seg, heads, w/r, head_dim)`` tensor, so *one*
:func:`~seqpar.kernels.block_forward` call handles every segment of a (pattern, offset). Its
``(out, lse)`` are merged in place into fp32 accumulators through the same strided views. No
``S x S`` mask is ever built: per head, a pattern costs ``(S/w) * (w/r)^2 = S*w/r^2`` score entries.
The backward repeats the gathers, calls :func:`~seqpar.kernels.block_backward` with the *merged*
``out``/``lse`` at the selected rows (which makes the per-pattern gradients add up exactly), and
scatter-adds dq/dk/dv (``index_add_`` over kv heads for GQA) into fp32 accumulators.

Sequence parallel (contiguous sharding, P ranks, ``seq_local = S / P``)
------------------------------------------------------------------------
- ``w`` divides ``seq_local`` (a *local* pattern): every segment lies inside one shard; no communication.
- ``seq_local`` divides ``w`` (a *spanning* pattern): a segment covers ``c = w / seq_local``
  consecutive ranks, and only those exchange anything: for each offset, the rows of K and V they hold
  at that offset (``1/r`` of their shard), through :class:`~seqpar.comm.segment.SegmentComm`
  point-to-point messages. ``mode="ring"``: the blocks travel round the ``c`` ranks one step at a time
  (the next transfer overlaps the current block's kernel; memory two blocks); under ``causal`` the ring
  becomes a chain that never carries a block to a rank before it. ``mode="allgather"``: every member
  sends its block straight to every member that needs it (memory ``c`` blocks). Backward: the K/V
  blocks are exchanged again, and each block's dK/dV contributions (fp32) go back to its owner --
  travelling with the block in ring mode (each hop's share computed first and added into the arriving
  accumulator only after its exchange's wait: :mod:`seqpar.comm.schedule`), sent directly in all-gather
  mode.
- Anything else is refused with a message naming the fix; so is zigzag sharding (see
  :func:`dilated_attention`).

Communication volume per rank and spanning pattern. Let ``B`` be the size of a member's K/V block:
``2 * batch * head_dim * sum_o kv_heads(o) * rows(o)`` elements (``kv_heads(o)``: kv heads the query
heads of offset ``o`` read; ``rows(o)``: the member's rows at offset ``o``, ``seq_local / r`` when
``r`` divides ``seq_local``). In the mixed layout without GQA, ``B = 2 * batch * kv_heads *
(seq_local / r) * head_dim``: ``1/r`` of a dense ring's K/V block. A kv head whose query heads use
``k`` distinct offsets sends ``k/r`` of its rows. Member ``i`` of ``c`` sends:

    =================  ==================  ======================================
    mode, mask         forward             backward
    =================  ==================  ======================================
    ring, full         (c-1) B             (c-1) B  +  (c-1) B in fp32 (dK/dV; bf16: half)
    ring, causal       (i+1) B, last: 0    same K/V as forward  +  i B in fp32
    allgather, full    (c-1) B             (c-1) B  +  (c-1) B in fp32
    allgather, causal  (c-1-i) B           (c-1-i) B  +  i B in fp32
    =================  ==================  ======================================

(a ring or chain forwards other members' blocks, so ``B`` there means the size of the block in
transit, which differs between members only when ``r`` does not divide ``seq_local``). Local patterns
send nothing. For comparison, dense ring attention sends ``(P-1) * 2 * batch * kv_heads * seq_local *
head_dim`` per rank in the forward.

Layouts: q ``(batch, q_heads, seq_local, head_dim)``, k/v ``(batch, kv_heads, seq_local, head_dim)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from seqpar.attn.checks import (
    check_across_ranks,
    check_dkv_wire,
    check_local,
    check_options,
    dkv_wire_digest,
)
from seqpar.attn.common import dkv_wire_dtype
from seqpar.comm.group_names import group_by_name, group_name
from seqpar.comm.ring import Pending
from seqpar.comm.segment import SegmentComm
from seqpar.kernels import (
    block_backward,
    block_forward,
    in_layout_of,
    lse_dtype,
    merge_into,
    output_like,
)
from seqpar.runtime.groups import resolve_group

__all__ = [
    "HEAD_LAYOUTS",
    "DilatedOptions",
    "OffsetPlan",
    "PatternPlan",
    "DilatedPlan",
    "check_pattern",
    "pattern_row",
    "plan_dilated",
    "dilated_forward",
    "dilated_backward",
    "DilatedAttention",
    "dilated_attention",
]

HEAD_LAYOUTS = ("mixed", "grouped")

_KV = 0  # SegmentComm channel of K/V blocks
_DKV = 1  # channel of dK/dV accumulators


# ------------------------------------------------------------------------------------------ options
@dataclass(frozen=True)
class DilatedOptions:
    """Static options of one dilated attention call."""

    segment_lengths: tuple[int, ...]
    """Segment length ``w`` of each pattern (global positions)."""
    dilation_rates: tuple[int, ...]
    """Dilation rate ``r`` of each pattern; divides its ``w``."""
    causal: bool = False
    """Causal within each sparsified segment."""
    scale: float = 1.0
    """Score multiplier (``head_dim ** -0.5`` by default in :func:`dilated_attention`)."""
    mode: str = "ring"
    """How spanning segments exchange K/V: ``"ring"`` or ``"allgather"``."""
    head_layout: str = "mixed"
    """``"mixed"`` or ``"grouped"`` (see the module docstring)."""
    dkv_wire_dtype: str = "fp32"
    """What the backward's dK/dV messages travel in: ``"fp32"`` (the accumulation dtype, exact) or
    ``"bf16"`` (half the bytes; the receiver adds them in fp32: not exact). See :mod:`seqpar.attn.ring`."""


def check_pattern(
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    *,
    head_layout: str = "mixed",
    q_heads: int | None = None,
    seq_local: int | None = None,
    world_size: int = 1,
) -> None:
    """Raise ``ValueError`` naming the fix unless the pattern fits these shapes.

    The checks that need no shapes (list lengths, positive integers, ``r | w``) match
    :class:`seqpar.config.PatternConfig`'s load-time ones; the shape-dependent ones (segment lengths
    against the sequence, head count for ``"grouped"``) run when ``q_heads`` / ``seq_local`` are given.
    """
    ws, rs = list(segment_lengths), list(dilation_rates)
    if head_layout not in HEAD_LAYOUTS:
        raise ValueError(f"head_layout={head_layout!r} is invalid: choose one of {list(HEAD_LAYOUTS)}")
    if not ws or not rs:
        raise ValueError(
            "dilated attention needs at least one pattern: pass segment_lengths=[...] and "
            "dilation_rates=[...] with one rate per segment length"
        )
    if len(ws) != len(rs):
        raise ValueError(
            f"segment_lengths has {len(ws)} entries but dilation_rates has {len(rs)}; "
            f"give one dilation rate per segment length"
        )
    for name, values in (("segment_lengths", ws), ("dilation_rates", rs)):
        for x in values:
            if isinstance(x, bool) or not isinstance(x, int) or x < 1:
                raise ValueError(f"{name}={values} is invalid: every entry must be a positive integer")
    for w, r in zip(ws, rs, strict=True):
        if w % r:
            raise ValueError(
                f"dilation rate {r} does not divide segment length {w}; choose a segment length that "
                f"is a multiple of its rate (e.g. {w - w % r or r}) or a rate that divides {w}"
            )
    if q_heads is not None and head_layout == "grouped" and q_heads % len(ws):
        raise ValueError(
            f"head_layout='grouped' splits the {q_heads} query heads evenly among the {len(ws)} patterns, "
            f"but {q_heads} is not a multiple of {len(ws)}; use a number of patterns that divides "
            f"{q_heads}, a head count that is a multiple of {len(ws)}, or head_layout='mixed'"
        )
    if seq_local is None:
        return
    # Traced with a symbolic local length (torch.compile, dynamic=True) each test below is one guard on the
    # call's validity, true for every valid length alike, so a new length reuses the graph. Two separate
    # tests of the straddle (``seq_local % w``, then ``w % seq_local``) guarded on which side held: a pattern
    # local at one length and spanning at the next recompiled. (A refusal's f-string of a symbolic length is a
    # graph break, dynamo's BUILD_STRING: the frame then runs eagerly and raises this message.)
    seq = seq_local * world_size
    for w in ws:
        if seq % w != 0:
            lcm = math.lcm(*ws)
            raise ValueError(
                f"segment length {w} does not divide the sequence length {seq} (= seq_local {seq_local} "
                f"x {world_size} ranks); pad the full sequence to a multiple of {lcm} (the lcm of the "
                f"segment lengths) or choose segment lengths that divide {seq}"
            )
        if world_size > 1 and (seq_local % w) * (w % seq_local) != 0:
            raise ValueError(
                f"segment length {w} and the local length seq_local={seq_local} (= {seq} / {world_size} "
                f"ranks) do not divide one another, so segments would straddle rank boundaries "
                f"unevenly; choose segment lengths that divide {seq_local} or are multiples of it, or a "
                f"number of ranks / padded length that makes them so"
            )


# --------------------------------------------------------------------------------------------- plan
@dataclass(frozen=True)
class OffsetPlan:
    """The query heads of one pattern that share one offset, and the rows they select."""

    offset: int
    """Global positions ``p`` with ``p % r == offset`` take part."""
    q_heads: slice
    """Query heads using this offset (a slice, so their accumulators are views)."""
    kv_heads: tuple[int, ...]
    """kv heads of the compact kernel call: either each distinct kv head once, in order, when every
    one serves the same number of the selected query heads (the kernel's GQA maps them), or one per
    query head."""
    start: int
    """First local row of this rank at this offset."""
    counts: tuple[int, ...]
    """Rows at this offset held by each member of this rank's segment group (spanning patterns), or
    ``(rows of this rank,)`` for local patterns."""


@dataclass(frozen=True)
class PatternPlan:
    """One pattern ``(w, r)`` as seen from one rank."""

    segment_length: int
    rate: int
    offsets: tuple[OffsetPlan, ...]
    span: int
    """Ranks per segment ``c`` (1: local pattern, segments inside the shard)."""
    first: int
    """SP rank of the first member of this rank's segment group (spanning patterns)."""
    index: int
    """This rank's position in its segment group."""
    n_seg: int
    """Segments (or segment parts) in this rank's shard: ``seq_local / w`` or 1."""


@dataclass(frozen=True)
class DilatedPlan:
    """Everything one rank needs for a dilated attention call."""

    opts: DilatedOptions
    patterns: tuple[PatternPlan, ...]
    rank: int
    world_size: int
    seq_local: int


def _kv_heads_for(q_heads: Sequence[int], group: int) -> tuple[int, ...]:
    kv = [h // group for h in q_heads]  # non-decreasing: q heads ascend
    distinct = sorted(set(kv))
    if len(kv) % len(distinct) == 0:
        per = len(kv) // len(distinct)
        if kv == [x for x in distinct for _ in range(per)]:
            return tuple(distinct)  # compact query head i reads compact kv head i // per
    return tuple(kv)


def _rows_at(offset: int, rate: int, sp_rank: int, seq_local: int) -> tuple[int, int]:
    """(start, count): local rows whose global position ``sp_rank * seq_local + row`` is ``offset`` mod ``rate``."""
    start = (offset - sp_rank * seq_local) % rate
    return start, max(0, -(-(seq_local - start) // rate))


def plan_dilated(
    opts: DilatedOptions, *, q_heads: int, kv_heads: int, seq_local: int, rank: int = 0, world_size: int = 1
) -> DilatedPlan:
    """The kernel calls and exchanges of SP rank ``rank``; the pattern must pass :func:`check_pattern`."""
    group = q_heads // kv_heads
    n_pat = len(opts.segment_lengths)
    patterns = []
    for p, (w, r) in enumerate(zip(opts.segment_lengths, opts.dilation_rates, strict=True)):
        if opts.head_layout == "mixed":
            head_sets = [(o, slice(o, q_heads, r)) for o in range(min(r, q_heads))]
        else:
            size = q_heads // n_pat
            head_sets = [(p % r, slice(p * size, (p + 1) * size))]
        span = max(1, w // seq_local)
        first = rank - rank % span
        offsets = []
        for o, heads in head_sets:
            start, _ = _rows_at(o, r, rank, seq_local)
            counts = tuple(_rows_at(o, r, first + j, seq_local)[1] for j in range(span))
            kv = _kv_heads_for(range(q_heads)[heads], group)
            offsets.append(OffsetPlan(o, heads, kv, start, counts))
        n_seg = seq_local // w if span == 1 else 1
        patterns.append(PatternPlan(w, r, tuple(offsets), span, first, rank - first, n_seg))
    return DilatedPlan(opts, tuple(patterns), rank, world_size, seq_local)


# ------------------------------------------------------------------------------ gathers / scatters
@dataclass(frozen=True)
class _Rows:
    """Rows ``start::step`` of a local shard, cut into ``n_seg`` segments of ``m`` rows."""

    start: int
    step: int
    n_seg: int
    m: int

    def view(self, x: Tensor) -> Tensor:
        """``(b, h, seq_local, *rest)`` -> strided view ``(b, h, n_seg, m, *rest)``."""
        return x[:, :, self.start :: self.step].unflatten(2, (self.n_seg, self.m))


def kv_index(off: OffsetPlan, q_heads: int, group: int, device: torch.device) -> Tensor:
    """``off.kv_heads`` as an index tensor, made on ``device`` by an arange (a tensor built from host
    ints would be a blocking host-to-device copy in every layer). The i-th entry is the kv head of the
    query head ``q[i * per]`` of the offset's heads ``q``, ``per`` = query heads per entry."""
    heads = range(q_heads)[off.q_heads]
    per = len(heads) // len(off.kv_heads)
    return torch.arange(heads.start, heads.stop, heads.step * per, device=device).div_(group, rounding_mode="floor")


def _my_rows(pat: PatternPlan, off: OffsetPlan) -> _Rows:
    return _Rows(off.start, pat.rate, pat.n_seg, off.counts[pat.index] // pat.n_seg)


def _compact(x5: Tensor) -> Tensor:
    """``(b, h, n_seg, m, *rest)`` -> ``(b * n_seg, h, m, *rest)``: segments folded into the batch (a copy)."""
    return x5.transpose(1, 2).flatten(0, 1)


def _uncompact(x: Tensor, batch: int) -> Tensor:
    """``(b * n_seg, h, m, *rest)`` -> view ``(b, h, n_seg, m, *rest)``, the inverse of :func:`_compact`."""
    return x.unflatten(0, (batch, -1)).transpose(1, 2)


def _gather_q(x: Tensor, rows: _Rows, heads: slice) -> Tensor:
    # (b, H, L, ...) -> (b * n_seg, h_sel, m, ...)
    return _compact(rows.view(x)[:, heads])


def _gather_kv(x: Tensor, rows: _Rows, idx: Tensor) -> Tensor:
    # (b, Hkv, L, d) -> (b, n_seg, Hkv, m, d) view -> select kv heads (the one copy) -> (b * n_seg, kv_sel, m, d)
    return rows.view(x).transpose(1, 2).index_select(2, idx).flatten(0, 1)


def _scatter_kv_(acc: Tensor, rows: _Rows, idx: Tensor, grad: Tensor) -> None:
    # grad (b * n_seg, kv_sel, m, d) added into the rows/heads of acc (b, Hkv, L, d); repeated heads add up
    b = acc.shape[0]
    rows.view(acc).transpose(1, 2).index_add_(2, idx, grad.unflatten(0, (b, -1)).to(acc.dtype))


def _pack(tensors: Sequence[Tensor]) -> Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _unpack(flat: Tensor, shapes: Sequence[tuple[int, ...]]) -> list[Tensor]:
    sizes = [math.prod(s) for s in shapes]
    return [t.view(s) for t, s in zip(flat.split(sizes), shapes, strict=True)]


def _block_shapes(
    pat: PatternPlan, member: int, batch: int, head_dim: int, v_head_dim: int
) -> list[tuple[int, ...]]:
    """Shapes of the K/V block of segment member ``member``: ``[K_o, V_o]`` per offset,
    ``(batch, kv_sel, rows, head_dim)`` and ``(batch, kv_sel, rows, v_head_dim)``."""
    shapes = []
    for off in pat.offsets:
        rows = (batch, len(off.kv_heads), off.counts[member])
        shapes += [(*rows, head_dim), (*rows, v_head_dim)]
    return shapes


# ------------------------------------------------------------------------- local patterns (no comm)
def _local_forward(q: Tensor, k: Tensor, v: Tensor, pat: PatternPlan, opts: DilatedOptions,
                   out_acc: Tensor, lse_acc: Tensor) -> None:
    b = q.shape[0]
    for off in pat.offsets:
        rows = _my_rows(pat, off)
        idx = kv_index(off, q.shape[1], q.shape[1] // k.shape[1], k.device)
        o, lse = block_forward(
            _gather_q(q, rows, off.q_heads), _gather_kv(k, rows, idx), _gather_kv(v, rows, idx),
            scale=opts.scale, causal=opts.causal,
        )
        merge_into(rows.view(out_acc)[:, off.q_heads], rows.view(lse_acc)[:, off.q_heads],
                   _uncompact(o, b), _uncompact(lse, b))


def _local_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                    pat: PatternPlan, opts: DilatedOptions,
                    dq_acc: Tensor, dk_acc: Tensor, dv_acc: Tensor) -> None:
    b = q.shape[0]
    for off in pat.offsets:
        rows = _my_rows(pat, off)
        idx = kv_index(off, q.shape[1], q.shape[1] // k.shape[1], k.device)
        dq, dk, dv = block_backward(
            _gather_q(dout, rows, off.q_heads), _gather_q(q, rows, off.q_heads),
            _gather_kv(k, rows, idx), _gather_kv(v, rows, idx),
            _gather_q(out, rows, off.q_heads), _gather_q(lse, rows, off.q_heads),
            scale=opts.scale, causal=opts.causal,
        )
        rows.view(dq_acc)[:, off.q_heads].add_(_uncompact(dq, b))
        _scatter_kv_(dk_acc, rows, idx, dk)
        _scatter_kv_(dv_acc, rows, idx, dv)


# ------------------------------------------------------------------- spanning patterns (exchanges)
class _Schedule:
    """Who attends whose block among the ``c`` members of a segment group, and in which ring round.

    Member ``i`` needs block ``j`` iff ``j <= i`` (causal) or always (full). Ring: in round ``s``
    member ``i`` holds block ``(i - s) mod c`` (full; ``c`` rounds) or ``i - s`` while ``>= 0``
    (causal: a chain ``j -> j+1 -> ... -> c-1`` that never wraps). The members holding block ``j``,
    in round order, are its *visitors*: ``c`` of them (full) or ``c - j`` (causal).
    """

    def __init__(self, span: int, index: int, causal: bool) -> None:
        self.c, self.me, self.causal = span, index, causal
        self.next, self.prev = (index + 1) % span, (index - 1) % span

    def origin(self, s: int) -> int | None:
        if s >= self.c:
            return None
        if self.causal:
            return self.me - s if self.me >= s else None
        return (self.me - s) % self.c

    def visitors(self, j: int) -> int:
        return self.c - j if self.causal else self.c

    def last_visitor(self, j: int) -> int:
        return self.c - 1 if self.causal else (j - 1) % self.c

    def needs(self, i: int, j: int) -> bool:
        return j <= i or not self.causal


class _Span:
    """This rank's part of one spanning pattern: its compact queries, its K/V block, and the block
    kernels against any member's block (packed flat, in the layout of :func:`_block_shapes`)."""

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, pat: PatternPlan, opts: DilatedOptions) -> None:
        self.pat, self.opts = pat, opts
        self.batch, self.head_dim, self.v_head_dim = q.shape[0], q.shape[-1], v.shape[-1]
        self.dtype, self.device = k.dtype, k.device
        self.rows = [_my_rows(pat, off) for off in pat.offsets]
        self.idx = [kv_index(off, q.shape[1], q.shape[1] // k.shape[1], k.device) for off in pat.offsets]
        self.q = [_gather_q(q, r, off.q_heads) for r, off in zip(self.rows, pat.offsets, strict=True)]
        own = []
        for r, i in zip(self.rows, self.idx, strict=True):
            own += [_gather_kv(k, r, i), _gather_kv(v, r, i)]
        self.own = _pack(own)

    def shapes(self, j: int) -> list[tuple[int, ...]]:
        return _block_shapes(self.pat, j, self.batch, self.head_dim, self.v_head_dim)

    def numel(self, j: int) -> int:
        return sum(math.prod(s) for s in self.shapes(j))

    def empty(self, j: int, dtype: torch.dtype | None = None) -> Tensor:
        return torch.empty(self.numel(j), dtype=dtype or self.dtype, device=self.device)

    def _pairs(self, j: int) -> list[int]:
        me = self.pat.index
        return [n for n, off in enumerate(self.pat.offsets) if off.counts[me] and off.counts[j]]

    def forward(self, j: int, kv: Tensor, out_acc: Tensor, lse_acc: Tensor) -> None:
        blocks = _unpack(kv, self.shapes(j))
        causal = self.opts.causal and j == self.pat.index  # diagonal block; others fully visible
        for n in self._pairs(j):
            off, rows = self.pat.offsets[n], self.rows[n]
            o, lse = block_forward(self.q[n], blocks[2 * n], blocks[2 * n + 1], scale=self.opts.scale, causal=causal)
            merge_into(rows.view(out_acc)[:, off.q_heads], rows.view(lse_acc)[:, off.q_heads],
                       _uncompact(o, self.batch), _uncompact(lse, self.batch))

    def prepare_backward(self, dout: Tensor, out: Tensor, lse: Tensor) -> None:
        pairs = list(zip(self.rows, self.pat.offsets, strict=True))
        self.dout = [_gather_q(dout, r, off.q_heads) for r, off in pairs]
        self.out = [_gather_q(out, r, off.q_heads) for r, off in pairs]
        self.lse = [_gather_q(lse, r, off.q_heads) for r, off in pairs]

    def backward(self, j: int, kv: Tensor, dkv_acc: Tensor, dq_acc: Tensor) -> None:
        """Add block ``j``'s share of dq into ``dq_acc`` and its dK/dV into ``dkv_acc`` (packed, fp32)."""
        blocks, grads = _unpack(kv, self.shapes(j)), _unpack(dkv_acc, self.shapes(j))
        causal = self.opts.causal and j == self.pat.index
        for n in self._pairs(j):
            off, rows = self.pat.offsets[n], self.rows[n]
            dq, dk, dv = block_backward(
                self.dout[n], self.q[n], blocks[2 * n], blocks[2 * n + 1], self.out[n], self.lse[n],
                scale=self.opts.scale, causal=causal,
            )
            rows.view(dq_acc)[:, off.q_heads].add_(_uncompact(dq, self.batch))
            grads[2 * n].add_(dk)
            grads[2 * n + 1].add_(dv)

    def scatter_own(self, dkv_acc: Tensor, dk_acc: Tensor, dv_acc: Tensor) -> None:
        """Add this rank's finished (packed) dK/dV into the full-shard accumulators."""
        grads = _unpack(dkv_acc, self.shapes(self.pat.index))
        for n, (rows, idx) in enumerate(zip(self.rows, self.idx, strict=True)):
            if rows.m:
                _scatter_kv_(dk_acc, rows, idx, grads[2 * n])
                _scatter_kv_(dv_acc, rows, idx, grads[2 * n + 1])


def _span_forward(span: _Span, comm: SegmentComm, out_acc: Tensor, lse_acc: Tensor) -> None:
    sch = _Schedule(span.pat.span, span.pat.index, span.opts.causal)
    me, c = sch.me, sch.c
    if span.opts.mode == "allgather":
        sends = [(i, span.own) for i in range(c) if i != me and sch.needs(i, me)]
        recvs = [(j, span.empty(j)) for j in range(c) if j != me and sch.needs(me, j)]
        pending = comm.exchange(sends, recvs, channel=_KV)
        span.forward(me, span.own, out_acc, lse_acc)  # overlaps the exchange
        for (j, _), kv in zip(recvs, pending.wait(), strict=True):
            span.forward(j, kv, out_acc, lse_acc)
        return
    cur = span.own
    for s in range(c):
        j, j_next = sch.origin(s), sch.origin(s + 1)
        sends = [(sch.next, cur)] if j is not None and s + 1 < sch.visitors(j) else []
        recvs = [(sch.prev, span.empty(j_next))] if j_next is not None else []
        pending = comm.exchange(sends, recvs, channel=_KV) if sends or recvs else None
        if j is not None:
            span.forward(j, cur, out_acc, lse_acc)  # overlaps the next block's transfer
        if pending is not None:
            received = pending.wait()
            if recvs:
                cur = received[0]


def _span_backward(span: _Span, comm: SegmentComm, dq_acc: Tensor, dk_acc: Tensor, dv_acc: Tensor) -> None:
    sch = _Schedule(span.pat.span, span.pat.index, span.opts.causal)
    me, c = sch.me, sch.c
    acc = lse_dtype(span.dtype)
    wire = dkv_wire_dtype(span.opts.dkv_wire_dtype, acc)  # dK/dV messages; every sum stays in acc
    own_acc = torch.zeros_like(span.own, dtype=acc)
    if span.opts.mode == "allgather":
        sends = [(i, span.own) for i in range(c) if i != me and sch.needs(i, me)]
        recvs = [(j, span.empty(j)) for j in range(c) if j != me and sch.needs(me, j)]
        pending = comm.exchange(sends, recvs, channel=_KV)
        span.backward(me, span.own, own_acc, dq_acc)
        shares = []
        for (j, _), kv in zip(recvs, pending.wait(), strict=True):
            share = torch.zeros(kv.numel(), dtype=acc, device=kv.device)
            span.backward(j, kv, share, dq_acc)
            shares.append((j, share.to(wire)))  # (no copy for the default wire)
        # the dual of the forward's sends: every block's dK/dV share goes back to its owner
        back = [(i, span.empty(me, wire)) for i, _ in sends]
        for share in comm.exchange(shares, back, channel=_DKV).wait():
            own_acc += share
        span.scatter_own(own_acc, dk_acc, dv_acc)
        return

    # Ring/chain: K/V move exactly as in the forward. The accumulator of block j starts at its first
    # visitor after j (round 1), travels with the block, and its last visitor sends it home, where j
    # adds it to its own (diagonal) share -- (visitors - 1) fp32 messages per block.
    # Each accumulator exchange is waited one round later, after that round's kernels, right before the
    # add into the received accumulator (wait where the buffer is first touched: seqpar.comm.schedule);
    # a round's share is computed into its own buffer so the kernels need not wait for the transfer.
    cur, travelling = span.own, None
    acc_pending: Pending | None = None  # the last round's accumulator exchange (fills travelling / home)
    home: Tensor | None = None
    for s in range(c):
        j, j_next = sch.origin(s), sch.origin(s + 1)
        sends = [(sch.next, cur)] if j is not None and s + 1 < sch.visitors(j) else []
        recvs = [(sch.prev, span.empty(j_next))] if j_next is not None else []
        kv_pending = comm.exchange(sends, recvs, channel=_KV) if sends or recvs else None
        share: Tensor | None = None
        if j is not None:
            if s == 0:
                span.backward(me, cur, own_acc, dq_acc)
            else:
                share = torch.zeros(cur.numel(), dtype=acc, device=cur.device)
                span.backward(j, cur, share, dq_acc)
        if acc_pending is not None:
            acc_pending.wait()  # fills travelling / home in place
            acc_pending = None
        acc_sends: list[tuple[int, Tensor]] = []
        if share is not None:
            if travelling is None:  # the first visitor after the owner starts the accumulator
                travelling = share.to(wire)  # (no copy for the default wire)
            else:  # received in the wire dtype; the add runs in acc and rounds once (ring.py)
                travelling += share
            dest = sch.next if s + 1 < sch.visitors(j) else j
            acc_sends.append((dest, travelling))
        del share
        acc_recvs: list[tuple[int, Tensor]] = []
        next_acc = None
        if j_next is not None and s + 1 >= 2:  # block j_next's accumulator, from its previous visitor
            next_acc = torch.empty(span.numel(j_next), dtype=wire, device=cur.device)
            acc_recvs.append((sch.prev, next_acc))
        home_round = sch.visitors(me) - 1
        if s == home_round and home_round >= 1:  # own block's accumulator, from its last visitor
            home = torch.empty_like(own_acc, dtype=wire)
            acc_recvs.append((sch.last_visitor(me), home))
        acc_pending = comm.exchange(acc_sends, acc_recvs, channel=_DKV) if acc_sends or acc_recvs else None
        if kv_pending is not None:
            received = kv_pending.wait()  # the next round's K/V: touched by its kernels
            if recvs:
                cur = received[0]
        travelling = next_acc
    if acc_pending is not None:
        acc_pending.wait()
    if home is not None:
        own_acc += home
    span.scatter_own(own_acc, dk_acc, dv_acc)


# ---------------------------------------------------------------------------- forward / backward
def dilated_forward(
    q: Tensor, k: Tensor, v: Tensor, plan: DilatedPlan, comms: dict[int, SegmentComm]
) -> tuple[Tensor, Tensor]:
    """Merged ``out`` (fp32/fp64 accumulator ``(batch, q_heads, seq_local, v_head_dim)``, laid out in memory
    as q is) and ``lse`` ``(batch, q_heads, seq_local)``.

    ``comms[p]`` is the segment communicator of spanning pattern ``p`` (absent for local patterns).
    """
    acc = lse_dtype(q.dtype)
    # the empty partial (out 0, lse -inf), out in q's memory order (a Hugging Face q is a (batch, seq, heads, dim)
    # buffer seen transposed): the output then is too, as seqpar.attention's, with no copy where q's dtype is acc
    out_acc = output_like(q, v.shape[-1], dtype=acc).zero_()
    lse_acc = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
    for p, pat in enumerate(plan.patterns):
        if pat.span == 1:
            _local_forward(q, k, v, pat, plan.opts, out_acc, lse_acc)
        else:
            _span_forward(_Span(q, k, v, pat, plan.opts), comms[p], out_acc, lse_acc)
    return out_acc, lse_acc


def dilated_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    plan: DilatedPlan, comms: dict[int, SegmentComm],
) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv in the input dtypes, given the forward's merged ``out`` (input dtype) and ``lse``."""
    acc = lse_dtype(q.dtype)
    dout = dout.contiguous()
    dq_acc = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk_acc = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv_acc = torch.zeros(v.shape, dtype=acc, device=v.device)
    for p, pat in enumerate(plan.patterns):
        if pat.span == 1:
            _local_backward(dout, q, k, v, out, lse, pat, plan.opts, dq_acc, dk_acc, dv_acc)
        else:
            span = _Span(q, k, v, pat, plan.opts)
            span.prepare_backward(dout, out, lse)
            _span_backward(span, comms[p], dq_acc, dk_acc, dv_acc)
    return dq_acc.to(q.dtype), dk_acc.to(k.dtype), dv_acc.to(v.dtype)


def output_in_layout(out_acc: Tensor, q: Tensor) -> Tensor:
    """The merged accumulator ``(batch, q_heads, seq_local, v_head_dim)`` as the output, in q's dtype and laid
    out in memory as q is (:func:`seqpar.kernels.output_like`), eager and compiled alike: ``out_acc`` itself
    when it already is (no copy), else copied into a fresh buffer that is."""
    if out_acc.dtype == q.dtype and in_layout_of(out_acc, q):
        return out_acc
    return output_like(q, out_acc.shape[-1]).copy_(out_acc)


class DilatedAttention(torch.autograd.Function):
    """Thin autograd wrapper of :func:`dilated_forward` / :func:`dilated_backward`. The backward
    repeats the forward's exchanges and sends every dK/dV share back to the block's owner (their dual)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, plan: DilatedPlan, comms: dict[int, SegmentComm]) -> Tensor:  # noqa: ANN001
        out_acc, lse = dilated_forward(q, k, v, plan, comms)
        out = output_in_layout(out_acc, q)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.comms = plan, comms
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):  # noqa: ANN001, ANN205
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = dilated_backward(dout, q, k, v, out, lse, ctx.plan, ctx.comms)
        return dq, dk, dv, None, None


# ------------------------------------------------------------------------------ compiled: custom ops
# Spanning segments exchange K/V rows point to point, which dynamo cannot trace: while it traces,
# dilated_attention runs the call as one forward and one backward torch.library op (seqpar::dilated_fwd /
# seqpar::dilated_bwd), opaque to dynamo and joined by a registered autograd formula, as seqpar.attn.ops does
# for the dense algorithms. Inside, the eager plan and algorithm run unchanged, so results and transfers are
# eager's. The group travels by name, DilatedOptions as its flat fields. Layouts as above; the op's output is
# laid out as q, lse (batch, q_heads, seq_local) in fp32 (fp64 for fp64 inputs).
def _plan(q: Tensor, k: Tensor, group: str, segment_lengths: list[int], dilation_rates: list[int], causal: bool,
          scale: float, mode: str, head_layout: str, dkv_wire_dtype: str) -> tuple[DilatedPlan, dict[int, SegmentComm]]:
    pg = group_by_name(group)
    opts = DilatedOptions(segment_lengths=tuple(segment_lengths), dilation_rates=tuple(dilation_rates), causal=causal,
                          scale=scale, mode=mode, head_layout=head_layout, dkv_wire_dtype=dkv_wire_dtype)
    rank, world = (0, 1) if pg is None else (dist.get_rank(pg), dist.get_world_size(pg))
    plan = plan_dilated(opts, q_heads=q.shape[1], kv_heads=k.shape[1], seq_local=q.shape[2], rank=rank, world_size=world)
    return plan, {p: SegmentComm(pg, pat.first, pat.span) for p, pat in enumerate(plan.patterns) if pat.span > 1}


@torch.library.custom_op("seqpar::dilated_fwd", mutates_args=())
def dilated_fwd(
    q: Tensor, k: Tensor, v: Tensor, group: str, segment_lengths: list[int], dilation_rates: list[int], causal: bool,
    scale: float, mode: str, head_layout: str, dkv_wire_dtype: str,
) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` of one rank (see the module)."""
    plan, comms = _plan(q, k, group, segment_lengths, dilation_rates, causal, scale, mode, head_layout, dkv_wire_dtype)
    out_acc, lse = dilated_forward(q, k, v, plan, comms)
    lse = lse.contiguous()  # the fake's layout (see seqpar.attn.ops)
    # a custom op's outputs have the fake's layout (q's) and never alias an input: the accumulator is a fresh buffer
    return output_in_layout(out_acc, q), lse


@dilated_fwd.register_fake
def _(q, k, v, group, segment_lengths, dilation_rates, causal, scale, mode, head_layout, dkv_wire_dtype):  # noqa: ANN001, ANN202
    return output_like(q, v.shape[-1]), q.new_empty(q.shape[:-1], dtype=lse_dtype(q.dtype))


@torch.library.custom_op("seqpar::dilated_bwd", mutates_args=())
def dilated_bwd(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, group: str, segment_lengths: list[int],
    dilation_rates: list[int], causal: bool, scale: float, mode: str, head_layout: str, dkv_wire_dtype: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` in the inputs' dtypes, each laid out as its input."""
    plan, comms = _plan(q, k, group, segment_lengths, dilation_rates, causal, scale, mode, head_layout, dkv_wire_dtype)
    grads = dilated_backward(dout, q, k, v, out, lse, plan, comms)
    return tuple(torch.empty_like(x).copy_(g) if g.stride() != x.stride() or g.data_ptr() == x.data_ptr() else g
                 for g, x in zip(grads, (q, k, v)))


@dilated_bwd.register_fake
def _(dout, q, k, v, out, lse, group, segment_lengths, dilation_rates, causal, scale, mode, head_layout,  # noqa: ANN001, ANN202
      dkv_wire_dtype):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:  # noqa: ANN001
    q, k, v, *rest = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.mark_non_differentiable(lse)
    ctx.rest = rest  # the group's name and the flat options: primitives


def _backward(ctx, dout: Tensor, dlse: Tensor | None):  # noqa: ANN001, ANN202
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = dilated_bwd(dout, q, k, v, out, lse, *ctx.rest)
    return dq, dk, dv, *([None] * len(ctx.rest))


dilated_fwd.register_autograd(_backward, setup_context=_setup_context)


def _compiled_dilated(q: Tensor, k: Tensor, v: Tensor, opts: DilatedOptions, group: dist.ProcessGroup | None) -> Tensor:
    """One checked dilated call (``opts`` resolved, the mode chosen) as the custom ops; q, k, v ``bhsd``.
    Returns ``(batch, q_heads, seq_local, v_head_dim)`` in q's dtype."""
    out, _ = dilated_fwd(q, k, v, group_name(group), list(opts.segment_lengths), list(opts.dilation_rates),
                         opts.causal, opts.scale, opts.mode, opts.head_layout, opts.dkv_wire_dtype)
    return out


# ---------------------------------------------------------------------------------- public entry
def pattern_row(
    segment_lengths: Sequence[int], dilation_rates: Sequence[int], head_layout: str
) -> list[int]:
    """The dilated pattern as integers for the cross-rank check (invalid entries become -1; they are
    refused by :func:`check_pattern` right after)."""

    def ints(xs: Sequence[int]) -> list[int]:
        return [x if isinstance(x, int) and not isinstance(x, bool) else -1 for x in xs]

    layout = HEAD_LAYOUTS.index(head_layout) if head_layout in HEAD_LAYOUTS else -1
    return [len(segment_lengths), *ints(segment_lengths), len(dilation_rates), *ints(dilation_rates), layout]


def dilated_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    causal: bool = False,
    scale: float | None = None,
    mode: str = "ring",
    group: dist.ProcessGroup | None = None,
    sharding: str = "contiguous",
    head_layout: str = "mixed",
    check_inputs: bool = True,
    dkv_wire_dtype: str = "fp32",
) -> Tensor:
    """LongNet dilated attention of this rank's queries over the sequence held by the SP group.

    Args:
        q: ``(batch, q_heads, seq_local, head_dim)``, this rank's contiguous shard of the queries.
        k, v: ``(batch, kv_heads, seq_local, head_dim)``; q_heads a multiple of kv_heads (GQA/MQA);
            v's head dim may differ (MLA), the output then has v's.
        segment_lengths: segment length ``w`` of each pattern, in global positions; each divides the
            global length ``seq_local * P`` and, for ``P > 1``, divides or is a multiple of ``seq_local``.
        dilation_rates: dilation rate ``r`` of each pattern; ``r`` divides its ``w``.
        causal: causal within each sparsified segment.
        scale: score multiplier, default ``head_dim ** -0.5``.
        mode: how segments spanning several ranks exchange their selected K/V rows: ``"ring"`` or
            ``"allgather"`` (see the module docstring for volumes).
        group: the SP process group; ``None`` = the default manager's SP group, or a single
            process when torch.distributed is not initialised (or has one rank); without a manager on a
            world > 1 it is an error: call ``seqpar.init_process_groups(...)`` first, or pass
            ``group=torch.distributed.group.WORLD`` to use the whole world on purpose.
        sharding: must be ``"contiguous"`` (LongNet segments are contiguous position ranges).
        head_layout: ``"mixed"`` (LongNet: head h uses offset h mod r in every pattern) or
            ``"grouped"`` (heads split evenly among the patterns; dilated-attention-pytorch's layout).
        check_inputs: all-gather a few integers first so that ranks passing different shapes all raise.
        dkv_wire_dtype: what the backward's dK/dV messages travel in, in both modes: ``"fp32"`` (default,
            exact) or ``"bf16"`` (half their bytes; each receiver adds them in fp32, not exact), as in
            :func:`seqpar.attention`.
    Returns:
        ``(batch, q_heads, seq_local, head_dim)`` in q's dtype and the same sharding.
    Raises:
        ValueError / TypeError naming the problem and the fix.
    """
    check_options(mode, sharding)
    if sharding != "contiguous":
        raise ValueError(
            "dilated attention needs sharding='contiguous': its segments are contiguous ranges of "
            "positions, and with contiguous shards local segments need no communication and every rank "
            "already does the same work, which is what zigzag buys dense causal attention. Shard the "
            "sequence with seqpar.shard_sequence(x, dim, sharding='contiguous')"
        )
    if mode in ("ulysses", "hybrid"):
        raise ValueError(
            f"dilated attention runs with mode='ring' or 'allgather' (or 'auto', which picks one of them), "
            f"not mode={mode!r}: its segments exchange selected rows between the ranks of a segment"
        )
    group = resolve_group(group)
    world = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    if check_inputs and world > 1:
        # The pattern decides which K/V rows travel: ranks that disagree on it would pair up
        # mismatched collectives, so it is part of what every rank must agree on.
        check_across_ranks(q, k, v, group=group, causal=causal, mode=mode, sharding=sharding, scale=scale,
                           extra=[*pattern_row(segment_lengths, dilation_rates, head_layout),
                                  dkv_wire_digest(dkv_wire_dtype)])
    # every mode of the dilated pattern sends dK/dV point to point and sums it in fp32 at the receiver
    check_dkv_wire(dkv_wire_dtype)
    if mode == "auto" and world == 1:
        # one rank exchanges nothing (every mode runs the same local pattern), and its group has no link to probe:
        # the probe measured 0 GB/s and the cost model divided by it (fuzz case 766629414: ZeroDivisionError)
        mode = "ring"
    if mode == "auto":
        from seqpar.attn.choose import choose_mode

        mode = choose_mode(q, k, world=world, manager=None, causal=causal, group=group, features={"dilated"},
                           dkv_wire_dtype=dkv_wire_dtype)
    check_local(q, k, v, world_size=world, sharding=sharding)
    check_pattern(segment_lengths, dilation_rates, head_layout=head_layout, q_heads=q.shape[1],
                  seq_local=q.shape[2], world_size=world)
    opts = DilatedOptions(
        segment_lengths=tuple(segment_lengths), dilation_rates=tuple(dilation_rates), causal=bool(causal),
        scale=float(q.shape[-1] ** -0.5 if scale is None else scale), mode=mode, head_layout=head_layout,
        dkv_wire_dtype=dkv_wire_dtype,
    )
    if torch.compiler.is_compiling():
        # dynamo cannot trace the segments' point-to-point exchanges: the call is one custom op in the graph,
        # which plans from the real sizes when it runs. Not planned here: the plan branches on seq_local
        # (local or spanning, rows per offset), and traced with a symbolic length each branch was a guard
        return _compiled_dilated(q, k, v, opts, group)
    plan = plan_dilated(opts, q_heads=q.shape[1], kv_heads=k.shape[1], seq_local=q.shape[2],
                        rank=rank, world_size=world)
    comms = {p: SegmentComm(group, pat.first, pat.span) for p, pat in enumerate(plan.patterns) if pat.span > 1}
    return DilatedAttention.apply(q, k, v, plan, comms)

