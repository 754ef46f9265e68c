"""``python -m seqpar.bench interleave``: a few attention methods timed in interleaved rounds, on one rank pool.

On a shared machine the load drifts over minutes, so timing method A's whole run and then B's compares
A's load with B's. Here every round runs each method once per causal setting, in the order given (rotate
it between runs), so a load change hits every method alike; each figure is kept per round, with the
median over rounds beside it. CPU time is the figure to read on an oversubscribed machine (P ranks on
fewer cores wait for a core, and waiting costs no CPU time)::

    python -m seqpar.bench interleave --seq-len 8192 --world 4 --rounds 3 --methods ring,seqpar_ulysses,hybrid \\
        --profile --out profile.json

Methods: those of the attention suite (:data:`seqpar.bench.attention.METHODS` and ``EXTRA_METHODS``);
DeepSpeed's Ulysses and the other peers are the ``peers`` suite's (also interleaved, ``--rounds``).
``--profile`` adds one phase-profiled step per method and round: the exclusive thread-CPU seconds of each
phase, averaged over the ranks, median over rounds. This replaces the loose scripts that produced
BENCHMARKS.md's hybrid comparisons (``bench/cpu-ulysses-p2/compare.py`` and
``bench/cpu-ulysses-p4/phase_profile.py`` until issue 30).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from typing import Any

from seqpar.bench.attention import EXTRA_METHODS, METHODS, BenchShape, Settings, run_case
from seqpar.bench.runner import RankPool, combine

__all__ = ["main", "build_parser", "run_rounds", "summarize", "run_compiled"]

CAUSAL = {"yes": (True,), "no": (False,), "both": (False, True)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m seqpar.bench interleave", description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, default=8192, help="total sequence length S")
    p.add_argument("--world", type=int, default=2, help="ranks P")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--methods", default="ring,seqpar_ulysses",
                   help=f"comma list, in the order each round runs them: {', '.join(METHODS + EXTRA_METHODS)}")
    p.add_argument("--causal", default="both", choices=sorted(CAUSAL))
    p.add_argument("--q-heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--head-chunks", default="auto", help="an int or auto")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=2, help="timed steps per method and round")
    p.add_argument("--profile", action="store_true", help="also one phase-profiled step per method and round")
    p.add_argument("--out", metavar="FILE", help="write every round's figures as JSON (rewritten after each round)")
    p.add_argument("--compile", action="store_true",
                   help="instead of attention methods: a swapped model's training step, torch.compile'd vs eager "
                        "(seqpar.bench.compiled; --model, --backend, --seq-len, --rounds, --repeats)")
    p.add_argument("--model", default="llama", help="with --compile: the transformers model type (llama, qwen3_5_text: Qwen3.5, ...)")
    p.add_argument("--backend", default="inductor", help="with --compile: the torch.compile backend")
    return p


def summarize(rounds: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """One method and causal setting over its rounds (each the ranks' raw records) -> the reported figures:
    per round and median, the step's CPU seconds (largest rank, median over repeats, as the suites report)
    and wall seconds (slowest rank); with a profile, each phase's CPU seconds (mean over ranks)."""
    per_round = [combine([r["timing"] for r in ranks]) for ranks in rounds]
    out: dict[str, Any] = {
        "cpu_s_rounds": [c["cpu_s"] for c in per_round],
        "time_s_rounds": [c["time_s"] for c in per_round],
        "cpu_s": statistics.median(c["cpu_s"] for c in per_round),
        "time_s": statistics.median(c["time_s"] for c in per_round),
    }
    if all("profile" in r for ranks in rounds for r in ranks):
        phases = sorted({p for ranks in rounds for r in ranks for p in r["profile"]["phases_cpu_s"]})
        out["phases_cpu_s"] = {
            p: statistics.median(statistics.mean(r["profile"]["phases_cpu_s"].get(p, 0.0) for r in ranks)
                                 for ranks in rounds)
            for p in phases
        }
    return out


def run_rounds(args: argparse.Namespace) -> dict[str, Any]:
    """Run the rounds on one pool of ``args.world`` CPU ranks; returns (and, with ``--out``, writes after
    every round) ``{"settings", "rounds_done", "summary": {"<method> causal=<bool>": summarize(...)}}``."""
    methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(methods) - set(METHODS + EXTRA_METHODS))
    if unknown or not methods:
        raise SystemExit(f"interleave: unknown method(s) {unknown or methods}; known: {[*METHODS, *EXTRA_METHODS]}")
    head_chunks = args.head_chunks if args.head_chunks == "auto" else int(args.head_chunks)
    shape = BenchShape(batch=1, q_heads=args.q_heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                       head_chunks=head_chunks)
    settings = Settings(warmup=args.warmup, repeats=args.repeats, seed=0, memory=False, profile=args.profile)
    raw: dict[str, list[list[dict[str, Any]]]] = {}
    result: dict[str, Any] = {"settings": {k: v for k, v in vars(args).items() if k != "out"}}
    with RankPool(args.world, device="cpu") as pool:
        for rnd in range(args.rounds):
            for causal in CAUSAL[args.causal]:
                for m in methods:
                    per = pool.run(run_case, m, args.seq_len, causal, shape, settings)
                    key = f"{m} causal={causal}"
                    raw.setdefault(key, []).append(per)
                    print(f"round {rnd} {key}: cpu {combine([r['timing'] for r in per])['cpu_s']:.3f} s", flush=True)
            result.update(rounds_done=rnd + 1, summary={k: summarize(v) for k, v in raw.items()})
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(result, f, indent=1)
    return result


