"""Run benchmark bodies on P ranks and time them the same way for every method.

- :class:`RankPool` starts P worker processes once (gloo on CPU, NCCL when there is a GPU per rank),
  each with ``torch.set_num_threads(threads)`` (1 by default: one core per rank), and runs module-level
  functions ``fn(ctx, *args)`` on all of them, returning the per-rank results. Start-up (3-5 s on CPU)
  is paid once per world size, not once per case.
- :func:`time_step` runs a step ``warmup`` times, then ``repeats`` times between barriers, recording
  wall and thread-CPU seconds per repeat. :func:`combine` turns the per-rank records into the figures
  the reports use: per repeat the wall time of the *slowest* rank (what the step costs the job), and
  medians over repeats.
- :func:`peak_memory` measures peak tensor bytes of a step exactly: MemTracker on CPU (every live
  tensor's storage, not RSS), ``torch.cuda.max_memory_allocated`` above the pre-step baseline on CUDA.

Nothing here knows about attention; the suites hand in the step.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import statistics
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "RankContext",
    "RankPool",
    "PoolError",
    "free_port",
    "sync",
    "time_step",
    "combine",
    "peak_memory",
    "resolve_device",
    "Progress",
    "PoolSet",
    "merge_rounds",
]

_STOP = "__stop__"
_READY = "__ready__"
_START_TIMEOUT_S = 120.0
_POLL_S = 0.1


class PoolError(RuntimeError):
    """A rank raised, died or timed out; the message carries the ranks' tracebacks."""


@dataclass(frozen=True)
class RankContext:
    """What a benchmark body receives on each rank."""

    rank: int
    world_size: int
    device: torch.device
    """``cpu``, or ``cuda:<local rank>`` when the pool runs one rank per GPU."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resolve_device(name: str) -> str:
    """``"auto"`` -> ``"cuda"`` when a GPU is visible, else ``"cpu"``; other names pass through."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name not in ("cpu", "cuda"):
        raise ValueError(f"device={name!r} is invalid: choose 'auto', 'cpu' or 'cuda'")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' asked for, but torch.cuda.is_available() is False; use --device cpu")
    return name


def _worker(rank: int, world: int, port: int, device: str, threads: int, tasks: Any, results: Any) -> None:
    """One rank: join the process group, then run tasks until told to stop."""
    try:
        torch.set_num_threads(threads)
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        if device == "cuda":
            torch.cuda.set_device(rank)
            dev = torch.device("cuda", rank)
            backend = "nccl"
        else:
            dev = torch.device("cpu")
            backend = "gloo"
        dist.init_process_group(
            backend, rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}",
            timeout=timedelta(seconds=600),
        )
    except BaseException:  # noqa: B036 - the parent shows it
        results.put((_READY, rank, False, traceback.format_exc()))
        return
    results.put((_READY, rank, True, b""))
    ctx = RankContext(rank, world, dev)
    while True:
        msg = tasks.get()
        if msg == _STOP:
            break
        task_id, payload = msg
        try:
            fn, args = pickle.loads(payload)
            out = (task_id, rank, True, pickle.dumps(fn(ctx, *args)))
        except BaseException:  # noqa: B036 - report everything, the parent decides
            out = (task_id, rank, False, traceback.format_exc())
        results.put(out)
    dist.barrier()  # gloo can abort at exit without it (DESIGN.md)
    dist.destroy_process_group()
    os._exit(0)


