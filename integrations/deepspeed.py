"""DeepSpeed with sequence parallelism: a drop-in for ``deepspeed.initialize``.

Add a ``"sequence_parallel"`` block to the DeepSpeed JSON and call
``seqpar.integrations.deepspeed.initialize`` where ``deepspeed.initialize`` was called::

    engine, optimizer, loader, scheduler = initialize(model=model, config="ds.json", ...)

What it does, in order (one small function per step): reads the block (``config=``,
``config_params=`` or ``args.deepspeed_config``; dict or path), refuses settings that would make
DeepSpeed build its own groups, initialises torch.distributed through ``deepspeed.init_distributed``
if needed (bounded by ``timeout_s``), builds the SP x DP groups
(:func:`seqpar.runtime.groups.init_process_groups`), swaps the model's attention
(:func:`seqpar.swap.swap_attention`), and hands the :class:`~seqpar.runtime.groups.ProcessGroupManager` to
DeepSpeed as ``mpu``.

Gradient meaning (read from DeepSpeed 0.19's engine and ZeRO optimizers). With an ``mpu`` that has
``get_sequence_data_parallel_group``, DeepSpeed partitions ZeRO state and reduces gradients over the
sequence-data-parallel group (all ``dp x sp`` ranks), summing there and dividing by
``world / sequence_parallel_size`` = the DP size (``engine._reduce_non_expert_gradients`` for ZeRO-0,
``stage_1_and_2.average_tensor`` for ZeRO-1/2, ``stage3.__avg_scatter_grads`` for ZeRO-3). With
:func:`seqpar.sequence.loss.sequence_parallel_loss`, each SP rank's backward yields its share of the
full-sequence gradient (the shares sum to it), so the reduced gradient is the mean over DP replicas of
the full-sequence gradient: what single-device training on the global batch gives. No loss rescaling
is needed (``tests/test_engines.py`` checks this numerically for every ZeRO stage).

The data loader DeepSpeed builds from ``training_data`` samples over the DP axis only
(``mpu.get_data_parallel_*``), so ranks of one SP group see the same samples; the returned loader
cuts each batch with :func:`seqpar.sequence.batch.shard_batch`.

Tensor parallelism (``sequence_parallel.tp_size`` > 1) is DeepSpeed's AutoTP
(``"tensor_parallel": {"autotp_size": N}``, set from ``tp_size`` when the JSON leaves it out; the two
must agree). Read from DeepSpeed 0.19.8's engine: with AutoTP it replaces the ``mpu`` by its own
``deepspeed.utils.groups`` (``_configure_tensor_parallel_states``) and builds a ``(world / tp, tp)``
mesh, TP on consecutive ranks, so it reports ``sequence_parallel_size = 1`` and reduces gradients
over its DP group of ``dp x sp`` ranks. seqpar's cube keeps TP innermost too, so DeepSpeed's TP group
is seqpar's and its DP group is seqpar's SP-DP group: each SP group is a subgroup of it (checked
after ``deepspeed.initialize``, on every rank). What differs is the average: ZeRO 0-2 then divide the
sum over ``dp x sp`` ranks by ``dp x sp / 1`` instead of ``dp`` (and ZeRO-3 always does, see
:func:`_compensate_gradient_average`), so ``engine.backward`` scales the loss by ``sp``. AutoTP checks
that the first batch is identical across each TP group: every TP rank of one SP rank gets the same
sequence shard (the SP groups are cut from the cube's TP-rank slices). Under AutoTP DeepSpeed's own
loader would sample over ``dp x sp`` ranks, so the loader is built here over the DP axis. With SP > 1 the
LM head stays whole by default (``tensor_parallel.vocab_parallel_lm_head`` set false unless given); with ``true``
DeepSpeed splits it over the vocabulary and seqpar's loss replaces DeepSpeed's ``VocabParallelCausalLMLoss`` (which
knows no SP group): vocab-parallel over the TP group, token-weighted over SP x DP (see
:func:`seqpar.integrations.deepspeed_tp.seqpar_loss_on_split_head`). Every AutoTP step (these checks, the
split head's loss, and what AutoTP trains wrong, refused by name) lives in :mod:`seqpar.integrations.deepspeed_tp`.

Checkpoints: ``engine.save_checkpoint`` resumes at the same layout. To resume at another TP / SP / DP
layout (e.g. saved at TP2 x SP2, resumed at SP2, and back), convert with :func:`to_universal` and load
the converted tag with ``"checkpoint": {"load_universal": true}`` in the DeepSpeed JSON (DeepSpeed's
universal checkpoint; it runs on CPU, checked in tests/test_deepspeed_tp.py for ZeRO-1 and ZeRO-3).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import logging
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from seqpar.config import BLOCK_KEY, SIZE_ALIASES, ConfigError, SeqParConfig, check_autotp
from seqpar.integrations import deepspeed_tp
from seqpar.integrations.common import ShardedLoader, rank_prefix, resolve_manager
from seqpar.integrations.deepspeed_reuse import refuse_reentrant_reuse
from seqpar.runtime.groups import init_process_groups, single_process_env, timeout_of

__all__ = ["initialize", "load_deepspeed_config", "refuse_deepspeed_ulysses", "ShardedDeepSpeedLoader", "to_universal",
           "ULYSSES_KEYS"]

logger = logging.getLogger("seqpar")

_INSTALL_HINT = "pip install 'deepspeed>=0.15' (or pip install 'seqpar[deepspeed]')"


def _import_deepspeed() -> Any:
    try:
        import deepspeed
    except ImportError as e:  # pragma: no cover - exercised by a monkeypatched test
        raise ImportError(
            f"seqpar.integrations.deepspeed needs DeepSpeed, which is not installed: {_INSTALL_HINT}"
        ) from e
    return deepspeed


def load_deepspeed_config(
    args: Any = None,
    config: str | os.PathLike | Mapping[str, Any] | None = None,
    config_params: str | os.PathLike | Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The DeepSpeed config as a fresh dict, from wherever ``deepspeed.initialize`` would read it.

    Raises:
        ConfigError: no config given, two given, or the file is not valid JSON.
    """
    if config is None:
        config = config_params
    from_args = getattr(args, "deepspeed_config", None) if args is not None else None
    if from_args is not None:
        if config is not None:
            raise ConfigError(
                "a DeepSpeed config was given both as args.deepspeed_config and as config=; pass one"
            )
        config = from_args
    if config is None:
        raise ConfigError(
            "no DeepSpeed config: pass config=<dict or path> or args with --deepspeed_config"
        )
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    try:
        with open(config) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{config}: not valid JSON ({e})") from None


