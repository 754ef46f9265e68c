"""Soak checks that fit CI: repeated init_process_groups / destroy cycles in one process leak no
process groups, threads or open files, and a short smoke of the soak command. The 300-step soak
itself runs by hand (``python launch/soak.py``); its figures are in BENCHMARKS.md."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]


def _resources() -> dict[str, int]:
    # pg_map: every process group torch still holds on this rank (torch's own registry)
    return {
        "process_groups": len(dist.distributed_c10d._world.pg_map),
        "threads": threading.active_count(),
        "open_files": len(os.listdir("/proc/self/fd")),
    }


def _cycles(rank: int, world: int, n: int) -> list[dict[str, int]]:
    from seqpar.runtime.groups import default_manager, destroy_process_groups, init_process_groups

    seen = []
    for i in range(n + 1):
        manager = init_process_groups(sp_size=2, ulysses_size=2 if i % 2 else 1)
        dist.all_reduce(torch.ones(1), group=manager.sp_group)  # the groups are used, not just made
        assert not manager.owns_world  # the pool created the world group: it must survive
        destroy_process_groups()
        assert default_manager() is None and dist.is_initialized()
        seen.append(_resources())
    return seen


def test_init_destroy_cycles_leak_nothing(dist_pool):
    for rank, seen in enumerate(dist_pool.run(2, _cycles, 5, timeout=120)):
        # the first cycle may warm lazily created state; every later one must end where it did
        assert all(s == seen[0] for s in seen[1:]), (rank, seen)


def _soak_smoke(rank: int, world: int, argv: list[str]) -> dict:
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("seqpar_launch_soak", ROOT / "launch" / "soak.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.soak(4, 2, argv)


def test_soak_command_smoke(dist_pool):
    argv = ["--config", str(ROOT / "configs" / "fsdp_ring.json"), "--seq-len", "128", "--no-progress",
            "--log-level", "WARNING"]
    for rank, out in enumerate(dist_pool.run(2, _soak_smoke, argv, timeout=240)):
        assert len(out["loss"]) == 4
        for point in ("at_check", "at_end"):
            assert out[point]["live_tensor_bytes"] > 0 and out[point]["process_groups"] > 0, (rank, out)
        # steady state from step 2 on: the same tensors, groups, threads and files at step 4
        assert out["at_check"] == out["at_end"], (rank, out)
