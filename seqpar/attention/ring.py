"""Ring attention: K/V blocks travel around the SP ring while each rank attends its local queries.

Forward (rank r of P, step s = 0..P-1): attend q to the K/V block of rank (r - s) mod P and merge
with the log-sum-exp rule, while the block is already being forwarded to rank r+1 and the next one
received from rank r-1 (double-buffered: two receive buffers alternate). Per rank the forward sends
P-1 K/V blocks.

Backward: dQ stays local (fp32). dK/dV of a block travel with it: the accumulator of rank j's block
starts at rank j+1 (the first to see that block after j itself), gathers every rank's contribution
as it goes round, and arrives home after P-1 hops, where j adds its own (diagonal) share, computed
first so it overlaps the first transfer. Per rank the backward sends P-1 K/V blocks (input dtype) and
P-1 dK/dV blocks (fp32); with no stored copies of remote blocks this is the minimum, and no rank ever
holds more than a few blocks of size S/P: memory O(S/P).

Documents and windows (``opts.cu_seqlens``, ``opts.window``): the blocks make only
:func:`~seqpar.attention.common.ring_hops` H <= P-1 hops, the farthest ring distance at which any rank
still sees a key of the block (every rank derives H from the same integers); forward H K/V blocks per
rank, backward H K/V blocks and H dK/dV blocks: each accumulator collects over H - 1 hops and then
goes straight home from rank j + H to j. Causal documents no longer than a shard under contiguous
sharding: H = 1. Whole blocks travel (under zigzag a block's two chunks have neighbours on ranks
r + 1 and r - 1 = r + P - 1, so zigzag keeps H = P - 1 once a document crosses a chunk edge).

Head chunks (``opts.head_chunks = G``): the ring runs G times, each pass on kv_heads / G K/V heads and
their query heads, writing into full-size outputs. Volume is unchanged (G passes of 1/G blocks); the
buffers in flight and the kernels' outputs shrink by G, which is most of the ring's memory beyond the
inputs, outputs and gradients themselves (at P = 4: ~8 + 11/G blocks of S/P instead of 19).

Layouts: q ``(batch, q_heads, seq_local, head_dim)``, k/v ``(batch, kv_heads, seq_local, head_dim)``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from seqpar.attention.common import (
    AttentionOptions,
    block_calls,
    block_grads,
    forward_block,
    piece_backward,
    ring_hops,
)
from seqpar.attention.plan import BlockCall, head_chunk_slices
from seqpar.comm.ring import RingExchange
from seqpar.kernels import Partials, add_sink, lse_dtype, sink_grad

__all__ = [
    "AttentionOptions", "ring_forward", "ring_backward", "ring_attention_forward", "ring_attention_backward",
    "RingAttention",
]

_KV = 0  # channel of the K/V blocks
_DKV = 1  # channel of the travelling dK/dV accumulators


def ring_forward(
    q: Tensor, k: Tensor, v: Tensor, comm: RingExchange, opts: AttentionOptions, sinks: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Returns ``out`` (fp32/fp64 accumulator, q's layout) and ``lse`` ``(batch, q_heads, seq_local)``.
    ``sinks``: optional ``(q_heads,)`` sink logits, one more term of every row's softmax."""
    world, rank = comm.world_size, comm.rank
    hops = ring_hops(opts, world, q.shape[2])
    acc = Partials.like(q, lse_dtype(q.dtype))
    k_cur, v_cur = k.contiguous(), v.contiguous()
    buffers: list[list[Tensor] | None] = [None, None]
    for step in range(hops + 1):
        pending = None
        if step + 1 <= hops:
            pending = comm.exchange([k_cur, v_cur], out=buffers[step % 2], channel=_KV)
            if not opts.overlap:
                pending.wait()
        src = (rank - step) % world
        forward_block(q, k_cur, v_cur, block_calls(opts, world, rank, src, q.shape[2]), opts.scale, acc)
        if pending is not None:
            k_cur, v_cur = received = pending.wait()
            buffers[step % 2] = received
    out, lse = acc.finish()
    if sinks is not None:
        add_sink(out, lse, sinks)
    return out, lse


def _remote_block_grads(
    dout: Tensor, q: Tensor, k_blk: Tensor, v_blk: Tensor, out: Tensor, lse: Tensor,
    calls: tuple[BlockCall, ...], opts: AttentionOptions, dq_acc: Tensor,
) -> tuple[Tensor, Tensor]:
    """dq share into ``dq_acc``; returns this rank's fp32 dK/dV share of a remote block. When one
    kernel call covers every key row (the usual case) its outputs are used as they are, instead of
    being added into fresh zero buffers: two block-sized buffers fewer at the backward's peak."""
    acc = dq_acc.dtype
    if len(calls) == 1 and calls[0].k_rows == slice(0, k_blk.shape[2]):
        qr = calls[0].q_rows
        dq, dk, dv = piece_backward(dout, q, k_blk, v_blk, out, lse, calls[0], opts.scale)
        dq_acc[:, :, qr] += dq
        return dk.to(acc), dv.to(acc)
    dk_blk = torch.zeros(k_blk.shape, dtype=acc, device=k_blk.device)
    dv_blk = torch.zeros(v_blk.shape, dtype=acc, device=v_blk.device)
    block_grads(dout, q, k_blk, v_blk, out, lse, calls, opts.scale, dq_acc, dk_blk, dv_blk)
    return dk_blk, dv_blk


