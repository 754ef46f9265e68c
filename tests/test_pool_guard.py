"""The rank pool's guard (issue 28 §2): a task that patches a module and leaves the patch behind fails, by name,
instead of changing what every later test on the same ranks runs."""

from __future__ import annotations

import functools

import pytest

from seqpar.testing.ranks import RankFailed, RankPool


def _patch_and_forget(ctx) -> None:  # noqa: ANN001
    import seqpar.sequence.sharding as sharding

    sharding.shard_index = lambda *a, **k: None


def _patch_and_restore(ctx) -> str:  # noqa: ANN001
    import seqpar.sequence.sharding as sharding

    original = sharding.shard_index
    sharding.shard_index = lambda *a, **k: None
    try:
        return "ran"
    finally:
        sharding.shard_index = original


def _original_is_back(ctx) -> bool:  # noqa: ANN001
    import seqpar.sequence.sharding as sharding

    return sharding.shard_index.__module__ == "seqpar.sequence.sharding"


def _import_and_patch(ctx) -> None:  # noqa: ANN001
    import wave  # first imported here: the guard saw no "before", and cannot put it back

    wave.open = functools.partial(wave.open, mode="rb")


@pytest.mark.timeout(120)
def test_a_task_that_leaves_a_patch_fails_by_name():
    with RankPool(1, guard_modules=("seqpar.*", "wave"), timeout=60) as pool:
        assert pool.run(_patch_and_restore) == ["ran"]
        with pytest.raises(RankFailed, match=r"left module state changed.*\n.*seqpar\.sequence\.sharding\.shard_index") as e:
            pool.run(_patch_and_forget)
        assert e.value.usable and not pool.closed
        assert pool.run(_original_is_back) == [True]  # put back: later tasks run the real function
        with pytest.raises(RankFailed, match=r"wave\.open \(imported by the task\) is functools\.partial"):
            pool.run(_import_and_patch)
        assert pool.recycled and pool.closed  # that module cannot be put back: fresh ranks next time
