"""An int ``head_chunks`` under length-aware dynamic CP with ``mode="ulysses"`` (seqpar.attn.resolve): it must divide
each rank's share of the K/V heads at every group size the planner may hand a micro-batch, checked on every rank of
the pool alike, whatever group this rank's micro-batch got; and a group that is not one of dynamic CP's (a user's own
``group=``) is judged by its own size alone. 4 gloo ranks, one pool of 4 (dynamic sizes 1, 2, 4), tiny tensors, the
calls on the dynamic groups a planned step would use: a pair {0, 1} beside two one-rank groups, or two pairs.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist


def _outcome(q_heads: int, kv_heads: int, head_chunks: int, group: dist.ProcessGroup) -> str:
    """``seqpar.attention`` (ulysses, causal) on this rank's (1, heads, 4, 8) shard in ``group``: "ran", or the
    ValueError's message."""
    import seqpar

    q = torch.randn(1, q_heads, 4, 8, dtype=torch.float64)
    k = torch.randn(1, kv_heads, 4, 8, dtype=torch.float64)
    try:
        seqpar.attention(q, k, k, causal=True, mode="ulysses", head_chunks=head_chunks, group=group,
                         check_inputs=False)
    except ValueError as e:
        return str(e)
    return "ran"


def _calls(rank: int, world: int) -> dict:
    from seqpar.runtime.groups import init_process_groups

    manager = init_process_groups(sp_size=world, config={"dynamic": {"max_tokens_per_rank": 64}})
    try:
        assert manager.dynamic_sizes == (1, 2, 4), manager.dynamic_sizes
        pair, single = manager.dynamic_group(2, rank // 2), manager.dynamic_group(1, rank)
        mixed = pair if rank < 2 else single  # slot 0 planned as the pair {0, 1} and two one-rank groups
        own_pairs, _ = dist.new_subgroups(2)  # a user's own pairs: not dynamic CP's groups
        out = {
            # 8 / 4 heads, head_chunks 2: 2 K/V heads a rank in a pair, 1 in the group of 4 (which 2 does not divide)
            "largest_size": _outcome(8, 4, 2, pair),
            # 16 / 8 heads, head_chunks 4: 4 K/V heads a rank in a pair, 2 in the group of 4
            "largest_size_hc4": _outcome(16, 8, 4, pair),
            # 6 / 3 heads, head_chunks 3: a pair splits the 3 K/V heads unevenly (2 on the busier rank), refused
            # there; a one-rank group holds all 3
            "uneven_pair": _outcome(6, 3, 3, mixed),
            # the same 8 / 4 call on the user's own pairs: 2 K/V heads a rank, which 2 divides
            "own_group": _outcome(8, 4, 2, own_pairs),
        }
        dist.destroy_process_group(own_pairs)
        return out
    finally:
        manager.destroy()


@pytest.fixture(scope="module")
def outcomes(dist_pool) -> list[dict]:  # noqa: ANN001
    return dist_pool.run(4, _calls, timeout=240)


def test_a_size_larger_than_the_calls_group_is_checked_on_every_rank(outcomes: list[dict]) -> None:
    """8 / 4 heads, ``head_chunks=2``, the call on a pair: the planner may hand a micro-batch the group of 4, whose
    ranks hold 1 K/V head each; refused by name on every rank now, not at that step on that group's ranks alone.

    The same with 16 / 8 heads and ``head_chunks=4`` (2 K/V heads a rank in the group of 4).

    Seen failing: with the last (largest) dynamic size left out of the check (``manager.dynamic_sizes[:-1]``): "ran"
    on every rank; with the check run only for ``head_chunks=2`` (``head_chunks != 2`` for ``== "auto"`` in its
    guard): the ``head_chunks=4`` call "ran" on every rank; with ``is_dynamic_group`` knowing only the first of the
    rank's dynamic groups: "ran"."""
    for rank, got in enumerate(outcomes):
        assert "head_chunks=2 does not divide the 1 K/V heads each rank holds in a dynamic-CP group of 4" \
            in got["largest_size"], (rank, got)
        assert "head_chunks=4 does not divide the 2 K/V heads each rank holds in a dynamic-CP group of 4" \
            in got["largest_size_hc4"], (rank, got)


def test_a_group_of_the_users_own_is_judged_by_its_own_size(outcomes: list[dict]) -> None:
    """The same call on pairs made by ``dist.new_subgroups`` (not dynamic CP's groups): 2 K/V heads a rank, which
    ``head_chunks=2`` divides; it runs (the dynamic sizes are not its).

    Seen failing: with ``manager.is_dynamic_group`` not asked (every group under a dynamic manager checked at every
    dynamic size): refused on every rank ("... in a dynamic-CP group of 4")."""
    for rank, got in enumerate(outcomes):
        assert got["own_group"] == "ran", (rank, got)


def test_an_uneven_split_at_a_dynamic_size_is_refused_on_every_rank(outcomes: list[dict]) -> None:
    """6 / 3 heads, ``head_chunks=3``, a step planned as the pair {0, 1} beside two one-rank groups: the pair splits
    the 3 K/V heads unevenly (the busier rank 2), which 3 does not divide, and its ranks refuse; the one-rank groups
    (3 K/V heads) must refuse too, or they go on into the step's next collective while the pair has raised (the
    hang of fuzz case 1844892924, for an uneven split).

    Seen failing: with the check's condition ``split.even and split.kv_per_rank % head_chunks`` (before the fix):
    ranks 0, 1 "head_chunks=3 does not divide the 2 K/V heads each of the 2 Ulysses ranks holds", ranks 2, 3
    "ran". Passing since ``split.even and`` was dropped."""
    for rank, got in enumerate(outcomes):
        assert "head_chunks=3" in got["uneven_pair"], (rank, got)
