"""``python -m seqpar.bench <suite> [options]`` (also ``seqpar-bench``): see BENCHMARKS.md.

Suites: ``attention``, ``peers``, ``memory``, ``train``, ``comm``, or ``all``; ``gpu-check`` (its own
flags, see :mod:`seqpar.bench.gpu_check`) is the GPU run-book; ``ssd`` (:mod:`seqpar.bench.ssd`)
measures one Mamba2 layer sequence-parallel; ``overlap``
(:mod:`seqpar.bench.overlap`) the transfers hidden on emulated links; ``gpu-perf``
(:mod:`seqpar.bench.gpu_perf`) the ring's speed on one GPU, ``gpu-perf-table`` its JSON as BENCHMARKS rows.
Presets: ``--quick`` (P = 2, S up to 4096: a few minutes on 2 CPU cores), ``--tiny`` (toy shapes: checks the machinery,
used by the tests), default (S up to 8192, P = 2 and 4). Explicit flags override the preset.
Every run prints a table; ``--out DIR`` also writes ``DIR/<suite>.json`` (every figure, the command,
the machine and versions) and PNG plots. ``ring-memory`` (:mod:`seqpar.bench.ring_memory`): one ring
rank's peak memory against one process, byte by byte. ``dynamic`` (:mod:`seqpar.bench.dynamic`):
length-aware dynamic CP against static SP, counted, measured on gloo ranks and modelled. ``interleave`` (:mod:`seqpar.bench.interleave`): a
few methods timed in interleaved rounds, with an optional phase profile per round.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from seqpar.bench.report import machine_info, write_json

__all__ = ["main", "build_parser", "SUITES", "COMMANDS"]

SUITES = ("attention", "peers", "memory", "train", "comm")
COMMANDS = {
    "gpu-check": "the GPU run-book's stages (docs/gpu-runbook.md)",
    "gpu-perf": "the ring's speed on one GPU",
    "gpu-perf-table": "a gpu-perf JSON as BENCHMARKS.md's markdown rows",
    "ssd": "one Mamba2 layer sequence-parallel",
    "overlap": "transfers hidden on emulated links",
    "ring-memory": "one ring rank's peak memory against one process",
    "dynamic": "length-aware dynamic CP against static SP",
    "interleave": "a few methods timed in interleaved rounds",
}
"""Commands with parsers of their own, dispatched by :func:`main` before the suites' parser."""

# preset -> defaults (flags given on the command line win)
_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"seq_lens": [128, 256], "worlds": [2], "q_heads": 2, "kv_heads": 2, "head_dim": 16,
             "warmup": 1, "repeats": 1, "budget_mib": 1.0, "train_seq_len": 64, "train_steps": 2,
             "sp_sizes": [1, 2]},
    "quick": {"seq_lens": [2048, 4096], "worlds": [2], "q_heads": 8, "kv_heads": 8, "head_dim": 64,
              "warmup": 1, "repeats": 3, "budget_mib": 64.0, "train_seq_len": 512, "train_steps": 4,
              "sp_sizes": [1, 2]},
    "full": {"seq_lens": [2048, 4096, 8192], "worlds": [2, 4], "q_heads": 8, "kv_heads": 8, "head_dim": 64,
             "warmup": 1, "repeats": 3, "budget_mib": 256.0, "train_seq_len": 2048, "train_steps": 6,
             "sp_sizes": [1, 2, 4]},
}


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def _pair(text: str) -> tuple[int, int]:
    """``"1048576:8"``, ``"1024k:8"`` or ``"1m:8"`` -> ``(S, P)``."""
    try:
        s, p = text.lower().split(":")
        mult = {"k": 1024, "m": 1024 * 1024}.get(s[-1:], 1)
        return int(s[:-1] if mult > 1 else s) * mult, int(p)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not S:P, e.g. 1048576:8 or 1024k:8") from None


