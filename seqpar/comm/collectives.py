"""Differentiable collectives along a tensor dimension; each backward is its forward's dual.

- :class:`AllGather` — forward: every rank's ``x`` concatenated in rank order along ``dim``.
  Backward, by ``grad_reduction``: ``"sum"`` reduce-scatters the incoming gradient (the dual of the
  all-gather; right when each rank's downstream loss is a separate term of the total), ``"slice"``
  takes this rank's block of it (right when every rank computes the *same* loss on the gathered
  tensor, so the gradients on the ranks are copies of one gradient, not terms to add).
- :class:`ReduceScatter` — forward: sum over ranks, each keeps its block along ``dim``; backward:
  all-gather (the dual).

dtype and device come from the inputs; nothing here hard-codes either. ``group=None`` means
:func:`seqpar.runtime.groups.resolve_group` (the default manager's SP group; without one on a world > 1: an error); a group of
one, or no process group at all, makes every op the identity.

While ``torch.compile`` traces (``torch.compiler.is_compiling()``), :func:`all_gather` and
:func:`reduce_scatter` run torch's functional collectives instead, which dynamo traces (it cannot trace an
autograd Function around an in-place collective): the same values and the same gradients, so no caller
special-cases compile.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from seqpar.comm.compat import all_gather_into, reduce_scatter_into
from seqpar.runtime.groups import resolve_group

__all__ = ["GRAD_REDUCTIONS", "AllGather", "ReduceScatter", "all_gather", "reduce_scatter"]

GRAD_REDUCTIONS = ("slice", "sum")


def _gather(x: Tensor, dim: int, group: dist.ProcessGroup, world: int) -> Tensor:
    """``(.., n, ..)`` -> ``(.., world * n, ..)``: the backends concatenate along dim 0."""
    x0 = x.movedim(dim, 0).contiguous()  # (n, ...)
    out0 = x0.new_empty((world * x0.shape[0], *x0.shape[1:]))  # (world * n, ...)
    all_gather_into(out0, x0, group=group)
    return out0.movedim(0, dim)


def _reduce_scatter(x: Tensor, dim: int, group: dist.ProcessGroup, world: int) -> Tensor:
    """``(.., world * n, ..)`` -> ``(.., n, ..)``: block ``rank`` of the sum over ranks."""
    x0 = x.movedim(dim, 0).contiguous()  # (world * n, ...)
    out0 = x0.new_empty((x0.shape[0] // world, *x0.shape[1:]))  # (n, ...)
    reduce_scatter_into(out0, x0, group=group)
    return out0.movedim(0, dim)


class AllGather(torch.autograd.Function):
    """All-gather along ``dim``; backward: reduce-scatter (its dual) or this rank's slice."""

    @staticmethod
    def forward(ctx, x: Tensor, dim: int, group: dist.ProcessGroup, grad_reduction: str) -> Tensor:
        ctx.dim, ctx.group, ctx.grad_reduction = dim, group, grad_reduction
        ctx.world, ctx.rank = dist.get_world_size(group), dist.get_rank(group)
        return _gather(x, dim, group, ctx.world)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None]:
        if ctx.grad_reduction == "sum":
            return _reduce_scatter(grad, ctx.dim, ctx.group, ctx.world), None, None, None
        n = grad.shape[ctx.dim] // ctx.world
        return grad.narrow(ctx.dim, ctx.rank * n, n).contiguous(), None, None, None


