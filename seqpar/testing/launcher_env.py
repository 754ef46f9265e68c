"""What a launcher sets for a pool rank, and its undoing: :func:`launcher_env`, for tests and fuzz cases that
run Hugging Face's Trainer, TRL or accelerate inside a rank pool (``seqpar.testing.ranks``)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

__all__ = ["launcher_env"]


@contextlib.contextmanager
def launcher_env(rank: int, world: int) -> Iterator[None]:
    """What a launcher would set (accelerate and DeepSpeed read it; the pool joined gloo already),
    undone on exit with everything accelerate / transformers left behind: pool ranks run later tests
    in the same process (``ACCELERATE_USE_DEEPSPEED``, accelerate's singletons, transformers'
    global DeepSpeed config, which would make later models build under ``zero.Init``)."""
    saved = dict(os.environ)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    try:
        yield
    finally:
        from accelerate.state import AcceleratorState, GradientState, PartialState
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        PartialState._reset_state()
        unset_hf_deepspeed_config()
        os.environ.clear()
        os.environ.update(saved)
