"""The dynamic-CP head_chunks check (seqpar.attn.resolve) when the pool's largest size is 2 (2 gloo ranks, dynamic
sizes 1, 2): a call on one-rank groups is refused on both ranks when a pair could not run it, as in fuzz case
1844892924 (2 K/V heads, ``head_chunks=2``). tests/test_audit27_dynamic_head_chunks.py's pool of 4 refuses its
cases at size 4 as well, so a check that skipped size 2 passed there."""

from __future__ import annotations

import pytest
import torch


def _single_group_call(rank: int, world: int) -> str:
    """``seqpar.attention`` (ulysses, causal, 4 / 2 heads, ``head_chunks=2``) on this rank's one-rank dynamic
    group: "ran", or the ValueError's message."""
    import seqpar
    from seqpar.runtime.groups import init_process_groups

    manager = init_process_groups(sp_size=world, config={"dynamic": {"max_tokens_per_rank": 64}})
    try:
        assert manager.dynamic_sizes == (1, 2), manager.dynamic_sizes
        q = torch.randn(1, 4, 4, 8, dtype=torch.float64)
        k = torch.randn(1, 2, 4, 8, dtype=torch.float64)
        try:
            seqpar.attention(q, k, k, causal=True, mode="ulysses", head_chunks=2,
                             group=manager.dynamic_group(1, rank), check_inputs=False)
        except ValueError as e:
            return str(e)
        return "ran"
    finally:
        manager.destroy()


@pytest.mark.timeout(300)
def test_a_pairs_share_is_checked_when_the_pool_is_two_ranks(dist_pool) -> None:  # noqa: ANN001
    """Each rank alone in a one-rank group holds both K/V heads (which 2 divides), but a pair would hold one each:
    both ranks refuse, naming the group of 2.

    Seen failing: the check from size 3 up (``if u <= 2: continue``): both ranks "ran", so a step that planned a
    pair next would refuse on the pair's ranks only."""
    for out in dist_pool.run(2, _single_group_call, timeout=240):
        assert "head_chunks=2 does not divide the 1 K/V heads" in out and "group of 2" in out, out