class ShardedDeepSpeedLoader(ShardedLoader):
    """Wraps DeepSpeed's training loader (DP-axis sampler): every batch is cut along the sequence
    (:class:`seqpar.integrations.common.ShardedLoader`).

    Iterating yields ``shard_batch(batch)`` dicts; ``len`` and other attributes come from the
    wrapped loader. DeepSpeed's loader is itself an iterator (``next(loader)`` works), so this is too.
    """

    def __init__(
        self,
        loader: Any,
        *,
        group: Any,
        sharding: str | None,
        causal_lm: bool = True,
        ignore_index: int = -100,
        pad_token_id: int = 0,
    ) -> None:
        super().__init__(loader, group=group, sharding=sharding, causal_lm=causal_lm, ignore_index=ignore_index,
                         pad_token_id=pad_token_id)
        self._it: Iterator[Any] | None = None

    def __next__(self) -> dict[str, Any]:
        if self._it is None:
            self._it = iter(self)
        return next(self._it)


def initialize(
    args: Any = None,
    model: torch.nn.Module | None = None,
    optimizer: Any = None,
    model_parameters: Any = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    distributed_port: int | None = None,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Any = None,
    config: str | os.PathLike | Mapping[str, Any] | None = None,
    mesh_param: Any = None,
    config_params: str | os.PathLike | Mapping[str, Any] | None = None,
    *,
    seqpar_config: SeqParConfig | Mapping[str, Any] | None = None,
    swap: bool = True,
    causal_lm: bool = True,
    ignore_index: int = -100,
    pad_token_id: int = 0,
    manager: Any = None,
) -> tuple[Any, Any, Any, Any]:
    """``deepspeed.initialize`` with sequence parallelism from the config's ``sequence_parallel`` block.

    Arguments up to ``config_params`` are DeepSpeed's, with the same meaning. Keyword-only extras:

    Args:
        seqpar_config: overrides the block in the DeepSpeed config (e.g. after command-line flags).
        swap: swap the model's attention (default). ``False`` when the model already calls
            ``seqpar.attention`` itself.
        causal_lm, ignore_index, pad_token_id: how the returned loader cuts batches
            (see :func:`seqpar.sequence.batch.shard_batch`).
        manager: groups built earlier from the same config (e.g. by ``SeqParTrainer``, whose data
            loader needs them first); default: built here.

    Returns:
        ``(engine, optimizer, training_dataloader, lr_scheduler)`` as DeepSpeed returns them; the
        loader (when ``training_data`` was given) yields sharded batches. The manager is
        ``engine.seqpar_manager`` and the swap report ``engine.seqpar_swap_report``.

    Raises:
        ConfigError: a bad ``sequence_parallel`` block, a DeepSpeed Ulysses / ALST setting left in the JSON or
            the arguments (:func:`refuse_deepspeed_ulysses`), or ``mpu``/``mesh_param`` given as well (seqpar builds
            the groups itself).
        ValueError: the world size is not ``dp x sp x tp``.
        RuntimeError: DeepSpeed's AutoTP groups are not seqpar's TP and SP-DP groups (a manager whose
            TP axis is not innermost).
        seqpar.swap.SwapError: nothing in the model could be swapped, or a feature cannot be honoured.
    """
    if model is None:
        raise ValueError("initialize requires a model (as deepspeed.initialize does)")
    ds_config = load_deepspeed_config(args, config, config_params)
    refuse_deepspeed_ulysses(ds_config, mpu, training_data)
    sp_config = (
        SeqParConfig.load(seqpar_config)
        if seqpar_config is not None
        else SeqParConfig.from_deepspeed_config(ds_config)
    )
    _check_compatible(ds_config, sp_config, mpu, mesh_param)
    ds_config.pop(BLOCK_KEY, None)  # DeepSpeed ignores unknown top-level keys; drop ours anyway
    if sp_config.tp_size > 1:  # one TP degree: AutoTP's is seqpar's
        ds_config.setdefault("tensor_parallel", {})["autotp_size"] = sp_config.tp_size
        if sp_config.size > 1:  # DeepSpeed's default (on for tied heads): see deepspeed_tp.seqpar_loss_on_split_head
            ds_config["tensor_parallel"].setdefault("vocab_parallel_lm_head", False)
    deepspeed = _import_deepspeed()

    _init_distributed(deepspeed, sp_config, distributed_port, dist_init_required)
    manager = init_process_groups(config=sp_config) if manager is None else resolve_manager(sp_config, manager)
    if manager.tp_size != sp_config.tp_size:
        raise ConfigError(
            f"the manager has tp_size {manager.tp_size} but sequence_parallel.tp_size is {sp_config.tp_size}; "
            "build the manager from the same config (init_process_groups(config=...))"
        )
    report = _prepare_model(model, sp_config, manager, swap=swap)
    if _zero_stage(ds_config) in (2, 3):
        refuse_reentrant_reuse(model, _zero_stage(ds_config))
    if _zero_stage(ds_config) == 3:
        _mark_moe_blocks_z3_leaf(model)
        _partition_zero3_over_sp_dp(deepspeed, model, ds_config, manager)
    # Under AutoTP DeepSpeed samples over its DP group (dp x sp ranks): the loader is built below
    tp_loader = training_data is not None and manager.tp_size > 1
    head_rows = deepspeed_tp.lm_head_rows(model) if sp_config.tiled_loss and manager.tp_size > 1 else {}
    sparse_rows = deepspeed_tp.sparse_gate_rows(model) if manager.tp_size > 1 else {}
    deepspeed_tp.refuse_autotp_model_type(model, manager)
    if manager.tp_size > 1:
        deepspeed_tp.refuse_unsplittable_tied_embedding(model, ds_config)
    named_before = [name for name, _ in model.named_parameters()] if manager.tp_size > 1 else []
    engine, ds_optimizer, loader, scheduler = deepspeed.initialize(
        args=_args_without_config_path(args),
        model=model,
        optimizer=optimizer,
        model_parameters=model_parameters,
        training_data=None if tp_loader else training_data,
        lr_scheduler=lr_scheduler,
        mpu=manager,
        dist_init_required=dist_init_required,
        collate_fn=collate_fn,
        config=ds_config,
        **({"distributed_port": distributed_port} if distributed_port is not None else {}),
    )
    _check_engine_groups(engine, manager)
    deepspeed_tp.refuse_tiled_loss_on_split_head(model, head_rows)
    deepspeed_tp.complete_split_head(model)
    deepspeed_tp.seqpar_loss_on_split_head(model, manager)
    deepspeed_tp.refuse_split_sparse_gate(model, sparse_rows)
    deepspeed_tp.refuse_z_loss_on_split_head(model)
    deepspeed_tp.refuse_parameters_autotp_dropped(model, named_before)
    deepspeed_tp.sum_split_activation_gradients(model, manager)
    deepspeed_tp.refuse_unreduced_parameters_on_split_features(model, manager)
    _compensate_gradient_average(engine, manager)
    if tp_loader:
        loader = deepspeed_tp.dp_axis_loader(engine, training_data, collate_fn, manager)
    if loader is not None:
        loader = ShardedDeepSpeedLoader(
            loader, group=manager.sp_group, sharding=sp_config.sharding, causal_lm=causal_lm,
            ignore_index=ignore_index, pad_token_id=pad_token_id,
        )
        engine.training_dataloader = loader
    _record_on_engine(engine, manager, sp_config, report)
    return engine, ds_optimizer, loader, scheduler


