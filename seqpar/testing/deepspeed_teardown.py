"""Destroy the DeepSpeed engines a task made, in the task that made them.

A pool rank (:mod:`seqpar.testing.ranks`) runs hundreds of tasks in one process, so an engine a task
leaves behind lives on: its gradient hooks (held by torch in C++, out of the cycle collector's sight)
keep the optimizer, the model and the process groups alive, 3 gloo threads per group. A task that makes
engines therefore runs under :func:`releases_deepspeed_engines` (a decorator) or
:func:`released_deepspeed_engines` (a ``with`` block): every engine ``deepspeed.initialize`` returns
inside it, directly or through seqpar's, HF Trainer's or accelerate's wrappers, is released when the
block ends, on success or failure, by :func:`release_deepspeed_engine`.

``engine.destroy()`` removes the hooks, but DeepSpeed keeps three pieces of module-level state that
outlive it (read in DeepSpeed 0.19.8's source; without either of the first two, a ZeRO-3 model outlives
its released engine: ``tests/test_groups.py::test_released_deepspeed_engines_free_their_threads``):

- ``deepspeed.runtime.zero.parameter_offload.FWD_MODULE_STACK``: ZeRO-3 pushes each engine's model on it
  (``setup_zero_stage3_hooks``) and never pops it;
- ``PartitionedParameterCoordinator.__params_to_release``: an unbounded ``functools.lru_cache`` on a
  method, keyed by (coordinator, submodule, step), under an nvtx wrapper: it holds every ZeRO-3 model;
- ``deepspeed.utils.groups.mpu`` / ``mesh_device``: the last engine's model-parallel unit and mesh, which
  the next engine given no ``mpu`` would use (their groups destroyed by then).

Those reaches into DeepSpeed's private state are pinned: :data:`DEEPSPEED_CHECKED` is the range of
DeepSpeed versions they were read and tested on, and outside it this module raises on import (and
:func:`release_deepspeed_engine` on use), naming both versions, so an upgrade re-checks them instead of
leaking quietly.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import sys
from collections.abc import Callable, Iterator
from typing import Any

from packaging.version import Version

__all__ = [
    "DEEPSPEED_CHECKED",
    "check_deepspeed_version",
    "release_deepspeed_engine",
    "released_deepspeed_engines",
    "releases_deepspeed_engines",
]

DEEPSPEED_CHECKED = ("0.19.8", "0.19.8")
"""(oldest, newest) DeepSpeed release whose source the private reaches below were read against and
whose engines ``tests/test_groups.py`` saw released by them (inclusive)."""


def check_deepspeed_version(version: str) -> None:
    """Raise ``RuntimeError`` unless ``version`` lies in :data:`DEEPSPEED_CHECKED`.

    Raises:
        RuntimeError: naming ``version``, the checked range, and what to re-check.
    """
    low, high = DEEPSPEED_CHECKED
    if not Version(low) <= Version(version) <= Version(high):
        raise RuntimeError(
            f"seqpar.testing.deepspeed_teardown reaches into DeepSpeed's private state (ZeRO-3's "
            f"FWD_MODULE_STACK, PartitionedParameterCoordinator's __params_to_release cache) and was checked "
            f"on DeepSpeed {low}..{high}; this is DeepSpeed {version}. Read that release's "
            f"runtime/zero/parameter_offload.py and partitioned_param_coordinator.py, check what "
            f"engine.destroy() now releases (tests/test_groups.py::test_released_deepspeed_engines_free_their_"
            f"threads), then widen DEEPSPEED_CHECKED"
        )


def _installed_deepspeed() -> str | None:
    try:
        return importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        return None


if _installed_deepspeed() is not None:  # module-level: an unchecked DeepSpeed fails every engine test at once
    check_deepspeed_version(_installed_deepspeed())


def _params_to_release_cache() -> Any:
    """The ``functools.lru_cache`` DeepSpeed 0.19.8 puts on ``PartitionedParameterCoordinator.__params_to_release``
    (name-mangled; under ``instrument_w_nvtx``, which keeps it in its closure), or None before ZeRO-3 loads."""
    module = sys.modules.get("deepspeed.runtime.zero.partitioned_param_coordinator")
    if module is None:
        return None
    method = vars(module.PartitionedParameterCoordinator)["_PartitionedParameterCoordinator__params_to_release"]
    for fn in [method, *(cell.cell_contents for cell in method.__closure__ or ())]:
        if hasattr(fn, "cache_clear"):
            return fn
    raise RuntimeError("DeepSpeed's PartitionedParameterCoordinator.__params_to_release has no lru_cache here "
                       "any more: re-check seqpar.testing.deepspeed_teardown against this DeepSpeed")


def release_deepspeed_engine(engine: Any) -> None:
    """``engine.destroy()``, then drop what DeepSpeed still holds of it at module level (see the module
    docstring). This rank only (no collective); idempotent. The caller drops its own references after."""
    import deepspeed

    check_deepspeed_version(deepspeed.__version__)
    engine.destroy()
    model = getattr(engine, "module", None)
    offload = sys.modules.get("deepspeed.runtime.zero.parameter_offload")
    if offload is not None and model is not None:
        # the model, and submodules a forward that raised half-way left pushed
        mine = {id(m) for m in model.modules()}
        offload.FWD_MODULE_STACK[:] = [m for m in offload.FWD_MODULE_STACK if id(m) not in mine]
    cache = _params_to_release_cache()
    if cache is not None:  # one cache for every coordinator: live engines refill it on their next step
        cache.cache_clear()
    ds_groups = sys.modules.get("deepspeed.utils.groups")
    if ds_groups is not None:
        for attr in ("mpu", "mesh_device"):
            mine = getattr(engine, attr, None)
            if mine is not None and getattr(ds_groups, attr, None) is mine:
                setattr(ds_groups, attr, None)


def _allow_float64_zero3() -> Callable[[], None]:
    """Let ZeRO-3's ``zero.Init`` take float64 parameters for the block; returns what undoes it.

    Under AutoTP seqpar leaves ZeRO-3's conversion to DeepSpeed (AutoTP shards first), whose
    ``DeepSpeedZeRoOffload._convert_to_zero_parameters`` builds ``zero.Init`` in the parameters' dtype, and DeepSpeed
    0.19.8 as published on PyPI asserts that dtype is half, bfloat16 or float32 (``InsertPostInitMethodToModuleSubClasses``).
    The suite's exactness tests run tiny models in float64 against a float64 process; on CPU with gloo ZeRO-3 partitions,
    gathers and reduce-scatters float64 like any dtype (those tests, and fuzzer case 1878399021 in float64, are exact
    with the assertion's list widened; the session-33 fresh install hit it, the DeepSpeed build of earlier sessions did
    not). Test-only: a user's float64 model under AutoTP and ZeRO-3 still meets DeepSpeed's own assertion."""
    import torch
    from deepspeed.runtime.zero import partition_parameters as pp

    cls = pp.InsertPostInitMethodToModuleSubClasses
    original = cls.__init__

    @functools.wraps(original)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("dtype") is not torch.float64:
            original(self, *args, **kwargs)
            return
        original(self, *args, **{**kwargs, "dtype": torch.float32})  # past the allow-list
        self.dtype = torch.float64  # then the parameters' own dtype, as a widened list would keep it

    cls.__init__ = init

    def undo() -> None:
        cls.__init__ = original

    return undo


@contextlib.contextmanager
def released_deepspeed_engines() -> Iterator[list]:
    """Within the block, record every engine ``deepspeed.initialize`` returns; release them all at its end.

    ``deepspeed.initialize`` is wrapped for the block's duration (and put back after), so engines made by
    wrappers the caller never sees (HF Trainer, accelerate, ``launch/train.py``) are released too. Yields
    the list of engines made so far. Where DeepSpeed is not installed, no engine can be made: a plain block.
    """
    try:
        import deepspeed
    except ImportError:
        yield []
        return
    check_deepspeed_version(deepspeed.__version__)
    engines: list = []
    original = deepspeed.initialize

    @functools.wraps(original)
    def initialize(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        engines.append(out[0])
        return out

    deepspeed.initialize = initialize
    undo_float64 = _allow_float64_zero3()
    try:
        yield engines
    finally:
        undo_float64()
        deepspeed.initialize = original
        for engine in reversed(engines):
            release_deepspeed_engine(engine)
        engines.clear()


def releases_deepspeed_engines(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a task function (module-level, so it still pickles by name): it runs inside
    :func:`released_deepspeed_engines`."""

    @functools.wraps(fn)
    def task(*args: Any, **kwargs: Any) -> Any:
        with released_deepspeed_engines():
            return fn(*args, **kwargs)

    return task
