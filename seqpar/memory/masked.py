"""The ring's peak under documents, windows, chunked attention and sinks: the plan the ring runs, replayed.

:mod:`seqpar.memory.attention` sizes the ring of a dense (causal or full) mask in closed form: every block
makes P - 1 hops and is one kernel call. Masks change that block by block (:mod:`seqpar.attn.ring`,
:func:`seqpar.attn.common.block_hops` / :func:`~seqpar.attn.common.block_calls`): block j makes only
``hops[j]`` hops, a rank holds and receives K/V only while it or a rank further on needs them, a block seen
by no query of this rank costs an empty share, a block seen in several pieces gets zeroed fp32 dK/dV
buffers, pieces of one small shape are stacked into one kernel call (their rows copied), anti-causal
pieces are flipped (copies in and out), a dK/dV accumulator that finished its hops goes home early and its
send stays referenced until the end of the backward, and the own block in pieces starts from zeroed
accumulators. So this module walks the same plan (the same ``block_hops`` and ``block_calls``, from
:class:`~seqpar.attn.common.AttentionOptions` built as :func:`seqpar.attention` builds them) through
``ring_forward`` and ``ring_backward`` statement by statement, counting each tensor made and freed, and
returns the largest live total of any rank: :func:`masked_ring_peak`.

Units: bytes per local row of one head-chunk pass (``batch * heads / head_chunks * head_dim`` elements).
Sinks (``(q_heads,)`` logits) add the forward's sink merge and the backward's sink gradient
(:func:`seqpar.kernels.merge.sink_grad`: ``rowsum(dout * out)`` in the accumulation dtype) after the ring.
"""

from __future__ import annotations

from dataclasses import dataclass

from seqpar.attn.common import (
    BATCH_PIECE_ROWS,
    BATCH_ROWS,
    AttentionOptions,
    block_calls,
    block_hops,
)
from seqpar.attn.plan import BlockCall
from seqpar.kernels.merge import cpu_merge_piece

__all__ = ["RowBytes", "allgather_block_peaks", "masked_ring_peak", "ring_backward_peak", "ring_forward_peak", "ring_options"]


@dataclass(frozen=True)
class RowBytes:
    """Bytes per local row of one pass: ``q`` (a query-sized row in the input dtype: q, out, dout, dq), ``k``
    (a K/V row), ``qa``/``ka`` the same in the accumulation dtype, ``kw`` a K/V row in the dK/dV wire dtype,
    ``la`` an lse row (accumulation dtype), ``q_elems`` output elements per row (the CPU merge's piece size),
    ``heads`` query heads times batch (the merge's one-byte empty-row mask), ``acc8`` fp64 accumulation;
    ``low``: inputs below the accumulation dtype; ``wire_is_acc``: the wire dtype is the accumulation's;
    ``wire_is_input``: the wire dtype is the inputs'; ``kernel_grads_contiguous``: the kernel's dk, dv are
    contiguous (the CPU kernel returns them in ``(batch, len, heads, dim)`` order: only with one K/V head a pass),
    so that a share over every key row travels as it is instead of a contiguous copy."""

    q: float
    k: float
    qa: float
    ka: float
    kw: float
    la: float
    q_elems: float
    heads: float
    acc8: bool
    low: bool
    wire_is_acc: bool
    wire_is_input: bool
    kernel_grads_contiguous: bool = False


def ring_options(*, causal: bool, sharding: str, window: int | None, cu_seqlens: tuple[int, ...] | None,
                 chunk_size: int | None) -> AttentionOptions:
    """The options :func:`seqpar.attention` hands the ring (the plan depends on these only)."""
    return AttentionOptions(causal=causal, scale=1.0, sharding=sharding, window=window, cu_seqlens=cu_seqlens,
                            chunk_size=chunk_size)


class _Refs:
    """Python's reference counting in miniature: storages with sizes, held by named references (variables,
    list slots, the pending exchanges that hold their send and receive tensors); a storage held by nothing is
    freed. Tracks the largest live total, at every allocation and at every kernel's short-lived moment."""

    def __init__(self) -> None:
        self.size: dict[int, float] = {}
        self.held: dict[str, int] = {}
        self.peak = 0.0
        self.total = 0.0  # sum(self.size.values()), kept as storages come and go
        self._refs: dict[int, int] = {}  # references per storage
        self._next = 0

    def new(self, size: float, ref: str) -> int:
        """Allocate a storage of ``size`` bytes held by ``ref``."""
        self._next += 1
        self.size[self._next] = size
        self.total += size
        self.bind(ref, self._next)
        self.peak = max(self.peak, self.total)
        return self._next

    def bind(self, ref: str, storage: int | None) -> None:
        """``ref = storage`` (``None``: ``ref`` lets go)."""
        old = self.held.pop(ref, None)
        if storage is not None:
            self.held[ref] = storage
            self._refs[storage] = self._refs.get(storage, 0) + 1
        if old is not None:
            self._refs[old] -= 1
            if not self._refs[old]:
                del self._refs[old]
                self.total -= self.size.pop(old, 0.0)

    def get(self, ref: str) -> int | None:
        return self.held.get(ref)

    def touch(self, extra: float) -> None:
        """A moment with ``extra`` bytes of short-lived temporaries on top of what is held."""
        self.peak = max(self.peak, self.total + extra)


