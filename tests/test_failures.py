"""Failures end cleanly: atomic checkpoints, resume after a crash, lost ranks named, no process left.

A save is written as ``<tag>.tmp`` by every rank and renamed by rank 0 once all are done
(:mod:`seqpar.runtime.checkpoint`). A rank killed during a save can therefore leave only a ``.tmp`` directory
(or, killed between the write and the marker, a directory without ``COMPLETE``); ``--resume`` must
skip both and continue from the last complete checkpoint with the losses of an uninterrupted run.
A rank lost mid-step (killed, stopped, raising) must end every other rank, with a message naming it
or the timeout (:mod:`seqpar.runtime.liveness`), within a bound, and leave no process (alive or zombie) behind.

Every process a test starts carries ``SEQPAR_TEST_RUN=<token>`` in its environment (torchrun passes
its environment to the workers, which run in sessions of their own), so the test finds them all.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from launch_module import run_main, train_module

from seqpar.runtime import checkpoint

ROOT = Path(__file__).resolve().parents[1]
SHORT = ["--seq-len", "128", "--no-progress", "--log-level", "WARNING"]


def _train_module() -> Any:
    return train_module()


def _run_main(rank: int, world: int, argv: list[str]) -> list[float]:
    return run_main(argv)["loss"]


def _tear(save_dir: Path, step: int) -> None:
    """What a rank killed in the middle of saving ``step`` leaves: a staging directory with a
    truncated file, and (killed after an older engine's write, before the marker) a ``step<N>`` with
    no marker."""
    tmp = Path(checkpoint.staging_dir(str(save_dir), f"step{step}"))
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "__0_0.distcp").write_bytes(b"\x00torn")
    torn = save_dir / f"step{step + 1}"
    torn.mkdir(exist_ok=True)
    (torn / ".metadata").write_bytes(b"\x00torn")


def test_latest_complete_skips_torn_saves(tmp_path):
    for step in (1, 2):
        os.makedirs(checkpoint.staging_dir(str(tmp_path), f"step{step}"))
        checkpoint.commit(str(tmp_path), f"step{step}")
    _tear(tmp_path, 3)
    assert checkpoint.latest_complete(str(tmp_path)) == "step2"
    assert (tmp_path / "latest").read_text() == "step2"
    assert checkpoint.latest_complete(str(tmp_path / "missing")) is None
    os.makedirs(checkpoint.staging_dir(str(tmp_path), "step2"))  # a re-save of step 2 replaces it
    checkpoint.commit(str(tmp_path), "step2")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step1", "step2", "step3.tmp", "step4"]


class _Crash(Exception):
    """A process killed at this point of a save."""


def _stage(save_dir: Path, tag: str, content: str) -> None:
    tmp = Path(checkpoint.staging_dir(str(save_dir), tag))
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "weights").write_text(content)


def _weights(save_dir: Path) -> tuple[str | None, str | None]:
    tag = checkpoint.latest_complete(str(save_dir))
    return tag, None if tag is None else (save_dir / tag / "weights").read_text()


def test_resave_leaves_a_complete_step_at_every_crash_point(tmp_path, monkeypatch):
    """Re-saving step 2 and killed before any rename or delete of the commit: step 2 stays loadable
    (the old copy or the new one), and the next save of it completes and leaves no copy aside."""
    crash_at, crashed = 0, True
    while crashed:
        save_dir = tmp_path / f"crash{crash_at}"
        for tag, content in (("step1", "one"), ("step2", "two-old")):
            _stage(save_dir, tag, content)
            checkpoint.commit(str(save_dir), tag)
        _stage(save_dir, "step2", "two-new")
        calls = []

        def fail_at(original, crash_at=crash_at, calls=calls):
            def op(*args, **kwargs):
                calls.append(args[0])
                if len(calls) - 1 == crash_at:
                    raise _Crash(crash_at)
                return original(*args, **kwargs)
            return op

        with monkeypatch.context() as m:
            m.setattr(os, "replace", fail_at(os.replace))
            m.setattr(shutil, "rmtree", fail_at(shutil.rmtree))
            try:
                checkpoint.commit(str(save_dir), "step2")
                crashed = False
            except _Crash:
                pass
        tag, content = _weights(save_dir)
        assert checkpoint.step_of(tag.removesuffix(".old")) == 2 and content in ("two-old", "two-new"), (
            f"killed at file operation {crash_at} ({calls[-1]}) of a re-save: latest complete is {tag} "
            f"holding {content!r}, step 2 was lost ({sorted(p.name for p in save_dir.iterdir())})"
        )
        _stage(save_dir, "step2", "two-again")  # the resumed job saves step 2 once more
        checkpoint.commit(str(save_dir), "step2")
        assert _weights(save_dir) == ("step2", "two-again")
        assert sorted(p.name for p in save_dir.iterdir()) == ["latest", "step1", "step2"], crash_at
        crash_at += 1
    assert crash_at >= 3  # the commit renames aside, renames in and deletes: each point was hit


# ---------------------------------------------------------------------------- processes of a test
def _token_env(token: str) -> dict[str, str]:
    return {**os.environ, "SEQPAR_TEST_RUN": token, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _stat(pid: str) -> tuple[str, int, int] | None:
    """(state, parent pid, session id) of a process, None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[1]), int(fields[3])


