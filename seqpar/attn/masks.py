"""Attention masks as a description (documents, chunks, sliding window, causal) and their block planner.

A mask is never a tensor here. :class:`MaskSpec` holds host integers: the global document
boundaries ``cu_seqlens`` (``[0, l1, l1 + l2, ..., S]``), a ``chunk_size``, a sliding ``window`` and
``causal``. Query at global position ``i`` sees key ``j`` iff both lie in the same document, in the
same chunk of it (Llama 4's chunked local attention: chunk ``c`` of a document starting at ``s`` is
``[s + c * chunk_size, s + (c + 1) * chunk_size)``, so a chunk is one more document to the planner), and
- causal: ``0 <= i - j < window``,
- not causal: ``|i - j| < window``
(``window=None``: no window). Every row sees at least itself, so no row of a result is ever empty.

:func:`plan_pieces` turns the description into the kernel calls one rank makes against one K/V
block: for each (query chunk, key chunk, document) the visible set is a band of rows ``i`` seeing keys
``[lo(i), hi(i))`` with ``lo``, ``hi`` non-decreasing of slope 0 or 1. Cut where a slope changes, each
segment is a union of at most three square or rectangular pieces the local kernels compute exactly:
a full rectangle, a causal triangle (row x sees key y <= x, top-left) and an anti-causal triangle
(row x sees key y >= x). A band with both edges sliding is tiled every ``width`` rows. Block pairs
with no visible pair give no call; adjacent rectangles are fused into one call.
"""

from __future__ import annotations

import bisect
import struct
import sys
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor
from torch.fx.experimental.symbolic_shapes import guard_scalar

from seqpar.attn.checks import shown
from seqpar.attn.plan import BlockCall
from seqpar.sequence.boundaries import (  # host_boundaries re-exported: the one conversion
    drop_empty_documents,
    host_boundaries,
)
from seqpar.sequence.sharding import num_chunks

__all__ = [
    "MaskSpec", "plan_pieces", "visible_pair_count", "host_boundaries", "mask_digest", "check_mask_inputs",
    "check_boundary_values", "document_bounds",
]


