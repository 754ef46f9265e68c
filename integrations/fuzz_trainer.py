"""The composition fuzzer's trainer runner: a model trained by a Hugging Face trainer, with seqpar or without, as a
user would construct it, for the fuzzer's ``trainer`` cases (``seqpar.testing.fuzz_trainers``).

The fuzzer's harness never imports this package (tests/test_layering.py); it finds :func:`run_trainer` through the
entry-point group ``seqpar.fuzz_trainers`` (setup.cfg: one entry per trainer name, all naming this function). The
runner takes plain arguments and knows nothing of the fuzzer (it does not import ``seqpar.testing``).

Trainers (the entry-point names, :data:`TRAINERS`):

- ``trainer``: ``transformers.Trainer``, or :class:`seqpar.integrations.trainer.SeqParTrainer` under SP;
- ``sft``: ``trl.SFTTrainer``, or ``sequence_parallel(SFTTrainer)`` under SP (:mod:`seqpar.integrations.trl`);
- ``dpo``: ``trl.DPOTrainer`` / ``sequence_parallel(DPOTrainer)``; the policy is loaded from a folder it was saved
  to, so that a reference model DPOTrainer builds itself (``ref_model=None``) is loaded from the same weights;
- ``grpo``: ``trl.GRPOTrainer`` / ``sequence_parallel(GRPOTrainer)`` (the reference model, ``beta > 0``, is built
  by GRPOTrainer from the policy's folder, as for DPO). Its rollouts are sampled with the Gumbel-max trick under
  noise drawn from each row's prompt, its place in the prompt's group and the decoding step
  (:class:`_RowNoise`), not from torch's RNG: the same prompt gets the same completions whichever process holds
  it and however the batch is split over DP replicas, which one process's sampling could not match otherwise.

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

TRAINERS = ("trainer", "sft", "dpo", "grpo")
ENGINES = ("zero1", "zero2", "zero3", "fsdp2", "plain")


def word_sum(completions: list[str], **kwargs: Any) -> list[float]:
    """A reward that varies between completions: the words' ids weighted by place, mod 7."""
    return [float(sum((i + 1) * int(w[1:]) for i, w in enumerate(c.split()) if w.startswith("t")) % 7)
            for c in completions]


def length(completions: list[str], **kwargs: Any) -> list[float]:
    """A reward for short completions: minus the word count."""
    return [-float(len(c.split())) for c in completions]


REWARDS = {"word_sum": word_sum, "length": length}
"""GRPO's reward functions by name (deterministic: the same completions score the same on every process)."""


def _from_folder(model: nn.Module | None, folder: str, like: nn.Module | None = None) -> nn.Module:
    """``model`` saved to ``folder/model`` and loaded back (its config then names the folder, from which DPO's
    and GRPO's trainers build their reference model), in its dtype; ``model=None``: another copy of ``like``'s
    saved weights."""
    import os

    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if distributed:  # transformers writes on the first rank only: every rank reads its folder
        shared = [folder]
        torch.distributed.broadcast_object_list(shared, src=0)
        folder = shared[0]
    path = os.path.join(folder, "model")
    if model is not None:
        model.save_pretrained(path)
        if distributed:
            torch.distributed.barrier()
    source = model if model is not None else like
    implementations = {key: getattr(source.config, f"_{key}") for key in ("attn_implementation",
                                                                          "experts_implementation")
                       if getattr(source.config, f"_{key}", None) is not None}
    loaded = type(source).from_pretrained(path, dtype=source.dtype, **implementations)
    loaded.config.use_cache = False
    if distributed:
        # every rank has read the folder before any goes on: rank 0 deletes it when it leaves run_trainer, and a rank
        # refused early (a ConfigError at construction) left while the others still read it (FileNotFoundError on
        # ranks 1-2, so a refusal on every rank read as a crash: fuzzer cases 934084441, 1664443607 at P = 3)
        torch.distributed.barrier()
    return loaded