# ----------------------------------------------------------------------------- the steps
def _zero_stage(ds_config: Mapping[str, Any]) -> int | None:
    return (ds_config.get("zero_optimization") or {}).get("stage")


def to_universal(checkpoint_dir: str | os.PathLike, tag: str, output_tag: str | None = None) -> str:
    """Convert ``checkpoint_dir/tag`` (as ``engine.save_checkpoint`` wrote it) to DeepSpeed's universal
    checkpoint format, which loads at any TP / SP / DP layout: AutoTP's shards are joined into whole
    weights and ZeRO's partitions into whole optimizer states. It is DeepSpeed's own converter
    (``deepspeed.checkpoint.ds_to_universal``) run in this process, with the universal-checkpoint
    metadata a model without AutoTP lacks injected (``--inject_missing_state``).

    Run it in one process once every rank has saved (rank 0 after a barrier, or offline); then start the
    new layout with ``"checkpoint": {"load_universal": true}`` in its DeepSpeed JSON and call
    ``engine.load_checkpoint(checkpoint_dir, tag=<the returned tag>)``.

    Returns:
        The universal checkpoint's tag, ``output_tag`` (default ``f"{tag}_universal"``), in ``checkpoint_dir``.
    """
    from deepspeed.checkpoint import ds_to_universal

    output_tag = output_tag or f"{tag}_universal"
    args = argparse.Namespace(
        input_folder=os.path.join(checkpoint_dir, tag), output_folder=os.path.join(checkpoint_dir, output_tag),
        num_extract_workers=1, num_merge_workers=1,  # in this process: no worker pool (ranks may be daemons)
        keep_temp_folder=False, strict=True, inject_missing_state=True,
    )
    with contextlib.redirect_stdout(None):  # the converter prints its progress
        ds_to_universal.main(args)
    logger.info("%s seqpar: universal checkpoint %s written from %s in %s", rank_prefix(), output_tag, tag,
                checkpoint_dir)
    return output_tag


