"""Persistent local ranks: run a function on P processes of one machine and collect what each returns.

Process start-up dominates short distributed jobs on CPU (3-5 s per spawn), so a :class:`RankPool`
starts its P workers once (gloo on CPU, NCCL with one GPU per rank), and every later ``run(fn, ...)``
reuses them. The benchmarks (``python -m seqpar.bench``) and the test suite (``tests/dist_harness.py``)
both run on it.

Protocol: each worker has its own task queue; all workers answer on one result queue. Tasks and
answers travel as ``pickle`` bytes (tensors included), so no shared-memory file descriptors stay open.
``fn`` must be a module-level function (pickled by reference) and is called as ``fn(ctx, *args,
**kwargs)`` with a :class:`RankContext`. After every task the worker forgets seqpar's default
process-group manager, and before the next one it destroys the groups the task left (and, when its
thread count grew, runs the cycle collector), so one task's groups never leak into the next. What holds
groups out of the collector's reach is the task's to release before it ends: a DeepSpeed engine's
gradient hooks, for one (:mod:`seqpar.testing.deepspeed_teardown`); a pool that leaks anyway recycles
itself past ``max_threads``. Each answer carries the rank's ``(threads, groups)``
(:attr:`RankPool.health`); a pool given ``max_threads`` closes itself when a rank passes it anyway
(:class:`PoolSet` counts it and starts a fresh one). ``SEQPAR_POOL_TRACE=<file>`` logs them per task.

A pool given ``guard_modules`` (module names; ``"seqpar.*"`` takes the modules below too) checks that no
task leaves a patch behind: each rank notes every callable attribute (function, class, ``functools.partial``,
...) of those modules before the task and compares after it. A replaced attribute fails the task on that rank
(:class:`RankFailed`, naming the attribute) and is put back; a module first imported by the task that holds
a patch (a mock, a ``functools.partial`` of the function it replaced, or a function defined beside the task's
own module) fails it too, and then the pool is recycled, since that module cannot be put back.

Failure rules (a caller never hangs):

- some ranks raise -> :class:`RankFailed` carrying their tracebacks. If every other rank finishes
  within a short grace period the pool stays usable (``usable=True``); if some are stuck (e.g. in a
  collective the failed rank skipped) the pool is killed;
- a task outliving its timeout -> :class:`PoolTimeout` (also a ``TimeoutError``), pool killed;
- a worker dying, or start-up failing -> :class:`PoolError`, pool killed.

A killed pool reports ``closed``; :class:`PoolSet` starts a fresh one on next use.
"""

from __future__ import annotations

import faulthandler
import functools
import gc
import inspect
import multiprocessing as mp
import os
import pickle
import queue
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

__all__ = [
    "RankContext",
    "RankPool",
    "PoolSet",
    "PoolError",
    "RankFailed",
    "PoolTimeout",
    "free_port",
]

_STOP = "__stop__"
_READY = "__ready__"
OWNER_POLL_S = 2.0  # how often an idle rank checks that the process that started its pool is still there


def owner_alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, killed and not yet reaped, does not: Linux's
    ``/proc/<pid>/stat`` state ``Z``)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def _next_task(tasks: Any, owner: int | None) -> Any:
    """A rank's next message, or ``None`` once the pool's owner is gone: a process killed (SIGKILL, a test
    runner's timeout) before it could stop its ranks would otherwise leave them waiting here for ever."""
    while True:
        try:
            return tasks.get(timeout=OWNER_POLL_S)
        except queue.Empty:
            if owner is not None and not owner_alive(owner):
                return None
_START_TIMEOUT_S = 120.0
# After one rank fails, how long the others get to finish before the pool is declared stuck.
_GRACE_S = 5.0
_POLL_S = 0.1


class PoolError(RuntimeError):
    """A pool could not start, a worker died, or (subclasses) a task failed or timed out."""


class RankFailed(PoolError):
    """Some ranks raised; ``usable`` says whether the others finished (the pool is still in step)."""

    def __init__(self, message: str, *, usable: bool) -> None:
        super().__init__(message)
        self.usable = usable


class PoolTimeout(PoolError, TimeoutError):
    """A task did not finish on every rank within its timeout; the pool was killed."""