class _RowNoise:
    """A logits processor that makes greedy decoding a sample of ``softmax(logits)`` (the Gumbel-max trick) whose
    noise is a function of the row's prompt (its tokens without padding), its place in the prompt's group of
    ``generations`` consecutive rows (GRPO's sampler repeats each prompt that many times in a row; seqpar requires
    whole groups on each rank) and the decoding step: the same on every process and batch split."""

    def __init__(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, generations: int) -> None:
        self.width = prompt_ids.shape[1]
        self.keys = [hash((tuple(ids[mask.bool()].tolist()), row % generations))
                     for row, (ids, mask) in enumerate(zip(prompt_ids, prompt_mask, strict=True))]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step = input_ids.shape[1] - self.width
        noise = torch.stack([
            -torch.log(-torch.log(torch.rand(scores.shape[1], generator=torch.Generator().manual_seed(
                (key * 1000003 + step) % 2 ** 63), dtype=torch.float64).clamp(min=1e-300)))
            for key in self.keys])
        return scores + noise.to(scores.device, scores.dtype)


def _sample_by_row(model: nn.Module, generations: int) -> None:
    """``model.generate`` (an instance attribute: this model only) decodes greedily through :class:`_RowNoise`
    (GRPOTrainer's generation config has ``do_sample=False`` from the runner's ``generation_kwargs``)."""
    import transformers

    generate = model.generate

    def sampled(*args: Any, **kwargs: Any) -> Any:
        ids, mask = kwargs["input_ids"], kwargs["attention_mask"]
        kwargs["logits_processor"] = transformers.LogitsProcessorList([_RowNoise(ids, mask, generations)])
        return generate(*args, **kwargs)

    model.generate = sampled


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
            out[_clean(name)] = full.detach().clone().cpu()
    return out


def _clean(name: str) -> str:
    """A parameter's name without FSDP's / checkpointing's wrapper prefixes, nor PEFT's outer ``base_model.model.``
    (the same on every side however the model is wrapped)."""
    name = name.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", "")
    return name.removeprefix("base_model.model.")


