"""Ring attention: K/V blocks travel around the SP ring while each rank attends its local queries.

Forward (rank r of P, step s = 0..P-1): attend q to the K/V block of rank (r - s) mod P and merge
with the log-sum-exp rule, while the block is already being forwarded to rank r+1 and the next one
received from rank r-1 (double-buffered: two receive buffers alternate). Per rank the forward sends
P-1 K/V blocks.

Backward: dQ stays local (fp32). dK/dV of a block travel with it: the accumulator of rank j's block
starts at rank j+1 (the first to see that block after j itself), gathers every rank's contribution
as it goes round, and arrives home after P-1 hops, where j adds its own (diagonal) share, computed
first so it overlaps the first transfer. Each hop's incoming accumulator is waited only after that hop's
kernels, right before the add into it (:mod:`seqpar.comm.schedule`: wait where the buffer is first
touched), so the dK/dV transfer hides behind them. Per rank the backward sends P-1 K/V blocks (input dtype) and
P-1 dK/dV blocks (fp32); with no stored copies of remote blocks this is the minimum, and no rank ever
holds more than a few blocks of size S/P: memory O(S/P).

dK/dV on the wire (``opts.dkv_wire_dtype``): ``"fp32"`` (default) sends the accumulators in the
accumulation dtype, exact. ``"bf16"`` halves their bytes (TransformerEngine's choice): the accumulator
travels and is received in bfloat16, and each rank adds its fp32 share to it in fp32 arithmetic, rounding
once to bf16 for the next hop (one kernel, ``bf16.add_(fp32)``: the add runs in the promoted dtype); the
owner adds the arriving accumulator into its fp32 own share. A block's dK/dV is thus rounded to bf16
once per hop it travels (at most P-1 times), never summed in bf16: not exact (measured against float64
in BENCHMARKS.md), the receive buffers and messages half the size.

Documents and windows (``opts.cu_seqlens``, ``opts.window``): block j makes only
``h_j = block_hops(...)[j] <= P-1`` hops, the farthest ring distance at which a rank still sees one of
its keys (every rank derives the same tuple from the same integers, so sends and receives pair up
with no extra message): a rank passes a block on only while someone further needs it and takes the
next only while it or someone further needs it. The block's dK/dV accumulator collects over h_j - 1
hops and then goes straight home from rank j + h_j (a send with ``shift``). Causal documents no
longer than a shard under contiguous sharding: one hop. Whole blocks travel (under zigzag a block's
two chunks have neighbours on ranks r + 1 and r - 1 = r + P - 1, so zigzag keeps P - 1 hops for any
block whose chunk edge a document crosses). Dense masks: h_j = P - 1 and the same messages as above.

Head chunks (``opts.head_chunks = G``): the ring runs G times, each pass on kv_heads / G K/V heads and
their query heads, writing into full-size outputs. Volume is unchanged (G passes of 1/G blocks); the
buffers in flight and the kernels' outputs shrink by G, which is most of the ring's memory beyond the
inputs, outputs and gradients themselves (at P = 4: ~8 + 11/G blocks of S/P instead of 19).

Buffers and NCCL (the guarantee seqpar relies on, and keeps): **a tensor handed to an exchange is
neither written (sent or received) nor read (received) until that exchange's ``wait()`` has returned**;
after it, the buffer is free: the backward reuses the accumulators it sent on at the last step as the
next step's receive buffers, and the forward reuses a received K/V pair two steps later, each only after
the ``wait()`` of the exchange that sent it. On NCCL, ``wait()`` orders the compute stream after the
communication stream rather than blocking the host, and the work object keeps its tensors alive (torch
stashes them or records them on the NCCL stream) until then, so this rule is all that makes reuse safe:
writing into a send buffer before its ``wait()`` could change what the peer receives. Reading a buffer
that is being sent (the forward attends to the K/V block it is passing on) is safe. Every communicator
group the ring runs on was initialised at creation (:mod:`seqpar.runtime.communicators`), so a rank
with no hop in a step never leaves its peers in NCCL's lazy communicator set-up. Both rules are checked
on gloo by :mod:`seqpar.testing.nccl_rules` (``tests/test_nccl_rules.py``); the buffer rule literally,
with ``sends="late"``: every send carries its buffer as it is at the send's ``wait()`` (the latest NCCL
may read it), and every mode that exchanges point to point (ring, hybrid, dilated; forward and backward,
documents, windows) still matches the reference, while a write into an accumulator before its
``wait()`` makes dK/dV wrong.

Layouts: q ``(batch, q_heads, seq_local, head_dim)``, k/v ``(batch, kv_heads, seq_local, head_dim)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from seqpar.attn.common import (
    AttentionOptions,
    BlockExpander,
    block_calls,
    block_grads,
    block_hops,
    dkv_wire_dtype,
    forward_block,
    function_backward,
    function_forward,
    piece_backward,
)
from seqpar.attn.plan import BlockCall, head_chunk_slices
from seqpar.comm.ring import Pending, RingExchange
from seqpar.kernels import (
    Partials,
    add_sink,
    backward_layout,
    in_layout_of,
    lse_dtype,
    output_like,
)

__all__ = [
    "AttentionOptions", "ring_forward", "ring_backward", "ring_attention_forward", "ring_attention_backward",
    "RingAttention",
]

_KV = 0  # channel of the K/V blocks
_DKV = 1  # channel of the travelling dK/dV accumulators
_HOME = 2  # channel of the accumulators going home after their block's last hop


def ring_forward(
    q: Tensor, k: Tensor, v: Tensor, comm: RingExchange, opts: AttentionOptions, sinks: Tensor | None = None,
    expander: BlockExpander | None = None,
) -> tuple[Tensor, Tensor]:
    """Returns ``out`` (fp32/fp64 accumulator ``(batch, q_heads, seq_local, v_head_dim)``) and ``lse``
    ``(batch, q_heads, seq_local)``. ``sinks``: optional ``(q_heads,)`` sink logits, one more term of
    every row's softmax. ``expander``: ``k``, ``v`` are a compressed form of the block (MLA's latent)
    that travels instead of K/V and is expanded at each rank before its kernels."""
    world, rank = comm.world_size, comm.rank
    hops = block_hops(opts, world, q.shape[2])
    acc = Partials.like(q, lse_dtype(q.dtype), v.shape[-1] if expander is None else expander.v_head_dim)
    k_cur, v_cur = k.contiguous(), v.contiguous()
    buffers: list[list[Tensor] | None] = [None, None]
    for step in range(max(hops) + 1):
        src, prev = (rank - step) % world, (rank - 1 - step) % world
        # pass block src on while someone further needs it; take the next while it is needed here
        # or further (every rank decides from the same hop plan, so sends and receives pair up)
        recv = step + 1 <= hops[prev]
        pending = _exchange(comm, [k_cur, v_cur], buffers[step % 2], _KV, send=step + 1 <= hops[src], recv=recv)
        if pending is not None and not opts.overlap:
            pending.wait()
        if step <= hops[src]:  # we hold block src (step 0: our own)
            k_blk, v_blk = (k_cur, v_cur) if expander is None else expander.expand(k_cur, v_cur)
            forward_block(q, k_blk, v_blk, block_calls(opts, world, rank, src, q.shape[2]), opts.scale, acc,
                          opts.softcap)
            del k_blk, v_blk
        if pending is not None:
            received = pending.wait()
            if recv:
                k_cur, v_cur = received
                buffers[step % 2] = received
    out, lse = acc.finish()
    if sinks is not None:
        add_sink(out, lse, sinks)
    return out, lse


def _widen(x: Tensor, rows: slice, n: int, acc: torch.dtype) -> Tensor:
    """``x`` ``(B, H, rows, D)`` as a contiguous ``(B, H, n, D)`` ``acc`` tensor that is 0 outside ``rows``
    (a new accumulator, ready to travel; ``acc`` is the wire dtype, bf16 rounding ``x`` once): ``x`` itself
    when it covers all ``n`` rows already in ``acc`` and contiguous (no copy), else one copy (dtype and
    layout at once) and a fill of the rest only."""
    if rows == slice(0, n):  # (x.to(acc) alone returns a non-contiguous x as it is)
        return x if x.dtype == acc and x.is_contiguous() else x.to(acc, memory_format=torch.contiguous_format, copy=True)
    full = x.new_empty((*x.shape[:2], n, *x.shape[3:]), dtype=acc)
    full.narrow(2, rows.start, rows.stop - rows.start).copy_(x)
    full.narrow(2, 0, rows.start).zero_()
    full.narrow(2, rows.stop, n - rows.stop).zero_()
    return full


@dataclass
class _BlockShare:
    """This rank's dK/dV share of a remote block: ``dk``, ``dv`` over the block's rows ``rows`` (of
    ``n``), in the kernel's dtype (fp32 once several pieces were summed)."""

    rows: slice
    n: int
    dk: Tensor
    dv: Tensor

    def start(self, acc: torch.dtype) -> list[Tensor]:
        """The block's new accumulators (its first hop) in dtype ``acc`` (the wire's): the share widened
        to all ``n`` rows."""
        return [_widen(self.dk, self.rows, self.n, acc), _widen(self.dv, self.rows, self.n, acc)]

    def add_to(self, dk_acc: Tensor, dv_acc: Tensor) -> None:
        """Add the share into a travelling accumulator, over its rows only (a zigzag half-block hop
        touches half the rows: no widened temporary, no add over the other half)."""
        length = self.rows.stop - self.rows.start
        dk_acc.narrow(2, self.rows.start, length).add_(self.dk)
        dv_acc.narrow(2, self.rows.start, length).add_(self.dv)


