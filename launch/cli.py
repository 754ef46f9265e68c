"""The command line of ``launch/train.py``: its flags, each overriding a key of the config (parsed, not applied:
``seqpar_launch.plan.build_plan`` applies them)."""

from __future__ import annotations

import argparse
import linecache
import os

__all__ = ["DESCRIPTION", "PROG", "config_error_message", "parse_args"]

PROG = "train.py"
"""The name argparse's errors start with (``train.py: error: ...``); the launcher's own config errors use it too."""

DESCRIPTION = "Train a small Llama on a long-range recall task with sequence parallelism (DeepSpeed or FSDP)."
"""``--help``'s first line: the first paragraph of launch/train.py's docstring."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags of ``argv`` (default: the command line's); ``--resume`` without ``--save-dir`` exits as argparse does."""
    p = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION)
    p.add_argument("--config", required=True, help="DeepSpeed or seqpar JSON (see module docstring)")
    p.add_argument("--engine", choices=["auto", "deepspeed", "fsdp"], help="override train.engine")
    p.add_argument("--sp-size", type=int, help="override sequence_parallel.size")
    p.add_argument("--tp-size", type=int, help="override sequence_parallel.tp_size (world = dp x sp x tp)")
    p.add_argument("--tp-sequence-parallel", action="store_true", default=None,
                   help="override sequence_parallel.tp_sequence_parallel (Megatron-style: norms and residuals "
                        "split along the sequence over the TP group)")
    p.add_argument("--mode", help="override sequence_parallel.mode (ring | allgather | ulysses | hybrid | auto)")
    p.add_argument("--ulysses-size", type=lambda x: x if x == "auto" else int(x),
                   help="override sequence_parallel.ulysses_size (an integer dividing the SP size, or auto)")
    p.add_argument("--sharding", help="override sequence_parallel.sharding (contiguous | zigzag | balanced)")
    p.add_argument("--zero-stage", type=int, help="DeepSpeed: override zero_optimization.stage")
    p.add_argument("--seq-len", type=int)
    p.add_argument("--steps", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--micro-batch-size", type=int)
    p.add_argument("--grad-accum", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--optimizer", help="override train.optimizer (adamw | sgd)")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--activation-checkpointing", action="store_true", default=None)
    p.add_argument("--tiled-loss", action="store_true", default=None,
                   help="override sequence_parallel.tiled_loss (LM head + loss over sequence chunks)")
    p.add_argument("--tiled-mlp", type=lambda v: v if v == "auto" else int(v),
                   help="override sequence_parallel.tiled_mlp: number of chunks or 'auto'")
    p.add_argument("--offload-activations", action="store_true", default=None,
                   help="override sequence_parallel.offload_activations (CUDA; a no-op on CPU)")
    p.add_argument("--recompute-norm", action="store_true", default=None,
                   help="override sequence_parallel.recompute_norm (RMSNorms save only their input)")
    p.add_argument("--packed", action="store_true", default=None,
                   help="train on packed documents of long-tailed lengths (sets train.packed)")
    p.add_argument("--dynamic", action="store_true", default=None,
                   help="length-aware dynamic CP over the packed documents (sets train.dynamic; needs "
                        "sequence_parallel.dynamic and train.packed)")
    p.add_argument("--compile", action="store_true", default=None,
                   help="torch.compile the model (sets train.compile: FSDP2 per block, DeepSpeed engine.compile())")
    p.add_argument("--compile-backend", help="override train.compile_backend (inductor | aot_eager | ...)")
    p.add_argument("--metrics-out", help="write the metrics JSON here (rank 0)")
    p.add_argument("--save-dir", help="checkpoint directory (the engine's own format)")
    p.add_argument("--save-every", type=int)
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --save-dir")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--validate-only", action="store_true",
                   help="check the config and every block, build the model and run the swap's refusals on it "
                        "(one process), then exit 0 (or 2 naming the key or module) before any process group "
                        "exists")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--deepspeed", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.resume and not args.save_dir:
        p.error("--resume needs --save-dir")
    return args


def _own_sources() -> tuple[str, ...]:
    """The folders of seqpar's own code: the package, its integrations, and this launcher."""
    import seqpar
    import seqpar.integrations

    return tuple(os.path.join(os.path.abspath(d), "") for d in (*seqpar.__path__, *seqpar.integrations.__path__,
                                                               os.path.dirname(os.path.abspath(__file__))))


def config_error_message(exc: BaseException) -> str | None:
    """The message of ``exc`` when it is one of seqpar's own checks refusing the config or the model (a
    ``ConfigError``, a ``SwapError``, or a ``ValueError`` that a ``raise`` statement in seqpar, its integrations
    or this launcher raised), as ``"<type>: <message>"`` (``SwapError: ...``), else None: a bug (an exception from torch or transformers, or one seqpar did not
    raise on purpose) keeps its traceback."""
    if not isinstance(exc, ValueError):  # ConfigError and SwapError are ValueErrors
        return None
    tb = exc.__traceback__
    if tb is None:
        return None
    while tb.tb_next is not None:
        tb = tb.tb_next
    path = os.path.abspath(tb.tb_frame.f_code.co_filename)
    if not path.startswith(_own_sources()):
        return None
    if not linecache.getline(path, tb.tb_lineno).lstrip().startswith("raise"):
        return None  # e.g. an unpacking error inside seqpar: a bug, not a check
    return f"{type(exc).__name__}: {exc}"
