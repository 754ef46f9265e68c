"""Hugging Face ``accelerate`` with sequence parallelism: one call instead of ``accelerator.prepare``.

A plain ``accelerate.Accelerator`` loop with FSDP2 gets SP by replacing its ``prepare`` call::

    accelerator = Accelerator()                   # no FSDP plugin: seqpar shards the model itself
    model, optimizer, loader = seqpar.integrations.accelerate.prepare(
        accelerator, model, optimizer, loader, config={"size": 2})
    for batch in loader:                          # batches are already cut along the sequence
        loss = model(**batch).loss                # the swapped model's SP-exact labels= loss
        accelerator.backward(loss)
        optimizer.step(); optimizer.zero_grad()

What :func:`prepare` does, in order (one small function per step):

1. builds the SP x DP groups (:func:`seqpar.runtime.groups.init_process_groups`, or the default manager);
2. swaps the model's attention and shards it with FSDP2 over all ``dp x sp`` ranks, with the gradient
   divide factor set to ``dp`` (:func:`seqpar.integrations.fsdp.wrap`, which explains why);
3. builds the optimizer *after* sharding when given a factory (FSDP2 replaces parameters by DTensors;
   an optimizer built on the unsharded parameters would step the wrong tensors), and refuses one
   built on other parameters;
4. splits the data loader over the **DP axis only** with accelerate's own
   :func:`accelerate.data_loader.prepare_data_loader` (``num_processes=dp``, ``process_index=dp_rank``):
   ``Accelerator.prepare`` would split it over every process, giving the ranks of one SP group
   different samples. This works because seqpar's rank grid is ``(dp, sp)`` with SP innermost
   (:func:`seqpar.runtime.groups.rank_grid`);
5. wraps the loader so every batch is cut with :func:`seqpar.sequence.batch.shard_batch` (labels shifted on the
   full sequence, before the cut).

Why not ``Accelerator(fsdp_plugin=...)``: accelerate's FSDP2 path builds its mesh over all processes
and divides gradients by the world size, so SP ranks' gradient shares would be averaged instead of
summed (gradients ``sp`` times too small); seqpar's wrap sets the divide factor itself. The
accelerator still does everything else (``backward``, gradient accumulation, ``gather``, logging).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from seqpar.config import SeqParConfig
from seqpar.integrations.common import ShardedLoader, rank_prefix, resolve_manager
from seqpar.runtime.groups import ProcessGroupManager

__all__ = ["prepare", "prepare_data_loader", "ShardedBatches"]

logger = logging.getLogger("seqpar")

OptimizerFactory = Callable[[Any], torch.optim.Optimizer]
"""``params -> optimizer``, called with the sharded model's parameters."""


class ShardedBatches(ShardedLoader):
    """A data loader whose dict batches are cut along the sequence for ``manager``'s SP group
    (:class:`seqpar.integrations.common.ShardedLoader`, the group read from the manager).

    Iterating yields ``shard_batch(batch)``; ``len``, ``set_epoch`` and other attributes come from the
    wrapped loader.
    """

    def __init__(self, loader: Any, *, manager: ProcessGroupManager, sharding: str | None,
                 causal_lm: bool = True, ignore_index: int = -100, pad_token_id: int = 0) -> None:
        super().__init__(loader, group=manager.sp_group, sharding=sharding, causal_lm=causal_lm,
                         ignore_index=ignore_index, pad_token_id=pad_token_id)
        self.manager = manager


def prepare_data_loader(accelerator: Any, dataloader: DataLoader, manager: ProcessGroupManager) -> Any:
    """``accelerator.prepare_data_loader`` split over the DP axis only (ranks of an SP group alike).

    Uses :func:`accelerate.data_loader.prepare_data_loader` with the accelerator's own settings
    (device placement, ``split_batches``, ``even_batches``, seedable sampler, ...), but
    ``num_processes = dp`` and ``process_index = dp_rank``.

    Returns:
        accelerate's ``DataLoaderShard`` (or dispatcher), yielding *unsharded* batches.
    """
    from accelerate.data_loader import prepare_data_loader as accelerate_prepare_data_loader

    cfg = accelerator.dataloader_config
    if cfg.dispatch_batches:
        raise ValueError(
            "dispatch_batches=True (rank 0 reads and scatters batches over all processes) is not "
            "supported with sequence parallelism; set DataLoaderConfiguration(dispatch_batches=False)"
        )
    loader = accelerate_prepare_data_loader(
        dataloader,
        accelerator.device,
        num_processes=manager.dp_size,
        process_index=manager.dp_rank,
        split_batches=cfg.split_batches,
        put_on_device=accelerator.device_placement,
        rng_types=accelerator.rng_types.copy(),
        dispatch_batches=False,
        even_batches=cfg.even_batches,
        use_seedable_sampler=cfg.use_seedable_sampler,
        data_seed=cfg.data_seed,
        non_blocking=cfg.non_blocking,
        use_stateful_dataloader=cfg.use_stateful_dataloader,
    )
    return loader


