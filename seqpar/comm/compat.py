"""Collective calls under the name each torch version prefers.

torch 2.13 renamed ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to ``all_gather_single`` /
``reduce_scatter_single`` (the old names warn); older releases only have the old names. Both
concatenate along dim 0: ``out.shape[0] == world * inp.shape[0]``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist
from torch import Tensor

from seqpar.runtime.liveness import reraise

__all__ = ["all_gather_into", "reduce_scatter_into", "intercepted"]

_ALL_GATHER_NAME = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
_REDUCE_SCATTER_NAME = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
_all_gather = getattr(dist, _ALL_GATHER_NAME)
_reduce_scatter = getattr(dist, _REDUCE_SCATTER_NAME)
# Looked up at call time (not bound into the callers), so that :func:`intercepted` can wrap them.


def all_gather_into(out: Tensor, inp: Tensor, group: dist.ProcessGroup | None = None, async_op: bool = False):  # noqa: ANN201
    """``out`` ``(world * n, ...)`` <- every rank's ``inp`` ``(n, ...)``, in rank order."""
    try:
        return _all_gather(out, inp.contiguous(), group=group, async_op=async_op)
    except RuntimeError as error:  # a peer lost or late: name it (seqpar.runtime.liveness)
        reraise(error)


def reduce_scatter_into(out: Tensor, inp: Tensor, group: dist.ProcessGroup | None = None, async_op: bool = False):  # noqa: ANN201
    """``out`` ``(n, ...)`` <- the sum over ranks of block ``rank`` of ``inp`` ``(world * n, ...)``."""
    try:
        return _reduce_scatter(out, inp.contiguous(), group=group, async_op=async_op)
    except RuntimeError as error:
        reraise(error)


@contextlib.contextmanager
def intercepted(wrap: Callable[[str, Callable[..., Any]], Callable[..., Any]]) -> Iterator[None]:
    """While the block runs, :func:`all_gather_into` and :func:`reduce_scatter_into` call
    ``wrap(name, fn)(...)`` instead of ``fn``, ``name`` being the torch.distributed function ``fn``.

    For traffic counters (:mod:`seqpar.testing.traffic`): seqpar's modules import these helpers by name
    at import time, so wrapping ``torch.distributed`` alone would never see their collectives.
    """
    global _all_gather, _reduce_scatter
    saved = _all_gather, _reduce_scatter
    _all_gather = wrap(_ALL_GATHER_NAME, saved[0])
    _reduce_scatter = wrap(_REDUCE_SCATTER_NAME, saved[1])
    try:
        yield
    finally:
        _all_gather, _reduce_scatter = saved
