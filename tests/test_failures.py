"""Failures end cleanly: atomic checkpoints, and resume after a crash.

A save is written as ``<tag>.tmp`` by every rank and renamed by rank 0 once all are done
(:mod:`seqpar.checkpoint`). A rank killed during a save can therefore leave only a ``.tmp`` directory
(or, killed between the write and the marker, a directory without ``COMPLETE``); ``--resume`` must
skip both and continue from the last complete checkpoint with the losses of an uninterrupted run.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from launch_module import train_module

from seqpar import checkpoint

ROOT = Path(__file__).resolve().parents[1]
SHORT = ["--seq-len", "128", "--no-progress", "--log-level", "WARNING"]


def _train_module() -> Any:
    return train_module()


def _run_main(rank: int, world: int, argv: list[str]) -> list[float]:
    return _train_module().main(argv)["loss"]


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


@pytest.mark.parametrize("config", ["fsdp_ring.json"])
def test_resume_after_crash_during_save_matches_uninterrupted(dist_pool, tmp_path, config):
    argv = ["--config", str(ROOT / "configs" / config), *SHORT, "--save-dir", str(tmp_path),
            "--save-every", "1"]
    full = dist_pool.run(2, _run_main, [*argv[:-4], "--steps", "4"], timeout=240)[0]
    head = dist_pool.run(2, _run_main, [*argv, "--steps", "2"], timeout=240)[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step1", "step2"], "no .tmp left behind"
    _tear(tmp_path, 3)  # the run "died" while saving step 3
    tail = dist_pool.run(2, _run_main, [*argv, "--steps", "4", "--resume"], timeout=240)[0]
    assert len(head) == 2 and len(tail) == 2, (head, tail)
    assert head + tail == full, f"resumed {head + tail} vs uninterrupted {full}"


# ---------------------------------------------------------------------------- two local "nodes"
TIMEOUT_S = 5
MARGIN_S = 60  # process start-up and rendezvous on a loaded 2-core machine; the bound is what matters


def _agent(node: int, port: int, victim: int, how: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
           "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
           "--rdzv-id", f"failures-{port}", "--max-restarts", "0", "--monitor-interval", "0.5",
           str(ROOT / "tests" / "failure_worker.py"), "--victim", str(victim), "--how", how,
           "--timeout-s", str(TIMEOUT_S)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)  # own process group: killpg cleans up everything


@pytest.mark.parametrize("how", ["kill", "stop", "raise"])
def test_lost_rank_ends_every_node(how):
    from seqpar.ranks import free_port

    port = free_port()
    victim = 3  # node 1's second rank; its SP peer (rank 2) waits in the ring, node 0 in the DP reduce
    agents = [_agent(node, port, victim, how) for node in (0, 1)]
    outputs = []
    try:
        for agent in agents:
            try:
                out, _ = agent.communicate(timeout=TIMEOUT_S + MARGIN_S + 60)
            except subprocess.TimeoutExpired:
                pytest.fail(f"{how}: an agent was still running after {TIMEOUT_S + MARGIN_S + 60} s (a hang)")
            outputs.append(out)
    finally:
        for agent in agents:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(agent.pid, signal.SIGKILL)  # no zombies, whatever happened
            agent.wait()
    for node, out in enumerate(outputs):  # kept for a reader of a failure
        (Path(os.environ.get("SEQPAR_FAILURE_LOGS", "/tmp")) / f"seqpar-failure-{how}-node{node}.log").write_text(out)
    joined = "\n".join(outputs)
    assert f"{how} at step 3" in joined, joined[-3000:]
    assert all(agent.returncode != 0 for agent in agents), ([a.returncode for a in agents], joined[-3000:])
    # node 0 lost no rank itself: one of its ranks must have failed on its own (not just been torn down
    # by its agent), with gloo naming the timeout (a stalled peer) or the closed connection (a dead one)
    why = "Timed out waiting" if how == "stop" else "Timed out waiting|Connection (closed|reset) by peer"
    assert re.search(rf"\[rank[01]\]: RuntimeError: .*({why})", outputs[0]), outputs[0][-3000:]
