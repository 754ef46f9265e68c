"""Check that every rank of a group holds the same row of integers: one tiny collective, one host read.

Used wherever a mismatch between ranks would otherwise hang a later collective or return garbage
(attention inputs, gathered shards, a model's batch). Every rank gets the same verdict, so every rank
raises together instead of some entering a collective the others never reach.

Rows may differ in length between ranks: each rank all-gathers ``(length, digest)`` (three int64),
where the digest is a 128-bit BLAKE2b hash of the row, so the common path costs the same for any
row. Only when the ranks disagree (and every rank then knows it) does a second collective fetch
every rank's full row, for an error message that names what differs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
import torch.distributed as dist

from seqpar.comm.compat import all_gather_into

__all__ = ["rows_across_ranks", "collective_device", "flagged_ranks"]

_WORDS = 3  # length, then the 128-bit digest as two int64 words


def collective_device(group: dist.ProcessGroup) -> torch.device:
    """Where a small tensor for a collective on ``group`` must live: NCCL takes the current CUDA
    device, gloo (and the rest) CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def flagged_ranks(flag: bool, group: dist.ProcessGroup) -> list[int]:
    """The ranks of ``group`` (group ranks, ascending) that passed ``flag`` true: one all-reduce of one int32
    per rank, one host read. Every rank gets the same list, so every rank takes the same branch after it
    (e.g. all raise when any refused)."""
    flags = torch.zeros(dist.get_world_size(group), dtype=torch.int32, device=collective_device(group))
    flags[dist.get_rank(group)] = int(flag)
    dist.all_reduce(flags, group=group)
    return [r for r, f in enumerate(flags.tolist()) if f]


def _digest(row: Sequence[int]) -> list[int]:
    data = b"".join(int(x).to_bytes(8, "little", signed=True) for x in row)
    h = hashlib.blake2b(data, digest_size=16).digest()
    return [len(row), int.from_bytes(h[:8], "little", signed=True), int.from_bytes(h[8:], "little", signed=True)]


def rows_across_ranks(row: Sequence[int], group: dist.ProcessGroup) -> list[list[int]] | None:
    """``None`` when every rank of ``group`` passed the same ``row``; else every rank's row, in rank
    order, returned on every rank.

    Collective: every rank of ``group`` must call it. Costs one all-gather of 3 int64 per rank and
    one device-to-host read of the result (plus an object all-gather when the rows differ).
    Entries must fit in int64.
    """
    device = collective_device(group)
    world = dist.get_world_size(group)
    # an asynchronous copy: a blocking one from pageable memory would wait for the device first
    mine = torch.tensor(_digest(row), dtype=torch.int64).to(device, non_blocking=True)
    everyone = torch.empty(world * _WORDS, dtype=torch.int64, device=device)
    all_gather_into(everyone, mine, group=group)
    digests = everyone.view(world, _WORDS).tolist()  # the one host sync
    if all(d == digests[0] for d in digests):
        return None
    rows: list[list[int] | None] = [None] * world
    dist.all_gather_object(rows, [int(x) for x in row], group=group)
    return [list(r) for r in rows]  # type: ignore[arg-type]