def _remote_block_grads(
    dout: Tensor, q: Tensor, k_blk: Tensor, v_blk: Tensor, out: Tensor, lse: Tensor,
    calls: tuple[BlockCall, ...], opts: AttentionOptions, dq_acc: Tensor,
) -> _BlockShare:
    """dq share into ``dq_acc``; returns this rank's dK/dV share of a remote block. When one kernel
    call makes the whole share (the usual case, dense masks) its outputs are used as they are, over the
    rows they cover, instead of being added into fresh zero buffers: no block-sized temporaries at the
    backward's peak, and no zero-fill-and-add pass."""
    acc, n = dq_acc.dtype, k_blk.shape[2]
    if not calls:  # no key of the block is visible here (causal, a later rank): a share over no rows
        empty = [x.new_empty((*x.shape[:2], 0, x.shape[3]), dtype=acc) for x in (k_blk, v_blk)]
        return _BlockShare(slice(0, 0), n, *empty)
    if len(calls) == 1:
        call = calls[0]
        dq, dk, dv = piece_backward(dout, q, k_blk, v_blk, out, lse, call, opts.scale, opts.softcap)
        dq_acc.narrow(2, call.q_rows.start, call.q_rows.stop - call.q_rows.start).add_(dq)
        return _BlockShare(call.k_rows, n, dk, dv)
    dk_blk = torch.zeros(k_blk.shape, dtype=acc, device=k_blk.device)
    dv_blk = torch.zeros(v_blk.shape, dtype=acc, device=v_blk.device)
    block_grads(dout, q, k_blk, v_blk, out, lse, calls, opts.scale, dq_acc, dk_blk, dv_blk, opts.softcap)
    return _BlockShare(slice(0, n), n, dk_blk, dv_blk)