class RankPool:
    """``world_size`` persistent ranks; ``run(fn, *args)`` calls ``fn(ctx, *args)`` on each.

    Args:
        world_size: number of ranks (processes).
        device: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL, one GPU per rank: needs ``world_size`` GPUs).
        threads: intra-op threads per rank.
        timeout: default seconds a task may take before the pool is killed and :class:`PoolError` raised.
    """

    def __init__(self, world_size: int, *, device: str = "cpu", threads: int = 1, timeout: float = 900.0) -> None:
        if device == "cuda" and torch.cuda.device_count() < world_size:
            raise ValueError(
                f"a CUDA pool of {world_size} ranks needs {world_size} GPUs, this machine has "
                f"{torch.cuda.device_count()}; run the CPU suite or the one-GPU ring-rank simulation"
            )
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.device = device
        self.timeout = timeout
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        port = free_port()
        self._procs = [
            ctx.Process(
                target=_worker, args=(r, world_size, port, device, threads, self._tasks[r], self._results),
                name=f"seqpar-bench-rank{r}-of{world_size}", daemon=True,
            )
            for r in range(world_size)
        ]
        self._next_id = 0
        self._closed = False
        for p in self._procs:
            p.start()
        try:
            self._collect(_READY, _START_TIMEOUT_S, "start-up")
        except BaseException:
            self.kill()
            raise

    def _collect(self, task_id: Any, timeout: float, what: str) -> list[Any]:
        done: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + timeout
        while len(done) < self.world_size:
            if time.monotonic() > deadline:
                self.kill()
                raise PoolError(f"{what} on {self.world_size} ranks did not finish within {timeout:.0f} s")
            try:
                tid, rank, ok, payload = self._results.get(timeout=_POLL_S)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                if dead:
                    self.kill()
                    raise PoolError(f"rank(s) {dead} died during {what}") from None
                continue
            if tid == task_id:
                done[rank] = (ok, payload)
                if not ok:  # the others may be stuck in a collective the failed rank skipped
                    deadline = min(deadline, time.monotonic() + 10.0)
        failed = {r: tb for r, (ok, tb) in sorted(done.items()) if not ok}
        if failed:
            self.kill()
            raise PoolError(f"{what} failed:\n" + "\n".join(f"--- rank {r}:\n{tb}" for r, tb in failed.items()))
        return [done[r][1] for r in range(self.world_size)]

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> list[Any]:
        """``[fn(ctx_0, *args), ..., fn(ctx_{P-1}, *args)]``; ``fn`` must be a module-level function."""
        task_id = self._next_id
        self._next_id += 1
        payload = pickle.dumps((fn, args))
        for q in self._tasks:
            q.put((task_id, payload))
        name = getattr(fn, "__qualname__", repr(fn))
        raw = self._collect(task_id, timeout or self.timeout, f"task {name}")
        return [pickle.loads(b) for b in raw]

    def close(self) -> None:
        """Stop the workers (barrier, destroy the group, exit); kill stragglers."""
        if self._closed:
            return
        for q in self._tasks:
            q.put(_STOP)
        deadline = time.monotonic() + 15.0
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        """End the workers now (after a failure, or once they were told to stop)."""
        if self._closed:
            return
        self._closed = True
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(5.0)
        for q in [self._results, *self._tasks]:
            q.cancel_join_thread()
            q.close()

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------------------- timing
def sync(device: torch.device) -> None:
    """Wait for queued device work (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _barrier(device: torch.device) -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        if device.type == "cuda":
            dist.barrier(device_ids=[device.index])
        else:
            dist.barrier()


def time_step(step: Callable[[], None], *, device: torch.device, warmup: int, repeats: int) -> dict[str, list[float]]:
    """Run ``step`` ``warmup`` times, then ``repeats`` times, each started right after a barrier.

    Returns:
        ``{"wall_s": [...], "cpu_s": [...]}`` per repeat; ``cpu_s`` is this thread's CPU time, which
        stays meaningful when more ranks than cores share the machine (wall time then is not).
    """
    for _ in range(warmup):
        step()
    sync(device)
    walls, cpus = [], []
    for _ in range(repeats):
        _barrier(device)
        sync(device)
        t0, c0 = time.perf_counter(), time.thread_time()
        step()
        sync(device)
        walls.append(time.perf_counter() - t0)
        cpus.append(time.thread_time() - c0)
    return {"wall_s": walls, "cpu_s": cpus}


def combine(per_rank: Sequence[dict[str, list[float]]]) -> dict[str, Any]:
    """Reduce :func:`time_step` records of all ranks to the reported figures.

    Returns:
        ``time_s``: median over repeats of the slowest rank's wall time; ``rank_time_s``: each rank's
        median wall time; ``cpu_s``: median over repeats of the largest per-rank CPU time;
        ``repeats_s``: the per-repeat slowest-rank wall times (so spread can be judged).
    """
    repeats = len(per_rank[0]["wall_s"])
    slowest = [max(r["wall_s"][i] for r in per_rank) for i in range(repeats)]
    cpu = [max(r["cpu_s"][i] for r in per_rank) for i in range(repeats)]
    return {
        "time_s": statistics.median(slowest),
        "rank_time_s": [statistics.median(r["wall_s"]) for r in per_rank],
        "cpu_s": statistics.median(cpu),
        "repeats_s": slowest,
    }


# ---------------------------------------------------------------------------------------- memory
def peak_memory(step: Callable[[], object], device: torch.device) -> int:
    """Peak bytes of tensors alive while ``step()`` runs, counting what ``step`` allocates
    (create the inputs inside ``step`` to count them too).

    CPU: ``torch.distributed._tools.mem_tracker.MemTracker`` (exact storage accounting).
    CUDA: ``torch.cuda.max_memory_allocated`` minus the allocation before the step.
    """
    if device.type == "cuda":
        sync(device)
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        sync(device)
        return int(torch.cuda.max_memory_allocated(device) - base)
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    with tracker:
        step()
    return int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])


# -------------------------------------------------------------------------------------- progress
class Progress:
    """A tqdm bar over a suite's cases (to stderr), or nothing when disabled."""

    def __init__(self, total: int, *, desc: str, enabled: bool = True) -> None:
        self._bar: Any = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit="case", dynamic_ncols=True)
        self._started = False

    def __call__(self, label: str) -> None:
        """Mark the previous case done and show ``label`` as the one running now."""
        if self._bar is None:
            return
        if self._started:
            self._bar.update(1)
        self._started = True
        self._bar.set_postfix_str(label, refresh=True)

    def close(self) -> None:
        if self._bar is not None:
            if self._started:
                self._bar.update(1)
            self._bar.close()


def merge_rounds(rounds: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per-rank records of one case measured in several rounds -> one record per rank.

    Suites interleave their cases round by round (case A, B, C, then A, B, C again) so that a change
    in background load hits every method alike instead of whichever ran at that moment. The timing
    lists of the rounds are concatenated; every other key comes from the first round.
    """
    merged = []
    for rank_recs in zip(*rounds):
        rec = dict(rank_recs[0])
        rec["timing"] = {key: [x for r in rank_recs for x in r["timing"][key]] for key in rank_recs[0]["timing"]}
        merged.append(rec)
    return merged


class PoolSet:
    """One :class:`RankPool` per world size, started on first use and kept until :meth:`close`
    (idle ranks block on their queue and cost no CPU)."""

    def __init__(self, device: str) -> None:
        self.device = device
        self._pools: dict[int, RankPool] = {}

    def get(self, world: int) -> RankPool:
        if world not in self._pools or self._pools[world]._closed:
            self._pools[world] = RankPool(world, device=self.device)
        return self._pools[world]

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()

    def __enter__(self) -> PoolSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