class ReduceScatter(torch.autograd.Function):
    """Reduce-scatter (sum) along ``dim``; backward: all-gather (its dual)."""

    @staticmethod
    def forward(ctx, x: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
        ctx.dim, ctx.group, ctx.world = dim, group, dist.get_world_size(group)
        return _reduce_scatter(x, dim, group, ctx.world)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        return _gather(grad, ctx.dim, ctx.group, ctx.world), None, None


class _ContiguousGrad(torch.autograd.Function):
    """The identity, whose backward hands on a contiguous gradient: the functional collectives' backward needs
    one (torch 2.11), and the gradient of the ``movedim`` after them is a strided view."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad.contiguous()


def _traced_all_gather(x: Tensor, dim: int, group: dist.ProcessGroup, grad_reduction: str) -> Tensor:
    """:class:`AllGather` as dynamo traces it, on torch's functional all-gather along dim 0 (another gather dim
    calls a helper dynamo skips in torch 2.11: a graph break). ``"sum"``: the autograd version, whose backward
    is the reduce-scatter (sum). ``"slice"``: the gathered blocks without autograd, with this rank's own ``x``
    spliced back in, so the gradient reaching ``x`` is its own block."""
    from torch.distributed import _functional_collectives as funcol

    x0 = x.movedim(dim, 0).contiguous()  # (n, ...)
    if grad_reduction == "sum":
        return _ContiguousGrad.apply(funcol.all_gather_tensor_autograd(x0, 0, group)).movedim(0, dim)
    rank, n = dist.get_rank(group), x0.shape[0]
    gathered = funcol.all_gather_tensor(x0.detach(), 0, group)  # (world * n, ...)
    spliced = torch.cat([gathered[: rank * n], x0, gathered[(rank + 1) * n:]], 0)
    return spliced.movedim(0, dim)


def _group_of_many(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The resolved group, or ``None`` when the op is the identity (no group, or a group of one)."""
    group = resolve_group(group)
    if group is None or dist.get_world_size(group) == 1:
        return None
    return group


def all_gather(
    x: Tensor,
    dim: int,
    *,
    group: dist.ProcessGroup | None = None,
    grad_reduction: str = "slice",
) -> Tensor:
    """Differentiable all-gather along ``dim``.

    Args:
        x: ``(.., n, ..)`` with ``n`` at ``dim``; the same shape on every rank.
        dim: the dimension to concatenate along (negative allowed).
        group: the process group (default: :func:`seqpar.runtime.groups.resolve_group`).
        grad_reduction: ``"slice"`` or ``"sum"``, see the module docstring.
    Returns:
        ``(.., world * n, ..)``, the ranks' blocks in rank order; ``x`` itself for a group of one.
    """
    if grad_reduction not in GRAD_REDUCTIONS:
        raise ValueError(
            f"grad_reduction={grad_reduction!r} is invalid: choose one of {list(GRAD_REDUCTIONS)}"
        )
    group = _group_of_many(group)
    if group is None:
        return x
    if torch.compiler.is_compiling():
        return _traced_all_gather(x, dim % x.dim(), group, grad_reduction)
    return AllGather.apply(x, dim % x.dim(), group, grad_reduction)


def reduce_scatter(x: Tensor, dim: int, *, group: dist.ProcessGroup | None = None) -> Tensor:
    """Differentiable reduce-scatter (sum over ranks) along ``dim``.

    Args:
        x: ``(.., world * n, ..)``; the same shape on every rank.
        dim: the dimension to scatter along (negative allowed).
        group: the process group (default: :func:`seqpar.runtime.groups.resolve_group`).
    Returns:
        ``(.., n, ..)``: block ``rank`` of the sum over ranks; ``x`` itself for a group of one.
    Raises:
        ValueError: ``dim`` is not a multiple of the group size.
    """
    group = _group_of_many(group)
    if group is None:
        return x
    world = dist.get_world_size(group)
    if x.shape[dim] % world:
        raise ValueError(
            f"reduce_scatter: dim {dim} has length {x.shape[dim]}, not a multiple of the group "
            f"size {world}; pad it to a multiple of {world}"
        )
    if torch.compiler.is_compiling():  # its backward is the all-gather, as ReduceScatter's
        from torch.distributed import _functional_collectives as funcol

        x0 = x.movedim(dim, 0).contiguous()  # along dim 0, as the all-gather above
        return _ContiguousGrad.apply(funcol.reduce_scatter_tensor_autograd(x0, "sum", 0, group)).movedim(0, dim)
    return ReduceScatter.apply(x, dim % x.dim(), group)
