"""Collective calls under the name each torch version prefers.

torch 2.13 renamed ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to ``all_gather_single`` /
``reduce_scatter_single`` (the old names warn); older releases only have the old names. Both
concatenate along dim 0: ``out.shape[0] == world * inp.shape[0]``.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor

__all__ = ["all_gather_into", "reduce_scatter_into"]

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_into(out: Tensor, inp: Tensor, group: dist.ProcessGroup | None = None, async_op: bool = False):  # noqa: ANN201
    """``out`` ``(world * n, ...)`` <- every rank's ``inp`` ``(n, ...)``, in rank order."""
    return _all_gather(out, inp.contiguous(), group=group, async_op=async_op)


def reduce_scatter_into(out: Tensor, inp: Tensor, group: dist.ProcessGroup | None = None, async_op: bool = False):  # noqa: ANN201
    """``out`` ``(n, ...)`` <- the sum over ranks of block ``rank`` of ``inp`` ``(world * n, ...)``."""
    return _reduce_scatter(out, inp.contiguous(), group=group, async_op=async_op)
