"""Soak: train for many steps and check that nothing grows (live tensors, process groups, threads, files).

    torchrun --nproc_per_node 2 launch/soak.py --steps 300 --check-at 20 --out soak.json -- \\
        --config configs/fsdp_ring.json --sp-size 2

Arguments after ``--`` go to launch/train.py (``--steps`` is set from ``--steps`` here). At step
``--check-at`` and at the last step every rank records the bytes of all live tensor storages (a
``gc`` scan after ``gc.collect()``, via seqpar.memory.tracker; RSS is too noisy to judge by), torch's count
of process groups, threads and open file descriptors. Exit status 1 when any of them differs between
the two points on any rank. Rank 0 prints (and with ``--out`` writes) the figures per rank.

Packed batches (``--packed``) hold a different document mix every step, so the live bytes at one
step include that step's boundary tensors, whose size varies with its document count. With
``--window N`` the tensor bytes are judged over N steps from ``--check-at`` and the last N steps
instead: growth is the last window's largest reading above the first window's largest by more
than ``--slack-bytes`` (what one batch's boundary tensors can vary: a few int64 per document).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import sys
import threading
import warnings
from typing import Any

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))


def live_tensor_bytes() -> int:
    """Bytes of every distinct tensor storage reachable in this process."""
    from seqpar.memory.tracker import tensor_storages

    gc.collect()
    seen: dict[tuple[int, str], int] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            try:
                if not isinstance(obj, torch.Tensor):
                    continue
            except Exception:  # noqa: BLE001 - exotic proxies may raise on isinstance
                continue
            for st in tensor_storages(obj):
                seen[(st.data_ptr(), str(st.device))] = st.nbytes()
    return sum(seen.values())


def resources() -> dict[str, int]:
    return {
        "live_tensor_bytes": live_tensor_bytes(),
        "process_groups": len(dist.distributed_c10d._world.pg_map) if dist.is_initialized() else 0,
        "threads": threading.active_count(),
        "open_files": len(os.listdir("/proc/self/fd")),
    }


def _train_module() -> Any:
    spec = importlib.util.spec_from_file_location("seqpar_launch_train", os.path.join(HERE, "train.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def soak(steps: int, check_at: int, train_argv: list[str], window: int = 0) -> dict[str, Any]:
    """Run the training; returns ``{"at_check": {...}, "at_end": {...}, "loss": [...]}`` on every rank,
    and with ``window`` > 0 ``"early"`` / ``"late"``: the live tensor bytes after each of the
    ``window`` steps from ``check_at`` and after each of the last ``window`` steps."""
    if not 1 <= check_at < steps:
        raise ValueError(f"--check-at {check_at} must be in [1, --steps {steps})")
    if window < 0 or (window and check_at + window > steps - window + 1):
        raise ValueError(f"--window {window}: the two windows must fit apart in --steps {steps} from --check-at")
    seen: dict[str, Any] = {"early": [], "late": []} if window else {}

    def on_step(step: int) -> None:
        if step == check_at:
            seen["at_check"] = resources()
        elif step == steps:
            seen["at_end"] = resources()
        if window and check_at <= step < check_at + window:
            seen["early"].append(live_tensor_bytes())
        elif window and step > steps - window:
            seen["late"].append(live_tensor_bytes())

    metrics = _train_module().main([*train_argv, "--steps", str(steps)], on_step=on_step)
    return {**seen, "loss": metrics["loss"]}


def grown(figures: dict[str, Any], slack_bytes: int = 0) -> bool:
    """Whether a rank's figures (:func:`soak`'s) grew: any resource differs between the two points,
    or, with windows, the tensor bytes of the last window exceed the first window's largest by more
    than ``slack_bytes`` (the most one step's own batch tensors can vary)."""
    if "early" in figures:
        strip = ("live_tensor_bytes",)
        if max(figures["late"]) > max(figures["early"]) + slack_bytes:
            return True
        return any(figures["at_check"][k] != figures["at_end"][k] for k in figures["at_check"] if k not in strip)
    return figures["at_check"] != figures["at_end"]


def main() -> int:
    argv = sys.argv[1:]
    train_argv = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--check-at", type=int, default=20)
    p.add_argument("--window", type=int, default=0,
                   help="judge tensor bytes over this many steps at each end (packed batches vary per step)")
    p.add_argument("--slack-bytes", type=int, default=0,
                   help="with --window: how much one step's own batch tensors may vary")
    p.add_argument("--out", help="write every rank's figures here (rank 0)")
    args = p.parse_args(own)
    result = soak(args.steps, args.check_at, ["--no-progress", *train_argv], window=args.window)
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, {k: v for k, v in result.items() if k != "loss"})
    grown_on = [r for r, fig in enumerate(per_rank) if grown(fig, args.slack_bytes)]
    if dist.get_rank() == 0:
        report = {"steps": args.steps, "check_at": args.check_at, "per_rank": per_rank, "grown_on": grown_on,
                  "loss_first_last": [result["loss"][0], result["loss"][-1]]}
        print(json.dumps(report, indent=1), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    return 1 if grown_on else 0


if __name__ == "__main__":
    sys.exit(main())
