"""Dynamic CP's group rank lists on pools of 8 and more, DP x SP x TP, without processes (session 21, mut21d).

``tests/test_dynamic_groups.py`` makes the groups for real at 4 gloo ranks, where every layout has DP or SP of 1,
or the only new size is the SP group or the whole pool: the flattening of the ``(dp, sp)`` grid into pool
positions is never used there with both axes above 1. Here :class:`seqpar.runtime.dynamic_groups.DynamicGroups`
runs on a stand-in manager (its cube from :func:`seqpar.runtime.grid.rank_cube`, ``new_group`` recorded), for
every rank of layouts up to 16 ranks, against rank lists written by hand: position ``p = dp_rank * sp + sp_rank``
of TP rank ``t`` is global rank ``p * tp + t``, and group ``(c, i)`` is positions ``[i c, (i + 1) c)``.

Seen failing (each alone): the pool flattened column-major (``cube.permute(2, 1, 0)`` in
``_make_dynamic_groups``: strided groups ``{0, 4}`` at DP 2 x SP 4); ``pool_position`` as ``sp_rank * dp + dp_rank``;
``dynamic_ranks`` reading the transposed grid.
"""

from __future__ import annotations

import pytest

from seqpar.runtime.dynamic_groups import DynamicGroups
from seqpar.runtime.grid import dynamic_group_sizes, rank_cube

LAYOUTS = [  # (world, sp, tp, min_size)
    (8, 4, 1, 1),
    (8, 2, 1, 1),
    (8, 2, 2, 1),
    (16, 4, 2, 1),
    (16, 2, 1, 2),
    (12, 2, 1, 1),  # a pool of 6: groups of 1 and 2 only
]


class _Manager(DynamicGroups):
    def __init__(self, world: int, sp: int, tp: int, rank: int) -> None:
        self.cube = rank_cube(world, sp, tp)
        self.rank = rank
        self.dp_size, self.sp_size, self.tp_size = self.cube.shape
        self.dp_rank, self.sp_rank, self.tp_rank = (int(i) for i in (self.cube == rank).nonzero()[0])
        self.grid = self.cube[:, :, self.tp_rank]
        self.self_group, self.sp_group, self.sp_dp_group = "self", "sp", "sp_dp"
        self.created: list[list[list[int]]] = []

    def _new_groups(self, rank_lists, kw):  # noqa: ANN001, ANN202 - records what new_group would be given
        self.created.append(rank_lists)
        for ranks in rank_lists:
            if self.rank in ranks:
                return ("new", tuple(ranks))
        return None


@pytest.mark.parametrize(("world", "sp", "tp", "min_size"), LAYOUTS)
def test_every_rank_gets_the_aligned_block_of_pool_positions(world: int, sp: int, tp: int, min_size: int) -> None:
    pool = world // tp
    sizes = dynamic_group_sizes(pool, min_size)
    orders = []
    for rank in range(world):
        m = _Manager(world, sp, tp, rank)
        t = rank % tp
        position = rank // tp  # global rank = position * tp + t (TP innermost, then SP, then DP)
        assert m.pool_position == position, (rank, m.pool_position)
        m._dynamic_groups = m._make_dynamic_groups(min_size, {})
        assert tuple(m._dynamic_groups) == tuple(sizes)
        for c in sizes:
            index = position // c
            members = [(index * c + j) * tp + t for j in range(c)]
            assert m.dynamic_ranks(c, index) == members, (rank, c)
            group = m.dynamic_group(c, index)
            if c == 1:
                assert group == "self"
            elif c == pool:
                assert group == "sp_dp"
            elif c == sp:  # the SP group: the rank's row of the grid, which is this block
                assert group == "sp" and members == [(position // sp * sp + j) * tp + t for j in range(sp)]
            else:
                assert group == ("new", tuple(members)), (rank, c, group)
        # every family whole, every TP rank set's groups, the same list on every rank (new_group's rule)
        family = [[[(i * c + j) * tp + u for j in range(c)] for u in range(tp) for i in range(pool // c)]
                  for c in sizes if c not in (1, pool, sp)]
        assert m.created == family, (rank, m.created)
        orders.append(m.created)
    assert all(o == orders[0] for o in orders)
