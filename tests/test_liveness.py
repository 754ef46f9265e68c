"""seqpar.runtime.liveness in one process: heartbeats in a real TCPStore on localhost, one client per "rank".

The two-"node" tests (tests/test_failures.py) show the diagnosis reaching the user of a real job;
these check its logic, quickly: who is named lost, left or failed, the timeout, a dead store, the
exception hook, and that start/release leave no thread or hook behind.
"""

from __future__ import annotations

import io
import sys
import threading
import time
from contextlib import redirect_stderr
from datetime import timedelta

import pytest
import torch.distributed as dist

from seqpar.runtime import liveness
from seqpar.runtime.liveness import Heartbeat, Observation, PeerFailure, describe
from seqpar.testing.ranks import free_port

INTERVAL = 0.05


@pytest.fixture
def server():
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False)
    yield store, port
    del store


def _client(port: int) -> dist.Store:
    return dist.PrefixStore(liveness.PREFIX, dist.TCPStore("127.0.0.1", port, is_master=False,
                                                          timeout=timedelta(seconds=2), wait_for_workers=False))


def _ranks(port: int, world: int, timeout_s: float = 5) -> list[Heartbeat]:
    return [Heartbeat(_client(port), r, world, timeout_s=timeout_s, store_host=f"127.0.0.1:{port}",
                      interval_s=INTERVAL).start() for r in range(world)]


def test_describe_names_failed_then_stalest_then_left():
    obs = Observation(before={0: "100.0", 1: "98.0", 2: "99.5", 3: "done", 4: None, 5: "95.0"},
                      after={0: "100.2", 1: "98.0", 2: "99.5", 3: "done", 4: None, 5: "95.0"},
                      now=100.3, window_s=0.2, errors={5: "rank 5: ValueError: bad batch"})
    text = describe(obs, me=0)
    assert text == "; ".join([
        "rank 5: ValueError: bad batch (an exception this rank recorded before it exited)",
        "rank 4 was never heard from (it died or hung before its first heartbeat)",
        "rank 1 was lost (no heartbeat for 2.3 s; killed, preempted or stopped)",
        "rank 2 was lost (no heartbeat for 0.8 s; killed, preempted or stopped)",
        "rank 3 had already left (destroyed its process groups)",
    ])
    alive = Observation(before={0: "1", 1: "2"}, after={0: "3", 1: "4"}, now=5.0, window_s=0.2)
    assert describe(alive, me=0) == ""


def test_heartbeats_name_the_lost_rank_and_the_timeout(server):
    _, port = server
    hbs = _ranks(port, 4)
    try:
        hbs[2].stop(left=False)  # killed: its heartbeat stands still
        hbs[3].stop(left=True)  # finished cleanly
        hbs[1].record_exception(ValueError("bad\nbatch"))
        text = hbs[0].diagnose(RuntimeError("Timed out waiting 5000ms for recv operation to complete"))
        assert text.startswith("seqpar: rank 0: a collective timed out (the timeout_s=5 elapsed): "), text
        assert "rank 1: ValueError: bad batch (an exception" in text
        assert "rank 2 was lost (no heartbeat for" in text and "rank 3 had already left" in text
        closed = hbs[0].diagnose(RuntimeError("Connection closed by peer [127.0.0.1]:1234"))
        assert "a peer's connection closed" in closed and "timeout_s" not in closed
    finally:
        for hb in hbs:
            hb.stop()


def test_every_peer_alive_says_so(server):
    _, port = server
    hbs = _ranks(port, 2)
    try:
        text = hbs[1].diagnose(RuntimeError("Timed out"))
        assert "every peer's heartbeat is still running" in text and "was lost" not in text, text
    finally:
        for hb in hbs:
            hb.stop()


def test_a_dead_store_is_named_in_bounded_time():
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False)
    hb = Heartbeat(_client(port), 0, 2, timeout_s=1, store_host=f"127.0.0.1:{port}", interval_s=INTERVAL).start()
    del server  # the store's host is lost
    tic = time.monotonic()
    text = hb.diagnose(RuntimeError("Connection closed by peer"))
    hb.stop()
    assert time.monotonic() - tic < 15
    assert f"the rendezvous store at 127.0.0.1:{port} did not answer" in text, text


