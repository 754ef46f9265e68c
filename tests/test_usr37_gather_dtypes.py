"""``seqpar.gather_sequence`` with shards of one shape and element size but different dtypes on the ranks (float32
beside int32, bfloat16 beside float16): its cross-rank check compared the element size only, and the all-gather moves
bytes, so each rank got the other's shard as its own dtype's reinterpretation of those bits (6 of an int32 came back
as 8.4e-45 on the float32 rank, 1.0 of a float32 as 1065353216 on the int32 rank), with no error, although the
docstring promises one. Now the dtype is part of the row and every rank raises naming both. P = 2, gloo."""

from __future__ import annotations

import torch

import seqpar


def _gather(rank: int, world: int, dtypes: tuple[torch.dtype, torch.dtype]) -> tuple[str, object]:
    seqpar.init_process_groups(sp_size=world)
    full = torch.arange(12).reshape(1, 12)  # every rank's copy of the whole sequence, as ints
    shard = seqpar.shard_sequence(full, 1).to(dtypes[rank])
    try:
        return "", seqpar.gather_sequence(shard, 1)
    except ValueError as e:
        return "ValueError", str(e)


def test_shards_of_different_dtypes_are_refused_on_every_rank(dist_pool) -> None:
    """Seen failing with the dtype code left out of sharding._check_same_shape's row: both pairs gathered without an
    error (the float32 rank read rank 1's int32 6, 7, ... as 8.4e-45, 9.8e-45, ...)."""
    for pair in ((torch.float32, torch.int32), (torch.bfloat16, torch.float16)):
        for kind, msg in dist_pool.run(2, _gather, pair, timeout=60):
            assert kind == "ValueError", (pair, msg)
            assert "same shape and dtype" in msg and str(pair[0]) in msg and str(pair[1]) in msg, msg


def test_shards_of_one_dtype_still_gather_exactly(dist_pool) -> None:
    for dtype in (torch.float32, torch.int32, torch.bfloat16):
        for kind, full in dist_pool.run(2, _gather, (dtype, dtype), timeout=60):
            assert kind == "" and torch.equal(full, torch.arange(12).reshape(1, 12).to(dtype)), (dtype, full)