def _lora_config(lora: dict[str, Any]) -> Any:
    """peft's ``LoraConfig`` of the fuzzer's draw (``r``, ``alpha``, ``targets``, ``init``, ``modules_to_save``;
    the variants ``rslora`` (``use_rslora``), ``bias``, ``embed`` (``embed_tokens`` among the targets) and ``dora``
    (``use_dora``), each off when absent).
    Dropout is 0: LoRA's dropout masks come from torch's RNG on each process, which no split of the sequence or the
    batch over ranks can draw the same as one process."""
    import peft

    targets = list(lora["targets"]) + (["embed_tokens"] if lora.get("embed") else [])
    return peft.LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], target_modules=targets,
                           lora_dropout=0.0, init_lora_weights=lora["init"] != "random",
                           modules_to_save=lora["modules_to_save"], task_type="CAUSAL_LM",
                           use_rslora=lora.get("rslora", False), bias=lora.get("bias", "none"),
                           use_dora=lora.get("dora", False))


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
            ``packing``, ``padding_free``, ``assistant_only_loss``, ``loss_type``, ``max_length``; for ``dpo``
            ``dpo_loss`` (the loss types), ``loss_weights``, ``dpo_smoothing``, ``beta``, ``ld_alpha``,
            ``use_weighting``, ``ref_model`` (``"given"``: a second model of the same weights; ``"built"``:
            DPOTrainer's own), ``sync_ref_model``, ``precompute_ref``; for ``grpo`` ``num_generations``,
            ``num_iterations``, ``scale_rewards``, ``grpo_loss``, ``beta``, ``epsilon``, ``rewards`` (names in
            :data:`REWARDS`), ``reward_weights``, ``max_completion_length``; for every trainer ``lora`` (None, or
            the LoRA adapter's ``r``, ``alpha``, ``targets``, ``init`` (``"default"`` / ``"random"``),
            ``modules_to_save`` and ``seed``, the variants ``rslora``, ``bias``, ``embed``, ``dora``, and ``premade``:
            ``get_peft_model`` before ``trainer`` (and before TRL's with ``premade``), ``peft_config=`` to TRL's).
        config: the ``sequence_parallel`` block (``size``, ``mode``, ``sharding``).

    Returns:
        ``{"logs": [each logged training step's entry], "evals": [each evaluation's entry], "before" / "after":
        {parameter name: whole tensor} at the start and end of training, "trainable": [the names of the
        parameters that require grad], "dp_sp": (dp, sp) or None}``.

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
        if trainer in ("dpo", "grpo") and engine.startswith("zero"):
            # As accelerate does on an accelerator before any engine (it skips it under use_cpu=True): DPO's and
            # GRPO's trainers build their reference model's DeepSpeed engine in __init__, before the policy's
            # engine starts DeepSpeed's comm; without it DeepSpeed counts a world of 1 for that engine's batch
            # check ("train_batch_size ... 6 != 1 * 2 * 1" at ZeRO-3 in a fresh pool, case 1055730221)
            import deepspeed

            if not deepspeed.comm.is_initialized():
                deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, dist_init_required=False)
        if trainer in ("dpo", "grpo"):
            model = _from_folder(model, out_dir)
            # a reference model the trainer builds from the folder gets the policy's experts implementation (the
            # tiny MoE models run "eager": grouped_mm takes no float64)
            experts = getattr(model.config, "_experts_implementation", None)
            common["model_init_kwargs"] = {"experts_implementation": experts} if experts else None
        if trainer == "dpo":
            import trl

            args = trl.DPOConfig(
                **common, bf16=False, loss_type=list(knobs["dpo_loss"]), loss_weights=knobs["loss_weights"],
                label_smoothing=knobs["dpo_smoothing"], beta=knobs["beta"], ld_alpha=knobs["ld_alpha"],
                use_weighting=knobs["use_weighting"], sync_ref_model=knobs["sync_ref_model"], ref_model_sync_steps=1,
                precompute_ref_log_probs=knobs["precompute_ref"])
            cls = trl.DPOTrainer
            kwargs["processing_class"] = data["tokenizer"]
            if knobs["ref_model"] == "given":
                kwargs["ref_model"] = _from_folder(None, out_dir, like=model)
        elif trainer == "grpo":
            import trl

            args = trl.GRPOConfig(
                **common, bf16=False, num_generations=knobs["num_generations"],
                num_iterations=knobs["num_iterations"], scale_rewards=knobs["scale_rewards"],
                loss_type=knobs["grpo_loss"], beta=knobs["beta"], epsilon=knobs["epsilon"],
                reward_weights=knobs["reward_weights"], max_completion_length=knobs["max_completion_length"],
                temperature=1.0, shuffle_dataset=False, generation_kwargs={"do_sample": False})
            cls = trl.GRPOTrainer
            kwargs["processing_class"] = data["tokenizer"]
            kwargs["reward_funcs"] = [REWARDS[name] for name in knobs["rewards"]]
            _sample_by_row(model, knobs["num_generations"])
        elif trainer == "sft":
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
        lora = knobs.get("lora")
        if lora is not None:
            peft_config = _lora_config(lora)
            # the adapter's random init (A, and B under init_lora_weights=False) from the case's seed on both sides
            # (peft draws it in fp32 and casts it to the model's dtype: the fp32 ranks and the float64 reference get
            # the same values)
            torch.manual_seed(lora["seed"])
            if trainer == "trainer" or lora.get("premade"):
                import peft

                # as a user wires LoRA into Trainer, or hands a TRL trainer a PeftModel of their own (DPO / GRPO
                # with a reference from the policy then copy the adapter as a frozen "ref" adapter)
                model = peft.get_peft_model(model, peft_config)
            else:
                kwargs["peft_config"] = peft_config  # TRL's trainers wrap the model themselves
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
        trainable = sorted(_clean(n) for n, p in built.model.named_parameters() if p.requires_grad)
        return {"logs": [h for h in history if "loss" in h and "train_runtime" not in h],
                "trainable": trainable,
                "evals": [h for h in history if "eval_loss" in h],
                "before": snapshots["before"], "after": snapshots["after"],
                "dp_sp": None if manager is None else (manager.dp_size, manager.sp_size)}