# What a user of DeepSpeed's Ulysses / Arctic Long Sequence Training (ALST) leaves in the JSON or passes: the arguments
# of UlyssesSPAttentionHF.register_with_transformers and UlyssesSPDataLoaderAdapter written as keys (at the top level,
# where DeepSpeed ignores them without a word, or in seqpar's block, where they would get a bare "unknown key"), and
# seqpar's form of each (docs/names.md, "DeepSpeed Ulysses / ALST").
ULYSSES_KEYS: dict[str, str] = {
    "seq_length_is_variable": "seqpar shards each batch as it comes, whatever its length (shard_batch pads it to a "
                              "multiple of the shards): remove it",
    "seq_length": "seqpar reads each batch's length (shard_batch pads it to a multiple of the shards): remove it",
    "max_length": "seqpar reads each batch's length (shard_batch pads it to a multiple of the shards): remove it",
    "core_attn_implementation": "seqpar swaps the model's attention itself (attn_implementation 'seqpar', running "
                                f"{BLOCK_KEY}.mode): remove it",
    "micro_batch_size": "the micro-batch is DeepSpeed's top-level train_micro_batch_size_per_gpu: remove it",
    "disable_in_eval": "seqpar has no such switch: remove it",
}


def _block_size(ds_config: Mapping[str, Any]) -> tuple[str, Any] | None:
    """``(key, degree)`` the ``sequence_parallel`` block writes the SP degree with (``size`` or an alias), ``None``
    when it writes none."""
    block = ds_config.get(BLOCK_KEY)
    if not isinstance(block, Mapping):
        return None
    return next(((k, block[k]) for k in ("size", *SIZE_ALIASES) if k in block), None)


