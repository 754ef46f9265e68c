"""The ring's block planner: what each rank computes at each step, and zigzag's load balance."""

from __future__ import annotations

import bisect
import itertools
import random

import pytest

from seqpar.attn.masks import MaskSpec, plan_pieces
from seqpar.attn.plan import BlockCall, plan_blocks
from seqpar.sequence.sharding import chunk_ids


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


def test_plan_covers_any_chunk_lists_exactly_once() -> None:
    """plan_blocks is public (seqpar.attention.plan): any lists of distinct chunks, in any order and sharing
    chunks, plan exactly the visible pairs once. The shardings never reach its diagonal runs (a rank's own
    block is one ascending list on both sides, taken whole; other ranks share no chunk), so only lists like
    these test them: [2, 0] against [0, 2] has two diagonal chunks, neither at the start of its list.

    Seen failing: a diagonal run planned as a full block (``runs.append((j, j + 1, False))`` in plan_blocks),
    which every sharded test, test_plan_covers_exactly_the_visible_pairs_once included, let through."""
    rng = random.Random(11)
    lists = [([2, 0], [0, 2]), ([1, 3, 0], [3, 1]), ([0], [0]), ([4, 1], [1, 2, 4])]
    for _ in range(300):
        n = rng.randint(1, 7)
        lists.append((rng.sample(range(n), rng.randint(1, n)), rng.sample(range(n), rng.randint(1, n))))
    for (q_chunks, k_chunks), causal, clen in itertools.product(lists, (False, True), (1, 3)):
        planned = planned_pairs(plan_blocks(q_chunks, k_chunks, clen, causal), q_chunks, k_chunks, clen)
        assert len(planned) == len(set(planned)), (q_chunks, k_chunks, causal, clen)
        assert set(planned) == visible_pairs(q_chunks, k_chunks, clen, causal), (q_chunks, k_chunks, causal, clen)


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


def _mask_visible(spec, i: int, j: int) -> bool:  # noqa: ANN001
    """The definition of issue 10, written independently of the planner."""
    if spec.cu_seqlens is not None and bisect.bisect_right(spec.cu_seqlens, i) != bisect.bisect_right(spec.cu_seqlens, j):
        return False
    if spec.causal:
        return 0 <= i - j and (spec.window is None or i - j < spec.window)
    return spec.window is None or abs(i - j) < spec.window


def _mask_planned(calls: list[BlockCall], q_pos: list[int], k_pos: list[int]) -> list[tuple[int, int]]:
    pairs = []
    for c in calls:
        n, m = c.q_rows.stop - c.q_rows.start, c.k_rows.stop - c.k_rows.start
        assert n > 0 and m > 0, c
        assert not (c.causal and c.anti), c
        if c.causal or c.anti:
            assert n == m, f"triangles are square: {c}"
        for x in range(n):
            for y in range(m):
                if (c.causal and y > x) or (c.anti and y < x):
                    continue
                pairs.append((q_pos[c.q_rows.start + x], k_pos[c.k_rows.start + y]))
    return pairs


def test_mask_plan_covers_exactly_the_visible_pairs_once() -> None:
    """Random documents (lengths from 1 up), windows from 1 to wider than the sequence, causal or
    not, contiguous and zigzag at P = 1..3: every planned pair is visible, every visible pair is
    planned once, and a block pair with nothing visible has no call."""
    rng = random.Random(0)
    for _ in range(300):
        seq = rng.choice([12, 24, 30])
        cuts = sorted(rng.sample(range(1, seq), rng.randint(0, 6)))
        spec = MaskSpec(
            causal=rng.random() < 0.5,
            window=rng.choice([None, 1, 2, 3, 5, 7, 13, 40]),
            cu_seqlens=(0, *cuts, seq) if rng.random() < 0.8 else None,
        )
        world = rng.choice([1, 2, 3])
        for sharding in ("contiguous", "zigzag"):
            clen = seq // (world if sharding == "contiguous" else 2 * world)
            if seq % (world if sharding == "contiguous" else 2 * world):
                continue
            for rank, src in itertools.product(range(world), range(world)):
                qr = [(c * clen, (c + 1) * clen) for c in chunk_ids(rank, world, sharding)]
                kr = [(c * clen, (c + 1) * clen) for c in chunk_ids(src, world, sharding)]
                q_pos = [p for a, b in qr for p in range(a, b)]
                k_pos = [p for a, b in kr for p in range(a, b)]
                planned = _mask_planned(plan_pieces(spec, qr, kr), q_pos, k_pos)
                want = {(i, j) for i in q_pos for j in k_pos if _mask_visible(spec, i, j)}
                assert len(planned) == len(set(planned)), (spec, rank, src)
                assert set(planned) == want, (spec, rank, src, sorted(set(planned) ^ want)[:4])


