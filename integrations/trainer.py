"""``transformers.Trainer`` (and its subclasses, TRL's among them) with sequence parallelism.

The one step: put a ``"sequence_parallel"`` block in the DeepSpeed JSON given to
``TrainingArguments(deepspeed="ds_config.json")`` and construct ``SeqParTrainer`` where ``Trainer``
was constructed (same arguments). The model code, the data collator and ``compute_loss`` stay as
they are::

    args = TrainingArguments(output_dir="out", deepspeed="ds_config.json", ...)
    trainer = SeqParTrainer(model=model, args=args, train_dataset=ds, data_collator=collator)
    trainer.train()

Any other Trainer subclass gets the same through :func:`sequence_parallel` (``SFTTrainer`` ->
``sequence_parallel(SFTTrainer)``), or by putting :class:`SequenceParallelMixin` *first* among the
bases (``class MySFT(SequenceParallelMixin, SFTTrainer)``). The mixin checks its place in the MRO at
class statement: a Trainer class ahead of it (``class X(SFTTrainer, SeqParTrainer)``) would run its own
``__init__`` / ``compute_loss`` / ``training_step`` before seqpar's and is refused by name; at
construction, so is a ``compute_loss``
seqpar does not know to be SP-exact (a subclass that reads the logits itself would log and train on
one shard's numbers; :mod:`seqpar.integrations.trl` lists the TRL trainers that are handled).

Without DeepSpeed, pass ``seqpar_config=`` (the block) and the trainer shards the model with FSDP2
itself (:func:`seqpar.integrations.fsdp.wrap`, gradient divide factor ``dp``; options in
``seqpar_fsdp=``); accelerate then leaves the model as it is (no DDP around it). It shards the model
``transformers.Trainer.__init__`` receives, as that ``__init__``'s first step: after a TRL trainer's own
``__init__`` applied ``peft_config`` and added its frozen "ref" adapter, which FSDP2 then shards with the rest.

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
- **``torch_compile=True``**: with DeepSpeed, accelerate calls ``engine.compile()`` (the swapped model,
  whole); on the FSDP2 path, where accelerate leaves the model as seqpar sharded it, each FSDP2 block is
  compiled after ``fully_shard`` (:func:`seqpar.integrations.fsdp.compile_blocks`, torchtitan's pattern).
  The compiled model gets the batches ``shard_batch`` cut, as :mod:`seqpar.swap.traced` needs.
  Under dynamic CP too: each micro-batch's group is a guarded constant of the graph, and dynamo's recompile
  limit is raised to cover the pool's groups (:func:`seqpar.sequence.call_group.raise_recompile_limit`).
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

- **Length-aware dynamic CP** (a ``"dynamic"`` entry in the block, issue 32): each document gets the group of
  ranks its length needs. Trainer's loop steps the optimizer after a fixed ``gradient_accumulation_steps``
  micro-batches (its ``do_sync_step`` counter), while a dynamic step has as many as its plan has slots, so
  ``gradient_accumulation_steps`` must be 1 and ``training_step`` runs the whole step itself: this DP
  replica's batch is cut into documents (a ``DataCollatorWithFlattening`` row at its position restarts, or
  each unpadded row), gathered over DP (the global batch, the same on every rank), planned, and the rank's
  planned micro-batches run in turn (every rank as many), each loss times ``dp``, one reduction (FSDP2) or
  one accumulation boundary and ``engine.step()`` (DeepSpeed). ``num_items_in_batch`` is the target count of
  the whole global batch (Trainer's own count is not used); the logged loss is the per-token mean over it.

- **Saving and resuming under FSDP2**: transformers does not know the model is sharded, so ``save_model`` gathers
  the full state dict (every rank; rank 0 writes it through ``Trainer._save``), a checkpoint adds the model's and
  optimizer's shards with torch.distributed.checkpoint (``checkpoint-N/seqpar_fsdp2/``), and resuming reads them
  back in one load, resharded onto the resuming run's layout (before, safetensors crashed on the model's DTensors
  at the first save). ``save_on_each_node``: each node's first rank writes (transformers' ``save_pretrained`` alone
  writes on global rank 0 only); a checkpoint some rank cannot read whole, or one saved with ``save_only_model``,
  is refused by name on every rank. ``save_model()`` called on some ranks only (it gathers) is refused by name
  on those ranks. These overrides live in :mod:`seqpar.integrations.trainer_checkpoint`.
- **A model given by name** (TRL's ``model="path"``, built in the trainer's own ``__init__``) is swapped (DeepSpeed)
  or swapped and sharded (FSDP2) as ``transformers.Trainer.__init__``'s first step, where it exists.

accelerate's own ``ParallelismConfig`` with ``cp_size``/``sp_size`` > 1 is another SP implementation
and is refused alongside this one; so is Trainer's own ``fsdp=`` (seqpar shards with FSDP2 itself).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import transformers

from seqpar.config import ConfigError, SeqParConfig
from seqpar.integrations.accelerate import prepare_data_loader
from seqpar.integrations.common import rank_prefix, resolve_manager
from seqpar.integrations.trainer_checkpoint import (  # noqa: F401 - SEQPAR_FSDP2_CHECKPOINT importable from here
    SEQPAR_FSDP2_CHECKPOINT,
    CheckpointMethods,
    is_fsdp2_sharded,
)
from seqpar.runtime.groups import ProcessGroupManager
from seqpar.sequence.batch import shard_batch

__all__ = ["SeqParTrainer", "SequenceParallelMixin", "sequence_parallel", "deepspeed_initialize_with"]

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

    if args is None or (not getattr(args, "deepspeed", None) and seqpar_config is None):
        raise ConfigError(
            "a seqpar Trainer needs the SP block: pass TrainingArguments(deepspeed='ds_config.json') whose "
            "JSON has a 'sequence_parallel' block, or seqpar_config={'size': ...} to shard with FSDP2. "
            "For an accelerate loop of your own use seqpar.integrations.accelerate.prepare"
        )
    if getattr(args, "fsdp", None):
        raise ConfigError(
            f"TrainingArguments(fsdp={args.fsdp!r}) shards through accelerate's FSDP plugin, which divides "
            "gradients by the world size (the SP ranks' shares would be averaged, not summed); drop fsdp= "
            "and pass seqpar_config=... (with seqpar_fsdp={...} for FSDP options): the trainer shards with "
            "FSDP2 itself"
        )
    if seqpar_config is not None:
        return SeqParConfig.load(seqpar_config)
    return SeqParConfig.from_deepspeed_config(load_deepspeed_config(config=args.deepspeed))


_EXACT_LOSS_FLAG = "seqpar_exact_loss"
# Whether transformers.Trainer.prediction_step passes the batch's target count (summed over the processes with
# average_tokens_across_devices) to compute_loss: then its eval loss is the token mean over the global eval batch,
# and SequenceParallelMixin.prediction_step counts alike
def _counts_in_prediction_step() -> bool:
    try:
        return "_get_num_items_in_batch" in inspect.getsource(transformers.Trainer.prediction_step)
    except (OSError, TypeError):  # no source installed (a .pyc-only transformers): Trainer's older behaviour
        return False


_COUNTS_IN_PREDICTION_STEP = _counts_in_prediction_step()


def _check_bases(cls: type) -> None:
    """The mixin must run before every Trainer class it changes (see the module docstring)."""
    mro = cls.__mro__
    here = mro.index(SequenceParallelMixin)
    if transformers.Trainer not in mro:
        return  # a mixin of mixins; checked when a Trainer class joins
    if transformers.Trainer not in mro[here:]:
        raise ConfigError(
            f"{cls.__name__}: SequenceParallelMixin must come before a transformers.Trainer class among the "
            f"bases; write class {cls.__name__}(SequenceParallelMixin, YourTrainer) or use "
            "seqpar.integrations.trainer.sequence_parallel(YourTrainer)"
        )
    ahead = [k.__qualname__ for k in mro[:here]
             if issubclass(k, transformers.Trainer) and not issubclass(k, SequenceParallelMixin)]
    if ahead:
        raise ConfigError(
            f"{cls.__name__}: {ahead[0]} comes before seqpar's mixin in the MRO (with {', '.join(ahead[1:]) or 'no other'}), "
            "so its __init__ / compute_loss / training_step would run before seqpar's. Put the seqpar "
            f"class first (class {cls.__name__}(SeqParTrainer-or-SequenceParallelMixin, {ahead[0]})) or use "
            f"seqpar.integrations.trainer.sequence_parallel({ahead[0]})"
        )


class SequenceParallelMixin(CheckpointMethods):
    """Sequence parallelism under any ``transformers.Trainer`` subclass: list it *first* among the bases
    (or use :func:`sequence_parallel`).

    Takes the trainer's arguments, plus keyword-only ``seqpar_config`` (the ``sequence_parallel`` block;
    default: the DeepSpeed config's) and ``seqpar_fsdp`` (FSDP2 options when there is no DeepSpeed
    config, :class:`seqpar.integrations.fsdp.FSDPOptions`). The groups are ``trainer.seqpar_manager``.

    Raises:
        ConfigError: no SP block, a bad one, accelerate's own context/sequence parallelism or Trainer's
            ``fsdp=`` requested as well, the mixin after a Trainer class in the MRO, or a loss seqpar does
            not know to be SP-exact (a ``compute_loss`` of the subclass's own, ``compute_loss_func``,
            label smoothing, an unhandled TRL trainer), each named with what to do.
        seqpar.swap.SwapError: the model's attention cannot be swapped.
    """

    seqpar_exact_loss: bool = False
    """Set to True on a subclass whose own ``compute_loss`` is exact under SP (the swapped model's
    ``labels=`` loss, or per-token sums reduced with :func:`seqpar.sequence.loss.sequence_parallel_mean`);
    without it such a subclass is refused at construction."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # At the class statement: a Trainer class ahead of the mixin would also run its __init__ first.
        super().__init_subclass__(**kwargs)
        _check_bases(cls)

    def __init__(self, *posargs: Any, seqpar_config: SeqParConfig | Mapping[str, Any] | None = None,
                 seqpar_fsdp: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        # The trainer's own arguments by name: ``args`` is Trainer's second parameter but DPOTrainer's
        # third (``model, ref_model, args``) and GRPOTrainer's third (``model, reward_funcs, args``).
        signature = inspect.signature(super().__init__)
        bound = signature.bind_partial(*posargs, **kwargs)
        kwargs = {}  # every argument by name, a **kwargs parameter's entries among them
        for name, value in bound.arguments.items():
            is_var_keyword = signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD
            kwargs.update(value if is_var_keyword else {name: value})
        model, args = kwargs.get("model"), kwargs.get("args")
        self.seqpar_config = _sp_config_from_args(args, seqpar_config)
        self._seqpar_engine = "deepspeed" if getattr(args, "deepspeed", None) else "fsdp2"
        self._seqpar_loss = self._seqpar_loss_path(args, kwargs)
        if self._seqpar_loss is not None:
            self._seqpar_loss.check(args)
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
        fsdp_options = dict(seqpar_fsdp or {})
        if self._seqpar_engine == "deepspeed" and fsdp_options:
            raise ConfigError("seqpar_fsdp= is for the FSDP2 path; with a DeepSpeed config drop it")
        if fsdp_options.setdefault("version", 2) != 2:
            raise ConfigError("a seqpar Trainer shards with FSDP2: leave seqpar_fsdp['version'] at 2")
        if self._seqpar_engine == "fsdp2" and getattr(args, "save_only_model", False) and args.load_best_model_at_end:
            raise ConfigError(  # as transformers refuses it for its own FSDP: a best checkpoint must be loadable
                "save_only_model=True with load_best_model_at_end=True: a seqpar FSDP2 trainer reloads the best "
                "checkpoint from its sharded model (checkpoint-N/seqpar_fsdp2), which save_only_model does not write; "
                "drop one of them"
            )
        if self._seqpar_engine == "fsdp2" and is_fsdp2_sharded(model):
            raise ConfigError(
                f"model is an FSDP2 module already ({type(model).__name__}, sharded by fully_shard, "
                "seqpar.integrations.fsdp.wrap or another seqpar trainer): a seqpar Trainer without DeepSpeed swaps "
                "and shards the model itself (gradient divide factor dp); pass the unsharded model"
            )
        if self.seqpar_config.dynamic is not None:
            self._check_dynamic(args)
            # a manager made earlier without the dynamic block has no dynamic groups: make them (collective)
            from seqpar.runtime.groups import init_process_groups

            self.seqpar_manager = init_process_groups(config=self.seqpar_config)
            if getattr(args, "torch_compile", False):  # one graph per micro-batch group: never silently eager
                from seqpar.sequence.call_group import raise_recompile_limit

                raise_recompile_limit(self.seqpar_manager.pool_size)
        else:
            self.seqpar_manager = resolve_manager(self.seqpar_config, None)
        if self._seqpar_loss is not None and model is not None:  # e.g. GRPO notes the unswapped attention
            self._seqpar_loss.before_swap(args, model, self.seqpar_manager)  # a name: again once built
        # FSDP2: the model Trainer.__init__ is given is swapped and sharded as its first step (in
        # create_accelerator_and_postprocess), after the trainer's own __init__ made it what it trains: TRL applies
        # peft_config there and adds the frozen "ref" copy of a PeftModel's adapter (DPO without ref_model, GRPO
        # with beta != 0), which on a model sharded before would mix FSDP2's DTensors with the new plain tensors
        # (fuzzer cases 188540536, 1171, 1720900617)
        self._seqpar_fsdp_options = fsdp_options if self._seqpar_engine == "fsdp2" else None
        # DeepSpeed: the given model is swapped now, in place (the engine shards it); one given by name (TRL's
        # model="path", built in the trainer's own __init__) where it is built, as FSDP2's (_seqpar_shard_model).
        # Before, swap_attention got the name ("'str' object has no attribute 'named_modules'")
        self._seqpar_swap_built = self._seqpar_engine != "fsdp2" and isinstance(model, str)
        self._seqpar_built_from_name = isinstance(model, str)  # the loss adapter sees it before the swap
        if model is not None and self._seqpar_engine != "fsdp2" and not self._seqpar_swap_built:
            self._seqpar_take_model(model)
        swap_other = self._seqpar_swap_other_models()
        if self._seqpar_loss is not None:  # a TRL trainer's further models (DPO's reference model)
            self._seqpar_loss.prepare(args, kwargs, swap_other)
        bound.arguments["model"] = model  # the given model, swapped in place (DeepSpeed; FSDP2: swapped later)
        super().__init__(*bound.args, **bound.kwargs)
        if self._seqpar_loss is not None:
            self._seqpar_loss.after_init(self, swap_other)
        self._seqpar_prepare_save_check()
        logger.info("%s seqpar: %s over dp %d x sp %d (%s)", rank_prefix(), type(self).__name__,
                    self.seqpar_manager.dp_size, self.seqpar_manager.sp_size, self._seqpar_engine)

    def _check_dynamic(self, args: Any) -> None:
        """Length-aware dynamic CP runs one Trainer micro-step per optimizer step (see :meth:`training_step`):
        refuse what it cannot honour, by name, on every rank (before any group or engine)."""
        fixes = []
        if getattr(args, "gradient_accumulation_steps", 1) != 1:
            fixes.append(f"gradient_accumulation_steps={args.gradient_accumulation_steps} (a dynamic step's "
                         "micro-batches are its plan's slots: set gradient_accumulation_steps=1 and size the step "
                         "with per_device_train_batch_size)")
        if self._seqpar_loss is not None:
            fixes.append("a TRL trainer's own loss (dynamic CP trains on the swapped model's labels= loss: use "
                         "SeqParTrainer)")
        if fixes:
            raise ConfigError("sequence_parallel.dynamic under a seqpar Trainer cannot take " + "; ".join(fixes))

    def _seqpar_swap_other_models(self) -> Any:
        """``swap(module)``: route another model the trainer runs on the same shards (a reference model)
        through seqpar, once per module (not sharded by FSDP2: each rank keeps it whole)."""
        swapped: list[Any] = []

        def swap(module: Any) -> None:
            if any(module is m for m in swapped):
                return
            swapped.append(module)
            if self.seqpar_config.swap != "none":
                from seqpar.swap import swap_attention

                swap_attention(module, self.seqpar_config, group=self.seqpar_manager.sp_group)

        return swap

    def _seqpar_loss_path(self, args: Any, kwargs: Mapping[str, Any]) -> Any:
        """How this trainer's loss is made SP-exact: None for ``transformers.Trainer``'s own (the swapped
        model's ``labels=`` loss), else the adapter of :mod:`seqpar.integrations.trl` for the TRL trainer
        beneath. A ``compute_loss`` above those that is not declared exact is refused by name."""
        from seqpar.integrations.trl import loss_adapter_for

        cls = type(self)
        if kwargs.get("compute_loss_func") is not None:
            raise ConfigError(
                "compute_loss_func= computes the loss from the model's logits, which under sequence "
                "parallelism are one shard's: drop it and let the swapped model compute the loss (labels=), "
                "or reduce your per-token sums with seqpar.sequence.loss.sequence_parallel_mean in a "
                f"compute_loss of your own and set seqpar_exact_loss = True on {cls.__name__}"
            )
        if getattr(args, "label_smoothing_factor", 0.0):
            raise ConfigError(
                "label_smoothing_factor > 0 makes Trainer compute the loss from the full logits, which "
                "under sequence parallelism are one shard's; set label_smoothing_factor=0"
            )
        owners = [k for k in cls.__mro__ if k is not SequenceParallelMixin and "compute_loss" in vars(k)]
        adapter = None
        for owner in owners:
            if owner is transformers.Trainer:
                break
            adapter = loss_adapter_for(owner)
            if adapter is not None:
                break
            declared = any(vars(k).get(_EXACT_LOSS_FLAG) for k in cls.__mro__[:cls.__mro__.index(owner) + 1])
            if not declared:
                raise ConfigError(
                    f"{owner.__module__}.{owner.__qualname__}.compute_loss is not known to seqpar: under "
                    "sequence parallelism each rank's model sees one shard of every sequence, so a loss or "
                    "metric read from the logits there is that shard's (and a per-sequence sum is partial). "
                    "Compute the loss with the swapped model's labels= (Trainer's default compute_loss), or "
                    "reduce per-token sums over the SP group (seqpar.sequence.loss.sequence_parallel_mean, "
                    "all_reduce_identity_backward) and set seqpar_exact_loss = True on "
                    f"{owner.__qualname__}"
                )
        return adapter

    # ------------------------------------------------------------------ engine and data loaders
    def _seqpar_shard_model(self) -> None:
        """FSDP2: swap and shard ``self.model`` (in place, :func:`seqpar.integrations.fsdp.wrap`), once.

        Called first in ``create_accelerator_and_postprocess``, which ``transformers.Trainer.__init__`` calls first,
        with ``self.model`` the model the trainer's own ``__init__`` hands it: for TRL's trainers, the ``PeftModel``
        it made from ``peft_config`` (``get_peft_model``), with the frozen "ref" adapter it adds to a given
        ``PeftModel`` and fills from the trained one (DPOTrainer without ``ref_model``, GRPOTrainer with
        ``beta != 0``). So TRL's adapters are built as without seqpar, on whole tensors, and FSDP2 shards and
        gathers them with the rest; the trainer's later steps see the sharded model (the same object).
        A ``model_init`` model (``self.model`` None here) is sharded where it is built (:meth:`call_model_init`)."""
        # sharded already (a given FSDP2 model is refused in __init__, so this one is seqpar's): hyperparameter search
        # calls create_accelerator_and_postprocess again with its model_init model, sharded in call_model_init
        if self.model is not None and self._seqpar_built_from_name:  # TRL built it from the name: the adapter's turn
            self._seqpar_built_from_name = False
            if self._seqpar_loss is not None:
                self._seqpar_loss.before_swap(self.args, self.model, self.seqpar_manager)
        if self._seqpar_swap_built and self.model is not None:  # DeepSpeed, a model TRL built from a name
            self._seqpar_swap_built = False  # swapped once (hyperparameter search calls this hook again)
            self._seqpar_take_model(self.model)
            return
        if self._seqpar_fsdp_options is None or self.model is None or is_fsdp2_sharded(self.model):
            return
        self._seqpar_take_model(self.model)

    def _seqpar_take_model(self, model: Any) -> None:
        """Make ``model`` seqpar's, in place: swapped (DeepSpeed: the engine shards it later) or swapped and sharded
        with FSDP2 (:func:`seqpar.integrations.fsdp.wrap`)."""
        if self._seqpar_fsdp_options is not None:
            from seqpar.integrations.fsdp import wrap

            wrap(model, self.seqpar_config, manager=self.seqpar_manager, fsdp=self._seqpar_fsdp_options,
                 swap=self.seqpar_config.swap != "none")
        elif self.seqpar_config.swap != "none":
            from seqpar.swap import swap_attention

            swap_attention(model, self.seqpar_config, group=self.seqpar_manager.sp_group)

    def call_model_init(self, trial: Any = None) -> Any:
        """``Trainer(model_init=...)``: transformers builds the model in its ``__init__`` (no ``model=``) and again for
        each hyperparameter-search trial in ``train``; each model it builds is made seqpar's as a given one is
        (:meth:`_seqpar_take_model`). Without this it reached training unswapped and crashed in ``compute_loss`` (a
        tiny Llama, unswapped, returns no loss for seqpar's cut inputs: transformers' "did not return a loss")."""
        model = super().call_model_init(trial)
        if self._seqpar_loss is not None:
            self._seqpar_loss.before_swap(self.args, model, self.seqpar_manager)
        self._seqpar_take_model(model)
        return model

    def create_accelerator_and_postprocess(self) -> None:
        self._seqpar_shard_model()
        super().create_accelerator_and_postprocess()
        accelerator = self.accelerator
        manager = self.seqpar_manager

        def dp_prepare_data_loader(data_loader: Any, device_placement: Any = None,
                                   slice_fn_for_dispatch: Any = None) -> Any:
            return prepare_data_loader(accelerator, data_loader, manager)

        # Instance attributes shadow the Accelerator methods for this trainer's accelerator only.
        accelerator.prepare_data_loader = dp_prepare_data_loader
        if self._seqpar_engine == "fsdp2":
            from accelerate.utils import DynamoBackend

            # seqpar sharded the model already (gradient divide factor dp); accelerate would put DDP
            # around it, which averages the SP ranks' gradient shares instead of summing them.
            def prepare_model_as_is(model: Any, device_placement: Any = None, evaluation_mode: bool = False) -> Any:
                if accelerator.state.dynamo_plugin.backend != DynamoBackend.NO and not any(model is m for m in compiled):
                    # torch_compile=True: accelerate would compile the model it prepares, which this skips;
                    # compile each FSDP2 block instead (torchtitan's per-block compile, fullgraph)
                    from seqpar.integrations.fsdp import compile_blocks

                    compile_blocks(model, **accelerator.state.dynamo_plugin.to_kwargs())
                    compiled.append(model)
                return model

            compiled: list[Any] = []  # prepare_model runs again for evaluation: compile each model once

            accelerator.prepare_model = prepare_model_as_is
            return
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

    def _cuts_in_step(self) -> bool:
        """The batch is cut before ``compute_loss`` (False: the loss adapter cuts at each model call)."""
        return self._seqpar_loss is None or self._seqpar_loss.shards_in_step

    def training_step(self, model: Any, inputs: dict[str, Any], num_items_in_batch: Any = None) -> Any:
        if self.seqpar_config.dynamic is not None:
            return self._dynamic_training_step(model, inputs)
        if not self._cuts_in_step():
            return super().training_step(model, inputs, num_items_in_batch)
        return super().training_step(model, self._sp_shard(inputs), num_items_in_batch)

    def _dynamic_training_step(self, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
        """One optimizer step of length-aware dynamic CP (``sequence_parallel.dynamic``); returns the step's
        loss, the per-token mean over every document of the global batch (the same on every rank).

        Trainer's loop decides when to step the optimizer by counting micro-batches against the fixed
        ``gradient_accumulation_steps`` (its ``do_sync_step``), so a step of a variable number of micro-batches
        cannot go through it: ``gradient_accumulation_steps`` is 1 (checked at construction) and this one
        Trainer micro-step runs the whole plan. The step's documents are the global batch's: this DP replica's
        batch (:func:`_batch_documents`) gathered over the DP group, the same list on every rank. Every rank
        plans them alike and cuts its micro-batches (:func:`seqpar.sequence.dynamic_step.plan_step`), whose
        ``num_items_in_batch`` is the targets of the whole global batch (Trainer's own count, the same number,
        is not used), and :func:`seqpar.integrations.dynamic.run_dynamic_step` runs them, as for
        ``launch/train.py --dynamic``: each loss times ``dp``, one reduction per step. FSDP2: Trainer then
        clips, steps and zeroes once, as for any step (the backward is accelerate's, which divides by its
        ``gradient_accumulation_steps``, 1 here). DeepSpeed is driven directly: ``engine.step()`` once at the
        step's accumulation boundary (its clipping, update and zeroing; accelerate's optimizer and scheduler
        wrappers, which Trainer steps next, do nothing under DeepSpeed).
        """
        import torch.distributed as dist

        from seqpar.integrations.dynamic import run_dynamic_step
        from seqpar.sequence.dynamic_step import plan_step

        manager = self.seqpar_manager
        docs = _batch_documents(inputs)
        if manager.dp_size > 1:  # every rank needs every document of the global batch
            gathered: list[Any] = [None] * manager.dp_size
            dist.all_gather_object(gathered, docs, group=manager.dp_group)
            docs = [doc for replica in gathered for doc in replica]
        pad = getattr(getattr(self.model, "config", None), "pad_token_id", None)
        step = plan_step([ids for ids, _ in docs], manager, self.seqpar_config.dynamic,
                         labels=[lab for _, lab in docs], sharding=self.seqpar_config.sharding,
                         pad_token_id=0 if pad is None else int(pad))
        model.train()
        deepspeed = self._seqpar_engine == "deepspeed"  # model is then the DeepSpeed engine
        loss = run_dynamic_step(model, step, deepspeed=deepspeed,
                                backward=None if deepspeed else self.accelerator.backward,
                                prepare=self._prepare_inputs, context=self.compute_loss_context_manager)
        return loss.to(device=self.args.device, dtype=torch.float32)

    def prediction_step(self, model: Any, inputs: dict[str, Any], prediction_loss_only: bool,
                        ignore_keys: Any = None) -> tuple[Any, None, None]:
        """The SP-exact loss of a cut batch (Trainer's own would see no ``labels`` once they are
        shifted into ``shift_labels``); logits stay sharded, so only the loss is returned.

        The target count is Trainer's own, taken on the full batch before the cut where the trainer's own
        ``prediction_step`` is ``transformers.Trainer``'s (not SFTTrainer's, which passes none): a transformers whose
        ``prediction_step`` counts ``num_items_in_batch`` (summed over every process with
        ``average_tokens_across_devices``, 5.2x) makes the eval loss of each step the token mean over the
        global eval batch, not the mean of the DP replicas' token means; the count is divided by ``sp`` as in
        training (each SP rank counted the same batch)."""
        if not prediction_loss_only:
            raise ValueError(
                "under sequence parallelism each rank holds a shard of the logits; evaluate with "
                "TrainingArguments(prediction_loss_only=True) or gather the logits yourself"
            )
        if not self._cuts_in_step():  # the trainer's own step; its compute_loss is the adapter's
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        if inputs.get("labels") is None and inputs.get("shift_labels") is None:
            return None, None, None
        num_items_in_batch = None
        # as the trainer's own prediction_step would: Trainer's counts, SFTTrainer's (its own, no count) does not
        own = getattr(super().prediction_step, "__func__", None)
        if _COUNTS_IN_PREDICTION_STEP and own is transformers.Trainer.prediction_step:
            num_items_in_batch = self._get_num_items_in_batch([inputs], self.args.device)
            if self._counts_every_sp_rank(num_items_in_batch):
                num_items_in_batch = num_items_in_batch / self.seqpar_manager.sp_size
        inputs = self._prepare_inputs(self._sp_shard(inputs))
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        return loss.detach().mean(), None, None

    def compute_loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        if self._seqpar_loss is not None:  # a TRL trainer's own loss, made SP-exact by its adapter
            return self._seqpar_loss.compute_loss(self, super().compute_loss, model, inputs,
                                                  return_outputs, num_items_in_batch)
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

def _batch_documents(inputs: Mapping[str, Any]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The documents of one collated batch, ``(input_ids (n,), labels (n,))`` each on the CPU, in order:
    a packed row (``transformers.DataCollatorWithFlattening``: ``(1, T)`` with ``position_ids`` restarting at
    0 at each document) is cut at those restarts; otherwise each row is a document, less its padding
    (``attention_mask`` 0).

    Raises:
        ValueError: no ``labels`` (dynamic CP trains on the swapped model's ``labels=`` loss), or
            ``shift_labels`` given (the documents are re-packed, so labels are taken unshifted).
    """
    if inputs.get("labels") is None or "shift_labels" in inputs:
        raise ValueError(
            "sequence_parallel.dynamic: each batch needs unshifted 'labels' (and no 'shift_labels'): the step's "
            f"documents are re-packed per micro-batch; got keys {sorted(inputs)}"
        )
    ids, labels = inputs["input_ids"].cpu(), inputs["labels"].cpu()
    positions = inputs.get("position_ids")
    if positions is not None and ids.shape[0] == 1:
        starts = (positions[0].cpu() == 0).nonzero().flatten().tolist()
        bounds = [*starts, ids.shape[1]] if starts and starts[0] == 0 else [0, *starts, ids.shape[1]]
        return [(ids[0, a:b], labels[0, a:b]) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    mask = inputs.get("attention_mask")
    keep = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.cpu().bool()
    return [(ids[r][keep[r]], labels[r][keep[r]]) for r in range(ids.shape[0]) if keep[r].any()]


class SeqParTrainer(SequenceParallelMixin, transformers.Trainer):
    """``transformers.Trainer`` with sequence parallelism from the DeepSpeed config's block (or, with
    ``seqpar_config=`` and no DeepSpeed config, FSDP2). See :class:`SequenceParallelMixin` for the
    arguments and the module docstring for what is changed and why."""


_COMPOSED: dict[type, type] = {}


def sequence_parallel(trainer_cls: type) -> type:
    """``trainer_cls`` with sequence parallelism: the class ``SeqPar<Name>(SequenceParallelMixin,
    trainer_cls)``, made once per class (the same object on every call), constructed with
    ``trainer_cls``'s arguments plus ``seqpar_config`` / ``seqpar_fsdp``.

    Raises:
        TypeError: ``trainer_cls`` is not a ``transformers.Trainer`` subclass.
    """
    if not (isinstance(trainer_cls, type) and issubclass(trainer_cls, transformers.Trainer)):
        raise TypeError(f"sequence_parallel takes a transformers.Trainer subclass, not {trainer_cls!r}")
    if issubclass(trainer_cls, SequenceParallelMixin):
        return trainer_cls
    if trainer_cls is transformers.Trainer:
        return SeqParTrainer
    if trainer_cls not in _COMPOSED:
        _COMPOSED[trainer_cls] = type(f"SeqPar{trainer_cls.__name__}", (SequenceParallelMixin, trainer_cls),
                                      {"__module__": trainer_cls.__module__, "__doc__": trainer_cls.__doc__})
    return _COMPOSED[trainer_cls]
