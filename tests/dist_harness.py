"""Run a test body on N persistent gloo ranks (CPU processes).

Process start-up dominates distributed tests on CPU (3-5 s per spawn), so one pool of ranks is
started per world size, lazily, and reused by every later test. A test hands a module-level
function ``fn(rank, world_size, *args, **kwargs)`` (picklable by reference) to ``DistPool.run``
and gets back the per-rank return values.

Failure rules:
- a rank raising -> ``AssertionError`` in the caller carrying that rank's traceback; the pool
  stays up when every rank finishes the task within a short grace period, and is killed
  (restarted on next use) when the others are stuck, e.g. in a collective the failed rank skipped;
- a task outliving its timeout, or a worker dying -> its pool is killed and a clear
  ``TimeoutError`` / ``AssertionError`` is raised; a test never hangs.

Protocol: each worker has its own task queue; all workers answer on one result queue. Payloads
travel as ``pickle`` bytes (tensors included), so no shared-memory file descriptors are left open.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

__all__ = ["DistPool", "free_port"]

_STOP = "__stop__"
_READY = "__ready__"
# After one rank fails, how long the others get to finish before the pool is declared stuck.
_GRACE_S = 5.0
_START_TIMEOUT_S = 90.0
_POLL_S = 0.1


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_main(
    rank: int, world_size: int, port: int, sys_path: list[str], tasks, results
) -> None:
    """Body of one rank: join the gloo group, then run tasks until told to stop."""
    sys.path[:] = sys_path  # so test modules (and their fns) import here as in the parent
    try:
        import torch
        import torch.distributed as dist

        from seqpar import groups

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            rank=rank,
            world_size=world_size,
            init_method=f"tcp://127.0.0.1:{port}",
            timeout=timedelta(seconds=60),
        )
    except BaseException:  # noqa: B036 - the parent shows it
        results.put((_READY, rank, False, traceback.format_exc()))
        return
    results.put((_READY, rank, True, b""))
    while True:
        msg = tasks.get()
        if msg == _STOP:
            break
        task_id, payload = msg
        try:
            fn, args, kwargs = pickle.loads(payload)
            out = (task_id, rank, True, pickle.dumps(fn(rank, world_size, *args, **kwargs)))
        except BaseException:  # noqa: B036 - report everything, the parent decides
            out = (task_id, rank, False, traceback.format_exc())
        finally:
            groups.set_default_manager(None)
        results.put(out)
    # gloo can SIGABRT at exit without this barrier (see DESIGN.md).
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # skip interpreter teardown: every answer was delivered before the stop message


class _TaskFailed(AssertionError):
    """Some ranks raised; ``usable`` says whether the others finished (the pool is in step)."""

    def __init__(self, message: str, usable: bool) -> None:
        super().__init__(message)
        self.usable = usable


class _Pool:
    """``world_size`` worker processes sharing one gloo process group."""

    def __init__(self, world_size: int) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.port = free_port()
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.procs = [
            ctx.Process(
                target=_worker_main,
                args=(r, world_size, self.port, list(sys.path), self.tasks[r], self.results),
                name=f"seqpar-test-rank{r}-of{world_size}",
                daemon=True,
            )
            for r in range(world_size)
        ]
        self.next_id = 0
        for p in self.procs:
            p.start()
        try:
            done = self._collect(_READY, _START_TIMEOUT_S, what="start-up (init_process_group)")
            failed = [f"--- rank {r}:\n{tb}" for r, (ok, tb) in sorted(done.items()) if not ok]
            if failed:
                raise RuntimeError(
                    f"dist_pool(world_size={world_size}): start-up failed:\n" + "\n".join(failed)
                )
        except BaseException:
            self.kill()
            raise

    def _dead(self) -> list[str]:
        return [
            f"rank {r} (exit code {p.exitcode})"
            for r, p in enumerate(self.procs)
            if not p.is_alive()
        ]

    def _collect(self, task_id: Any, timeout: float, what: str) -> dict[int, tuple[bool, Any]]:
        """Wait for every rank's answer to ``task_id``; after a failure only ``_GRACE_S`` more."""
        done: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + timeout
        while len(done) < self.world_size:
            now = time.monotonic()
            if now > deadline:
                if any(not ok for ok, _ in done.values()):
                    return done  # a rank failed and others are stuck: report the failure
                pending = sorted(set(range(self.world_size)) - set(done))
                raise TimeoutError(
                    f"dist_pool(world_size={self.world_size}): {what} did not finish within "
                    f"{timeout:.1f} s; ranks still running: {pending}. The pool was killed and "
                    f"restarts on next use."
                )
            try:
                tid, rank, ok, payload = self.results.get(timeout=_POLL_S)
            except queue.Empty:
                dead = self._dead()
                if dead:
                    raise AssertionError(
                        f"dist_pool(world_size={self.world_size}): worker(s) died during {what}: "
                        f"{', '.join(dead)}"
                    ) from None
                continue
            if tid != task_id:  # a stale answer from a task we gave up on; cannot happen after kill
                continue
            done[rank] = (ok, payload)
            if not ok:
                deadline = min(deadline, time.monotonic() + _GRACE_S)
        return done

    def run(self, fn: Callable, args: tuple, kwargs: dict, timeout: float) -> list:
        """Run one task on every rank; the per-rank return values."""
        task_id = self.next_id
        self.next_id += 1
        payload = pickle.dumps((fn, args, kwargs))
        for q in self.tasks:
            q.put((task_id, payload))
        name = getattr(fn, "__qualname__", repr(fn))
        done = self._collect(task_id, timeout, what=f"task {name}")
        failed = {r: tb for r, (ok, tb) in sorted(done.items()) if not ok}
        if failed:
            stuck = sorted(set(range(self.world_size)) - set(done))
            report = "\n".join(
                f"--- rank {r} of {self.world_size} raised:\n{tb}" for r, tb in failed.items()
            )
            if stuck:
                report += f"\n--- ranks {stuck} did not finish (stuck waiting for the failed ranks)"
            raise _TaskFailed(
                f"{name} failed on rank(s) {list(failed)}:\n{report}", usable=not stuck
            )
        return [pickle.loads(done[r][1]) for r in range(self.world_size)]

    def send_stop(self) -> None:
        for q in self.tasks:
            q.put(_STOP)

    def stop(self, timeout: float = 10.0) -> None:
        """Wait for the workers (told to stop by ``send_stop``) to exit; kill stragglers."""
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(5.0)
        for q in [self.results, *self.tasks]:
            q.cancel_join_thread()
            q.close()


