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
import dataclasses
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from seqpar.attn.common import AttentionOptions, block_calls
from seqpar.attn.masks import visible_pair_count
from seqpar.bench.report import format_table, machine_info, write_json
from seqpar.config import Links
from seqpar.sequence.dynamic import (
    RING_PASSES,
    CostModel,
    DynamicPlan,
    MicroBatch,
    fit_cost_terms,
    plan_dynamic,
    static_plan,
)

__all__ = ["long_tailed_rows", "log_uniform_documents", "pack_rows", "counted_rank_costs", "mix_report", "modelled_step_seconds",
           "pool_report", "pool_case", "slot_balance", "tiny_llama_model", "random_documents", "measured_report", "calibration_report", "scheme_plans", "tiny_llama_cost", "run", "main", "ANCHORS",
           "TINY_LLAMA", "QWEN3_30B_A3B", "distinct_lengths", "CALIBRATION"]

PAD = 8  # balanced sharding pads a group's micro-batch to a multiple of 8 x its size (its finest layout)


# The fixed terms of the 4-rank CPU run (forward-FLOP units; the --calibrate fit in BENCHMARKS.md "Length-aware
# dynamic CP", idle 2-core VM, 2026-11-29, commit ef75491 (after the CPU merge fix): 34.5 ms per micro-batch,
# 0.44 ms per ring step, layer and pass, 0.93 ms per document, at 5.53e-11 s per forward FLOP). Machine- and
# commit-specific: `--calibrate` refits them and runs with the fit.
TINY_LLAMA_MICRO_BATCH_COST = 6.23e8
TINY_LLAMA_RING_STEP_COST = 7.95e6
TINY_LLAMA_PER_DOCUMENT_COST = 1.69e7


def tiny_llama_cost(hidden: int, layers: int, heads: int, *, micro_batch_cost: float = TINY_LLAMA_MICRO_BATCH_COST,
                    ring_step_cost: float = TINY_LLAMA_RING_STEP_COST,
                    per_document_cost: float = TINY_LLAMA_PER_DOCUMENT_COST) -> CostModel:
    """The counted cost of the measured run's model (:func:`tiny_llama_model`'s sizes: intermediate ``2 x
    hidden``, fp32 K/V on the ring), with the CPU ranks' fixed terms (defaults: the last calibration)."""
    return CostModel.transformer(hidden, 2 * hidden, q_heads=heads, kv_heads=heads, layers=layers, elem_bytes=4,
                                 micro_batch_cost=micro_batch_cost, ring_step_cost=ring_step_cost,
                                 per_document_cost=per_document_cost)


# the 4-rank CPU run's model by default (a tiny Llama: hidden 64, intermediate 128, 4 heads, 2 layers): its cost
TINY_LLAMA = tiny_llama_cost(64, 2, 4)
# verl's anchor model: hidden 2048, 48 layers, 32 query / 4 K/V heads of 128, 8 active experts of 768
QWEN3_30B_A3B = CostModel.transformer(2048, 768, q_heads=32, kv_heads=4, head_dim=128, layers=48, active_mlps=8)
ANCHORS = {"megatron_core_dynamic_cp": 1.48, "verl_qwen3_30b_a3b_1k_16k": 1.61}


def long_tailed_rows(rows: int, seq_len: int, seed: int, *, median: int = 1024, sigma: float = 1.2,
                     lo: int = 64) -> list[list[int]]:
    """``rows`` packed rows of ``seq_len`` tokens: document lengths log-normal (``median``, ``sigma``)
    clipped to ``[lo, seq_len]``; a row's last document takes what is left (and absorbs a rest below
    ``lo``), so every row sums to ``seq_len``. Deterministic in ``seed``."""
    rng = random.Random(seed)
    out = []
    for _ in range(rows):
        left, row = seq_len, []
        while left:
            n = min(seq_len, max(lo, round(math.exp(rng.gauss(math.log(median), sigma)))), left)
            if left - n < lo:
                n = left
            row.append(n)
            left -= n
        out.append(row)
    return out


def log_uniform_documents(tokens: int, seed: int, *, lo: int, hi: int) -> list[int]:
    """Whole documents of lengths log-uniform in ``[lo, hi]`` (the anchors' "1K-16K"), drawn until the next
    would pass ``tokens`` in total. Deterministic in ``seed``."""
    rng = random.Random(seed)
    out: list[int] = []
    total = 0
    while True:
        n = round(math.exp(rng.uniform(math.log(lo), math.log(hi))))
        if total + n > tokens:
            return out
        out.append(n)
        total += n


def pack_rows(lengths: Sequence[int], row_len: int) -> list[list[int]]:
    """Whole documents packed into rows of ``row_len`` in order (next fit: a document that does not fit
    starts a new row; the rest of a row is padding), as static CP packs an SFT batch without cutting
    samples."""
    rows: list[list[int]] = [[]]
    for n in lengths:
        if sum(rows[-1]) + n > row_len:
            rows.append([])
        rows[-1].append(n)
    return [row for row in rows if row]