def _len(s: slice) -> int:
    return s.stop - s.start


def _groups(calls: tuple[BlockCall, ...]) -> list[list[BlockCall]]:
    """The calls in the groups :func:`seqpar.attn.common.backward_pieces` / ``forward_pieces`` run as one kernel
    call each (the same rule: same shape and mask, at most ``BATCH_PIECE_ROWS`` a side, ``BATCH_ROWS`` stacked
    query rows; larger pieces alone, first)."""
    groups: dict[tuple, list[BlockCall]] = {}
    out: list[list[BlockCall]] = []
    for c in calls:
        n, m = _len(c.q_rows), _len(c.k_rows)
        if n > BATCH_PIECE_ROWS or m > BATCH_PIECE_ROWS:
            out.append([c])
            continue
        key = (n, m, c.causal, c.anti)
        group = groups.setdefault(key, [])
        group.append(c)
        if (len(group) + 1) * n > BATCH_ROWS:
            out.append(groups.pop(key))
    return out + list(groups.values())


def _group_sizes(group: list[BlockCall], u: RowBytes) -> tuple[float, float, float, float]:
    """``(query rows, key rows, backward inputs, backward outputs)`` of one kernel group: its dout, q, out (query
    rows), k, v (key rows) and lse; its dq (query rows), dk, dv (key rows), all in the input dtype but lse."""
    n = sum(_len(c.q_rows) for c in group)
    m = sum(_len(c.k_rows) for c in group)
    return n, m, 3 * n * u.q + 2 * m * u.k + n * u.la, n * u.q + 2 * m * u.k


def _group_backward(group: list[BlockCall], u: RowBytes) -> tuple[float, float]:
    """``(peak, outputs)`` of one unstacked kernel call (:func:`seqpar.attn.common.piece_backward`): its dq, dk,
    dv, and an anti-causal piece's flipped inputs (copies) and flipped outputs beside the kernel's."""
    _, _, ins, outs = _group_sizes(group, u)
    return (ins + 2 * outs if group[0].anti else outs), outs


def _block_grads(live: _Refs, calls: tuple[BlockCall, ...], u: RowBytes) -> None:
    """:func:`seqpar.attn.common.block_grads` into accumulators already held, statement by statement of
    ``backward_pieces``: a stacked group's inputs are made while the generator still holds the last stacked
    group's (``args``) and outputs (``dq, dk, dv``), and the loop's variables the previous group's outputs;
    anti-causal groups flip their inputs (a second copy, beside the first while it is made) and their outputs."""
    for group in _groups(calls):
        _, _, ins, outs = _group_sizes(group, u)
        anti = group[0].anti
        if len(group) > 1:
            _stacked_group(live, "g_", ins, outs, anti)
            live.bind("loop", live.get("g_outs"))
        else:
            if anti:
                live.new(ins, "p_flip")
            live.new(outs, "p_kernel")
            if anti:
                live.new(outs, "p_out")
                live.bind("p_kernel", live.get("p_out"))
                live.bind("p_out", None)
            live.bind("p_flip", None)
            live.bind("loop", live.get("p_kernel"))
            live.bind("p_kernel", None)
    for ref in ("g_args", "g_outs", "loop"):  # the generator and the loop end
        live.bind(ref, None)


def _stacked_group(live: _Refs, p: str, ins: float, outs: float, anti: bool) -> None:
    """A stacked group of pieces, as ``forward_pieces`` and ``backward_pieces`` both run it (references prefixed
    ``p``): the stacked inputs (``ins`` bytes) made and held as the call's arguments, for an anti-causal group
    flipped into a second copy beside the first while it is made; the kernel's outputs (``outs`` bytes), flipped
    back likewise; ``{p}args`` and ``{p}outs`` hold them until the next group rebinds them."""
    live.new(ins, f"{p}stack")
    live.bind(f"{p}args", live.get(f"{p}stack"))
    live.bind(f"{p}stack", None)
    if anti:
        live.new(ins, f"{p}flip")
        live.bind(f"{p}args", live.get(f"{p}flip"))
        live.bind(f"{p}flip", None)
    live.new(outs, f"{p}kernel")
    if anti:
        live.new(outs, f"{p}kflip")
        live.bind(f"{p}kernel", live.get(f"{p}kflip"))
        live.bind(f"{p}kflip", None)
    live.bind(f"{p}outs", live.get(f"{p}kernel"))
    live.bind(f"{p}kernel", None)