def run_compiled(args: argparse.Namespace) -> dict[str, Any]:
    """``--compile``: :func:`seqpar.bench.compiled.compiled_rounds` on one pool; prints and (``--out``) writes
    the summary."""
    from seqpar.bench.compiled import compiled_rounds, summarize_compiled

    with RankPool(args.world, device="cpu") as pool:
        # an hour, not the pool's 15 minutes: inductor compiling Qwen3.5's Gated DeltaNet on a loaded CPU
        # took more than 15 minutes (2026-11-29, load ~30 on 2 cores)
        per = pool.run(compiled_rounds, args.model, args.seq_len, args.rounds, args.repeats, args.backend,
                       timeout=3600)
    result = {"settings": {k: v for k, v in vars(args).items() if k != "out"},
              "summary": summarize_compiled(per, args.seq_len)}
    summary = result["summary"]
    for rnd, (e, c) in enumerate(zip(summary["eager_tokens_per_s_rounds"], summary["compiled_tokens_per_s_rounds"],
                                     strict=True)):
        print(f"round {rnd}: eager {e:.0f} tokens/s, compiled {c:.0f} tokens/s, ratio {c / e:.3f}", flush=True)
    print(f"median: eager {summary['eager_tokens_per_s']:.0f}, compiled {summary['compiled_tokens_per_s']:.0f} "
          f"tokens/s, ratio {summary['ratio_median']:.3f} (compile {summary['compile_s']:.1f} s; first losses "
          f"{summary['first_loss']}, gradients' largest relative difference {summary['grad_max_rel_diff']:.2e})", flush=True)
    if "cpu_ratio_median" in summary:
        print(f"thread CPU per step (busiest rank): eager {summary['eager_cpu_s']:.3f} s, compiled "
              f"{summary['compiled_cpu_s']:.3f} s, eager / compiled {summary['cpu_ratio_median']:.3f}; "
              f"(process: eager {summary.get('eager_process_cpu_s', float('nan')):.3f} s, compiled "
              f"{summary.get('compiled_process_cpu_s', float('nan')):.3f} s); recompiles during the rounds: "
              f"{summary['recompiles']}", flush=True)
    if "eager_forward_cpu_s" in summary:
        print(f"of which the forward: eager {summary['eager_forward_cpu_s']:.3f} s, compiled "
              f"{summary['compiled_forward_cpu_s']:.3f} s", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.compile:
        run_compiled(args)
    else:
        run_rounds(args)
    return 0