@dataclass(frozen=True)
class RankContext:
    """What a task receives on each rank."""

    rank: int
    world_size: int
    device: torch.device
    """``cpu``, or ``cuda:<local rank>`` when the pool runs one rank per GPU."""


def _trace(line: str) -> None:
    """Append ``line`` to the file named by ``SEQPAR_POOL_TRACE`` (a debugging aid: which tasks leave
    threads or process groups behind on the pool's ranks); nothing when it is unset."""
    path = os.environ.get("SEQPAR_POOL_TRACE")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join_group(rank: int, world: int, port: int, device: str, threads: int, pg_timeout_s: float) -> torch.device:
    import torch.distributed as dist

    torch.set_num_threads(threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    if device == "cuda":
        torch.cuda.set_device(rank)
        dev, backend = torch.device("cuda", rank), "nccl"
    else:
        dev, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(
        backend, rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}",
        timeout=timedelta(seconds=pg_timeout_s),
    )
    return dev


def _process_groups() -> set:
    """Every process group torch holds on this rank (its own registry)."""
    from torch.distributed import distributed_c10d

    return set(distributed_c10d._world.pg_map)


def _threads() -> int:
    """Threads of this process now (0 where ``/proc`` is missing)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


def _health() -> tuple[int, int]:
    """``(threads, process groups)`` of this rank now: what leaked gloo groups grow (each holds threads)."""
    return _threads(), len(_process_groups())


_DYNAMO_GLOBALS = ("__resume_at_", "__compiled_fn_", "__import_")


def _module_state(names: tuple[str, ...]) -> dict[tuple[str, str], Any]:
    """``(module, attribute) -> value`` of every callable attribute of the loaded modules ``names`` names
    (``"torch.cuda"``: that module; ``"seqpar.*"``: seqpar and every module below it). Data attributes are
    left out: counters and caches change by design. So are dynamo's own globals (a graph break's
    ``__resume_at_*`` function, installed in the module of the frame it resumes; ``__compiled_fn_*``,
    ``__import_*``): ``torch._dynamo.reset()`` in a later task deletes them, which is no patch left behind."""
    state = {}
    for name, module in list(sys.modules.items()):
        if module is None or not _guarded(name, names):
            continue
        for attr, value in list(vars(module).items()):
            if callable(value) and not inspect.ismodule(value) and not attr.startswith(_DYNAMO_GLOBALS):
                state[(name, attr)] = value
    return state


def _guarded(name: str, names: tuple[str, ...]) -> bool:
    """Whether module ``name`` is one of ``names`` (``"seqpar.*"``: seqpar and every module below it)."""
    return any(name == p.removesuffix(".*") or (p.endswith(".*") and name.startswith(p.removesuffix("*")))
               for p in names)


def _is_patch(attr: str, value: Any, test_dir: str | None, names: tuple[str, ...]) -> bool:
    """Whether ``value``, found as ``attr`` of a module, looks put there by a test: a ``unittest.mock`` object, a
    ``functools.partial`` of a function named ``attr`` (the function it replaced, bound to other arguments),
    or a function defined in ``test_dir`` (the folder of the task's own module) by a module the guard does not
    cover (``names``). Functions of guarded modules are the library's own: a task defined in a guarded package
    (the benchmark suites', run on the test session's pools) imports its module and the neighbours it imports
    from, and that is no patch."""
    if type(value).__module__.startswith("unittest.mock"):
        return True
    if isinstance(value, functools.partial):
        return getattr(inspect.unwrap(value.func), "__name__", None) == attr
    if not inspect.isfunction(value):
        return False
    fn = inspect.unwrap(value)
    code = getattr(fn, "__code__", None)
    return bool(test_dir and code is not None and os.path.dirname(os.path.abspath(code.co_filename)) == test_dir
                and not _guarded(getattr(fn, "__module__", None) or "", names))


def _installed_by_seqpar(name: str, value: Any) -> bool:
    """Whether ``value``, now ``name``'s attribute, is one of seqpar's own library functions put into another
    library's module on purpose: the swap installs its router-loss dispatcher into a MoE model's transformers
    module once, for the process's life (:mod:`seqpar.swap.moe`). The first task that swaps such a model
    changes that module; it is not a test's patch, and later tasks find it already there."""
    where = getattr(value, "__module__", None) or ""
    return (not name.startswith("seqpar") and where.startswith("seqpar.")
            and not where.startswith("seqpar.testing"))


def _state_changes(before: dict[tuple[str, str], Any], names: tuple[str, ...],
                   test_dir: str | None) -> tuple[list[str], bool]:
    """What a task changed in the guarded modules: one line per attribute, and whether a module it imported
    holds a patch (which cannot be put back). Replaced attributes of modules loaded before are put back."""
    changes, fresh_patch = [], False
    missing = object()
    seen = {name for name, _ in before}
    for (name, attr), value in before.items():
        module = sys.modules.get(name)
        now = missing if module is None else vars(module).get(attr, missing)
        if now is not value and module is not None and not _installed_by_seqpar(name, now):
            changes.append(f"{name}.{attr} was {value!r:.80}, is {'deleted' if now is missing else repr(now)[:80]}")
            setattr(module, attr, value)
    for (name, attr), value in _module_state(names).items():
        if name not in seen and _is_patch(attr, value, test_dir, names):
            changes.append(f"{name}.{attr} (imported by the task) is {value!r:.80}")
            fresh_patch = True
    return changes, fresh_patch


def _task_dir(fn: Any) -> str | None:
    """The folder of the module that defines ``fn`` (``__wrapped__`` followed), or None."""
    try:
        return os.path.dirname(os.path.abspath(inspect.getsourcefile(inspect.unwrap(fn)) or ""))
    except (TypeError, ValueError):
        return None


def _destroy_groups_but(keep: set, clean_threads: int) -> int:
    """Destroy the groups earlier tasks made and left behind (a manager a test did not destroy, a
    DeviceMesh's groups). Run at the start of the next task: by then every rank of the pool has finished
    the earlier one, so no peer still uses them. Without this, each leaked gloo group keeps its threads
    and sockets for the rest of the session (hundreds per worker over the suite, busy enough to slow the
    whole machine). DTensor's cached plans name groups too, so they go with them.

    A destroyed group still keeps its threads while a python object refers to it. When this rank has more
    threads than ``clean_threads`` (its count after the last full clean-up) once the groups are destroyed,
    the full clean-up runs the cycle collector, then freezes what survived (so not after every task, and
    cheap after the first). Returns the thread count to pass next time."""
    import sys

    import torch.distributed as dist

    leftover = _process_groups() - keep
    # DeepSpeed keeps its own references (its TP / DP / expert groups, reused by its next engine):
    # its destroy_process_group releases them with the group.
    deepspeed_comm = sys.modules.get("deepspeed.comm")
    if deepspeed_comm is not None and getattr(sys.modules.get("deepspeed.comm.comm"), "cdb", None) is not None:
        destroy = deepspeed_comm.destroy_process_group
    else:
        destroy = dist.destroy_process_group
    for group in leftover:
        destroy(group)
    # ... and, whether or not a group was left, the model-parallel unit (a finished task's manager, whose groups
    # are gone) and the mesh a DeepSpeed engine was given: its next engine must not inherit them. A task that
    # released its engines (seqpar.testing.deepspeed_teardown) already cleared both; these public attributes
    # are reset here too for engines no task released (one whose initialize raised half-way, a runner
    # outside tests/ such as integrations/fuzz_engine.py)
    ds_groups = sys.modules.get("deepspeed.utils.groups")
    for attr in ("mpu", "mesh_device") if ds_groups is not None else ():
        if getattr(ds_groups, attr, None) is not None:
            setattr(ds_groups, attr, None)
    if not leftover and _threads() <= clean_threads:
        return clean_threads
    # A group destroyed, or dropped from the registry, keeps its gloo threads and sockets while any python
    # object still refers to it: a DeviceMesh, a manager, an exception's traceback frames in a reference cycle.
    # (DeepSpeed engines are the task's to release: seqpar.testing.deepspeed_teardown.)
    try:
        from torch.distributed.tensor import debug
    except ImportError:
        pass
    else:
        getattr(debug, "_clear_sharding_prop_cache", lambda: None)()
    gc.collect()
    freeze_long_lived_heap()
    return _threads()


GC_FREEZE_CHECKED = ((3, 10), (3, 13))
"""(oldest, newest) CPython minor version on which :func:`freeze_long_lived_heap` is known to pay
(inclusive). Measured on 3.11 (issue 30); 3.10 to 3.13 share that generational collector, whose
``gc.freeze`` moves survivors to a permanent generation that full collections skip. CPython 3.14.0-3.14.4
shipped an incremental collector (reverted in 3.14.5 and 3.15; PEP 848 proposes another for 3.16), so what
a freeze saves there is unmeasured: re-measure before widening the range."""


def check_gc_freeze_version(version: tuple[int, ...] | None = None) -> None:
    """Raise ``RuntimeError`` unless the CPython ``(major, minor)`` ``version`` (default: this
    interpreter's) lies in :data:`GC_FREEZE_CHECKED`.

    Raises:
        RuntimeError: naming ``version``, the checked range, and what to re-measure.
    """
    (low, high) = GC_FREEZE_CHECKED
    v = tuple(sys.version_info[:2] if version is None else version[:2])
    if not low <= v <= high:
        raise RuntimeError(
            f"seqpar.testing.ranks freezes the cycle collector's long-lived heap after a full clean-up, a "
            f"saving measured on CPython {low[0]}.{low[1]}..{high[0]}.{high[1]}; this is CPython "
            f"{v[0]}.{v[1]}. Re-measure the DeepSpeed-heavy tests with and without gc.freeze() (see "
            f"freeze_long_lived_heap) and widen GC_FREEZE_CHECKED, or drop the freeze."
        )


def freeze_long_lived_heap() -> None:
    """Freeze what survived the full collection just run: the rank's long-lived state (torch, transformers,
    DeepSpeed: ~420k objects), so later collections skip it.

    CPython's documented ``gc`` API for long-lived workers, not a reach into any library, and not there for
    leaks: only what survives ``gc.collect()`` is frozen, and a released ZeRO engine's groups sit in
    reference cycles, so a DeepSpeed task is followed by a full collection. Measured on this 2-core machine
    under load (issue 30): one collection over that heap 3.3-3.8 s, after the freeze ~0 s; the
    DeepSpeed-heavy set (test_groups, test_deepspeed_tp, test_model_parallel_group, test_train's ZeRO tests)
    361 s of CPU without it, 299 s with it. Pinned to :data:`GC_FREEZE_CHECKED`: outside it, raises."""
    check_gc_freeze_version()
    gc.freeze()


# What a CPU rank forks from: one server process that imported these once (torch's import is 3-4 CPU-seconds,
# transformers' 1-2 more; a spawned rank pays both, and on 2 cores a 4-rank pool's start took 44-56 s under
# load against 13-20 s forked). CUDA ranks are spawned: nothing CUDA may be initialised before a fork.
FORKSERVER_PRELOAD = ("torch", "torch.distributed", "transformers")


def _start_method(device: str) -> Any:
    """The multiprocessing context a pool starts its ranks in: a fork server preloading
    :data:`FORKSERVER_PRELOAD` for CPU ranks, ``spawn`` for CUDA ranks."""
    if device == "cuda":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))  # read when the server starts (once per process)
    return ctx


