"""The counted and modelled parts of ``python -m seqpar.bench dynamic`` (see :mod:`seqpar.bench.dynamic`).

Part 1 (``mix``, counted): the long-tailed mix's batches planned as static SP, static DP2 x SP and dynamic CP,
each rank's visible pairs counted by the attention planner. Part 3 (``pools``, modelled): the planner alone on
modelled pools against static CP. Also the cost models both parts and the measured part share.
"""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
import time
from collections.abc import Sequence
from typing import Any

from seqpar.attn.common import AttentionOptions, block_calls
from seqpar.attn.masks import visible_pair_count
from seqpar.config import Links
from seqpar.sequence.dynamic import (
    RING_PASSES,
    CostModel,
    DynamicPlan,
    MicroBatch,
    plan_dynamic,
    static_plan,
)

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


def max_over_mean(values: Sequence[float]) -> float:
    """The busiest rank over the mean (1.0: balanced; 1.0 for all zeros)."""
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
            step[name] = {"slots": plan.num_slots, "balance_counted": max_over_mean(counted),
                          "balance_planned": plan.balance, "bytes_max_per_rank": plan.bytes_max,
                          "cost_max_per_rank": max(counted), "peak_tokens_per_rank": plan.peak_tokens_per_rank,
                          "balance_counted_with_fixed": max_over_mean(with_fixed), "cost_max_per_rank_with_fixed": max(with_fixed)}
            if name == "dynamic":
                step[name]["slots_lower_bound"] = plan.slots_lower_bound
                step[name]["documents_per_size"] = plan.summary()["documents_per_size"]
        per_step.append(step)
    static_sp, static_dp = f"static_sp{world}", f"static_dp2_sp{world // 2}"
    overall = {name: {"slots": t["slots"], "balance_counted": max_over_mean(t["cost"]), "cost_max_per_rank": max(t["cost"]),
                      "balance_counted_with_fixed": max_over_mean(t["fixed"]),
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
                       **cost_fields(cost)},
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


def cost_fields(cost: CostModel) -> dict[str, Any]:
    """The cost model's terms as written into the JSON (``cost_model``)."""
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
                                               "links' latency", **cost_fields(cost)},
            "static_cp_model": ("the same whole documents packed into rows of static CP x budget in order (next fit, "
                                "the rest of a row padding), rows dealt to the pool / CP groups in order, each row's "
                                "cost split evenly over its group (balanced sharding), the same micro-batch time "
                                "model"),
            "links": {"intra_gbps": links.intra_gbps, "inter_gbps": links.inter_gbps, "flops": links.flops,
                      "node_size": links.node_size, "latency_s": links.latency_s},
            "anchors_measured_elsewhere": ANCHORS, "cases": out}
