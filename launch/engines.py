"""The engines ``launch/train.py`` trains with: DeepSpeed and FSDP (1 or 2), behind the few calls its loop makes.

An engine is built from the launcher's resolved ``Plan`` (``launch/train.py``: ``plan.sp``, the
``sequence_parallel`` block; ``plan.train``, the ``train`` block; ``plan.engine_config``, the DeepSpeed JSON or
the ``fsdp`` block) and the built model; it holds the wrapped ``model`` and the process-group ``manager``.
Static steps: ``forward`` / ``backward`` per micro-step (the update at the last). Length-aware dynamic CP
(``--dynamic``): ``seqpar.integrations.dynamic.run_dynamic_step`` drives ``model`` and calls ``update`` once,
after the step's last backward.
"""

from __future__ import annotations

import abc
import os
import shutil
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Engine", "DeepSpeedEngine", "FSDPEngine", "packed_kwargs", "checkpoint_engine", "resume_tag"]


def packed_kwargs(batch: dict[str, Any]) -> dict[str, Any]:
    """The packed-document boundaries shard_batch added (cu_seq_lens_q/k ...), for the model."""
    from seqpar.sequence.batch import PACKED_KEYS

    return {k: batch[k] for k in PACKED_KEYS if k in batch}


ENGINE_NAMES = {"fsdp": "FSDP (torch.distributed.checkpoint)", "deepspeed": "DeepSpeed"}


def checkpoint_engine(path: str) -> str | None:
    """``"fsdp"`` or ``"deepspeed"``: which engine wrote the checkpoint directory ``path``, from the files each
    writes (DCP's ``*.distcp`` / ``.metadata``; DeepSpeed's ``*model_states.pt`` / ``*optim_states.pt``), else None."""
    names = os.listdir(path)
    if any(n.endswith(".distcp") or n == ".metadata" for n in names):
        return "fsdp"
    if any(n.endswith(("model_states.pt", "optim_states.pt")) for n in names):
        return "deepspeed"
    return None


def resume_tag(save_dir: str, engine: str) -> str:
    """The tag ``--resume`` loads: the latest complete checkpoint in ``save_dir``, written by ``engine``.

    Raises ValueError (``train.py: error: [rank R] ...`` on every rank, each reading the same directory) when there is
    none, or when another engine wrote it (DeepSpeed's loader met a DCP directory with a bare ``AssertionError``)."""
    from seqpar.runtime import checkpoint

    tag = checkpoint.latest_complete(save_dir)
    if tag is None:
        raise ValueError(
            f"--resume: no complete checkpoint in {save_dir!r} (a step<N> directory holding its "
            f"{checkpoint.MARKER} marker, as --save-dir runs write them); run without --resume to start at step 0, or "
            "pass the --save-dir an earlier run saved into"
        )
    wrote = checkpoint_engine(os.path.join(save_dir, tag))
    if wrote is not None and wrote != engine:
        raise ValueError(
            f"--resume: {os.path.join(save_dir, tag)!r} is a {ENGINE_NAMES[wrote]} checkpoint, but this run's engine "
            f"is {engine}; resume it with the config it was saved with (train.engine / --engine {wrote}), or start "
            "in a new --save-dir"
        )
    return tag


class Engine(abc.ABC):
    """The few things the loop needs from an engine (an engine that lacks one cannot be built)."""

    model: Any

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        out = self.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                         **packed_kwargs(batch))
        return out.logits

    @abc.abstractmethod
    def backward(self, loss: torch.Tensor, last_micro: bool) -> None:
        """One micro-step's backward (``last_micro``: the step's last, where the gradients are reduced)."""

    @abc.abstractmethod
    def update(self) -> None:
        """After a step's last backward (the gradients reduced): clip, update, zero the gradients. Length-aware
        dynamic CP calls it once per step (``seqpar.integrations.dynamic.run_dynamic_step``)."""

    @abc.abstractmethod
    def save(self, save_dir: str, step: int) -> None:
        """Write a checkpoint of the model and optimizer at ``step`` under ``save_dir``."""

    @abc.abstractmethod
    def load(self, save_dir: str) -> int:
        """Read the checkpoint under ``save_dir``; returns its step."""

    def eval(self) -> None:
        self.model.eval()


