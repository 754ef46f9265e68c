"""Ring communicators: send tensors to the next rank of the SP ring, receive the previous rank's.

The ring algorithms only need ``exchange(tensors) -> Pending`` and ``Pending.wait() -> received``;
two implementations provide it:

- :class:`RingComm` — torch.distributed point-to-point (``batch_isend_irecv``) over a process group:
  gloo on CPU, NCCL on GPUs.
- :class:`ThreadRing` — P virtual ranks in one process, one Python thread each, exchanging through
  in-memory mailboxes. It runs the exact ring code with real kernels on a single device (e.g. P ranks
  on one GPU), which a one-GPU machine cannot do with NCCL.

Each tensor of an exchange travels under its own tag (``channel * 16 + i``) so that gloo never pairs
a K message with a V receive, and two channels (K/V and the travelling dK/dV) can be in flight at once.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from seqpar.runtime.liveness import reraise

__all__ = ["Pending", "RingExchange", "RingComm", "ThreadRing", "ThreadRingComm"]

_MAX_TENSORS_PER_EXCHANGE = 16


class Pending:
    """An exchange in flight; :meth:`wait` blocks until it is done and returns the received tensors
    (waiting again returns them at once)."""

    def __init__(self, finish: Callable[[], None], received: list[Tensor]) -> None:
        self._finish: Callable[[], None] | None = finish
        self._received = received

    def wait(self) -> list[Tensor]:
        if self._finish is not None:
            try:
                self._finish()
            except RuntimeError as error:  # a peer lost or late: name it (seqpar.runtime.liveness)
                reraise(error)
            self._finish = None
        return self._received


class RingExchange(Protocol):
    """What the ring algorithms need from a communicator."""

    rank: int
    world_size: int
    bytes_sent: int

    def exchange(
        self, tensors: Sequence[Tensor], out: Sequence[Tensor] | None = None, *, channel: int = 0, shift: int = 1,
        send: bool = True, recv: bool = True,
    ) -> Pending:
        """Start sending ``tensors`` to the next rank and receiving same-shaped ones from the previous
        rank (into ``out`` when given). ``shift``: send to rank + shift and receive from rank - shift
        instead (mod P; a ring whose blocks stop early sends their gradients home in one message).
        ``send`` / ``recv`` False: only the other half (``tensors`` then only give the shapes)."""
        ...


def _recv_buffers(tensors: Sequence[Tensor], out: Sequence[Tensor] | None) -> list[Tensor]:
    if len(tensors) > _MAX_TENSORS_PER_EXCHANGE:
        raise ValueError(f"at most {_MAX_TENSORS_PER_EXCHANGE} tensors per ring exchange")
    if out is None:
        return [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    if len(out) != len(tensors) or any(o.shape != t.shape or o.dtype != t.dtype for o, t in zip(out, tensors)):
        raise ValueError("ring exchange: receive buffers must match the sent tensors in shape and dtype")
    return list(out)


class RingComm:
    """Point-to-point ring over ``group``: rank i sends to i+1 and receives from i-1 (mod P)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        # batch_isend_irecv addresses peers by global rank
        self.next_rank = dist.get_global_rank(self.group, (self.rank + 1) % self.world_size)
        self.prev_rank = dist.get_global_rank(self.group, (self.rank - 1) % self.world_size)
        self.bytes_sent = 0

    def exchange(
        self, tensors: Sequence[Tensor], out: Sequence[Tensor] | None = None, *, channel: int = 0, shift: int = 1,
        send: bool = True, recv: bool = True,
    ) -> Pending:
        bufs = _recv_buffers(tensors, out) if recv else []
        dst, src = self.next_rank, self.prev_rank
        if shift % self.world_size != 1:
            dst = dist.get_global_rank(self.group, (self.rank + shift) % self.world_size)
            src = dist.get_global_rank(self.group, (self.rank - shift) % self.world_size)
        ops = []
        for i, t in enumerate(tensors):
            tag = channel * _MAX_TENSORS_PER_EXCHANGE + i
            if send:
                ops.append(dist.P2POp(dist.isend, t.contiguous(), dst, self.group, tag))
                self.bytes_sent += t.numel() * t.element_size()
            if recv:
                ops.append(dist.P2POp(dist.irecv, bufs[i], src, self.group, tag))
        works = dist.batch_isend_irecv(ops) if ops else []

        def finish() -> None:
            for w in works:
                w.wait()

        return Pending(finish, bufs)


class ThreadRing:
    """P virtual ranks in one process; ``ThreadRing(P).comm(r)`` is rank r's communicator.

    Run each rank's code in its own thread (see :meth:`run`). Messages are cloned on send, as a real
    transfer would copy them, so a sender may reuse its buffer once the exchange is waited on.
    """

    def __init__(self, world_size: int, timeout: float = 60.0) -> None:
        self.world_size = world_size
        self.timeout = timeout
        self._boxes: dict[tuple[int, int, int], queue.Queue] = {}
        self._lock = threading.Lock()

    def _box(self, src: int, dst: int, tag: int) -> queue.Queue:
        with self._lock:
            return self._boxes.setdefault((src, dst, tag), queue.Queue())

    def comm(self, rank: int) -> ThreadRingComm:
        return ThreadRingComm(self, rank)

    def run(self, fn: Callable[[ThreadRingComm], object]) -> list[object]:
        """Run ``fn(comm)`` for every virtual rank in its own thread; return the per-rank results,
        re-raising the first exception."""
        results: list[object] = [None] * self.world_size
        errors: list[BaseException] = []

        def body(rank: int) -> None:
            try:
                results[rank] = fn(self.comm(rank))
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller
                errors.append(e)

        threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(self.world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.timeout * 4)
        if errors:
            raise errors[0]
        if any(t.is_alive() for t in threads):
            raise TimeoutError("ThreadRing: a virtual rank did not finish (deadlock in the ring code?)")
        return results


class ThreadRingComm:
    """Rank ``rank``'s view of a :class:`ThreadRing`."""

    def __init__(self, ring: ThreadRing, rank: int) -> None:
        self.ring = ring
        self.rank = rank
        self.world_size = ring.world_size
        self.bytes_sent = 0

    def exchange(
        self, tensors: Sequence[Tensor], out: Sequence[Tensor] | None = None, *, channel: int = 0, shift: int = 1,
        send: bool = True, recv: bool = True,
    ) -> Pending:
        bufs = _recv_buffers(tensors, out) if recv else []
        nxt, prv = (self.rank + shift) % self.world_size, (self.rank - shift) % self.world_size
        for i, t in enumerate(tensors if send else []):
            self.ring._box(self.rank, nxt, channel * _MAX_TENSORS_PER_EXCHANGE + i).put(t.clone())
            self.bytes_sent += t.numel() * t.element_size()

        def finish() -> None:
            for i, r in enumerate(bufs):
                box = self.ring._box(prv, self.rank, channel * _MAX_TENSORS_PER_EXCHANGE + i)
                try:
                    r.copy_(box.get(timeout=self.ring.timeout))
                except queue.Empty:
                    raise TimeoutError(
                        f"ThreadRing rank {self.rank}: nothing arrived from rank {prv} in {self.ring.timeout}s"
                    ) from None

        return Pending(finish, bufs)
