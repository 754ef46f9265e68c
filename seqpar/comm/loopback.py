"""A ring communicator whose neighbours are the calling rank itself: one rank of a P-rank ring on one device.

A single-GPU machine cannot run a real multi-rank CUDA ring (NCCL refuses two ranks on one GPU, and
gloo's point-to-point ops take CPU tensors). :class:`LoopbackComm` lets the unchanged ring code run one
rank's share of a long sequence there: every step it "receives" a copy of the blocks it sends, so each
step works on blocks of the right shape and follows the causal plan of the right source rank (the plan
depends on ranks, not values). The results are not those of a real ring (values differ); the time and
peak memory of the rank's work are. :func:`seqpar.bench.attention.simulate_rank` is its user.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from seqpar.comm.ring import Pending

__all__ = ["LoopbackComm", "LoopbackSegmentComm"]


class LoopbackComm:
    """Rank ``rank`` of a ``world_size``-rank ring whose neighbours this rank plays itself (same
    ``exchange`` contract as :class:`seqpar.comm.ring.RingComm`).

    ``exchange`` "receives" a copy of what it sends, so the ring code runs each of its P steps on
    K/V blocks (and dK/dV accumulators) of the right shape, with the causal plan of the right source
    rank (the plan depends on ranks, not on values). ``transfer=False`` hands the sent tensors back
    with no copy at all (compute alone). On CUDA the copy runs on a side stream, as a real transfer
    would, and ``wait`` makes the compute stream wait for it; on CPU it is a plain copy.
    """

    def __init__(self, rank: int, world_size: int, *, transfer: bool = True) -> None:
        self.rank = rank
        self.world_size = world_size
        self.transfer = transfer
        self.bytes_sent = 0
        self._stream: Any = None

    def exchange(
        self, tensors: Sequence[Tensor], out: Sequence[Tensor] | None = None, *, channel: int = 0, shift: int = 1,
        send: bool = True, recv: bool = True,
    ) -> Pending:
        # shift / send / recv: accepted for the RingExchange contract; the loopback hands back what it
        # is given either way (masks with blocks that stop early then see values, never shapes, differ)
        if send:
            self.bytes_sent += sum(t.numel() * t.element_size() for t in tensors)
        if not self.transfer:
            sent = list(tensors)
            return Pending(lambda: None, sent)
        recv = list(out) if out is not None else [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
        dev = tensors[0].device
        if dev.type != "cuda":
            for r, t in zip(recv, tensors):
                r.copy_(t)
            return Pending(lambda: None, recv)
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=dev)
        side, main = self._stream, torch.cuda.current_stream(dev)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            for r, t in zip(recv, tensors):
                r.copy_(t, non_blocking=True)
                t.record_stream(side)
                r.record_stream(side)

        def finish() -> None:
            main.wait_stream(side)

        return Pending(finish, recv)


class LoopbackSegmentComm:
    """Member ``index`` of a ``size``-member segment (:class:`seqpar.comm.segment.SegmentComm`'s
    ``exchange(sends, recvs)`` contract) whose peers this process plays itself: sends go nowhere and
    receive buffers are zero-filled (their shapes, not values, are what a timing needs)."""

    def __init__(self, index: int, size: int) -> None:
        self.index, self.size, self.first = index, size, 0
        self.bytes_sent = 0

    def exchange(
        self, sends: Sequence[tuple[int, Tensor]], recvs: Sequence[tuple[int, Tensor]], *, channel: int = 0
    ) -> Pending:
        self.bytes_sent += sum(t.numel() * t.element_size() for _, t in sends)
        for _, buf in recvs:
            buf.zero_()
        return Pending(lambda: None, [buf for _, buf in recvs])