def _merge_temps(rows: float, u: RowBytes, *, sink: bool = False) -> float:
    """The CPU merge's temporaries over ``rows`` rows (:func:`seqpar.kernels.merge._merge_torch`): the two lse in
    fp64 (copies unless the accumulators are fp64), the empty-row mask, the accumulator's weight (and the block's:
    ``sink`` has no block), one more lse-sized fp64 temporary while a weight or the merged lse is made, or
    instead one piece of the accumulator and of the block upcast to fp64 (fp64 accumulators: the block's only;
    a sink: the accumulator's only)."""
    lse64 = rows * u.heads * 8
    elems = rows * u.q_elems
    piece = min(elems, cpu_merge_piece(int(elems)))
    copies = 0 if u.acc8 else 2
    weights = 1 if sink else 2
    upcast = ((0 if u.acc8 else 1) + (0 if sink else 1)) * 8 * piece
    return (copies + weights) * lse64 + rows * u.heads + max(lse64, upcast)


def _reach(reached: list[tuple[int, int]], a: int, b: int) -> None:
    """Add rows ``[a, b)`` to ``reached`` in place, kept as ``Partials`` keeps it: disjoint, sorted row ranges,
    touching ones joined. So a later piece merges each run of reached rows at once, as ``Partials.add`` does (a
    list of every piece's range counted one merge per earlier piece: smaller merges than the real ones where
    pieces meet, and quadratic in the pieces: 0.2 s an estimate at 6M tokens with a window of 4096)."""
    merged: list[tuple[int, int]] = []
    for ra, rb in sorted([*reached, (a, b)]):
        if merged and ra <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], rb))
        else:
            merged.append((ra, rb))
    reached[:] = merged


def _forward_block(live: _Refs, calls: tuple[BlockCall, ...], u: RowBytes, seq_local: int,
                   reached: list[tuple[int, int]]) -> None:
    """:func:`seqpar.attn.common.forward_block` into the partial accumulators (``Partials``), statement by
    statement of ``forward_pieces``: a stacked group's q, k, v copies are made while the generator still holds
    the last stacked group's (and its output), anti-causal groups flip inputs and outputs, the loop holds the
    previous piece's output, and each piece's merge makes the CPU merge's fp64 temporaries. The accumulators
    are made at the first piece, unless that piece covers every row in the accumulation dtype (it becomes
    them). ``reached``: the row ranges some piece has reached (``Partials``' own record), extended here."""
    for group in _groups(calls):
        n, m, _, _ = _group_sizes(group, u)
        ins, outs = n * u.q + 2 * m * u.k, n * (u.q + u.la)
        anti = group[0].anti
        if len(group) > 1:
            _stacked_group(live, "f_", ins, outs, anti)
            live.bind("f_loop", live.get("f_outs"))
        else:
            if anti:
                live.new(ins, "p_flip")
            live.new(outs, "p_kernel")
            live.bind("p_flip", None)
            if anti:
                live.new(outs, "p_out")
                live.bind("p_kernel", live.get("p_out"))
                live.bind("p_out", None)
            live.bind("f_loop", live.get("p_kernel"))
            live.bind("p_kernel", None)
        for c in group:  # Partials.add, piece by piece: rows reached before are merged, the others copied
            if live.get("acc") is None:
                if len(group) == 1 and _len(c.q_rows) == seq_local and not u.low:
                    live.bind("acc", live.get("f_loop"))  # the piece's out and lse become the accumulators
                    _reach(reached, 0, seq_local)
                    continue
                live.new(seq_local * (u.qa + u.la), "acc")
            for a, b in reached:  # one merge per run of rows reached before (Partials._split)
                n = min(b, c.q_rows.stop) - max(a, c.q_rows.start)
                if n > 0:
                    live.touch(_merge_temps(n, u))
            _reach(reached, c.q_rows.start, c.q_rows.stop)
    for ref in ("f_args", "f_outs", "f_loop"):  # the generator and the loop end
        live.bind(ref, None)