class DeepSpeedEngine(Engine):
    def __init__(self, plan: Any, model: torch.nn.Module) -> None:
        from seqpar.integrations.deepspeed import initialize

        self.model, _, _, _ = initialize(model=model, config=plan.engine_config, seqpar_config=plan.sp)
        self.manager = self.model.seqpar_manager
        if plan.train.compile:  # DeepSpeed's own: module.compile() of the swapped model, whole
            self.model.compile(backend=plan.train.compile_backend)
        # DeepSpeed's own key: resume from the universal form, which loads at any TP / SP / DP layout
        self.load_universal = bool((plan.engine_config.get("checkpoint") or {}).get("load_universal"))

    def backward(self, loss: torch.Tensor, last_micro: bool) -> None:
        self.model.backward(loss)
        self.model.step()  # every micro-step; DeepSpeed applies the update at the boundary

    def update(self) -> None:
        # dynamic CP: at the accumulation boundary run_dynamic_step set on the step's last micro-batch
        self.model.step()  # DeepSpeed's clipping, update and zeroing

    def save(self, save_dir: str, step: int) -> None:
        from seqpar.runtime import checkpoint

        # written as "<tag>.tmp" and renamed once complete: a rank killed mid-save leaves no torn
        # checkpoint behind ("latest" is ours to write, after the rename)
        tag = f"step{step}"
        self.model.save_checkpoint(save_dir, tag=f"{tag}.tmp", client_state={"step": step}, save_latest=False)
        dist.barrier()
        if self.manager.rank == 0:
            checkpoint.commit(save_dir, tag)
        dist.barrier()

    def load(self, save_dir: str) -> int:
        tag = resume_tag(save_dir, "deepspeed")
        if self.load_universal:
            tag = self._universal(save_dir, tag)
        path, client = self.model.load_checkpoint(save_dir, tag=tag)
        if path is None:
            raise FileNotFoundError(f"--resume: DeepSpeed could not load {tag} in {save_dir}")
        return int(client["step"])

    def _universal(self, save_dir: str, tag: str) -> str:
        """``universal/<tag>`` under ``save_dir``: ``tag`` converted to DeepSpeed's universal checkpoint once,
        on rank 0 (seqpar.integrations.deepspeed.to_universal); a failed conversion raises on every rank."""
        from seqpar.integrations.deepspeed import to_universal

        out = os.path.join("universal", tag)
        failure: list[str | None] = [None]
        if self.manager.rank == 0 and not os.path.isdir(os.path.join(save_dir, out)):
            try:
                shutil.rmtree(os.path.join(save_dir, out + ".tmp"), ignore_errors=True)  # a killed conversion
                to_universal(save_dir, tag, output_tag=out + ".tmp")
                os.replace(os.path.join(save_dir, out + ".tmp"), os.path.join(save_dir, out))
            except Exception as e:  # noqa: BLE001 - reported on every rank below
                failure[0] = f"{type(e).__name__}: {e}"
        dist.broadcast_object_list(failure, src=0)
        if failure[0] is not None:
            raise RuntimeError(f"--resume with checkpoint.load_universal: converting {tag} in {save_dir} to a "
                               f"universal checkpoint failed on rank 0 ({failure[0]})")
        return out


class FSDPEngine(Engine):
    def __init__(self, plan: Any, model: torch.nn.Module) -> None:
        from seqpar.integrations import fsdp
        from seqpar.runtime.groups import init_process_groups

        self.manager = init_process_groups(config=plan.sp)
        self.model = fsdp.wrap(model, plan.sp, manager=self.manager, fsdp=plan.engine_config,
                               compile={"backend": plan.train.compile_backend} if plan.train.compile else False)
        # train.optimizer: "sgd" lets a test see a gradient's scale in the losses (Adam normalises it away)
        optimizer = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[plan.train.optimizer]
        self.optimizer = optimizer(self.model.parameters(), lr=plan.train.lr, weight_decay=plan.train.weight_decay)
        self.grad_accum = plan.train.grad_accum
        self.grad_clip = plan.train.grad_clip

    def backward(self, loss: torch.Tensor, last_micro: bool) -> None:
        (loss / self.grad_accum).backward()
        if last_micro:
            self.update()

    def update(self) -> None:
        if self.grad_clip > 0:
            self._clip()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _clip(self) -> None:
        from torch.distributed.fsdp import FullyShardedDataParallel

        if isinstance(self.model, FullyShardedDataParallel):
            # FSDP1's parameters are plain local shards: torch.nn.utils.clip_grad_norm_ would clip
            # each rank by its own shard's norm. FSDP1's method reduces the norm over the shards.
            self.model.clip_grad_norm_(self.grad_clip)
        elif self.manager.tp_size > 1:  # FSDP2 x TP: gradients on two meshes, which torch's clip cannot stack
            from seqpar.integrations.tp import clip_grad_norm

            clip_grad_norm(self.model.parameters(), self.grad_clip)
        else:  # FSDP2: DTensor parameters, the norm is already the global one
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)

    def save(self, save_dir: str, step: int) -> None:
        from seqpar.runtime import checkpoint

        # DCP, written as "<tag>.tmp" and renamed once every rank is done (see seqpar.runtime.checkpoint)
        checkpoint.save_dcp(save_dir, step, self.model, self.optimizer)

    def load(self, save_dir: str) -> int:
        from seqpar.runtime import checkpoint

        resume_tag(save_dir, "fsdp")
        # DCP reshards: the checkpoint may come from another layout (SP, TP or world size)
        return int(checkpoint.load_dcp(save_dir, self.model, self.optimizer)["step"])