def test_mask_plan_is_few_calls() -> None:
    """A dense causal diagonal is one causal call; documents inside a block are one call each (two for
    a causal diagonal with a window: the band's triangles)."""
    assert plan_pieces(MaskSpec(causal=True, cu_seqlens=(0, 16)), [(0, 8)], [(0, 8)]) == [
        BlockCall(slice(0, 8), slice(0, 8), True)
    ]
    assert len(plan_pieces(MaskSpec(causal=False, cu_seqlens=(0, 3, 8)), [(0, 8)], [(0, 8)])) == 2
    # full rectangles of one document fuse across the chunks they span
    assert plan_pieces(MaskSpec(causal=False, cu_seqlens=(0, 32)), [(0, 8), (24, 32)], [(8, 16), (16, 24)]) == [
        BlockCall(slice(0, 16), slice(0, 16), False)
    ]


def test_block_calls_join_a_ranks_consecutive_chunks() -> None:
    """block_calls (what the ring and the all-gather run) under balanced and zigzag sharding with random
    documents, causal or not, with or without a window, at P = 1..4: every planned pair is visible and
    every visible pair planned once; and a document whole on one rank (balanced cuts it into 8 chunks)
    is one causal call, not a triangle per chunk and a rectangle per chunk row.
    Seen failing: joining chunks that are not consecutive (``<=`` for ``==`` in the join) plans rows past
    the block (IndexError in the pair check); without the join the whole document was 15 calls."""
    from seqpar.attn.common import AttentionOptions, block_calls
    from seqpar.sequence.sharding import chunk_ids as ids

    rng = random.Random(1)
    for _ in range(60):
        world = rng.choice([1, 2, 3, 4])
        sharding = rng.choice(["balanced", "zigzag"])
        seq = 16 * world * rng.choice([1, 2])
        cuts = sorted(rng.sample(range(1, seq), rng.randint(0, 5)))
        cu = (0, *cuts, seq)
        opts = AttentionOptions(causal=rng.random() < 0.7, scale=1.0, sharding=sharding, cu_seqlens=cu,
                                window=rng.choice([None, None, 3, 9]))
        seq_local = seq // world
        spec = MaskSpec(opts.causal, opts.window, cu)
        for rank, src in itertools.product(range(world), range(world)):
            pos = []
            for r in (rank, src):
                chunks = ids(r, world, sharding, seq_len=seq, cu_seqlens=cu)
                clen = seq_local // len(chunks)
                pos.append([c * clen + i for c in chunks for i in range(clen)])
            planned = _mask_planned(list(block_calls(opts, world, rank, src, seq_local)), pos[0], pos[1])
            want = {(i, j) for i in pos[0] for j in pos[1] if _mask_visible(spec, i, j)}
            assert len(planned) == len(set(planned)), (opts, rank, src)
            assert set(planned) == want, (opts, rank, src, sorted(set(planned) ^ want)[:4])
    whole = AttentionOptions(causal=True, scale=1.0, sharding="balanced", cu_seqlens=(0, 1024))
    assert block_calls(whole, 1, 0, 0, 1024) == (BlockCall(slice(0, 1024), slice(0, 1024), True),)
