"""Length-aware dynamic CP through a swapped model (issue 32 §2, §3): every micro-batch runs attention and the
loss over the group its call carries, and a step equals one process running the planned micro-batches in
sequence.

At 4 gloo ranks (the pool: SP = 4, DP = 1), a tiny fp32 Llama swapped over the manager's full SP group, two SGD
steps of planned documents (``max_tokens_per_rank`` 16):

- step 1, lengths (50, 30, 12, 9, 7, 3): slot 0 is one micro-batch over all 4 ranks (the 50-token document),
  slot 1 holds a 2-rank micro-batch and two 1-rank ones with two documents packed each (mixed group sizes in
  one slot);
- step 2, lengths (9, 5): fewer documents than ranks, so two ranks run empty micro-batches (the issue's "No
  hang"): every rank completes, and their zero loss and gradients change nothing.

The reference is float64 on one process: each document run alone by transformers, its summed token loss
divided by the step's target count (the loss is the per-token mean over the whole pool's step), gradients
accumulated over the step, the same SGD step. seqpar's gradients, summed once per step over the pool, equal
it (each parameter judged on its own scale), and so does the step's loss.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

from hf_tiny import VOCAB, tiny_llama  # noqa: E402

STEPS = ((50, 30, 12, 9, 7, 3), (9, 5))
BUDGET = 16  # max_tokens_per_rank
LR = 0.5  # SGD: step 2's gradients see step 1's update, so a wrong step-1 gradient shows twice


def documents(lengths: tuple[int, ...], step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(32 + step)
    return [torch.randint(3, VOCAB, (n,), generator=g) for n in lengths]


def reference() -> list[tuple[float, dict[str, torch.Tensor]]]:
    """float64, one process: per step, every document alone, summed token losses over the step's targets."""
    model = tiny_llama(torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out = []
    for step, lengths in enumerate(STEPS):
        targets = sum(n - 1 for n in lengths)
        loss = sum(model(input_ids=d[None], labels=d[None]).loss * (len(d) - 1)
                   for d in documents(lengths, step)) / targets
        loss.backward()
        out.append((float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}))
        opt.step()
        opt.zero_grad()
    return out


def _dynamic_steps(rank: int, world: int) -> list[tuple[float, dict[str, torch.Tensor], list[tuple[int, int]]]]:
    import seqpar
    from seqpar.config import SeqParConfig
    from seqpar.sequence.dynamic import plan_dynamic
    from seqpar.sequence.dynamic_batch import rank_micro_batches
    from seqpar.swap import swap_attention

    manager = seqpar.init_process_groups(
        sp_size=world, config={"sharding": "zigzag", "dynamic": {"max_tokens_per_rank": BUDGET, "min_size": 1}})
    try:
        model = tiny_llama(torch.float32)
        swap_attention(model, SeqParConfig(size=world, sharding="zigzag"))  # the manager's full SP group
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        out = []
        for step, lengths in enumerate(STEPS):
            plan = plan_dynamic(lengths, manager.pool_size, BUDGET)
            loss = torch.zeros((), dtype=torch.float64)
            ran = []
            for inputs in rank_micro_batches(plan, documents(lengths, step), manager, sharding="zigzag"):
                size = dist.get_world_size(inputs["seqpar_group"])
                step_loss = model(**inputs).loss
                step_loss.backward()
                loss += step_loss.detach().double() / size  # each group's ranks all hold its loss
                ran.append((size, inputs["input_ids"].shape[1]))
            dist.all_reduce(loss, group=manager.sp_dp_group)
            grads = {}
            for name, p in model.named_parameters():  # reduced once per step, a sum over the pool
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad, group=manager.sp_dp_group)
                grads[name] = p.grad.detach().double().clone()
            opt.step()
            opt.zero_grad()
            out.append((float(loss), grads, ran))
        return out
    finally:
        seqpar.destroy_process_groups(manager)


@pytest.mark.timeout(180)
def test_dynamic_llama_steps_equal_one_process(dist_pool) -> None:
    from seqpar.sequence.dynamic import plan_dynamic

    plans = [plan_dynamic(lengths, 4, BUDGET) for lengths in STEPS]
    # the plans hold what this test is about: mixed sizes in one slot, and empty micro-batches
    assert any({mb.size for mb in slot if mb.docs} >= {1, 2} for slot in plans[0].slots), plans[0].slots
    assert any(mb.size == 4 for slot in plans[0].slots for mb in slot), plans[0].slots
    assert any(not mb.docs for slot in plans[1].slots for mb in slot), plans[1].slots
    ref = reference()
    results = dist_pool.run(4, _dynamic_steps, timeout=150)
    for rank, steps in enumerate(results):
        for step, ((loss, grads, ran), (ref_loss, ref_grads)) in enumerate(zip(steps, ref)):
            assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (rank, step, loss, ref_loss)
            for name, want in ref_grads.items():
                err = float((grads[name] - want).abs().max() / want.abs().max())
                assert err <= 1e-4, f"rank {rank} step {step}: grad of {name} {err:.3g} of its scale off ({ran})"
