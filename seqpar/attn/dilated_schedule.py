"""The forward and backward passes of :mod:`seqpar.attn.dilated` on one rank: every pattern into fp32 (fp64)
accumulators, local patterns directly, spanning ones through their segment group's exchanges (ring / chain or
all-gather, and the dK/dV shares back to each block's owner), the kernels overlapping the transfers."""

from __future__ import annotations

import torch
from torch import Tensor

from seqpar.attn.common import dkv_wire_dtype
from seqpar.attn.dilated_blocks import Span, local_backward, local_forward
from seqpar.attn.dilated_plan import DilatedPlan
from seqpar.comm.ring import Pending
from seqpar.comm.segment import SegmentComm
from seqpar.kernels import in_layout_of, lse_dtype, new_accumulators, output_like

__all__ = ["dilated_forward", "dilated_backward", "output_in_layout"]

_KV = 0  # SegmentComm channel of K/V blocks
_DKV = 1  # channel of dK/dV accumulators


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


def _span_forward(span: Span, comm: SegmentComm, out_acc: Tensor, lse_acc: Tensor) -> None:
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


def _span_backward(span: Span, comm: SegmentComm, dq_acc: Tensor, dk_acc: Tensor, dv_acc: Tensor) -> None:
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
    # the empty partial (out 0, lse -inf), out in q's memory order (a Hugging Face q is a (batch, seq, heads, dim)
    # buffer seen transposed): the output then is too, as seqpar.attention's, with no copy where q's dtype is acc
    out_acc, lse_acc = new_accumulators(q, lse_dtype(q.dtype), v.shape[-1])
    for p, pat in enumerate(plan.patterns):
        if pat.span == 1:
            local_forward(q, k, v, pat, plan.opts, out_acc, lse_acc)
        else:
            _span_forward(Span(q, k, v, pat, plan.opts), comms[p], out_acc, lse_acc)
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
            local_backward(dout, q, k, v, out, lse, pat, plan.opts, dq_acc, dk_acc, dv_acc)
        else:
            span = Span(q, k, v, pat, plan.opts)
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