class DistPool:
    """One lazily started pool of gloo ranks per world size, shared by a whole test session."""

    def __init__(self) -> None:
        self._pools: dict[int, _Pool] = {}

    def run(
        self, world_size: int, fn: Callable, *args: Any, timeout: float = 120.0, **kwargs: Any
    ) -> list:
        """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` ranks.

        Returns the per-rank return values (index = rank). Raises ``AssertionError`` with the
        failing ranks' tracebacks if any rank raises, ``TimeoutError`` if ``timeout`` seconds pass.
        """
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if world_size not in self._pools:
            self._pools[world_size] = _Pool(world_size)
        pool = self._pools[world_size]
        try:
            return pool.run(fn, args, kwargs, timeout)
        except _TaskFailed as e:
            if not e.usable:
                self._drop(world_size)
            raise AssertionError(str(e)) from None
        except BaseException:  # timeout, dead worker, pytest-timeout, Ctrl-C: state unknown
            self._drop(world_size)
            raise

    def _drop(self, world_size: int) -> None:
        pool = self._pools.pop(world_size, None)
        if pool is not None:
            pool.kill()

    def close(self) -> None:
        """Stop every pool: workers barrier, destroy their group, exit; stragglers are killed."""
        pools, self._pools = list(self._pools.values()), {}
        for pool in pools:  # all pools wind down at once
            pool.send_stop()
        for pool in pools:
            pool.stop()
