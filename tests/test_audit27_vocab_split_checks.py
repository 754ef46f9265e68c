"""The tiled loss's agreement on a vocabulary-split head (:func:`seqpar.memory.tiling.tiled_lm_loss` with
``vocab_split=``), 2 gloo ranks, in the three inconsistencies tests/test_tiled_loss_slice_agreement.py does not hand
it: slices that leave an id uncovered, ranks describing different splits, and a slice larger than the split's
``largest_rows`` (each rank's slice fitting the vocabulary). Each must raise the same TilingError on both ranks
before the tiles' collectives (a silent loss over 52 of 53 ids, or tile counts that differ between the ranks, else).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

VOCAB, HIDDEN, ROWS = 53, 8, 6


def _outcome(weight: torch.Tensor, split) -> str:  # noqa: ANN001
    """``tiled_lm_loss`` on random hidden states and targets, then a backward: ``"ok"`` or the TilingError's
    message."""
    from seqpar.memory.tiling import TilingError, tiled_lm_loss

    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(1, ROWS, HIDDEN, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, VOCAB - 1, (1, ROWS), generator=gen)
    try:
        loss_sum, _ = tiled_lm_loss(hidden, weight, targets, chunk_rows=2, vocab_split=split)
    except TilingError as e:
        return str(e)
    loss_sum.backward()
    return "ok"


def _cases(rank: int, world: int) -> dict:
    from seqpar.sequence.vocab_parallel import VocabSplitHead

    group = dist.group.WORLD
    full = torch.randn(VOCAB + 1, HIDDEN, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    # (start, rows, vocab_size, largest_rows) of rank 0 and rank 1
    cases = {
        "consistent": ((0, 27, VOCAB, 27), (27, 26, VOCAB, 27)),
        "gap_at_the_end": ((0, 27, VOCAB, 27), (27, 25, VOCAB, 27)),  # id 52 on no rank
        "different_splits": ((0, 27, VOCAB, 27), (27, 26, VOCAB, 28)),  # rank 1 says at most 28 a rank
        "over_largest_rows": ((0, 27, VOCAB, 26), (27, 26, VOCAB, 26)),  # rank 0 holds 27 rows of "at most 26"
    }
    out = {}
    for name, per_rank in cases.items():
        start, rows, vocab, largest = per_rank[rank]
        weight = full[start:start + rows].clone().requires_grad_(True)
        out[name] = _outcome(weight, VocabSplitHead(group, start, vocab, largest))
    return out


def test_vocab_split_inconsistencies_raise_on_every_rank(dist_pool) -> None:  # noqa: ANN001
    """Consistent slices compute; a gap at the vocabulary's end, ranks describing different splits, and a slice over
    the split's ``largest_rows`` raise a TilingError naming the problem on both ranks, within the pool's timeout.

    Seen failing: with the coverage total not checked (``covered != split.vocab_size`` dropped: "ok" on both ranks,
    the loss over 52 of the 53 ids); with the ranks' descriptions not compared (the different-splits check dropped:
    "ok" on both); with ``rows <= split.largest_rows`` dropped from the fit ("ok" on both: the tile count follows
    ``largest_rows``, which rank 0's slice exceeds)."""
    got = dist_pool.run(2, _cases, timeout=120)
    for rank, out in enumerate(got):
        assert out["consistent"] == "ok", (rank, out)
        assert "cover 52 of the 53 ids" in out["gap_at_the_end"], (rank, out)
        assert "the ranks describe different splits" in out["different_splits"] \
            and "TP rank 1: 53, 28" in out["different_splits"], (rank, out)
        assert "TP rank 0's 27 rows from 0 do not fit the split it describes (53 ids, at most 26 a rank)" \
            in out["over_largest_rows"], (rank, out)
        for name in ("gap_at_the_end", "different_splits", "over_largest_rows"):
            assert "seqpar_vocab_split" in out[name], (rank, name, out[name])