@dataclass(frozen=True)
class MaskSpec:
    """Which (query, key) pairs of the global sequence are visible; host integers only.

    Attributes:
        causal: keys after the query are hidden.
        window: sliding window (``>= 1``) or None.
        cu_seqlens: global document boundaries ``(0, ..., S)``, or None for one document.
        chunk_size: chunked local attention (``>= 1``): each document cut into chunks of this many
            tokens from its own start, each chunk seeing only itself; or None.
    """

    causal: bool
    window: int | None = None
    cu_seqlens: tuple[int, ...] | None = None
    chunk_size: int | None = None

    @property
    def dense(self) -> bool:
        """Plain (causal or full) attention: the shardings' own chunk planner applies."""
        return self.window is None and self.cu_seqlens is None and self.chunk_size is None

    def documents(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """``[start, stop)`` of the documents (chunks of them, with ``chunk_size``) that hold a position
        ``>= lo`` and one ``< hi``: those that meet both a query range and a key range, for ``lo`` the
        larger start and ``hi`` the smaller stop (one unbounded document when there are no boundaries)."""
        if self.cu_seqlens is None:
            docs = [(0, sys.maxsize)]
        else:
            cu = self.cu_seqlens
            first = bisect.bisect_right(cu, lo) - 1
            last = bisect.bisect_left(cu, hi)
            docs = [(cu[d], cu[d + 1]) for d in range(max(first, 0), min(last, len(cu) - 1))]
        if self.chunk_size is None:
            return docs
        c = self.chunk_size
        # chunk n of a document starting at s: [s + n c, s + (n + 1) c); it meets both ranges iff its
        # start is < hi and its stop > lo
        return [
            (s + n * c, min(s + (n + 1) * c, e))
            for s, e in docs
            for n in range(max(0, (lo - s) // c), (min(hi, e) - 1 - s) // c + 1)
        ]


def _band_pieces(q0: int, q1: int, k0: int, k1: int, causal: bool, window: int | None) -> list[tuple]:
    """Pieces of the visible pairs of queries ``[q0, q1)`` x keys ``[k0, k1)`` (global positions, one
    document) as ``(kind, q_start, q_stop, k_start, k_stop)``, kind ``"rect" | "causal" | "anti"``."""
    big = max(q1, k1) - min(q0, k0) + 2  # "no window": wider than any distance here
    w = window if window is not None else big

    def lo(i: int) -> int:
        return max(k0, i - w + 1)

    def hi(i: int) -> int:
        return min(k1, i + 1) if causal else min(k1, i + w)

    lo_bend = k0 + w  # rows >= lo_bend: lo slides with i
    hi_bend = k1 if causal else k1 - w + 1  # rows < hi_bend: hi slides with i
    cuts = sorted({q0, q1, *(c for c in (lo_bend, hi_bend) if q0 < c < q1)})
    pieces: list[tuple] = []
    for a, b in zip(cuts, cuts[1:]):
        lo_slides, hi_slides = a >= lo_bend, a < hi_bend
        a, b = _nonempty_rows(a, b, hi(a) - lo(a), int(hi_slides) - int(lo_slides))
        if a >= b:
            continue
        if lo_slides and hi_slides:  # a band of constant width: tiles of `width` rows
            width = hi(a) - lo(a)
            for t in range(a, b, width):
                m = min(width, b - t)
                pieces.append(("anti", t, t + m, lo(t), lo(t) + m))
                if lo(t) + m < hi(t):
                    pieces.append(("rect", t, t + m, lo(t) + m, hi(t)))
                if m > 1:  # strictly below the diagonal: row t + x sees hi(t) .. hi(t) + x - 1
                    pieces.append(("causal", t + 1, t + m, hi(t), hi(t) + m - 1))
        elif hi_slides:
            if lo(a) < hi(a) - 1:
                pieces.append(("rect", a, b, lo(a), hi(a) - 1))
            pieces.append(("causal", a, b, hi(a) - 1, hi(a) - 1 + (b - a)))
        elif lo_slides:
            pieces.append(("anti", a, b, lo(a), lo(a) + (b - a)))
            if lo(a) + (b - a) < hi(a):
                pieces.append(("rect", a, b, lo(a) + (b - a), hi(a)))
        else:
            pieces.append(("rect", a, b, lo(a), hi(a)))
    return pieces


def _nonempty_rows(a: int, b: int, width_a: int, slope: int) -> tuple[int, int]:
    """The rows of ``[a, b)`` whose visible width ``width_a + slope * (i - a)`` is positive."""
    if slope == 0:
        return (a, b) if width_a > 0 else (a, a)
    if slope > 0:
        return max(a, a + 1 - width_a), b
    return a, min(b, a + width_a)


def plan_pieces(
    spec: MaskSpec, q_ranges: Sequence[tuple[int, int]], k_ranges: Sequence[tuple[int, int]]
) -> list[BlockCall]:
    """Kernel calls for queries holding the global ranges ``q_ranges`` (in local order) against keys
    holding ``k_ranges``; rows and keys of each call are local offsets into the concatenations."""
    calls: list[BlockCall] = []
    q_off = 0
    for qa, qb in q_ranges:
        k_off = 0
        for ka, kb in k_ranges:
            if not (spec.causal and ka >= qb):  # keys all after the queries: nothing to see
                for ds, de in spec.documents(max(qa, ka), min(qb, kb)):
                    q0, q1, k0, k1 = max(qa, ds), min(qb, de), max(ka, ds), min(kb, de)
                    for kind, a, b, c, d in _band_pieces(q0, q1, k0, k1, spec.causal, spec.window):
                        calls.append(BlockCall(
                            slice(a - qa + q_off, b - qa + q_off), slice(c - ka + k_off, d - ka + k_off),
                            causal=kind == "causal", anti=kind == "anti",
                        ))
            k_off += kb - ka
        q_off += qb - qa
    return _fuse_rectangles(calls)


def _fuse_rectangles(calls: list[BlockCall]) -> list[BlockCall]:
    """Merge full rectangles that share their rows and touch in keys (or the reverse)."""
    rects = [c for c in calls if not (c.causal or c.anti)]
    others = [c for c in calls if c.causal or c.anti]
    for span, other in (("k", "q"), ("q", "k")):  # fuse along keys, then along rows
        rects.sort(key=lambda c: (_rng(c, other), _rng(c, span)))
        fused: list[BlockCall] = []
        for c in rects:
            last = fused[-1] if fused else None
            if last is not None and _rng(last, other) == _rng(c, other) and _rng(last, span)[1] == _rng(c, span)[0]:
                fused[-1] = _with(last, span, (_rng(last, span)[0], _rng(c, span)[1]))
            else:
                fused.append(c)
        rects = fused
    return rects + others


def _rng(c: BlockCall, side: str) -> tuple[int, int]:
    s = c.q_rows if side == "q" else c.k_rows
    return (s.start, s.stop)


def _with(c: BlockCall, side: str, r: tuple[int, int]) -> BlockCall:
    if side == "q":
        return BlockCall(slice(*r), c.k_rows, c.causal, c.anti)
    return BlockCall(c.q_rows, slice(*r), c.causal, c.anti)


def visible_pair_count(calls: Sequence[BlockCall]) -> int:
    """Visible (query, key) pairs the calls cover: the attention work, in score entries."""
    total = 0
    for c in calls:
        n, m = c.q_rows.stop - c.q_rows.start, c.k_rows.stop - c.k_rows.start
        total += n * (n + 1) // 2 if (c.causal or c.anti) else n * m
    return total


# --------------------------------------------------------------------------- inputs of the public call
def mask_digest(bounds: tuple[int, ...] | None, window: object, sinks: object, chunk_size: object = None) -> list[int]:
    """Five integers every rank must agree on (for the cross-rank check): the number of boundaries
    (-1: none), their CRC32, the window (0: none, -1: not an int), the sinks' length (-1: none) and
    the chunk size (0: none, -1: not an int)."""
    n = -1 if bounds is None else len(bounds)
    # guard_scalar: boundaries dynamo traces as SymInts (dynamic=True) would reach struct.pack, whose polyfill
    # recurses without end on them (torch's TORCH_STRUCT_BUG, seqpar.testing.fuzz_compile; fuzzer case 647716)
    crc = 0 if bounds is None else zlib.crc32(struct.pack(f"<{len(bounds)}q", *(guard_scalar(b) for b in bounds)))
    s = -1 if sinks is None else (sinks.numel() if isinstance(sinks, Tensor) else -2)
    return [n, crc, _int_digest(window), s, _int_digest(chunk_size)]


def _int_digest(value: object) -> int:
    if value is None:
        return 0
    return value if isinstance(value, int) and not isinstance(value, bool) else -1


def check_mask_inputs(
    bounds: tuple[int, ...] | None, window: object, sinks: object, *, q: Tensor, seq_len: int,
    world: int = 1, sharding: str = "contiguous", chunk_size: object = None, check_end: bool = True,
) -> None:
    """Raise ValueError/TypeError naming the problem and the fix (the same verdict on every rank,
    once the ranks are known to agree on these inputs). ``check_end=False``: not that ``bounds`` end at
    ``seq_len``, which a traced multi-rank call leaves to its custom op (:mod:`seqpar.attn.ops`)."""
    if sharding == "balanced":
        num_chunks(world, sharding, seq_len=seq_len)  # raises with the padding to use
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise ValueError(
            f"window={shown(window)!r} is invalid: pass an int >= 1 (query i sees key j when 0 <= i - j < window, "
            f"or |i - j| < window without causal) or None for no window"
        )
    if chunk_size is not None and (not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1):
        raise ValueError(
            f"chunk_size={shown(chunk_size)!r} is invalid: pass an int >= 1 (chunked local attention: query i sees "
            "key j only inside the same chunk of chunk_size tokens of its document) or None for no chunks"
        )
    if bounds is not None:
        check_boundary_values(bounds, seq_len if check_end else None)
        if q.shape[0] != 1:
            raise ValueError(
                f"cu_seqlens needs batch 1 (documents packed into one sequence, as flash varlen), got batch "
                f"{q.shape[0]}: pack the batch's rows into one sequence and concatenate their boundaries"
            )
    if sinks is not None:
        if not isinstance(sinks, Tensor) or sinks.dim() != 1 or sinks.shape[0] != q.shape[1]:
            shape = tuple(sinks.shape) if isinstance(sinks, Tensor) else type(sinks).__name__
            raise ValueError(f"sinks must be a ({shown(q.shape[1])},) tensor, one logit per query head; got {shown(shape)}")
        if not sinks.is_floating_point() or sinks.device != q.device:
            raise TypeError(f"sinks must be a floating-point tensor on {q.device}; got {sinks.dtype} on {sinks.device}")


def check_boundary_values(bounds: tuple[int, ...], seq_len: int | None) -> None:
    """Raise ValueError unless ``bounds`` are document boundaries ``[0, l1, l1 + l2, ..., seq_len]``
    (non-decreasing: a repeated entry is a zero-length document, dropped by :func:`document_bounds`). Also run
    at run time inside the compiled ops, which read boundary tensors that tracing could not, and check that
    boundaries given as ints end at the real length (:mod:`seqpar.attn.ops`). ``seq_len=None``: the end is
    not checked (a traced call, whose length is symbolic: see :func:`check_mask_inputs`)."""
    fix = ("pass the global boundaries [0, l1, l1 + l2, ..., S] with S = seq_local * P"
           + ("" if seq_len is None else f" = {seq_len}"))
    if len(bounds) < 2 or bounds[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0 and hold at least [0, S]; got {_show(bounds)}: {fix}")
    bad = next((i for i in range(1, len(bounds)) if bounds[i] < bounds[i - 1]), None)
    if bad is not None:
        raise ValueError(
            f"cu_seqlens must not decrease (a repeated entry, a zero-length document, is allowed); got "
            f"{bounds[bad - 1]} then {bounds[bad]} at index {bad}: {fix}"
        )
    if seq_len is not None and bounds[-1] != seq_len:
        raise ValueError(f"cu_seqlens must end at the global sequence length {seq_len}, got {bounds[-1]}: {fix}")


def document_bounds(bounds: tuple[int, ...], seq_len: int) -> tuple[int, ...]:
    """``bounds`` checked (:func:`check_boundary_values`) and without zero-length documents (repeated entries,
    :func:`~seqpar.sequence.boundaries.drop_empty_documents`): what every plan reads, so an empty document costs
    nothing and the result equals the same call with the repeats removed."""
    check_boundary_values(bounds, seq_len)
    return drop_empty_documents(bounds)


def _show(bounds: tuple[int, ...]) -> str:
    return str(list(bounds)) if len(bounds) <= 12 else f"[{', '.join(map(str, bounds[:6]))}, ..., {bounds[-1]}]"