def _processes_of(token: str, sessions: set[int]) -> dict[int, str]:
    """pid -> state of every process left from a test: those whose environment carries the token,
    those in the sessions given (the agents'), and zombies whose parent is this process or one of them."""
    marked = f"SEQPAR_TEST_RUN={token}".encode()
    found: dict[int, str] = {}
    zombies: list[tuple[int, int]] = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        st = _stat(pid)
        if st is None or int(pid) == os.getpid():
            continue
        state, ppid, sid = st
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes()  # empty for a zombie
        except OSError:
            env = b""
        if marked in env.split(b"\0") or sid in sessions:
            found[int(pid)] = state
        elif state == "Z":
            zombies.append((int(pid), ppid))
    found.update({pid: "Z" for pid, ppid in zombies if ppid == os.getpid() or ppid in found})
    return found


def _assert_none_left(token: str, agents: list[subprocess.Popen], bound_s: float = 15.0) -> None:
    """Wait (bounded) until no process of the test is left, alive or zombie; kill what is left
    regardless, then fail naming it."""
    sessions = {a.pid for a in agents}
    deadline = time.monotonic() + bound_s
    left = _processes_of(token, sessions)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = _processes_of(token, sessions)
    _kill_all(token, agents)
    assert not left, f"processes left {bound_s:.0f} s after the agents ended (pid: state): {left}"


def _kill_all(token: str, agents: list[subprocess.Popen]) -> None:
    for agent in agents:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(agent.pid, signal.SIGKILL)
    for pid in _processes_of(token, {a.pid for a in agents}):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    for agent in agents:
        if agent.poll() is None:
            agent.kill()
        agent.wait()


def _signal_all(token: str, sig: signal.Signals) -> None:
    for pid in _processes_of(token, set()):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _late_exec(token: str) -> list[str]:
    # A child whose environment shows the token only after a delay, as a loaded machine can make it: Popen
    # returns once the child's exec has begun, and its new environment becomes readable in /proc a moment later.
    return ["sh", "-c", f"sleep 0.3; exec env SEQPAR_TEST_RUN={token} sleep 60"]


