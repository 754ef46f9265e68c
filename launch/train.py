"""Train a small Llama on a long-range recall task with sequence parallelism (DeepSpeed or FSDP).

Launch it as you would any training script::

    deepspeed --num_gpus 2 launch/train.py --config configs/deepspeed_ring.json
    torchrun --nproc_per_node 2 launch/train.py --config configs/fsdp_ring.json
    python launch/train.py --config configs/fsdp_ring.json --sp-size 1      # one process

On a CPU-only machine both launchers start CPU ranks (gloo).

The task. Each sample is ``BOS k1 v1 k2 v2 ... kN vN <filler ...> (SEP k v)*Q``: key/value pairs at
the start, random filler, then queries at the end whose answer is the value paired with the key
earlier. Only the answers carry a loss. With contiguous (or zigzag) sharding the pairs and the
queries sit on different ranks, so the model can only learn the task if attention crosses shards
exactly; chance accuracy is ``1 / num_values``.

The config JSON. A DeepSpeed config (recognised by DeepSpeed's own keys) or a standalone seqpar
config, with three extra sections the launcher reads and removes before the engine sees the rest::

    "sequence_parallel": {...}                        # seqpar.config.SeqParConfig
    "model": {"hidden_size": 64, ...}                 # transformers.LlamaConfig fields, or with
                                                      # "architecture": "mixtral" (a transformers model
                                                      # type) that config class's fields (sizes:
                                                      # MODEL_SIZE_RANGES); hybrids too ("jamba",
                                                      # "lfm2", ...: configs/*_hybrid.json), whose
                                                      # mixers the swap makes sequence-parallel or
                                                      # refuses by name on every rank
    "train": {"seq_len": 1024, "steps": 30, ...}      # TrainSettings below; flags override
    "fsdp": {"version": 2, ...}                       # FSDP only: integrations.fsdp.FSDPOptions

An unknown key in any of them, or at the top level (other than DeepSpeed's own keys), fails before
any process group starts, naming the key and the allowed ones. ``model.vocab_size`` may exceed what
the task needs (``3 + num_keys + num_values + filler_vocab``): the task's tokens keep the first ids
and the ids above are never sampled.

Metrics (``--metrics-out``): per-step ``loss`` (global: mean over DP replicas of the SP-group loss),
``tokens_per_s`` (global tokens of the timed steps / their wall time), ``peak_mem_bytes`` per rank
and ``peak_mem_kind`` saying what that figure is, ``recall_accuracy`` on held-out samples, and the
run's settings. A resumed run continues with the same losses as an uninterrupted one (the data of
step ``s`` depends only on the seed and ``s``).

This file is the entry point: :func:`main` in named steps. The steps live beside it in ``launch/``, imported as
the package ``seqpar_launch`` (this file names the folder so: the launcher is a script, not part of the installed
package): ``settings.py`` (the ``train`` block, the resolved :class:`Plan`), ``cli.py`` (the flags),
``config_file.py`` (the JSON and its top-level keys), ``plan.py`` (config and flags resolved and checked),
``model.py`` (the ``model`` block and the model), ``recall.py`` (the task and its accuracy), ``engines.py``
(DeepSpeed and FSDP behind the calls the loop makes), ``loop.py`` (the steps, checkpoints and peak memory) and
``report.py`` (logging, metrics, summary). ``--dynamic`` steps are planned by ``seqpar.sequence.dynamic_step`` and
driven by ``seqpar.integrations.dynamic``, as under ``SeqParTrainer``.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import logging
import os
import sys
from typing import Any

import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE = "seqpar_launch"
"""The name this folder's modules are imported under (``seqpar_launch.plan``, ...)."""


def _register_package() -> None:
    """``launch/`` as the package :data:`PACKAGE`, once per process: this file runs as a script
    (``python launch/train.py``) or is loaded by path (the tests, launch/soak.py), so ``launch/`` is on no import
    path; its modules import one another through this name."""
    if PACKAGE not in sys.modules:
        spec = importlib.machinery.ModuleSpec(PACKAGE, None, is_package=True)
        spec.submodule_search_locations = [HERE]
        sys.modules[PACKAGE] = importlib.util.module_from_spec(spec)


_register_package()

# The public names of the launcher, as tests and launch/soak.py reach them on this module.
from seqpar_launch.cli import PROG, config_error_message, parse_args  # noqa: E402
from seqpar_launch.config_file import DEEPSPEED_KEYS, LAUNCHER_KEYS  # noqa: E402, F401
from seqpar_launch.engines import DeepSpeedEngine, Engine, FSDPEngine, packed_kwargs  # noqa: E402, F401
from seqpar_launch.loop import PeakMemory, train_steps  # noqa: E402, F401
from seqpar_launch.loop import dynamic_step as _dynamic_step  # noqa: E402, F401  (tests call it by this name)
from seqpar_launch.model import (  # noqa: E402, F401
    ARCHITECTURE_KEY,
    MODEL_SIZE_RANGES,
    build_model,
    check_swap,
    config_class,
    llama_config,
    validate_model,
)
from seqpar_launch.plan import build_plan  # noqa: E402
from seqpar_launch.recall import IGNORE, RecallTask, recall_accuracy  # noqa: E402, F401
from seqpar_launch.report import configure_logging, run_metrics, summary, write_metrics  # noqa: E402
from seqpar_launch.settings import Plan, TrainSettings, compile_backends  # noqa: E402, F401

