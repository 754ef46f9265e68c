"""Multi-node layout: SP and Ulysses groups follow node boundaries by default (consecutive ranks,
numbered node by node), and a layout that crosses them is explained. No process group needed."""

from __future__ import annotations

import pytest

from seqpar.groups import node_layout_problems, rank_grid


@pytest.mark.parametrize("world,sp,u,node", [(16, 4, 1, 8), (16, 8, 4, 8), (16, 16, 8, 8), (8, 2, 2, 4),
                                             (4, 2, 1, None), (4, 4, 2, 4)])
def test_good_layouts_are_silent_and_stay_in_nodes(world, sp, u, node):
    assert node_layout_problems(world, sp, u, node) == []
    if node and sp <= node:  # every SP group lies inside one node
        for row in rank_grid(world, sp).tolist():
            assert len({r // node for r in row}) == 1, row


def test_sp_group_straddling_nodes_is_explained():
    (problem,) = node_layout_problems(12, 6, 1, 4)
    assert "sequence_parallel.size 6" in problem and "4 ranks per node" in problem
    nodes_of_group_1 = {r // 4 for r in rank_grid(12, 6).tolist()[0]}
    assert nodes_of_group_1 == {0, 1}  # the problem the message describes is real


def test_ulysses_across_nodes_is_explained():
    (problem,) = node_layout_problems(16, 16, 16, 8)
    assert "ulysses_size 16" in problem and "divisor of 8" in problem
