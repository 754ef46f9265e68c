"""``python -m seqpar.bench interleave --compile``: a swapped Hugging Face model's training step, compiled
(``torch.compile(model, fullgraph=True)``, inductor by default) against eager, timed in interleaved rounds::

    python -m seqpar.bench interleave --compile --model llama --world 2 --seq-len 2048 --rounds 7 --out c.json

Every rank builds the same seeded model (a small one of ``--model``'s family: :data:`SIZES`), swaps it at
SP = ``--world`` (ring, zigzag), and cuts one fixed batch with :func:`seqpar.sequence.batch.shard_batch`. The
compiled model is compiled once, before the rounds (its first call, timed apart as ``compile_s``); then
every round runs the eager and the compiled step ``--repeats`` times each, in an order that alternates
between rounds, so a change in the machine's load hits both alike. A step is forward with ``labels=``,
backward and an SGD update. Reported per round and as the median over rounds: tokens per second (the
batch's global tokens over the slowest rank's median step time) and compiled / eager. The first compiled
and the first eager losses and gradients (same weights, no update between) are compared too: they must
agree (``grad_max_rel_diff``: per parameter, the largest difference over the gradient's largest entry; the
worst over parameters and ranks).

Beside wall time, each step's thread CPU seconds (``eager_cpu_s``, ``compiled_cpu_s``: the busiest rank's
median, median over rounds; ``cpu_ratio_median`` = eager / compiled; ``*_forward_cpu_s``: the forward's
share alone, the rest being the backward and the update; ``*_process_cpu_s``: all the rank's
threads, gloo's included): on a machine shared with other jobs a
rank waiting for a core, or for the other rank, costs wall time but no CPU time. ``recompiles`` counts
dynamo's graphs made during the rounds (must be 0: a recompile would be timed as a step).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

__all__ = ["SIZES", "FAMILY_SIZES", "bench_config", "compiled_rounds", "summarize_compiled"]

SIZES: dict[str, Any] = {
    "hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 4, "num_attention_heads": 8,
    "num_key_value_heads": 4, "vocab_size": 2048, "max_position_embeddings": 16384, "tie_word_embeddings": False,
    "use_cache": False,
}
"""The benchmarked model's sizes (the fields its family's config has): small enough for a loaded CPU,
large enough that the step is compute, not Python overhead alone."""

FAMILY_SIZES: dict[str, dict[str, Any]] = {
    # Qwen3.5's hybrid pattern (three Gated DeltaNet layers, then one attention layer), its heads scaled
    # to hidden 256 like Llama's: attention 8 x 32 (4 KV heads), GDN 4 key heads and 8 value heads of 32
    "qwen3_5_text": {
        "layer_types": ["linear_attention"] * 3 + ["full_attention"], "head_dim": 32,
        "linear_num_key_heads": 4, "linear_num_value_heads": 8, "linear_key_head_dim": 32,
        "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4,
    },
}
"""Per family, the fields :data:`SIZES` does not set (a hybrid's layer pattern, its mixers' heads); a family
not named here takes its tiny test model's (:func:`seqpar.testing.tiny_models.tiny_kwargs`) for them."""


def bench_config(model_type: str) -> Any:
    """The benchmarked model's transformers config: :data:`SIZES`, then :data:`FAMILY_SIZES` (or the tiny
    test model's fields) for the family's own."""
    import transformers
    from transformers.models.auto import modeling_auto as auto

    if model_type not in transformers.CONFIG_MAPPING or model_type not in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise SystemExit(f"interleave --compile: --model {model_type!r} is not a transformers causal-LM model "
                         "type; use e.g. llama or qwen3_5_text (Qwen3.5's text model)")
    default = transformers.CONFIG_MAPPING[model_type]()
    fields = {k: v for k, v in SIZES.items() if hasattr(default, k)}
    if model_type in FAMILY_SIZES:
        fields.update(FAMILY_SIZES[model_type])
    elif model_type != "llama":  # a hybrid's layer pattern etc.: the tiny model's, with the sizes above
        from seqpar.testing.tiny_models import tiny_kwargs

        fields = {**tiny_kwargs(model_type), **fields}
    return transformers.CONFIG_MAPPING[model_type](**fields)