def _worker(
    rank: int, world: int, port: int, device: str, threads: int, pg_timeout_s: float, tasks: Any, results: Any,
    guard_modules: tuple[str, ...] | None = None, environ: dict[str, str] | None = None, owner: int | None = None,
) -> None:
    """One rank: join the process group, then run tasks until told to stop, or until ``owner`` (the process
    that started the pool) is gone. ``environ``: the parent's environment when it started the pool (a forked
    rank would otherwise have the fork server's)."""
    if environ is not None:
        os.environ.clear()
        os.environ.update(environ)
    # A rank killed by a signal from C++ (gloo's or libtorch's abort) leaves no Python traceback in the answer
    # queue: faulthandler writes every thread's Python stack to the rank's stderr, which shows where it was.
    faulthandler.enable(all_threads=True)
    try:
        dev = _join_group(rank, world, port, device, threads, pg_timeout_s)
        import torch.distributed as dist

        from seqpar.runtime import groups
    except BaseException:  # noqa: B036 - the parent shows it
        results.put((_READY, rank, False, traceback.format_exc(), (0, 0, 0, 0), False))
        return
    results.put((_READY, rank, True, b"", _health() * 2, False))
    ctx = RankContext(rank, world, dev)
    own_groups = _process_groups()
    clean_threads = _threads()
    while True:
        msg = _next_task(tasks, owner)
        if msg is None:  # orphaned: no barrier (the peers may be mid-task or gone), just leave
            os._exit(0)
        if msg == _STOP:
            break
        task_id, payload = msg
        clean_threads = _destroy_groups_but(own_groups, clean_threads)
        residual = _health()  # what earlier tasks left that the clean-up could not release
        before = _module_state(guard_modules) if guard_modules else None
        fn = None
        try:
            fn, args, kwargs = pickle.loads(payload)
            out = (task_id, rank, True, pickle.dumps(fn(ctx, *args, **kwargs)))
        except BaseException:  # noqa: B036 - report everything, the parent decides
            out = (task_id, rank, False, traceback.format_exc())
        finally:
            groups.set_default_manager(None)
        fresh_patch = False
        if before is not None:
            changes, fresh_patch = _state_changes(before, guard_modules, _task_dir(fn))
            if changes:
                note = (f"the task left module state changed on rank {rank} (a patch not undone; restore it with "
                        f"pytest.MonkeyPatch.context() or try/finally):\n  " + "\n  ".join(changes))
                out = (task_id, rank, False, note if out[2] else f"{out[3]}\n{note}")
        results.put((*out, residual + _health(), fresh_patch))
    # gloo can abort (SIGABRT) at exit when a rank destroys its group while a peer still uses it.
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # skip interpreter teardown: every answer was delivered before the stop message