def _counted_micro_batch(mb: MicroBatch, lengths: Sequence[int], cost: CostModel) -> list[tuple[int, int]]:
    """``(visible pairs, tokens)`` of each rank of the micro-batch's group, counted by the attention
    planner on the ``balanced`` layout of its packed documents (padding is one more document)."""
    if not mb.docs:
        return [(0, 0)] * mb.size
    docs = [lengths[d] for d in mb.docs]
    if mb.size == 1:
        return [(sum(cost.pairs(n) for n in docs), sum(docs))]
    padded = -(-sum(docs) // (PAD * mb.size)) * PAD * mb.size
    cu = [0]
    for n in docs + ([padded - sum(docs)] if padded > sum(docs) else []):
        cu.append(cu[-1] + n)
    opts = AttentionOptions(causal=cost.causal, scale=1.0, sharding="balanced", window=cost.window,
                            chunk_size=cost.chunk_size, cu_seqlens=tuple(cu))
    local = padded // mb.size
    return [(sum(visible_pair_count(block_calls(opts, mb.size, r, s, local)) for s in range(mb.size)), local)
            for r in range(mb.size)]


def counted_rank_costs(plan: DynamicPlan, cost: CostModel, *, fixed: bool = False) -> list[float]:
    """Each pool position's cost over the step, its visible pairs counted by the attention planner
    (not the planner's even split): ``layers * (pair_cost * pairs + token_cost * tokens)``; with ``fixed``
    plus each micro-batch's fixed cost (:meth:`CostModel.fixed_cost`) and its documents' per-document term
    (``per_document_cost`` split over the group, as the planner counts it): what the measured CPU time should
    follow."""
    out = [0.0] * plan.pool_size
    for slot in plan.slots:
        for mb in slot:
            extra = (cost.fixed_cost(mb.size, empty=not mb.docs) + cost.per_document_cost * len(mb.docs) / mb.size
                     if fixed else 0.0)
            for q, (pairs, tokens) in zip(mb.positions, _counted_micro_batch(mb, plan.lengths, cost)):
                out[q] += cost.layers * (cost.pair_cost * pairs + cost.token_cost * tokens) + extra
    return out


def _ratio(values: Sequence[float]) -> float:
    total = sum(values)
    return max(values) * len(values) / total if total else 1.0


def mix_report(world: int, seq_len: int, rows: int, batches: int, seed: int, cost: CostModel = TINY_LLAMA) -> dict:
    """Part 1 (see the module docstring): per scheme, per step and over all steps (per-rank sums)."""
    if world % 2 or world < 2:
        raise ValueError(f"--world {world}: static DP = 2 x SP = world / 2 needs an even world")
    budget = seq_len // world
    schemes = {f"static_sp{world}": None, f"static_dp2_sp{world // 2}": None, "dynamic": None}
    per_step: list[dict] = []
    totals = {name: {"cost": [0.0] * world, "fixed": [0.0] * world, "bytes": [0] * world, "slots": 0, "peak_tokens": 0}
              for name in schemes}
    for b in range(batches):
        batch = long_tailed_rows(rows, seq_len, seed + b)
        lengths = [n for row in batch for n in row]
        plans = {
            f"static_sp{world}": static_plan(batch, world, world, cost=cost, pad_multiple=PAD),
            f"static_dp2_sp{world // 2}": static_plan(batch, world, world // 2, cost=cost, pad_multiple=PAD),
            "dynamic": plan_dynamic(lengths, world, budget, cost=cost, pad_multiple=PAD, spread_heavy=True),
        }
        step = {"batch": b, "documents": len(lengths), "longest": max(lengths)}
        for name, plan in plans.items():
            counted = counted_rank_costs(plan, cost)
            with_fixed = counted_rank_costs(plan, cost, fixed=True)
            t = totals[name]
            t["cost"] = [a + c for a, c in zip(t["cost"], counted)]
            t["fixed"] = [a + c for a, c in zip(t["fixed"], with_fixed)]
            t["bytes"] = [a + c for a, c in zip(t["bytes"], plan.rank_bytes)]
            t["slots"] += plan.num_slots
            t["peak_tokens"] = max(t["peak_tokens"], plan.peak_tokens_per_rank)
            step[name] = {"slots": plan.num_slots, "balance_counted": _ratio(counted),
                          "balance_planned": plan.balance, "bytes_max_per_rank": plan.bytes_max,
                          "cost_max_per_rank": max(counted), "peak_tokens_per_rank": plan.peak_tokens_per_rank,
                          "balance_counted_with_fixed": _ratio(with_fixed), "cost_max_per_rank_with_fixed": max(with_fixed)}
            if name == "dynamic":
                step[name]["slots_lower_bound"] = plan.slots_lower_bound
                step[name]["documents_per_size"] = plan.summary()["documents_per_size"]
        per_step.append(step)
    static_sp, static_dp = f"static_sp{world}", f"static_dp2_sp{world // 2}"
    overall = {name: {"slots": t["slots"], "balance_counted": _ratio(t["cost"]), "cost_max_per_rank": max(t["cost"]),
                      "balance_counted_with_fixed": _ratio(t["fixed"]),
                      "bytes_max_per_rank": max(t["bytes"]), "peak_tokens_per_rank": t["peak_tokens"]}
               for name, t in totals.items()}
    dyn = overall["dynamic"]
    return {
        "kind": "counted",
        "world": world, "seq_len": seq_len, "rows_per_batch": rows, "batches": batches, "seeds": [seed + b for b in range(batches)],
        "max_tokens_per_rank": budget,
        "lengths": {"distribution": "log-normal", "median": 1024, "sigma": 1.2, "clip": [64, seq_len],
                    "rows": "each row sums to seq_len: its last document takes what is left"},
        "cost_model": {"name": "the measured run's tiny Llama, forward FLOPs, with the CPU ranks' fixed terms",
                       **_cost_fields(cost)},
        "overall": overall,
        "bytes_ratio_static_sp_over_dynamic": overall[static_sp]["bytes_max_per_rank"] / max(dyn["bytes_max_per_rank"], 1),
        "bytes_ratio_worst_step": min(s[static_sp]["bytes_max_per_rank"] / max(s["dynamic"]["bytes_max_per_rank"], 1)
                                      for s in per_step),
        "work_ratio_counted_static_dp2_over_dynamic": overall[static_dp]["cost_max_per_rank"] / dyn["cost_max_per_rank"],
        # per step (what a step's max-over-ranks CPU time would compare): the busiest rank of each step
        "work_ratio_counted_per_step": [s[static_dp]["cost_max_per_rank"] / s["dynamic"]["cost_max_per_rank"]
                                        for s in per_step],
        # the same with every micro-batch's fixed cost (the calibrated CPU model: what thread CPU time follows)
        "work_ratio_counted_with_fixed": sum(s[static_dp]["cost_max_per_rank_with_fixed"] for s in per_step)
        / sum(s["dynamic"]["cost_max_per_rank_with_fixed"] for s in per_step),
        "per_step": per_step,
    }


def _cost_fields(cost: CostModel) -> dict[str, Any]:
    return {"causal": cost.causal, "window": cost.window, "chunk_size": cost.chunk_size, "pair_cost": cost.pair_cost,
            "token_cost": cost.token_cost, "kv_width": cost.kv_width, "elem_bytes": cost.elem_bytes,
            "acc_bytes": cost.acc_bytes, "layers": cost.layers, "micro_batch_cost": cost.micro_batch_cost,
            "ring_step_cost": cost.ring_step_cost, "per_document_cost": cost.per_document_cost,
            "ring_passes": RING_PASSES}


def modelled_step_seconds(plan: DynamicPlan, cost: CostModel, links: Links | None = None) -> dict[str, float]:
    """The modelled step time of a plan: each micro-batch takes, on each rank of its group,
    ``max(3 x work / flops, bytes / bandwidth) + 3 x fixed / flops`` (forward + backward = 3 forwards; the
    ring's transfers hidden behind compute where they can be; intra-node bandwidth for groups within
    ``links.node_size``, inter-node beyond); ``work`` the documents' forward cost, ``fixed`` the cost
    model's fixed terms (:meth:`CostModel.fixed_cost`; :func:`gpu_cost` sets ``ring_step_cost`` so that they
    come to ``3 (c - 1) layers x latency``). Two synchronisations:

    - ``slot_sync``: every slot waits for the pool's slowest rank (FSDP2 / ZeRO-3: their per-forward
      gathers span the pool): the sum over slots of the slowest micro-batch;
    - ``group_sync``: a group starts when all its ranks finished their previous slot (DDP, ZeRO-1/2:
      gradients reduced once per step): the longest chain through the slots.

    ``links``: default :class:`seqpar.config.Links` (H100-class figures).
    """
    links = links if links is not None else Links()
    finish = [0.0] * plan.pool_size
    slot_sum = 0.0
    for slot in plan.slots:
        slowest = 0.0
        for mb in slot:
            fixed = cost.fixed_cost(mb.size, empty=not mb.docs)
            if not mb.docs and not fixed:
                continue
            bw = (links.intra_gbps if mb.size <= links.node_size else links.inter_gbps) * 1e9
            t = max(3 * (mb.cost_per_rank - fixed) / links.flops, mb.bytes_per_rank / bw) + 3 * fixed / links.flops
            slowest = max(slowest, t)
            start = max(finish[q] for q in mb.positions)
            for q in mb.positions:
                finish[q] = start + t
        slot_sum += slowest
    return {"slot_sync": slot_sum, "group_sync": max(finish)}


def gpu_cost(cost: CostModel, links: Links) -> CostModel:
    """``cost`` with the modelled GPUs' fixed terms: a ring step costs ``links.latency_s`` per layer and pass
    of the backward-weighted step (``ring_step_cost = latency x flops / RING_PASSES``, so a micro-batch of ``c``
    ranks pays ``3 (c - 1) layers x latency`` in :func:`modelled_step_seconds`); no per-micro-batch term (the
    links model has none: launch overheads are not modelled)."""
    return dataclasses.replace(cost, micro_batch_cost=0.0, ring_step_cost=links.latency_s * links.flops / RING_PASSES)


POOL_MIXES = {
    # name: (lengths lo, hi, row length = static CP x budget, static CP, max_tokens_per_rank)
    "1k_16k": (1024, 16384, 16384, 4, 4096),
    "to_256k": (1024, 262144, 262144, 32, 8192),
}


def pool_case(pool: int, mix: str, seed: int, slots_per_group: int, cost: CostModel, links: Links) -> dict:
    """One modelled pool and mix (:data:`POOL_MIXES`) at one seed: the documents (about ``pool x budget x
    slots_per_group`` tokens, ``seed + pool`` draws them),
    the static plan and the two dynamic plans, their modelled step times and the speedup; ``skipped`` when the
    mix's static CP does not divide the pool. ``cost``: already :func:`gpu_cost`'s."""
    lo, hi, row_len, cp, budget = POOL_MIXES[mix]
    if cp > pool or pool % cp:
        return {"kind": "modelled", "pool": pool, "mix": mix, "skipped": f"static CP {cp} > pool {pool}"}
    lengths = log_uniform_documents(pool * budget * slots_per_group, seed + pool, lo=lo, hi=hi)
    rows = pack_rows(lengths, row_len)
    t0 = time.perf_counter()
    dyn = plan_dynamic(lengths, pool, budget, cost=cost, pad_multiple=PAD, spread_heavy=True)
    plan_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    dyn_slot = plan_dynamic(lengths, pool, budget, cost=cost, pad_multiple=PAD, spread_heavy=True, slot_sync=True)
    plan_slot_s = time.perf_counter() - t0
    static = static_plan(rows, pool, cp, cost=cost, pad_multiple=PAD)
    t_static = modelled_step_seconds(static, cost, links)
    t_group, t_slot = modelled_step_seconds(dyn, cost, links), modelled_step_seconds(dyn_slot, cost, links)
    # each engine's sync with the plan made for it (slot_sync for FSDP2 / ZeRO-3)
    t_dyn = {"slot_sync": t_slot["slot_sync"], "group_sync": t_group["group_sync"]}
    tokens = sum(lengths)
    return {
        "kind": "modelled", "pool": pool, "mix": mix, "seed": seed,
        "lengths": f"log-uniform [{lo}, {hi}], whole documents; static rows of {row_len}, next fit",
        "static_cp": cp, "max_tokens_per_rank": budget, "documents": len(lengths), "tokens": tokens,
        "planner_seconds": plan_s, "planner_seconds_slot_sync": plan_slot_s,
        "static": {"slots": static.num_slots, "balance": static.balance, "bytes_max_per_rank": static.bytes_max,
                   "step_s": t_static},
        "dynamic": {"slots": dyn.num_slots, "slots_lower_bound": dyn.slots_lower_bound, "balance": dyn.balance,
                    "fill_of_lower_bound": tokens / (pool * budget * dyn.slots_lower_bound),
                    "bytes_max_per_rank": dyn.bytes_max, "step_s": t_group,
                    "documents_per_size": dyn.summary()["documents_per_size"]},
        "dynamic_slot_sync": {"slots": dyn_slot.num_slots, "balance": dyn_slot.balance,
                              "bytes_max_per_rank": dyn_slot.bytes_max, "step_s": t_slot,
                              "slot_balance": slot_balance(dyn_slot),
                              "documents_per_size": dyn_slot.summary()["documents_per_size"]},
        "speedup": {k: t_static[k] / t_dyn[k] for k in t_dyn},
        "tokens_per_s": {"static": {k: tokens / v for k, v in t_static.items()},
                         "dynamic": {k: tokens / v for k, v in t_dyn.items()}},
    }


def slot_balance(plan: DynamicPlan) -> float:
    """The sum over slots of the busiest rank's planned cost over the sum of the slots' mean per rank (1: every
    slot's ranks even; what a slot-sync engine loses to imbalance)."""
    busiest = sum(max(mb.cost_per_rank for mb in slot) for slot in plan.slots)
    mean = sum(sum(mb.cost_per_rank * mb.size for mb in slot) for slot in plan.slots) / plan.pool_size
    return busiest / mean if mean else 1.0


def pool_report(pools: Sequence[int], slots_per_group: int, seed: int, cost: CostModel = QWEN3_30B_A3B,
                links: Links | None = None, seeds: int = 1) -> dict:
    """Part 2 (see the module docstring): per pool and mix, the same whole documents (about ``pool x
    budget x slots_per_group`` tokens) under static CP (packed into rows of ``cp x budget``, next fit) and
    dynamic CP, their modelled step times (:func:`modelled_step_seconds`) and the speedup. Dynamic plans with
    ``spread_heavy`` for each synchronisation: ``slot_sync=True`` for the slot-sync figure (FSDP2 / ZeRO-3),
    without it for the group-sync one. A mix whose static CP exceeds the pool is skipped. ``seeds > 1``: each
    case also reports the speedups of ``seeds`` batches (seeds ``seed, seed + 1, ...``) under ``by_seed``, and
    their least, median and most under ``speedup_over_seeds`` (one batch's figure is one draw of the mix)."""
    links = links if links is not None else Links()
    cost = gpu_cost(cost, links)
    out = []
    for pool in pools:
        for name in POOL_MIXES:
            case = pool_case(pool, name, seed, slots_per_group, cost, links)
            if seeds > 1 and "skipped" not in case:
                runs = [case] + [pool_case(pool, name, seed + k, slots_per_group, cost, links)
                               for k in range(1, seeds)]
                case["by_seed"] = [{"seed": r["seed"], "documents": r["documents"], "static_slots": r["static"]["slots"],
                                    "dynamic_slots": r["dynamic_slot_sync"]["slots"],
                                    "slot_balance": r["dynamic_slot_sync"]["slot_balance"], "speedup": r["speedup"]}
                                   for r in runs]
                case["speedup_over_seeds"] = {
                    k: {"least": min(v), "median": statistics.median(v), "most": max(v)}
                    for k in ("slot_sync", "group_sync") for v in [[r["speedup"][k] for r in runs]]}
            out.append(case)
    return {"kind": "modelled", "cost_model": {"name": "Qwen3-30B-A3B (hidden 2048, 48 layers, 32 q / 4 kv heads "
                                               "x 128, 8 active experts x 768), forward FLOPs; ring steps at the "
                                               "links' latency", **_cost_fields(cost)},
            "static_cp_model": ("the same whole documents packed into rows of static CP x budget in order (next fit, "
                                "the rest of a row padding), rows dealt to the pool / CP groups in order, each row's "
                                "cost split evenly over its group (balanced sharding), the same micro-batch time "
                                "model"),
            "links": {"intra_gbps": links.intra_gbps, "inter_gbps": links.inter_gbps, "flops": links.flops,
                      "node_size": links.node_size, "latency_s": links.latency_s},
            "anchors_measured_elsewhere": ANCHORS, "cases": out}


# ------------------------------------------------------------------------------------------ measured
def tiny_llama_model(hidden: int, layers: int, heads: int, seq_len: int) -> Any:
    """A tiny fp32 Llama (vocab 256, intermediate ``2 x hidden``), the same weights on every rank (seed 0)."""
    import torch
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                                   max_position_embeddings=seq_len, tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).float()


def random_documents(lengths: Sequence[int], seed: int) -> list[Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g) for n in lengths]