def test_start_release_hook_and_reraise(server, monkeypatch):
    _, port = server
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # no default process group here: the env names the store
    monkeypatch.setenv("MASTER_PORT", str(port))
    hook, threads = sys.excepthook, threading.active_count()
    hb = liveness.start(rank=0, world_size=2, timeout_s=1)  # rank 1 never starts
    assert hb is not None and liveness.start(0, 2, 1) is hb and hb.users == 2  # a second manager joins it
    try:
        assert sys.excepthook is not hook and threading.active_count() == threads + 1
        err = io.StringIO()
        with redirect_stderr(err):
            try:
                raise RuntimeError("Connection closed by peer [127.0.0.1]:9")
            except RuntimeError as e:
                sys.excepthook(type(e), e, e.__traceback__)
            try:
                raise ValueError("my own bug")
            except ValueError as e:
                sys.excepthook(type(e), e, e.__traceback__)
        first = err.getvalue().splitlines()[0]
        assert first.startswith("seqpar: rank 0: a collective failed") and "rank 1 was never heard from" in first
        assert hb.store.get("error/0").decode() == "rank 0: ValueError: my own bug"
        with pytest.raises(PeerFailure, match="rank 1 was never heard from") as info:
            try:
                raise RuntimeError("Timed out waiting 1000ms")
            except RuntimeError as e:
                liveness.reraise(e)
        assert isinstance(info.value.__cause__, RuntimeError)
        with pytest.raises(ValueError, match="not a collective"):  # an own error passes through untouched
            try:
                raise ValueError("not a collective")
            except ValueError as e:
                liveness.reraise(e)
    finally:
        hb.release()
        hb.release()
    assert liveness.active() is None and sys.excepthook is hook and threading.active_count() == threads
    assert hb.store.get("hb/0").decode() == "done"
    assert liveness.start(0, 1, 1) is None  # a world of one has no peer to lose


def test_a_forked_child_forgets_the_heartbeat(server, monkeypatch):
    import os

    _, port = server
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    hb = liveness.start(rank=0, world_size=2, timeout_s=1)
    try:
        pid = os.fork()
        if pid == 0:  # the child: no heartbeat of its own, nothing written on the parent's connection
            os._exit(0 if liveness.active() is None else 1)
        assert os.waitpid(pid, 0)[1] == 0
        assert liveness.active() is hb and hb.running
        hb.beat()  # the parent's connection still works
    finally:
        hb.release()


def test_the_interval_follows_the_timeout(server, monkeypatch):
    """A tenth of the collective timeout, within [0.1, 2] s, so a lost rank shows well inside a short timeout; and
    :func:`liveness.start` beats at that interval.

    Seen failing: ``heartbeat_interval`` ignoring ``timeout_s`` (always torch's 1800 s default, so 2 s: a diagnosis
    under ``timeout_s=1`` waited 4.1 s, past the timeout it explains)."""
    assert [liveness.heartbeat_interval(t) for t in (0.5, 1, 5, 10, 100, None)] == [0.1, 0.1, 0.5, 1.0, 2.0, 2.0]
    _, port = server
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    hb = liveness.start(rank=0, world_size=2, timeout_s=3)
    try:
        assert hb is not None and hb.interval_s == pytest.approx(0.3) and hb.timeout_s == 3
    finally:
        hb.release()


def test_a_joining_manager_brings_its_timeout(server, monkeypatch):
    """A heartbeat started by a manager without a timeout (torch's default), joined by one with ``timeout_s=3``: the
    diagnosis names 3 s and the beat follows the shorter timeout; a later manager with a longer one keeps the beat.

    Seen failing: joining without taking the timeout (``timeout_s`` None after the second start: the full suite's
    ``test_tp_mesh.py::test_eight_ranks_dp_sp_tp_and_hybrid_inside_tp`` on a pool process whose earlier test left a
    heartbeat running)."""
    _, port = server
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    hb = liveness.start(rank=0, world_size=2, timeout_s=None)
    try:
        assert hb is not None and hb.timeout_s is None and hb.interval_s == 2.0
        assert liveness.start(0, 2, 3) is hb and hb.timeout_s == 3 and hb.interval_s == pytest.approx(0.3)
        assert liveness.start(0, 2, 60) is hb and hb.timeout_s == 60 and hb.interval_s == pytest.approx(0.3)
    finally:
        for _ in range(3):
            hb.release()
    assert liveness.active() is None
