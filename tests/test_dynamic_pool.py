"""Length-aware dynamic CP over a DP x SP pool (issue 32; session 21's mutation audit, mut21d).

The other multi-rank dynamic tests run SP = 4, DP = 1 (where the pool's positions are the SP ranks) or go
through an engine; here 4 gloo ranks are DP 2 x SP 2, so a group of 2 is a DP replica's SP group, a group of
4 spans both replicas and position ``dp_rank * 2 + sp_rank`` is what names a rank's groups. One pool task:

- the groups: every ``(size, index)`` holds the pool positions ``[index * size, (index + 1) * size)``, and a
  sum over it adds exactly those ranks;
- the cut against the plan (loose end 3a): under ``contiguous``, ``zigzag`` and ``balanced`` sharding
  (``plan_step``, which plans with the sharding's pad multiple, and the loader's dynamic mode) every rank's
  micro-batch of every slot holds the plan's ``tokens_per_rank``, and the plan's ``peak_tokens_per_rank`` is
  the most any rank holds;
- one step of a tiny fp32 Llama under ``balanced`` sharding (``max_tokens_per_rank`` 16, lengths (50, 30, 12,
  9, 7, 3): groups of 4, 2 and 1 in use): ``DynamicStep.loss`` and every gradient, summed once over the pool,
  equal float64 one-process transformers running each document alone (its token losses summed over the step's
  targets), each parameter on its own scale;
- a step with no target (every label ``ignore_index``, loose end 3b): the loss is NaN on every rank, as one
  process gives it (transformers' ``ForCausalLMLoss`` with ``num_items_in_batch`` 0, and torch's mean
  cross-entropy over no target: 0 / 0), and every gradient is exactly zero (the step moves nothing).

Seen failing (each alone, session 21's mutation audit; the first four pass ``test_dynamic_train``'s SP = 4 Llama
step or ``test_dynamic_groups``):

- ``packed_micro_batches`` taking ``manager.sp_rank`` for the pool position (a DP replica's ranks run the first
  replica's micro-batches); ``pool_position`` as ``sp_rank * dp + dp_rank``; ``dynamic_ranks`` reading the
  transposed grid; the groups of size ``sp`` taken from the DP group (strided): the group check or the step;
- ``plan_from_config`` planning at pad 2 whatever the sharding (``pad_multiple_of`` returning 2, or ``plan_step``
  not passing the sharding): the balanced cut holds more than the plan's ``tokens_per_rank``;
- ``DynamicStep.loss`` dividing by the pool's size instead of each group's, or not all-reducing: the loss;
- ``DynamicStep.loss`` returning 0 for a step with no target (``nan_to_num``): the NaN check.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

from hf_tiny import VOCAB, tiny_llama  # noqa: E402

LENGTHS = (50, 30, 12, 9, 7, 3)
BUDGET = 16  # max_tokens_per_rank: a multiple of 8, what balanced sharding pads each rank's share to
FIGURE_CASES = ((50, 30, 12, 9, 7, 3), (9, 5), (33, 17, 1, 2, 15), (64,), (1, 1, 2, 3, 4, 5, 6, 7))



def _backward_each(model, step) -> list:  # noqa: ANN001
    """Each of the step's micro-batches forward and backward, as a training loop runs them; their losses."""
    losses = []
    for inputs in step.micro_batches:
        loss = model(**inputs).loss
        loss.backward()
        losses.append(loss)
    return losses

