"""When an algorithm waits for a transfer: **wait where the buffer is first touched**.

Every point-to-point algorithm of seqpar (ring, hybrid's ring, dilated, all-gather; forward and
backward) follows one rule, stated here once:

1. *Post as early as the data allows*: an exchange starts as soon as what it sends is final and its
   receive buffers are free.
2. *Wait as late as the buffers allow*: an exchange is waited only right before the first use of what it
   received (a K/V block before the kernels that read it; a travelling dK/dV accumulator after the hop's
   kernels, right before the add into it), or right before its buffers are needed again, and never
   before kernels that do not need it. Per hop the order is therefore *post -> compute -> wait*; an
   exchange posted after the last kernel (the last dK/dV hop home) has nothing to hide behind.
3. *The NCCL buffer rule* (see :mod:`seqpar.attn.ring`): a tensor handed to an exchange is neither written
   (sent or received) nor read (received) until that exchange's ``wait()`` has returned. Waiting late
   never breaks it: a buffer is reused (the accumulators sent on become the next receive buffers) only
   after the wait of the exchange that sent it.

``tests/test_overlap_order.py`` records post / kernel / wait events of every algorithm and checks rule 2;
``tests/test_nccl_rules.py`` checks rule 3. :func:`hidden_bound` replays a recorded schedule
(:class:`Trace`) on a link model to give the most overlap that schedule allows
(``python -m seqpar.bench overlap``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

__all__ = ["Event", "Trace", "replay", "hidden", "hidden_bound", "early_waits"]


@dataclass(frozen=True)
class Event:
    """One step of a schedule. ``kind``: ``"post"`` (an exchange started: ``nbytes`` on ``link``),
    ``"compute"`` (host work of ``seconds`` between two communication calls) or ``"wait"``.
    ``xid`` names the exchange (post and wait of one exchange share it); ``channel`` its channel."""

    kind: str
    xid: int = -1
    seconds: float = 0.0
    nbytes: int = 0
    link: tuple = ()
    channel: int = 0


@dataclass
class Trace:
    """A recorded schedule: events in program order (see :class:`seqpar.comm.emulated.EmulatedLinks`)."""

    events: list[Event] = field(default_factory=list)

    def compute_seconds(self) -> float:
        return sum(e.seconds for e in self.events if e.kind == "compute")


def replay(events: Sequence[Event], transfer_seconds: Callable[[int], float], *, compute: bool = True) -> float:
    """End time of ``events`` played on one host thread against FIFO links: a message starts when it is
    posted and its link is free, and takes ``transfer_seconds(nbytes)``; a wait blocks the host until
    its exchange's messages are done. ``compute=False``: host work costs nothing (transfers alone)."""
    now, link_free, done = 0.0, {}, {}
    for e in events:
        if e.kind == "compute":
            now += e.seconds if compute else 0.0
        elif e.kind == "post":
            start = max(now, link_free.get(e.link, 0.0))
            link_free[e.link] = end = start + transfer_seconds(e.nbytes)
            done[e.xid] = max(done.get(e.xid, 0.0), end)
        elif e.kind == "wait":
            now = max(now, done.get(e.xid, 0.0))
    return now


def hidden(t_compute: float, t_transfer: float, t_step: float) -> float:
    """The share of the shorter of compute and transfer that the step hid:
    ``(T_compute + T_transfer - T_step) / min(T_compute, T_transfer)`` (1: fully hidden, 0: serial)."""
    return (t_compute + t_transfer - t_step) / min(t_compute, t_transfer)


def hidden_bound(events: Sequence[Event], transfer_seconds: Callable[[int], float]) -> dict[str, float]:
    """The structural figures of a schedule: its replayed ``T_compute``, ``T_transfer``, ``T_step`` and
    the ``hidden`` they give (what this order of posts, kernels and waits allows at best)."""
    t_c = sum(e.seconds for e in events if e.kind == "compute")
    t_t = replay(events, transfer_seconds, compute=False)
    t_s = replay(events, transfer_seconds)
    return {"t_compute": t_c, "t_transfer": t_t, "t_step": t_s, "hidden": hidden(t_c, t_t, t_s)}


def early_waits(events: Sequence[Event], channels: Sequence[int]) -> list[Event]:
    """The same schedule with every exchange of ``channels`` waited right after it is posted (before the
    next kernels): the order the ring and dilated backward had before waiting late, for comparison."""
    waits = {e.xid: e for e in events if e.kind == "wait" and e.channel in channels}
    last_post = {e.xid: i for i, e in enumerate(events) if e.kind == "post"}
    out = []
    for i, e in enumerate(events):
        if e.kind == "wait" and e.xid in waits:
            continue
        out.append(e)
        if e.kind == "post" and e.xid in waits and last_post[e.xid] == i:
            out.append(waits[e.xid])
    return out
