"""The dynamic-CP head_chunks check (seqpar.attn.resolve._check_head_chunks_every_dynamic_size) under tensor
parallelism: 4 gloo ranks, TP 2 x SP 2, so each TP rank set is a pool of 2 (dynamic sizes 1, 2). The heads a rank
holds are its TP shard; the check splits them over every dynamic size and, when a size cannot take them at all,
its refusal says that these are the heads TP leaves the rank (``head_split(..., tp=manager.tp_size)``), so that the
user's fix (a smaller tp_size) is named. Audit 28's survivor H3."""

from __future__ import annotations

import pytest
import torch


def _one_rank_group_call(rank: int, world: int) -> str:
    """``seqpar.attention`` (ulysses, causal, 1 / 1 heads on this rank: the model's 2 / 2 over TP 2,
    ``head_chunks=1``) on this rank's one-rank dynamic group: "ran", or the ValueError's message."""
    import seqpar
    from seqpar.runtime.groups import init_process_groups

    manager = init_process_groups(sp_size=2, tp_size=2, config={"dynamic": {"max_tokens_per_rank": 64}})
    try:
        assert manager.tp_size == 2 and manager.dynamic_sizes == (1, 2), (manager.tp_size, manager.dynamic_sizes)
        q = torch.randn(1, 1, 4, 8, dtype=torch.float64)
        k = torch.randn(1, 1, 4, 8, dtype=torch.float64)
        try:  # pool position of this rank in its TP rank set: rank // tp (TP is the innermost axis)
            seqpar.attention(q, k, k, causal=True, mode="ulysses", head_chunks=1,
                             group=manager.dynamic_group(1, rank // 2), check_inputs=False)
        except ValueError as e:
            return str(e)
        return "ran"
    finally:
        manager.destroy()


@pytest.mark.timeout(420)
def test_a_pairs_split_under_tp_names_the_tp_shard(dist_pool) -> None:  # noqa: ANN001
    """Alone in a one-rank group each rank runs its one head, but a pair of the pool could not split it (1 query
    head over 2 Ulysses ranks): every rank refuses before any exchange, and the message says the heads are what
    tp_size 2 leaves the rank.

    Seen failing: the check's head split with ``tp=1`` (audit 28's H3, ``head_split(..., tp=1)``): the refusal on
    every rank without the TP note ("These are the heads tensor parallelism leaves this rank ... tp_size 2")."""
    for out in dist_pool.run(4, _one_rank_group_call, timeout=360):
        assert "cannot be split over 2 Ulysses ranks" in out, out
        assert "tensor parallelism leaves this rank" in out and "tp_size 2" in out, out
