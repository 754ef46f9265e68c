"""Length-aware dynamic CP, one step: plan the step's documents, cut this rank's micro-batches, add up the
step's loss (issue 32 §1, §3, §5).

What every driver of a dynamic step does around its forwards and backwards, in one place:
``launch/train.py --dynamic`` and ``SeqParTrainer`` (both through
:func:`seqpar.integrations.dynamic.run_dynamic_step`) and the tests.

- :func:`plan_step`: the step's documents (host tensors, the same list on every rank of the pool) planned over
  the manager's pool with the ``sequence_parallel.dynamic`` settings
  (:func:`seqpar.sequence.dynamic.plan_dynamic`), and this rank's micro-batch of every slot
  (:func:`seqpar.sequence.batch.rank_micro_batches`: packed, cut over its group, carrying the group and the
  step's ``num_items_in_batch``), as a :class:`DynamicStep`.
- :meth:`DynamicStep.loss`: the step's loss from this rank's micro-batch losses. Every rank of a micro-batch's
  group holds that micro-batch's loss, so each rank counts it ``1 / group size``; the sum over the pool is the
  per-token mean of the step (each loss is its targets' summed loss over the step's targets), the same on every
  rank.

The pieces, from the plan to the model inputs, one name each: :func:`~seqpar.sequence.dynamic.plan_dynamic`
(which documents each group runs in each slot), :func:`~seqpar.sequence.dynamic_batch.packed_micro_batches`
(this rank's micro-batch of each slot, packed whole, with its group),
:func:`~seqpar.sequence.batch.rank_micro_batches` (those cut over their groups: the model inputs), and
:func:`plan_step` (the three for one step).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from seqpar.sequence.batch import rank_micro_batches
from seqpar.sequence.call_group import GROUP_KEY
from seqpar.sequence.dynamic import CostModel, DynamicPlan, plan_from_config
from seqpar.sequence.sharding import resolve_sharding

__all__ = ["DynamicStep", "plan_step"]


@dataclass(frozen=True)
class DynamicStep:
    """One planned step of length-aware dynamic CP, on this rank."""

    plan: DynamicPlan
    """The step's plan, the same on every rank of the pool."""
    micro_batches: list[dict[str, Any]]
    """This rank's model inputs, one per slot of ``plan`` (as many on every rank of the pool):
    :func:`seqpar.sequence.batch.rank_micro_batches`' dicts, each passed as ``model(**inputs)``."""
    manager: Any
    """The process-group manager whose pool the step is planned over."""

    def loss(self, losses: Sequence[Tensor]) -> Tensor:
        """The step's loss, the per-token mean over every document of the step, the same on every rank: the
        0-dim float64 sum over the pool (``manager.sp_dp_group``) of each of this rank's micro-batch losses
        (``losses[i]`` of ``micro_batches[i]``, 0-dim) divided by the size of its group, which holds it on every
        rank. Collective over the pool.

        A step with no target anywhere (every label ``ignore_index``, or one-token documents only) has no
        per-token mean: its loss is NaN (0 / 0) on every rank, what one process gives for the same step
        (transformers' ``ForCausalLMLoss`` with ``num_items_in_batch`` 0, as each micro-batch's loss here, and
        torch's mean cross-entropy over no target), and every gradient is exactly zero, so the step moves
        nothing; a caller that logs it may skip or count such a step (``math.isnan``).

        Raises:
            ValueError: not one loss per micro-batch.
        """
        if len(losses) != len(self.micro_batches):
            raise ValueError(f"DynamicStep.loss: {len(losses)} losses for {len(self.micro_batches)} micro-batches; "
                             "pass the loss of every micro-batch of the step, in order")
        total = torch.zeros((), dtype=torch.float64, device=losses[0].device if losses else "cpu")
        for loss, inputs in zip(losses, self.micro_batches):
            total += loss.detach().double() / dist.get_world_size(inputs[GROUP_KEY])
        dist.all_reduce(total, group=self.manager.sp_dp_group)
        return total


def plan_step(
    docs: Sequence[Tensor], manager: Any, dynamic: Any, *, labels: Sequence[Tensor] | None = None,
    sharding: str | None = None, pad_token_id: int = 0, ignore_index: int = -100, cost: CostModel | None = None,
) -> DynamicStep:
    """Plan one step of length-aware dynamic CP and cut this rank's micro-batches.

    Args:
        docs: every document of the step, 1-D token tensors, the same list (and order) on every rank of the pool.
        manager: the process-group manager built with the ``sequence_parallel.dynamic`` block (its pool is
            planned over and its dynamic groups carried by the micro-batches).
        dynamic: the ``sequence_parallel.dynamic`` settings (``max_tokens_per_rank``, ``min_size``, ``balance``:
            :class:`seqpar.config.DynamicConfig`; :func:`~seqpar.sequence.dynamic.plan_from_config`).
        labels: each document's labels (default: its tokens); a document's first label never counts.
        sharding, pad_token_id, ignore_index: as for :func:`seqpar.sequence.batch.shard_batch`.
        cost: the planner's cost model (default: :func:`~seqpar.sequence.dynamic.plan_dynamic`'s).

    Returns:
        the plan and this rank's micro-batches (:class:`DynamicStep`).
    """
    sharding = resolve_sharding(sharding, manager=manager, where="plan_step")
    # planned with the sharding's pad multiple: the plan's tokens per rank are what the cut below holds
    plan = plan_from_config([int(d.numel()) for d in docs], manager.pool_size, dynamic, cost=cost, sharding=sharding)
    micro = rank_micro_batches(plan, list(docs), manager, labels=None if labels is None else list(labels),
                               sharding=sharding, pad_token_id=pad_token_id, ignore_index=ignore_index)
    return DynamicStep(plan, micro, manager)
