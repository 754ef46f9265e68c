"""Saving and resuming under a seqpar Trainer (:class:`CheckpointMethods`, a base of
:class:`seqpar.integrations.trainer.SequenceParallelMixin`), split from :mod:`seqpar.integrations.trainer`.

- **FSDP2**: transformers does not know seqpar's FSDP2 model is sharded (``is_fsdp_enabled`` is False), so its own
  save handed the model's DTensors to safetensors ("Attempted to access the data pointer on an invalid python
  storage") and its resume loaded plain tensors into them. Here ``save_model`` gathers the full state dict (every
  rank), a checkpoint adds the model's and optimizer's shards (torch.distributed.checkpoint, ``seqpar_fsdp2/``), and
  resuming reads them back in one load, resharded onto the resuming run's layout. DeepSpeed's path is transformers'
  own.
- **``save_model()`` on some ranks only** (e.g. under ``if trainer.is_world_process_zero():``) with FSDP2 or ZeRO-3,
  whose save gathers every rank's shards: before, the calling ranks waited in the gather until the process group's
  timeout and failed with the backend's error (or for good, under a long timeout). A user's call (not Trainer's own,
  ``_internal_call``, which every rank makes) first meets the other ranks through the rendezvous store, bounded by
  ``TrainingArguments.ddp_timeout``, the wait the process group allows any collective: the ranks that came raise
  :class:`seqpar.config.ConfigError` naming the ranks missing and the fix (call it on every rank), and the process
  group is left as it was (see :meth:`CheckpointMethods._seqpar_meet_every_rank`).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from typing import Any

import torch
import transformers

from seqpar.config import ConfigError

__all__ = ["CheckpointMethods", "SEQPAR_FSDP2_CHECKPOINT", "dcp_problem", "default_store", "is_fsdp2_sharded", "raw_optimizer",
           "writes_where_trainer_says"]


_TRAINERS = itertools.count()  # the seqpar trainers whose save_model meets every rank, made in this process


class CheckpointMethods:
    """The save and resume overrides of a seqpar Trainer (see the module docstring). A base of
    ``SequenceParallelMixin``, ahead of the Trainer class in the MRO; reads the mixin's ``_seqpar_engine``."""

    def _seqpar_prepare_save_check(self) -> None:
        """At construction, on every rank: whether a user's ``save_model`` gathers over the world (FSDP2; DeepSpeed
        ZeRO-3) and so must meet every rank first, and the store keys this trainer meets them under (the same on
        every rank: the trainers a process made before, which every rank made alike). No collective."""
        import torch.distributed as dist

        self._seqpar_save_meets = False
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return
        plugin = getattr(getattr(getattr(self, "accelerator", None), "state", None), "deepspeed_plugin", None)
        zero3 = self._seqpar_engine == "deepspeed" and getattr(plugin, "zero_stage", None) == 3
        if self._seqpar_engine != "fsdp2" and not zero3:
            return  # ZeRO-1/2: transformers' save reads this rank's whole weights, no collective
        self._seqpar_save_meets = True
        self._seqpar_save_key = f"seqpar/save_model/{next(_TRAINERS)}"
        self._seqpar_save_calls = 0

    def _seqpar_meet_every_rank(self) -> None:
        """Before a user's ``save_model`` gathers: every rank must be here, within ``TrainingArguments.ddp_timeout``
        (the wait the process group allows any collective). Through the rendezvous store, not a collective: a gloo
        ``monitored_barrier`` that times out closes its group's connections (the world's, or one more group a
        trainer would have to make on every rank), and NCCL has none. Each rank writes its key and waits for the
        others'; the first rank to decide (all arrived, or its wait ran out) sets the call's outcome with
        ``compare_set``, so every rank, a late one too, acts on the same outcome: all go on, or all that came raise.
        Cost: three store requests per call."""
        if not getattr(self, "_seqpar_save_meets", False):
            return
        import datetime

        import torch.distributed as dist

        store = default_store()
        if store is None:  # a torch without the default store's name: the gather's own timeout, as before
            return
        rank, world, timeout = dist.get_rank(), dist.get_world_size(), self.args.ddp_timeout
        prefix = f"{self._seqpar_save_key}/{self._seqpar_save_calls}/"
        self._seqpar_save_calls += 1
        store.set(f"{prefix}{rank}", "1")
        try:
            store.wait([f"{prefix}{r}" for r in range(world)], datetime.timedelta(seconds=timeout))
            arrived = True
        except RuntimeError:  # DistStoreError: the wait ran out
            arrived = False
        outcome = store.compare_set(f"{prefix}outcome", "", "ok" if arrived else "failed")
        if outcome in (b"ok", "ok"):
            return
        missing = [r for r in range(world) if not store.check([f"{prefix}{r}"])]
        raise ConfigError(
            f"save_model() on rank {rank}: rank(s) {missing} did not call it within TrainingArguments.ddp_timeout "
            f"({timeout} s). Under seqpar's FSDP2 (and DeepSpeed ZeRO-3) save_model gathers the weights from every "
            "rank's shards, so every rank must call it (it writes on the saving rank only): call "
            "trainer.save_model() on every rank, not under `if trainer.is_world_process_zero():`"
        )

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """FSDP2: the full state dict, gathered on every rank (a collective), written once by the saving rank
        through ``Trainer._save``, so ``from_pretrained(output_dir)`` loads the trained weights (a PeftModel:
        its adapters, as peft saves them). Every rank must call it, as for transformers' own FSDP (and ZeRO-3): a
        user's call on some ranks only is refused by name on the ranks that made it (:meth:`_seqpar_meet_every_rank`).
        """
        if not _internal_call:  # Trainer's own calls (checkpoints) are made on every rank
            self._seqpar_meet_every_rank()
        if self._seqpar_engine != "fsdp2":
            return super().save_model(output_dir, _internal_call)
        from seqpar.integrations.fsdp import full_state_dict

        output_dir = self.args.output_dir if output_dir is None else output_dir
        # {} on every rank but 0, unless each node's first rank writes as well (save_on_each_node)
        state_dict = full_state_dict(self.model, every_rank=self.args.save_on_each_node)
        with writes_where_trainer_says(self.model):
            self._save(output_dir, state_dict=state_dict)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _seqpar_dcp_dir(self, checkpoint: str) -> str:
        import os

        return os.path.join(checkpoint, SEQPAR_FSDP2_CHECKPOINT)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """FSDP2: model and optimizer sharded as they train, each rank its shards (torch.distributed.checkpoint,
        :func:`seqpar.integrations.fsdp.save_checkpoint`, a collective) into ``<checkpoint>/seqpar_fsdp2``; the
        scheduler as transformers saves it. Resume reads them back (:meth:`_load_optimizer_and_scheduler`)."""
        if self._seqpar_engine != "fsdp2":
            return super()._save_optimizer_and_scheduler(output_dir)
        import os
        import warnings

        from seqpar.integrations.fsdp import save_checkpoint

        save_checkpoint(self._seqpar_dcp_dir(output_dir), self.model, raw_optimizer(self.optimizer))
        if self.args.should_save:
            with warnings.catch_warnings(record=True) as caught:
                torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, transformers.trainer.SCHEDULER_NAME))
            transformers.trainer.reissue_pt_warnings(caught)

    def _seqpar_require_dcp(self, checkpoint: str) -> str:
        """``<checkpoint>/seqpar_fsdp2``, checked on every rank before DCP reads it (a collective): refused by name on
        every rank where any rank lacks it or any file of it (DCP would fail on those ranks only and leave the others
        waiting in its collectives)."""
        import torch.distributed as dist

        path = self._seqpar_dcp_dir(checkpoint)
        problem = dcp_problem(path)
        problems = [problem]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            problems = [None] * dist.get_world_size()
            dist.all_gather_object(problems, problem)
        missing = [(rank, p) for rank, p in enumerate(problems) if p is not None]
        if missing and all(p == "no directory" for _, p in missing):
            raise ConfigError(
                f"resume_from_checkpoint={checkpoint!r} has no {SEQPAR_FSDP2_CHECKPOINT}/ (the sharded model and "
                "optimizer a seqpar FSDP2 trainer writes with every checkpoint) on rank(s) "
                f"{[rank for rank, _ in missing]}: it was saved with save_only_model=True, by save_model(), or by "
                "another trainer. Resume from a checkpoint this trainer saved with save_only_model=False, or load the "
                "saved weights with from_pretrained() and train anew"
            )
        if missing:
            raise ConfigError(
                f"resume_from_checkpoint={checkpoint!r}: {SEQPAR_FSDP2_CHECKPOINT}/ is incomplete where rank(s) read it "
                f"({'; '.join(f'rank {rank}: {p}' for rank, p in missing)}). It holds every rank's shards "
                "(torch.distributed.checkpoint), which every rank must be able to read: with save_on_each_node=True "
                "on node-local disks each node wrote only its own ranks' shards; copy every node's "
                f"{SEQPAR_FSDP2_CHECKPOINT}/ files into one directory all ranks read (a shared filesystem)"
            )
        return path

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """FSDP2: only checks that the checkpoint has ``seqpar_fsdp2/`` (refused by name, on every rank, before the
        optimizer is built); the model's shards are read with the optimizer's, in one load, by
        :meth:`_load_optimizer_and_scheduler`, which ``train`` calls next. transformers' own would load the full
        safetensors into the sharded model."""
        if self._seqpar_engine != "fsdp2":
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        self._seqpar_require_dcp(resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """FSDP2: the model's and the optimizer's shards (every rank's, one DCP load, resharded onto this run's
        layout) from ``<checkpoint>/seqpar_fsdp2``, and the scheduler as transformers loads it."""
        if self._seqpar_engine != "fsdp2" or checkpoint is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        import os
        import warnings

        from seqpar.integrations.fsdp import load_checkpoint

        load_checkpoint(self._seqpar_require_dcp(checkpoint), self.model, raw_optimizer(self.optimizer))
        scheduler = os.path.join(checkpoint, transformers.trainer.SCHEDULER_NAME)
        if os.path.isfile(scheduler):
            with warnings.catch_warnings(record=True) as caught:
                self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))
            transformers.trainer.reissue_pt_warnings(caught)

    def _load_best_model(self) -> None:
        """FSDP2 (``load_best_model_at_end``): the best checkpoint's model shards (a collective)."""
        if self._seqpar_engine != "fsdp2":
            return super()._load_best_model()
        from seqpar.integrations.fsdp import load_checkpoint

        load_checkpoint(self._seqpar_require_dcp(self.state.best_model_checkpoint), self.model)


