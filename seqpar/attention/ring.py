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

Head chunks (``opts.head_chunks = G``): the ring runs G times, each pass on kv_heads / G K/V heads and
their query heads, writing into full-size outputs. Volume is unchanged (G passes of 1/G blocks); the
buffers in flight and the kernels' outputs shrink by G, which is most of the ring's memory beyond the
inputs, outputs and gradients themselves (at P = 4: ~8 + 11/G blocks of S/P instead of 19).

Layouts: q ``(batch, q_heads, seq_local, head_dim)``, k/v ``(batch, kv_heads, seq_local, head_dim)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from seqpar.attention.plan import head_chunk_slices, plan_blocks
from seqpar.comm.ring import RingExchange
from seqpar.kernels import (
    block_backward,
    block_forward,
    lse_dtype,
    merge_owned_into,
    new_accumulators,
)
from seqpar.sharding import chunk_ids

__all__ = [
    "AttentionOptions", "ring_forward", "ring_backward", "ring_attention_forward", "ring_attention_backward",
    "RingAttention",
]

_KV = 0  # channel of the K/V blocks
_DKV = 1  # channel of the travelling dK/dV accumulators


@dataclass(frozen=True)
class AttentionOptions:
    """Static options of one distributed attention call."""

    causal: bool
    scale: float
    sharding: str = "contiguous"
    overlap: bool = True
    head_chunks: int = 1  # heads processed in this many independent passes (resolved, >= 1)


def _chunk_len(seq_local: int, rank: int, world: int, sharding: str) -> int:
    return seq_local // len(chunk_ids(rank, world, sharding))


def ring_forward(q: Tensor, k: Tensor, v: Tensor, comm: RingExchange, opts: AttentionOptions) -> tuple[Tensor, Tensor]:
    """Returns ``out`` (fp32/fp64 accumulator, q's layout) and ``lse`` ``(batch, q_heads, seq_local)``."""
    world, rank = comm.world_size, comm.rank
    q_chunks = chunk_ids(rank, world, opts.sharding)
    clen = _chunk_len(q.shape[2], rank, world, opts.sharding)
    out, lse = new_accumulators(q, lse_dtype(q.dtype))
    k_cur, v_cur = k.contiguous(), v.contiguous()
    buffers: list[list[Tensor] | None] = [None, None]
    for step in range(world):
        pending = None
        if step + 1 < world:
            pending = comm.exchange([k_cur, v_cur], out=buffers[step % 2], channel=_KV)
            if not opts.overlap:
                pending.wait()
        src = (rank - step) % world
        for call in plan_blocks(q_chunks, chunk_ids(src, world, opts.sharding), clen, opts.causal):
            o, o_lse = block_forward(
                q[:, :, call.q_rows], k_cur[:, :, call.k_rows], v_cur[:, :, call.k_rows],
                scale=opts.scale, causal=call.causal,
            )
            merge_owned_into(out[:, :, call.q_rows], lse[:, :, call.q_rows], o, o_lse)
        if pending is not None:
            k_cur, v_cur = received = pending.wait()
            buffers[step % 2] = received
    return out, lse


def _block_grads(
    dout: Tensor, q: Tensor, k_blk: Tensor, v_blk: Tensor, out: Tensor, lse: Tensor,
    q_chunks: list[int], k_chunks: list[int], clen: int, opts: AttentionOptions,
    dq_acc: Tensor, dk_acc: Tensor, dv_acc: Tensor,
) -> None:
    """Add one K/V block's shares of dq, dk, dv into the fp32 accumulators."""
    for call in plan_blocks(q_chunks, k_chunks, clen, opts.causal):
        qr, kr = call.q_rows, call.k_rows
        dq, dk, dv = block_backward(
            dout[:, :, qr], q[:, :, qr], k_blk[:, :, kr], v_blk[:, :, kr], out[:, :, qr], lse[:, :, qr],
            scale=opts.scale, causal=call.causal,
        )
        dq_acc[:, :, qr] += dq
        dk_acc[:, :, kr] += dk
        dv_acc[:, :, kr] += dv


