"""Count what this rank hands to torch.distributed while a block of code runs: calls and bytes sent.

:func:`counting` wraps torch.distributed's entry points *and* the collective helpers of
:mod:`seqpar.comm.compat` (which seqpar's modules bind at import time, so patching torch.distributed
alone would count none of their collectives). Bytes are what this rank puts on the wire:

- ``batch_isend_irecv``: the bytes of every ``isend`` (p2p);
- ``all_gather_*``: (P-1) x the input (a ring all-gather forwards every block but its own);
- ``reduce_scatter_*``: (P-1) x the output; ``all_to_all_single``: the input but this rank's own block
  ((P-1)/P of it, or its ``input_split_sizes`` blocks for the other ranks);
- ``all_reduce``: 2 (P-1)/P of the tensor; ``broadcast``, ``barrier``, ``all_gather_object``: calls only.

A call made from inside another counted call (torch's ``all_gather_into_tensor`` forwards to
``all_gather_single``) counts once, as the outer one. ``dist.isend`` / ``dist.irecv`` are left alone:
``P2POp`` checks them by identity, and seqpar posts its sends through ``batch_isend_irecv``.
Used by the ``comm`` benchmark and by the tests that assert exact communication counts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from seqpar.comm import compat

__all__ = ["Traffic", "counting"]


@dataclass
class Traffic:
    """Calls and bytes this rank made while :func:`counting` was active (a live, growing record)."""

    world_size: int
    p2p_bytes: int = 0
    collective_bytes: int = 0
    calls: dict[str, int] = field(default_factory=dict)
    """torch.distributed function name -> number of calls (outermost calls only)."""

    @property
    def collectives(self) -> int:
        """Number of collective calls (everything but ``batch_isend_irecv``)."""
        return sum(n for name, n in self.calls.items() if name != "batch_isend_irecv")

    def snapshot(self) -> Traffic:
        """A frozen copy, e.g. after the forward, to subtract from the totals after the backward."""
        return replace(self, calls=dict(self.calls))


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str) -> Any:
    return args[index] if len(args) > index else kwargs[name]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


_ByteRule = Callable[[int, tuple[Any, ...], dict[str, Any]], int]
# torch.distributed name -> bytes this rank sends, given (world size, args, kwargs)
_RULES: dict[str, _ByteRule] = {
    "batch_isend_irecv": lambda w, a, k: sum(
        _nbytes(op.tensor) for op in _arg(a, k, 0, "p2p_op_list") if op.op is dist.isend),
    "all_gather_single": lambda w, a, k: (w - 1) * _nbytes(_arg(a, k, 1, "input_tensor")),
    "all_gather_into_tensor": lambda w, a, k: (w - 1) * _nbytes(_arg(a, k, 1, "input_tensor")),
    "all_gather": lambda w, a, k: (w - 1) * _nbytes(_arg(a, k, 1, "tensor")),
    "reduce_scatter_single": lambda w, a, k: (w - 1) * _nbytes(_arg(a, k, 0, "output")),
    "reduce_scatter_tensor": lambda w, a, k: (w - 1) * _nbytes(_arg(a, k, 0, "output")),
    "all_to_all_single": lambda w, a, k: _all_to_all_sent(w, a, k),
    "all_reduce": lambda w, a, k: 2 * _nbytes(_arg(a, k, 0, "tensor")) * (w - 1) // w,
    "broadcast": lambda w, a, k: 0,
    "barrier": lambda w, a, k: 0,
    "all_gather_object": lambda w, a, k: 0,
}


def _all_to_all_sent(w: int, a: tuple[Any, ...], k: dict[str, Any]) -> int:
    """``all_to_all_single``: the input's rows but this rank's own block; with ``input_split_sizes``
    (uneven blocks, seqpar.comm.alltoall.start_all_to_all_uneven) the blocks' own sizes, else (P-1)/P."""
    nbytes = _nbytes(_arg(a, k, 1, "input"))
    splits = k.get("input_split_sizes", a[3] if len(a) > 3 else None)
    if not splits:
        return nbytes * (w - 1) // w
    own = splits[dist.get_rank(k.get("group"))]
    return nbytes * (sum(splits) - own) // sum(splits)


@contextlib.contextmanager
def counting(world_size: int) -> Iterator[Traffic]:
    """Count this rank's torch.distributed traffic while the block runs; yields the live :class:`Traffic`.

    Args:
        world_size: the size of the group the counted calls run on (the byte rules depend on it).
    """
    traffic = Traffic(world_size)
    depth = [0]  # > 0 while inside a counted call: nested torch calls are not counted again

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        rule = _RULES[name]

        def call(*args: Any, **kwargs: Any) -> Any:
            if depth[0] == 0:
                traffic.calls[name] = traffic.calls.get(name, 0) + 1
                group = kwargs.get("group")  # a sub-group (the hybrid's Ulysses axis) has its own size
                nbytes = rule(world_size if group is None else dist.get_world_size(group), args, kwargs)
                if name == "batch_isend_irecv":
                    traffic.p2p_bytes += nbytes
                else:
                    traffic.collective_bytes += nbytes
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1

        return call

    saved = [(name, getattr(dist, name)) for name in _RULES if hasattr(dist, name)]
    for name, fn in saved:
        setattr(dist, name, wrap(name, fn))
    try:
        with compat.intercepted(wrap):
            yield traffic
    finally:
        for name, fn in saved:
            setattr(dist, name, fn)
