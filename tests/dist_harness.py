"""Run a test body on N persistent gloo ranks (CPU processes), on :mod:`seqpar.testing.ranks`' pools.

Process start-up dominates distributed tests on CPU (3-5 s per spawn), so one pool of ranks is
started per world size, lazily, and reused by every later test. A test hands a module-level
function ``fn(rank, world_size, *args, **kwargs)`` (picklable by reference) to ``DistPool.run``
and gets back the per-rank return values.

Failure rules (those of :class:`seqpar.testing.ranks.RankPool`, surfaced the way pytest reads best):
- a rank raising -> ``AssertionError`` in the caller carrying that rank's traceback; the pool
  stays up when every rank finishes the task within a short grace period, and is killed
  (restarted on next use) when the others are stuck, e.g. in a collective the failed rank skipped;
- a task leaving a module of :data:`GUARD_MODULES` patched -> ``AssertionError`` naming the attribute;
- a task outliving its timeout -> its pool is killed and a ``TimeoutError`` is raised; a worker
  dying -> its pool is killed and an ``AssertionError`` is raised; a test never hangs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from seqpar.testing.ranks import PoolError, PoolSet, PoolTimeout, RankContext, free_port

__all__ = ["DistPool", "free_port"]

# A collective waiting longer than this on a rank raises there (the task timeout is the outer bound).
_PROCESS_GROUP_TIMEOUT_S = 60.0
# A rank starting a task with more threads than this (after the pool's clean-up) recycles its pool: groups
# something still refers to keep 3 gloo threads each, and a few hundred slow every later test. An idle rank
# has ~7; a restart costs a few seconds, a rank at 500 threads costs more than that on every test.
_MAX_THREADS = 80
# Modules no test may leave patched on a rank (the pool's guard fails the task that does): seqpar's own, and
# those the tests patch on the ranks (grep the tests for setattr / monkeypatch in rank functions). A module's
# callable attributes are compared before and after every task (~1-10 ms a task).
GUARD_MODULES = (
    "seqpar.*", "torch.distributed", "torch.distributed.distributed_c10d", "torch.cuda", "torch.version",
    "transformers.models.kimi_linear.*", "transformers.models.jamba.*", "transformers.models.mixtral.*",
    "transformers.masking_utils", "transformers.integrations.sdpa_attention",
)


class _WithRank:
    """The tests' calling convention, ``fn(rank, world_size, ...)``, as a pool task ``task(ctx, ...)``;
    named after ``fn`` so that failure reports name the test's function."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.__qualname__ = getattr(fn, "__qualname__", repr(fn))
        self.__wrapped__ = fn  # the pool's guard looks for patches defined beside the test's module

    def __call__(self, ctx: RankContext, *args: Any, **kwargs: Any) -> Any:
        return self.fn(ctx.rank, ctx.world_size, *args, **kwargs)


class DistPool:
    """One lazily started pool of gloo ranks per world size, shared by a whole test session."""

    def __init__(self, max_threads: int | None = _MAX_THREADS,
                 guard_modules: tuple[str, ...] | None = GUARD_MODULES) -> None:
        self._pools = PoolSet("cpu", pg_timeout_s=_PROCESS_GROUP_TIMEOUT_S, max_threads=max_threads,
                              guard_modules=guard_modules)

    @property
    def recycles(self) -> int:
        """How many pools were restarted for passing ``max_threads`` threads on a rank."""
        return self._pools.recycles

    def run(
        self, world_size: int, fn: Callable, *args: Any, timeout: float = 120.0, fresh: bool = False, **kwargs: Any
    ) -> list:
        """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` ranks.

        ``fresh``: on newly started ranks (the pool of that size is restarted first), for a measurement that must
        not see what earlier tasks left in the rank processes. Returns the per-rank return values (index = rank).
        Raises ``AssertionError`` with the failing ranks' tracebacks if any rank raises, ``TimeoutError`` if
        ``timeout`` seconds pass.
        """
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if fresh:
            self._pools.restart(world_size)
        try:
            return self._pools.run(world_size, _WithRank(fn), *args, timeout=timeout, **kwargs)
        except PoolTimeout:
            raise
        except PoolError as e:  # a rank raised or died: a test failure, not an error of the harness
            raise AssertionError(str(e)) from None

    @property
    def pools(self) -> PoolSet:
        """The pools themselves, for code that runs ``fn(ctx, ...)`` tasks on a :class:`PoolSet` (the benchmark
        suites: ``seqpar.bench.__main__.main(argv, pools=dist_pool.pools)``) on the session's started ranks."""
        return self._pools

    @property
    def starts(self) -> dict[int, int]:
        """Pools started per world size (each start costs every rank a fresh interpreter's imports)."""
        return dict(self._pools.starts)

    def close(self) -> None:
        """Stop every pool: workers barrier, destroy their group, exit; stragglers are killed."""
        self._pools.close()
