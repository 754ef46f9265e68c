"""Where the documents of a packed batch start inside this rank's chunks: what a sharded recurrence
needs to restart its scan (host ints, made once per batch layout and cached).

This rank's shard is ``n`` chunks of ``c`` positions (:func:`seqpar.sequence.sharding.chunk_ids`). A
recurrence scanned over local chunk ``j`` restarts (state zero) at each document start inside it, and
only its first ``lead(j)`` positions (those before the first document start strictly inside it, or
all ``c``) continue the state the chunk came in with (:func:`seqpar.mixers.state_passing.
chunk_initial_states`).
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist
from torch import Tensor

from seqpar.runtime.groups import resolve_group
from seqpar.sequence.boundaries import drop_empty_documents, host_boundaries
from seqpar.sequence.sharding import chunk_ids

__all__ = ["ScanLayout", "scan_layout", "shard_boundaries"]


@dataclass(frozen=True)
class ScanLayout:
    """This rank's chunks and the document starts inside them."""

    world: int
    rank: int
    seq_len: int
    chunk_len: int
    cu: tuple[int, ...] | None
    """Global document boundaries ``(0, ..., S)``, or None (one sequence)."""
    starts: tuple[tuple[int, ...], ...]
    """Per local chunk: the offsets (``1 .. c-1``) of the document starts strictly inside it."""

    @property
    def chunks(self) -> int:
        return len(self.starts)

    def lead(self, j: int) -> int:
        """Positions of local chunk ``j`` that continue the chunk's incoming state."""
        return self.starts[j][0] if self.starts[j] else self.chunk_len

    def segments(self, j: int) -> list[tuple[int, int]]:
        """``[(start, end), ...]`` offsets inside local chunk ``j``, cut at each document start."""
        edges = [0, *self.starts[j], self.chunk_len]
        return list(zip(edges, edges[1:]))


@functools.lru_cache(maxsize=256)
def _layout(world: int, rank: int, sharding: str, seq_len: int, cu: tuple[int, ...] | None) -> ScanLayout:
    layout = {"seq_len": seq_len, "cu_seqlens": cu} if sharding == "balanced" else {}
    # One rank holds the whole sequence in order under every sharding (zigzag's chunks 0 and 1, balanced's
    # all of them, ascending): one chunk, so each document is scanned through. Cut in zigzag's two chunks,
    # the second started from a zero state, and the world-1 scans (which pass no state) lost what a
    # document crossing the middle carried over (tiny Jamba at SP=1, zigzag: loss 4e-3, A_log's gradient 31%)
    ids = [0] if world == 1 else chunk_ids(rank, world, sharding, **layout)
    total = len(ids) * world
    if seq_len % total:
        raise ValueError(
            f"sharded recurrence: sequence length {seq_len} cannot be cut into {total} equal chunks for {world} "
            f"rank(s) with sharding='{sharding}': pad it to a multiple of {total} (seqpar.sequence.batch.shard_batch "
            "pads and cuts a batch the way the swapped model expects)")
    c = seq_len // total
    if cu is None:  # one sequence: no start inside any chunk (no bisect: dynamo cannot trace it)
        return ScanLayout(world, rank, seq_len, c, None, ((),) * len(ids))
    doc_starts = list(cu[:-1])
    starts = []
    for g in ids:
        lo = bisect.bisect_right(doc_starts, g * c)
        hi = bisect.bisect_left(doc_starts, (g + 1) * c)
        starts.append(tuple(s - g * c for s in doc_starts[lo:hi]))
    return ScanLayout(world, rank, seq_len, c, cu, tuple(starts))


def scan_layout(seq_local: int, *, group: dist.ProcessGroup | None, sharding: str,
                cu_seqlens: Tensor | Sequence[int] | None = None, where: str = "sharded recurrence") -> ScanLayout:
    """The layout of this rank's shard of ``seq_local`` positions.

    Args:
        seq_local: this rank's shard length.
        group: the SP group (None: the default manager's; none at all: one process).
        sharding: ``"contiguous"``, ``"zigzag"`` or ``"balanced"``.
        cu_seqlens: global document boundaries ``[0, ..., S]`` (a tensor is read on the host once per batch).
        where: names the caller in errors.
    """
    world, rank, seq_len, cu = shard_boundaries(seq_local, group=group, cu_seqlens=cu_seqlens, where=where)
    return _layout(world, rank, sharding, seq_len, cu)


def shard_boundaries(seq_local: int, *, group: dist.ProcessGroup | None, cu_seqlens: Tensor | Sequence[int] | None,
                     where: str) -> tuple[int, int, int, tuple[int, ...] | None]:
    """``(world, rank, seq_len, cu)`` of this rank's shard: the SP group's size and this rank in it, the global
    length ``seq_local x world``, and the global document boundaries as host ints (None: one sequence), checked.

    Args:
        seq_local: this rank's shard length.
        group: the SP group (None: the default manager's; none at all: one process).
        cu_seqlens: global document boundaries ``[0, ..., S]`` (a tensor is read on the host once per batch).
        where: names the caller in errors.
    Raises:
        ValueError: boundaries that decrease or do not run from 0 to the global length (repeats are dropped).
    """
    group = resolve_group(group)
    world = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    seq_len = seq_local * world
    cu = host_boundaries(cu_seqlens)
    if cu is not None and (cu[0] != 0 or cu[-1] != seq_len or any(b < a for a, b in zip(cu, cu[1:]))):
        raise ValueError(f"{where}: cu_seqlens {list(cu)} must not decrease, running from 0 to the global length "
                         f"{seq_len} (seq_local {seq_local} x {world} ranks; a repeated entry, a zero-length "
                         "document, is allowed)")
    # a zero-length document (flash-attn varlen / Megatron's fixed-size padding) holds no token: dropped here, so
    # every mixer plans the boundaries the attention does
    return world, rank, seq_len, None if cu is None else drop_empty_documents(cu)
