"""Soak checks that fit CI: repeated init_process_groups / destroy cycles in one process leak no
process groups, threads or open files, a short smoke of the soak command, and a 300-step packed
soak of a tiny model (a different document mix every step: the per-batch caches must stay flat).
The 300-step soak of the shipped model runs by hand (``python launch/soak.py``); its figures are in
BENCHMARKS.md."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import torch
import torch.distributed as dist
from launch_module import train_module

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
        # the first cycle may warm lazily created state (or still see sockets of groups an earlier task left,
        # closing as it starts): no later cycle ends above it, and every later one ends where the second did
        assert all(s[k] <= seen[0][k] for s in seen[1:] for k in s), (rank, seen)
        assert all(s == seen[1] for s in seen[2:]), (rank, seen)


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


PACKED_STEPS, PACKED_CHECK_AT, PACKED_WINDOW = 300, 20, 20
# one step's boundary tensors: up to 11 int64 entries (10 documents of >= 9 tokens in 96) in a few
# tensors (cu_seq_lens_q/k and their shards' plans); measured: readings vary in steps of 8 bytes
# over ~50 bytes. A leak of one int64 per step adds 2 KB over the 260 steps between the windows.
PACKED_SLACK = 512


def _packed_config(tmp: Path) -> Path:
    """configs/fsdp_ring.json with a tiny model and a short recall task: 300 steps stay cheap."""
    import json

    raw = json.loads((ROOT / "configs" / "fsdp_ring.json").read_text())
    raw["model"] = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                    "num_attention_heads": 2, "num_key_value_heads": 1}
    raw["train"].update(num_pairs=2, num_queries=1, num_keys=4, num_values=4, filler_vocab=4, eval_samples=0)
    path = tmp / "packed_soak.json"
    path.write_text(json.dumps(raw))
    return path


def test_packed_soak_keeps_tensor_bytes_flat(dist_pool, tmp_path):
    """300 steps of packed rows (DataCollatorWithFlattening-style, documents of long-tailed lengths,
    a different mix every step): the per-batch boundary plans and caches must not accumulate. Each
    step's own boundary tensors vary with its document count, so the live tensor bytes of steps
    281-300 may exceed the largest of steps 20-39 by at most :data:`PACKED_SLACK`, and groups,
    threads and files are those of step 20."""
    argv = ["--config", str(_packed_config(tmp_path)), "--packed", "--seq-len", "96", "--no-progress",
            "--log-level", "WARNING"]
    # the document mixes really vary (lengths of each step's row, as launch/train.py draws them)
    train = train_module()
    task = train.RecallTask(train.TrainSettings(seq_len=96, num_pairs=2, num_queries=1, num_keys=4, num_values=4,
                                                filler_vocab=4, packed=True))
    mixes = {tuple(task.packed_lengths(step)) for step in range(PACKED_STEPS)}
    assert len(mixes) >= 100 and len({len(m) for m in mixes}) >= 3, sorted(mixes)[:10]
    for rank, out in enumerate(dist_pool.run(2, _packed_soak, argv, timeout=600)):
        assert len(out["loss"]) == PACKED_STEPS
        assert len(out["early"]) == len(out["late"]) == PACKED_WINDOW and min(out["early"]) > 0
        assert not _soak_module().grown(out, PACKED_SLACK), (rank, {k: v for k, v in out.items() if k != "loss"})


def _soak_module():  # noqa: ANN202
    import importlib.util
    import sys

    if "seqpar_launch_soak" not in sys.modules:
        spec = importlib.util.spec_from_file_location("seqpar_launch_soak", ROOT / "launch" / "soak.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return sys.modules["seqpar_launch_soak"]


def _packed_soak(rank: int, world: int, argv: list[str]) -> dict:
    return _soak_module().soak(PACKED_STEPS, PACKED_CHECK_AT, argv, window=PACKED_WINDOW)