def refuse_deepspeed_ulysses(ds_config: Mapping[str, Any], mpu: Any = None, training_data: Any = None) -> None:
    """Raise one ``ConfigError`` naming every piece of a DeepSpeed Ulysses / ALST setup left in ``ds_config`` or the
    arguments, each with seqpar's key: a top-level ``sequence_parallel_size`` (beside the block or instead of it,
    agreeing or not), ``register_with_transformers``' arguments written as keys (top level or block), DeepSpeed's
    Ulysses ``mpu`` (``parallel_state_sp``), a ``UlyssesSPDataLoaderAdapter`` as ``training_data``. Read from the
    config and the arguments alone, before torch.distributed or DeepSpeed is touched: every rank raises alike."""
    problems: list[str] = []
    said = _block_size(ds_config)
    size = None if said is None else said[1]
    in_block = f"{BLOCK_KEY}.{said[0]} = {said[1]!r}" if said is not None else f"no {BLOCK_KEY}.size yet"
    if "sequence_parallel_size" in ds_config:
        top = ds_config["sequence_parallel_size"]
        if size is None:
            fix = f'write "{BLOCK_KEY}": {{"size": {top!r}}} and remove the top-level key'
        elif size == top and type(size) is type(top):
            fix = f"the block already says {size!r}: remove the top-level key"
        else:
            fix = f"they disagree ({in_block}): set the degree in the block only and remove the top-level key"
        problems.append(
            f"the DeepSpeed config has 'sequence_parallel_size' = {top!r} at its top level, DeepSpeed Ulysses' key "
            f"(with data_parallel_size DeepSpeed builds its own mesh from it); seqpar reads the SP degree from "
            f"{BLOCK_KEY}.size: {fix}"
        )
    for where, keys in (("top level", ds_config),
                        (BLOCK_KEY, ds_config.get(BLOCK_KEY) if isinstance(ds_config.get(BLOCK_KEY), Mapping) else {})):
        for key in sorted(set(keys) & set(ULYSSES_KEYS)):
            problems.append(f"{key!r} ({where}) is an argument of DeepSpeed's UlyssesSPAttentionHF."
                            f"register_with_transformers, not a config key: {ULYSSES_KEYS[key]}")
    if mpu is not None and (hasattr(mpu, "initialize_sequence_parallel")
                            or "parallel_state_sp" in getattr(mpu, "__name__", "")):
        problems.append(
            "mpu= is DeepSpeed Ulysses' parallel state (what UlyssesSPAttentionHF.register_with_transformers returns): "
            f"remove that call and mpu=; seqpar builds the SP x DP groups from {BLOCK_KEY}.size ({in_block}) and "
            "swaps the model's attention itself"
        )
    if type(training_data).__name__ == "UlyssesSPDataLoaderAdapter":
        problems.append(
            "training_data= is a UlyssesSPDataLoaderAdapter, which shards batches over DeepSpeed's own SP group: pass "
            "the dataset (as deepspeed.initialize takes it); the returned loader samples over DP and cuts every "
            f"batch over seqpar's SP group ({in_block}), or shard your own loader's batches with seqpar.shard_batch"
        )
    if problems:
        raise ConfigError("DeepSpeed Ulysses / ALST settings seqpar does not read (docs/names.md): "
                          + "; ".join(problems))


def _check_compatible(ds_config: Mapping[str, Any], sp_config: SeqParConfig, mpu: Any,
                      mesh_param: Any) -> None:
    """Refuse what would make DeepSpeed build groups of its own or average gradients wrongly."""
    if mpu is not None or mesh_param is not None:
        raise ConfigError(
            "seqpar builds the sequence/data/tensor-parallel groups itself and passes them to DeepSpeed "
            "as mpu; do not pass mpu= or mesh_param= (set sequence_parallel.size for the SP degree, "
            "sequence_parallel.tp_size for tensor parallelism; pipeline parallelism is not supported)"
        )
    check_autotp(ds_config, sp_config)
    if sp_config.tp_sequence_parallel:
        raise ConfigError(
            "sequence_parallel.tp_sequence_parallel splits activations over TP with the model's tp plan under "
            "FSDP2 (seqpar.integrations.fsdp.wrap); DeepSpeed's AutoTP shards the weights its own way and keeps "
            "whole activations on every TP rank: set tp_sequence_parallel false, or train with FSDP2"
        )
    if sp_config.tp_loss_parallel is True:
        raise ConfigError(
            "sequence_parallel.tp_loss_parallel = true keeps the LM head's logits split on the vocabulary with the "
            "model's tp plan under FSDP2 (seqpar.integrations.fsdp.wrap); DeepSpeed's AutoTP gives every TP rank the "
            "whole logits: set tp_loss_parallel false or \"auto\", or train with FSDP2"
        )
    for key in ("sequence_parallel_size", "data_parallel_size"):
        if key in ds_config:
            raise ConfigError(
                f"the DeepSpeed config has '{key}', which makes DeepSpeed build its own mesh; set the "
                f"SP degree in the '{BLOCK_KEY}' block (\"size\") instead and remove '{key}'"
            )
    zero = ds_config.get("zero_optimization") or {}
    if sp_config.size > 1 and zero.get("stage") == 3 and zero.get("reduce_scatter") is False:
        raise ConfigError(
            "ZeRO-3 with \"reduce_scatter\": false mixes two gradient averages in DeepSpeed 0.19 "
            "(over dp for buckets that fit, over dp x sp otherwise), so sequence-parallel gradients "
            "would be scaled inconsistently; remove \"reduce_scatter\": false (the default is true)"
        )


