"""Run benchmark bodies on P ranks and time them the same way for every method.

- :class:`RankPool` / :class:`PoolSet` (from :mod:`seqpar.testing.ranks`, re-exported here) start P worker
  processes once (gloo on CPU, NCCL when there is a GPU per rank), each with one intra-op thread by
  default (one core per rank), and run module-level functions ``fn(ctx, *args)`` on all of them,
  returning the per-rank results. Start-up (3-5 s on CPU) is paid once per world size, not per case.
  :func:`suite_pools` lends a suite the caller's pools when it has some (the test suite's, already
  started), else starts its own.
- :func:`time_step` runs a step ``warmup`` times, then ``repeats`` times between barriers, recording
  wall and thread-CPU seconds per repeat. :func:`combine` turns the per-rank records into the figures
  the reports use: per repeat the wall time of the *slowest* rank (what the step costs the job), and
  medians over repeats.
- :class:`Phases` times the phases of a layer's forward by wrapping the functions it calls.
- :func:`peak_memory` measures peak tensor bytes of a step exactly: MemTracker on CPU (every live
  tensor's storage, not RSS), ``torch.cuda.max_memory_allocated`` above the pre-step baseline on CUDA.

Nothing here knows about attention; the suites hand in the step.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from seqpar.testing.ranks import PoolError, PoolSet, RankContext, RankPool, free_port

__all__ = [
    "RankContext",
    "RankPool",
    "PoolError",
    "free_port",
    "sync",
    "time_step",
    "combine",
    "peak_memory",
    "Phases",
    "resolve_device",
    "Progress",
    "PoolSet",
    "merge_rounds",
    "suite_pools",
]


def resolve_device(name: str) -> str:
    """``"auto"`` -> ``"cuda"`` when a GPU is visible, else ``"cpu"``; other names pass through."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name not in ("cpu", "cuda"):
        raise ValueError(f"device={name!r} is invalid: choose 'auto', 'cpu' or 'cuda'")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' asked for, but torch.cuda.is_available() is False; use --device cpu")
    return name


@contextmanager
def suite_pools(device: str, pools: PoolSet | None = None) -> Iterator[PoolSet]:
    """The rank pools a suite runs on: ``pools`` when the caller lends some (left running on exit: they
    are the caller's, e.g. the test suite's, whose ranks are already started), else a fresh
    :class:`PoolSet` on ``device``, closed on exit.

    Raises:
        ValueError: the lent pools run on another device than the suite's.
    """
    if pools is None:
        with PoolSet(device) as own:
            yield own
        return
    if pools.device != device:
        raise ValueError(f"the suite runs on device={device!r} but the pools lent to it run on "
                         f"{pools.device!r}; lend pools of the suite's device, or none")
    yield pools


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
def peak_memory(step: Callable[[], object], device: torch.device, *, repeats: int = 1) -> int:
    """Peak bytes of tensors alive while ``step()`` runs, counting what ``step`` allocates
    (create the inputs inside ``step`` to count them too); the lowest of ``repeats`` runs.

    CPU: ``torch.distributed._tools.mem_tracker.MemTracker`` (exact storage accounting).
    CUDA: ``torch.cuda.max_memory_allocated`` minus the allocation before the step.

    Why the lowest: a finished gloo collective's buffers are freed by gloo's worker thread, not by
    the caller, and on an oversubscribed CPU (P ranks on 2 cores) that thread is sometimes scheduled
    only after the caller's next allocations. The peak of such a run includes buffers the algorithm
    has already let go (seen for Ulysses' all-to-alls in ~10% of steps: the just-waited dout
    all-to-all's send and receive buffers; a 3 ms pause after each wait removes it). The lowest of a
    few runs is the algorithm's peak, as the median of a few runs is its time.
    """
    if repeats < 1:
        raise ValueError(f"repeats={repeats} is invalid: at least 1 run is needed")
    return min(_peak_once(step, device) for _ in range(repeats))


def _peak_once(step: Callable[[], object], device: torch.device) -> int:
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


class Phases:
    """Wall time of a forward's phases on this rank: :meth:`wrap` times every call of a function the layer
    calls (looked up on its module at each call, so wrapping the module attribute is enough); forward
    only (no autograd), for the per-phase breakdowns of the mixer benchmarks."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._undo: list[Callable[[], None]] = []

    def wrap(self, module: Any, name: str, phase: str) -> None:
        original = getattr(module, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            out = original(*args, **kwargs)
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t0
            return out

        setattr(module, name, timed)
        self._undo.append(lambda: setattr(module, name, original))

    def undo(self) -> None:
        for fn in reversed(self._undo):
            fn()

    def time_forward(self, forward: Callable[[], object], rest: str, *, barrier: bool) -> tuple[float, dict[str, float]]:
        """Run ``forward()`` once without autograd with the wrapped functions timed, then :meth:`undo` them
        (also on error). ``barrier``: start together with the other ranks (``dist.barrier()`` first).
        Returns the forward's wall seconds and the seconds of each phase, ``rest`` the remainder."""
        try:
            if barrier:
                dist.barrier()
            t0 = time.perf_counter()
            with torch.no_grad():
                forward()
            total = time.perf_counter() - t0
        finally:
            self.undo()
        seconds = dict(self.seconds)
        seconds[rest] = total - sum(seconds.values())
        return total, seconds
