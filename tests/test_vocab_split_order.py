"""A vocabulary-split LM head whose TP ranks hold their rows out of rank order (TP rank 0 the upper ids, rank 1 the
lower): ``tiled_lm_loss(vocab_split=...)`` reads each rank's first id from its :class:`VocabSplitHead`, not from
its rank, so such a split is valid and its loss and gradients equal one process's in float64. DeepSpeed's
``VocabParallelLinear`` always lays rank r's rows after rank r - 1's; a hand-made split need not (audit 27's
survivor T16: the slice check's coverage walk had no test of an unsorted split).
"""

from __future__ import annotations

import torch

VOCAB, HIDDEN = 11, 8
SLICES = {0: (5, 6), 1: (0, 5)}  # tp rank -> (vocab_start, rows): rank 0 holds ids 5..10, rank 1 ids 0..4


def _reversed_split(rank: int, world: int) -> str:
    """On 2 gloo ranks, the pair as the TP group, rows out of rank order: loss, count and every gradient against
    one process's float64 cross entropy over the whole head, at 4-row tiles and the automatic tile."""
    import torch.distributed as dist
    from test_audit26_vocab_split import assert_slice_matches, one_process_reference

    from seqpar.sequence.vocab_parallel import VocabSplitHead

    start, rows = SLICES[rank]
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(2, 7, HIDDEN, generator=g, dtype=torch.float64)
    weight = torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64)
    targets = torch.randint(0, VOCAB, (2, 7), generator=g)
    targets[0, 1] = 0
    targets[1, 3] = VOCAB - 1
    targets[1, 5] = -100
    reference = one_process_reference(hidden, weight, targets)
    split = VocabSplitHead(dist.group.WORLD, start, VOCAB, max(r for _, r in SLICES.values()))
    for chunk_rows in (4, None):
        assert_slice_matches(hidden, weight, targets, (start, rows), split, chunk_rows, reference)
    return "exact"


def test_a_split_out_of_rank_order_matches_one_process(dist_pool) -> None:  # noqa: ANN001
    """Seen failing: with the slice check's coverage walk over the slices in rank order (``sorted`` dropped,
    tiling._check_vocab_split): refused, 'the slices (first id, rows) [(5, 6), (0, 5)] by TP rank do not cover
    the 11 ids once'."""
    assert dist_pool.run(2, _reversed_split, timeout=180) == ["exact", "exact"]
