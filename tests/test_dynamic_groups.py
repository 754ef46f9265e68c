"""Dynamic CP's groups (issue 32 §2): made once, at ``init_process_groups``, NCCL-rules safe.

At 4 gloo ranks, for layouts dp x sp x tp = 4 x 1 x 1, 1 x 4 x 1, 2 x 1 x 2 (and ``min_size`` 2): every
aligned group ``(size, index)`` of every size the planner may choose exists on its members, holds the
pool positions ``[index * size, (index + 1) * size)`` of this rank's TP rank set (checked against
torch's own view and by an all-reduce over it), every rank called ``new_group`` with the same rank
lists in the same order (recorded on each rank, compared across ranks), and looking a group up (as a
step would) creates nothing.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

LAYOUTS = [  # (sp_size, tp_size, min_size)
    (1, 1, 1),
    (4, 1, 1),
    (1, 2, 1),
    (4, 1, 2),
]


def _expected(world: int, sp: int, tp: int, min_size: int) -> dict[int, list[list[int]]]:
    """size -> the groups of every TP rank set (global ranks), from the cube (dp, sp, tp) by hand."""
    pool = world // tp
    out: dict[int, list[list[int]]] = {}
    c = min_size
    while c <= pool and pool % c == 0:
        groups = []
        for t in range(tp):
            ranks = [p * tp + t for p in range(pool)]  # position p = dp * sp + sp_rank -> global p * tp + t
            groups += [ranks[i * c:(i + 1) * c] for i in range(pool // c)]
        out[c] = groups
        c *= 2
    return out


def _recording(new_group, created: list):  # noqa: ANN001, ANN202
    """``dist.new_group`` that also records the rank lists it was called with, in order."""
    def recording(ranks=None, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if kwargs.get("use_local_synchronization"):  # this rank alone, by design not collective
            created.append("local")
        else:
            created.append(sorted(ranks) if ranks is not None else None)
        return new_group(ranks, *args, **kwargs)

    return recording


def _one_layout(rank: int, world: int, sp: int, tp: int, min_size: int) -> dict:
    from seqpar.runtime.groups import init_process_groups

    new_group = dist.new_group
    created: list = []
    dist.new_group = _recording(new_group, created)
    try:
        manager = init_process_groups(sp_size=sp, tp_size=tp,
                                      config={"dynamic": {"max_tokens_per_rank": 64, "min_size": min_size}})
    finally:
        dist.new_group = new_group
    everyone: list = [None] * world
    dist.all_gather_object(everyone, created)  # what every rank created, in its order
    mine = {}
    during_step: list = []
    dist.new_group = _recording(new_group, during_step)
    try:
        for c in manager.dynamic_sizes:
            index = manager.pool_position // c
            group = manager.dynamic_group(c, index)
            total = torch.tensor([float(rank)])
            dist.all_reduce(total, group=group)  # the group works, over exactly its members
            if manager.pool_size // c > 1:  # another group of this size: not this rank's
                with pytest.raises(ValueError, match="is not in group"):
                    manager.dynamic_group(c, (index + 1) % (manager.pool_size // c))
            mine[c] = {"ranks": dist.get_process_group_ranks(group), "sum": total.item(),
                       "listed": manager.dynamic_ranks(c, index)}
        with pytest.raises(ValueError, match="no dynamic-CP groups of size"):
            manager.dynamic_group(3, 0)
    finally:
        dist.new_group = new_group
    manager.destroy()
    return {"sizes": manager.dynamic_sizes, "mine": mine, "orders": everyone, "during_step": len(during_step)}


def _dynamic_groups_worker(rank: int, world: int) -> list[dict]:
    return [_one_layout(rank, world, sp, tp, min_size) for sp, tp, min_size in LAYOUTS]


def test_dynamic_groups_exist_are_correct_and_made_in_one_order(dist_pool) -> None:
    world = 4
    out = dist_pool.run(world, _dynamic_groups_worker, timeout=120)
    for li, (sp, tp, min_size) in enumerate(LAYOUTS):
        expected = _expected(world, sp, tp, min_size)
        for rank in range(world):
            got = out[rank][li]
            assert list(got["sizes"]) == sorted(expected), (sp, tp, min_size, got["sizes"])
            for c, groups in expected.items():
                mine = next(g for g in groups if rank in g)
                assert got["mine"][c]["ranks"] == mine == got["mine"][c]["listed"], (sp, tp, c, rank, got["mine"][c])
                assert got["mine"][c]["sum"] == sum(mine)
            assert got["during_step"] == 0  # looking groups up creates none
            orders = got["orders"]
            assert all(o == orders[0] for o in orders), f"creation order differs across ranks: {orders}"
        # every size whose groups no earlier group covers was created, each group of it
        made = out[0][li]["orders"][0]
        for c, groups in expected.items():
            if 1 < c < world // tp and c != sp:
                assert all(g in made for g in groups), (sp, tp, c, made)


def test_init_refuses_a_min_size_the_pool_cannot_hold(dist_pool) -> None:
    out = dist_pool.run(4, _min_size_too_big, timeout=60)  # the 4-rank pool of the test above: no new spawn
    assert len(out) == 4 and all("min_size = 8 does not divide the pool of 4 ranks" in m for m in out), out


def _min_size_too_big(rank: int, world: int) -> str:
    from seqpar.runtime.groups import default_manager, init_process_groups

    with pytest.raises(ValueError) as info:
        init_process_groups(sp_size=2, config={"dynamic": {"max_tokens_per_rank": 64, "min_size": 8}})
    assert default_manager() is None
    return str(info.value)
