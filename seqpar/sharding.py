"""How a sequence is cut across the ranks of an SP group, and the differentiable cut/gather.

Layouts (P = SP size):
- ``contiguous``: the sequence is cut into P chunks; rank r holds chunk r.
- ``zigzag``: the sequence is cut into 2P chunks; rank r holds chunks r and 2P-1-r, in that order.
  Under causal masking every rank then does the same amount of attention work.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from seqpar.comm.agree import rows_across_ranks
from seqpar.comm.collectives import all_gather
from seqpar.groups import resolve_group
from seqpar.verified import batch_verified

__all__ = [
    "num_chunks",
    "chunk_ids",
    "shard_index",
    "shard_sequence",
    "gather_sequence",
    "pad_to_multiple",
]


def num_chunks(world_size: int, sharding: str) -> int:
    """How many equal chunks the full sequence is cut into."""
    if sharding == "contiguous":
        return world_size
    if sharding == "zigzag":
        return 2 * world_size
    raise ValueError(f"sharding={sharding!r} is invalid: choose 'contiguous' or 'zigzag'")


def chunk_ids(rank: int, world_size: int, sharding: str) -> list[int]:
    """The global chunk indices rank ``rank`` holds, in local (ascending) order."""
    if sharding == "contiguous":
        return [rank]
    if sharding == "zigzag":
        return [rank, 2 * world_size - 1 - rank]
    raise ValueError(f"sharding={sharding!r} is invalid: choose 'contiguous' or 'zigzag'")


def _check_length(seq_len: int, world_size: int, sharding: str) -> int:
    n = num_chunks(world_size, sharding)
    if seq_len % n:
        fix = f"pad it to a multiple of {n} (seqpar.sharding.pad_to_multiple(x, dim, {n}, value))"
        if sharding == "zigzag" and seq_len % world_size == 0:
            fix += " or use sharding='contiguous'"
        raise ValueError(
            f"sequence length {seq_len} cannot be cut for {world_size} ranks with sharding='{sharding}' "
            f"({n} equal chunks needed): {fix}"
        )
    return seq_len // n


def shard_index(
    seq_len: int,
    rank: int,
    world_size: int,
    sharding: str = "contiguous",
    *,
    device: torch.device | str | None = None,
) -> Tensor:
    """Global positions (LongTensor ``(seq_len / P,)``) that ``rank`` holds, in local order."""
    c = _check_length(seq_len, world_size, sharding)
    return torch.cat(
        [
            torch.arange(i * c, (i + 1) * c, device=device)
            for i in chunk_ids(rank, world_size, sharding)
        ]
    )


def _world_and_rank(group: dist.ProcessGroup | None) -> tuple[dist.ProcessGroup | None, int, int]:
    group = resolve_group(group)
    if group is None:
        return None, 1, 0
    return group, dist.get_world_size(group), dist.get_rank(group)


def shard_sequence(
    x: Tensor, dim: int, *, group: dist.ProcessGroup | None = None, sharding: str = "contiguous"
) -> Tensor:
    """This rank's part of a full tensor (the same full tensor on every rank).

    Args:
        x: any tensor whose ``dim`` is the sequence, e.g. ``(batch, seq, hidden)`` with ``dim=1``.
        dim: the sequence dimension (negative allowed).
        group: the SP group (default: the default manager's SP group, else the world).
        sharding: ``"contiguous"`` or ``"zigzag"``.
    Returns:
        ``x`` with ``dim`` cut to ``seq / P``. Differentiable: the gradient of the full input is this
        rank's gradient scattered into zeros (sum it over the SP group to get the full gradient).
    Raises:
        ValueError: the length does not divide into P chunks (2P for zigzag); the message says how to pad.
    """
    group, world, rank = _world_and_rank(group)
    c = _check_length(x.shape[dim], world, sharding)
    parts = [x.narrow(dim, i * c, c) for i in chunk_ids(rank, world, sharding)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def _check_same_shape(x: Tensor, dim: int, group: dist.ProcessGroup) -> None:
    """Raise on every rank unless all ranks pass shards of one shape and element size.

    One tiny all-gather (seqpar.comm.agree); without it, unequal shards would hang the all-gather
    or return garbage.
    """
    row = [x.shape[dim], x.element_size(), x.dim(), *x.shape]
    rows = rows_across_ranks(row, group)
    if rows is None:
        return
    seq_locals = [r[0] for r in rows]
    if len(set(seq_locals)) != 1:
        raise ValueError(
            f"gather_sequence: the ranks hold shards of different lengths along dim {dim} "
            f"({seq_locals}); every rank must pass its shard of the same sequence "
            f"(cut with shard_sequence)"
        )
    shapes = [tuple(r[3:]) for r in rows]
    itemsizes = [r[1] for r in rows]
    raise ValueError(
        f"gather_sequence: the ranks' shards differ outside dim {dim} (shapes {shapes}, bytes "
        f"per element {itemsizes}); every rank must pass a shard of the same shape and dtype"
    )


def gather_sequence(
    x: Tensor,
    dim: int,
    *,
    group: dist.ProcessGroup | None = None,
    sharding: str = "contiguous",
    grad_reduction: str = "slice",
    check_inputs: bool = True,
) -> Tensor:
    """The inverse of :func:`shard_sequence`: every rank gets the full tensor, in global order.

    Args:
        x: this rank's shard, ``dim`` of length ``seq / P`` (the same shape on every rank).
        dim: the sequence dimension (negative allowed).
        group: the SP group (default: the default manager's SP group, else the world).
        sharding: ``"contiguous"`` or ``"zigzag"``, as the shard was cut.
        grad_reduction: ``"slice"`` (default) — the backward keeps this rank's part of the incoming
            gradient: right when every rank computes the same loss on the gathered tensor (the
            usual case: the ranks' gradients are copies, not terms). ``"sum"`` — the backward
            reduce-scatters (the dual of the all-gather): right when each rank's loss is a separate
            term of the total.
        check_inputs: first check across ranks that every shard has the same shape (one tiny
            collective and a host sync); skipped inside a swapped model's verified forward, where
            the batch check already covered it (seqpar.verified).
    Returns:
        The full tensor, ``dim`` of length ``seq``.
    Raises:
        ValueError: on every rank, if the ranks' shards differ in length or shape.
    """
    group, world, _ = _world_and_rank(group)
    per_rank = len(chunk_ids(0, world, sharding))  # also validates `sharding`
    if world == 1:
        return all_gather(x, dim, group=group, grad_reduction=grad_reduction)  # identity, checked
    dim = dim % x.dim()
    if check_inputs and not batch_verified():
        _check_same_shape(x, dim, group)
    if x.shape[dim] % per_rank:
        raise ValueError(
            f"gather_sequence: a zigzag shard holds two equal chunks, so its length must be even, "
            f"got {x.shape[dim]}"
        )
    full_rank_order = all_gather(x, dim, group=group, grad_reduction=grad_reduction)
    if sharding == "contiguous":
        return full_rank_order
    # rank order holds chunks [0, 2P-1, 1, 2P-2, ...]; put each global chunk back in its place
    c = x.shape[dim] // per_rank
    position = {
        i: r * per_rank + j
        for r in range(world)
        for j, i in enumerate(chunk_ids(r, world, sharding))
    }
    chunks = [full_rank_order.narrow(dim, position[i] * c, c) for i in range(world * per_rank)]
    return torch.cat(chunks, dim=dim)


def pad_to_multiple(x: Tensor, dim: int, multiple: int, value: float = 0) -> Tensor:
    """Pad ``dim`` at its end with ``value`` up to the next multiple of ``multiple``.

    E.g. before sharding: ``pad_to_multiple(input_ids, 1, 2 * P, pad_id)`` for zigzag (pad labels
    with the loss's ignore index so the padding does not count).

    Returns:
        ``x`` itself if already a multiple, else a padded copy.
    """
    if isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1:
        raise ValueError(f"pad_to_multiple: multiple must be a positive integer, got {multiple!r}")
    extra = (-x.shape[dim]) % multiple
    if extra == 0:
        return x
    dim = dim % x.dim()
    pad = [0, 0] * (x.dim() - 1 - dim) + [0, extra]  # F.pad lists the last dim first
    return F.pad(x, pad, value=value)