def _forward(rank: int, world: int, seq_local: int, opts: AttentionOptions, u: RowBytes, sinks: bool) -> float:
    """``ring_forward`` on ``rank`` beside q, k, v (and dout): the output/lse accumulators, the K/V pairs
    referenced (the one in use, the receive buffers of both parities) and each block's pieces and merges;
    then the sink merge and the output's cast (low precision)."""
    hops = block_hops(opts, world, seq_local)
    L = seq_local
    live = _Refs()
    reached: list[tuple[int, int]] = []
    for step in range(max(hops) + 1):
        src, prev = (rank - step) % world, (rank - 1 - step) % world
        recv = step + 1 <= hops[prev]
        slot = f"buffers{step % 2}"
        if recv and live.get(slot) is None:
            live.new(2 * L * u.k, slot)
        if step <= hops[src]:
            _forward_block(live, block_calls(opts, world, rank, src, L), u, L, reached)
        if recv:
            live.bind("cur", live.get(slot))
    if live.get("acc") is None:
        live.new(L * (u.qa + u.la), "acc")
    if sinks:
        live.touch(_merge_temps(L, u, sink=True))
    if u.low:  # out = output_like(q).copy_(out_acc)
        live.new(L * u.q, "out")
    return live.peak


def _backward(rank: int, world: int, seq_local: int, opts: AttentionOptions, u: RowBytes, *, into: bool,
              cast: bool) -> float:
    """``ring_backward`` on ``rank`` (one pass), beside the always-live q, k, v, out, dout, lse, statement by
    statement: the references each step makes and drops, the kernels' moments. ``into``: a head-chunk pass in
    the accumulation dtype, whose accumulators are the gradients' own slices (counted by the caller); ``cast``:
    the accumulators are cast to the input dtype at the end (one pass, low precision; a head-chunk pass copies
    them into the gradients' slices instead). Returns the largest live total."""
    hops = block_hops(opts, world, seq_local)
    L = seq_local
    kw2 = 2 * L * u.kw
    live = _Refs()
    if hops[(rank - 1) % world] >= 1:  # the first K/V exchange's receive buffers
        live.new(2 * L * u.k, "kv_pending")
    own = block_calls(opts, world, rank, rank, L)
    acc = L * (u.qa + 2 * u.ka)
    if len(own) == 1 and _len(own[0].q_rows) == L and _len(own[0].k_rows) == L:
        peak, outs = _group_backward(list(own), u)
        live.touch(peak)
        live.new(outs, "acc")  # the kernel's dq, dk, dv become the accumulators
        if u.low:  # .to(acc): copies beside them
            live.new(acc, "acc32")
            live.bind("acc", live.get("acc32"))
            live.bind("acc32", None)
    else:  # zeroed accumulators, the own pieces added in
        live.new(acc, "acc")
        _block_grads(live, own, u)
    if into:  # copied into the gradients' slices, the own shares freed
        live.bind("acc", None)
    home = 0
    for step in range(1, max(hops, default=0) + 1):
        src, prev = (rank - step) % world, (rank - 1 - step) % world
        have = step <= hops[src]
        live.bind("received", live.get("kv_pending"))  # this hop's K/V (waited)
        live.bind("kv_pending", None)
        recv_kv = step + 1 <= hops[prev]
        slot, other = f"buffers{step % 2}", f"buffers{(step + 1) % 2}"
        if recv_kv:
            reuse = live.get(slot)
            if reuse is None:
                live.new(2 * L * u.k, "kv_pending")
            else:
                live.bind("kv_pending", reuse)
        else:
            live.bind(slot, None)
        chain_recv = step < hops[prev]
        home_recv = step == hops[rank]
        live.bind("send", None)
        share_full = False
        if have:
            live.bind("k_cur", live.get("received"))
            live.bind(other, live.get("received"))
            calls = block_calls(opts, world, rank, src, L)
            if not calls:  # an empty share (no key of the block visible here): widened to zeros below
                live.new(0.0, "share")
            elif len(calls) == 1:
                c = calls[0]
                peak, _ = _group_backward([c], u)
                live.touch(peak)  # dq added in place and freed; dk, dv are the share
                live.new(2 * _len(c.k_rows) * u.k, "share")
                share_full = _len(c.k_rows) == L and u.wire_is_input and u.kernel_grads_contiguous
            else:  # zeroed acc-dtype dK/dV of the block, the pieces added in
                live.new(2 * L * u.ka, "share")
                _block_grads(live, list(calls), u)
                share_full = u.wire_is_acc
        # the last accumulator exchange completes: its sends are let go, its receive is ``incoming``
        live.bind("incoming", live.get("chain_recv"))
        live.bind("chain_send", None)
        live.bind("chain_recv", None)
        live.bind("free", live.get("dkv_sent"))
        if have:
            if step == 1:
                if share_full:  # the share itself travels
                    live.bind("send", live.get("share"))
                else:  # the share widened to every row, in the wire dtype
                    live.new(kw2, "send")
            else:
                live.bind("send", live.get("incoming"))
        live.bind("share", None)
        live.bind("incoming", None)
        onward = live.get("send") is not None and step < hops[src]
        if onward:
            live.bind("chain_send", live.get("send"))
        if chain_recv:
            if live.get("free") is not None:
                live.bind("chain_recv", live.get("free"))
            else:
                live.new(kw2, "chain_recv")
        home_send = live.get("send") is not None and not onward
        home_buf = None if chain_recv else live.get("free")
        if home_send:  # its pending send holds it until the end
            home += 1
            live.bind(f"home_send{home}", live.get("send"))
        if home_recv:
            if home_buf is None:
                live.new(kw2, "home_in")
            else:
                live.bind("home_in", home_buf)
        live.bind("dkv_sent", live.get("send") if onward else None)
    # the end: the sends are waited (their tensors let go), the own block's accumulator added in place, the
    # accumulators cast to the input dtype (G = 1, low precision) beside what is still referenced
    live.bind("chain_send", None)
    for h in range(1, home + 1):
        live.bind(f"home_send{h}", None)
    if cast:
        live.new(L * (u.q + 2 * u.k), "grads")
    return live.peak


