"""Audit 36 (session 37), the rank pool's faulthandler (6e96285): a rank killed by a C++ abort leaves *every*
thread's Python stack on its stderr, not only the aborting thread's: a hang or abort under load is as often in a
library's worker thread (gloo's, a data loader's) as in the rank's main one. One own one-rank pool (the abort kills
the pool it runs on); the rank points its stderr (file descriptor 2, where faulthandler writes) at a file the test
reads, since a rank forked from a server started earlier in the session does not share ``capfd``'s.

Seen failing: ``faulthandler.enable(all_threads=False)`` (audit 36's K2) -> only the aborting thread's stack: the
parked worker thread's function is not in the dump."""

from __future__ import annotations

import os
import threading

import pytest

from seqpar.testing.ranks import PoolError, RankPool


def _parked_worker_thread_of_audit36(ready: threading.Event) -> None:
    ready.set()
    threading.Event().wait(120)


def _abort_beside_a_parked_thread(ctx, path: str) -> None:  # noqa: ANN001
    os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
    ready = threading.Event()
    threading.Thread(target=_parked_worker_thread_of_audit36, args=(ready,), daemon=True).start()
    ready.wait(30)
    os.abort()


@pytest.mark.timeout(120)
def test_an_abort_dumps_every_threads_stack(tmp_path) -> None:  # noqa: ANN001
    path = tmp_path / "rank0.stderr"
    with RankPool(1, timeout=60.0) as pool:
        with pytest.raises(PoolError, match=r"SIGABRT"):
            pool.run(_abort_beside_a_parked_thread, str(path))
    err = path.read_text(errors="replace")
    assert "_parked_worker_thread_of_audit36" in err and "_abort_beside_a_parked_thread" in err, err[-3000:]