def documents(lengths: tuple[int, ...], seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(71 + seed)
    return [torch.randint(3, VOCAB, (n,), generator=g) for n in lengths]


def reference() -> tuple[float, dict[str, torch.Tensor]]:
    """float64, one process: each document alone through transformers' own attention and loss, its summed token
    losses over the step's targets; the gradient of the step's mean."""
    model = tiny_llama(torch.float64)
    targets = sum(n - 1 for n in LENGTHS)
    loss = sum(model(input_ids=d[None], labels=d[None]).loss * (len(d) - 1) for d in documents(LENGTHS)) / targets
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


def reference_no_target() -> float:
    """One process on a step whose every label is ``ignore_index``: transformers' loss of each planned micro-batch
    with ``num_items_in_batch`` 0 (the step's targets), summed."""
    from seqpar.sequence.dynamic import plan_dynamic
    from seqpar.sequence.dynamic_batch import pack_documents

    model = tiny_llama(torch.float64)
    docs = documents((5, 3, 2), seed=1)
    plan = plan_dynamic([5, 3, 2], 4, BUDGET)
    return float(sum(model(**pack_documents([docs[d] for d in mb.docs], [torch.full_like(docs[d], -100)
                                                                          for d in mb.docs]),
                           num_items_in_batch=0).loss.detach() for slot in plan.slots for mb in slot if mb.docs))


def _pool_task(rank: int, world: int) -> dict:
    import seqpar
    from seqpar.config import DynamicConfig, SeqParConfig
    from seqpar.sequence.batch import ShardedDataLoader
    from seqpar.sequence.dynamic_step import plan_step
    from seqpar.swap import swap_attention

    dynamic = DynamicConfig(max_tokens_per_rank=BUDGET)
    out: dict = {"groups": {}, "figures": [], "held": []}
    for sharding in ("contiguous", "zigzag", "balanced"):
        manager = seqpar.init_process_groups(sp_size=2, config={"sharding": sharding, "dynamic": {
            "max_tokens_per_rank": BUDGET}})
        try:
            assert (manager.dp_size, manager.sp_size) == (2, 2)
            if sharding == "contiguous":
                for c in manager.dynamic_sizes:
                    index = manager.pool_position // c
                    group = manager.dynamic_group(c, index)
                    got = torch.tensor([float(rank)])
                    dist.all_reduce(got, group=group)
                    out["groups"][c] = (index, dist.get_process_group_ranks(group), got.item(),
                                        manager.dynamic_ranks(c, index), manager.pool_position)
            for lengths in FIGURE_CASES:
                step = plan_step(documents(lengths), manager, dynamic)
                held = []
                for slot, inputs in enumerate(step.micro_batches):
                    mb = step.plan.micro_batch(manager.pool_position, slot)
                    if mb.docs:  # an empty micro-batch holds its padding tokens, no document: the plan counts 0
                        held.append((mb.tokens_per_rank, int(inputs["input_ids"].shape[1])))
                out["figures"].append((sharding, lengths, held, step.plan.peak_tokens_per_rank))
                samples = [{"input_ids": d} for d in documents(lengths)]
                loader = ShardedDataLoader(
                    torch.utils.data.DataLoader(samples, batch_size=len(samples),
                                                collate_fn=lambda s: {"input_ids": [x["input_ids"] for x in s]}),
                    manager=manager, dynamic=dynamic)
                (micro,) = list(loader)
                assert [m["input_ids"].shape for m in micro] == [m["input_ids"].shape for m in step.micro_batches]
            if sharding != "balanced":
                continue
            model = tiny_llama(torch.float32)
            swap_attention(model, SeqParConfig(size=2, sharding=sharding))
            step = plan_step(documents(LENGTHS), manager, dynamic)
            out["loss"] = float(step.loss(_backward_each(model, step)))
            grads = {}
            for name, p in model.named_parameters():  # the step's one reduction: a sum over the pool
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                dist.all_reduce(g, group=manager.sp_dp_group)
                grads[name] = g.double().clone()
            out["grads"] = grads
            out["sizes"] = sorted({mb.size for slot in step.plan.slots for mb in slot if mb.docs})
            model.zero_grad()
            docs = documents((5, 3, 2), seed=1)
            step = plan_step(docs, manager, dynamic, labels=[torch.full_like(d, -100) for d in docs])
            out["no_target_loss"] = float(step.loss(_backward_each(model, step)))
            out["no_target_nonzero"] = [n for n, p in model.named_parameters()
                                        if p.grad is not None and bool(p.grad.ne(0).any())]
        finally:
            seqpar.destroy_process_groups(manager)
    return out


@pytest.mark.timeout(300)
def test_dynamic_dp_by_sp_pool_groups_figures_and_step(dist_pool) -> None:
    ref_loss, ref_grads = reference()
    ref_no_target = reference_no_target()
    results = dist_pool.run(4, _pool_task, timeout=270)
    for rank, r in enumerate(results):
        position = rank  # tp 1: global rank = dp_rank * sp + sp_rank
        assert sorted(r["groups"]) == [1, 2, 4], r["groups"]
        for c, (index, ranks, total, listed, pos) in r["groups"].items():
            members = list(range(index * c, (index + 1) * c))
            assert (pos, index) == (position, position // c), (rank, c, pos, index)
            assert ranks == members and listed == members and total == sum(members), (rank, c, ranks, total)
        assert len(r["figures"]) == 3 * len(FIGURE_CASES)
        for sharding, lengths, held, _ in r["figures"]:
            assert all(planned == cut for planned, cut in held), (rank, sharding, lengths, held)
        assert r["sizes"] == [1, 2, 4], r["sizes"]
        assert abs(r["loss"] - ref_loss) <= 1e-5 * abs(ref_loss), (rank, r["loss"], ref_loss)
        for name, want in ref_grads.items():
            err = float((r["grads"][name] - want).abs().max() / want.abs().max())
            assert err <= 1e-4, f"rank {rank}: gradient of {name} {err:.3g} of its scale off"
        assert math.isnan(ref_no_target), ref_no_target  # one process: 0 / 0
        assert math.isnan(r["no_target_loss"]), (rank, r["no_target_loss"])
        assert r["no_target_nonzero"] == [], (rank, r["no_target_nonzero"])
    assert all(any(r["figures"][case][2] for r in results) for case in range(3 * len(FIGURE_CASES)))
    # the plan's peak is the most any rank holds in a slot (every rank's cut, per case)
    for case in range(3 * len(FIGURE_CASES)):
        sharding, lengths, _, peak = results[0]["figures"][case]
        most = max(cut for r in results for _, cut in r["figures"][case][2])
        assert peak == most, (sharding, lengths, peak, most)
