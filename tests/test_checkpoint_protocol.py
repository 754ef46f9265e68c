"""The atomic checkpoint protocol of :mod:`seqpar.runtime.checkpoint` at the places the mutation audit of session 21
(mut21r) found unguarded: steps past 9 (a tag compared as a string) and a re-save's ``.old`` copy against a later
step. One process, no process group: the protocol is file-system work on rank 0."""

from __future__ import annotations

import os

from seqpar.runtime import checkpoint


def _save(save_dir: str, step: int) -> None:
    os.makedirs(checkpoint.staging_dir(save_dir, f"step{step}"))
    checkpoint.commit(save_dir, f"step{step}")


def test_latest_complete_orders_steps_as_numbers(tmp_path) -> None:
    """``step10`` is newer than ``step9`` and ``step100`` than ``step20`` (string order says the reverse), whatever
    order the directory lists them in; the ``latest`` file names the last commit.

    Seen failing: ``latest_complete`` keeping the greatest *name* (``name > best[1]`` instead of
    ``step > best[0]``) returned ``step9``."""
    save_dir = str(tmp_path)
    for step in (9, 10, 2):
        _save(save_dir, step)
    assert checkpoint.latest_complete(save_dir) == "step10"
    assert (tmp_path / "latest").read_text() == "step2"  # the last commit, not the newest step
    for step in (20, 100):
        _save(save_dir, step)
    assert checkpoint.latest_complete(save_dir) == "step100"
