"""The one-process reference of a ``launch/train.py --dynamic`` step, shared by the tests of issue 32."""

from __future__ import annotations

from typing import Any

import torch


def launcher_step(model: torch.nn.Module, task: Any, dynamic: Any, step: int, rows: int,
                  pool: int = 4, sharding: str = "zigzag") -> tuple[float, Any, int]:
    """Step ``step`` of ``launch/train.py --dynamic``, run on one process.

    The step's documents are those of the ``rows`` packed rows (``grad_accum x dp``) a static run trains on in
    that step (``task``: the launcher's ``RecallTask``). They are planned over a pool of ``pool`` ranks with
    ``dynamic`` (the ``sequence_parallel.dynamic`` settings), and each planned micro-batch runs in sequence,
    packed (seqpar's attention on one process keeps the documents apart), its targets' summed loss over the
    whole step's (``num_items_in_batch``; an MoE model adds its own router loss per micro-batch), gradients
    accumulated on ``model``.

    Returns:
        the step's loss, its plan (:class:`seqpar.sequence.dynamic.DynamicPlan`) and its number of documents.
    """
    from seqpar.sequence.dynamic import plan_from_config
    from seqpar.sequence.dynamic_batch import pack_documents, step_targets

    docs = [doc for row in range(step * rows, (step + 1) * rows) for doc in task.packed_docs(row)]
    planned = plan_from_config([int(ids.numel()) for ids, _ in docs], pool, dynamic,
                               sharding=sharding)  # as the launcher plans (plan_step: the run's sharding's padding)
    targets = step_targets([ids for ids, _ in docs], [labels for _, labels in docs])
    total = 0.0
    for mb in (mb for slot in planned.slots for mb in slot if mb.docs):
        batch = pack_documents([docs[d][0] for d in mb.docs], [docs[d][1] for d in mb.docs])
        loss = model(**batch, num_items_in_batch=targets).loss
        loss.backward()
        total += float(loss.detach())
    return total, planned, len(docs)


def launcher_reference(argv: list[str], *, sgd: bool = False, first_grads: dict[str, torch.Tensor] | None = None
                       ) -> tuple[list[float], list[set[int]]]:
    """One process, fp32, ``launch/train.py``'s own model and task for ``argv``, each step as
    :func:`launcher_step` (a pool of 4 ranks at dp = 1: a step's rows are its ``grad_accum`` ones), then the
    optimizer step: the launcher's AdamW with its clipping, or with ``sgd`` plain SGD at the launcher's lr
    (what exposes a wrong gradient's scale, which AdamW hides). Returns the per-step losses and each step's
    group sizes in use; ``first_grads``, when given, receives step 1's accumulated gradients before clipping
    (by parameter name, fp32; a parameter the step leaves without one is absent)."""
    from launch_module import train_module

    from seqpar.sequence.sharding import padded_length
    from seqpar.swap import swap_attention

    train = train_module()
    plan = train.build_plan(train.parse_args(argv))
    t, dynamic = plan.train, plan.sp.dynamic
    task = train.RecallTask(t)
    model = train.build_model(plan, task.vocab_size, padded_length(t.seq_len, plan.sp.size, plan.sp.sharding))
    swap_attention(model)  # one process: seqpar attention separates the packed documents
    opt = (torch.optim.SGD(model.parameters(), lr=t.lr) if sgd
           else torch.optim.AdamW(model.parameters(), lr=t.lr, weight_decay=t.weight_decay))
    losses, sizes = [], []
    for step in range(t.steps):
        total, planned, _ = launcher_step(model, task, dynamic, step, t.grad_accum, sharding=plan.sp.sharding)
        if step == 0 and first_grads is not None:
            first_grads.update({n: p.grad.detach().float().clone() for n, p in model.named_parameters()
                                if p.grad is not None})
        if not sgd:
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        opt.zero_grad()
        losses.append(total)
        sizes.append({mb.size for slot in planned.slots for mb in slot if mb.docs})
    return losses, sizes
