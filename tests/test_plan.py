"""The ring's block planner: what each rank computes at each step, and zigzag's load balance."""

from __future__ import annotations

import itertools

import pytest

from seqpar.attention.plan import BlockCall, plan_blocks
from seqpar.sharding import chunk_ids


def visible_pairs(q_chunks: list[int], k_chunks: list[int], clen: int, causal: bool) -> set[tuple[int, int]]:
    """(global query position, global key position) pairs the definition of attention needs."""
    q_pos = [c * clen + i for c in q_chunks for i in range(clen)]
    k_pos = [c * clen + i for c in k_chunks for i in range(clen)]
    return {(a, b) for a in q_pos for b in k_pos if not causal or b <= a}


def planned_pairs(calls: list[BlockCall], q_chunks: list[int], k_chunks: list[int], clen: int) -> list[tuple[int, int]]:
    q_pos = [c * clen + i for c in q_chunks for i in range(clen)]
    k_pos = [c * clen + i for c in k_chunks for i in range(clen)]
    pairs = []
    for call in calls:
        for i in range(call.q_rows.start, call.q_rows.stop):
            for j in range(call.k_rows.start, call.k_rows.stop):
                if not call.causal or (j - call.k_rows.start) <= (i - call.q_rows.start):
                    pairs.append((q_pos[i], k_pos[j]))
    return pairs


@pytest.mark.parametrize("world,sharding,causal", list(itertools.product((1, 2, 3, 4, 5), ("contiguous", "zigzag"), (False, True))))
def test_plan_covers_exactly_the_visible_pairs_once(world: int, sharding: str, causal: bool) -> None:
    clen = 3
    for rank, src in itertools.product(range(world), range(world)):
        q_chunks, k_chunks = chunk_ids(rank, world, sharding), chunk_ids(src, world, sharding)
        planned = planned_pairs(plan_blocks(q_chunks, k_chunks, clen, causal), q_chunks, k_chunks, clen)
        assert len(planned) == len(set(planned)), "a pair computed twice would be double-counted"
        assert set(planned) == visible_pairs(q_chunks, k_chunks, clen, causal), (rank, src)


def _work(rank: int, world: int, sharding: str) -> int:
    clen = 4
    return sum(
        len(planned_pairs(plan_blocks(chunk_ids(rank, world, sharding), chunk_ids(src, world, sharding), clen, True),
                          chunk_ids(rank, world, sharding), chunk_ids(src, world, sharding), clen))
        for src in range(world)
    )


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_zigzag_balances_causal_work(world: int) -> None:
    zigzag = [_work(r, world, "zigzag") for r in range(world)]
    contiguous = [_work(r, world, "contiguous") for r in range(world)]
    assert len(set(zigzag)) == 1, zigzag
    assert contiguous[-1] > 2 * contiguous[0], contiguous  # the imbalance zigzag removes


def test_future_blocks_are_skipped_and_halves_are_one_call() -> None:
    assert plan_blocks([0], [1], 4, True) == []
    # zigzag, P=2: rank 0 holds chunks [0, 3]; rank 1's block [1, 2] is seen by chunk 3 only, in one call
    assert plan_blocks([0, 3], [1, 2], 4, True) == [BlockCall(slice(4, 8), slice(0, 8), False)]
    assert plan_blocks([1, 2], [0, 3], 4, True) == [BlockCall(slice(0, 8), slice(0, 4), False)]