def _exit_text(code: int | None) -> str:
    """``-6, SIGABRT: ...``: a negative exit code is the signal that ended the rank; an abort is C++'s, whose
    message and the rank's Python stacks (faulthandler) are on its stderr."""
    if code is None or code >= 0:
        return str(code)
    try:
        name = signal.Signals(-code).name
    except ValueError:
        return str(code)
    if -code == signal.SIGABRT:
        return (f"{code}, {name}: a C++ abort (gloo, libtorch); its message and every thread's Python stack "
                "are on that rank's stderr")
    return f"{code}, {name}"


class RankPool:
    """``world_size`` persistent ranks; ``run(fn, *args, **kwargs)`` calls ``fn(ctx, *args, **kwargs)`` on each.

    Args:
        world_size: number of ranks (processes), >= 1.
        device: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL, one GPU per rank: needs ``world_size`` GPUs).
        threads: intra-op threads per rank (1: one core per rank).
        timeout: default seconds a task may take before the pool is killed and :class:`PoolTimeout` raised.
        pg_timeout_s: the process group's own timeout (a collective waiting longer raises on the rank).
        max_threads: recycle the pool (close it; :class:`PoolSet` starts a fresh one on next use) once a rank
            starts a task with more threads than this after the clean-up of what earlier tasks left: groups
            that something still refers to keep their gloo threads (3 per group) and sockets, and hundreds
            of them slow every later task. ``None``: never (and where ``/proc`` is missing threads are not
            counted).
        guard_modules: modules (``"seqpar.*"``: and those below) whose callable attributes no task may leave
            changed (see the module docstring); ``None``: no guard.
    """

    def __init__(
        self, world_size: int, *, device: str = "cpu", threads: int = 1, timeout: float = 900.0,
        pg_timeout_s: float = 600.0, max_threads: int | None = None,
        guard_modules: tuple[str, ...] | None = None,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device={device!r} is invalid: choose 'cpu' or 'cuda'")
        if device == "cuda" and torch.cuda.device_count() < world_size:
            raise ValueError(
                f"a CUDA pool of {world_size} ranks needs {world_size} GPUs, this machine has "
                f"{torch.cuda.device_count()}; run the CPU suite or the one-GPU ring-rank simulation"
            )
        check_gc_freeze_version()  # a rank's clean-up freezes the collector: refuse before starting any
        ctx = _start_method(device)
        self.world_size = world_size
        self.device = device
        self.timeout = timeout
        self.max_threads = max_threads
        self.recycled = False
        """True once the pool closed itself because a rank's threads passed ``max_threads``."""
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        port = free_port()
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, port, device, threads, pg_timeout_s, self._tasks[r], self._results,
                      tuple(guard_modules) if guard_modules else None, dict(os.environ), os.getpid()),
                name=f"seqpar-rank{r}-of{world_size}", daemon=True,
            )
            for r in range(world_size)
        ]
        self._next_id = 0
        self._closed = False
        self._fresh_patch = False
        self.health: list[tuple[int, int, int, int]] = [(0, 0, 0, 0)] * world_size
        """Per rank, as of its last answer: ``(threads, process groups)`` when the task started (after the
        clean-up of what earlier tasks left), then ``(threads, process groups)`` when it ended."""
        for p in self._procs:
            p.start()
        try:
            done = self._collect(_READY, _START_TIMEOUT_S, "start-up (init_process_group)")
            failed = self._failures(done)
            if failed:
                raise PoolError(f"RankPool(world_size={world_size}): start-up failed:\n{failed}")
        except BaseException:
            self.kill()
            raise

    @property
    def pids(self) -> list[int | None]:
        """The ranks' process ids (``None`` before a rank started)."""
        return [p.pid for p in self._procs]

    @property
    def closed(self) -> bool:
        """True once the pool was stopped or killed; it cannot run tasks any more."""
        return self._closed

    def _dead(self) -> list[str]:
        return [f"rank {r} (exit code {_exit_text(p.exitcode)})" for r, p in enumerate(self._procs) if not p.is_alive()]

    @staticmethod
    def _failures(done: dict[int, tuple[bool, Any]]) -> str:
        return "\n".join(f"--- rank {r} raised:\n{tb}" for r, (ok, tb) in sorted(done.items()) if not ok)

    def _collect(self, task_id: Any, timeout: float, what: str) -> dict[int, tuple[bool, Any]]:
        """Every rank's ``(ok, payload)`` for ``task_id``; after a failure the others get ``_GRACE_S``."""
        done: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + timeout
        while len(done) < self.world_size:
            if time.monotonic() > deadline:
                if any(not ok for ok, _ in done.values()):
                    return done  # a rank failed and others are stuck: the caller reports the failure
                pending = sorted(set(range(self.world_size)) - set(done))
                self.kill()
                raise PoolTimeout(
                    f"RankPool(world_size={self.world_size}): {what} did not finish within {timeout:.1f} s; "
                    f"ranks still running: {pending}. The pool was killed."
                )
            try:
                tid, rank, ok, payload, health, fresh_patch = self._results.get(timeout=_POLL_S)
            except queue.Empty:
                dead = self._dead()
                if dead:
                    self.kill()
                    raise PoolError(
                        f"RankPool(world_size={self.world_size}): worker(s) died during {what}: {', '.join(dead)}"
                    ) from None
                continue
            if tid != task_id:  # a late answer to a task given up on; cannot happen after kill
                continue
            done[rank] = (ok, payload)
            self.health[rank] = health
            self._fresh_patch |= fresh_patch
            if not ok:
                deadline = min(deadline, time.monotonic() + _GRACE_S)
        return done

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """``[fn(ctx_0, *args, **kwargs), ..., fn(ctx_{P-1}, *args, **kwargs)]``.

        Raises:
            RankFailed: some ranks raised (their tracebacks in the message).
            PoolTimeout: ``timeout`` (default: the pool's) seconds passed.
            PoolError: a worker died.
        """
        if self._closed:
            raise PoolError(f"RankPool(world_size={self.world_size}) is closed; start a new one")
        task_id = self._next_id
        self._next_id += 1
        payload = pickle.dumps((fn, args, kwargs))
        for q in self._tasks:
            q.put((task_id, payload))
        name = getattr(fn, "__qualname__", repr(fn))
        try:
            done = self._collect(task_id, timeout or self.timeout, f"task {name}")
        except BaseException:  # Ctrl-C, a test runner's timeout...: the ranks' state is unknown
            self.kill()
            raise
        _trace(f"P={self.world_size} {name} health={self.health}")
        failures = self._failures(done)
        stuck = sorted(set(range(self.world_size)) - set(done))
        if stuck:
            pass  # killed below
        elif self._fresh_patch:  # a patched module the guard could not put back: later tasks need fresh ranks
            self.recycled = True
            _trace(f"P={self.world_size} recycled after {name}: it left a patch in a module it imported")
            self.close()
        elif self.max_threads is not None and max(h[0] for h in self.health) > self.max_threads:
            # every rank answered, so every rank is waiting for its next message: a clean stop
            self.recycled = True
            _trace(f"P={self.world_size} recycled after {name}: threads {[h[0] for h in self.health]}")
            self.close()
        if failures:
            failed = [r for r, (ok, _) in sorted(done.items()) if not ok]
            note = f" (ranks {stuck} did not finish: stuck waiting for the failed ranks)" if stuck else ""
            if stuck:
                self.kill()
            raise RankFailed(
                f"{name} failed on rank(s) {failed} of {self.world_size}{note}:\n{failures}", usable=not stuck
            )
        return [pickle.loads(done[r][1]) for r in range(self.world_size)]

    def send_stop(self) -> None:
        """Tell the workers to stop (barrier, destroy the group, exit); :meth:`stop` waits for them."""
        if not self._closed:
            for q in self._tasks:
                q.put(_STOP)

    def stop(self, timeout: float = 15.0) -> None:
        """Wait for the workers told to stop by :meth:`send_stop` to exit; kill stragglers."""
        deadline = time.monotonic() + timeout
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def close(self) -> None:
        """Stop the workers (barrier, destroy the group, exit); kill stragglers."""
        if self._closed:
            return
        self.send_stop()
        self.stop()

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


