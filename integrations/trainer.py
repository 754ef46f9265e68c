"""``transformers.Trainer`` + DeepSpeed with sequence parallelism: use :class:`SeqParTrainer`.

The one step: put a ``"sequence_parallel"`` block in the DeepSpeed JSON given to
``TrainingArguments(deepspeed="ds_config.json")`` and construct ``SeqParTrainer`` where ``Trainer``
was constructed (same arguments). The model code, the data collator and ``compute_loss`` stay as
they are::

    args = TrainingArguments(output_dir="out", deepspeed="ds_config.json", ...)
    trainer = SeqParTrainer(model=model, args=args, train_dataset=ds, data_collator=collator)
    trainer.train()

What it changes in Trainer, and why (each a small override or hook):

- **Groups and the model** (``__init__``): the SP x DP groups are built from the block
  (:func:`seqpar.runtime.groups.init_process_groups`; torch.distributed is already up, ``TrainingArguments``
  started it) and the model's attention is swapped (:func:`seqpar.swap.swap_attention`). The swapped
  Hugging Face model's ``labels=`` loss is the SP-exact token-weighted one (:mod:`seqpar.swap.hf`),
  so Trainer's default ``compute_loss`` is right.
- **DeepSpeed gets seqpar's groups** (the hook): Trainer creates the engine itself, through
  ``accelerator.prepare`` -> accelerate's DeepSpeed path -> ``deepspeed.initialize(model=...,
  config_params=...)``, which has no way to pass an ``mpu``. While *this trainer's*
  ``accelerator.prepare`` runs, ``deepspeed.initialize`` is routed to
  :func:`seqpar.integrations.deepspeed.initialize` with the trainer's manager (so ``mpu`` = the
  manager, the ZeRO-3 partition and gradient average fixed as there), and the config's
  ``train_batch_size`` is corrected to ``micro x accumulation x dp`` (accelerate and Trainer fill it
  with the world size, which DeepSpeed refuses once the mpu says the DP size is ``world / sp``). The
  patch is scoped to that call and removed after it, also on error.
- **Same samples on an SP group**: accelerate's ``prepare`` splits loaders over all processes; this
  trainer's accelerator splits them over the DP axis only
  (:func:`seqpar.integrations.accelerate.prepare_data_loader`).
- **Batches are cut** in ``training_step`` / ``prediction_step`` with :func:`seqpar.sequence.batch.shard_batch`
  (labels shifted on the full sequence, before the cut), *after* Trainer counted the target tokens.
- **Token counts** (``num_items_in_batch``): Trainer sums the count over all processes
  (``average_tokens_across_devices``), which counts every sample ``sp`` times; it is divided by
  ``sp``. Trainer then multiplies the loss by the process count so that an average of gradients over
  all ranks is right; DeepSpeed with seqpar's mpu averages over the ``dp`` replicas only (summing the
  SP ranks' gradient shares), so the factor becomes ``dp``. The logged loss is the single-device one.
  ``num_input_tokens_seen`` and ``total_flos`` (also summed over all processes) count each SP
  group's batch once as well.
- **Packed batches** (``data_collator=transformers.DataCollatorWithFlattening()``) need nothing
  more: ``shard_batch`` takes the documents' global boundaries from the full row before the cut, the
  collator's ``-100`` at each document start keeps the shifted labels from crossing documents, and
  Trainer's count of those labels is each row's real targets.

Only the DeepSpeed path is covered; an accelerate loop with FSDP2 uses
:func:`seqpar.integrations.accelerate.prepare`. accelerate's own ``ParallelismConfig`` with
``cp_size``/``sp_size`` > 1 is another SP implementation and is refused alongside this one.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import transformers

from seqpar.config import ConfigError, SeqParConfig
from seqpar.integrations.accelerate import prepare_data_loader
from seqpar.integrations.common import rank_prefix, resolve_manager
from seqpar.runtime.groups import ProcessGroupManager
from seqpar.sequence.batch import shard_batch

__all__ = ["SeqParTrainer", "deepspeed_initialize_with"]

logger = logging.getLogger("seqpar")


@contextlib.contextmanager
def deepspeed_initialize_with(manager: ProcessGroupManager, sp_config: SeqParConfig) -> Iterator[None]:
    """Within the block, ``deepspeed.initialize`` runs as seqpar's with ``manager`` as the groups.

    For callers that build the engine through code they do not own (accelerate's DeepSpeed plugin).
    The model is not swapped again (the caller swapped it); ``train_batch_size`` is set to
    ``micro x accumulation x dp``.
    """
    import deepspeed

    from seqpar.integrations.deepspeed import initialize as seqpar_initialize

    original = deepspeed.initialize

    def initialize(**kwargs: Any) -> Any:
        if kwargs.get("mpu") is not None:
            raise ConfigError(
                "accelerate passed its own mpu to DeepSpeed (a ParallelismConfig with sp_size > 1): that "
                "is DeepSpeed's Ulysses SP, which cannot be combined with seqpar's; remove one of them"
            )
        kwargs.pop("mpu", None)
        config = dict(kwargs.pop("config_params", None) or kwargs.pop("config"))
        config["train_batch_size"] = (
            config["train_micro_batch_size_per_gpu"] * config.get("gradient_accumulation_steps", 1)
            * manager.dp_size
        )
        deepspeed.initialize = original  # seqpar's initialize calls DeepSpeed's
        try:
            return seqpar_initialize(**kwargs, config=config, seqpar_config=sp_config, manager=manager,
                                     swap=False)
        finally:
            deepspeed.initialize = initialize

    deepspeed.initialize = initialize
    try:
        yield
    finally:
        deepspeed.initialize = original


def _sp_config_from_args(args: Any, seqpar_config: SeqParConfig | Mapping[str, Any] | None) -> SeqParConfig:
    from seqpar.integrations.deepspeed import load_deepspeed_config

    if args is None or not getattr(args, "deepspeed", None):
        raise ConfigError(
            "SeqParTrainer runs on DeepSpeed: pass TrainingArguments(deepspeed='ds_config.json') whose "
            "JSON has a 'sequence_parallel' block. For an accelerate loop with FSDP2 use "
            "seqpar.integrations.accelerate.prepare"
        )
    if seqpar_config is not None:
        return SeqParConfig.load(seqpar_config)
    return SeqParConfig.from_deepspeed_config(load_deepspeed_config(config=args.deepspeed))


class SeqParTrainer(transformers.Trainer):
    """``transformers.Trainer`` with sequence parallelism from the DeepSpeed config's block.

    Takes ``Trainer``'s arguments, plus keyword-only ``seqpar_config`` (overrides the block). The
    groups are ``trainer.seqpar_manager``; see the module docstring for what is changed and why.

    Raises:
        ConfigError: no DeepSpeed config, a bad ``sequence_parallel`` block, or accelerate's own
            context/sequence parallelism requested as well.
        seqpar.swap.SwapError: the model's attention cannot be swapped.
    """

    def __init__(self, model: Any = None, args: Any = None, *posargs: Any,
                 seqpar_config: SeqParConfig | Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        self.seqpar_config = _sp_config_from_args(args, seqpar_config)
        pc = getattr(args, "parallelism_config", None)
        if pc is not None and (getattr(pc, "cp_size", 1) > 1 or getattr(pc, "sp_size", 1) > 1):
            raise ConfigError(
                "TrainingArguments.parallelism_config asks for accelerate's context/sequence parallelism "
                "(cp_size/sp_size > 1), which cannot be combined with seqpar's; remove it or use "
                "transformers.Trainer without seqpar"
            )
        if getattr(args, "train_sampling_strategy", None) == "batch_rebalance":
            raise ConfigError(
                "train_sampling_strategy='batch_rebalance' splits batches over every process, so the "
                "ranks of one SP group would train on different samples; use 'random', 'sequential' "
                "or 'group_by_length' with SeqParTrainer"
            )
        self.seqpar_manager = resolve_manager(self.seqpar_config, None)
        if model is not None and self.seqpar_config.swap != "none":
            from seqpar.swap import swap_attention

            swap_attention(model, self.seqpar_config, group=self.seqpar_manager.sp_group)
        super().__init__(model, args, *posargs, **kwargs)
        logger.info("%s seqpar: Trainer over dp %d x sp %d", rank_prefix(),
                    self.seqpar_manager.dp_size, self.seqpar_manager.sp_size)

    # ------------------------------------------------------------------ engine and data loaders
    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        accelerator = self.accelerator
        manager = self.seqpar_manager

        def dp_prepare_data_loader(data_loader: Any, device_placement: Any = None,
                                   slice_fn_for_dispatch: Any = None) -> Any:
            return prepare_data_loader(accelerator, data_loader, manager)

        # Instance attributes shadow the Accelerator methods for this trainer's accelerator only.
        accelerator.prepare_data_loader = dp_prepare_data_loader
        prepare = accelerator.prepare

        @functools.wraps(prepare)
        def prepare_with_seqpar_groups(*args: Any, **kwargs: Any) -> Any:
            with deepspeed_initialize_with(manager, self.seqpar_config):
                return prepare(*args, **kwargs)

        accelerator.prepare = prepare_with_seqpar_groups

    # ------------------------------------------------------------------ batches and token counts
    def _sp_shard(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        return shard_batch(inputs, group=self.seqpar_manager.sp_group, sharding=self.seqpar_config.sharding)

    def _counts_every_sp_rank(self, num_items_in_batch: Any) -> bool:
        """Trainer summed ``num_items_in_batch`` over all processes (each SP rank counted once)."""
        return (num_items_in_batch is not None and self.args.average_tokens_across_devices
                and self.args.world_size > 1)

    def get_batch_samples(self, epoch_iterator: Iterator, num_batches: int,
                          device: torch.device) -> tuple[list, Any]:
        batches, num_items_in_batch = super().get_batch_samples(epoch_iterator, num_batches, device)
        if self._counts_every_sp_rank(num_items_in_batch):
            num_items_in_batch = num_items_in_batch / self.seqpar_manager.sp_size
        return batches, num_items_in_batch

    def training_step(self, model: Any, inputs: dict[str, Any], num_items_in_batch: Any = None) -> Any:
        return super().training_step(model, self._sp_shard(inputs), num_items_in_batch)

    def prediction_step(self, model: Any, inputs: dict[str, Any], prediction_loss_only: bool,
                        ignore_keys: Any = None) -> tuple[Any, None, None]:
        """The SP-exact loss of a cut batch (Trainer's own would see no ``labels`` once they are
        shifted into ``shift_labels``); logits stay sharded, so only the loss is returned."""
        if not prediction_loss_only:
            raise ValueError(
                "under sequence parallelism each rank holds a shard of the logits; evaluate with "
                "TrainingArguments(prediction_loss_only=True) or gather the logits yourself"
            )
        if inputs.get("labels") is None and inputs.get("shift_labels") is None:
            return None, None, None
        inputs = self._prepare_inputs(self._sp_shard(inputs))
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)  # no num_items_in_batch: the token mean
        return loss.detach().mean(), None, None

    def compute_loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        result = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                      num_items_in_batch=num_items_in_batch)
        scaled = self.model_accepts_loss_kwargs or self.compute_loss_func is not None
        if not (self._counts_every_sp_rank(num_items_in_batch) and scaled):
            return result
        # Trainer scaled the loss by the process count; DeepSpeed averages over the dp replicas only.
        sp = self.seqpar_manager.sp_size
        if return_outputs:
            return result[0] / sp, result[1]
        return result / sp

    def floating_point_ops(self, inputs: dict[str, Any]) -> float:
        """Trainer's estimate for the full batch it was given, divided by ``sp``: each SP rank does
        its share of that batch, and ``total_flos`` sums the estimate over all processes."""
        return super().floating_point_ops(inputs) / self.seqpar_manager.sp_size

    def _track_num_input_tokens(self, inputs: dict[str, Any]) -> None:
        # Trainer sums the full batch's token count over all processes (include_num_input_tokens_seen),
        # so every SP rank counted the same batch: keep one count per SP group. Its own hook, as for
        # num_items_in_batch; a transformers without it never calls this.
        before = self.state.num_input_tokens_seen
        super()._track_num_input_tokens(inputs)
        counted = self.state.num_input_tokens_seen - before
        self.state.num_input_tokens_seen = before + counted // self.seqpar_manager.sp_size

    def get_total_train_batch_size(self, args: Any) -> int:
        return self._train_batch_size * args.gradient_accumulation_steps * self.seqpar_manager.dp_size
