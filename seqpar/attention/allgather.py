"""All-gather attention (the Llama-3 style): gather K/V from the SP group, attend locally.

Forward: one all-gather of K and one of V, in flight while the rank attends to its own block; then
the other ranks' blocks (causal blocks in the future skipped, as in the ring). The gathered K/V are
not kept for backward — holding them would cost O(S) per layer until backward — so backward gathers
them again, computes the remote blocks' dK/dV shares in fp32 and reduce-scatters them to their
owners (the dual of the gather) while it computes its own block's share.

Volume per rank: forward (P-1) K/V blocks; backward (P-1) K/V blocks plus (P-1) fp32 dK/dV blocks.
Memory: O(S) for the gathered K/V and the fp32 dK/dV of the full sequence, transiently, per layer.

Layouts: q ``(batch, q_heads, seq_local, head_dim)``, k/v ``(batch, kv_heads, seq_local, head_dim)``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from seqpar.attention.plan import plan_blocks
from seqpar.attention.ring import AttentionOptions, _block_grads, _chunk_len
from seqpar.comm.compat import all_gather_into, reduce_scatter_into
from seqpar.kernels import block_forward, lse_dtype, merge_owned_into, new_accumulators
from seqpar.sharding import chunk_ids

__all__ = ["allgather_forward", "allgather_backward", "AllGatherAttention"]


def _start_gather(x: Tensor, group: dist.ProcessGroup, world: int) -> tuple[Tensor, object]:
    """Start gathering ``(B, H, L, D)`` blocks; the result views as ``(P, B, H, L, D)`` (block p from
    SP rank p) once the returned work is waited on."""
    out = torch.empty((world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    work = all_gather_into(out, x, group=group, async_op=True)
    return out.view(world, *x.shape), work


def allgather_forward(
    q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup, opts: AttentionOptions
) -> tuple[Tensor, Tensor]:
    """Returns the fp32 ``out`` accumulator and ``lse`` ``(batch, q_heads, seq_local)``."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    q_chunks = chunk_ids(rank, world, opts.sharding)
    clen = _chunk_len(q.shape[2], rank, world, opts.sharding)
    (k_all, k_work), (v_all, v_work) = _start_gather(k, group, world), _start_gather(v, group, world)
    out, lse = new_accumulators(q, lse_dtype(q.dtype))

    def attend(src: int, k_blk: Tensor, v_blk: Tensor) -> None:
        for call in plan_blocks(q_chunks, chunk_ids(src, world, opts.sharding), clen, opts.causal):
            o, o_lse = block_forward(
                q[:, :, call.q_rows], k_blk[:, :, call.k_rows], v_blk[:, :, call.k_rows],
                scale=opts.scale, causal=call.causal,
            )
            merge_owned_into(out[:, :, call.q_rows], lse[:, :, call.q_rows], o, o_lse)

    attend(rank, k, v)  # the own block needs no communication: it hides the gather
    k_work.wait()
    v_work.wait()
    for src in range(world):
        if src != rank:
            attend(src, k_all[src], v_all[src])
    return out, lse


def allgather_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    group: dist.ProcessGroup, opts: AttentionOptions,
) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv in the input dtypes; dK/dV shares are summed across ranks in fp32.

    The remote blocks' dK/dV shares are reduce-scattered while this rank computes its own block's
    share, which needs no communication; the own slot of the reduce-scatter input stays zero."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    acc = lse_dtype(q.dtype)
    q_chunks = chunk_ids(rank, world, opts.sharding)
    clen = _chunk_len(q.shape[2], rank, world, opts.sharding)
    dout = dout.contiguous()
    (k_all, k_work), (v_all, v_work) = _start_gather(k, group, world), _start_gather(v, group, world)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk_all = torch.zeros(k_all.shape, dtype=acc, device=k.device)  # (P, B, Hkv, L, D)
    dv_all = torch.zeros(v_all.shape, dtype=acc, device=v.device)
    k_work.wait()
    v_work.wait()
    for src in range(world):
        if src != rank:
            _block_grads(
                dout, q, k_all[src], v_all[src], out, lse, q_chunks, chunk_ids(src, world, opts.sharding),
                clen, opts, dq, dk_all[src], dv_all[src],
            )
    del k_all, v_all, k_work, v_work  # the works hold the gathered buffers too
    dk = torch.empty(k.shape, dtype=acc, device=k.device)
    dv = torch.empty(v.shape, dtype=acc, device=v.device)
    works = [
        reduce_scatter_into(dk, dk_all.view(-1, *k.shape[1:]), group=group, async_op=True),
        reduce_scatter_into(dv, dv_all.view(-1, *v.shape[1:]), group=group, async_op=True),
    ]
    dk_own = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv_own = torch.zeros(v.shape, dtype=acc, device=v.device)
    _block_grads(dout, q, k, v, out, lse, q_chunks, q_chunks, clen, opts, dq, dk_own, dv_own)
    for w in works:
        w.wait()
    dk += dk_own
    dv += dv_own
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class AllGatherAttention(torch.autograd.Function):
    """Exact attention by all-gathered K/V; backward re-gathers and reduce-scatters dK/dV (the dual
    of the forward's all-gather)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup, opts: AttentionOptions) -> Tensor:  # noqa: ANN001
        out_acc, lse = allgather_forward(q, k, v, group, opts)
        out = out_acc.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.opts = group, opts
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):  # noqa: ANN001, ANN205
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = allgather_backward(dout, q, k, v, out, lse, ctx.group, ctx.opts)
        return dq, dk, dv, None, None
