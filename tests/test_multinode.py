"""Multi-node layout: SP and Ulysses groups follow node boundaries by default (consecutive ranks,
numbered node by node), and a layout that crosses them is explained. No process group needed."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from seqpar.runtime.groups import node_layout_problems, rank_grid

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("world,sp,u,node", [(16, 4, 1, 8), (16, 8, 4, 8), (16, 16, 8, 8), (8, 2, 2, 4),
                                             (4, 2, 1, None), (4, 4, 2, 4)])
def test_good_layouts_are_silent_and_stay_in_nodes(world, sp, u, node):
    assert node_layout_problems(world, sp, u, node) == []
    if node and sp <= node:  # every SP group lies inside one node
        for row in rank_grid(world, sp).tolist():
            assert len({r // node for r in row}) == 1, row


def test_sp_group_straddling_nodes_is_explained():
    (problem,) = node_layout_problems(12, 6, 1, 4)
    assert "sequence_parallel.size 6" in problem and "4 ranks per node" in problem
    nodes_of_group_1 = {r // 4 for r in rank_grid(12, 6).tolist()[0]}
    assert nodes_of_group_1 == {0, 1}  # the problem the message describes is real


def test_ulysses_across_nodes_is_explained():
    (problem,) = node_layout_problems(16, 16, 16, 8)
    assert "ulysses_size 16" in problem and "divisor of 8" in problem


# ---------------------------------------------------------------------------- two local "nodes"
def _run_main(rank: int, world: int, argv: list[str]) -> list[float]:
    from launch_module import run_main

    return run_main(argv)["loss"]


def test_two_nodes_sp2_dp2_match_one_four_rank_run(dist_pool, tmp_path):
    """Two torchrun agents (c10d rendezvous on localhost, 2 ranks each) train SP=2 x DP=2: each SP group
    lies inside one "node", the DP reduce crosses them; losses equal one 4-rank run's."""
    from seqpar.testing.ranks import free_port

    cfg = json.loads((ROOT / "configs" / "fsdp_ring.json").read_text())
    cfg["train"]["eval_samples"] = 0
    cfg["sequence_parallel"]["timeout_s"] = 60
    config = tmp_path / "cfg.json"
    config.write_text(json.dumps(cfg))
    argv = ["--config", str(config), "--sp-size", "2", "--seq-len", "128", "--steps", "3", "--no-progress",
            "--log-level", "WARNING"]
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    agents = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
             "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
             "--rdzv-id", f"multinode-{port}", "--max-restarts", "0", str(ROOT / "launch" / "train.py"), *argv,
             *(["--metrics-out", str(tmp_path / "metrics.json")] if node == 0 else [])],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
        for node in (0, 1)
    ]
    outputs = []
    try:
        for agent in agents:
            outputs.append(agent.communicate(timeout=300)[0])
    finally:
        for agent in agents:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()
    assert all(a.returncode == 0 for a in agents), "\n".join(o[-2000:] for o in outputs)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert (metrics["world_size"], metrics["sp_size"], metrics["dp_size"]) == (4, 2, 2), metrics
    ref = dist_pool.run(4, _run_main, argv, timeout=300)[0]
    assert len(ref) == 3
    for a, b in zip(metrics["loss"], ref, strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (metrics["loss"], ref)
