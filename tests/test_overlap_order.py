"""Every transfer is waited where its buffer is first touched (:mod:`seqpar.comm.schedule`): per exchange
the order is post -> kernels -> wait, for ring, hybrid (its ring), dilated and all-gather, forward and
backward. A recording communicator logs posts and waits; the kernel entry points log their calls.

Ring and dilated run one rank of a P-rank ring in this process (loopback communicators wrapped in
:class:`~seqpar.comm.emulated.EmulatedRing` / ``EmulatedSegment`` with free links, whose trace is the
record); hybrid and all-gather run on gloo ranks, with the hybrid's ring communicator wrapped the same
way and all-gather's collectives recorded where it makes its :class:`~seqpar.comm.ring.Pending`.
Before the ring and dilated backward waited late, both failed here (the accumulator exchange was waited
before the next hop's kernels)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

import seqpar
import seqpar.attn.allgather as allgather_mod
import seqpar.attn.common as common_mod
import seqpar.attn.dilated_blocks as dilated_blocks_mod
import seqpar.attn.hybrid as hybrid_mod
import seqpar.attn.ulysses as ulysses_mod
from seqpar.attn.common import AttentionOptions
from seqpar.attn.dilated import DilatedOptions, dilated_backward, dilated_forward, plan_dilated
from seqpar.attn.ring import ring_backward, ring_forward
from seqpar.comm.emulated import EmulatedLinks, EmulatedRing, EmulatedSegment
from seqpar.comm.loopback import LoopbackComm, LoopbackSegmentComm
from seqpar.comm.ring import Pending, RingComm
from seqpar.comm.schedule import Event

KERNEL_SITES = ((common_mod, "block_forward"), (common_mod, "block_backward"),
                (dilated_blocks_mod, "block_forward"), (dilated_blocks_mod, "block_backward"))


@contextlib.contextmanager
def kernels_logged(events: list[Event]) -> Iterator[None]:
    """Every kernel call appends a ``"kernel"`` event to ``events`` (patched where the algorithms call it)."""
    saved = [(mod, name, getattr(mod, name)) for mod, name in KERNEL_SITES]

    def logged(fn):  # noqa: ANN001, ANN202
        def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            events.append(Event("kernel"))
            return fn(*args, **kwargs)
        return call

    def ends(fn):  # noqa: ANN001, ANN202
        def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            result = fn(*args, **kwargs)
            events.append(Event("end"))  # a ring pass returns: everything it posted is waited
            return result
        return call

    passes = [(ulysses_mod, name, getattr(ulysses_mod, name)) for name in ("ring_forward", "ring_backward")]
    try:
        for mod, name, fn in saved:
            setattr(mod, name, logged(fn))
        for mod, name, fn in passes:
            setattr(mod, name, ends(fn))
        yield
    finally:
        for mod, name, fn in saved + passes:
            setattr(mod, name, fn)


def late_wait_violations(events: list[Event]) -> list[str]:
    """Exchanges waited with no kernel between post and wait although kernels came after the post in
    the same pass (an exchange posted after a pass's last kernel, e.g. the last dK/dV hop home, has
    nothing to hide behind and is exempt; ``"end"`` events close the passes of the hybrid's chunks)."""
    bad = []
    posts = {}
    for i, e in enumerate(events):
        if e.kind == "post":
            posts[e.xid] = i  # the last message of the exchange
        elif e.kind == "wait":
            p = posts[e.xid]
            between = any(x.kind == "kernel" for x in events[p + 1:i])
            rest = events[p + 1:]
            rest = rest[:next((n for n, x in enumerate(rest) if x.kind == "end"), len(rest))]
            later = any(x.kind == "kernel" for x in rest)
            if later and not between:
                bad.append(f"exchange {e.xid} (channel {e.channel}) waited at event {i} right after its post at {p}")
    return bad


def _ring_events(world: int, rank: int, causal: bool) -> dict[str, list[Event]]:
    g = torch.Generator().manual_seed(3)
    seq_local = 8
    q, k, v, dout = (torch.randn(1, 2, seq_local, 8, generator=g) for _ in range(4))
    opts = AttentionOptions(causal=causal, scale=0.3, sharding="zigzag" if causal else "contiguous")
    got = {}
    for phase in ("forward", "backward"):
        links = EmulatedLinks(None)
        comm = EmulatedRing(LoopbackComm(rank, world, transfer=False), links)
        with kernels_logged(links.trace.events):
            out, lse = ring_forward(q, k, v, LoopbackComm(rank, world, transfer=False), opts) if phase == "backward" \
                else (None, None)
            links.trace.events.clear()
            if phase == "forward":
                ring_forward(q, k, v, comm, opts)
            else:
                ring_backward(dout, q, k, v, out.to(q.dtype), lse, comm, opts)
        got[phase] = list(links.trace.events)
    return got


def _dilated_events(world: int, rank: int, causal: bool) -> dict[str, list[Event]]:
    g = torch.Generator().manual_seed(4)
    seq_local = 8
    q, k, v, dout = (torch.randn(1, 2, seq_local, 8, generator=g) for _ in range(4))
    opts = DilatedOptions(segment_lengths=(seq_local * world,), dilation_rates=(1,), causal=causal, scale=0.3)
    plan = plan_dilated(opts, q_heads=2, kv_heads=2, seq_local=seq_local, rank=rank, world_size=world)
    got = {}
    for phase in ("forward", "backward"):
        links = EmulatedLinks(None)
        comms = {p: EmulatedSegment(LoopbackSegmentComm(pat.index, pat.span), links)
                 for p, pat in enumerate(plan.patterns) if pat.span > 1}
        with kernels_logged(links.trace.events):
            out, lse = dilated_forward(q, k, v, plan, comms)
            if phase == "backward":
                links.trace.events.clear()
                dilated_backward(dout, q, k, v, out.to(q.dtype), lse, plan, comms)
        got[phase] = list(links.trace.events)
    return got


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("world,rank", [(4, 1), (4, 3), (8, 5)])
def test_ring_waits_after_the_kernels(world: int, rank: int, causal: bool) -> None:
    for phase, events in _ring_events(world, rank, causal).items():
        assert sum(e.kind == "wait" for e in events) >= world - 1, (phase, events)
        assert not late_wait_violations(events), (phase, late_wait_violations(events))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("world,rank", [(4, 0), (4, 2), (4, 3), (8, 6)])
def test_dilated_waits_after_the_kernels(world: int, rank: int, causal: bool) -> None:
    for phase, events in _dilated_events(world, rank, causal).items():
        assert any(e.kind == "wait" for e in events), (phase, events)
        assert not late_wait_violations(events), (phase, late_wait_violations(events))


# --------------------------------------------------------------------- hybrid and all-gather (gloo ranks)
def _recorded_run(rank: int, world: int, mode: str, causal: bool, **options: object) -> dict[str, list[str]]:
    """Worker body: forward + backward of seqpar.attention with the point-to-point / collective
    exchanges and the kernels recorded; returns the late-wait violations per phase (and counts)."""
    events: list[Event] = []
    links = EmulatedLinks(None)
    links.trace.events = events
    saved_ring, saved_pending = hybrid_mod.RingComm, allgather_mod.Pending
    counter = iter(range(10**6))

    class RecordingPending(Pending):  # all-gather's collectives
        def __init__(self, finish, received) -> None:  # noqa: ANN001
            super().__init__(finish, received)
            self.xid = -1 - next(counter)
            events.append(Event("post", xid=self.xid))

        def wait(self) -> list[torch.Tensor]:
            if self._finish is not None:
                events.append(Event("wait", xid=self.xid))
            return super().wait()

    hybrid_mod.RingComm = lambda group: EmulatedRing(RingComm(group), links)  # the hybrid's ring
    allgather_mod.Pending = RecordingPending
    try:
        if mode == "hybrid":
            seqpar.init_process_groups(sp_size=world, ulysses_size=2)
        g = torch.Generator().manual_seed(5 + rank)
        q, k, v, dout = (torch.randn(1, 4, 8, 8, generator=g) for _ in range(4))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        group = seqpar.default_manager().sp_group if mode == "hybrid" else torch.distributed.group.WORLD
        with kernels_logged(events):
            out = seqpar.attention(q, k, v, causal=causal, mode=mode, group=group,
                                   sharding="zigzag" if causal else "contiguous", **options)
            fwd = list(events)
            events.clear()
            out.backward(dout)
            bwd = list(events)
    finally:
        hybrid_mod.RingComm, allgather_mod.Pending = saved_ring, saved_pending
    return {"forward": late_wait_violations(fwd), "backward": late_wait_violations(bwd),
            "waits": [sum(e.kind == "wait" for e in fwd), sum(e.kind == "wait" for e in bwd)]}


@pytest.mark.parametrize("causal", [False, True])
def test_hybrid_ring_waits_after_the_kernels(dist_pool, causal: bool) -> None:
    for rank, r in enumerate(dist_pool.run(4, _recorded_run, "hybrid", causal, timeout=120)):
        assert min(r["waits"]) >= 1, (rank, r)
        assert not r["forward"] and not r["backward"], (rank, r)


@pytest.mark.parametrize("causal", [False, True])
def test_allgather_waits_after_the_kernels(dist_pool, causal: bool) -> None:
    """Two head chunks: with one, the backward hides its dK/dV reduce-scatter behind the own block and
    leaves the one K/V gather exposed (one independent kernel cannot hide both)."""
    for rank, r in enumerate(dist_pool.run(2, _recorded_run, "allgather", causal, head_chunks=2, timeout=120)):
        assert min(r["waits"]) >= 1, (rank, r)
        assert not r["forward"] and not r["backward"], (rank, r)
