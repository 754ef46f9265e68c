"""The measured part of ``python -m seqpar.bench dynamic`` (see :mod:`seqpar.bench.dynamic`, part 2) and its
``--calibrate`` step: the schemes run at P gloo ranks through a swapped tiny Llama, and single micro-batches timed to
fit the cost model's fixed terms.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

from seqpar.bench.dynamic_mix import (
    PAD,
    TINY_LLAMA_MICRO_BATCH_COST,
    TINY_LLAMA_PER_DOCUMENT_COST,
    TINY_LLAMA_RING_STEP_COST,
    cost_fields,
    counted_rank_costs,
    long_tailed_rows,
    max_over_mean,
    tiny_llama_cost,
)
from seqpar.sequence.dynamic import (
    RING_PASSES,
    CostModel,
    DynamicPlan,
    fit_cost_terms,
    plan_dynamic,
    static_plan,
)


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
            counted.append(max_over_mean(counted_rank_costs(plan, cost)))
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
        "cost_model": cost_fields(cost),
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
