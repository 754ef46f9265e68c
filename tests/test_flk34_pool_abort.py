"""A rank that aborts in C++ (SIGABRT, e.g. gloo's ``terminate called after throwing ...``) is reported by name,
with its Python stacks on the rank's stderr (faulthandler), so that a one-off abort in a loaded CI run
(``tests/test_trl_sft.py``'s FSDP2 test: rank 0 exit code -6 once) says where it happened next time.

Own one-rank pools, not the session's ``dist_pool``: the abort kills the pool it runs on.
"""

from __future__ import annotations

import faulthandler
import os

import pytest

from seqpar.testing.ranks import PoolError, RankPool


def _faulthandler_on(ctx) -> bool:  # noqa: ANN001
    return faulthandler.is_enabled()


def _abort(ctx) -> None:  # noqa: ANN001
    os.abort()


@pytest.mark.timeout(120)
def test_a_rank_that_aborts_is_named_and_dumps_its_stacks(capfd) -> None:  # noqa: ANN001
    with RankPool(1, timeout=60.0) as pool:
        assert pool.run(_faulthandler_on) == [True]
        with pytest.raises(PoolError, match=r"rank 0 \(exit code -6, SIGABRT: a C\+\+ abort"):
            pool.run(_abort)
        assert pool.closed
