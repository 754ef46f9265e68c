"""Where the calibration's micro-batch spends its thread CPU (BENCHMARKS.md, "Where the fixed costs went").

    PYTHONPATH=bench/scripts python -m calibration_attribution WORLD REPEATS   # e.g. 4 5

At WORLD gloo ranks (2 or 4), the tiny Llama of ``python -m seqpar.bench dynamic --calibrate`` runs the
calibration's micro-batches (1 x 1024 on one rank; the same 1024 tokens per rank in a ring of 2 and, at 4,
of 4) through ``rank_micro_batches``, forward + backward, with seqpar's functions wrapped to add up their
*exclusive* thread CPU (a wrapped callee's time is subtracted from its wrapped caller). Prints rank 0's
totals and each part's median over REPEATS (after one warm-up). ``HC=n`` in the environment sets
``seqpar.attn.checks.AUTO_HEAD_CHUNKS`` on every rank (what the CPU's ``head_chunks="auto"`` may choose).
A measuring script, not part of the package: it patches module attributes of the ranks it starts.
"""
from __future__ import annotations

import functools
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from seqpar.testing.ranks import RankPool


def _instrument(acc: dict[str, float]) -> Callable[[Any, str, str], None]:
    """Wrap seqpar's parts (module attributes, looked up where they are called) to add their exclusive
    thread CPU into ``acc``; returns the wrapper for more."""
    import seqpar.attn.common as common
    import seqpar.attn.dispatch as dispatch
    import seqpar.attn.resolve as resolve
    import seqpar.attn.ring as ring
    import seqpar.comm.ring as cring
    import seqpar.kernels.merge as merge
    import seqpar.swap.options as options

    stack: list[float] = []

    def wrap(owner: Any, name: str, label: str) -> None:
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.thread_time()
            stack.append(0.0)
            try:
                return fn(*a, **k)
            finally:
                dt = time.thread_time() - t0
                child = stack.pop()
                acc[label] = acc.get(label, 0.0) + dt - child
                if stack:
                    stack[-1] += dt

        setattr(owner, name, timed)

    wrap(common, "block_forward", "kernels: block_forward (SDPA fwd)")
    wrap(common, "block_backward", "kernels: block_backward (SDPA bwd)")
    wrap(merge.Partials, "add", "merge: Partials.add / merge_into")
    wrap(common, "block_calls", "plan: block_calls (cached)")
    wrap(cring.RingComm, "exchange", "comm: RingComm.exchange (post)")
    wrap(cring.Pending, "wait", "comm: Pending.wait")
    wrap(cring.RingComm, "__init__", "comm: RingComm() per call")
    wrap(resolve, "resolve_attention", "resolve_attention (checks, plan)")
    wrap(dispatch, "resolve_attention", "resolve_attention (checks, plan)")
    wrap(ring, "ring_attention_forward", "ring fwd: rest (loops, allocs)")
    wrap(ring, "ring_attention_backward", "ring bwd: rest (loops, allocs, zero fills, adds)")
    wrap(options.SwapOptions, "attention", "swap attention call path (options, dispatch)")
    return wrap


def work(ctx: Any, world: int, reps: int) -> dict[str, Any]:
    """One rank: every case's micro-batch ``reps`` times after a warm-up; totals and parts per repeat."""
    import os

    import torch.distributed as dist

    import seqpar
    from seqpar.bench.dynamic import (
        PAD,
        random_documents,
        static_plan,
        tiny_llama_cost,
        tiny_llama_model,
    )
    from seqpar.config import SeqParConfig
    from seqpar.sequence.batch import rank_micro_batches
    from seqpar.swap import swap_attention

    if os.environ.get("HC"):
        import seqpar.attn.checks as checks

        checks.AUTO_HEAD_CHUNKS = int(os.environ["HC"])
    cases = [("1 rank, 1 x 1024", [[1024]] * world, 1)]
    cases += [(f"{s} ranks, 1 x {1024 * s}", [[1024 * s]] * (world // s), s) for s in (2, 4) if s <= world]
    manager = seqpar.init_process_groups(sp_size=world, config={
        "sharding": "balanced", "dynamic": {"max_tokens_per_rank": 4096, "min_size": 1}})
    try:
        model = tiny_llama_model(64, 2, 4, 16384)
        swap_attention(model, SeqParConfig(size=world, sharding="balanced"))
        acc: dict[str, float] = {}
        wrap = _instrument(acc)

        class Box:
            pre_hook: Any

        for key, hook in list(model._forward_pre_hooks.items()):  # the swapped model's batch pre-hook
            if getattr(hook, "__name__", "") == "pre_hook":
                box = Box()
                box.pre_hook = hook
                wrap(box, "pre_hook", "swapped model pre-hook (prepare, agree)")
                model._forward_pre_hooks[key] = box.pre_hook
        out = {}
        for name, rows, sp in cases:
            plan = static_plan(rows, world, sp, cost=tiny_llama_cost(64, 2, 4), pad_multiple=PAD)
            docs = random_documents(plan.lengths, 0)

            def once() -> None:
                for inputs in rank_micro_batches(plan, docs, manager, sharding="balanced"):  # noqa: B023
                    model(**inputs).loss.backward()
                model.zero_grad(set_to_none=True)

            once()
            times, parts = [], []
            for _ in range(reps):
                acc.clear()
                dist.barrier()
                c0 = time.thread_time()
                once()
                times.append(time.thread_time() - c0)
                parts.append(dict(acc))
            out[name] = {"total": times, "parts": parts}
        return out
    finally:
        seqpar.destroy_process_groups(manager)


def main() -> None:
    world, reps = int(sys.argv[1]), int(sys.argv[2])
    with RankPool(world, device="cpu") as pool:
        res = pool.run(__import__("calibration_attribution").work, world, reps, timeout=1800)
    for name in res[0]:
        r0 = res[0][name]
        medians = [round(statistics.median(r[name]["total"]), 4) for r in res]
        print(f"== {name}: rank 0 totals {[round(t, 4) for t in r0['total']]}; every rank's median {medians}")
        for key in sorted(set().union(*[p.keys() for p in r0["parts"]])):
            print(f"   {key:60s} {statistics.median(p.get(key, 0.0) for p in r0['parts']) * 1000:8.2f} ms")


if __name__ == "__main__":
    import calibration_attribution  # the ranks unpickle work() by this module's name

    calibration_attribution.main()