def scheme_plans(batch: list[list[int]], world: int, seq_len: int, cost: CostModel) -> dict[str, DynamicPlan]:
    """The schemes' plans of one global batch (packed rows): static SP = world (each row over the pool),
    static DP = 2 x SP = world / 2 (rows dealt to the two SP groups), ``dynamic`` at ``max_tokens_per_rank =
    seq_len / world`` (what static SP holds per rank) and ``dynamic_dp_budget`` at ``2 seq_len / world``
    (what static DP2 x SP holds per rank: the same-memory comparison for that scheme). All run through the same
    path: each is a plan whose micro-batches name their aligned group, and
    :func:`seqpar.sequence.batch.rank_micro_batches` cuts them."""
    lengths = [n for row in batch for n in row]
    return {f"static_sp{world}": static_plan(batch, world, world, cost=cost, pad_multiple=PAD),
            f"static_dp2_sp{world // 2}": static_plan(batch, world, world // 2, cost=cost, pad_multiple=PAD),
            "dynamic": plan_dynamic(lengths, world, seq_len // world, cost=cost, pad_multiple=PAD, spread_heavy=True),
            "dynamic_dp_budget": plan_dynamic(lengths, world, 2 * seq_len // world, cost=cost, pad_multiple=PAD,
                                              spread_heavy=True)}


def _measured_rank(ctx: Any, world: int, seq_len: int, rows: int, batches: int, seed: int, hidden: int,
                   layers: int, heads: int, memory: bool, fixed: tuple[float, float, float]) -> dict:
    """On each rank of the pool (SP = world, DP = 1; every aligned group of 1, 2, 4, ... ranks made once by
    the ``dynamic`` block): per global batch, the three schemes in turn, each step the forward + backward of
    this rank's micro-batches (``balanced`` sharding inside each group) and one sum of the gradients over the
    pool. Returns per scheme and step this rank's thread CPU and wall seconds (between barriers). First one
    untimed step per scheme on batch 0 (the warm-up), with ``memory`` under
    :class:`~seqpar.memory.tracker.TensorMemoryTracker` (5x slower than a plain step): the peak bytes of the tensors the
    step allocates (activations, gradients, ring buffers; not the parameters or the inputs)."""
    import torch
    import torch.distributed as dist

    import seqpar
    from seqpar.config import SeqParConfig
    from seqpar.memory.tracker import TensorMemoryTracker
    from seqpar.sequence.batch import rank_micro_batches
    from seqpar.sequence.dynamic_step import DynamicStep
    from seqpar.swap import swap_attention

    cost = tiny_llama_cost(hidden, layers, heads, micro_batch_cost=fixed[0], ring_step_cost=fixed[1],
                           per_document_cost=fixed[2])
    manager = seqpar.init_process_groups(sp_size=world, config={
        "sharding": "balanced", "dynamic": {"max_tokens_per_rank": seq_len // world, "min_size": 1}})
    try:
        model = tiny_llama_model(hidden, layers, heads, seq_len)
        swap_attention(model, SeqParConfig(size=world, sharding="balanced"))
        params = [p for p in model.parameters()]

        def step(ds: DynamicStep) -> list:
            losses = []
            for inputs in ds.micro_batches:
                loss = model(**inputs).loss
                loss.backward()
                losses.append(loss.detach())
            for p in params:  # reduced once per step over the pool (a sum: see rank_micro_batches)
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad, group=manager.sp_dp_group)
            for p in params:
                p.grad = None
            return losses

        def inputs_of(b: int) -> dict[str, DynamicStep]:
            # every scheme, the statics too, as a DynamicStep: a plan and this rank's micro-batches of it (what
            # seqpar.sequence.dynamic_step.plan_step builds; the bench's own plans, so not plan_step itself)
            batch = long_tailed_rows(rows, seq_len, seed + b)
            docs = random_documents([n for row in batch for n in row], seed + b)
            return {name: DynamicStep(plan, rank_micro_batches(plan, docs, manager, sharding="balanced"), manager)
                    for name, plan in scheme_plans(batch, world, seq_len, cost).items()}

        out: dict[str, Any] = {"peak_bytes": {}, "cpu_s": {}, "process_cpu_s": {}, "wall_s": {}, "slots": {},
                               "loss": {}}
        for name, ds in inputs_of(0).items():  # warm-up (first calls build caches), untimed
            dist.barrier()
            if not memory:
                step(ds)
                continue
            tracker = TensorMemoryTracker("cpu", count_existing=False)  # MemTracker refuses a module run twice
            with tracker:
                step(ds)
            out["peak_bytes"][name] = tracker.peak
        for b in range(batches):
            for name, ds in inputs_of(b).items():  # interleaved: drifting load hits every scheme alike
                dist.barrier()
                t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
                losses = step(ds)
                out["cpu_s"].setdefault(name, []).append(time.thread_time() - c0)
                out["process_cpu_s"].setdefault(name, []).append(time.process_time() - p0)
                out["wall_s"].setdefault(name, []).append(time.perf_counter() - t0)
                out["slots"].setdefault(name, []).append(len(ds.micro_batches))
                # the step's per-token mean loss (a collective, after the timing): the same documents and
                # weights in every scheme, so the schemes must agree
                out["loss"].setdefault(name, []).append(float(ds.loss(losses)))
        return out
    finally:
        seqpar.destroy_process_groups(manager)


def measured_report(world: int, seq_len: int, rows: int, batches: int, seed: int, *, hidden: int, layers: int,
                    heads: int, memory: bool = True, pools: Any = None, timeout: float = 3600.0,
                    fixed: tuple[float, float, float] = (TINY_LLAMA_MICRO_BATCH_COST, TINY_LLAMA_RING_STEP_COST,
                                                         TINY_LLAMA_PER_DOCUMENT_COST)) -> dict:
    """The measured part (see the module docstring): the three schemes run at ``world`` gloo ranks, the dynamic
    plans made with the cost model's terms ``fixed`` (``micro_batch_cost``, ``ring_step_cost``,
    ``per_document_cost``)."""
    from seqpar.bench.runner import suite_pools

    cost = tiny_llama_cost(hidden, layers, heads, micro_batch_cost=fixed[0], ring_step_cost=fixed[1],
                           per_document_cost=fixed[2])
    with suite_pools("cpu", pools) as ps:
        per_rank = ps.run(world, _measured_rank, world, seq_len, rows, batches, seed, hidden, layers, heads, memory,
                          fixed, timeout=timeout)
    tokens = rows * seq_len
    schemes: dict[str, Any] = {}
    for name in per_rank[0]["cpu_s"]:
        cpu = [max(r["cpu_s"][name][b] for r in per_rank) for b in range(batches)]
        proc = [max(r["process_cpu_s"][name][b] for r in per_rank) for b in range(batches)]
        wall = [max(r["wall_s"][name][b] for r in per_rank) for b in range(batches)]
        bytes_max, counted, modelled = [], [], []
        for b in range(batches):
            plan = scheme_plans(long_tailed_rows(rows, seq_len, seed + b), world, seq_len, cost)[name]
            bytes_max.append(plan.bytes_max)
            counted.append(_ratio(counted_rank_costs(plan, cost)))
            modelled.append(max(counted_rank_costs(plan, cost, fixed=True)))
        schemes[name] = {
            "cpu_s_max_over_ranks_per_step": cpu, "cpu_s_max_over_ranks_total": sum(cpu),
            "cpu_s_per_rank_total": [sum(r["cpu_s"][name]) for r in per_rank],
            "process_cpu_s_max_over_ranks_per_step": proc, "process_cpu_s_max_over_ranks_total": sum(proc),
            "slots_per_step": per_rank[0]["slots"][name],
            "wall_s_slowest_rank_per_step": wall, "tokens_per_s": tokens * batches / sum(wall),
            "bytes_max_per_rank_counted_per_step": bytes_max, "balance_counted_per_step": counted,
            "cost_max_per_rank_with_fixed_per_step": modelled,
            "step_loss_per_step": per_rank[0]["loss"][name],
        }
        if memory:
            schemes[name]["peak_bytes_max_over_ranks"] = max(r["peak_bytes"][name] for r in per_rank)
            schemes[name]["peak_bytes_per_rank"] = [r["peak_bytes"][name] for r in per_rank]
    static_dp = f"static_dp2_sp{world // 2}"
    dyn = schemes["dynamic"]
    losses = [[s["step_loss_per_step"][b] for s in schemes.values()] for b in range(batches)]
    return {
        "kind": "measured", "world": world, "seq_len": seq_len, "rows_per_batch": rows, "batches": batches,
        "seeds": [seed + b for b in range(batches)],
        "cost_model": _cost_fields(cost),
        "model": {"name": "tiny Llama, fp32", "hidden": hidden, "intermediate": 2 * hidden, "layers": layers,
                  "heads": heads, "vocab": 256},
        "how": ("gloo ranks, one intra-op thread each; SP = world with every aligned group made once (the dynamic "
                "block); every scheme runs as a plan through rank_micro_batches (balanced sharding inside each "
                "group), forward + backward of each micro-batch, then one all-reduce (sum) of the gradients over "
                "the pool; per step: each rank's time.thread_time() and wall time between barriers; the three "
                "schemes interleaved batch by batch"),
        "schemes": schemes,
        # every scheme ran the same documents through the same weights: their step losses agree (fp32 sums)
        "step_loss_max_rel_diff": max(((max(ls) - min(ls)) / abs(min(ls)) for ls in losses), default=0.0),
        "work_ratio_measured_static_dp2_over_dynamic": schemes[static_dp]["cpu_s_max_over_ranks_total"]
        / dyn["cpu_s_max_over_ranks_total"],
        "work_ratio_measured_per_step": [a / b for a, b in zip(schemes[static_dp]["cpu_s_max_over_ranks_per_step"],
                                                                dyn["cpu_s_max_over_ranks_per_step"])],
        "work_ratio_process_cpu_static_dp2_over_dynamic": schemes[static_dp]["process_cpu_s_max_over_ranks_total"]
        / dyn["process_cpu_s_max_over_ranks_total"],
        # at the memory static DP2 x SP holds (2 seq_len / world tokens per rank)
        "work_ratio_measured_static_dp2_over_dynamic_dp_budget": schemes[static_dp]["cpu_s_max_over_ranks_total"]
        / schemes["dynamic_dp_budget"]["cpu_s_max_over_ranks_total"],
        "work_ratio_measured_per_step_dp_budget": [
            a / b for a, b in zip(schemes[static_dp]["cpu_s_max_over_ranks_per_step"],
                                  schemes["dynamic_dp_budget"]["cpu_s_max_over_ranks_per_step"])],
        # what the calibrated cost model predicts for the same ratios (counted FLOPs plus fixed terms)
        "work_ratio_modelled_static_dp2_over_dynamic": sum(schemes[static_dp]["cost_max_per_rank_with_fixed_per_step"])
        / sum(dyn["cost_max_per_rank_with_fixed_per_step"]),
        "work_ratio_modelled_static_dp2_over_dynamic_dp_budget":
        sum(schemes[static_dp]["cost_max_per_rank_with_fixed_per_step"])
        / sum(schemes["dynamic_dp_budget"]["cost_max_per_rank_with_fixed_per_step"]),
        "bytes_ratio_static_sp_over_dynamic": sum(schemes[f"static_sp{world}"]["bytes_max_per_rank_counted_per_step"])
        / max(sum(dyn["bytes_max_per_rank_counted_per_step"]), 1),
    }


def distinct_lengths(count: int, tokens: int) -> list[int]:
    """``count`` documents of distinct lengths (consecutive integers around ``tokens / count``) summing to
    ``tokens``. The calibration's many-document cases use them: documents of one length are stacked into one
    kernel call (:data:`seqpar.attn.common.BATCH_PIECE_ROWS`), so ``32 x 128`` costs a third of 32 documents
    of distinct lengths near 128 on the CPU, and the mix's documents (log-normal lengths) are all but distinct."""
    base = tokens // count
    out = [base + i - count // 2 for i in range(count)]
    out[-1] += tokens - sum(out)
    if len(set(out)) != count or min(out) < 1:
        raise ValueError(f"distinct_lengths: {count} distinct lengths do not make {tokens} tokens")
    return out


# (name, packed rows, SP size): one micro-batch per rank, the same on every rank (static_plan over 4 ranks). The
# cases tell the four terms apart: FLOPs (1 to 16384 tokens per micro-batch), micro-batches (every case one),
# ring steps (groups of 1, 2 and 4) and documents (1 to 64 per micro-batch, of distinct lengths, at each size).
CALIBRATION = (
    ("1 rank, 1 x 1024", [[1024]] * 4, 1), ("1 rank, 1 x 4096", [[4096]] * 4, 1),
    ("1 rank, 4 x ~1024", [distinct_lengths(4, 4096)] * 4, 1),
    ("1 rank, 32 x ~128", [distinct_lengths(32, 4096)] * 4, 1),
    ("2 ranks, 1 x 2048", [[2048]] * 2, 2), ("2 ranks, 1 x 8192", [[8192]] * 2, 2),
    ("2 ranks, 32 x ~256", [distinct_lengths(32, 8192)] * 2, 2),
    ("4 ranks, 1 x 4096", [[4096]], 4), ("4 ranks, 1 x 16384", [[16384]], 4),
    ("4 ranks, 64 x ~256", [distinct_lengths(64, 16384)], 4),
)


def _calibrate_rank(ctx: Any, hidden: int, layers: int, heads: int, repeats: int) -> dict[str, float]:
    """At 4 ranks: each :data:`CALIBRATION` case's forward + backward, this rank's thread CPU seconds (median of
    ``repeats`` after one warm-up): what a micro-batch, a ring step and a visible pair cost on this machine."""
    import statistics

    import torch.distributed as dist

    import seqpar
    from seqpar.config import SeqParConfig
    from seqpar.sequence.batch import rank_micro_batches
    from seqpar.swap import swap_attention

    manager = seqpar.init_process_groups(sp_size=4, config={
        "sharding": "balanced", "dynamic": {"max_tokens_per_rank": 4096, "min_size": 1}})
    try:
        model = tiny_llama_model(hidden, layers, heads, 16384)
        swap_attention(model, SeqParConfig(size=4, sharding="balanced"))
        out = {}
        for name, rows, sp in CALIBRATION:
            plan = static_plan(rows, 4, sp, cost=tiny_llama_cost(hidden, layers, heads), pad_multiple=PAD)
            micro = rank_micro_batches(plan, random_documents(plan.lengths, 0), manager, sharding="balanced")
            times = []
            for _ in range(repeats + 1):
                dist.barrier()
                c0 = time.thread_time()
                for inputs in micro:
                    model(**inputs).loss.backward()
                times.append(time.thread_time() - c0)
                model.zero_grad(set_to_none=True)
            out[name] = statistics.median(times[1:])
        return out
    finally:
        seqpar.destroy_process_groups(manager)


def calibration_report(hidden: int, layers: int, heads: int, repeats: int = 2, pools: Any = None) -> dict:
    """``--calibrate``: what one micro-batch costs in thread CPU against its counted cost, at 4 gloo ranks, for
    the shapes that tell a micro-batch's fixed cost, a ring step's, a document's and a visible pair's apart."""
    from seqpar.bench.runner import suite_pools

    cost = tiny_llama_cost(hidden, layers, heads, micro_batch_cost=0.0, ring_step_cost=0.0)
    with suite_pools("cpu", pools) as ps:
        per_rank = ps.run(4, _calibrate_rank, hidden, layers, heads, repeats, timeout=3600.0)
    cases, samples = [], []
    for name, rows, sp in CALIBRATION:
        plan = static_plan(rows, 4, sp, cost=cost, pad_multiple=PAD)
        counted = max(counted_rank_costs(plan, cost))
        cpu = max(r[name] for r in per_rank)
        documents = len(rows[0]) / sp  # per rank, as the planner splits a micro-batch's documents
        cases.append({"case": name, "group": sp, "tokens_per_rank": plan.peak_tokens_per_rank,
                      "counted_gflop": counted / 1e9, "ring_steps": cost.ring_steps(sp),
                      "documents_per_rank": documents, "cpu_s_max_over_ranks": cpu, "s_per_gflop": cpu * 1e9 / counted})
        samples.append((counted, 1, cost.ring_steps(sp), documents, cpu))
    fit = fit_cost_terms(samples)
    for case, (work, mbs, steps, docs, _) in zip(cases, samples):
        case["fitted_s"] = (fit["seconds_per_unit"] * work + fit["micro_batch_s"] * mbs + fit["ring_step_s"] * steps
                            + fit["per_document_s"] * docs)
    return {"kind": "measured", "what": "one micro-batch (forward + backward) per rank, thread CPU, median of "
            f"{repeats} after a warm-up, max over 4 ranks", "cases": cases,
            "fit": {"model": "cpu_s = seconds_per_unit x counted forward FLOPs + micro_batch_s x micro-batches + "
                    f"ring_step_s x ring steps ({RING_PASSES} x layers x (c - 1)) + per_document_s x documents per "
                    "rank (a micro-batch's documents / c); least squares over the cases",
                    **fit}}


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