def _init_distributed(deepspeed: Any, sp_config: SeqParConfig, distributed_port: int | None,
                      dist_init_required: bool | None) -> None:
    """``deepspeed.init_distributed`` with the environment it needs, bounded by ``timeout_s``."""
    import torch.distributed as dist

    if not dist.is_initialized():
        single_process_env()  # a plain `python script.py`: a world of one
    elif "LOCAL_RANK" not in os.environ:
        # torch.distributed was started by something other than a launcher (a notebook, a test
        # pool); DeepSpeed insists on LOCAL_RANK. One process per device is the only layout we know.
        n_dev = torch.cuda.device_count() if torch.cuda.is_available() else 0
        os.environ["LOCAL_RANK"] = str(dist.get_rank() % n_dev if n_dev else 0)
        logger.info("%s seqpar: LOCAL_RANK not set; using %s", rank_prefix(), os.environ["LOCAL_RANK"])
    init_kw: dict[str, Any] = {"dist_init_required": dist_init_required}
    if distributed_port is not None:
        init_kw["distributed_port"] = distributed_port
    timeout = timeout_of(sp_config)
    if timeout is not None:
        init_kw["timeout"] = timeout  # applies only when DeepSpeed creates the world group
    deepspeed.init_distributed(**init_kw)


def _prepare_model(model: torch.nn.Module, sp_config: SeqParConfig, manager: Any, *,
                   swap: bool) -> Any:
    """Swap attention (unless told not to) and apply apex's fused norms; returns the swap report."""
    report = None
    if swap and sp_config.swap != "none":
        from seqpar.swap import swap_attention

        report = swap_attention(model, sp_config, group=manager.sp_group)  # logs what it swapped
    if sp_config.apex:
        from seqpar.integrations.apex import apply_fused_norms

        apply_fused_norms(model)
    return report


def _args_without_config_path(args: Any) -> Any:
    """``args`` with ``deepspeed_config`` cleared: the config travels as a dict, and DeepSpeed
    refuses both."""
    if args is not None and getattr(args, "deepspeed_config", None) is not None:
        args = copy.copy(args)
        args.deepspeed_config = None
    return args


def _record_on_engine(engine: Any, manager: Any, sp_config: SeqParConfig, report: Any) -> None:
    engine.seqpar_manager = manager
    engine.seqpar_config = sp_config
    engine.seqpar_swap_report = report
    logger.info(
        "%s seqpar: DeepSpeed engine over dp %d x sp %d x tp %d (mode %s, sharding %s, ZeRO stage %d)",
        rank_prefix(), manager.dp_size, manager.sp_size, manager.tp_size, sp_config.mode, manager.sharding or "contiguous",
        engine.zero_optimization_stage(),
    )


def _check_engine_groups(engine: Any, manager: Any) -> None:
    """DeepSpeed reduces gradients over seqpar's SP-DP group (and, under AutoTP, shards over seqpar's TP
    group); raise on every rank otherwise."""
    if manager.tp_size == 1:
        if engine.seq_dp_world_size != manager.world_size or (
            engine.sequence_parallel_size != manager.sp_size
        ):  # pragma: no cover - a DeepSpeed version that reads mpu differently
            raise RuntimeError(
                f"DeepSpeed did not take seqpar's groups: engine reports seq_dp_world_size="
                f"{engine.seq_dp_world_size}, sequence_parallel_size={engine.sequence_parallel_size}; "
                f"expected {manager.world_size} and {manager.sp_size}. Check the DeepSpeed version"
            )
        return
    deepspeed_tp.check_autotp_groups(engine, manager)


