"""The pattern of :mod:`seqpar.attn.dilated` as one rank sees it: its static options, the checks that refuse a
pattern the shapes cannot take (naming the fix), and the plan: per pattern and offset, the query heads, kv heads
and rows this rank computes, and which ranks share a segment. Plain Python on ints, no tensors."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "HEAD_LAYOUTS",
    "DilatedOptions",
    "OffsetPlan",
    "PatternPlan",
    "DilatedPlan",
    "check_pattern",
    "pattern_row",
    "plan_dilated",
]

HEAD_LAYOUTS = ("mixed", "grouped")


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
    for name, values in (("segment_lengths", segment_lengths), ("dilation_rates", dilation_rates)):
        if not _is_list(values):
            one = isinstance(values, int) and not isinstance(values, bool)
            hint = (f" ({name}=[{values!r}] for one pattern)" if one
                    else f" ({name}=t.tolist())" if hasattr(values, "tolist") else
                    f" ({name}=list(...) of a generator)" if hasattr(values, "__next__") else "")
            raise TypeError(f"{name}={values!r} is invalid: pass a list of positive integers, one per pattern{hint}")
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
    # Under torch.compile these run inside the custom op, at the real sizes (dilated_attention passes no shapes
    # while tracing): a refusal raised in a trace reaches a fullgraph=True caller as dynamo's "Unsupported:
    # Observed exception". Should a trace call this with a symbolic length, each test below is one guard on the
    # call's validity, true for every valid length alike: two separate tests of the straddle (``seq_local % w``,
    # then ``w % seq_local``) guarded on which side held, and a pattern local at one length and spanning at the
    # next recompiled.
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


def pattern_row(
    segment_lengths: Sequence[int], dilation_rates: Sequence[int], head_layout: str
) -> list[int]:
    """The dilated pattern as integers for the cross-rank check (invalid entries become -1; they are
    refused by :func:`check_pattern` right after)."""

    def ints(xs: Sequence[int]) -> list[int]:
        if not _is_list(xs):  # a bare int, a string, a generator: -2 (len() raised here, before the all-gather)
            return [-2]
        return [len(xs), *(x if isinstance(x, int) and not isinstance(x, bool) else -1 for x in xs)]

    layout = HEAD_LAYOUTS.index(head_layout) if head_layout in HEAD_LAYOUTS else -1
    return [*ints(segment_lengths), *ints(dilation_rates), layout]


def _is_list(values: object) -> bool:
    """A pattern's list: a list, a tuple or another sequence, not a string (whose characters it would read) nor a
    bare int or a generator (which ``len()`` refused deep inside, and which a first read would have used up)."""
    return isinstance(values, Sequence) and not isinstance(values, (str, bytes))


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
