"""The tiled loss's checks of a vocabulary-split head (:func:`seqpar.memory.tiling.tiled_lm_loss`) raise on every
rank of the TP group alike, on 2 gloo ranks: a slice inconsistent on one rank only must not leave the other blocked
in the tiles' collectives (each tile's vocab-parallel reductions are all-reduces over the group)."""

from __future__ import annotations

import torch
import torch.distributed as dist

VOCAB, HIDDEN, ROWS = 53, 8, 6


def _tiled_loss_outcome(weight: torch.Tensor, **kwargs) -> str:  # noqa: ANN003
    """``tiled_lm_loss`` on random hidden states and targets, then a backward: ``"ok"`` or the TilingError's message
    (any other exception propagates)."""
    from seqpar.memory.tiling import TilingError, tiled_lm_loss

    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(1, ROWS, HIDDEN, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, VOCAB, (1, ROWS), generator=gen)
    try:
        loss_sum, _ = tiled_lm_loss(hidden, weight, targets, chunk_rows=2, **kwargs)
    except TilingError as e:
        return str(e)
    loss_sum.backward()
    return "ok"


def _split_head_slices(rank: int, world: int) -> dict:
    """DeepSpeed's split (27 + 26 rows of 53) as :class:`VocabSplitHead`: consistent; then rank 1 handed an
    inconsistent slice (rows 28-53: one row past the vocabulary); then rank 1's slice starting one row early (every
    slice fits, but they overlap: 27 + 26 from 0 and 26)."""
    from seqpar.sequence.vocab_parallel import VocabSplitHead

    group = dist.group.WORLD
    starts, sizes = (0, 27), (27, 26)
    # a spare row past the vocabulary: rank 1's 26 rows from 28 exist
    full = torch.randn(VOCAB + 1, HIDDEN, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out = {}
    for case, start in (("consistent", starts[rank]), ("past_the_end", (0, 28)[rank]),
                        ("overlapping", (0, 26)[rank])):
        weight = full[start:start + sizes[rank]].clone().requires_grad_(True)
        out[case] = _tiled_loss_outcome(weight, vocab_split=VocabSplitHead(group, start, VOCAB, max(sizes)))
    return out


def _dtensor_slices(rank: int, world: int) -> dict:
    """A head weight as a DTensor ``Shard(0)`` of 53 rows over 2 ranks (torch's layout: 27 + 26): consistent; then
    rank 1 holding 27 rows (``DTensor.from_local`` told the global shape, no check)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    # a spare row past the vocabulary: rank 1's 26 rows from 28 exist
    full = torch.randn(VOCAB + 1, HIDDEN, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out = {}
    for case, start in (("consistent", (0, 27)[rank]), ("wrong_rows", (0, 26)[rank])):
        local = full[start:start + (27, VOCAB - start)[rank]].clone()  # rank 1: from start to the end
        weight = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size([VOCAB, HIDDEN]),
                                    stride=(HIDDEN, 1)).requires_grad_(True)
        out[case] = _tiled_loss_outcome(weight)
    return out


def test_an_inconsistent_vocab_split_raises_on_every_rank(dist_pool) -> None:
    """``tiled_lm_loss`` with a ``vocab_split`` (DeepSpeed AutoTP's vocabulary-split head), 2 gloo ranks: consistent
    slices compute; rank 1 handed an inconsistent slice (one row past the vocabulary), and rank 1's slice overlapping
    rank 0's (each fits alone), raise a TilingError naming TP rank 1 (and the overlap) on both ranks, before the
    tiles' collectives, within the pool's timeout.

    Seen failing: the check before the agreement put back (this rank's slice alone, no all-gather): rank 1 raised,
    rank 0 blocked in the first tile's all-reduce (pytest-timeout's 100 s; another run, rank 0 failed in gloo as rank
    1 went on); the coverage check dropped (the overlapping slices computed: "ok" on both ranks)."""
    got = dist_pool.run(2, _split_head_slices, timeout=120)
    for rank in got:
        assert rank["consistent"] == "ok", rank
        assert "TP rank 1's 26 rows from 28 do not fit the split it describes (53 ids, at most 27 a rank)" \
            in rank["past_the_end"] and "TP rank 0" not in rank["past_the_end"], rank
        assert "the slices (first id, rows) [(0, 27), (26, 26)] by TP rank do not cover the 53 ids once" \
            in rank["overlapping"], rank
        for case in ("past_the_end", "overlapping"):
            assert "seqpar_vocab_split" in rank[case] and "set tiled_loss false" in rank[case], rank


def test_an_inconsistent_dtensor_head_slice_raises_on_every_rank(dist_pool) -> None:
    """``tiled_lm_loss`` with a DTensor head (``Shard(0)`` over the TP mesh), 2 gloo ranks: rank 1's local slice 27
    rows where torch's layout gives 26 raises a TilingError naming TP rank 1 on both ranks, within the timeout.

    Seen failing: the local-slice check on this rank alone put back (as before the agreement): rank 1 raised, rank 0
    blocked in the first tile's all-reduce until gloo's 60 s "Timed out waiting 60000ms for recv operation"."""
    got = dist_pool.run(2, _dtensor_slices, timeout=120)
    for rank in got:
        assert rank["consistent"] == "ok", rank
        assert "TP rank 1: 27 rows where torch's Shard layout gives 26" in rank["wrong_rows"] \
            and "TP rank 0" not in rank["wrong_rows"], rank
