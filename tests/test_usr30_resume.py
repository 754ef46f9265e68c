"""Session 30's new-user walk (reports/usr30.md): `launch/train.py --resume` on a `--save-dir` that holds no
checkpoint, or one another engine wrote, is one `train.py: error: [rank R] ...` line naming the directory and the
fix, exit 2 — not a traceback (FileNotFoundError) or DeepSpeed's bare `AssertionError` from inside its loader.

Each run is one process (`--sp-size 1`; the launcher makes its own world of 1 on a free port); the checks read the
directory, which every rank of a job reads alike, so each rank prints the same line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
TRAIN = str(ROOT / "launch" / "train.py")


def _fake_checkpoint(save_dir: Path, files: tuple[str, ...]) -> str:
    """A complete `step3` checkpoint directory holding empty files named as one engine names its own."""
    step = save_dir / "step3"
    step.mkdir(parents=True)
    for name in ("COMPLETE", *files):
        (step / name).write_text("")
    return str(save_dir)


def _resume(config: str, save_dir: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, TRAIN, "--config", str(ROOT / "configs" / config), "--sp-size", "1", "--steps", "1",
           "--seq-len", "64", "--no-progress", "--save-dir", save_dir, "--resume"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=ROOT)


def _error_line(run: subprocess.CompletedProcess) -> str:
    assert run.returncode == 2, (run.returncode, run.stderr[-3000:])
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    lines = [line for line in run.stderr.splitlines() if line.startswith("train.py: error: [rank 0] ValueError: --resume")]
    assert len(lines) == 1, run.stderr[-3000:]
    return lines[0]


def test_resume_without_a_checkpoint_names_the_directory_and_the_fix(tmp_path):
    """`--resume --save-dir DIR` with nothing saved in DIR. Seen failing (launch/engines.py before this session): a
    `FileNotFoundError` traceback on every rank ("no complete FSDP checkpoint in DIR"), exit 1, no fix named."""
    save_dir = str(tmp_path / "empty")
    line = _error_line(_resume("fsdp_ring.json", save_dir))
    assert repr(save_dir) in line and "run without --resume" in line, line


def test_resume_of_a_deepspeed_checkpoint_under_fsdp_names_the_engine(tmp_path):
    """An FSDP run resuming a directory DeepSpeed saved. Seen failing (launch/engines.py before this session):
    DCP's loader raised `FileNotFoundError: .../step3/__0.metadata` from inside torch on every rank, exit 1, a
    traceback that does not say the engines differ."""
    save_dir = _fake_checkpoint(tmp_path / "ds", ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"))
    line = _error_line(_resume("fsdp_ring.json", save_dir))
    assert "is a DeepSpeed checkpoint, but this run's engine is fsdp" in line and "--engine deepspeed" in line, line


def test_resume_of_an_fsdp_checkpoint_under_deepspeed_names_the_engine(tmp_path):
    """A DeepSpeed run resuming a directory FSDP2 saved (`torchrun ... fsdp_ring.json --save-dir ck`, then
    `deepspeed ... deepspeed_ring.json --save-dir ck --resume`). Seen failing (launch/engines.py before this session,
    by the command itself: `train.py --config configs/deepspeed_ring.json --sp-size 1 --resume --save-dir <an FSDP
    run's dir>`): a bare `AssertionError` traceback from DeepSpeed's `load_checkpoint`, naming nothing."""
    save_dir = _fake_checkpoint(tmp_path / "fsdp", ("__0_0.distcp", ".metadata"))
    line = _error_line(_resume("deepspeed_ring.json", save_dir))
    assert "is a FSDP (torch.distributed.checkpoint) checkpoint, but this run's engine is deepspeed" in line, line
    assert "--engine fsdp" in line, line
