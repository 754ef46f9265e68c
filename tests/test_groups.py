"""Process-group manager tests, and self-tests of the distributed harness."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

# ------------------------------------------------------------------ harness self-tests


def _rank_and_sum(rank: int, world_size: int, offset: int) -> tuple[int, float]:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return rank + offset, t.item()


def _raise_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        raise KeyError("boom from rank 1")
    return rank


def _sleep(rank: int, world_size: int, seconds: float) -> None:
    time.sleep(seconds)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_harness_returns_per_rank_values(dist_pool, world_size):
    out = dist_pool.run(world_size, _rank_and_sum, 10)
    total = float(sum(range(world_size)))
    assert out == [(r + 10, total) for r in range(world_size)]


def test_harness_rank_exception_surfaces_and_pool_survives(dist_pool):
    with pytest.raises(AssertionError) as info:
        dist_pool.run(2, _raise_on_rank_1)
    message = str(info.value)
    assert "rank 1" in message and "KeyError" in message and "boom from rank 1" in message
    assert "_raise_on_rank_1" in message  # the traceback, not just the message
    assert dist_pool.run(2, _rank_and_sum, 0) == [(0, 1.0), (1, 1.0)]


def test_harness_timeout_kills_and_restarts(dist_pool):
    dist_pool.run(2, _rank_and_sum, 0)  # pool up, so start-up time is not measured below
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="did not finish within"):
        dist_pool.run(2, _sleep, 60.0, timeout=1.0)
    assert time.monotonic() - start < 10.0
    assert dist_pool.run(2, _rank_and_sum, 0) == [(0, 1.0), (1, 1.0)]
