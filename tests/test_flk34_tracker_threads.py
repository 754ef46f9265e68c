"""The tracker counts the step's own thread only: a storage another thread makes or refills (``resize_``) inside the
window never enters the peak, while the entering thread's resizes (FSDP2 frees and refills its unsharded parameters
that way) still do, to the byte.

Why: ``test_one_layer_fsdp2_counts_no_prefetched_layer[64-2048-64]`` measured once exactly 1,048,576 B over its
recorded 7,312,476 B in a loaded CI run; the ``resize_`` wrapper is global, so any thread's 1 MiB refill inside the
window was counted (the dispatch mode, thread-local, never saw other threads' ops).
"""

from __future__ import annotations

import threading

import torch

from seqpar.memory.tracker import TensorMemoryTracker

MIB = 1 << 20


def _in_thread(fn) -> None:  # noqa: ANN001
    t = threading.Thread(target=fn)
    t.start()
    t.join()


def test_another_threads_resize_and_ops_are_not_counted() -> None:
    keep: list = []
    empty = torch.empty(0).untyped_storage()  # made before entry, refilled by another thread inside

    def other() -> None:
        keep.append(torch.ones(MIB // 4))  # an op: 1 MiB
        empty.resize_(MIB)  # a refill outside the dispatcher: 1 MiB
        fresh = torch.empty(0).untyped_storage()
        fresh.resize_(MIB)
        keep.append(fresh)

    tracker = TensorMemoryTracker("cpu", count_existing=False)
    with tracker:
        own = torch.ones(16)  # 64 B: the step's own
        _in_thread(other)
        assert tracker.current == 64, tracker.current
    assert tracker.peak == 64, tracker.peak
    assert empty.nbytes() == MIB and keep[1].nbytes() == MIB  # the other thread did allocate them
    del own


def test_the_entering_threads_resize_is_counted_to_the_byte() -> None:
    """FSDP2's pattern: a storage freed (``resize_(0)``) and refilled (``resize_(n)``) in the step's thread."""
    param = torch.ones(MIB // 4)  # alive at entry (count_existing=False: not counted until resized)
    tracker = TensorMemoryTracker("cpu", count_existing=False)
    with tracker:
        st = param.untyped_storage()
        st.resize_(0)
        assert tracker.current == 0, tracker.current
        st.resize_(MIB)
        assert tracker.current == MIB, tracker.current
        st.resize_(0)
        assert tracker.current == 0, tracker.current
    assert tracker.peak == MIB, tracker.peak