def ring_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    comm: RingExchange, opts: AttentionOptions,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of ring attention; ``out`` is the forward output (input dtype), ``lse`` its fp32 lse.
    Returns dq, dk, dv in the input dtypes."""
    world, rank = comm.world_size, comm.rank
    acc = lse_dtype(q.dtype)
    seq_local = q.shape[2]
    hops = ring_hops(opts, world, seq_local)
    dout = dout.contiguous()
    k, v = k.contiguous(), v.contiguous()

    dq_acc = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk_own = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv_own = torch.zeros(v.shape, dtype=acc, device=v.device)

    kv_pending = comm.exchange([k, v], channel=_KV) if hops > 0 else None
    if kv_pending is not None and not opts.overlap:
        kv_pending.wait()
    # own block first: its share waits for the accumulator coming home at the end
    own = block_calls(opts, world, rank, rank, seq_local)
    block_grads(dout, q, k, v, out, lse, own, opts.scale, dq_acc, dk_own, dv_own)

    buffers: list[list[Tensor] | None] = [None, None]
    dkv_pending = None
    dkv_sent: list[Tensor] | None = None  # the accumulators last sent; reused as the next receive buffers
    for step in range(1, hops + 1):
        k_cur, v_cur = received = kv_pending.wait()
        kv_pending = None
        if step + 1 <= hops:
            kv_pending = comm.exchange([k_cur, v_cur], out=buffers[step % 2], channel=_KV)
            if not opts.overlap:
                kv_pending.wait()
        buffers[(step + 1) % 2] = received
        src = (rank - step) % world
        dk_blk, dv_blk = _remote_block_grads(
            dout, q, k_cur, v_cur, out, lse, block_calls(opts, world, rank, src, seq_local), opts, dq_acc
        )
        if dkv_pending is None:  # first hop of block src's accumulator
            send = [dk_blk.contiguous(), dv_blk.contiguous()]
        else:  # the accumulator of block src arrives from rank r-1 (and our last send is done)
            dk_in, dv_in = send = dkv_pending.wait()
            dk_in += dk_blk
            dv_in += dv_blk
        del dk_blk, dv_blk
        # on to the next rank; after the block's last hop, straight home (rank - hops: the next
        # rank when the ring goes all the way round)
        shift = 1 if step < hops else world - hops
        # (shift passed only when != 1: communicators without it still run every full ring)
        dkv_pending = comm.exchange(send, out=dkv_sent, channel=_DKV, **({"shift": shift} if shift != 1 else {}))
        if not opts.overlap:
            dkv_pending.wait()
        dkv_sent = send
    if dkv_pending is not None:  # own block's accumulator, home from rank + hops
        dk_in, dv_in = dkv_pending.wait()
        dk_own += dk_in
        dv_own += dv_in
    return dq_acc.to(q.dtype), dk_own.to(k.dtype), dv_own.to(v.dtype)


def ring_attention_forward(
    q: Tensor, k: Tensor, v: Tensor, comm: RingExchange, opts: AttentionOptions, sinks: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Ring forward over ``opts.head_chunks`` head chunks, one ring pass each.

    Returns ``out`` in q's dtype and layout and the fp32 ``lse`` ``(batch, q_heads, seq_local)``
    (sinks included). Each pass moves only its chunk's K/V, so the buffers in flight are
    ``1 / head_chunks`` of a block."""
    if opts.head_chunks == 1:
        out_acc, lse = ring_forward(q, k, v, comm, opts, sinks)
        return out_acc.to(q.dtype), lse
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
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
        dq_c, dk_c, dv_c = ring_backward(
            dout[:, qs], q[:, qs], k[:, ks], v[:, ks], out[:, qs], lse[:, qs].contiguous(), comm, opts
        )
        dq[:, qs], dk[:, ks], dv[:, ks] = dq_c, dk_c, dv_c
        del dq_c, dk_c, dv_c
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
        out, lse = ring_attention_forward(q, k, v, comm, opts, sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.comm, ctx.opts = comm, opts
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):  # noqa: ANN001, ANN205
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dq, dk, dv = ring_attention_backward(dout, q, k, v, out, lse, ctx.comm, ctx.opts)
        dsinks = None if sinks is None else sink_grad(dout, out, lse, sinks)
        return dq, dk, dv, None, None, dsinks
