"""The training loop of ``launch/train.py``: each optimizer step (the static micro-steps, or a planned dynamic step),
its loss, the progress bar, the peak memory of one tracked step and the checkpoints, from a resumed step on."""

from __future__ import annotations

import logging
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from seqpar_launch.engines import Engine, packed_kwargs
from seqpar_launch.recall import RecallTask
from seqpar_launch.settings import Plan, TrainSettings

__all__ = ["LoopResult", "PeakMemory", "dp_mean", "dynamic_step", "static_micro_steps", "train_steps"]

logger = logging.getLogger("seqpar")


class PeakMemory:
    """Peak tensor memory of one tracked step (CUDA: the allocator's peak; CPU: every live tensor
    storage, counted by seqpar.memory.tracker in every setting: checkpointing, accumulation, tiling)."""

    def __init__(self, engine: Engine, settings: TrainSettings) -> None:
        self.kind = "unknown"
        self.value = 0
        self._tracker: Any = None
        self._engine = engine
        self._compiled = settings.compile

    def __enter__(self) -> PeakMemory:
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
            self.kind = "cuda_max_memory_allocated over the run"
            return self
        if self._compiled:  # the CPU tracker is a dispatch mode, under which dynamo compiles nothing
            self.kind = "not measured (train.compile: the CPU tensor tracker cannot run in compiled code)"
            return self
        from seqpar.memory.tracker import TensorMemoryTracker

        # what this job holds (model, optimizer, engine buffers) plus what the step allocates; not
        # other tensors of the process (a test's persistent ranks run several jobs in turn)
        self._tracker = TensorMemoryTracker("cpu", count_existing=False)
        self._tracker.track_reachable(self._engine)
        self._tracker.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if torch.cuda.is_available():
            self.value = int(torch.cuda.max_memory_allocated())
            return
        if self._tracker is None:
            return
        self._tracker.__exit__(*exc)
        self.value = int(self._tracker.peak)
        self.kind = "cpu tensor bytes at the peak of one tracked step (seqpar.memory.tracker)"


@dataclass
class LoopResult:
    """What :func:`train_steps` measured: one entry per step it ran."""

    losses: list[float] = field(default_factory=list)
    """Each step's loss (global: the mean over DP replicas of the SP group's loss), the same on every rank."""
    step_seconds: list[float] = field(default_factory=list)
    """Each step's wall time on this rank."""
    memory: PeakMemory | None = None
    """The peak memory of the tracked step (the second step run, or the only one)."""


def static_micro_steps(engine: Engine, plan: Plan, task: RecallTask, manager: Any, step: int) -> torch.Tensor:
    """One step's ``train.grad_accum`` micro-steps over this rank's samples (the update at the last micro-step);
    returns this rank's step loss, the mean over micro-steps of the SP group's loss (a float64 scalar; the DP mean
    is :func:`dp_mean`'s)."""
    from seqpar.sequence.batch import shard_batch
    from seqpar.sequence.loss import sequence_parallel_loss

    t = plan.train
    total = torch.zeros((), dtype=torch.float64)
    for m in range(t.grad_accum):
        first = ((step * t.grad_accum + m) * manager.dp_size + manager.dp_rank) * t.micro_batch_size
        full = task.packed_batch(first) if t.packed else task.batch(first, t.micro_batch_size)
        batch = shard_batch(full, group=manager.sp_group, sharding=plan.sp.sharding)
        # The swapped model computes the SP loss itself: never the logits with a tiled loss, and
        # with its router losses (MoE, output_router_logits) added over the whole sequence.
        if plan.sp.tiled_loss or plan.model.get("output_router_logits"):
            loss = engine.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                                shift_labels=batch["shift_labels"], **packed_kwargs(batch)).loss
        else:
            logits = engine.forward(batch)
            loss = sequence_parallel_loss(logits, batch["shift_labels"], group=manager.sp_group)
        engine.backward(loss, last_micro=m == t.grad_accum - 1)
        total += loss.detach().double() / t.grad_accum
    return total


