"""Length-aware dynamic CP against static SP: counted, measured and modelled (issue 32 §6).

``python -m seqpar.bench dynamic --world 4 --out DIR`` writes ``DIR/dynamic.json``, three parts, each
marked with its ``kind``:

1. ``mix`` (**counted**): the long-tailed mix, ``--batches`` global batches (fixed seeds) of ``--rows``
   packed rows of ``--seq-len`` tokens, document lengths log-normal (median 1024, sigma 1.2) clipped to
   ``[64, seq_len]``, the last document of a row taking what is left (as ``train.packed`` does). The
   same batches under static SP = P (each row cut over the whole pool, ``balanced`` sharding), static
   DP = 2 x SP = P/2 (rows dealt to the two SP groups) and dynamic (``max_tokens_per_rank = seq_len /
   P``, what static SP holds): per-rank cost max / mean (visible pairs counted by the attention planner
   on each rank's ``balanced`` shard, plus the linear terms; the cost model is the measured run's tiny
   Llama), bytes per rank (max; the dense ring's volume,
   :func:`seqpar.sequence.dynamic.ring_bytes_per_rank`), slots and peak tokens per rank.
2. ``measured``: the mix's first ``--measure-batches`` batches (the same seeds; ``--measure-rows`` rows
   each) run at P gloo ranks (:mod:`seqpar.bench.runner`'s rank pools, one intra-op thread per rank) through
   a swapped tiny fp32 Llama (``--hidden`` 64, intermediate ``2 x hidden``, ``--layers`` 2, ``--heads`` 4),
   the three schemes interleaved batch by batch and all through one path: each scheme is a plan whose
   micro-batches name their aligned group (static SP = P: one group of P per row; DP2 x SP: a group of P/2
   per row; dynamic: the planner's, at the budget static SP holds per rank, ``seq_len / P``, and again as
   ``dynamic_dp_budget`` at what static DP2 x SP holds, ``2 seq_len / P``: each baseline is compared at its own
   memory), :func:`seqpar.sequence.batch.rank_micro_batches` cuts them
   (``balanced`` sharding inside each group), each rank runs the forward + backward of its micro-batches and
   the gradients are summed over the pool once; each step is a
   :class:`seqpar.sequence.dynamic_step.DynamicStep` (the plan and this rank's micro-batches), whose
   :meth:`~seqpar.sequence.dynamic_step.DynamicStep.loss` gives the step's per-token mean loss after the timed
   part: every scheme runs the same documents through the same weights, so the schemes' step losses must agree
   (``step_loss_max_rel_diff``). Per scheme: each step's thread CPU time
   (``time.thread_time()`` between barriers, max over ranks; also the process's CPU time, which includes
   gloo's own threads), tokens/s (the slowest rank's wall time), the counted bytes (max per rank) and, from
   one untimed step on batch 0 (the warm-up), the peak bytes of the tensors a step allocates
   (:class:`~seqpar.memory.tracker.TensorMemoryTracker`; not the parameters or inputs).
3. ``pools`` (**modelled**): the planner alone on modelled pools of 64 and 512 GPUs for the anchors' mixes
   (lengths 1K-16K at 4096 tokens per rank against static CP 4, verl's Qwen3-30B-A3B SFT set-up; lengths up
   to 256K at 8192 tokens per rank against static CP 32), reporting the modelled step time against static
   CP beside Megatron-Core's 1.48x and verl's 1.61x (which are measured, on GPUs). Dynamic plans with
   ``spread_heavy``, and ``slot_sync`` for the slot-sync figure; the planner's seconds and its slot lower
   bound are reported.

The cost model of the counted and measured parts is the tiny Llama's FLOPs plus the CPU ranks' fixed terms
(per micro-batch, per ring step, per document: :data:`TINY_LLAMA_MICRO_BATCH_COST`,
:data:`TINY_LLAMA_RING_STEP_COST`, :data:`TINY_LLAMA_PER_DOCUMENT_COST`, or ``--micro-batch-cost`` /
``--ring-step-cost`` / ``--per-document-cost``). ``--calibrate`` first times single micro-batches of several
shapes at 4 ranks (one to 64 documents of distinct lengths, groups of 1, 2 and 4), fits the terms (:func:`seqpar.sequence.dynamic.fit_cost_terms`; ``calibration.fit`` in
the JSON) and plans the rest of the run with the fit.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from seqpar.bench.dynamic_measured import (
    CALIBRATION,
    calibration_report,
    distinct_lengths,
    measured_report,
    random_documents,
    scheme_plans,
    tiny_llama_model,
)
from seqpar.bench.dynamic_mix import (
    ANCHORS,
    PAD,
    QWEN3_30B_A3B,
    TINY_LLAMA,
    TINY_LLAMA_MICRO_BATCH_COST,
    TINY_LLAMA_PER_DOCUMENT_COST,
    TINY_LLAMA_RING_STEP_COST,
    counted_rank_costs,
    gpu_cost,
    log_uniform_documents,
    long_tailed_rows,
    mix_report,
    modelled_step_seconds,
    pack_rows,
    pool_case,
    pool_report,
    slot_balance,
    tiny_llama_cost,
)
from seqpar.bench.report import format_table, machine_info, write_json

# the parts live in dynamic_mix (counted, modelled) and dynamic_measured (measured, calibration); their names stay
# importable from here, where the command and the tests have always found them

__all__ = ["long_tailed_rows", "log_uniform_documents", "pack_rows", "counted_rank_costs", "mix_report", "modelled_step_seconds",
           "pool_report", "pool_case", "slot_balance", "tiny_llama_model", "random_documents", "measured_report", "calibration_report", "scheme_plans", "tiny_llama_cost", "run", "main", "ANCHORS", "PAD", "gpu_cost",
           "TINY_LLAMA", "QWEN3_30B_A3B", "distinct_lengths", "CALIBRATION"]


def run(args: argparse.Namespace, pools: Any = None) -> dict:
    t0 = time.perf_counter()
    calibration = calibration_report(args.hidden, args.layers, args.heads, pools=pools) if args.calibrate else None
    fixed = (args.micro_batch_cost, args.ring_step_cost, args.per_document_cost)
    if calibration is not None:  # the rest of the run plans with this machine's fit
        fit = calibration["fit"]
        fixed = (fit["micro_batch_cost"], fit["ring_step_cost"], fit["per_document_cost"])
    cost = tiny_llama_cost(args.hidden, args.layers, args.heads, micro_batch_cost=fixed[0], ring_step_cost=fixed[1],
                           per_document_cost=fixed[2])
    mix = mix_report(args.world, args.seq_len, args.rows, args.batches, args.seed, cost)
    measured = None
    if args.measure_batches:
        measured = measured_report(args.world, args.seq_len, args.measure_rows, args.measure_batches, args.seed,
                                   hidden=args.hidden, layers=args.layers, heads=args.heads,
                                   memory=not args.no_memory, pools=pools, fixed=fixed)
    pools_part = pool_report(args.pools, args.slots_per_group, args.seed, seeds=args.pool_seeds)
    return {"suite": "dynamic", "command": " ".join(["python -m seqpar.bench dynamic", *(args.argv or sys.argv[2:])]),
            "figures": "counted (mix), measured (measured: real gloo ranks) and modelled (pools)",
            "machine": machine_info(), "wall_s": time.perf_counter() - t0, "mix": mix, "measured": measured,
            "calibration": calibration, "pools": pools_part}


def render(payload: dict) -> str:
    mix = payload["mix"]
    rows = [{"scheme": name, "slots": o["slots"], "balance": o["balance_counted"],
             "bytes": f"{o['bytes_max_per_rank'] / 2**20:.0f} MiB", "peak": o["peak_tokens_per_rank"]}
            for name, o in mix["overall"].items()]
    text = [f"long-tailed mix, world {mix['world']}, {mix['batches']} batches x {mix['rows_per_batch']} rows of "
            f"{mix['seq_len']} (counted, all steps):",
            format_table(rows, [("scheme", "scheme"), ("slots", "slots"), ("cost max/mean", "balance"),
                                ("bytes max/rank", "bytes"), ("peak tokens/rank", "peak")]),
            f"bytes static SP / dynamic: {mix['bytes_ratio_static_sp_over_dynamic']:.2f} (worst step "
            f"{mix['bytes_ratio_worst_step']:.2f}); counted work static DP2 x SP / dynamic: "
            f"{mix['work_ratio_counted_static_dp2_over_dynamic']:.2f} over all steps, per step "
            + ", ".join(f"{r:.2f}" for r in mix["work_ratio_counted_per_step"])
            + f"; with the fixed terms {mix['work_ratio_counted_with_fixed']:.2f}"]
    rows = [{"pool": c["pool"], "mix": c["mix"], "cp": c["static_cp"], "s_slots": c["static"]["slots"],
             "d_slots": c["dynamic"]["slots"], "lb": c["dynamic"]["slots_lower_bound"],
             "fill": f"{c['dynamic']['fill_of_lower_bound']:.4f}", "plan_s": c["planner_seconds"],
             "slot": c["speedup"]["slot_sync"], "group": c["speedup"]["group_sync"],
             "bal": f"{c['dynamic_slot_sync']['slot_balance']:.3f}",
             "seeds": " / ".join(f"{c['speedup_over_seeds']['slot_sync'][k]:.2f}" for k in ("least", "median", "most"))
             if "speedup_over_seeds" in c else "-"}
            for c in payload["pools"]["cases"] if "skipped" not in c]
    text += ["", "modelled pools, step time static CP / dynamic (Megatron 1.48x and verl 1.61x are measured elsewhere):",
             format_table(rows, [("pool", "pool"), ("mix", "mix"), ("static CP", "cp"), ("static slots", "s_slots"),
                                 ("dynamic slots", "d_slots"), ("lower bound", "lb"),
                                 ("tokens / lower bound's room", "fill"), ("planner s", "plan_s"),
                                 ("speedup slot-sync", "slot"), ("slot-sync busiest / mean", "bal"),
                                 ("speedup group-sync", "group"),
                                 ("slot-sync over seeds (least / median / most)", "seeds")])]
    m = payload.get("measured")
    if m:
        rows = [{"scheme": name, "cpu": s["cpu_s_max_over_ranks_total"], "proc": s["process_cpu_s_max_over_ranks_total"],
                 "tps": s["tokens_per_s"], "bytes": f"{sum(s['bytes_max_per_rank_counted_per_step']) / 2**20:.0f} MiB",
                 "peak": f"{s['peak_bytes_max_over_ranks'] / 2**20:.1f} MiB" if "peak_bytes_max_over_ranks" in s else "-"}
                for name, s in m["schemes"].items()]
        text += ["", f"measured, {m['world']} gloo ranks, {m['batches']} batches x {m['rows_per_batch']} rows of "
                 f"{m['seq_len']}, tiny Llama hidden {m['model']['hidden']}, {m['model']['layers']} layers:",
                 format_table(rows, [("scheme", "scheme"), ("thread CPU s (max rank, summed over steps)", "cpu"),
                                     ("process CPU s", "proc"), ("tokens/s (wall)", "tps"),
                                     ("bytes max/rank (counted)", "bytes"), ("peak (max rank)", "peak")]),
                 f"thread CPU static DP2 x SP / dynamic: {m['work_ratio_measured_static_dp2_over_dynamic']:.2f} over "
                 "all steps, per step " + ", ".join(f"{r:.2f}" for r in m["work_ratio_measured_per_step"]),
                 "thread CPU static DP2 x SP / dynamic at its budget (2 seq_len / world tokens per rank): "
                 f"{m['work_ratio_measured_static_dp2_over_dynamic_dp_budget']:.2f} over all steps, per step "
                 + ", ".join(f"{r:.2f}" for r in m["work_ratio_measured_per_step_dp_budget"]),
                 f"step losses, largest relative difference between the schemes: {m['step_loss_max_rel_diff']:.1e}",
                 "the calibrated cost model predicts (counted FLOPs + fixed terms): "
                 f"{m['work_ratio_modelled_static_dp2_over_dynamic']:.2f} and "
                 f"{m['work_ratio_modelled_static_dp2_over_dynamic_dp_budget']:.2f}"]
    if payload.get("calibration"):
        rows = [{"case": c["case"], "tok": c["tokens_per_rank"], "gf": c["counted_gflop"], "cpu": c["cpu_s_max_over_ranks"],
                 "spg": c["s_per_gflop"], "fit": c["fitted_s"]} for c in payload["calibration"]["cases"]]
        fit = payload["calibration"]["fit"]
        text += ["", "calibration, one micro-batch per rank (thread CPU, max over ranks):",
                 format_table(rows, [("case", "case"), ("tokens/rank", "tok"), ("counted GFLOP/rank", "gf"),
                                     ("CPU s", "cpu"), ("s per GFLOP", "spg"), ("fitted s", "fit")]),
                 f"fit: {fit['seconds_per_unit'] * 1e9:.4f} s per GFLOP, {fit['micro_batch_s'] * 1e3:.1f} ms per "
                 f"micro-batch ({fit['micro_batch_cost']:.3g} FLOP), {fit['ring_step_s'] * 1e3:.2f} ms per ring step, "
                 f"layer and pass ({fit['ring_step_cost']:.3g} FLOP), {fit['per_document_s'] * 1e3:.2f} ms per "
                 f"document ({fit['per_document_cost']:.3g} FLOP); rms residual {fit['residual_rel']:.1%}"]
    return "\n".join(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m seqpar.bench dynamic", description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=4, help="ranks of the counted comparison (even; default 4)")
    p.add_argument("--seq-len", type=int, default=16384, help="packed row length (default 16384)")
    p.add_argument("--rows", type=int, default=8, help="packed rows per global batch (default 8)")
    p.add_argument("--batches", type=int, default=8, help="global batches (default 8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pools", type=lambda t: [int(x) for x in t.split(",") if x], default=[64, 512],
                   help="modelled pool sizes (default 64,512)")
    p.add_argument("--slots-per-group", type=int, default=4,
                   help="modelled pools: static micro-batches per DP group per step (default 4)")
    p.add_argument("--pool-seeds", type=int, default=1,
                   help="modelled pools: also plan this many batches of each mix (seeds --seed, --seed + 1, ...) and "
                        "report the speedup's least / median / most (default 1: one batch)")
    p.add_argument("--measure-rows", type=int, default=4,
                   help="measured part: packed rows per global batch (default 4: a few minutes on 2 loaded cores)")
    p.add_argument("--measure-batches", type=int, default=3,
                   help="measured part: global batches, the mix's first seeds (default 3; 0 skips the measured part)")
    p.add_argument("--hidden", type=int, default=64, help="the measured tiny Llama's hidden size (default 64)")
    p.add_argument("--layers", type=int, default=2, help="its layers (default 2)")
    p.add_argument("--heads", type=int, default=4, help="its attention heads, as many K/V heads (default 4)")
    p.add_argument("--no-memory", action="store_true", help="measured part: skip the peak-memory step")
    p.add_argument("--calibrate", action="store_true",
                   help="first time single micro-batches and fit the cost model's fixed terms (per micro-batch, per "
                        "ring step, per document) to them; the rest of the run plans with the fit (written under calibration.fit)")
    p.add_argument("--micro-batch-cost", type=float, default=TINY_LLAMA_MICRO_BATCH_COST,
                   help="the CPU ranks' fixed cost per micro-batch, forward-FLOP units, without --calibrate "
                        f"(default {TINY_LLAMA_MICRO_BATCH_COST:g}: the last calibration)")
    p.add_argument("--ring-step-cost", type=float, default=TINY_LLAMA_RING_STEP_COST,
                   help="the fixed cost per ring step, layer and pass, forward-FLOP units, without --calibrate "
                        f"(default {TINY_LLAMA_RING_STEP_COST:g})")
    p.add_argument("--per-document-cost", type=float, default=TINY_LLAMA_PER_DOCUMENT_COST,
                   help="the cost per document besides its FLOPs (its kernel calls and merges), forward-FLOP units, "
                        f"without --calibrate (default {TINY_LLAMA_PER_DOCUMENT_COST:g})")
    p.add_argument("--out", metavar="DIR", help="write DIR/dynamic.json")
    return p


def main(argv: Sequence[str] | None = None, *, pools: Any = None) -> int:
    """``pools``: a :class:`seqpar.bench.runner.PoolSet` to run the measured part's ranks on (left running; the
    test suite's), else it starts its own."""
    args = build_parser().parse_args(argv)
    args.argv = None if argv is None else list(argv)
    payload = run(args, pools=pools)
    if args.out:
        path = os.path.join(args.out, "dynamic.json")
        write_json(path, payload)
    print(render(payload), flush=True)
    if args.out:
        print(f"wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