class PoolSet:
    """One :class:`RankPool` per world size, started on first use and kept until :meth:`close`
    (idle ranks block on their queue and cost no CPU); a pool that was killed restarts on next use.

    Args:
        device, threads, timeout, pg_timeout_s, max_threads, guard_modules: passed to every :class:`RankPool`.
    """

    def __init__(self, device: str = "cpu", *, threads: int = 1, timeout: float = 900.0,
                 pg_timeout_s: float = 600.0, max_threads: int | None = None,
                 guard_modules: tuple[str, ...] | None = None) -> None:
        self.device = device
        self._options = {
            "threads": threads, "timeout": timeout, "pg_timeout_s": pg_timeout_s, "max_threads": max_threads,
            "guard_modules": guard_modules,
        }
        self._pools: dict[int, RankPool] = {}
        self.recycles = 0
        """How many pools closed themselves for passing ``max_threads`` (each one restarted on next use)."""
        self.starts: dict[int, int] = {}
        """Pools started per world size (the first start, and each restart after a kill or recycle)."""

    def get(self, world: int) -> RankPool:
        """The pool of ``world`` ranks, started now if there is none or the last one was killed or recycled."""
        if world not in self._pools or self._pools[world].closed:
            self._pools[world] = RankPool(world, device=self.device, **self._options)
            self.starts[world] = self.starts.get(world, 0) + 1
        return self._pools[world]

    def run(self, world: int, fn: Callable[..., Any], *args: Any, timeout: float | None = None,
            **kwargs: Any) -> list[Any]:
        """:meth:`RankPool.run` on the pool of ``world`` ranks."""
        pool = self.get(world)
        try:
            return pool.run(fn, *args, timeout=timeout, **kwargs)
        finally:
            if pool.recycled:  # it closed itself; forget it (the next get starts a fresh one)
                self.recycles += 1
                self._pools.pop(world, None)

    def restart(self, world: int) -> None:
        """Stop the pool of ``world`` ranks (if started): the next task on that size starts fresh interpreters, which
        carry no state from earlier tasks (caches, library registries)."""
        pool = self._pools.pop(world, None)
        if pool is not None:
            pool.send_stop()
            pool.stop()

    def close(self) -> None:
        """Stop every pool; all of them wind down at once."""
        pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.send_stop()
        for pool in pools:
            pool.stop()

    def __enter__(self) -> PoolSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