def dp_mean(total: torch.Tensor, manager: Any) -> float:
    """The static step's loss: :func:`static_micro_steps`' per-rank loss averaged over the DP replicas."""
    dist.all_reduce(total, group=manager.dp_group)
    return total.item() / manager.dp_size


def dynamic_step(engine: Engine, plan: Plan, task: RecallTask, manager: Any, step: int) -> float:
    """One step of length-aware dynamic CP (``train.dynamic``); returns the step's loss (the per-token mean
    over the pool's step, the same on every rank).

    The step's documents are those of the ``grad_accum x dp`` packed rows a static run trains on in this step;
    every rank plans them alike and cuts its micro-batches (``seqpar.sequence.dynamic_step.plan_step``), and
    ``seqpar.integrations.dynamic.run_dynamic_step`` runs them (each loss times dp, one reduction per step; the
    step's accumulation is not the engine's ``grad_accum``), then ``engine.update`` clips, updates and zeroes
    once."""
    from seqpar.integrations.dynamic import run_dynamic_step
    from seqpar.sequence.dynamic_step import plan_step

    rows = plan.train.grad_accum * manager.dp_size
    docs = [doc for row in range(step * rows, (step + 1) * rows) for doc in task.packed_docs(row)]
    planned = plan_step([ids for ids, _ in docs], manager, plan.sp.dynamic, labels=[labels for _, labels in docs],
                        sharding=plan.sp.sharding)
    return run_dynamic_step(engine.model, planned, deepspeed=plan.engine == "deepspeed", update=engine.update).item()


def train_steps(engine: Engine, plan: Plan, task: RecallTask, manager: Any, *, start: int, save_dir: str | None,
                progress: bool, on_step: Any = None) -> LoopResult:
    """Steps ``start .. train.steps - 1``; saves every ``train.save_every`` steps and at the end when ``save_dir`` is
    given; ``on_step(done)`` after each step on every rank. Raises FloatingPointError on a non-finite loss."""
    t = plan.train
    rank0 = manager.rank == 0
    global_batch = t.micro_batch_size * t.grad_accum * manager.dp_size
    bar = None
    if rank0 and progress:
        from tqdm import tqdm

        bar = tqdm(total=t.steps, initial=start, desc=f"{plan.engine} sp{manager.sp_size}",
                   dynamic_ncols=True, file=sys.stderr)
    result = LoopResult(memory=PeakMemory(engine, t))
    track_step = min(start + 1, t.steps - 1)
    for step in range(start, t.steps):
        engine.model.train()
        tic = time.perf_counter()
        tracking = step == track_step
        if tracking:
            result.memory.__enter__()
        if t.dynamic:  # the planned micro-batches replace the static grad_accum micro-steps
            step_loss = dynamic_step(engine, plan, task, manager, step)
        else:
            total = static_micro_steps(engine, plan, task, manager, step)
        if tracking:
            result.memory.__exit__(None, None, None)
        if not t.dynamic:  # outside the tracked step, as the reduction is no part of its memory
            step_loss = dp_mean(total, manager)
        result.losses.append(step_loss)
        result.step_seconds.append(time.perf_counter() - tic)
        if not math.isfinite(step_loss):
            raise FloatingPointError(f"step {step}: loss is {step_loss}; lower the learning rate")
        if bar is not None:
            timed = result.step_seconds[1:] or result.step_seconds
            tps = global_batch * t.seq_len * len(timed) / sum(timed)
            bar.set_postfix(loss=f"{step_loss:.4f}", tok_s=f"{tps:.0f}")
            bar.update(1)
        elif rank0:  # --no-progress: a log line per step instead (repr: the exact value, for comparisons)
            logger.info("step %d/%d: loss %r", step + 1, t.steps, step_loss)
        done = step + 1
        if on_step is not None:
            on_step(done)
        if save_dir and ((t.save_every and done % t.save_every == 0) or done == t.steps):
            engine.save(save_dir, done)
    if bar is not None:
        bar.close()
    return result
