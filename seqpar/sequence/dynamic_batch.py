"""Length-aware dynamic CP, the inputs: each rank's micro-batches of a planned step (issue 32 §2, §3, §5).

From a plan to the model inputs, one name each:

- :func:`seqpar.sequence.dynamic.plan_dynamic`: which documents each group of ranks runs in each slot;
- :func:`packed_micro_batches` (here): this rank's micro-batch of every slot, its documents packed whole
  (not yet cut), with its group;
- :func:`seqpar.sequence.batch.rank_micro_batches`: those cut over their groups, the model inputs of this rank,
  one dict per slot (what ``ShardedDataLoader(..., dynamic=...)`` yields per step);
- :func:`seqpar.sequence.dynamic_step.plan_step`: the plan and the cut micro-batches of one step, and the
  step's loss from theirs (``launch/train.py --dynamic``, ``SeqParTrainer``).

Every rank of the pool gets the same number of micro-batches, so engines' per-forward and per-backward
collectives stay matched:

- a micro-batch's documents are packed into one row (:func:`pack_documents`: ``input_ids`` ``(1, T)``,
  ``labels`` with ``ignore_index`` at each document's start, positions restarting, ``cu_seq_lens_q/k``)
  and cut over the micro-batch's group by :func:`seqpar.sequence.batch.shard_batch` (the whole row on a
  group of one rank);
- the group travels with the call: :data:`seqpar.sequence.call_group.GROUP_KEY` holds it
  (``manager.dynamic_group(size, index)``, made at ``init_process_groups``), and every swapped layer and
  the loss take it from there;
- ``num_items_in_batch`` is the target count of the **whole step over the pool** (every document of the
  plan), so each micro-batch's loss is its targets' summed loss divided by it, and the sum of every
  micro-batch's loss over the slots and the pool is the per-token mean of the step. Gradients summed over
  the slots and the pool are then that mean's gradient: reduce them once per step with a **sum** over the
  pool (an engine that averages over the pool's ``n`` ranks needs the loss scaled by ``n``);
- an empty micro-batch (a rank no document covers in a slot) is :data:`EMPTY_TOKENS` padding tokens on the
  rank alone, every target ``ignore_index``: the model runs (its collectives stay matched) and its loss
  and gradients are exactly zero.

The reference (tests): one process running the planned micro-batches in sequence, accumulating gradients.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from seqpar.sequence.dynamic import DynamicPlan

__all__ = ["pack_documents", "step_targets", "packed_micro_batches", "EMPTY_TOKENS"]

EMPTY_TOKENS = 2
"""Tokens of an empty micro-batch (padding, no target): two, so any sharding's length multiple holds."""


def pack_documents(docs: Sequence[Tensor], labels: Sequence[Tensor] | None = None, *,
                   ignore_index: int = -100) -> dict[str, Tensor]:
    """Documents (1-D token tensors) packed into one row, as ``transformers.DataCollatorWithFlattening(
    return_flash_attn_kwargs=True)`` packs them: ``input_ids``, ``labels`` (each document's own ``labels``,
    default its tokens; ``ignore_index`` at each document's first token) and ``position_ids`` ``(1, T)``;
    ``cu_seq_lens_q/k`` ``(n_docs + 1,)`` int32 (``n_docs``: the documents of at least one token; an empty one is
    dropped); ``max_length_q/k``."""
    if labels is not None:  # zero-length documents hold no token and no target: dropped (their labels are empty too)
        labels = [lab for d, lab in zip(docs, labels) if d.numel()]
    docs = [d for d in docs if d.numel()]
    if not docs:
        raise ValueError("pack_documents: no documents (an empty micro-batch has none to pack)")
    input_ids = torch.cat([d.reshape(-1) for d in docs])[None]
    labels = input_ids.clone() if labels is None else torch.cat([lab.reshape(-1) for lab in labels])[None].clone()
    lengths = [d.numel() for d in docs]
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    labels[0, torch.tensor(bounds[:-1])] = ignore_index
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor(bounds, dtype=torch.int32)
    return {"input_ids": input_ids, "labels": labels, "position_ids": positions, "cu_seq_lens_q": cu,
            "cu_seq_lens_k": cu, "max_length_q": max(lengths), "max_length_k": max(lengths)}


def step_targets(docs: Sequence[Tensor], labels: Sequence[Tensor] | None = None, ignore_index: int = -100) -> int:
    """Target tokens of a step's documents, the ``num_items_in_batch`` of every micro-batch of the step: a
    document's labels but its first (which no token predicts), less ``ignore_index``; without ``labels``
    ``n - 1`` per document."""
    if labels is None:
        return sum(max(int(d.numel()) - 1, 0) for d in docs)
    return sum(int((lab.reshape(-1)[1:] != ignore_index).sum()) for lab in labels)


def packed_micro_batches(
    plan: DynamicPlan, docs: Sequence[Tensor], manager: Any, *, labels: Sequence[Tensor] | None = None,
    pad_token_id: int = 0, ignore_index: int = -100,
) -> list[tuple[dict[str, Tensor], Any]]:
    """This rank's micro-batch of every slot of ``plan``, whole (not yet cut): ``(packed batch, group)``
    pairs, the batch :func:`pack_documents`' (an empty micro-batch: :data:`EMPTY_TOKENS` padding tokens, no
    target) and the group ``manager.dynamic_group(size, index)``.
    :func:`seqpar.sequence.batch.rank_micro_batches` cuts them.

    Raises:
        ValueError: a plan over another pool than ``manager``'s, or documents that do not match it.
    """
    if plan.pool_size != manager.pool_size:
        raise ValueError(f"dynamic CP: the plan is over a pool of {plan.pool_size} ranks but the manager's pool "
                         f"(dp x sp) has {manager.pool_size}: plan with pool_size=manager.pool_size")
    got = tuple(int(d.numel()) for d in docs)
    if got != plan.lengths:
        raise ValueError(f"dynamic CP: the documents' lengths {list(got[:8])} are not the planned lengths "
                         f"{list(plan.lengths[:8])} (first 8): pass the documents the plan was made for, in order")
    position = manager.pool_position
    out = []
    for slot in range(plan.num_slots):
        mb = plan.micro_batch(position, slot)
        if mb.docs:
            batch = pack_documents([docs[d] for d in mb.docs], None if labels is None else [labels[d] for d in mb.docs],
                                   ignore_index=ignore_index)
        else:
            batch = {"input_ids": torch.full((1, EMPTY_TOKENS), pad_token_id, dtype=torch.long),
                     "labels": torch.full((1, EMPTY_TOKENS), ignore_index, dtype=torch.long)}
        out.append((batch, manager.dynamic_group(mb.size, mb.index)))
    return out