def prepare(
    accelerator: Any,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | OptimizerFactory,
    dataloader: DataLoader | None = None,
    config: SeqParConfig | Mapping[str, Any] | str | None = None,
    *,
    manager: ProcessGroupManager | None = None,
    fsdp: Mapping[str, Any] | None = None,
    swap: bool = True,
    causal_lm: bool = True,
    ignore_index: int = -100,
    pad_token_id: int = 0,
) -> tuple[nn.Module, torch.optim.Optimizer, ShardedBatches | None]:
    """Swap, shard with FSDP2 and prepare a training loop for ``accelerator`` with sequence parallelism.

    Collective: every rank calls it with the same model (same initial weights) and config.

    Args:
        accelerator: an ``accelerate.Accelerator`` created *without* an FSDP or DeepSpeed plugin (the
            model is sharded here; see the module docstring).
        model: the model, unwrapped, on its device.
        optimizer: a factory ``params -> optimizer`` (recommended: FSDP2 replaces the parameters), or
            an optimizer already built on ``model.parameters()``, which is rebuilt on the sharded
            ones with the same class and hyper-parameters.
        dataloader: a map-style loader of full-sequence dict batches (optional).
        config: the ``sequence_parallel`` block (object, dict or JSON path).
        manager: process groups (default: the default manager, made from ``config`` if needed).
        fsdp: options of :class:`seqpar.integrations.fsdp.FSDPOptions` (``version`` must stay 2).
        swap: swap the model's attention (default).
        causal_lm, ignore_index, pad_token_id: how batches are cut (:func:`seqpar.sequence.batch.shard_batch`).

    Returns:
        ``(model, optimizer, loader)``: the FSDP2 model, the accelerate-wrapped optimizer, and the
        loader yielding this rank's shards (``None`` without ``dataloader``). ``model.seqpar_manager``
        holds the groups.

    Raises:
        ValueError: an accelerator with a DeepSpeed / FSDP plugin, ``fsdp.version`` 1, an optimizer
            built on other parameters; errors of :func:`seqpar.integrations.fsdp.wrap`.
    """
    _check_accelerator(accelerator)
    sp_config = SeqParConfig.load(config)
    fsdp_options = dict(fsdp or {})
    if fsdp_options.setdefault("version", 2) != 2:
        raise ValueError("seqpar.integrations.accelerate.prepare shards with FSDP2: leave fsdp.version at 2")
    manager = resolve_manager(sp_config, manager)
    wrapped = _shard_model(model, sp_config, manager, fsdp_options, swap=swap)
    opt = _optimizer_for(wrapped, model, optimizer)
    opt = accelerator.prepare_optimizer(opt)
    loader = None
    if dataloader is not None:
        loader = ShardedBatches(
            prepare_data_loader(accelerator, dataloader, manager), manager=manager,
            sharding=sp_config.sharding, causal_lm=causal_lm, ignore_index=ignore_index,
            pad_token_id=pad_token_id,
        )
    logger.info("%s seqpar: accelerate loop over dp %d x sp %d (FSDP2)", rank_prefix(),
                manager.dp_size, manager.sp_size)
    return wrapped, opt, loader


# ----------------------------------------------------------------------------- the steps
def _check_accelerator(accelerator: Any) -> None:
    from accelerate.utils import DistributedType

    if accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP):
        raise ValueError(
            f"the accelerator was created with a {accelerator.distributed_type.value} plugin; with "
            "seqpar.integrations.accelerate.prepare, create Accelerator() without one (seqpar shards "
            "the model with FSDP2 over the SP x DP ranks itself). For DeepSpeed use "
            "seqpar.integrations.trainer.SeqParTrainer or seqpar.integrations.deepspeed.initialize"
        )
    if getattr(accelerator, "parallelism_config", None) is not None:
        pc = accelerator.parallelism_config
        if getattr(pc, "cp_size", 1) > 1 or getattr(pc, "sp_size", 1) > 1:
            raise ValueError(
                "the accelerator has a ParallelismConfig with cp_size/sp_size > 1: that is accelerate's "
                "own context parallelism, which cannot be combined with seqpar's; use one of them"
            )


def _shard_model(model: nn.Module, sp_config: SeqParConfig, manager: ProcessGroupManager,
                 fsdp_options: dict[str, Any], *, swap: bool) -> nn.Module:
    from seqpar.integrations.fsdp import wrap

    return wrap(model, sp_config, manager=manager, fsdp=fsdp_options, swap=swap)


def _optimizer_for(wrapped: nn.Module, model: nn.Module,
                   optimizer: torch.optim.Optimizer | OptimizerFactory) -> torch.optim.Optimizer:
    """The optimizer over the sharded parameters (FSDP2 swaps parameters for DTensors in place)."""
    params = [p for p in wrapped.parameters() if p.requires_grad]
    if not isinstance(optimizer, torch.optim.Optimizer):
        return optimizer(params)
    if optimizer.state:
        raise ValueError(
            "the optimizer already has state (it has stepped); pass a factory, e.g. "
            "optimizer=lambda params: torch.optim.AdamW(params, lr=...), so it is built on the "
            "sharded parameters"
        )
    # Rebuild with the same class and hyper-parameters: the old one holds the unsharded tensors.
    defaults = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
    if len(optimizer.param_groups) > 1:
        raise ValueError(
            "an optimizer with several parameter groups cannot be rebuilt on the sharded parameters; "
            "pass a factory params -> optimizer instead"
        )
    # Only what the class's __init__ takes: torch's AdamW keeps Adam's decoupled_weight_decay=True in its
    # groups but does not accept it (TypeError at prepare before this filter).
    accepted = inspect.signature(type(optimizer).__init__).parameters
    if not any(a.kind is inspect.Parameter.VAR_KEYWORD for a in accepted.values()):
        defaults = {k: v for k, v in defaults.items() if k in accepted}
    return type(optimizer)(params, **defaults)
