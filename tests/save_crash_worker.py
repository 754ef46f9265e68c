"""launch/train.py with one rank SIGKILLed in the middle of a save (tests/test_failures.py), under torchrun.

``--kill-rank R --kill-at-step N -- <train.py arguments>``: rank R kills itself right after it has
written its own files of checkpoint ``stepN``, before the rest of the save (the other ranks' files,
metadata, the completion marker and the rename): a crash in the middle of saving. Both engines'
writers are wrapped, so the same worker covers an FSDP run (torch.distributed.checkpoint's file writer)
and a DeepSpeed run (DeepSpeed's torch checkpoint engine, which writes each rank's ZeRO optimizer
partition). The patches are test-side only; launch/train.py runs unchanged.
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


def _die(rank: int, step: int, directory: Path) -> None:
    written = sorted(p.name for p in directory.iterdir())
    print(f"rank {rank}: SIGKILL while saving step {step} (written: {', '.join(written)})", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _kill_in_dcp_write(rank: int, step: int) -> None:
    """Wrap DCP's file writer: rank ``rank`` dies once its shards of ``step<step>.tmp`` are on disk."""
    write_data = FileSystemWriter.write_data

    def wrapped(self, plan, planner):  # noqa: ANN001, ANN202 - DCP's own signature
        future = write_data(self, plan, planner)
        if int(os.environ["RANK"]) == rank and Path(str(self.path)).name == f"step{step}.tmp":
            future.wait()  # this rank's files are written; metadata, marker and rename are not
            _die(rank, step, Path(str(self.path)))
        return future

    FileSystemWriter.write_data = wrapped


def _kill_in_deepspeed_write(rank: int, step: int) -> None:
    """Wrap DeepSpeed's torch checkpoint engine: rank ``rank`` dies once it has written its own
    optimizer partition of ``step<step>.tmp`` (rank 0's model states may or may not be there yet)."""
    try:
        from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import (
            TorchCheckpointEngine,
        )
    except ImportError:  # an FSDP-only environment: nothing to wrap
        return
    save = TorchCheckpointEngine.save

    def wrapped(self, state_dict, path):  # noqa: ANN001, ANN202 - DeepSpeed's own signature
        out = save(self, state_dict, path)
        p = Path(str(path))
        if (int(os.environ["RANK"]) == rank and p.parent.name == f"step{step}.tmp"
                and "optim_states" in p.name):
            _die(rank, step, p.parent)
        return out

    TorchCheckpointEngine.save = wrapped


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--kill-rank", type=int, required=True)
    p.add_argument("--kill-at-step", type=int, required=True)
    p.add_argument("train_argv", nargs=argparse.REMAINDER)
    args = p.parse_args()
    _kill_in_dcp_write(args.kill_rank, args.kill_at_step)
    _kill_in_deepspeed_write(args.kill_rank, args.kill_at_step)
    train_argv = args.train_argv[1:] if args.train_argv[:1] == ["--"] else args.train_argv
    train_module().main(train_argv)
    sys.exit(0)  # not reached: the save of --kill-at-step kills a rank


if __name__ == "__main__":
    main()
