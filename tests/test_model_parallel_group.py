"""The model-parallel group (issue 20 §2): one local group creation per rank, not one collective
creation per rank of the world, and a valid group that DeepSpeed's gradient clipping reduces over.

- Group creations counted against theory on 4 ranks for every layout: a family of groups costs one
  ``new_group`` per group, or one in all when its groups are single ranks (the model-parallel group;
  SP or DP of size 1); every family's group is initialised by exactly one collective.
- DeepSpeed (ZeRO 0 and 2, SGD, ``gradient_clipping`` active) at SP 2 x DP 2: its reduced gradients, and
  the clipped gradients it applies, equal float64 gradients of the whole batch on one process (written out
  here, no seqpar code), unclipped and clipped. ``None`` (the whole world) as the
  model-parallel group would sum the gradient norm over the 4 replicas and clip twice as hard.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from test_engines import ToyLM, _clean, _global_batch, _rows, _sp_step_loss

import seqpar
from seqpar.testing.deepspeed_teardown import releases_deepspeed_engines

LAYOUTS = [(1, 1), (2, 1), (4, 1), (4, 2), (4, 4), (2, 2)]  # (sp, ulysses) on 4 ranks


def expected_creations(world: int, sp: int, u: int) -> tuple[int, int]:
    """(new_group calls, eager set-up collectives) per rank when seqpar builds the groups of a layout."""
    dp = world // sp
    families = [(dp, sp), (sp, dp), (1, world), (world, 1)]  # (groups, ranks each): SP, DP, SP-DP, MP
    if 1 < u < sp:
        families += [(dp * sp // u, u), (dp * u, sp // u)]  # Ulysses, ring
    return sum(1 if size == 1 else n for n, size in families), len(families)


def _creations(world: int, sp: int, u: int) -> tuple[seqpar.ProcessGroupManager, list[list[int]], int]:
    """Build the groups of a layout; return the manager, the rank lists of every ``new_group`` call and
    the number of all-reduces (the eager set-ups) this rank made meanwhile."""
    calls: list[list[int]] = []
    reduces = [0]
    new_group, all_reduce = dist.new_group, dist.all_reduce

    def counting_new_group(ranks=None, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        calls.append(list(ranks) if ranks is not None else list(range(world)))
        return new_group(ranks, *args, **kwargs)

    def counting_all_reduce(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        reduces[0] += 1
        return all_reduce(*args, **kwargs)

    dist.new_group, dist.all_reduce = counting_new_group, counting_all_reduce
    try:
        manager = seqpar.init_process_groups(sp_size=sp, ulysses_size=u)
    finally:
        dist.new_group, dist.all_reduce = new_group, all_reduce
    return manager, calls, reduces[0]


def _count_creations(rank: int, world: int) -> list[dict]:
    out = []
    for sp, u in LAYOUTS:
        m, calls, reduces = _creations(world, sp, u)
        mp = m.get_model_parallel_group()
        mine = torch.tensor([float(rank + 1)])
        dist.all_reduce(mine, group=mp)  # a valid group of this rank alone
        out.append({"calls": calls, "reduces": reduces, "mp": (dist.get_world_size(mp), mine.item(),
                    dist.get_process_group_ranks(mp), m.get_model_parallel_world_size(), m.get_model_parallel_rank())})
        m.destroy()
    return out


def test_group_creations_match_theory(dist_pool) -> None:
    per_rank = dist_pool.run(4, _count_creations, timeout=240)
    for rank, layouts in enumerate(per_rank):
        for (sp, u), got in zip(LAYOUTS, layouts):
            calls, inits = expected_creations(4, sp, u)
            assert len(got["calls"]) == calls, (rank, sp, u, got["calls"])
            assert got["reduces"] == inits, (rank, sp, u, got["reduces"])
            assert sum(len(c) == 1 for c in got["calls"]) <= 2, got["calls"]  # MP (+ one size-1 SP/DP axis)
            assert [rank] in got["calls"], got["calls"]  # the model-parallel group: made by this rank alone
            assert got["mp"] == (1, rank + 1.0, [rank], 1, 0), got["mp"]


# ------------------------------------------------------------------------ DeepSpeed clipping
SGD_LR = 1.0


def _reference_float64(global_bs: int) -> tuple[dict[str, torch.Tensor], float]:
    """One process, float64, the whole global batch and the full sequence, none of seqpar's code: ToyLM's
    forward written out with SDPA (GQA as ``enable_gqa``: query head h reads kv head h // (HEADS / KV_HEADS))
    and the mean next-token cross-entropy over every row's S - 1 targets. Returns (gradients, global norm)."""
    from test_engines import DIM, HEADS, KV_HEADS

    torch.manual_seed(0)
    model = ToyLM().double()
    ids = _global_batch(0, global_bs)["input_ids"]
    b, s = ids.shape
    x = model.embed(ids) + model.pos(torch.arange(s))[None]
    for blk in model.blocks:
        h = blk.norm1(x)
        q = blk.q(h).view(b, s, HEADS, DIM // HEADS).transpose(1, 2)
        k, v = blk.kv(h).view(b, s, 2, KV_HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + blk.o(a.transpose(1, 2).reshape(b, s, DIM))
        x = x + blk.mlp(blk.norm2(x))
    logits = model.head(model.norm(x))
    F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()])).item()
    return grads, norm


