"""shard_sequence / gather_sequence / shard_index: layouts, round trips, gradients, bad input."""

from __future__ import annotations

import pytest
import torch

import seqpar
from seqpar.sharding import chunk_ids, pad_to_multiple, shard_index

SHARDINGS = ("contiguous", "zigzag")


def expected_positions(seq: int, rank: int, world: int, sharding: str) -> list[int]:
    """Written out from the documented layout, independently of shard_index."""
    if sharding == "contiguous":
        c = seq // world
        return list(range(rank * c, (rank + 1) * c))
    c = seq // (2 * world)
    return list(range(rank * c, (rank + 1) * c)) + list(range((2 * world - 1 - rank) * c, (2 * world - rank) * c))


def _round_trip(rank: int, world: int, full: torch.Tensor, dim: int, sharding: str, grad_reduction: str) -> dict:
    x = full.clone().requires_grad_()
    shard = seqpar.shard_sequence(x, dim, sharding=sharding)
    # every rank applies the same weights to the gathered tensor: the loss is replicated
    w = torch.arange(full.numel(), dtype=full.dtype).view(full.shape).sin()
    gathered = seqpar.gather_sequence(shard, dim, sharding=sharding, grad_reduction=grad_reduction)
    (gathered * w).sum().backward()
    return {"shard": shard.detach(), "gathered": gathered.detach(), "grad": x.grad}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shard_gather_round_trip_and_grads(dist_pool, world: int) -> None:
    for sharding in SHARDINGS:
        for dim, shape in ((1, (2, 12 * world, 3)), (2, (2, 3, 12 * world, 5)), (-2, (3, 12 * world, 4))):
            full = torch.randn(shape, dtype=torch.float64)
            w = torch.arange(full.numel(), dtype=full.dtype).view(full.shape).sin()
            seq = full.shape[dim]
            for grad_reduction in ("slice", "sum"):
                res = dist_pool.run(world, _round_trip, full, dim, sharding, grad_reduction)
                grads = torch.zeros_like(full)
                for rank, r in enumerate(res):
                    pos = torch.tensor(expected_positions(seq, rank, world, sharding))
                    assert shard_index(seq, rank, world, sharding).tolist() == pos.tolist()
                    torch.testing.assert_close(r["shard"], full.index_select(dim, pos), rtol=0, atol=0)
                    torch.testing.assert_close(r["gathered"], full, rtol=0, atol=0)
                    grads += r["grad"]
                # 'slice': each rank's grad is w at its own positions -> summed over ranks = w.
                # 'sum': each rank's loss is a separate term -> summed grads = P * w.
                scale = 1 if grad_reduction == "slice" else world
                torch.testing.assert_close(grads, scale * w, msg=f"{sharding} dim={dim} {grad_reduction}")


def _bad_gather(rank: int, world: int) -> str:
    x = torch.randn(2, 4 if rank == 0 else 6, 3)
    try:
        seqpar.gather_sequence(x, 1)
    except ValueError as e:
        return str(e)
    return ""


def test_gather_with_unequal_shards_fails_on_every_rank(dist_pool) -> None:
    for msg in dist_pool.run(2, _bad_gather, timeout=60):
        assert "different lengths" in msg and "[4, 6]" in msg


def _bad_shard(rank: int, world: int, seq: int, sharding: str) -> str:
    try:
        seqpar.shard_sequence(torch.randn(1, seq, 2), 1, sharding=sharding)
    except ValueError as e:
        return str(e)
    return ""


def test_indivisible_length_names_the_fix(dist_pool) -> None:
    msgs = dist_pool.run(2, _bad_shard, 7, "contiguous")
    assert all("sequence length 7" in m and "pad it to a multiple of 2" in m for m in msgs), msgs
    msgs = dist_pool.run(2, _bad_shard, 6, "zigzag")
    assert all("multiple of 4" in m and "sharding='contiguous'" in m for m in msgs), msgs


def test_single_process_and_padding() -> None:
    x = torch.randn(2, 6, 3)
    assert seqpar.shard_sequence(x, 1) is x or torch.equal(seqpar.shard_sequence(x, 1), x)
    assert torch.equal(seqpar.gather_sequence(x, 1), x)
    padded = pad_to_multiple(x, 1, 4, value=-1.0)
    assert padded.shape == (2, 8, 3) and torch.equal(padded[:, :6], x) and (padded[:, 6:] == -1).all()
    assert chunk_ids(1, 3, "zigzag") == [1, 4]
    with pytest.raises(ValueError, match="striped"):
        chunk_ids(0, 2, "striped")
