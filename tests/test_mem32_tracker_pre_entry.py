"""The tracker's wait rule and storages alive at entry (``count_existing=False``): a caller's buffer that existed
before the tracker was entered and is first touched inside a ``Work.wait`` is no backend copy, so it is counted as
it would be outside a wait, until it is freed, not ended when the wait returns.

One process, no process group: ``Work.wait`` is replaced by a stand-in before the tracker is entered (as
tests/test_audit31_tracker_waits.py does); the stand-in runs ops the way gloo's waiting thread does.
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

    def install(body):  # noqa: ANN001, ANN202
        def wait(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            body(self)
            return True
        Work.wait = wait
        return wait

    yield install
    Work.wait = orig


def test_a_storage_alive_at_entry_first_touched_inside_a_wait_stays_counted(fake_wait) -> None:  # noqa: ANN001
    """``y`` (4096 B) exists before entry, is first touched inside the wait (a view and an in-place op, as gloo's
    split and copy) and used after it: counted from that touch until it is freed (4096 B after the wait, as an op
    outside a wait would count it; 0 once freed), and a later op on it counts it once, not twice.

    Seen failing: the tracker before mem32 (a storage first touched inside a wait was a backend copy whatever its
    age): 0 B counted after the wait while ``y`` is alive and used, the peak after it 4096 B short."""
    ys = [torch.zeros(N)]  # the only reference, dropped below
    fake_wait(lambda w: ys[0].view(-1).add_(1))
    with TensorMemoryTracker(count_existing=False) as tr:
        Work().wait()
        assert tr.current - tr.baseline == 4 * N
        z = ys[0] * 2  # a new 4096 B beside y: the peak holds both
        assert tr.current - tr.baseline == 8 * N
        assert tr.peak - tr.baseline == 8 * N
        ys[0].add_(1)
        assert tr.current - tr.baseline == 8 * N
        ys.clear()
        del z
        assert tr.current - tr.baseline == 0


def test_a_copy_made_inside_the_window_is_still_ended_with_its_wait(fake_wait) -> None:  # noqa: ANN001
    """Beside a storage alive at entry, a storage made inside the window out of the tracker's sight (as gloo's clone
    of a reduce-scatter's input, made inside the collective's call) and first touched inside the wait is still a
    backend copy: counted there, not after the wait returns, while the pre-entry one stays counted.

    Seen failing: every storage never seen made treated as alive at entry (the wait rule's test ``st not in
    self._pre_entry`` replaced by ``False``): the copy's 4096 B still counted after the wait (8192 B where 4096 are
    due); and the tracker before mem32: ``y`` ended with the wait too (0 B where 4096 are due)."""
    y = torch.zeros(N)
    held = []

    def body(w: Work) -> None:
        held[0].add_(1)
        y.add_(1)

    fake_wait(body)
    with TensorMemoryTracker(count_existing=False) as tr:
        with no_dispatch():  # made where the tracker does not see it
            held.append(torch.zeros(N))
        Work().wait()
        assert tr.peak - tr.baseline == 8 * N
        assert tr.current - tr.baseline == 4 * N  # y alone
        held.clear()
        assert tr.current - tr.baseline == 4 * N
