"""Emulated links: one rank's communicator whose transfers take the time a given link would.

Each directed link is a FIFO with one bandwidth: a message completes ``latency + bytes / bandwidth``
after it is posted or after the link is free, whichever is later, so messages on one link (K/V and
dK/dV channels alike) share it. The transfer itself costs no CPU: the inner communicator (a loopback
that hands the buffers back, :class:`~seqpar.comm.loopback.LoopbackComm` with ``transfer=False``) moves
nothing, and ``wait()`` only lets the clock run until the message is done. One rank plays against
peers that behave as it does (the ring's symmetry): what it receives on the link ``r - d -> r`` was
posted when it posted its own send on ``r -> r + d``.

Clocks (:class:`LinkClock`): ``"wall"`` sleeps until a message is done and times the host with
``time.perf_counter``; ``"thread"`` reads the calling thread's CPU time and *adds* the idle time instead
of sleeping, so other processes on a loaded machine neither stretch the compute nor the idle time
(run the kernels on one thread: ``torch.set_num_threads(1)``). Every post / wait, and the host time
between them, is recorded in a :class:`~seqpar.comm.schedule.Trace` for
:func:`~seqpar.comm.schedule.hidden_bound`.

On CUDA, :class:`CudaLinks` keeps the same model on the device: each link a side stream held by a
calibrated ``torch.cuda._sleep`` (:func:`sleep_cycles_per_second`; ``emulation="sleep"``) or by pinned
host <-> device copies that the copy engines run without an SM (:class:`CopyEngine`; ``emulation="copy"``),
the host never blocking.

Layouts: whatever the inner communicator takes; only the byte counts matter here.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from seqpar.comm.ring import Pending
from seqpar.comm.schedule import Event, Trace

__all__ = [
    "LinkClock", "EmulatedLinks", "EmulatedRing", "EmulatedSegment", "CudaLinks", "sleep_cycles_per_second",
    "CopyRate", "CopyEngine", "copy_pieces", "copy_direction", "rate_from_two", "EMULATIONS",
]

EMULATIONS = ("sleep", "copy")
"""How :class:`CudaLinks` holds a link for a message's time: a ``torch.cuda._sleep`` kernel (one thread
block on an SM) or copy-engine copies (no SM)."""


class LinkClock:
    """``kind="wall"`` (perf_counter, real sleeps) or ``"thread"`` (this thread's CPU time plus the idle
    time it was told to pass, no sleeping)."""

    def __init__(self, kind: str = "wall") -> None:
        if kind not in ("wall", "thread"):
            raise ValueError(f"LinkClock: kind must be 'wall' or 'thread', not {kind!r}")
        self.kind = kind
        self._idle = 0.0

    def now(self) -> float:
        return time.perf_counter() if self.kind == "wall" else time.thread_time() + self._idle

    def idle_until(self, t: float) -> None:
        dt = t - self.now()
        if dt <= 0:
            return
        if self.kind == "wall":
            time.sleep(dt)
        else:
            self._idle += dt


class EmulatedLinks:
    """The links of one rank: FIFOs keyed by ``(direction, distance)``, each of ``bandwidth`` bytes/s
    (None: free links, every transfer done when posted) and ``latency`` seconds per message."""

    def __init__(self, bandwidth: float | None, latency: float = 0.0, clock: LinkClock | None = None) -> None:
        if bandwidth is not None and bandwidth <= 0:
            raise ValueError(f"EmulatedLinks: bandwidth must be > 0 bytes/s (or None for free links), not {bandwidth}")
        self.bandwidth, self.latency = bandwidth, latency
        self.clock = clock or LinkClock()
        self.trace = Trace()
        self._free: dict[tuple, float] = {}
        self._mark = self.clock.now()
        self._next_xid = 0

    def transfer_seconds(self, nbytes: int) -> float:
        return 0.0 if self.bandwidth is None else self.latency + nbytes / self.bandwidth

    def _compute(self) -> None:
        now = self.clock.now()
        self.trace.events.append(Event("compute", seconds=now - self._mark))
        self._mark = now

    def post(self, messages: Sequence[tuple[tuple, int]], inner: Pending, channel: int) -> Pending:
        """Start ``messages`` (``(link, nbytes)`` each) wrapping the inner exchange ``inner``."""
        self._compute()  # the host time so far, the inner exchange's own included
        xid, self._next_xid = self._next_xid, self._next_xid + 1
        now = done = self._mark
        for link, nbytes in messages:
            end = max(now, self._free.get(link, now)) + self.transfer_seconds(nbytes)
            self._free[link] = end
            done = max(done, end)
            self.trace.events.append(Event("post", xid=xid, nbytes=nbytes, link=link, channel=channel))
        return _Timed(self, inner, xid, done, channel)

    def wait(self, inner: Pending, xid: int, done: float, channel: int) -> list[Tensor]:
        """Wait for ``inner`` and let the clock run until ``done`` (the message's end on its link)."""
        received = inner.wait()
        self._compute()  # host time (bookkeeping of this class included) counts as compute
        self.clock.idle_until(done)
        self.trace.events.append(Event("wait", xid=xid, channel=channel))
        self._mark = self.clock.now()  # the idle time is not host work
        return received

    def finish(self) -> None:
        """Record the host time since the last post / wait (call at the end of a timed step)."""
        self._compute()


class _Timed(Pending):
    """An emulated exchange in flight: :meth:`wait` returns when its link says the messages are done."""

    def __init__(self, links: EmulatedLinks, inner: Pending, xid: int, done: float, channel: int) -> None:
        super().__init__(lambda: None, [])
        self._args = (links, inner, xid, done, channel)

    def wait(self) -> list[Tensor]:
        if self._finish is not None:
            links, inner, xid, done, channel = self._args
            self._received = links.wait(inner, xid, done, channel)
            self._finish = None
        return self._received


def _nbytes(tensors: Sequence[Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class _OnLinks:
    """An inner communicator and the ``links`` its messages take the time of: the bytes sent are the inner one's."""

    def __init__(self, inner, links: EmulatedLinks) -> None:  # noqa: ANN001 - a RingExchange or SegmentComm-like
        self.inner, self.links = inner, links

    @property
    def bytes_sent(self) -> int:
        return self.inner.bytes_sent


class EmulatedRing(_OnLinks):
    """A :class:`~seqpar.comm.ring.RingExchange` whose exchanges take ``links``' time (see the module)."""

    def __init__(self, inner, links: EmulatedLinks) -> None:  # noqa: ANN001 - any RingExchange
        super().__init__(inner, links)
        self.rank, self.world_size = inner.rank, inner.world_size

    def exchange(
        self, tensors: Sequence[Tensor], out: Sequence[Tensor] | None = None, *, channel: int = 0, shift: int = 1,
        send: bool = True, recv: bool = True,
    ) -> Pending:
        extra = {n: v for n, v, d in (("shift", shift, 1), ("send", send, True), ("recv", recv, True)) if v != d}
        inner = self.inner.exchange(tensors, out, channel=channel, **extra)
        d, n = shift % self.world_size, _nbytes(tensors)
        messages = ([(("send", d), n)] if send else []) + ([(("recv", d), n)] if recv else [])
        return self.links.post(messages, inner, channel)


class EmulatedSegment(_OnLinks):
    """A :class:`~seqpar.comm.segment.SegmentComm`-like communicator (``exchange(sends, recvs)``) whose
    messages take ``links``' time; peers are segment indices, links keyed by their distance."""

    def __init__(self, inner, links: EmulatedLinks) -> None:  # noqa: ANN001 - SegmentComm-like
        super().__init__(inner, links)
        self.index, self.size = inner.index, inner.size

    def exchange(
        self, sends: Sequence[tuple[int, Tensor]], recvs: Sequence[tuple[int, Tensor]], *, channel: int = 0
    ) -> Pending:
        inner = self.inner.exchange(sends, recvs, channel=channel)
        messages = [(("send", (p - self.index) % self.size), _nbytes([t])) for p, t in sends if t.numel()]
        messages += [(("recv", (self.index - p) % self.size), _nbytes([b])) for p, b in recvs if b.numel()]
        return self.links.post(messages, inner, channel)


def sleep_cycles_per_second(device: torch.device, *, cycles: int = 2_000_000, repeats: int = 3) -> float:
    """Clock rate of ``torch.cuda._sleep`` on ``device`` (cycles per second), measured with CUDA events:
    the median of ``repeats`` sleeps of ``cycles`` cycles after one warm-up."""
    stream = torch.cuda.current_stream(device)
    rates = []
    for i in range(repeats + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        torch.cuda._sleep(cycles)
        end.record(stream)
        end.synchronize()
        if i:  # the first is the warm-up
            rates.append(cycles / (start.elapsed_time(end) * 1e-3))
    return sorted(rates)[len(rates) // 2]


class CudaLinks:
    """The links of one rank on one GPU: the same FIFO model as :class:`EmulatedLinks`, with the time
    spent on the device instead of the host.

    Each directed link is a CUDA stream. A message is one ``torch.cuda._sleep`` kernel on its link's
    stream, lasting ``latency + bytes / bandwidth``; it starts once the compute stream has reached the
    post (an event) and the link's earlier messages are done (the stream's order: a FIFO). ``wait`` makes
    the compute stream wait for the message's end (an event); the host never blocks, as with NCCL. The
    sleep kernel holds one thread block on one SM while it runs: a transfer costs the compute (nearly)
    nothing, as a copy engine's or NVLink's would. ``bandwidth`` None: free links (no kernel at all).

    The link streams have **high priority** (``high_priority=True``, CUDA priority -1 against the compute
    stream's 0). A copy engine starts a transfer when it is posted; a sleep kernel needs a free SM, and at
    equal priority the block scheduler hands a later stream's grid SMs only at the tail of the compute
    grid in flight (a kernel that fills the GPU), so a message posted right before an attention kernel
    would start only after it (issue 29 §8: ``hidden`` at 50 GB/s fell from 0.90 to 0.76 once the copies
    that used to sit between the K/V post and the kernel were gone; modelled in
    :mod:`seqpar.testing.streams`, not measured). At high priority it takes the next SM a thread block
    frees. ``time_links=True`` also times each message on its stream (from the moment its stream may run
    it to its end): :meth:`finish` then lists in :attr:`lags` how much longer each took than
    ``latency + bytes / bandwidth`` (waiting for an SM, or a sleep clock slower than calibrated).

    ``emulation="copy"`` holds a message with copy-engine copies instead of the sleep (``copies``, a
    :class:`CopyEngine`: pinned host <-> device, ``non_blocking``, on the link's stream, sized by
    :func:`copy_pieces` to last ``latency + bytes / bandwidth`` at the measured copy rate): no kernel,
    so no SM to wait for whatever the compute stream runs (a persistent attention kernel included).
    The waits and the FIFO order are the sleep's. A ``send`` link copies device -> host and a ``recv``
    link host -> device; two links of one direction would share its copy engine and each copy would run
    longer than sized, so a second one is refused by name (gpu-perf's ring uses one link each way).

    Posts and waits are recorded in :attr:`trace`, and :meth:`finish` adds the compute stream's time
    between them (CUDA events around each segment; the time the stream idles in a wait is excluded), so
    a trace replays as :class:`EmulatedLinks`' does (:func:`~seqpar.comm.schedule.hidden_bound`).
    """

    def __init__(self, bandwidth: float | None, latency: float = 0.0, *, device: torch.device,
                 cycles_per_second: float | None = None, high_priority: bool = True, time_links: bool = False,
                 emulation: str = "sleep", copies: CopyEngine | None = None) -> None:
        if bandwidth is not None and bandwidth <= 0:
            raise ValueError(f"CudaLinks: bandwidth must be > 0 bytes/s (or None for free links), not {bandwidth}")
        if device.type != "cuda":
            raise ValueError(f"CudaLinks needs a CUDA device, not {device}; on CPU use EmulatedLinks")
        if emulation not in EMULATIONS:
            raise ValueError(f"CudaLinks: emulation must be one of {EMULATIONS}, not {emulation!r}")
        self.bandwidth, self.latency, self.device, self.emulation = bandwidth, latency, device, emulation
        if emulation == "sleep":
            self.cycles_per_second = cycles_per_second if cycles_per_second else sleep_cycles_per_second(device)
        else:
            self.cycles_per_second = cycles_per_second
            self.copies = copies if copies is not None or bandwidth is None else CopyEngine.measure(device)
        self._directions: dict[str, tuple] = {}  # copy direction -> the link holding it (emulation "copy")
        self.trace = Trace()
        self.high_priority, self.time_links = high_priority, time_links
        self.lags: list[float] = []  # seconds each timed message took beyond its modelled time (finish())
        self._timed: list[tuple[torch.cuda.Event, torch.cuda.Event, float]] = []
        self._streams: dict[tuple, torch.cuda.Stream] = {}
        self._next_xid = 0
        # the compute stream's time between communication calls, as (trace position, start, end) events:
        # turned into "compute" events by finish(), so a trace reads as EmulatedLinks' does
        self._segments: list[tuple[int, torch.cuda.Event, torch.cuda.Event]] = []
        self._last = self._mark()

    def _mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _segment(self) -> torch.cuda.Event:
        """Close the compute segment since the last call (it ends now on the compute stream)."""
        end = self._mark()
        self._segments.append((len(self.trace.events), self._last, end))
        return end

    def transfer_seconds(self, nbytes: int) -> float:
        return 0.0 if self.bandwidth is None else self.latency + nbytes / self.bandwidth

    def post(self, messages: Sequence[tuple[tuple, int]], inner: Pending, channel: int) -> Pending:
        """Start ``messages`` (``(link, nbytes)`` each) wrapping the inner exchange ``inner``."""
        xid, self._next_xid = self._next_xid, self._next_xid + 1
        main = torch.cuda.current_stream(self.device)
        ready = self._last = self._segment()
        ends = []
        for link, nbytes in messages:
            self.trace.events.append(Event("post", xid=xid, nbytes=nbytes, link=link, channel=channel))
            if self.bandwidth is None:
                continue
            stream = self._streams.get(link)
            if stream is None and self.emulation == "copy":
                direction = copy_direction(link)
                other = self._directions.setdefault(direction, link)
                if other != link:
                    raise ValueError(
                        f"CudaLinks(emulation='copy'): link {link} would share the {direction} copy engine with link "
                        f"{other}; their copies would split its rate and each last longer than its message. The copy "
                        "emulation holds one link per direction (a ring at distance 1): use --link-emulation sleep")
            if stream is None:
                # high priority: the sleep takes the next free SM instead of queueing behind the compute
                # stream's grid in flight (see the class docstring)
                stream = self._streams[link] = torch.cuda.Stream(device=self.device,
                                                                 priority=-1 if self.high_priority else 0)
            stream.wait_event(ready)
            with torch.cuda.stream(stream):
                begin = torch.cuda.Event(enable_timing=True) if self.time_links else None
                if begin is not None:
                    begin.record(stream)
                if self.emulation == "copy":
                    self.copies.issue(copy_direction(link), self.transfer_seconds(nbytes),
                                      what=f"a message of {nbytes} bytes on link {link}")
                else:
                    torch.cuda._sleep(max(1, int(self.transfer_seconds(nbytes) * self.cycles_per_second)))
                end = torch.cuda.Event(enable_timing=self.time_links)
                end.record(stream)
            if begin is not None:
                self._timed.append((begin, end, self.transfer_seconds(nbytes)))
            ends.append(end)

        def finish() -> list[Tensor]:
            received = inner.wait()
            self._segment()  # compute up to the wait; the time the stream then idles is not compute
            for end in ends:
                main.wait_event(end)
            self.trace.events.append(Event("wait", xid=xid, channel=channel))
            self._last = self._mark()
            return received

        return _CudaTimed(finish)

    def finish(self) -> None:
        """Close the last compute segment, wait for the device and write every segment's duration into
        :attr:`trace` as a ``compute`` event at its place (call at the end of a timed step)."""
        self._last = self._segment()
        self._last.synchronize()
        for pos, start, end in reversed(self._segments):
            self.trace.events.insert(pos, Event("compute", seconds=start.elapsed_time(end) * 1e-3))
        self._segments.clear()
        for begin, end, seconds in self._timed:
            end.synchronize()
            self.lags.append(begin.elapsed_time(end) * 1e-3 - seconds)
        self._timed.clear()


class _CudaTimed(Pending):
    """A message in flight on :class:`CudaLinks`: :meth:`wait` orders the compute stream after it."""

    def __init__(self, finish: Callable[[], list[Tensor]]) -> None:
        super().__init__(lambda: None, [])
        self._wait = finish

    def wait(self) -> list[Tensor]:
        if self._finish is not None:
            self._received = self._wait()
            self._finish = None
        return self._received


# ------------------------------------------------------------------------------------------ copy-engine links
@dataclass(frozen=True)
class CopyRate:
    """One copy direction's measured cost: a copy of ``n`` bytes lasts ``fixed + n / rate`` seconds."""

    fixed: float
    rate: float

    def seconds(self, nbytes: int) -> float:
        return self.fixed + nbytes / self.rate


def copy_direction(link: tuple) -> str:
    """The copy direction that holds ``link``: ``"d2h"`` for a ``("send", d)`` link, ``"h2d"`` for a
    ``("recv", d)`` one, so a rank's two directions of one distance use PCIe's two directions (two copy
    engines) and never share one."""
    return "d2h" if link[0] == "send" else "h2d"


def copy_pieces(seconds: float, rate: CopyRate, buffer_bytes: int, *, what: str = "a message") -> list[int]:
    """Byte counts of the copies that together last ``seconds`` at ``rate``, each at most ``buffer_bytes``
    (the staging buffers' size): ``k`` copies of ``S`` bytes in all last ``k * fixed + S / rate``, so
    ``S = (seconds - k * fixed) * rate`` with the least ``k`` such that ``S <= k * buffer_bytes``; the
    pieces are as equal as whole bytes allow. A bandwidth above the copy rate needs nothing special: the
    copies carry none of the message's bytes (the loopback moves nothing), only its duration, so they
    are then smaller than the message. Raises ``ValueError`` naming ``what`` when ``seconds`` is shorter
    than one copy's fixed cost (no copy can last that little: a silent wrong figure otherwise)."""
    if rate.rate <= 0 or rate.fixed < 0 or buffer_bytes < 1:
        raise ValueError(f"copy_pieces: need rate > 0, fixed >= 0 and buffer_bytes >= 1, not {rate}, {buffer_bytes}")
    k = 1
    while True:
        total = (seconds - k * rate.fixed) * rate.rate
        if total < k:  # each copy at least one byte
            raise ValueError(
                f"copy emulation: {what} lasts {seconds * 1e6:.2f} us on the link model, less than "
                f"{k} cop{'y' if k == 1 else 'ies'} of at least one byte ({k * rate.fixed * 1e6:.2f} us of fixed cost "
                f"at {rate.rate / 1e9:.1f} GB/s): a copy cannot hold it that briefly. Use --link-emulation sleep, a "
                "lower bandwidth, a larger latency or larger messages")
        need = math.ceil(total / buffer_bytes)
        if need <= k:
            break
        k = need
    total = int(total)
    return [total // k + (1 if i < total % k else 0) for i in range(k)]


class CopyEngine:
    """Pinned host and device staging buffers (``buffer_bytes`` each) and each direction's measured
    :class:`CopyRate`: what :class:`CudaLinks` (``emulation="copy"``) holds a link with. Made once per run
    (:meth:`measure`) and shared by every ``CudaLinks`` of it, as the sleep's clock rate is. The buffers'
    contents are garbage: only the copies' durations matter."""

    def __init__(self, device: torch.device, rates: dict[str, CopyRate], *, buffer_bytes: int = 64 << 20,
                 pin: bool = True) -> None:
        missing = {"h2d", "d2h"} - set(rates)
        if missing:
            raise ValueError(f"CopyEngine: rates need 'h2d' and 'd2h', missing {sorted(missing)}")
        self.device, self.rates, self.buffer_bytes = device, dict(rates), buffer_bytes
        self.host = torch.empty(buffer_bytes, dtype=torch.uint8, pin_memory=pin)
        # one device buffer per direction: the two directions' copies run at once
        self.dev = {d: torch.empty(buffer_bytes, dtype=torch.uint8, device=device) for d in ("h2d", "d2h")}
        self.host_out = torch.empty(buffer_bytes, dtype=torch.uint8, pin_memory=pin)

    def issue(self, direction: str, seconds: float, *, what: str = "a message") -> list[int]:
        """Queue on the current stream the copies that last ``seconds`` in ``direction``; returns their
        sizes. Asynchronous (pinned memory, ``non_blocking``): the host does not wait, no SM runs them."""
        sizes = copy_pieces(seconds, self.rates[direction], self.buffer_bytes, what=what)
        for n in sizes:
            self._copy(direction, n)
        return sizes

    def _copy(self, direction: str, n: int) -> None:
        if direction == "h2d":
            self.dev[direction][:n].copy_(self.host[:n], non_blocking=True)
        else:
            self.host_out[:n].copy_(self.dev[direction][:n], non_blocking=True)

    @classmethod
    def measure(cls, device: torch.device, *, buffer_bytes: int = 64 << 20, small: int = 1 << 16,
                repeats: int = 3) -> CopyEngine:
        """Each direction's :class:`CopyRate` from CUDA events around copies of ``small`` bytes and of the
        whole buffer (median of ``repeats`` after a warm-up): ``rate`` from the difference, ``fixed`` from
        the small copy (at least 0). The whole-buffer copy is timed while the other direction copies too
        (two whole buffers on a side stream, started with it): a ring's send and receive messages are
        posted together, so its links run both directions at once (PCIe is full duplex, but the host's
        memory and the bus's overheads are shared)."""
        engine = cls(device, {"h2d": CopyRate(0.0, 1.0), "d2h": CopyRate(0.0, 1.0)}, buffer_bytes=buffer_bytes)
        stream = torch.cuda.current_stream(device)
        side = torch.cuda.Stream(device=device)
        for direction in ("h2d", "d2h"):
            other = "d2h" if direction == "h2d" else "h2d"
            times = {}
            for n in (small, buffer_bytes):
                runs = []
                for i in range(repeats + 1):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record(stream)
                    if n == buffer_bytes:
                        side.wait_event(start)
                        with torch.cuda.stream(side):
                            engine._copy(other, n)
                            engine._copy(other, n)
                    engine._copy(direction, n)
                    end.record(stream)
                    end.synchronize()
                    if i:
                        runs.append(start.elapsed_time(end) * 1e-3)
                times[n] = sorted(runs)[len(runs) // 2]
            side.synchronize()
            engine.rates[direction] = rate_from_two(small, times[small], buffer_bytes, times[buffer_bytes])
        return engine


def rate_from_two(small: int, t_small: float, big: int, t_big: float) -> CopyRate:
    """The :class:`CopyRate` through two timed copies (``t_small`` s for ``small`` bytes, ``t_big`` for
    ``big``): ``rate = (big - small) / (t_big - t_small)``, ``fixed = t_small - small / rate`` (at least
    0). Raises ``ValueError`` when the larger copy was not slower (a broken measurement)."""
    if big <= small or t_big <= t_small:
        raise ValueError(f"copy calibration: {big} bytes took {t_big * 1e6:.1f} us, not more than {small} bytes' "
                         f"{t_small * 1e6:.1f} us; rerun (a loaded machine?) or use --link-emulation sleep")
    rate = (big - small) / (t_big - t_small)
    return CopyRate(max(0.0, t_small - small / rate), rate)