def masked_ring_peak(*, world: int, seq_local: int, opts: AttentionOptions, units: RowBytes, into: bool,
                     cast: bool, sinks: bool) -> tuple[float, float]:
    """``(backward, forward)``: the largest live bytes of any rank beside the always-live q, k, v, out, dout
    and lse, for one head-chunk pass of the ring under ``opts``' mask (:func:`_backward`, :func:`_forward`)."""
    bwd = max(_backward(r, world, seq_local, opts, units, into=into, cast=cast) for r in range(world))
    fwd = max(_forward(r, world, seq_local, opts, units, sinks) for r in range(world))
    return bwd, fwd


def ring_backward_peak(*, world: int, seq_local: int, opts: AttentionOptions, units: RowBytes, cast: bool) -> float:
    """The largest live bytes of any rank in one ring backward (one pass, beside its always-live q, k, v, out, dout
    and lse): :func:`masked_ring_peak`'s backward alone, for a ring run inside another algorithm (the hybrid's inner
    ring on one head chunk, or on one GQA piece of an uneven head share)."""
    return max(_backward(r, world, seq_local, opts, units, into=False, cast=cast) for r in range(world))


def ring_forward_peak(*, world: int, seq_local: int, opts: AttentionOptions, units: RowBytes,
                      sinks: bool = False) -> float:
    """The largest live bytes of any rank in one ring forward beside its q, k, v (``sinks``: with the sink merge):
    :func:`masked_ring_peak`'s forward alone, for a ring run inside another algorithm (an uneven hybrid's inner ring
    on one GQA piece, Ulysses' inner attention at P = 1)."""
    return max(_forward(r, world, seq_local, opts, units, sinks) for r in range(world))


def allgather_block_peaks(*, world: int, seq_local: int, opts: AttentionOptions,
                          units: RowBytes) -> tuple[float, float, float]:
    """``(own, remote, forward)`` transients of the all-gather under ``opts``' mask, for one head-chunk pass (units as
    :func:`masked_ring_peak`'s), the largest of any rank: one K/V block's ``_grads_into`` (the pieces' dq/dk/dv,
    stacked and flipped copies, :func:`_block_grads`; its fp32 slot is the caller's), for the own block and for a
    remote one; forward, the chunk's ``forward_block`` calls over the own block then every remote one into its
    ``Partials`` (views of the preallocated fp32 out / lse: no accumulator made here), with the CPU merge's
    temporaries over rows reached before (:func:`_forward_block`)."""
    own = remote = fwd = 0.0
    for rank in range(world):
        live = _Refs()
        live.new(0.0, "acc")  # Partials over out[:, qs], lse[:, qs]: storage the caller counts
        reached: list[tuple[int, int]] = []
        for src in [rank, *(s for s in range(world) if s != rank)]:
            calls = block_calls(opts, world, rank, src, seq_local)
            block = _Refs()
            _block_grads(block, calls, units)
            if src == rank:
                own = max(own, block.peak)
            else:
                remote = max(remote, block.peak)
            _forward_block(live, calls, units, seq_local, reached)
        fwd = max(fwd, live.peak)
    return own, remote, fwd