@pytest.mark.parametrize("late", [False, True], ids=["sleep", "late-exec"])
def test_process_scan_sees_live_and_zombie_processes(late):
    """The leftover check can fail: it finds a marked process, then its zombie until it is reaped."""
    token = uuid.uuid4().hex
    command = _late_exec(token) if late else ["sleep", "60"]
    child = subprocess.Popen(command, env=_token_env(token) if not late else None, start_new_session=True)
    try:
        # Seen once the child's exec is done (bounded wait: under load that takes a while after Popen).
        deadline = time.monotonic() + 10
        while _processes_of(token, set()).get(child.pid) is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _processes_of(token, set()).get(child.pid) in ("R", "S", "D")  # D: paging in under load
        os.kill(child.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while _processes_of(token, set()).get(child.pid) != "Z" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _processes_of(token, set()) == {child.pid: "Z"}  # not reaped yet: a zombie of ours
    finally:
        _kill_all(token, [child])
    assert _processes_of(token, {child.pid}) == {}


def _torchrun(token: str, args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--max-restarts", "0",
                             "--monitor-interval", "0.5", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=_token_env(token),
                            start_new_session=True)  # its own session: killpg reaches the agent


def _communicate(agent: subprocess.Popen, timeout: float, what: str) -> str:
    try:
        return agent.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        pytest.fail(f"{what}: still running after {timeout:.0f} s (a hang)")


# ---------------------------------------------------------------------------- a real kill during save
_STEP_LOSS = re.compile(r"step (\d+)/\d+: loss (\S+)")


@pytest.mark.parametrize("config", ["fsdp_ring.json", "deepspeed_ring.json"])
def test_rank_killed_during_save_resumes_from_last_complete(dist_pool, tmp_path, config):
    """Rank 1 is SIGKILLed once its files of step 3 are on disk (tests/save_crash_worker.py: DCP's
    shards under FSDP2, its ZeRO-2 optimizer partition under DeepSpeed): the job ends, step 3 stays a
    ``.tmp``, and ``--resume`` continues from step 2 with the losses of an uninterrupted run."""
    argv = ["--config", str(ROOT / "configs" / config), *SHORT, "--save-dir", str(tmp_path),
            "--save-every", "1"]
    token = uuid.uuid4().hex
    crash = _torchrun(token, ["--standalone", "--nproc-per-node", "2", str(ROOT / "tests" / "save_crash_worker.py"),
                              "--kill-rank", "1", "--kill-at-step", "3", "--",
                              *[a if a != "WARNING" else "INFO" for a in argv], "--steps", "4"])
    try:
        out = _communicate(crash, 300, "the crashing run")
        _assert_none_left(token, [crash])
    finally:
        _kill_all(token, [crash])
    assert "rank 1: SIGKILL while saving step 3 (written: " in out and crash.returncode != 0, out[-3000:]
    head = [float(loss) for _, loss in sorted((int(s), v) for s, v in _STEP_LOSS.findall(out))]
    assert len(head) == 3, out[-3000:]  # step 3 trained; its checkpoint died half-written
    # (DeepSpeed also copies its recovery script, zero_to_torch.py, beside the checkpoints)
    kept = sorted(p.name for p in tmp_path.iterdir() if p.is_dir() or p.name == "latest")
    assert kept == ["latest", "step1", "step2", "step3.tmp"], kept
    assert any((tmp_path / "step3.tmp").iterdir()) and not (tmp_path / "step3.tmp" / checkpoint.MARKER).exists()
    assert checkpoint.latest_complete(str(tmp_path)) == "step2"

    tail = dist_pool.run(2, _run_main, [*argv, "--steps", "4", "--resume"], timeout=240)[0]
    full = dist_pool.run(2, _run_main, [*argv[:-4], "--steps", "4"], timeout=240)[0]
    assert len(tail) == 2, tail  # steps 3 and 4, from step 2's checkpoint
    assert head[:2] + tail == full, f"resumed {head[:2]} + {tail} vs uninterrupted {full}"
    assert head[2] == full[2]  # the step whose save died was trained as in the uninterrupted run


# ---------------------------------------------------------------------------- two local "nodes"
TIMEOUT_S = 5
MARGIN_S = 60  # process start-up and rendezvous on a loaded 2-core machine; the bound is what matters


def _agent(token: str, node: int, port: int, victim: int, how: str) -> subprocess.Popen:
    return _torchrun(token, ["--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(node),
                             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                             "--rdzv-id", f"failures-{port}", str(ROOT / "tests" / "failure_worker.py"),
                             "--victim", str(victim), "--how", how, "--timeout-s", str(TIMEOUT_S)])


# What node 0 must print (seqpar.runtime.liveness): the lost rank, its exception, or the timeout.
_DIAGNOSIS = {
    "kill": r"seqpar: rank [01]: a collective failed \(a peer's connection closed or failed\): "
            r"[^\n]*rank 3 was lost \(no heartbeat for [\d.]+ s; killed, preempted or stopped\)",
    "stop": r"seqpar: rank [01]: a collective timed out \(the timeout_s=5 elapsed\): "
            r"[^\n]*rank 3 was lost \(no heartbeat for [\d.]+ s; killed, preempted or stopped\)",
    "raise": r"seqpar: rank [01]: a collective failed [^\n]*"
             r"rank 3: RuntimeError: rank 3: injected failure in forward at step 3 \(an exception this rank recorded",
}


def _wait_listening(port: int, agent: subprocess.Popen, bound_s: float) -> None:
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline and agent.poll() is None:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    pytest.fail(f"node 0's agent did not open the rendezvous port {port} (exit code {agent.poll()})")


@pytest.mark.parametrize("how", ["kill", "stop", "raise"])
def test_lost_rank_ends_every_node(how):
    from seqpar.testing.ranks import free_port

    port = free_port()
    victim = 3  # node 1's second rank; its SP peer (rank 2) waits in the ring, node 0 in the DP reduce
    token = uuid.uuid4().hex
    bound = TIMEOUT_S + MARGIN_S + 60
    # node 0's agent hosts the rendezvous store, as on real nodes (the endpoint names node 0): on one
    # host either agent could win the port, and a store that leaves with node 1 tears node 0 down too
    agents = [_agent(token, 0, port, victim, how)]
    try:
        _wait_listening(port, agents[0], bound)
        agents.append(_agent(token, 1, port, victim, how))
        outputs = [_communicate(agents[0], bound, f"{how}: node 0")]
        if how == "stop":
            # node 0 ended on its own; node 1's agent now waits 30 s before it SIGKILLs a stopped
            # process that ignores its SIGTERM. Resuming the victim lets that SIGTERM act at once.
            _signal_all(token, signal.SIGCONT)
        outputs.append(_communicate(agents[1], bound, f"{how}: node 1"))
        _assert_none_left(token, agents)
    finally:
        _kill_all(token, agents)  # whatever happened
    for node, out in enumerate(outputs):  # kept for a reader of a failure
        (Path(os.environ.get("SEQPAR_FAILURE_LOGS", "/tmp")) / f"seqpar-failure-{how}-node{node}.log").write_text(out)
    joined = "\n".join(outputs)
    assert f"{how} at step 3" in joined, joined[-3000:]
    assert all(agent.returncode != 0 for agent in agents), ([a.returncode for a in agents], joined[-3000:])
    # node 0 lost no rank itself: one of its ranks must have failed on its own (not just been torn down
    # by its agent), and said which rank was lost and how (or that the timeout elapsed)
    why = "Timed out waiting" if how == "stop" else "Timed out waiting|Connection (closed|reset) by peer"
    assert re.search(rf"\[rank[01]\]: RuntimeError: .*({why})", outputs[0]), outputs[0][-3000:]
    assert re.search(_DIAGNOSIS[how], outputs[0]), outputs[0][-3000:]
