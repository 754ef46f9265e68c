"""The composition fuzzer's trainer runner: a model trained by a Hugging Face trainer, with seqpar or without, as a
user would construct it, for the fuzzer's ``trainer`` cases (``seqpar.testing.fuzz_trainers``).

The fuzzer's harness never imports this package (tests/test_layering.py); it finds :func:`run_trainer` through the
entry-point group ``seqpar.fuzz_trainers`` (setup.cfg: one entry per trainer name, all naming this function). The
runner takes plain arguments and knows nothing of the fuzzer (it does not import ``seqpar.testing``).

Trainers (the entry-point names, :data:`TRAINERS`):

- ``trainer``: ``transformers.Trainer``, or :class:`seqpar.integrations.trainer.SeqParTrainer` under SP;
- ``sft``: ``trl.SFTTrainer``, or ``sequence_parallel(SFTTrainer)`` under SP (:mod:`seqpar.integrations.trl`).

Engines: ``zero1`` / ``zero2`` / ``zero3`` (``TrainingArguments(deepspeed=...)`` with a ``sequence_parallel``
block: Trainer builds the engine through accelerate, seqpar's mixin routes it to seqpar's ``initialize``),
``fsdp2`` (``seqpar_config=``: the mixin shards with FSDP2), and ``plain``: the trainer class itself, no seqpar,
no engine (the reference). The optimizer is always plain SGD (``optim="sgd"``, constant rate, no weight decay):
its update is proportional to the gradient, so a gradient off by a factor shows in the parameters (Adam would hide
it).
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["TRAINERS", "ENGINES", "run_trainer"]

TRAINERS = ("trainer", "sft")
ENGINES = ("zero1", "zero2", "zero3", "fsdp2", "plain")


@contextlib.contextmanager
def _gathered(model: nn.Module) -> Iterator[None]:
    """ZeRO-3's partitioned parameters gathered whole for the block (collective); anything else as it is."""
    params = [p for p in model.parameters() if hasattr(p, "ds_id")]
    if not params:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        yield


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, whole, by its name in the unwrapped model (FSDP2's DTensors and ZeRO-3's partitions
    gathered: collective, every rank calls)."""
    out = {}
    with _gathered(model):
        for name, p in model.named_parameters():
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            clean = name.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", "")
            out[clean] = full.detach().clone().cpu()
    return out


def _ds_config(engine: str, block: dict[str, Any]) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto", "gradient_clipping": "auto",
            "zero_optimization": {"stage": int(engine[-1])}, "steps_per_print": 10 ** 6,
            "sequence_parallel": block}


def run_trainer(trainer: str, engine: str, model: nn.Module, data: dict[str, Any], knobs: dict[str, Any],
                config: dict[str, Any] | None) -> dict[str, Any]:
    """Train ``model`` for ``knobs["steps"]`` optimizer steps with ``trainer`` on this rank (every rank of the
    default group calls; the launcher's environment, ``RANK`` / ``WORLD_SIZE`` ..., is the caller's).

    Args:
        trainer: one of :data:`TRAINERS`.
        engine: one of :data:`ENGINES` (``plain``: no seqpar, ``config`` ignored).
        model: the model to train (the same on every rank).
        data: ``train`` and ``eval`` (``eval`` None: no evaluation) data sets as the trainer takes them,
            ``collator`` (``trainer`` only; None: transformers' default) and ``tokenizer`` (``sft``: the
            processing class).
        knobs: ``micro`` (per-device batch), ``accumulation``, ``steps``, ``lr``, ``max_grad_norm``,
            ``average_tokens`` (``average_tokens_across_devices``), ``label_smoothing``, ``eval_batch`` (the
            per-device eval batch, default 1); for ``sft`` also
            ``packing``, ``padding_free``, ``assistant_only_loss``, ``loss_type``, ``max_length``.
        config: the ``sequence_parallel`` block (``size``, ``mode``, ``sharding``).

    Returns:
        ``{"logs": [each logged training step's entry], "evals": [each evaluation's entry], "before" / "after":
        {parameter name: whole tensor} at the start and end of training, "dp_sp": (dp, sp) or None}``.

    Raises:
        ValueError: an unknown trainer or engine; whatever seqpar or the trainer raises otherwise.
    """
    import transformers

    if trainer not in TRAINERS:
        raise ValueError(f"unknown trainer {trainer!r}: choose one of {list(TRAINERS)}")
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}: choose one of {list(ENGINES)}")
    snapshots: dict[str, dict[str, torch.Tensor]] = {}

    class Snapshots(transformers.TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            snapshots["before"] = _snapshot(model)

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            snapshots["after"] = _snapshot(model)

    with tempfile.TemporaryDirectory(prefix="seqpar-fuzz-trainer-") as out_dir:
        common = dict(
            output_dir=out_dir, per_device_train_batch_size=knobs["micro"],
            gradient_accumulation_steps=knobs["accumulation"], max_steps=knobs["steps"], learning_rate=knobs["lr"],
            optim="sgd", lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=knobs["max_grad_norm"],
            average_tokens_across_devices=knobs["average_tokens"], label_smoothing_factor=knobs["label_smoothing"],
            logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0,
            train_sampling_strategy="sequential", prediction_loss_only=True, per_device_eval_batch_size=knobs.get("eval_batch", 1),
            eval_strategy="steps" if data.get("eval") is not None else "no", eval_steps=1,
            deepspeed=_ds_config(engine, config) if engine.startswith("zero") else None,
        )
        kwargs: dict[str, Any] = {"train_dataset": data["train"], "eval_dataset": data.get("eval"),
                                  "callbacks": [Snapshots()]}
        if trainer == "sft":
            import trl

            args = trl.SFTConfig(**common, packing=knobs["packing"], padding_free=knobs["padding_free"],
                                 assistant_only_loss=knobs["assistant_only_loss"], loss_type=knobs["loss_type"],
                                 max_length=knobs["max_length"], bf16=False)
            cls = trl.SFTTrainer
            kwargs["processing_class"] = data["tokenizer"]
        else:
            args = transformers.TrainingArguments(**common)
            cls = transformers.Trainer
            kwargs["data_collator"] = data.get("collator")
        if engine != "plain":
            from seqpar.integrations.trainer import sequence_parallel

            cls = sequence_parallel(cls)
            if engine == "fsdp2":
                kwargs["seqpar_config"] = config
        built = cls(model=model, args=args, **kwargs)
        built.remove_callback(transformers.PrinterCallback)  # disable_tqdm's printing of every log to stdout
        built.train()
        history = built.state.log_history
        manager = getattr(built, "seqpar_manager", None)
        return {"logs": [h for h in history if "loss" in h and "train_runtime" not in h],
                "evals": [h for h in history if "eval_loss" in h],
                "before": snapshots["before"], "after": snapshots["after"],
                "dp_sp": None if manager is None else (manager.dp_size, manager.sp_size)}
