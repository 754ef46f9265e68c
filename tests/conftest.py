"""Shared fixtures: ``dist_pool`` runs a test body on N persistent gloo ranks (see dist_harness)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from dist_harness import DistPool


@pytest.fixture(scope="session")
def dist_pool() -> Iterator[DistPool]:
    """``dist_pool.run(world_size, fn, *args, timeout=120.0, **kwargs) -> [value of rank 0, ...]``.

    ``fn(rank, world_size, *args, **kwargs)`` must be a module-level function of a test module.
    """
    pool = DistPool()
    try:
        yield pool
    finally:
        pool.close()
