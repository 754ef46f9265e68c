"""``check_finite``: a collective NaN/Inf check on attention inputs and outputs.

A rank that finds a non-finite value must not raise alone: its peers would wait for it in the next
ring exchange until the timeout. So every rank of the group reports what it found in one small
all-reduce, and all of them raise together, naming the layer, the tensors and the ranks that saw it.
This costs one all-reduce and one host sync per check, which is why it is off by default
(``"check_finite": false``); the callers skip the call entirely when it is off.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["NonFiniteError", "check_finite"]


class NonFiniteError(FloatingPointError):
    """Raised on every rank of a group when any rank saw a NaN or Inf (``check_finite``)."""


def check_finite(tensors: dict[str, Tensor], group: dist.ProcessGroup | None, where: str) -> None:
    """Raise :class:`NonFiniteError` on every rank of ``group`` if any rank's ``tensors`` hold a NaN/Inf.

    Args:
        tensors: name -> tensor on this rank (any shape, e.g. ``(batch, heads, seq_local, head_dim)``).
        group: the ranks that must decide together (the SP group); ``None`` = the default manager's SP
            group (without one on a world > 1: an error), or this process alone when torch.distributed
            is not initialised.
        where: the layer and the point, e.g. ``"layer model.layers.0.self_attn, inputs"``.
    """
    names = list(tensors)
    bad_local = [name for name in names if not bool(torch.isfinite(tensors[name]).all())] if names else []
    if not (dist.is_available() and dist.is_initialized()):
        if bad_local:
            raise NonFiniteError(f"seqpar check_finite: NaN/Inf in {where} ({', '.join(bad_local)}) on rank 0")
        return
    from seqpar.runtime.groups import resolve_group

    group = resolve_group(group)  # None: the default manager's SP group (without one on a world > 1: an error)
    size, me = dist.get_world_size(group), dist.get_rank(group)
    # one row per rank, one column per tensor: every rank learns who saw what
    seen = torch.zeros(size, max(len(names), 1), dtype=torch.int32)
    for j, name in enumerate(names):
        if name in bad_local:
            seen[me, j] = 1
    dist.all_reduce(seen, group=group)
    if not bool(seen.any()):
        return
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(size))
    culprits = [
        f"rank {ranks[r]} ({', '.join(names[j] for j in range(len(names)) if seen[r, j])})"
        for r in range(size) if seen[r].any()
    ]
    raise NonFiniteError(
        f"seqpar check_finite: NaN/Inf in {where} on {'; '.join(culprits)}; rank {dist.get_rank()} stops with "
        "them. Look for a too-high learning rate, fp16 overflow or bad input data; set "
        '"check_finite": false in the sequence_parallel block to switch the check off'
    )