def _remote_block_grads(
    dout: Tensor, q: Tensor, k_blk: Tensor, v_blk: Tensor, out: Tensor, lse: Tensor,
    q_chunks: list[int], k_chunks: list[int], clen: int, opts: AttentionOptions, dq_acc: Tensor,
) -> tuple[Tensor, Tensor]:
    """dq share into ``dq_acc``; returns this rank's fp32 dK/dV share of a remote block. When one
    kernel call covers every key row (the usual case) its outputs are used as they are, instead of
    being added into fresh zero buffers: two block-sized buffers fewer at the backward's peak."""
    acc = dq_acc.dtype
    calls = plan_blocks(q_chunks, k_chunks, clen, opts.causal)
    if len(calls) == 1 and calls[0].k_rows == slice(0, k_blk.shape[2]):
        qr = calls[0].q_rows
        dq, dk, dv = block_backward(
            dout[:, :, qr], q[:, :, qr], k_blk, v_blk, out[:, :, qr], lse[:, :, qr],
            scale=opts.scale, causal=calls[0].causal,
        )
        dq_acc[:, :, qr] += dq
        return dk.to(acc), dv.to(acc)
    dk_blk = torch.zeros(k_blk.shape, dtype=acc, device=k_blk.device)
    dv_blk = torch.zeros(v_blk.shape, dtype=acc, device=v_blk.device)
    _block_grads(dout, q, k_blk, v_blk, out, lse, q_chunks, k_chunks, clen, opts, dq_acc, dk_blk, dv_blk)
    return dk_blk, dv_blk


def ring_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    comm: RingExchange, opts: AttentionOptions,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of ring attention; ``out`` is the forward output (input dtype), ``lse`` its fp32 lse.
    Returns dq, dk, dv in the input dtypes."""
    world, rank = comm.world_size, comm.rank
    acc = lse_dtype(q.dtype)
    q_chunks = chunk_ids(rank, world, opts.sharding)
    clen = _chunk_len(q.shape[2], rank, world, opts.sharding)
    dout = dout.contiguous()
    k, v = k.contiguous(), v.contiguous()

    dq_acc = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk_own = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv_own = torch.zeros(v.shape, dtype=acc, device=v.device)

    kv_pending = comm.exchange([k, v], channel=_KV) if world > 1 else None
    if kv_pending is not None and not opts.overlap:
        kv_pending.wait()
    # own block first: its share waits for the accumulator coming home at the end
    _block_grads(dout, q, k, v, out, lse, q_chunks, q_chunks, clen, opts, dq_acc, dk_own, dv_own)

    buffers: list[list[Tensor] | None] = [None, None]
    dkv_pending = None
    dkv_sent: list[Tensor] | None = None  # the accumulators last sent; reused as the next receive buffers
    for step in range(1, world):
        k_cur, v_cur = received = kv_pending.wait()
        kv_pending = None
        if step + 1 < world:
            kv_pending = comm.exchange([k_cur, v_cur], out=buffers[step % 2], channel=_KV)
            if not opts.overlap:
                kv_pending.wait()
        buffers[(step + 1) % 2] = received
        src = (rank - step) % world
        dk_blk, dv_blk = _remote_block_grads(
            dout, q, k_cur, v_cur, out, lse, q_chunks, chunk_ids(src, world, opts.sharding), clen, opts, dq_acc
        )
        if dkv_pending is None:  # first hop of block src's accumulator
            send = [dk_blk.contiguous(), dv_blk.contiguous()]
        else:  # the accumulator of block src arrives from rank r-1 (and our last send is done)
            dk_in, dv_in = send = dkv_pending.wait()
            dk_in += dk_blk
            dv_in += dv_blk
        del dk_blk, dv_blk
        dkv_pending = comm.exchange(send, out=dkv_sent, channel=_DKV)
        if not opts.overlap:
            dkv_pending.wait()
        dkv_sent = send
    if dkv_pending is not None:  # own block's accumulator, home after P-1 hops
        dk_in, dv_in = dkv_pending.wait()
        dk_own += dk_in
        dv_own += dv_in
    return dq_acc.to(q.dtype), dk_own.to(k.dtype), dv_own.to(v.dtype)


def ring_attention_forward(
    q: Tensor, k: Tensor, v: Tensor, comm: RingExchange, opts: AttentionOptions
) -> tuple[Tensor, Tensor]:
    """Ring forward over ``opts.head_chunks`` head chunks, one ring pass each.

    Returns ``out`` in q's dtype and layout and the fp32 ``lse`` ``(batch, q_heads, seq_local)``. Each
    pass moves only its chunk's K/V, so the buffers in flight are ``1 / head_chunks`` of a block."""
    if opts.head_chunks == 1:
        out_acc, lse = ring_forward(q, k, v, comm, opts)
        return out_acc.to(q.dtype), lse
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:-1], dtype=lse_dtype(q.dtype), device=q.device)
    for qs, ks in head_chunk_slices(q.shape[1], k.shape[1], opts.head_chunks):
        out_c, lse_c = ring_forward(q[:, qs], k[:, ks], v[:, ks], comm, opts)
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
    blocks, and the gradients of each block sent back along with it."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, comm: RingExchange, opts: AttentionOptions) -> Tensor:  # noqa: ANN001
        out, lse = ring_attention_forward(q, k, v, comm, opts)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm, ctx.opts = comm, opts
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):  # noqa: ANN001, ANN205
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_attention_backward(dout, q, k, v, out, lse, ctx.comm, ctx.opts)
        return dq, dk, dv, None, None
