"""Differentiable collectives along a tensor dimension; each backward is its forward's dual.

- :class:`AllGather` — forward: every rank's ``x`` concatenated in rank order along ``dim``.
  Backward, by ``grad_reduction``: ``"sum"`` reduce-scatters the incoming gradient (the dual of the
  all-gather; right when each rank's downstream loss is a separate term of the total), ``"slice"``
  takes this rank's block of it (right when every rank computes the *same* loss on the gathered
  tensor, so the gradients on the ranks are copies of one gradient, not terms to add).
- :class:`ReduceScatter` — forward: sum over ranks, each keeps its block along ``dim``; backward:
  all-gather (the dual).

dtype and device come from the inputs; nothing here hard-codes either.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from seqpar.comm.compat import all_gather_into, reduce_scatter_into

__all__ = ["AllGather", "ReduceScatter", "all_gather", "reduce_scatter"]

GRAD_REDUCTIONS = ("slice", "sum")


def _gather(x: Tensor, dim: int, group: dist.ProcessGroup, world: int) -> Tensor:
    # gather along dim 0 (what the backends concatenate along), then move the blocks to `dim`
    x0 = x.movedim(dim, 0).contiguous()  # (n, ...)
    out = torch.empty((world * x0.shape[0], *x0.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_into(out, x0, group=group)
    return out.movedim(0, dim)


def _reduce_scatter(x: Tensor, dim: int, group: dist.ProcessGroup, world: int) -> Tensor:
    x0 = x.movedim(dim, 0).contiguous()  # (world * n, ...)
    out = torch.empty((x0.shape[0] // world, *x0.shape[1:]), dtype=x.dtype, device=x.device)
    reduce_scatter_into(out, x0, group=group)
    return out.movedim(0, dim)


class AllGather(torch.autograd.Function):
    """``(.., n, ..)`` on each rank -> ``(.., world * n, ..)``, rank order along ``dim``."""

    @staticmethod
    def forward(ctx, x: Tensor, dim: int, group: dist.ProcessGroup, grad_reduction: str) -> Tensor:  # noqa: ANN001
        ctx.dim, ctx.group, ctx.grad_reduction = dim, group, grad_reduction
        ctx.world, ctx.rank = dist.get_world_size(group), dist.get_rank(group)
        return _gather(x, dim, group, ctx.world)

    @staticmethod
    def backward(ctx, grad: Tensor):  # noqa: ANN001, ANN205
        if ctx.grad_reduction == "sum":
            return _reduce_scatter(grad, ctx.dim, ctx.group, ctx.world), None, None, None
        n = grad.shape[ctx.dim] // ctx.world
        return grad.narrow(ctx.dim, ctx.rank * n, n).contiguous(), None, None, None


class ReduceScatter(torch.autograd.Function):
    """``(.., world * n, ..)`` on each rank -> the sum over ranks of block ``rank``: ``(.., n, ..)``."""

    @staticmethod
    def forward(ctx, x: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:  # noqa: ANN001
        ctx.dim, ctx.group, ctx.world = dim, group, dist.get_world_size(group)
        if x.shape[dim] % ctx.world:
            raise ValueError(
                f"reduce_scatter: dim {dim} has length {x.shape[dim]}, not a multiple of the group size {ctx.world}"
            )
        return _reduce_scatter(x, dim, group, ctx.world)

    @staticmethod
    def backward(ctx, grad: Tensor):  # noqa: ANN001, ANN205
        return _gather(grad, ctx.dim, ctx.group, ctx.world), None, None


def all_gather(x: Tensor, dim: int, group: dist.ProcessGroup | None, *, grad_reduction: str = "slice") -> Tensor:
    """Differentiable all-gather along ``dim``; identity for a group of one (or no group)."""
    if grad_reduction not in GRAD_REDUCTIONS:
        raise ValueError(f"grad_reduction={grad_reduction!r} is invalid: choose one of {list(GRAD_REDUCTIONS)}")
    if group is None or dist.get_world_size(group) == 1:
        return x
    return AllGather.apply(x, dim % x.dim(), group, grad_reduction)


def reduce_scatter(x: Tensor, dim: int, group: dist.ProcessGroup | None) -> Tensor:
    """Differentiable reduce-scatter (sum) along ``dim``; identity for a group of one."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    return ReduceScatter.apply(x, dim % x.dim(), group)
