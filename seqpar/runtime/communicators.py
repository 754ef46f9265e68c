"""How seqpar creates process groups: every group's communicator exists before its first real use.

The guarantee (relied on by the ring, whose ranks may have nothing to send or receive in a step):
**every group seqpar creates has been joined by all its members, in one small collective, before
``init_process_groups`` returns**, so no later operation on it is a communicator set-up.

Why: NCCL creates a group's communicator lazily, at the group's first operation, and every member
must take part in that set-up. A collective involves every member anyway; a batched point-to-point
exchange does not. seqpar's ring skips hops that no rank needs (documents, windows): with 3 hybrid
super-ranks, one document over super-ranks 0-1 and another starting exactly at super-rank 2, super-rank
2 has no ring operation in either pass, and super-ranks 0 and 1 would wait in the communicator set-up
of their first exchange until the timeout. One small all-reduce per group at creation removes that
case for any backend (gloo connects at creation anyway; the fake backend makes it a no-op); the
collectives run in creation order on every rank, the order ``new_group`` already imposes, so they
cannot deadlock. On NCCL every group is also created with ``device_id=`` (the current CUDA device),
torch's eager initialisation: the communicator is connected inside ``new_group`` itself, among the group's
members only. The world seqpar starts from the environment is not bound (``init_process_group`` without
``device_id=``): under a bound world every creation is a split of the world's communicator, which every
rank must join, and the single-rank families below would cost O(world) creations again. The
all-reduce stays, for the backends and torch builds that connect lazily whatever they are given, and
costs one tiny collective per group at start-up. gloo takes no ``device_id`` (it connects at creation). A group the user creates
and passes as ``group=`` is the user's to initialise (``device_id=``, one collective, or the input digest
of ``check_inputs=True``, a collective on the group before every call): seqpar keeps no per-rank record
of the groups it has seen, since a record that differed across ranks could itself hang.

Group families whose groups are single ranks (the model-parallel group today; the SP, DP, Ulysses or
ring groups of a degenerate layout) cost one ``new_group(..., use_local_synchronization=True)`` per
rank, instead of one collective ``new_group`` per rank of the world (O(world) calls and, at thousands
of ranks, O(world) store barriers). A TP group family will take the same path.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["init_communicator", "new_groups", "world_is_bound", "eager_device", "high_priority_options"]


def _probe_device(group: dist.ProcessGroup) -> torch.device:
    """Where a collective on ``group`` must live: the current CUDA device for an NCCL group (the lazy
    one), the CPU for everything else (gloo; the fake backend takes any device)."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def eager_device(backend: str | None = None) -> torch.device | None:
    """The ``device_id=`` for a group made with ``backend`` (None: the world's): the current CUDA device
    on NCCL, where it makes torch connect the communicator at creation; None elsewhere (gloo and the
    fake backend take none)."""
    if backend is None:
        backend = str(dist.get_backend()) if dist.is_initialized() else ""
    if "nccl" in str(backend).lower() and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return None


def init_communicator(group: dist.ProcessGroup) -> None:
    """Create ``group``'s communicator now: one one-element all-reduce over all its members.

    Collective over ``group`` (every member, in the same order as the group's other collectives)."""
    probe = torch.zeros(1, device=_probe_device(group))
    dist.all_reduce(probe, group=group)


def world_is_bound() -> bool:
    """Whether the world group was created with ``device_id=`` (torch then creates every new group's
    NCCL communicator eagerly, by splitting the world's: a collective over the whole world)."""
    return getattr(dist.group.WORLD, "bound_device_id", None) is not None


def high_priority_options(backend: str | None = None) -> object | None:
    """``pg_options`` that put an NCCL group's kernels on a **high-priority CUDA stream** (None for any other
    backend: gloo and the fake backend have no streams, and a CPU build of torch has no NCCL).

    Why: an NCCL send/receive is a kernel that needs SMs like any other. On a stream of the compute stream's
    priority, the block scheduler gives it SMs only as an attention kernel that fills the GPU drains, so a
    ring's K/V or dK/dV transfer posted right before the hop's kernel starts only after it and the overlap
    is lost; at high priority it takes the next SM a thread block frees. Megatron-LM offers the same for its
    CP and EP groups (``--high-priority-stream-groups``). The effect was modelled on fake CUDA
    (:mod:`seqpar.testing.streams`, BENCHMARKS.md's gpu-perf section), not yet measured over real NCCL."""
    if backend is None:
        backend = str(dist.get_backend()) if dist.is_initialized() else ""
    if "nccl" not in str(backend).lower() or not hasattr(dist, "ProcessGroupNCCL"):
        return None
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = True
    return options


def new_groups(
    rank_lists: list[list[int]], rank: int, *, backend: str | None = None, timeout: timedelta | None = None,
    high_priority: bool = False,
) -> dist.ProcessGroup:
    """Create the groups of a partition of the world (``rank_lists``, the same on every rank) and return
    the one holding ``rank``, its communicator initialised (:func:`init_communicator`).

    Collective over the world: every rank calls it with the same lists, in the same order as its other
    group creations. A partition into single ranks costs this rank one local creation (no other rank
    takes part) instead of one collective creation per rank of the world; other partitions cost one
    ``new_group`` per group, as torch requires. Under a world created with ``device_id=`` every creation
    is a split of the world's communicator, which every rank must join: there the per-group path is kept.
    ``high_priority``: NCCL groups run their kernels on a high-priority stream
    (:func:`high_priority_options`); no effect on other backends.
    """
    kw: dict = {"backend": backend} | ({"timeout": timeout} if timeout is not None else {})
    device = eager_device(backend)
    if device is not None:  # NCCL: connected inside new_group (torch's eager init), see the module docstring
        kw["device_id"] = device
    options = high_priority_options(backend) if high_priority else None
    if options is not None:
        kw["pg_options"] = options
    mine = None
    if all(len(ranks) == 1 for ranks in rank_lists) and not world_is_bound():
        mine = dist.new_group([rank], use_local_synchronization=True, **kw)
    else:
        for ranks in rank_lists:
            group = dist.new_group(ranks, **kw)
            if rank in ranks:
                mine = group
    if mine is None or mine is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(f"new_groups: rank {rank} is in none of the groups {rank_lists}")
    init_communicator(mine)
    return mine
