"""launch/train.py with one rank SIGKILLed in the middle of a save (tests/test_failures.py), under torchrun.

``--kill-rank R --kill-at-step N -- <train.py arguments>``: rank R kills itself right after
torch.distributed.checkpoint has written its own shard files of checkpoint ``stepN`` (so the staging
directory holds some files), before the checkpoint's metadata, marker and rename: a crash in the
middle of saving. The patch is test-side only (DCP's file writer), launch/train.py runs unchanged.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/launch_module.py

from launch_module import train_module  # noqa: E402
from torch.distributed.checkpoint import FileSystemWriter  # noqa: E402


def _kill_in_write_data(rank: int, step: int) -> None:
    """Wrap DCP's file writer: rank ``rank`` dies once its shards of ``step<step>.tmp`` are on disk."""
    write_data = FileSystemWriter.write_data

    def wrapped(self, plan, planner):  # noqa: ANN001, ANN202 - DCP's own signature
        future = write_data(self, plan, planner)
        if int(os.environ["RANK"]) == rank and Path(str(self.path)).name == f"step{step}.tmp":
            future.wait()  # this rank's files are written; metadata, marker and rename are not
            written = sorted(p.name for p in Path(str(self.path)).iterdir())
            print(f"rank {rank}: SIGKILL while saving step {step} (written: {', '.join(written)})", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return future

    FileSystemWriter.write_data = wrapped


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--kill-rank", type=int, required=True)
    p.add_argument("--kill-at-step", type=int, required=True)
    p.add_argument("train_argv", nargs=argparse.REMAINDER)
    args = p.parse_args()
    _kill_in_write_data(args.kill_rank, args.kill_at_step)
    train_argv = args.train_argv[1:] if args.train_argv[:1] == ["--"] else args.train_argv
    train_module().main(train_argv)
    sys.exit(0)  # not reached: the save of --kill-at-step kills a rank


if __name__ == "__main__":
    main()
