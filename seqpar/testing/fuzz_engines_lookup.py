"""The ``engine`` kind's installed code, found by entry point (setup.cfg; the harness never imports
``seqpar.integrations``): the engine runners (:data:`ENTRY_POINT_GROUP`, :class:`EngineRunner`,
:func:`engine_runner`), the adapters' checks the draws ask (:data:`CHECK_ENTRY_POINT_GROUP`) and the folder whose
errors are the adapters' own (:func:`runner_dir`). The kind itself is :mod:`seqpar.testing.fuzz_engines`.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Protocol

from torch import nn

ENTRY_POINT_GROUP = "seqpar.fuzz_engines"
CHECK_ENTRY_POINT_GROUP = "seqpar.fuzz_engine_checks"
"""The adapters' refusals the draws ask (setup.cfg): ``vocab_split_tied_embedding`` names
``seqpar.integrations.deepspeed_tp.refuse_unsplittable_tied_embedding`` (:func:`vocab_split_refused`)."""


class EngineRunner(Protocol):
    """What an entry point of :data:`ENTRY_POINT_GROUP` names: one step of a model through an engine, called
    on every rank of the default process group.

    Args:
        engine: the engine's name (the entry point's name, one of :data:`seqpar.testing.fuzz_engines.ENGINES`).
        build_model: makes the case's model (the same on every rank; activation checkpointing already set).
        batches: the case's full (unsharded) batches, as the model takes them; the runner shards each with
            :func:`seqpar.shard_batch` on its SP group and ``config["sharding"]``.
        config: the ``sequence_parallel`` config (``size``, ``tp_size``, ``mode``, ``sharding``,
            ``ulysses_size``, ``check_inputs``; ``tp2`` cases also ``tp_sequence_parallel`` and ``tiled_loss``).
        accumulate: one backward per batch (gradient accumulation); else every forward, then one backward of
            the summed losses.

    Returns:
        ``{"loss": float (summed over the batches), "grads": {parameter name: reduced full gradient}}`` (on
        every rank). A refusal is raised (seqpar's errors, or the runner's own ``ValueError``).
    """

    def __call__(self, engine: str, build_model: Callable[[], nn.Module], batches: list[dict[str, Any]],
                 config: dict[str, Any], *, accumulate: bool) -> dict[str, Any]: ...


def engine_runner(engine: str, group: str = ENTRY_POINT_GROUP, what: str = "engine runner",
                  declared: str = "run_engine") -> EngineRunner:
    """The installed runner of ``engine`` (the entry point of that name in ``group``, default
    :data:`ENTRY_POINT_GROUP`; the ``dynamic`` kind's runners are another group, ``what`` and ``declared`` name
    them in the error).

    Raises:
        LookupError: none is installed (seqpar installed without its metadata, e.g. a source tree on
            ``sys.path``, or metadata older than the group: ``pip install -e .`` declares seqpar's own).
    """
    found = entry_points(group=group, name=engine)
    if not found:
        raise LookupError(
            f"no fuzzer {what} for {engine!r}: no entry point {engine!r} in group {group!r} "
            f"(installed: {sorted(ep.name for ep in entry_points(group=group))}). Install seqpar "
            f"(pip install -e . in a checkout), which declares "
            f"{declared if ':' in declared else 'seqpar.integrations.fuzz_engine:' + declared} in setup.cfg")
    return next(iter(found)).load()


def runner_dir(runner: Any) -> Path:
    """The folder of the package that holds ``runner``'s module: errors raised there are the adapters' own
    refusals (``integrations/`` in a checkout, ``seqpar/integrations`` in a wheel)."""
    import sys

    return Path(sys.modules[runner.__module__].__file__).resolve().parent
