"""Audit 36 (session 37): the tracker's ``resize_`` rule counts the thread that *entered* it, whichever that is, not
the main thread. A step run in a worker thread (a trainer in a background thread, a test harness's rank thread) has
its own refills counted to the byte, and the main thread's refill inside that window is not.

Seen failing: the owner taken as ``threading.main_thread().ident`` (audit 36's TR3) -> the worker's 1 MiB refill
uncounted (current 0) and the main thread's counted."""

from __future__ import annotations

import threading

import torch

from seqpar.memory.tracker import TensorMemoryTracker

MIB = 1 << 20


def test_a_tracker_entered_in_a_worker_thread_counts_that_threads_resizes() -> None:
    seen: dict[str, int] = {}
    entered, main_done = threading.Event(), threading.Event()
    main_storage = torch.empty(0).untyped_storage()

    def step() -> None:
        param = torch.ones(MIB // 4)  # alive at entry (count_existing=False: counted once resized)
        tracker = TensorMemoryTracker("cpu", count_existing=False)
        with tracker:
            st = param.untyped_storage()
            st.resize_(0)
            st.resize_(MIB)
            seen["own"] = tracker.current
            entered.set()
            main_done.wait(30)  # the main thread refills 2 MiB inside this window
            seen["after_main"] = tracker.current
        seen["peak"] = tracker.peak

    worker = threading.Thread(target=step)
    worker.start()
    assert entered.wait(30)
    main_storage.resize_(2 * MIB)
    main_done.set()
    worker.join(30)
    assert seen == {"own": MIB, "after_main": MIB, "peak": MIB}, seen
    assert main_storage.nbytes() == 2 * MIB
