"""Audit 31 (session 30's tracker rule): a backend copy is counted until the wait it was first seen in returns.

One process, no process group: ``Work.wait`` is replaced by a stand-in before the tracker is entered (the tracker
wraps whatever ``Work.wait`` is then, and restores it on exit), which runs ops on a storage the tracker never saw
made, as gloo's waiting thread splits its reduce-scatter copy (tests/test_memtrack.py's 2-rank test has one wait,
no nesting, and never sees the copy again after it). The stand-in copy is made inside the tracked window out of the
tracker's sight (``no_dispatch``), as gloo's clone inside the collective's call: a storage alive at entry is no
backend copy (mem32, tests/test_mem32_tracker_pre_entry.py).
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.distributed_c10d import Work
from torch.utils._mode_utils import no_dispatch

from seqpar.memory.tracker import TensorMemoryTracker

N = 1024  # fp32 elements: 4096 bytes


@pytest.fixture
def fake_wait():
    """Install ``Work.wait = body`` (``body(work)``) for the test; the real one back afterwards."""
    orig = Work.wait
    installed = []

    def install(body):  # noqa: ANN001, ANN202
        def wait(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            body(self)
            return True
        Work.wait = wait
        installed.append(wait)
        return wait

    yield install
    Work.wait = orig


def test_a_copy_seen_again_after_its_wait_is_not_counted_again(fake_wait) -> None:  # noqa: ANN001
    """A backend copy (``x``, never seen made) touched inside the wait is counted there (peak 4096 B) and not after
    it; an op on it after the wait has returned counts nothing either, and the wait is restored on exit.

    Seen failing (audit 31, mutant T2: ``_register`` without its ``st in self._ended`` check): after the later op,
    4096 B counted again."""
    stand_in = fake_wait(lambda w: x.add_(1))
    with TensorMemoryTracker(count_existing=False) as tr:
        with no_dispatch():
            x = torch.randn(N)
        Work().wait()
        assert tr.peak - tr.baseline == 4 * N
        assert tr.current - tr.baseline == 0
        x.add_(1)
        x.view(-1)
        assert tr.current - tr.baseline == 0
        assert tr.peak - tr.baseline == 4 * N
    assert Work.wait is stand_in


def test_a_copy_ends_with_the_inner_wait_it_was_seen_in(fake_wait) -> None:  # noqa: ANN001
    """Nested waits: a copy first seen in the inner wait is no longer counted once that wait returns, while the
    outer one still runs (the copy is tied to the wait it was first seen in).

    Seen failing (audit 31, mutant T5: the copy appended to the outermost wait's list): 4096 B still counted
    between the inner wait's return and the outer's."""
    between, depth = [], []

    def body(w: Work) -> None:
        if depth:  # the inner wait
            x.add_(1)
            return
        depth.append(1)
        Work().wait()
        between.append(tr.current - tr.baseline)

    fake_wait(body)
    with TensorMemoryTracker(count_existing=False) as tr:
        with no_dispatch():
            x = torch.randn(N)
        Work().wait()
    assert between == [0], between
    assert tr.peak - tr.baseline == 4 * N


def test_a_storage_seen_made_is_no_backend_copy(fake_wait) -> None:  # noqa: ANN001
    """A storage the tracker saw made (``z``, made inside it) and touched inside a wait stays counted after the
    wait returns: only storages never seen made are backend copies.

    Seen failing (audit 31, mutant T6: the ``st not in self._sizes`` test dropped): ``z``'s 4096 B subtracted at
    the wait's return while ``z`` is alive (0 counted)."""
    made = []
    fake_wait(lambda w: made[0].add_(1))
    with TensorMemoryTracker(count_existing=False) as tr:
        z = torch.zeros(N)
        made.append(z)
        Work().wait()
        made.clear()
        assert tr.current - tr.baseline == 4 * N
        del z
        assert tr.current - tr.baseline == 0