def _mark_moe_blocks_z3_leaf(model: torch.nn.Module) -> None:
    """Make every module that owns an ``experts`` child (a mixture-of-experts block) a ZeRO-3 leaf module.

    transformers' MoE blocks loop only over the experts their tokens were routed to (``expert_hit``), and
    some read expert weights outside the owning module's forward (``DbrxExperts`` slices ``self.mlp.w1``, so
    ZeRO-3 all-gathers it on access, once per expert hit). Under ZeRO-3 every such gather is a collective
    over the SP-DP group, and with sequence parallelism the ranks hold different tokens, hit different
    experts and so issue different numbers of gathers: the collectives no longer match (fuzzer case
    1260527780, tiny DBRX at P = 3: a rank aborts or the group times out). A leaf module's parameters are
    gathered once when it is entered, whatever the routing (``deepspeed.utils.set_z3_leaf_modules``,
    DeepSpeed's documented remedy for MoE; DeepSpeed 0.19 marks Mixtral's and Qwen2/3-MoE's blocks itself
    by default). The arithmetic is unchanged; the block's parameters are held whole while it runs.

    Which modules: those with a child module named ``experts`` (every transformers 5 model whose expert
    loop depends on the routing owns its experts that way), so both the loop and any out-of-forward read
    lie inside the leaf. Flags a user set are kept.

    DeepSpeed's limit that comes with it: ZeRO-3 reduces a leaf's gradients in the leaf's backward hook,
    once per call, so two forwards through the model before one backward fail DeepSpeed's assertion on
    a parameter reduced twice (``stage3.__reduce_and_partition_ipg_grads``; plain ``deepspeed.initialize``
    without seqpar, one rank, does the same). Run a backward per forward (gradient accumulation) instead.

    Keyword inputs. That backward hook is torch's full backward hook, which sees only the *positional*
    arguments: a leaf called with its tensors by keyword (JetMoE's ``self_attention(hidden_states=...)``,
    whose ``JetMoeAttention`` owns the mixture-of-attention-heads ``experts``) has its hook fire as soon
    as the gradients of its outputs exist, before its own backward: DeepSpeed reduces and partitions the
    parameters, and the backward then accumulates a full gradient into a partitioned (empty) parameter,
    "The size of tensor a (0) must match the size of tensor b (32)" (fuzzer case 1687718336; plain
    ``deepspeed.initialize`` on one rank with ``set_z3_leaf_modules`` fails the same way). Each marked
    module therefore gets a forward pre-hook, first of its hooks, that passes every argument its
    signature allows positionally (:func:`_leaf_inputs_positional`): the same call, with the tensors where
    the backward hook sees them. A leaf whose gradient-carrying tensors can only be passed by keyword
    (keyword-only parameters, ``**kwargs``) is refused by name when it is called.
    """
    from deepspeed.utils import set_z3_leaf_modules

    leaves = [m for m in model.modules() if isinstance(getattr(m, "experts", None), torch.nn.Module)]
    classes = {type(m) for m in leaves}
    if not classes:
        return
    set_z3_leaf_modules(model, sorted(classes, key=lambda c: c.__qualname__))
    for m in leaves:
        m.register_forward_pre_hook(_leaf_inputs_positional(m), with_kwargs=True, prepend=True)
    logger.info("%s seqpar: ZeRO-3 leaf modules (routing-dependent expert loops): %s", rank_prefix(),
                ", ".join(sorted(c.__name__ for c in classes)))



def _carries_grad(value: Any) -> bool:
    """Whether ``value`` (a tensor, or a tuple / list / dict holding tensors) has a tensor that requires grad."""
    if isinstance(value, torch.Tensor):
        return value.requires_grad
    if isinstance(value, (tuple, list)):
        return any(_carries_grad(v) for v in value)
    if isinstance(value, Mapping):
        return any(_carries_grad(v) for v in value.values())
    return False


