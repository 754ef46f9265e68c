"""Length-aware dynamic CP against static SP, planned and counted (issue 32 §6, the planner part).

``python -m seqpar.bench dynamic --world 4 --out DIR`` writes ``DIR/dynamic.json``. Nothing here runs
a model: every figure is **counted** (from the plans, with the attention planner counting each rank's
visible pairs) or **modelled** (a cost and link model); the measured parts of issue 32's benchmark
(each rank's thread CPU time, tokens/s, peak memory with real ranks) are pending until the planned
micro-batches run through models and engines.

1. ``mix``: the long-tailed mix, ``--batches`` global batches (fixed seeds) of ``--rows`` packed rows of
   ``--seq-len`` tokens, document lengths log-normal (median 1024, sigma 1.2) clipped to
   ``[64, seq_len]``, the last document of a row taking what is left (as ``train.packed`` does). The
   same batches under static SP = P (each row cut over the whole pool, ``balanced`` sharding), static
   DP = 2 x SP = P/2 (rows dealt to the two SP groups) and dynamic (``max_tokens_per_rank = seq_len /
   P``, what static SP holds): per-rank cost max / mean (visible pairs counted by the attention planner
   on each rank's ``balanced`` shard, plus the linear terms), bytes per rank (max; the dense ring's
   volume, :func:`seqpar.sequence.dynamic.ring_bytes_per_rank`), slots and peak tokens per rank.
2. ``pools``: the planner alone on modelled pools of 64 and 512 GPUs for the anchors' mixes (lengths
   1K-16K at 4096 tokens per rank against static CP 4, verl's Qwen3-30B-A3B SFT set-up; lengths up to
   256K at 8192 tokens per rank against static CP 32), reporting the modelled step time against static
   CP beside Megatron-Core's 1.48x and verl's 1.61x (which are measured, on GPUs).
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time
from collections.abc import Sequence
from typing import Any

from seqpar.attn.common import AttentionOptions, block_calls
from seqpar.attn.masks import visible_pair_count
from seqpar.bench.report import format_table, machine_info, write_json
from seqpar.config import Links
from seqpar.sequence.dynamic import CostModel, DynamicPlan, MicroBatch, plan_dynamic, static_plan

__all__ = ["long_tailed_rows", "log_uniform_documents", "pack_rows", "counted_rank_costs", "mix_report", "modelled_step_seconds",
           "pool_report", "run", "main", "ANCHORS", "TINY_LLAMA", "QWEN3_30B_A3B"]

PAD = 8  # balanced sharding pads a group's micro-batch to a multiple of 8 x its size (its finest layout)

# the 4-rank CPU run's model (a tiny Llama, the size the training tests use): its counted cost
TINY_LLAMA = CostModel.transformer(256, 688, q_heads=4, kv_heads=4, layers=2, elem_bytes=4)
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


def counted_rank_costs(plan: DynamicPlan, cost: CostModel) -> list[float]:
    """Each pool position's cost over the step, its visible pairs counted by the attention planner
    (not the planner's even split): ``layers * (pair_cost * pairs + token_cost * tokens)``."""
    out = [0.0] * plan.pool_size
    for slot in plan.slots:
        for mb in slot:
            for q, (pairs, tokens) in zip(mb.positions, _counted_micro_batch(mb, plan.lengths, cost)):
                out[q] += cost.layers * (cost.pair_cost * pairs + cost.token_cost * tokens)
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
    totals = {name: {"cost": [0.0] * world, "bytes": [0] * world, "slots": 0, "peak_tokens": 0} for name in schemes}
    for b in range(batches):
        batch = long_tailed_rows(rows, seq_len, seed + b)
        lengths = [n for row in batch for n in row]
        plans = {
            f"static_sp{world}": static_plan(batch, world, world, cost=cost, pad_multiple=PAD),
            f"static_dp2_sp{world // 2}": static_plan(batch, world, world // 2, cost=cost, pad_multiple=PAD),
            "dynamic": plan_dynamic(lengths, world, budget, cost=cost, pad_multiple=PAD),
        }
        step = {"batch": b, "documents": len(lengths), "longest": max(lengths)}
        for name, plan in plans.items():
            counted = counted_rank_costs(plan, cost)
            t = totals[name]
            t["cost"] = [a + c for a, c in zip(t["cost"], counted)]
            t["bytes"] = [a + c for a, c in zip(t["bytes"], plan.rank_bytes)]
            t["slots"] += plan.num_slots
            t["peak_tokens"] = max(t["peak_tokens"], plan.peak_tokens_per_rank)
            step[name] = {"slots": plan.num_slots, "balance_counted": _ratio(counted),
                          "balance_planned": plan.balance, "bytes_max_per_rank": plan.bytes_max,
                          "cost_max_per_rank": max(counted), "peak_tokens_per_rank": plan.peak_tokens_per_rank}
            if name == "dynamic":
                step[name]["slots_lower_bound"] = plan.slots_lower_bound
                step[name]["documents_per_size"] = plan.summary()["documents_per_size"]
        per_step.append(step)
    static_sp, static_dp = f"static_sp{world}", f"static_dp2_sp{world // 2}"
    overall = {name: {"slots": t["slots"], "balance_counted": _ratio(t["cost"]), "cost_max_per_rank": max(t["cost"]),
                      "bytes_max_per_rank": max(t["bytes"]), "peak_tokens_per_rank": t["peak_tokens"]}
               for name, t in totals.items()}
    dyn = overall["dynamic"]
    return {
        "kind": "counted",
        "world": world, "seq_len": seq_len, "rows_per_batch": rows, "batches": batches, "seeds": [seed + b for b in range(batches)],
        "max_tokens_per_rank": budget,
        "lengths": {"distribution": "log-normal", "median": 1024, "sigma": 1.2, "clip": [64, seq_len],
                    "rows": "each row sums to seq_len: its last document takes what is left"},
        "cost_model": {"name": "tiny Llama (hidden 256, intermediate 688, 4 heads, 2 layers), forward FLOPs",
                       **_cost_fields(cost)},
        "overall": overall,
        "bytes_ratio_static_sp_over_dynamic": overall[static_sp]["bytes_max_per_rank"] / max(dyn["bytes_max_per_rank"], 1),
        "bytes_ratio_worst_step": min(s[static_sp]["bytes_max_per_rank"] / max(s["dynamic"]["bytes_max_per_rank"], 1)
                                      for s in per_step),
        "work_ratio_counted_static_dp2_over_dynamic": overall[static_dp]["cost_max_per_rank"] / dyn["cost_max_per_rank"],
        # per step (what a step's max-over-ranks CPU time would compare): the busiest rank of each step
        "work_ratio_counted_per_step": [s[static_dp]["cost_max_per_rank"] / s["dynamic"]["cost_max_per_rank"]
                                        for s in per_step],
        "per_step": per_step,
    }


def _cost_fields(cost: CostModel) -> dict[str, Any]:
    return {"causal": cost.causal, "window": cost.window, "chunk_size": cost.chunk_size, "pair_cost": cost.pair_cost,
            "token_cost": cost.token_cost, "kv_width": cost.kv_width, "elem_bytes": cost.elem_bytes,
            "acc_bytes": cost.acc_bytes, "layers": cost.layers}


def modelled_step_seconds(plan: DynamicPlan, cost: CostModel, links: Links | None = None) -> dict[str, float]:
    """The modelled step time of a plan: each micro-batch takes, on each rank of its group,
    ``max(3 x forward cost / flops, bytes / bandwidth) + 3 (c - 1) layers x latency`` (forward +
    backward = 3 forwards; the ring's transfers hidden behind compute where they can be; intra-node
    bandwidth for groups within ``links.node_size``, inter-node beyond). Two synchronisations:

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
            if not mb.docs:
                continue
            bw = (links.intra_gbps if mb.size <= links.node_size else links.inter_gbps) * 1e9
            t = max(3 * mb.cost_per_rank / links.flops, mb.bytes_per_rank / bw)
            t += 3 * (mb.size - 1) * cost.layers * links.latency_s
            slowest = max(slowest, t)
            start = max(finish[q] for q in mb.positions)
            for q in mb.positions:
                finish[q] = start + t
        slot_sum += slowest
    return {"slot_sync": slot_sum, "group_sync": max(finish)}


POOL_MIXES = {
    # name: (lengths lo, hi, row length = static CP x budget, static CP, max_tokens_per_rank)
    "1k_16k": (1024, 16384, 16384, 4, 4096),
    "to_256k": (1024, 262144, 262144, 32, 8192),
}


def pool_report(pools: Sequence[int], slots_per_group: int, seed: int, cost: CostModel = QWEN3_30B_A3B,
                links: Links | None = None) -> dict:
    """Part 2 (see the module docstring): per pool and mix, the same whole documents (about ``pool x
    budget x slots_per_group`` tokens) under static CP (packed into rows of ``cp x budget``, next fit) and
    dynamic CP, their modelled step times (:func:`modelled_step_seconds`) and the speedup. A mix whose
    static CP exceeds the pool is skipped."""
    links = links if links is not None else Links()
    out = []
    for pool in pools:
        for name, (lo, hi, row_len, cp, budget) in POOL_MIXES.items():
            if cp > pool or pool % cp:
                out.append({"kind": "modelled", "pool": pool, "mix": name, "skipped": f"static CP {cp} > pool {pool}"})
                continue
            lengths = log_uniform_documents(pool * budget * slots_per_group, seed + pool, lo=lo, hi=hi)
            rows = pack_rows(lengths, row_len)
            t0 = time.perf_counter()
            dyn = plan_dynamic(lengths, pool, budget, cost=cost, pad_multiple=PAD)
            plan_s = time.perf_counter() - t0
            static = static_plan(rows, pool, cp, cost=cost, pad_multiple=PAD)
            t_dyn, t_static = modelled_step_seconds(dyn, cost, links), modelled_step_seconds(static, cost, links)
            tokens = sum(lengths)
            out.append({
                "kind": "modelled", "pool": pool, "mix": name,
                "lengths": f"log-uniform [{lo}, {hi}], whole documents; static rows of {row_len}, next fit",
                "static_cp": cp, "max_tokens_per_rank": budget, "documents": len(lengths), "tokens": tokens,
                "planner_seconds": plan_s,
                "static": {"slots": static.num_slots, "balance": static.balance, "bytes_max_per_rank": static.bytes_max,
                           "step_s": t_static},
                "dynamic": {"slots": dyn.num_slots, "slots_lower_bound": dyn.slots_lower_bound, "balance": dyn.balance,
                            "bytes_max_per_rank": dyn.bytes_max, "step_s": t_dyn,
                            "documents_per_size": dyn.summary()["documents_per_size"]},
                "speedup": {k: t_static[k] / t_dyn[k] for k in t_dyn},
                "tokens_per_s": {"static": {k: tokens / v for k, v in t_static.items()},
                                 "dynamic": {k: tokens / v for k, v in t_dyn.items()}},
            })
    return {"kind": "modelled", "cost_model": {"name": "Qwen3-30B-A3B (hidden 2048, 48 layers, 32 q / 4 kv heads "
                                               "x 128, 8 active experts x 768), forward FLOPs", **_cost_fields(cost)},
            "links": {"intra_gbps": links.intra_gbps, "inter_gbps": links.inter_gbps, "flops": links.flops,
                      "node_size": links.node_size, "latency_s": links.latency_s},
            "anchors_measured_elsewhere": ANCHORS, "cases": out}


PENDING = ("measured parts pending (issue 32): each rank's thread CPU time (max over ranks), tokens/s and peak "
           "memory with real ranks need the planned micro-batches to run through models and engines")


def run(args: argparse.Namespace) -> dict:
    t0 = time.perf_counter()
    mix = mix_report(args.world, args.seq_len, args.rows, args.batches, args.seed)
    pools = pool_report(args.pools, args.slots_per_group, args.seed)
    return {"suite": "dynamic", "command": " ".join(["python -m seqpar.bench dynamic", *(args.argv or sys.argv[2:])]),
            "figures": "counted (mix) and modelled (pools); nothing measured", "pending": PENDING,
            "machine": machine_info(), "wall_s": time.perf_counter() - t0, "mix": mix, "pools": pools}


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
            + ", ".join(f"{r:.2f}" for r in mix["work_ratio_counted_per_step"])]
    rows = [{"pool": c["pool"], "mix": c["mix"], "cp": c["static_cp"], "s_slots": c["static"]["slots"],
             "d_slots": c["dynamic"]["slots"], "slot": c["speedup"]["slot_sync"], "group": c["speedup"]["group_sync"]}
            for c in payload["pools"]["cases"] if "skipped" not in c]
    text += ["", "modelled pools, step time static CP / dynamic (Megatron 1.48x and verl 1.61x are measured elsewhere):",
             format_table(rows, [("pool", "pool"), ("mix", "mix"), ("static CP", "cp"), ("static slots", "s_slots"),
                                 ("dynamic slots", "d_slots"), ("speedup slot-sync", "slot"),
                                 ("speedup group-sync", "group")]),
             "", payload["pending"]]
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
    p.add_argument("--out", metavar="DIR", help="write DIR/dynamic.json")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = None if argv is None else list(argv)
    payload = run(args)
    if args.out:
        path = os.path.join(args.out, "dynamic.json")
        write_json(path, payload)
    print(render(payload), flush=True)
    if args.out:
        print(f"wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