SEQPAR_FSDP2_CHECKPOINT = "seqpar_fsdp2"
"""The folder of a Trainer checkpoint (``checkpoint-<step>/``) where a seqpar FSDP2 trainer writes the model's and
the optimizer's shards with torch.distributed.checkpoint, for ``train(resume_from_checkpoint=...)``."""


@contextlib.contextmanager
def writes_where_trainer_says(model: Any) -> Iterator[None]:
    """Within the block, ``model.save_pretrained(is_main_process=...)`` writes where it is told: Trainer passes
    ``args.should_save`` (with ``save_on_each_node=True``, each node's first rank), but transformers 5.x's
    ``save_pretrained`` also requires global rank 0 once torch.distributed is up (``should_save_on_this_rank``), so
    the other nodes' checkpoints had no weights. Scoped to this model instance (an attribute shadowing the method,
    removed after)."""
    if not hasattr(model, "should_save_on_this_rank") or "should_save_on_this_rank" in vars(model):
        yield
        return
    model.should_save_on_this_rank = lambda is_main_process: is_main_process
    try:
        yield
    finally:
        del model.should_save_on_this_rank


def dcp_problem(path: str) -> str | None:
    """What keeps this rank from reading the DCP checkpoint at ``path`` (no directory, no ``.metadata``, a file the
    metadata names missing), or None."""
    import os

    from torch.distributed.checkpoint import FileSystemReader

    if not os.path.isdir(path):
        return "no directory"
    try:
        metadata = FileSystemReader(path).read_metadata()
    except FileNotFoundError:
        return "no .metadata (written by rank 0)"
    files = sorted({info.relative_path for info in (metadata.storage_data or {}).values()})
    absent = [f for f in files if not os.path.isfile(os.path.join(path, f))]
    return f"missing shard file(s) {absent}" if absent else None


def default_store() -> Any:
    """The store torch.distributed was initialised from (its default group's), or None. Reached through a private
    torch name (``_get_default_store``), kept to this function; None where it is renamed or absent."""
    try:
        from torch.distributed.distributed_c10d import (
            _get_default_store,  # private: None below without it
        )

        return _get_default_store()
    except Exception:  # noqa: BLE001 - renamed or absent in this torch, or no default group
        return None


def is_fsdp2_sharded(model: Any) -> bool:
    """Whether ``model`` is an FSDP2 module (``fully_shard`` applied to it)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def raw_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer under accelerate's ``AcceleratedOptimizer`` (torch's state-dict helpers need its param
    groups as the model's parameters)."""
    return getattr(optimizer, "optimizer", optimizer)
