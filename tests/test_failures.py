"""Failures end cleanly: atomic checkpoints, and resume after a crash.

A save is written as ``<tag>.tmp`` by every rank and renamed by rank 0 once all are done
(:mod:`seqpar.checkpoint`). A rank killed during a save can therefore leave only a ``.tmp`` directory
(or, killed between the write and the marker, a directory without ``COMPLETE``); ``--resume`` must
skip both and continue from the last complete checkpoint with the losses of an uninterrupted run.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from seqpar import checkpoint

ROOT = Path(__file__).resolve().parents[1]
SHORT = ["--seq-len", "128", "--no-progress", "--log-level", "WARNING"]


def _train_module() -> Any:
    name = "seqpar_launch_train"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "launch" / "train.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _run_main(rank: int, world: int, argv: list[str]) -> list[float]:
    return _train_module().main(argv)["loss"]


def _tear(save_dir: Path, step: int) -> None:
    """What a rank killed in the middle of saving ``step`` leaves: a staging directory with a
    truncated file, and (killed after an older engine's write, before the marker) a ``step<N>`` with
    no marker."""
    tmp = Path(checkpoint.staging_dir(str(save_dir), f"step{step}"))
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "__0_0.distcp").write_bytes(b"\x00torn")
    torn = save_dir / f"step{step + 1}"
    torn.mkdir(exist_ok=True)
    (torn / ".metadata").write_bytes(b"\x00torn")


def test_latest_complete_skips_torn_saves(tmp_path):
    for step in (1, 2):
        os.makedirs(checkpoint.staging_dir(str(tmp_path), f"step{step}"))
        checkpoint.commit(str(tmp_path), f"step{step}")
    _tear(tmp_path, 3)
    assert checkpoint.latest_complete(str(tmp_path)) == "step2"
    assert (tmp_path / "latest").read_text() == "step2"
    assert checkpoint.latest_complete(str(tmp_path / "missing")) is None
    os.makedirs(checkpoint.staging_dir(str(tmp_path), "step2"))  # a re-save of step 2 replaces it
    checkpoint.commit(str(tmp_path), "step2")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step1", "step2", "step3.tmp", "step4"]


@pytest.mark.parametrize("config", ["fsdp_ring.json"])
def test_resume_after_crash_during_save_matches_uninterrupted(dist_pool, tmp_path, config):
    argv = ["--config", str(ROOT / "configs" / config), *SHORT, "--save-dir", str(tmp_path),
            "--save-every", "1"]
    full = dist_pool.run(2, _run_main, [*argv[:-4], "--steps", "4"], timeout=240)[0]
    head = dist_pool.run(2, _run_main, [*argv, "--steps", "2"], timeout=240)[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step1", "step2"], "no .tmp left behind"
    _tear(tmp_path, 3)  # the run "died" while saving step 3
    tail = dist_pool.run(2, _run_main, [*argv, "--steps", "4", "--resume"], timeout=240)[0]
    assert len(head) == 2 and len(tail) == 2, (head, tail)
    assert head + tail == full, f"resumed {head + tail} vs uninterrupted {full}"
