"""Segment-local point-to-point exchange: the few ranks of an SP group that share one segment.

Dilated attention (see :mod:`seqpar.attn.dilated`) cuts the sequence into segments of length w.
With contiguous sharding and ``w`` a multiple of the local length, each segment covers ``c = w /
seq_local`` consecutive ranks of the SP group, and only those ranks ever need each other's rows.
:class:`SegmentComm` addresses them by their *index within the segment* (0..c-1) and posts one
``batch_isend_irecv`` per exchange, so a segment never touches a rank outside it and no sub-process
group has to be created (creating groups would be a collective over the whole world).

Every exchange is explicit about both sides: the caller lists ``(peer, tensor)`` sends and
``(peer, buffer)`` receives; the algorithms compute both lists from the same deterministic schedule
on every rank, so each send meets exactly one receive. Zero-element tensors are skipped on both sides.
Each channel uses its own tag, so two exchanges of different channels may be in flight at once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist
from torch import Tensor

from seqpar.comm.ring import Pending

__all__ = ["SegmentComm"]

# Tags above the ring communicator's range (channel * 16 + i, i < 16, a few channels).
_TAG_BASE = 1 << 12


class SegmentComm:
    """Point-to-point messages among the ``size`` consecutive SP ranks ``first .. first+size-1``.

    Args:
        group: the SP process group (ranks below are ranks *of this group*).
        first: the SP rank of the segment's first member.
        size: how many consecutive SP ranks share the segment (``c``).

    Attributes:
        index: this rank's position in the segment (0..size-1).
        bytes_sent: running total of bytes this rank has sent through this communicator.
    """

    def __init__(self, group: dist.ProcessGroup, first: int, size: int) -> None:
        self.group = group
        self.first = first
        self.size = size
        self.index = dist.get_rank(group) - first
        if not 0 <= self.index < size:
            raise ValueError(
                f"SegmentComm: SP rank {dist.get_rank(group)} is not among ranks {first}..{first + size - 1}"
            )
        # batch_isend_irecv addresses peers by global rank
        self._global = [dist.get_global_rank(group, first + j) for j in range(size)]
        self.bytes_sent = 0

    def exchange(
        self,
        sends: Sequence[tuple[int, Tensor]],
        recvs: Sequence[tuple[int, Tensor]],
        *,
        channel: int = 0,
    ) -> Pending:
        """Start sending ``sends`` (segment index, tensor) and receiving into ``recvs`` (segment index,
        buffer). At most one message per (peer, direction, channel) per exchange.

        Returns:
            a :class:`~seqpar.comm.ring.Pending` whose ``wait()`` returns the receive buffers, in the
            order of ``recvs``.
        """
        tag = _TAG_BASE + channel
        ops = []
        for peer, t in sends:
            if t.numel():
                ops.append(dist.P2POp(dist.isend, t.contiguous(), self._global[peer], self.group, tag))
                self.bytes_sent += t.numel() * t.element_size()
        for peer, buf in recvs:
            if buf.numel():
                ops.append(dist.P2POp(dist.irecv, buf, self._global[peer], self.group, tag))
        works = dist.batch_isend_irecv(ops) if ops else []

        def finish() -> None:
            for w in works:
                w.wait()
            ops.clear()  # the sent tensors (maybe contiguous copies) live until here

        return Pending(finish, [buf for _, buf in recvs])