def _model(model_type: str) -> torch.nn.Module:
    import transformers
    from transformers.models.auto import modeling_auto as auto

    config = bench_config(model_type)
    cls = getattr(transformers, auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    torch.manual_seed(0)
    return cls(config).train()


def compiled_rounds(ctx: Any, model_type: str, seq_len: int, rounds: int, repeats: int,
                    backend: str) -> dict[str, Any]:
    """Rank task (:class:`seqpar.bench.runner.RankPool`): per round, each of eager and compiled's step
    times (wall seconds, ``repeats`` of them), and the compile time and first losses."""
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    import seqpar
    from seqpar.sequence.batch import shard_batch

    group = dist.group.WORLD
    model = _model(model_type)
    seqpar.swap_attention(model, {"size": ctx.world_size, "mode": "ring", "sharding": "zigzag"}, group=group)
    ids = torch.randint(3, model.config.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(5))
    batch = shard_batch({"input_ids": ids, "labels": ids.clone()}, group=group, sharding="zigzag")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    compiled = torch.compile(model, fullgraph=True, backend=backend)

    def step(fn: Any, update: bool = True) -> tuple[float, float, float, float, float]:
        """(wall seconds, this thread's CPU seconds, loss, the process's CPU seconds: gloo's threads too,
        this thread's CPU seconds in the forward alone)."""
        dist.barrier(group)
        tic, cpu, proc = time.perf_counter(), time.thread_time(), time.process_time()
        loss = fn(**batch).loss
        forward = time.thread_time() - cpu
        loss.backward()
        if update:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - tic, time.thread_time() - cpu, loss.item(), time.process_time() - proc, forward

    def take_grads() -> dict[str, torch.Tensor]:
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        optimizer.zero_grad(set_to_none=True)
        return grads

    # the first steps without an update: the same weights' loss and gradients (they must agree)
    first_eager = step(model, update=False)[2]
    eager_grads = take_grads()
    compile_s, _, first_compiled, *_ = step(compiled, update=False)
    compiled_grads = take_grads()
    # each gradient's largest difference over its own largest entry, the worst over parameters
    grad_rel = max(((compiled_grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-30)).item()
                   for n, g in eager_grads.items())
    out: dict[str, Any] = {"compile_s": compile_s, "first_loss": {"eager": first_eager, "compiled": first_compiled},
                           "grad_max_rel_diff": grad_rel, "threads": torch.get_num_threads(), "rounds": []}
    graphs = counters["stats"]["unique_graphs"]
    for rnd in range(rounds):
        order = [("eager", model), ("compiled", compiled)]
        if rnd % 2:
            order.reverse()
        times: dict[str, Any] = {"cpu": {}, "process_cpu": {}, "forward_cpu": {}}
        for name, fn in order:
            steps = [step(fn) for _ in range(repeats)]
            times[name] = [s[0] for s in steps]
            times["cpu"][name] = [s[1] for s in steps]
            times["process_cpu"][name] = [s[3] for s in steps]
            times["forward_cpu"][name] = [s[4] for s in steps]
        out["rounds"].append(times)
    # a recompile here would be timed as a step (the first compiled call is the compile, above)
    out["recompiles"] = counters["stats"]["unique_graphs"] - graphs
    return out


def summarize_compiled(per_rank: list[dict[str, Any]], seq_len: int) -> dict[str, Any]:
    """The ranks' records -> tokens/s per round (slowest rank's median step) and the medians over rounds."""
    rounds = len(per_rank[0]["rounds"])
    tps: dict[str, list[float]] = {"eager": [], "compiled": []}
    for rnd in range(rounds):
        for name in tps:
            slowest = max(statistics.median(r["rounds"][rnd][name]) for r in per_rank)
            tps[name].append(seq_len / slowest)
    ratios = [c / e for c, e in zip(tps["compiled"], tps["eager"], strict=True)]
    # thread CPU seconds per step (the busiest rank's median per round): what load (waiting for a core or
    # for the other rank) does not inflate
    def busiest(key: str) -> dict[str, list[float]] | None:
        if not all(key in rnd for r in per_rank for rnd in r["rounds"]):
            return None
        return {name: [max(statistics.median(r["rounds"][rnd][key][name]) for r in per_rank) for rnd in range(rounds)]
                for name in tps}

    cpu, process_cpu, forward_cpu = busiest("cpu"), busiest("process_cpu"), busiest("forward_cpu")
    out = {
        "eager_tokens_per_s_rounds": tps["eager"], "compiled_tokens_per_s_rounds": tps["compiled"],
        "ratio_rounds": ratios,
        "eager_tokens_per_s": statistics.median(tps["eager"]),
        "compiled_tokens_per_s": statistics.median(tps["compiled"]),
        "ratio_median": statistics.median(ratios),
        "compile_s": max(r["compile_s"] for r in per_rank),
        "first_loss": per_rank[0]["first_loss"],
        "grad_max_rel_diff": max(r["grad_max_rel_diff"] for r in per_rank),
        "recompiles": max(r.get("recompiles", 0) for r in per_rank),
    }
    if cpu is not None:
        out.update(eager_cpu_s_rounds=cpu["eager"], compiled_cpu_s_rounds=cpu["compiled"],
                   eager_cpu_s=statistics.median(cpu["eager"]), compiled_cpu_s=statistics.median(cpu["compiled"]),
                   cpu_ratio_median=statistics.median(e / c for e, c in zip(cpu["eager"], cpu["compiled"], strict=True)))
    if process_cpu is not None:
        out.update(eager_process_cpu_s=statistics.median(process_cpu["eager"]),
                   compiled_process_cpu_s=statistics.median(process_cpu["compiled"]))
    if forward_cpu is not None:  # the forward's share of the step's thread CPU (the rest: backward, update)
        out.update(eager_forward_cpu_s=statistics.median(forward_cpu["eager"]),
                   compiled_forward_cpu_s=statistics.median(forward_cpu["compiled"]))
    return out
