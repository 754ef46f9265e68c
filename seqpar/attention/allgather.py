"""All-gather attention (the Llama-3 style): gather K/V from the SP group, attend locally.

Forward: one all-gather of K and one of V; each rank attends its local queries to every rank's block
(causal blocks in the future skipped, as in the ring). The gathered K/V are not kept for backward —
holding them would cost O(S) per layer until backward — so backward gathers them again, computes
every block's dK/dV share in fp32 and reduce-scatters them to their owners (the dual of the gather).

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


def _gather_blocks(x: Tensor, group: dist.ProcessGroup, world: int) -> Tensor:
    """``(B, H, L, D)`` -> ``(P, B, H, L, D)``, block p from SP rank p."""
    out = torch.empty((world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_into(out, x, group=group)
    return out.view(world, *x.shape)


def allgather_forward(
    q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup, opts: AttentionOptions
) -> tuple[Tensor, Tensor]:
    """Returns the fp32 ``out`` accumulator and ``lse`` ``(batch, q_heads, seq_local)``."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    q_chunks = chunk_ids(rank, world, opts.sharding)
    clen = _chunk_len(q.shape[2], rank, world, opts.sharding)
    k_all, v_all = _gather_blocks(k, group, world), _gather_blocks(v, group, world)
    out, lse = new_accumulators(q, lse_dtype(q.dtype))
    for src in range(world):
        for call in plan_blocks(q_chunks, chunk_ids(src, world, opts.sharding), clen, opts.causal):
            o, o_lse = block_forward(
                q[:, :, call.q_rows], k_all[src][:, :, call.k_rows], v_all[src][:, :, call.k_rows],
                scale=opts.scale, causal=call.causal,
            )
            merge_owned_into(out[:, :, call.q_rows], lse[:, :, call.q_rows], o, o_lse)
    return out, lse


def allgather_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    group: dist.ProcessGroup, opts: AttentionOptions,
) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv in the input dtypes; dK/dV shares are summed across ranks in fp32."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    acc = lse_dtype(q.dtype)
    q_chunks = chunk_ids(rank, world, opts.sharding)
    clen = _chunk_len(q.shape[2], rank, world, opts.sharding)
    dout = dout.contiguous()
    k_all, v_all = _gather_blocks(k, group, world), _gather_blocks(v, group, world)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk_all = torch.zeros(k_all.shape, dtype=acc, device=k.device)  # (P, B, Hkv, L, D)
    dv_all = torch.zeros(v_all.shape, dtype=acc, device=v.device)
    for src in range(world):
        _block_grads(
            dout, q, k_all[src], v_all[src], out, lse, q_chunks, chunk_ids(src, world, opts.sharding),
            clen, opts, dq, dk_all[src], dv_all[src],
        )
    del k_all, v_all
    dk = torch.empty(k.shape, dtype=acc, device=k.device)
    dv = torch.empty(v.shape, dtype=acc, device=v.device)
    reduce_scatter_into(dk, dk_all.view(-1, *k.shape[1:]), group=group)
    reduce_scatter_into(dv, dv_all.view(-1, *v.shape[1:]), group=group)
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