__all__ = ["TrainSettings", "RecallTask", "parse_args", "main", "cli"]

logger = logging.getLogger("seqpar")


def validate(argv: list[str] | None = None) -> Plan:
    """Everything ``--validate-only`` checks, in process: the JSON, every block, the flags, the ``model`` block
    and the swap's refusals on the model built from it (``check_swap``: the model the job builds, or on the meta
    device above ``PROBE_MAX_PARAMS``). No process group is created. Raises ConfigError/ValueError (SwapError)
    naming the key or the module and the fix."""
    plan = build_plan(parse_args(argv))
    validate_model(plan)
    check_swap(plan)
    return plan


def build_engine(plan: Plan) -> tuple[RecallTask, Engine, int]:
    """The task, the engine holding the seeded model (its process groups made), and the model's parameter count."""
    from seqpar.sequence.sharding import UNDECLARED_DEFAULT, padded_length

    task = RecallTask(plan.train)
    seq_padded = padded_length(plan.train.seq_len, plan.sp.size, plan.sp.sharding or UNDECLARED_DEFAULT)
    model = build_model(plan, task.vocab_size, seq_padded)
    n_params = sum(p.numel() for p in model.parameters())
    engine: Engine = (DeepSpeedEngine if plan.engine == "deepspeed" else FSDPEngine)(plan, model)
    if plan.train.dynamic and plan.train.compile:  # a large pool's groups must not silently run eagerly
        from seqpar.sequence.call_group import raise_recompile_limit

        raise_recompile_limit(engine.manager.pool_size)
    return task, engine, n_params


def resume(engine: Engine, save_dir: str | None, resuming: bool) -> int:
    """The step to start from: the latest checkpoint's in ``save_dir`` with ``--resume``, else 0; makes ``save_dir``
    (rank 0)."""
    manager = engine.manager
    start = 0
    if resuming:
        start = engine.load(save_dir)
        logger.info("[rank %d] resumed from step %d of %s", manager.rank, start, save_dir)
    if save_dir and manager.rank == 0:
        os.makedirs(save_dir, exist_ok=True)
    return start


def main(argv: list[str] | None = None, on_step: Any = None) -> dict[str, Any]:
    """Train; returns the metrics dict (on every rank). Raises before training on a bad config.
    ``on_step(step)``, if given, is called on every rank after each optimizer step (launch/soak.py)."""
    args = parse_args(argv)
    configure_logging(args.log_level)
    plan = build_plan(args)  # no process group yet: config errors surface first
    if args.validate_only:
        validate_model(plan)
        note = check_swap(plan)  # the model the job builds, swapped in this process: the job's SwapError, if any
        if note:
            logger.warning("%s: %s", args.config, note)
        print(f"{args.config}: valid ({plan.engine}, sp size {plan.sp.size}, mode {plan.sp.mode})", flush=True)
        return {}
    task, engine, n_params = build_engine(plan)
    manager = engine.manager
    configure_logging(args.log_level)  # now that the rank is known
    start = resume(engine, args.save_dir, args.resume)
    result = train_steps(engine, plan, task, manager, start=start, save_dir=args.save_dir,
                         progress=not args.no_progress, on_step=on_step)
    acc = recall_accuracy(engine, task, plan, first=10**9) if plan.train.eval_samples else None
    metrics = run_metrics(plan, manager, result, start=start, n_params=n_params, recall_accuracy=acc)
    if manager.rank == 0:
        print(summary(plan, manager, metrics, n_params), file=sys.stderr, flush=True)
        if args.metrics_out:
            write_metrics(args.metrics_out, metrics)
    return metrics


def cli(argv: list[str] | None = None) -> None:
    """:func:`main` as the command runs it. A config or model that seqpar's own checks refuse, before or after the
    process groups start, exits 2 with one ``train.py: error: [rank R] <type>: <message>`` on each rank (argparse's style;
    the rank once groups exist) instead of a traceback; any other exception (a bug) keeps its traceback.

    seqpar's checks after the groups start raise on every rank alike (each reads what every rank has, or agrees
    across ranks first), so each rank prints its line and exits; none is left waiting in a collective for it."""
    try:
        main(argv)
    except ValueError as e:
        message = config_error_message(e)
        if message is None:
            raise
        where = f"[rank {dist.get_rank()}] " if dist.is_available() and dist.is_initialized() else ""
        print(f"{PROG}: error: {where}{message}", file=sys.stderr, flush=True)
        # no barrier and no destroy_process_group: every rank exits on its own, none waits for another
        raise SystemExit(2) from None
    # Only after success: a rank that failed alone must not wait here for ranks stuck in a
    # collective; the launcher stops them when it exits non-zero.
    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # gloo can abort (SIGABRT) at exit when a rank destroys its group while a peer still uses it
        dist.destroy_process_group()


if __name__ == "__main__":
    cli()