def _assert_close_own_scale(got: torch.Tensor, want: torch.Tensor, what: str, floor: float = 0.0) -> None:
    """fp32 against float64, judged on the parameter's own scale (its largest float64 entry): 1e-5 of it,
    plus ``floor`` (an applied update's own rounding, see the test)."""
    own = float(want.abs().max())
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * own + floor,
                               msg=lambda m: f"{what} (own scale {own:.3g}): {m}")


@releases_deepspeed_engines
def _ds_clipped_step(rank: int, world: int, sp: int, stage: int, clip: float) -> dict[str, torch.Tensor]:
    """One DeepSpeed SGD step with clipping; returns the reduced gradients before it clips them and the
    update it applied, divided by the LR."""
    from deepspeed.utils import safe_get_full_grad

    from seqpar.integrations.deepspeed import initialize

    dp = world // sp
    torch.manual_seed(0)
    model = ToyLM()
    config = {
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": dp,
        "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
        "gradient_clipping": clip, "steps_per_print": 10**6,
        "sequence_parallel": {"size": sp, "mode": "ring", "sharding": "contiguous", "swap": "none"},
    }
    engine, _, _, _ = initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=SGD_LR), config=config)
    manager = engine.seqpar_manager
    before = {_clean(n): p.detach().clone() for n, p in engine.module.named_parameters()}
    loss = _sp_step_loss(engine, _rows(_global_batch(0, dp), manager.dp_rank, 1), manager, "contiguous")
    engine.backward(loss)
    reduced = {_clean(n): safe_get_full_grad(p).detach().clone() for n, p in engine.module.named_parameters()}
    engine.step()
    applied = {_clean(n): (before[_clean(n)] - p.detach()) / SGD_LR for n, p in engine.module.named_parameters()}
    largest = max(float(p.detach().abs().max()) for p in engine.module.parameters())
    return {"reduced": reduced, "applied": applied, "largest": largest}


@pytest.mark.parametrize("stage", [0, 2])
def test_deepspeed_clipping_reduces_over_the_model_parallel_group(dist_pool, stage: int) -> None:
    """SP 2 x DP 2, against float64 on one process (:func:`_reference_float64`, no seqpar code): the reduced
    gradients before clipping equal its gradients, and the clipped gradient DeepSpeed applies (SGD:
    update / LR) equals them clipped to the same bound, parameter by parameter on each one's own scale.
    The unclipped comparison is what sees a factor on every gradient: clipping divides it out again.

    Seen failing (2026-11-29): every SP gradient doubled (``sequence_parallel_loss`` returning twice the
    loss): the old test, whose reference itself ran ``shard_batch`` and ``sequence_parallel_loss`` and which
    compared only the clipped gradients, passed; this one fails on the reduced gradients."""
    world, sp = 4, 2
    grads, norm = _reference_float64(world // sp)
    clip = norm / 3  # clipping active: the applied gradient is scaled by clip / norm
    coef = clip / (norm + 1e-6)  # DeepSpeed's coefficient (torch's clip_grad_norm_ uses the same)
    out = dist_pool.run(world, _ds_clipped_step, sp, stage, clip, timeout=300)
    for rank, got in enumerate(out):
        assert set(got["reduced"]) == set(got["applied"]) == set(grads)
        for name, want in grads.items():
            _assert_close_own_scale(got["reduced"][name], want, f"rank {rank} {name}: reduced gradient")
            # (before - after) / LR in fp32 carries the rounding of both parameters: up to 2**-24 of the
            # largest parameter each (measured: 1.2e-7 on embed.weight, whose gradient scale is 1.6e-3)
            _assert_close_own_scale(got["applied"][name], want * coef, f"rank {rank} {name}: clipped gradient",
                                    floor=2 * 2.0**-24 * got["largest"] / SGD_LR)