def _leaf_inputs_positional(module: torch.nn.Module) -> Any:
    """A forward pre-hook (``with_kwargs=True``) for the ZeRO-3 leaf ``module``: the call's arguments
    re-bound to its ``forward``'s signature, every one it allows positionally moved into ``args`` (in order,
    up to the first it was not given), so that DeepSpeed's leaf reduction hook, a full backward hook that
    sees positional tensors only, fires after the module's backward (see :func:`_mark_moe_blocks_z3_leaf`).

    Raises:
        ConfigError: (when called with grad enabled) a tensor requiring grad reaches the module only by
            keyword, where no positional argument carries one.
    """
    import inspect

    signature = inspect.signature(module.forward)
    name = type(module).__name__

    def hook(mod: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
        if not kwargs:
            return None
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return None  # the call does not fit the signature: forward raises its own error
        args, kwargs = bound.args, bound.kwargs
        if torch.is_grad_enabled() and not _carries_grad(args) and _carries_grad(kwargs):
            raise ConfigError(
                f"{name} is a ZeRO-3 leaf module (it owns the mixture-of-experts 'experts') but receives its "
                f"gradient-carrying tensors only by keyword ({sorted(k for k, v in kwargs.items() if _carries_grad(v))}), "
                "which its signature does not allow positionally. DeepSpeed reduces a leaf's gradients in a full "
                "backward hook, which sees positional inputs only, so it would reduce them before the module's "
                "backward. Train this model with ZeRO-1/2 or FSDP2, or give the module's forward a positional "
                "parameter for its input"
            )
        return args, kwargs

    return hook


def _partition_zero3_over_sp_dp(deepspeed: Any, model: torch.nn.Module, ds_config: dict[str, Any],
                                manager: Any) -> None:
    """Partition ZeRO-3 parameters over the sequence-data-parallel group (``dp x sp`` ranks).

    DeepSpeed 0.19 converts a model's parameters for ZeRO-3 over ``mpu.get_data_parallel_group()``
    (``parameter_offload._convert_to_zero_parameters``): with SP that is the DP group, so SP ranks
    would never sum their gradient shares (seen here: each rank stepped with its own local
    gradient). DeepSpeed's own Ulysses mpu has no ``get_data_parallel_group`` for this reason. We
    convert the parameters first, over the SP-DP group; DeepSpeed then keeps that partitioning.
    Under AutoTP nothing is converted here: DeepSpeed's mpu is then its own groups, whose DP group is
    the SP-DP group (checked after initialisation), and AutoTP shards the weights before ZeRO-3 does.
    """
    params = list(model.parameters())
    zero_params = [p for p in params if hasattr(p, "ds_id")]
    replicas = manager.dp_size * manager.sp_size
    if zero_params:
        bad = [p for p in zero_params if p.ds_process_group is None
               or deepspeed.comm.get_world_size(p.ds_process_group) != replicas]
        if bad:
            raise ConfigError(
                f"the model was built under deepspeed.zero.Init with a partition group of another size than "
                f"dp x sp = {replicas}: with sequence parallelism ZeRO-3 must partition over the SP-DP group. "
                "Build it with deepspeed.zero.Init(data_parallel_group=manager.sp_dp_group, ...) where "
                "manager = seqpar.init_process_groups(config=...)"
            )
        if len(zero_params) == len(params):
            return
    if manager.tp_size > 1:
        return
    if ds_config.get("bf16", {}).get("enabled"):
        dtype = torch.bfloat16
    elif ds_config.get("fp16", {}).get("enabled"):
        dtype = torch.float16
    else:
        dtype = torch.float32
    deepspeed.zero.Init(
        module=model, data_parallel_group=manager.sp_dp_group, dtype=dtype,
        config_dict_or_path=ds_config, mpu=manager,
    )


def _compensate_gradient_average(engine: Any, manager: Any) -> None:
    """Make DeepSpeed's gradient average mean "over DP replicas" of the full-sequence gradient.

    With seqpar's loss each SP rank's backward yields a share of the full-sequence gradient, so the
    sum over the ``dp x sp`` replica ranks must be divided by ``dp``. DeepSpeed 0.19 divides by
    (read from its sources):

    - ZeRO 0-2 (``engine._reduce_non_expert_gradients``, ``stage_1_and_2.average_tensor``): the
      reducing group's size over ``sequence_parallel_size``. With seqpar's mpu that is ``dp``; under
      AutoTP the engine ignores the mpu and reports ``sequence_parallel_size = 1``: ``dp x sp``.
    - ZeRO-3's reduce-scatter path (``stage3.__avg_scatter_grads`` via ``reduce_scatter_coalesced``,
      the default ``reduce_scatter: true``): the group's full size ``dp x sp``, always.

    The shortfall, ``divisor / dp`` (1 or ``sp``), is made up by scaling the loss inside
    ``engine.backward`` (and ``engine.scale``, for a manual ``loss.backward()``); the loss the user
    holds is unchanged. Checked numerically in tests/test_engines.py and tests/test_deepspeed_tp.py.
    """
    divisor = engine.seq_dp_world_size
    if engine.zero_optimization_stage() != 3:
        divisor //= engine.sequence_parallel_size
    factor, rest = divmod(divisor, manager.dp_size)
    if rest or factor not in (1, manager.sp_size):  # pragma: no cover - a DeepSpeed that averages otherwise
        raise RuntimeError(
            f"DeepSpeed averages gradients over {divisor} ranks (seq_dp_world_size {engine.seq_dp_world_size}, "
            f"sequence_parallel_size {engine.sequence_parallel_size}); seqpar expects dp {manager.dp_size} or "
            f"dp x sp {manager.dp_size * manager.sp_size}. Check the DeepSpeed version"
        )
    if factor == 1:
        return
    backward, scale = engine.backward, engine.scale

    def backward_sp_scaled(loss: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return backward(loss * factor, *args, **kwargs)

    def scale_sp_scaled(loss: torch.Tensor) -> torch.Tensor:
        return scale(loss * factor)

    engine.backward, engine.scale = backward_sp_scaled, scale_sp_scaled
    logger.info(
        "%s seqpar: DeepSpeed (ZeRO stage %d%s) averages gradients over dp x sp ranks; engine.backward "
        "scales the loss by sp=%d so gradients are the DP mean of the full-sequence gradient",
        rank_prefix(), engine.zero_optimization_stage(), ", AutoTP" if manager.tp_size > 1 else "", factor,
    )

