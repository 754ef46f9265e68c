"""All-to-all: the communicator of Ulysses sequence parallelism (sequence shards <-> head shards).

Two layers:

- :func:`start_all_to_all` — the raw, asynchronous exchange the attention algorithms pipeline:
  ``send`` is ``(u, ...)``, slot j goes to rank j of the group; the received tensor is ``(u, ...)``,
  slot i from rank i. One ``all_to_all_single`` however many tensors were packed into the slots.
  :func:`start_all_to_all_uneven` is its uneven twin (blocks of per-peer sizes, Ulysses with head
  counts the group size does not divide).
- :class:`AllToAll` / :func:`all_to_all` — a differentiable all-to-all along tensor dimensions:
  ``x`` is cut into ``u`` equal pieces along ``scatter_dim``, piece j goes to rank j, and the pieces
  received are concatenated in rank order along ``gather_dim``. Its backward is its own dual: the
  same all-to-all with ``scatter_dim`` and ``gather_dim`` swapped (DeepSpeed's ``_SeqAllToAll`` idiom).
  ``all_to_all(x_seq_shard, scatter_dim=1, gather_dim=2)`` turns ``(batch, heads, seq_local, head_dim)``
  into ``(batch, heads / u, u * seq_local, head_dim)`` (head shard of the sequence in rank order).

dtype and device come from the inputs. Volume per rank and call: ``(u - 1) / u`` of ``send``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from seqpar.comm.ring import Pending

__all__ = ["start_all_to_all", "start_all_to_all_uneven", "AllToAll", "all_to_all"]


def start_all_to_all(send: Tensor, group: dist.ProcessGroup) -> Pending:
    """Start exchanging the slots of ``send`` ``(u, ...)`` across the ``u`` ranks of ``group``.

    Returns a :class:`~seqpar.comm.ring.Pending`; ``wait()`` gives ``[recv]``, ``(u, ...)`` like
    ``send``, with slot i = what rank i put in slot ``rank`` of its ``send``. Every rank must pass
    the same shape and dtype (the attention entry checks this across ranks first)."""
    world = dist.get_world_size(group)
    if send.shape[0] != world:
        raise ValueError(f"all-to-all: send has {send.shape[0]} slots along dim 0, the group has {world} ranks")
    send = send.contiguous()
    recv = torch.empty_like(send)
    work = dist.all_to_all_single(recv, send, group=group, async_op=True)
    reading = [send]  # the collective reads it until done: keep it referenced until the wait

    def finish() -> None:
        work.wait()
        reading.clear()

    return Pending(finish, [recv])


def start_all_to_all_uneven(
    send: Tensor, send_sizes: list[int], recv_sizes: list[int], group: dist.ProcessGroup
) -> Pending:
    """Start an all-to-all of uneven blocks: ``send`` is 1-D, its consecutive blocks of ``send_sizes[j]``
    elements go to rank j; ``wait()`` gives ``[recv]``, 1-D, the blocks of ``recv_sizes[i]`` elements from
    rank i, in rank order. Rank i's ``send_sizes[j]`` must equal rank j's ``recv_sizes[i]`` (the caller
    derives both from a split every rank shares). One ``all_to_all_single`` with split sizes (gloo and
    NCCL both take them); the even exchange stays :func:`start_all_to_all`."""
    world = dist.get_world_size(group)
    if len(send_sizes) != world or len(recv_sizes) != world:
        raise ValueError(f"all-to-all: {len(send_sizes)} send / {len(recv_sizes)} receive sizes for a group of {world} ranks")
    if send.dim() != 1 or send.numel() != sum(send_sizes):
        raise ValueError(f"all-to-all: send {tuple(send.shape)} is not 1-D of the {sum(send_sizes)} elements the sizes name")
    send = send.contiguous()
    recv = send.new_empty(sum(recv_sizes))
    work = dist.all_to_all_single(recv, send, output_split_sizes=list(recv_sizes), input_split_sizes=list(send_sizes),
                                  group=group, async_op=True)
    reading = [send]

    def finish() -> None:
        work.wait()
        reading.clear()

    return Pending(finish, [recv])


def _exchange(x: Tensor, scatter_dim: int, gather_dim: int, group: dist.ProcessGroup, world: int) -> Tensor:
    n = x.shape[scatter_dim]
    if n % world:
        raise ValueError(
            f"all_to_all: dim {scatter_dim} has length {n}, not a multiple of the group size {world}; "
            f"pad it or choose a group whose size divides it"
        )
    pieces = x.unflatten(scatter_dim, (world, n // world)).movedim(scatter_dim, 0)  # (u, ..., n/u, ...)
    (recv,) = start_all_to_all(pieces, group).wait()  # slot i: rank i's piece for us
    # (u, ..., n/u, ...) with the piece dims of x: put the rank axis next to gather_dim and merge it
    return recv.movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1)


class AllToAll(torch.autograd.Function):
    """All-to-all along tensor dimensions; the backward is the same all-to-all with ``scatter_dim`` and
    ``gather_dim`` swapped (its own dual)."""

    @staticmethod
    def forward(ctx, x: Tensor, scatter_dim: int, gather_dim: int, group: dist.ProcessGroup) -> Tensor:  # noqa: ANN001
        ctx.dims, ctx.group, ctx.world = (scatter_dim, gather_dim), group, dist.get_world_size(group)
        return _exchange(x, scatter_dim, gather_dim, group, ctx.world)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None]:  # noqa: ANN001
        scatter_dim, gather_dim = ctx.dims
        return _exchange(grad, gather_dim, scatter_dim, ctx.group, ctx.world), None, None, None


def all_to_all(x: Tensor, *, scatter_dim: int, gather_dim: int, group: dist.ProcessGroup | None) -> Tensor:
    """Differentiable all-to-all: cut ``x`` into ``u`` pieces along ``scatter_dim`` (piece j to rank j),
    concatenate the received pieces in rank order along ``gather_dim``.

    Args:
        x: any tensor whose ``scatter_dim`` is a multiple of the group size ``u``; same shape on every rank.
        scatter_dim, gather_dim: distinct dimensions (negative allowed).
        group: the process group; ``None`` or a group of one makes this the identity.
    Returns:
        ``x`` with ``scatter_dim`` divided by ``u`` and ``gather_dim`` multiplied by ``u``.
    """
    if group is None or dist.get_world_size(group) == 1:
        return x
    scatter_dim, gather_dim = scatter_dim % x.dim(), gather_dim % x.dim()
    if scatter_dim == gather_dim:
        raise ValueError(f"all_to_all: scatter_dim and gather_dim must differ, got {scatter_dim} for both")
    return AllToAll.apply(x, scatter_dim, gather_dim, group)
