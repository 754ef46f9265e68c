"""Length-aware dynamic CP through an engine: one optimizer step's planned micro-batches (issue 32 §3, §4).

The one driver of a dynamic step for ``launch/train.py --dynamic`` and ``SeqParTrainer`` (a
``"dynamic"`` entry in ``sequence_parallel``): :func:`run_dynamic_step` runs this rank's micro-batches of a
:class:`seqpar.sequence.dynamic_step.DynamicStep` (:func:`seqpar.sequence.dynamic_step.plan_step`), every rank
as many, so the engines' per-forward and per-backward collectives stay matched.

The gradient of the step's mean is the **sum** over the pool of every rank's. FSDP2 and DeepSpeed both reduce
over the pool and divide by ``dp`` (FSDP2: seqpar's gradient divide factor; DeepSpeed: its average over the
sequence-data-parallel group, which seqpar's ``initialize`` makes a division by ``dp`` under every ZeRO stage),
so each micro-batch's loss is multiplied by ``dp``, and by nothing else: the step's accumulation is not the
engine's fixed one.

- FSDP2: the step's last micro-batch reduces (``set_requires_gradient_sync``; ``True`` again afterwards).
- DeepSpeed: its fixed ``gradient_accumulation_steps`` is overridden by DeepSpeed's own
  ``set_gradient_accumulation_boundary`` (the plan's last slot is the boundary, set before the forward, as
  DeepSpeed asks; ZeRO-1 reduces at the boundary, ZeRO-2 and 3 every backward: sums, so the same),
  ``backward(scale_wrt_gas=False)`` (no division by its accumulation steps), then ``engine.step()`` once, at
  the boundary (its clipping, update and zeroing), and DeepSpeed's counter back afterwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from seqpar.sequence.dynamic_step import DynamicStep

__all__ = ["run_dynamic_step"]


def run_dynamic_step(
    model: Any, step: DynamicStep, *, deepspeed: bool, backward: Callable[[torch.Tensor], Any] | None = None,
    update: Callable[[], Any] | None = None, prepare: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    context: Callable[[], Any] = contextlib.nullcontext,
) -> torch.Tensor:
    """Run one step of length-aware dynamic CP: every micro-batch of ``step`` forward (``model(**inputs).loss``)
    and backward, its loss times ``dp``, the gradients reduced once over the pool; then ``update``.

    Args:
        model: the DeepSpeed engine (``deepspeed=True``) or the model (FSDP2, or any module).
        step: this rank's planned step (:func:`seqpar.sequence.dynamic_step.plan_step`).
        deepspeed: drive ``model`` as a DeepSpeed engine (accumulation boundary, ``backward``, ``step``).
        backward: not DeepSpeed: runs the backward of a loss (default ``loss.backward()``; ``SeqParTrainer``:
            accelerate's).
        update: after the last backward, the gradients reduced (e.g. clip, step the optimizer, zero the
            gradients). Default: DeepSpeed ``model.step()``; otherwise nothing (the caller updates).
        prepare: maps each micro-batch's inputs before the forward (``SeqParTrainer``: ``_prepare_inputs``).
        context: a fresh context manager around each forward (``SeqParTrainer``: its autocast context).

    Returns:
        the step's loss (:meth:`~seqpar.sequence.dynamic_step.DynamicStep.loss`: the per-token mean over the
        pool's step, 0-dim float64, the same on every rank).
    """
    multiplier = step.manager.dp_size
    sync = None if deepspeed else getattr(model, "set_requires_gradient_sync", None)
    n = len(step.micro_batches)
    losses = []
    try:
        for i, inputs in enumerate(step.micro_batches):
            last = i == n - 1
            if deepspeed:
                model.set_gradient_accumulation_boundary(last)  # before the forward, as DeepSpeed asks
            elif sync is not None:
                sync(last)
            if prepare is not None:
                inputs = prepare(inputs)
            with context():
                loss = model(**inputs).loss
            if deepspeed:
                model.backward(loss * multiplier, scale_wrt_gas=False)
            elif backward is not None:
                backward(loss * multiplier)
            else:
                (loss * multiplier).backward()
            losses.append(loss.detach())
        if update is not None:
            update()
        elif deepspeed:
            model.step()  # the boundary: DeepSpeed clips, updates and zeroes
    finally:
        if deepspeed:
            model.set_gradient_accumulation_boundary(None)  # back to DeepSpeed's counter
        elif sync is not None:
            sync(True)
    return step.loss(losses)
