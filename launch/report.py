"""What ``launch/train.py`` reports: its log lines (rank 0 at INFO, the others from WARNING), the metrics of a run
(``--metrics-out``'s JSON: per-step loss, tokens/s, peak memory per rank, recall accuracy and the run's settings) and
the summary rank 0 prints at the end."""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

import torch.distributed as dist
from seqpar_launch.loop import LoopResult
from seqpar_launch.model import config_class
from seqpar_launch.settings import Plan

__all__ = ["all_gather", "configure_logging", "run_metrics", "summary", "write_metrics"]


def configure_logging(level: str) -> None:
    """The ``seqpar`` logger, its lines prefixed with the rank (``RANK`` before the process group exists)."""
    rank = int(os.environ.get("RANK", "0"))
    if dist.is_available() and dist.is_initialized():
        rank = dist.get_rank()
    log = logging.getLogger("seqpar")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"[rank {rank}] %(levelname)s %(message)s"))
        log.addHandler(handler)
    # Only rank 0 talks at INFO; others warn and worse.
    log.setLevel(getattr(logging, level.upper()) if rank == 0 else logging.WARNING)


def all_gather(obj: Any) -> list[Any]:
    """``obj`` of every rank, in rank order."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def run_metrics(plan: Plan, manager: Any, result: LoopResult, *, start: int, n_params: int,
                recall_accuracy: float | None) -> dict[str, Any]:
    """The metrics of the run (the same on every rank; ``peak_mem_bytes`` gathered from every rank)."""
    t = plan.train
    global_batch = t.micro_batch_size * t.grad_accum * manager.dp_size
    step_times = result.step_seconds
    # Steady-state throughput: the first step of a run pays for lazy init and warm-up.
    timed = step_times[1:] if len(step_times) > 1 else step_times
    tokens_per_s = global_batch * t.seq_len * len(timed) / max(sum(timed), 1e-9)
    mem = result.memory
    if mem.kind == "unknown":  # no step ran (resumed at the end)
        mem.kind = "not measured (no training step ran)"
    return {
        "loss": result.losses,
        "start_step": start,
        "steps": t.steps,
        "tokens_per_s": tokens_per_s,
        "step_seconds": step_times,
        "train_seconds": sum(step_times),
        "peak_mem_bytes": all_gather(mem.value),
        "peak_mem_kind": mem.kind,
        "recall_accuracy": recall_accuracy,
        "global_batch": global_batch,
        "engine": plan.engine,
        "world_size": manager.world_size,
        "sp_size": manager.sp_size,
        "dp_size": manager.dp_size,
        "mode": plan.sp.mode,
        "sharding": manager.sharding or "contiguous",  # the declared one, else the undeclared default
        "seq_len": t.seq_len,
        "dtype": t.dtype,
        "grad_accum": t.grad_accum,
        "activation_checkpointing": t.activation_checkpointing,
        "n_params": n_params,
    }


def summary(plan: Plan, manager: Any, metrics: dict[str, Any], n_params: int) -> str:
    """The run in a few lines (rank 0 prints it to stderr at the end)."""
    losses = metrics["loss"]
    mem = ", ".join(f"{b / 2**20:.1f}" for b in metrics["peak_mem_bytes"])
    lines = [
        "=" * 72,
        f"seqpar train: {plan.engine} | world {manager.world_size} = dp {manager.dp_size} x "
        f"sp {manager.sp_size} | mode {plan.sp.mode} | sharding {manager.sharding or 'contiguous'}",
        f"model: {config_class(plan.model).model_type} {n_params / 1e6:.2f} M params ({plan.model or 'default sizes'}) | dtype "
        f"{plan.train.dtype} | activation checkpointing {plan.train.activation_checkpointing}",
        f"data: recall, seq_len {plan.train.seq_len}, {metrics['global_batch']} samples/step "
        f"(micro {plan.train.micro_batch_size} x accum {plan.train.grad_accum} x dp {manager.dp_size})",
        f"steps {metrics['start_step']}..{metrics['steps']}: loss {losses[0]:.4f} -> {losses[-1]:.4f}"
        if losses else "no steps run",
        f"throughput: {metrics['tokens_per_s']:.0f} tokens/s | wall {metrics['train_seconds']:.1f} s",
        f"peak memory per rank (MiB): {mem} [{metrics['peak_mem_kind']}]",
    ]
    if metrics.get("recall_accuracy") is not None:
        lines.append(
            f"recall accuracy on {plan.train.eval_samples} held-out samples: "
            f"{metrics['recall_accuracy']:.3f} (chance 1/{plan.train.num_values} = "
            f"{1 / plan.train.num_values:.4g})"
        )
    lines.append("=" * 72)
    return "\n".join(lines)


def write_metrics(path: str, metrics: dict[str, Any]) -> None:
    """``metrics`` as JSON at ``path`` (its folder made if missing)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(metrics, f, indent=1)