def _own_block_grads(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    calls: tuple[BlockCall, ...], opts: AttentionOptions, acc: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor]:
    """The ``acc`` (fp32) accumulators of dq, dk, dv, started from the own block's shares. The own block
    is one kernel call over every row for dense masks (the causal diagonal included): its outputs then
    become the accumulators themselves, instead of zero fills and adds (three block-sized passes)."""
    n_q, n_k = q.shape[2], k.shape[2]
    if len(calls) == 1 and calls[0].q_rows == slice(0, n_q) and calls[0].k_rows == slice(0, n_k):
        dq, dk, dv = piece_backward(dout, q, k, v, out, lse, calls[0], opts.scale, opts.softcap)
        return dq.to(acc), dk.to(acc), dv.to(acc)
    dq_acc = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk_own = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv_own = torch.zeros(v.shape, dtype=acc, device=v.device)
    block_grads(dout, q, k, v, out, lse, calls, opts.scale, dq_acc, dk_own, dv_own, opts.softcap)
    return dq_acc, dk_own, dv_own


def ring_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    comm: RingExchange, opts: AttentionOptions, expander: BlockExpander | None = None,
    into: tuple[Tensor, Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of ring attention; ``out`` is the forward output (input dtype), ``lse`` its fp32 lse.
    Returns dq, dk, dv in the input dtypes. ``into``: tensors shaped like q, k, v (a head chunk's slices
    of the whole gradients, may be views) that receive dq, dk, dv and are returned; in the accumulation
    dtype they are the accumulators themselves, so no second set of gradient-sized buffers lives through
    the ring. With an ``expander``, ``k``, ``v`` are the compressed
    blocks (see :func:`ring_forward`): each block's K/V shares are reduced to the compressed form
    (:meth:`BlockExpander.reduce`) before they travel, and dk, dv are the compressed blocks' gradients.

    Block j makes ``hops[j]`` hops (see :func:`~seqpar.attn.common.block_hops`); its dK/dV
    accumulator starts at rank j+1, collects at each rank up to j + hops[j] and goes home from there."""
    world, rank = comm.world_size, comm.rank
    acc = lse_dtype(q.dtype)
    wire = dkv_wire_dtype(opts.dkv_wire_dtype, acc)  # what the dK/dV accumulators travel in
    seq_local = q.shape[2]
    hops = block_hops(opts, world, seq_local)
    # once, in the layout the plan's kernels read (no per-hop copies); an expander's K/V are known only expanded
    calls = [] if expander is not None else [
        (len(range(seq_local)[c.q_rows]), len(range(seq_local)[c.k_rows]), c.causal or c.anti)
        for src in range(world) if src == rank or (rank - src) % world <= hops[src]
        for c in block_calls(opts, world, rank, src, seq_local)
    ]
    dout, out = backward_layout(dout, out, q, k, calls, v_head_dim=v.shape[-1])
    k, v = k.contiguous(), v.contiguous()

    kv_pending = _exchange(comm, [k, v], None, _KV, send=hops[rank] >= 1, recv=hops[(rank - 1) % world] >= 1)
    if kv_pending is not None and not opts.overlap:
        kv_pending.wait()
    # own block first: its share waits for the accumulator coming home at the end
    own = block_calls(opts, world, rank, rank, seq_local)
    if expander is None:
        dq_acc, dk_own, dv_own = _own_block_grads(dout, q, k, v, out, lse, own, opts, acc)
    else:
        dq_acc, dk_own, dv_own = _own_block_grads(dout, q, *expander.expand(k, v), out, lse, own, opts, acc)
        dk_own, dv_own = expander.reduce(k, v, dk_own, dv_own)
    if into is not None and all(t.dtype == acc for t in into):
        # accumulate in the caller's gradients: the own block's shares are copied there once, now, and
        # their buffers freed before the hops (instead of living through them and being copied at the end)
        dq_acc, dk_own, dv_own = (dst.copy_(share) for dst, share in zip(into, (dq_acc, dk_own, dv_own)))
    # the shapes (and wire dtype) of the accumulators a rank only receives: dk_own / dv_own themselves
    # when they travel in the accumulation dtype, else one-element templates seen at their shape
    dkv_shapes = [t if t.dtype == wire else t.new_empty((), dtype=wire).expand(t.shape) for t in (dk_own, dv_own)]

    buffers: list[list[Tensor] | None] = [None, None]
    chain: Pending | None = None  # the last step's accumulator exchange with ranks r-1 / r+1
    dkv_sent: list[Tensor] | None = None  # the accumulators last sent on; reused as receive buffers
    home_sends: list[Pending] = []  # accumulators sent home (waited at the end)
    home_in: Pending | None = None  # our own block's accumulator
    for step in range(1, max(hops) + 1):
        src, prev = (rank - step) % world, (rank - 1 - step) % world
        have = step <= hops[src]  # block src reached us (its recv was posted at the last step)
        received = kv_pending.wait() if kv_pending is not None else None  # this hop's K/V: touched now
        kv_pending = None
        send_kv, recv_kv = step + 1 <= hops[src], step + 1 <= hops[prev]
        kv_pending = _exchange(comm, received if have else [k, v], buffers[step % 2], _KV, send=send_kv, recv=recv_kv)
        if not recv_kv:  # the last hop's block: the older buffer (its send waited above) is never reused
            buffers[step % 2] = None
        if kv_pending is not None and not opts.overlap:
            kv_pending.wait()
        chain_recv = step < hops[prev]  # block prev's accumulator comes on from rank r-1
        home_recv = step == hops[rank]  # our own block's accumulator comes home from rank r + step
        send: list[Tensor] | None = None
        share = None
        if have:
            k_cur, v_cur = received
            buffers[(step + 1) % 2] = received
            k_blk, v_blk = (k_cur, v_cur) if expander is None else expander.expand(k_cur, v_cur)
            share = _remote_block_grads(
                dout, q, k_blk, v_blk, out, lse, block_calls(opts, world, rank, src, seq_local), opts, dq_acc
            )
            del k_blk, v_blk
            if expander is not None:
                dk_c, dv_c = expander.reduce(k_cur, v_cur, *share.start(acc))
                share = _BlockShare(slice(0, dk_c.shape[2]), dk_c.shape[2], dk_c, dv_c)
        # the last step's accumulator exchange is waited only now, after this hop's kernels (its buffer is
        # first touched by the add below; seqpar.comm.schedule): the dK/dV transfer hides behind them.
        # The wait also completes our last send, so its buffers are free (the receive buffers below)
        incoming = chain.wait() if chain is not None else None
        chain, free = None, dkv_sent
        if share is not None:
            if step == 1:  # first hop of block src's accumulator (rounded once to the wire dtype)
                send = share.start(wire)
            else:  # the accumulator of block src arrived from rank r-1 (wire dtype; the add runs in acc)
                send = incoming
                share.add_to(*send)
        del share, incoming
        onward = send is not None and step < hops[src]
        chain = _exchange(comm, send if onward else dkv_shapes, free if chain_recv else None, _DKV,
                          send=onward, recv=chain_recv)
        home_send = send is not None and not onward  # the block's last hop: straight home
        home_buf = None if chain_recv else free
        if home_send and home_recv:  # one exchange (a dense ring's last step: the next rank, shift 1)
            home_in = _exchange(comm, send, home_buf, _HOME, shift=world - step)
            home_sends.append(home_in)
        elif home_send:
            home_sends.append(_exchange(comm, send, None, _HOME, shift=world - step, recv=False))
        elif home_recv:
            home_in = _exchange(comm, dkv_shapes, home_buf, _HOME, shift=world - step, send=False)
        if not opts.overlap:
            for p in (chain, home_in, *home_sends):
                if p is not None:
                    p.wait()
        dkv_sent = send if onward else None  # a buffer on its way home is not reused
    if chain is not None:
        chain.wait()
    for p in home_sends:
        p.wait()
    if home_in is not None:  # own block's accumulator, home from rank + hops[rank] (added in acc)
        dk_in, dv_in = home_in.wait()
        dk_own += dk_in
        dv_own += dv_in
    if into is not None:
        for dst, grad in zip(into, (dq_acc, dk_own, dv_own)):
            if dst is not grad:  # accumulated elsewhere (another dtype): one conversion into place
                dst.copy_(grad)
        return into
    return dq_acc.to(q.dtype), dk_own.to(k.dtype), dv_own.to(v.dtype)


def _exchange(
    comm: RingExchange, tensors: list[Tensor], out: list[Tensor] | None, channel: int, *,
    shift: int = 1, send: bool = True, recv: bool = True,
) -> Pending | None:
    """One exchange, or None when this rank neither sends nor receives. Arguments at their defaults
    are not passed, so communicators without ``shift``/``send``/``recv`` still run full rings."""
    if not (send or recv):
        return None
    extra = {name: val for name, val, default in (("shift", shift, 1), ("send", send, True), ("recv", recv, True))
             if val != default}
    return comm.exchange(tensors, out=out if recv else None, channel=channel, **extra)


def ring_attention_forward(
    q: Tensor, k: Tensor, v: Tensor, comm: RingExchange, opts: AttentionOptions, sinks: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Ring forward over ``opts.head_chunks`` head chunks, one ring pass each.

    Returns ``out`` ``(batch, q_heads, seq_local, v_head_dim)`` in q's dtype and memory layout and the
    fp32 ``lse`` ``(batch, q_heads, seq_local)`` (sinks included). Each pass moves only its chunk's K/V, so the buffers in flight are
    ``1 / head_chunks`` of a block."""
    # ``out`` takes q's memory layout: a Hugging Face q is a (batch, seq, heads, dim) buffer seen
    # transposed, so the caller's transpose back + .contiguous() is then free, and o_proj saves the
    # very storage attention saves instead of a copy (one hidden-sized tensor per layer)
    if opts.head_chunks == 1:
        out_acc, lse = ring_forward(q, k, v, comm, opts, sinks)
        if out_acc.dtype == q.dtype and in_layout_of(out_acc, q):
            return out_acc, lse
        return output_like(q, v.shape[-1]).copy_(out_acc), lse
    out = output_like(q, v.shape[-1])
    lse = torch.empty(q.shape[:-1], dtype=lse_dtype(q.dtype), device=q.device)
    for qs, ks in head_chunk_slices(q.shape[1], k.shape[1], opts.head_chunks):
        sinks_c = None if sinks is None else sinks[qs]
        out_c, lse_c = ring_forward(q[:, qs], k[:, ks], v[:, ks], comm, opts, sinks_c)
        out[:, qs] = out_c
        lse[:, qs] = lse_c
        del out_c, lse_c
    return out, lse


def ring_attention_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    comm: RingExchange, opts: AttentionOptions,
) -> tuple[Tensor, Tensor, Tensor]:
    """Ring backward over ``opts.head_chunks`` head chunks; dq, dk, dv in the input dtypes."""
    if opts.head_chunks == 1:
        return ring_backward(dout, q, k, v, out, lse, comm, opts)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for qs, ks in head_chunk_slices(q.shape[1], k.shape[1], opts.head_chunks):
        # each pass accumulates straight into its heads of dq, dk, dv (fp32 inputs; other dtypes convert
        # into them at the end): no chunk-sized accumulators beside the gradients at the peak
        ring_backward(dout[:, qs], q[:, qs], k[:, ks], v[:, ks], out[:, qs], lse[:, qs].contiguous(), comm, opts,
                      into=(dq[:, qs], dk[:, ks], dv[:, ks]))
    return dq, dk, dv


class RingAttention(torch.autograd.Function):
    """Exact attention over the SP ring; a thin autograd wrapper of :func:`ring_attention_forward` /
    :func:`ring_attention_backward`. The backward is the forward's mirror: the same ring, the same
    blocks, and the gradients of each block sent back along with it. ``sinks`` ``(q_heads,)`` (or
    None) gets this rank's share of its gradient (its rows' terms), like any replicated weight."""

    @staticmethod
    def forward(  # noqa: ANN001
        ctx, q: Tensor, k: Tensor, v: Tensor, comm: RingExchange, opts: AttentionOptions, sinks: Tensor | None = None
    ) -> Tensor:
        return function_forward(ctx, ring_attention_forward, q, k, v, comm, opts, sinks)

    @staticmethod
    def backward(ctx, dout: Tensor):  # noqa: ANN001, ANN205
        return function_backward(ctx, ring_attention_backward, dout)