def _head_chunks(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer or 'auto'")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="seqpar-bench",
        description="Benchmarks of seqpar's sequence-parallel attention against single-device attention and peers.",
        # the commands are dispatched in main() before this parser runs: list them, or --help hides them
        epilog="commands with flags of their own (python -m seqpar.bench COMMAND --help):\n"
               + "\n".join(f"  {name}: {what}" for name, what in COMMANDS.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,  # the epilog's one line per command
    )
    p.add_argument("suite", choices=[*SUITES, "all"], help="what to measure (or a command below)")
    preset = p.add_mutually_exclusive_group()
    preset.add_argument("--quick", action="store_true", help="P=2, S up to 4096 (a few minutes on 2 CPU cores)")
    preset.add_argument("--tiny", action="store_true", help="toy shapes: checks that every path runs (tests)")
    p.add_argument("--out", metavar="DIR", help="write DIR/<suite>.json and PNG plots")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    g = p.add_argument_group("shapes")
    g.add_argument("--seq-lens", type=_ints, help="total sequence lengths S, e.g. 2048,4096,8192")
    g.add_argument("--worlds", type=_ints, help="ranks P, e.g. 2,4")
    g.add_argument("--batch", type=int, default=1)
    g.add_argument("--q-heads", type=int)
    g.add_argument("--kv-heads", type=int)
    g.add_argument("--head-dim", type=int)
    g.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="default float32 on CPU, bfloat16 on CUDA (flash kernels)")
    g.add_argument("--head-chunks", type=_head_chunks, default="auto",
                   help="seqpar.attention head_chunks for ring / all-gather: an integer or 'auto' (default)")
    g.add_argument("--causal", default="both", choices=["both", "yes", "no"])
    g.add_argument("--methods", help="attention suite: comma list of sdpa,ring,allgather,dilated (default all), or also seqpar_ulysses,hybrid")
    g = p.add_argument_group("measurement")
    g.add_argument("--warmup", type=int)
    g.add_argument("--repeats", type=int)
    g.add_argument("--rounds", type=int, default=1,
                   help="interleave the cases this many times (fair against drifting background load)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--no-memory", action="store_true", help="skip the (untimed) peak-memory pass")
    g.add_argument("--profile", action="store_true", help="attention: split each step into phases")
    g.add_argument("--simulate", type=_pair, action="append", metavar="S:P",
                   help="attention: time one rank of a P-rank ring on this device (default on CUDA: 1048576:8)")
    g.add_argument("--budget-mib", type=float, help="memory: per-rank budget for the largest-S search")
    g.add_argument("--model", help="memory: a whole model instead of one attention call, e.g. llama3-8b "
                   "(seqpar.memory.training.MODEL_SHAPES): the longest trainable sequence, modelled")
    g.add_argument("--gpus", type=int, help="memory --model: GPUs, all one SP group (default: 1 and 8)")
    g.add_argument("--layouts", help="memory --model: TP x SP mesh layouts to compare instead, e.g. "
                   "tp8,sp8,tp2xsp4 (TP ones with and without tp_sequence_parallel)")
    g.add_argument("--gpu-mem", type=float, default=80.0, help="memory --model: GB (GiB) per GPU (default 80)")
    g.add_argument("--model-dtype", default="bf16", choices=["bf16", "fp16", "fp32"],
                   help="memory --model: training dtype (default bf16)")
    g.add_argument("--gpu-reserve", type=float, default=0.05,
                   help="memory --model: fraction of --gpu-mem kept for the CUDA context and fragmentation")
    g.add_argument("--window", type=int, help="memory --model: the data's sliding window (tokens); the ring's plan "
                   "skips and pieces blocks by it (seqpar.memory.masked)")
    g.add_argument("--chunk-size", type=int, help="memory --model: chunked attention's chunk (tokens)")
    g.add_argument("--sinks", action="store_true", help="memory --model: attention sinks (one learned logit a head)")
    g.add_argument("--sharding", choices=["zigzag", "contiguous", "balanced"],
                   help="memory --model: the sequence's sharding under a mask (default: the ring's, zigzag)")
    g.add_argument("--sp-sizes", type=_ints, help="train: SP sizes (default 1,2[,4])")
    g.add_argument("--train-config", default="configs/fsdp_ring.json", help="train: launch/train.py config")
    g.add_argument("--train-launcher", default="torchrun", choices=["torchrun", "deepspeed"])
    g.add_argument("--train-seq-len", type=int)
    g.add_argument("--train-steps", type=int)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--replot", metavar="DIR", help="no measuring: print the table and redraw the plots of DIR/<suite>.json")
    return p


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Fill unset options from the preset (``tiny`` / ``quick`` / ``full``) and the device."""
    from seqpar.bench.runner import resolve_device

    args.preset = "tiny" if args.tiny else "quick" if args.quick else "full"
    args.explicit = {key for key in _PRESETS[args.preset] if getattr(args, key, None) is not None}
    for key, value in _PRESETS[args.preset].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.device = resolve_device(args.device)
    if args.device == "cuda":  # GPU kernels need longer sequences before they are worth timing
        cuda_lens = {"tiny": [1024, 2048], "quick": [8192, 32768], "full": [8192, 32768, 131072]}
        if "seq_lens" not in args.explicit:
            args.seq_lens = cuda_lens[args.preset]
        args.dtype = args.dtype or "bfloat16"
    args.dtype = args.dtype or "float32"
    args.causal_list = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    if args.simulate is None:
        args.simulate = []
        if args.device == "cuda" and args.suite in ("attention", "all"):
            args.simulate = [(262144, 8)] if args.preset != "full" else [(1048576, 8)]
    return args


def run_suite(name: str, args: argparse.Namespace, pools: Any = None) -> dict[str, Any]:
    """Run one suite, print its report, write JSON/plots when ``--out``; returns the JSON payload.

    ``pools``: a :class:`seqpar.bench.runner.PoolSet` to run the suite's ranks on (left running), else it starts
    its own."""
    from seqpar.bench.runner import Progress

    mod = importlib.import_module(f"seqpar.bench.{name}")
    cfg = mod.configure(args)
    machine = machine_info()  # before the run: its load average is everybody else's
    bar = Progress(mod.count(cfg), desc=name, enabled=not args.no_progress)
    t0 = time.perf_counter()
    try:
        payload = mod.run(cfg, bar, pools=pools)
    finally:
        bar.close()
    payload = {"suite": name, "command": " ".join(["python -m seqpar.bench", *sys.argv[1:]]),
               "preset": args.preset, "wall_s": time.perf_counter() - t0, "machine": machine, **payload}
    machine["load_avg_after_run"] = list(os.getloadavg())
    print(mod.render(payload), flush=True)
    if args.out:
        payload["plots"] = [os.path.relpath(p, args.out) for p in mod.plots(payload, args.out)]
        path = os.path.join(args.out, f"{name}.json")
        write_json(path, payload)
        print(f"wrote {path}" + "".join(f", {os.path.join(args.out, p)}" for p in payload["plots"]), flush=True)
    return payload


def replot(name: str, out_dir: str) -> None:
    """Print the table of ``out_dir/<name>.json`` and redraw its plots (the JSON keeps its figures)."""
    path = os.path.join(out_dir, f"{name}.json")
    if not os.path.exists(path):
        print(f"--replot: {path} does not exist; skipped", file=sys.stderr)
        return
    mod = importlib.import_module(f"seqpar.bench.{name}")
    with open(path) as f:
        payload = json.load(f)
    print(mod.render(payload), flush=True)
    payload["plots"] = [os.path.relpath(p, out_dir) for p in mod.plots(payload, out_dir)]
    write_json(path, payload)


def main(argv: Sequence[str] | None = None, *, pools: Any = None) -> int:
    """Entry point of ``seqpar-bench`` / ``python -m seqpar.bench``.

    ``pools``: a :class:`seqpar.bench.runner.PoolSet` the suites (``attention``, ``peers``, ``memory``, ``comm``)
    run their ranks on, left running (the tests lend theirs, already started); by default each suite starts
    its own. The commands of their own (``gpu-check``, ``ssd``, ...) take none."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["gpu-check"]:  # the GPU run-book: a command of its own, not a suite
        from seqpar.bench.gpu_check import main as gpu_check_main

        return gpu_check_main(argv[1:])
    if argv[:1] == ["ssd"]:  # one Mamba2 layer sequence-parallel: a command of its own (BENCHMARKS.md)
        from seqpar.bench.ssd import main as ssd_main

        return ssd_main(argv[1:])
    if argv[:1] == ["gpu-perf"]:  # the ring's speed on one GPU (issue 29 §8): a command of its own
        from seqpar.bench.gpu_perf import main as gpu_perf_main

        return gpu_perf_main(argv[1:])
    if argv[:1] == ["gpu-perf-table"]:  # a gpu-perf JSON as BENCHMARKS.md's markdown rows
        from seqpar.bench.gpu_perf import table_main

        return table_main(argv[1:])
    if argv[:1] == ["overlap"]:  # transfers hidden on emulated links (issue 29): a command of its own
        from seqpar.bench.overlap import main as overlap_main

        return overlap_main(argv[1:])
    if argv[:1] == ["ring-memory"]:  # one ring rank's peak vs one process, and its breakdown (issue 29)
        from seqpar.bench.ring_memory import main as ring_memory_main

        return ring_memory_main(argv[1:])
    if argv[:1] == ["dynamic"]:  # length-aware dynamic CP, counted, measured, modelled (issue 32): its own command
        from seqpar.bench.dynamic import main as dynamic_main

        return dynamic_main(argv[1:], pools=pools)
    if argv[:1] == ["interleave"]:  # a few methods timed in interleaved rounds (BENCHMARKS.md, Ulysses)
        from seqpar.bench.interleave import main as interleave_main

        return interleave_main(argv[1:])
    args = build_parser().parse_args(argv)
    names = list(SUITES) if args.suite == "all" else [args.suite]
    if args.replot:
        for name in names:
            replot(name, args.replot)
        return 0
    args = resolve(args)
    for name in names:
        run_suite(name, args, pools)
    return 0


if __name__ == "__main__":
    sys.exit(main())
