"""The ``memory`` suite: peak bytes per rank against S, the largest S a budget fits, the estimator.

For each P and S it measures one forward+backward of ``sdpa`` (P = 1), ``ring``, ``allgather``,
``seqpar_ulysses`` and the ``hybrid`` ((P/2) x 2, P >= 4) where the head counts allow them
(inputs, outputs and gradients included; MemTracker on CPU, ``max_memory_allocated`` on CUDA) and
prints :func:`seqpar.memory.attention.estimate_attention_memory`'s prediction beside it. Then, for a per-rank budget, it
asks the estimator for the largest S each method fits and measures that S to confirm it fits.
No timing here: the attention suite times, this one only counts bytes.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from seqpar.bench.attention import BenchShape, forward_fn, make_inputs, shape_from_args
from seqpar.bench.runner import PoolSet, RankContext, peak_memory, suite_pools
from seqpar.memory.attention import estimate_attention_memory, max_seq_len

__all__ = ["MemoryConfig", "measure_peak", "configure", "count", "run", "render", "plots"]

_METHODS = ("sdpa", "ring", "allgather")
MEASURE_REPEATS = 3


@dataclass(frozen=True)
class MemoryConfig:
    """What one ``memory`` run covers."""

    seq_lens: list[int]
    worlds: list[int]
    causal: list[bool]
    shape: BenchShape
    budget_bytes: int
    seed: int = 0
    device: str = "cpu"


def measure_peak(ctx: RankContext, method: str, seq_len: int, causal: bool, shape: BenchShape, seed: int) -> int:
    """Peak tensor bytes on this rank over one forward+backward, inputs and gradients included (the
    lowest of 3 runs: see :func:`seqpar.bench.runner.peak_memory`)."""
    fwd = forward_fn(method, causal, seq_len, shape.head_chunks)
    seq_local = seq_len // ctx.world_size

    def step() -> None:
        q, k, v, dout = make_inputs(shape, seq_local, ctx.device, seed + ctx.rank)
        fwd(q, k, v).backward(dout)

    return peak_memory(step, ctx.device, repeats=MEASURE_REPEATS)


def _estimator_mode(method: str) -> str:
    return {"sdpa": "single", "seqpar_ulysses": "ulysses"}.get(method, method)


def _methods(world: int, shape: BenchShape) -> list[str]:
    """What runs at P = world: SDPA alone at P = 1; ring, all-gather, and Ulysses / the (P/2) x 2 hybrid
    where the head counts allow them, evenly or in uneven shares (seqpar.runtime.grid.ulysses_heads_accepted)."""
    from seqpar.runtime.grid import ulysses_heads_accepted

    if world == 1:
        return ["sdpa"]
    methods = ["ring", "allgather"]
    if ulysses_heads_accepted(shape.q_heads, shape.kv_heads, world):
        methods.append("seqpar_ulysses")
    if world > 2 and world % 2 == 0 and ulysses_heads_accepted(shape.q_heads, shape.kv_heads, 2):
        methods.append("hybrid")
    return methods


def _estimate(method: str, seq_len: int, world: int, causal: bool, shape: BenchShape) -> int:
    return estimate_attention_memory(seq_len, world_size=world, mode=_estimator_mode(method),
                           batch=shape.batch, q_heads=shape.q_heads, kv_heads=shape.kv_heads,
                           head_dim=shape.head_dim, dtype=shape.torch_dtype, causal=causal,
                           head_chunks=shape.head_chunks, ulysses_size=2 if method == "hybrid" else None)


def _largest(method: str, world: int, causal: bool, cfg: MemoryConfig) -> int:
    s = cfg.shape
    return max_seq_len(cfg.budget_bytes, world_size=world, mode=_estimator_mode(method),
                       batch=s.batch, q_heads=s.q_heads, kv_heads=s.kv_heads, head_dim=s.head_dim,
                       dtype=s.torch_dtype, causal=causal, multiple=64, head_chunks=s.head_chunks,
                       ulysses_size=2 if method == "hybrid" else None)


def configure(args: Any) -> Any:
    """A :class:`MemoryConfig` from the CLI's resolved arguments (P = 2 and 4 unless ``--worlds``);
    with ``--model``, the whole-model suite's config (:mod:`seqpar.bench.model_memory`)."""
    if getattr(args, "model", None):
        from seqpar.bench import model_memory

        return model_memory.configure(args)
    worlds = args.worlds if "worlds" in args.explicit or args.preset == "tiny" else [2, 4]
    return MemoryConfig(
        seq_lens=list(args.seq_lens), worlds=list(worlds), causal=list(args.causal_list),
        shape=shape_from_args(args),
        budget_bytes=int(args.budget_mib * 2**20), seed=args.seed, device=args.device,
    )


def count(cfg: MemoryConfig) -> int:
    """Progress steps of :func:`run`."""
    if not isinstance(cfg, MemoryConfig):
        from seqpar.bench import model_memory

        return model_memory.count(cfg)
    runs = sum(len(_methods(w, cfg.shape)) for w in [1, *cfg.worlds])
    return (len(cfg.seq_lens) + 1) * runs * len(cfg.causal)


def run(cfg: MemoryConfig, progress: Callable[[str], None], *, pools: PoolSet | None = None) -> dict[str, Any]:
    """Measure every (method, P, S, causal) and the budget's largest S; returns the JSON payload.

    ``pools``: rank pools to run on (left running); else each world size gets its own pool, closed before
    the next one starts."""
    if not isinstance(cfg, MemoryConfig):
        from seqpar.bench import model_memory

        return model_memory.run(cfg, progress)
    rows: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    largest: list[dict[str, Any]] = []
    for world in [1, *cfg.worlds]:
        if cfg.device == "cuda" and torch.cuda.device_count() < world:
            skipped.append({"P": world, "reason": f"needs {world} GPUs, this machine has {torch.cuda.device_count()}"})
            continue
        methods = _methods(world, cfg.shape)
        with suite_pools(cfg.device, pools) as world_pools:
            for causal in cfg.causal:
                for method in methods:
                    for seq_len in cfg.seq_lens:
                        progress(f"{method} P={world} S={seq_len}")
                        peaks = world_pools.run(world, measure_peak, method, seq_len, causal, cfg.shape, cfg.seed)
                        est = _estimate(method, seq_len, world, causal, cfg.shape)
                        rows.append({"method": method, "P": world, "S": seq_len, "causal": causal,
                                     "peak_bytes": max(peaks), "peak_bytes_per_rank": peaks,
                                     "bytes_per_token": max(peaks) / (seq_len / world),
                                     "estimate_bytes": est, "estimate_error": est / max(peaks) - 1.0})
                    progress(f"largest S {method} P={world}")
                    s_max = _largest(method, world, causal, cfg)
                    entry: dict[str, Any] = {"method": method, "P": world, "causal": causal,
                                             "budget_bytes": cfg.budget_bytes, "largest_S": s_max}
                    if s_max:
                        peaks = world_pools.run(world, measure_peak, method, s_max, causal, cfg.shape, cfg.seed)
                        entry["measured_bytes"] = max(peaks)
                        entry["fits"] = max(peaks) <= cfg.budget_bytes
                        entry["measured_vs_budget"] = max(peaks) / cfg.budget_bytes
                    largest.append(entry)
    _ratios(rows)
    return {"config": {"seq_lens": cfg.seq_lens, "worlds": cfg.worlds, "causal": cfg.causal,
                       "shape": asdict(cfg.shape), "budget_bytes": cfg.budget_bytes, "device": cfg.device},
            "results": rows, "largest": largest, "skipped": skipped}


def _ratios(rows: list[dict[str, Any]]) -> None:
    single = {(r["S"], r["causal"]): r["peak_bytes"] for r in rows if r["method"] == "sdpa"}
    for r in rows:
        base = single.get((r["S"], r["causal"]))
        if r["method"] != "sdpa" and base:
            r["mem_vs_single"] = r["peak_bytes"] / base


def render(payload: dict[str, Any]) -> str:
    """Measured vs estimated peak per rank, memory per token, and the budget's largest S."""
    if payload.get("kind") == "model":
        from seqpar.bench import model_memory

        return model_memory.render(payload)
    from seqpar.bench.report import fmt_bytes, format_table

    rows = [{
        "method": r["method"], "P": r["P"], "S": r["S"], "causal": "yes" if r["causal"] else "no",
        "peak": fmt_bytes(r["peak_bytes"]), "est": fmt_bytes(r["estimate_bytes"]),
        "err": f"{r['estimate_error']:+.1%}", "tok": fmt_bytes(r["bytes_per_token"]), "ratio": r.get("mem_vs_single"),
    } for r in payload["results"]]
    cols = [("method", "method"), ("P", "P"), ("S", "S"), ("causal", "causal"), ("measured peak/rank", "peak"),
            ("estimate", "est"), ("est err", "err"), ("per local token", "tok"), ("vs single", "ratio")]
    out = ["memory: peak tensor bytes per rank over forward+backward (inputs, outputs, gradients included)",
           format_table(rows, cols)]
    budget = fmt_bytes(payload["config"]["budget_bytes"])
    big = [{"method": e["method"], "P": e["P"], "causal": "yes" if e["causal"] else "no", "S": e["largest_S"],
            "meas": fmt_bytes(e.get("measured_bytes")), "x": e.get("measured_vs_budget"), "fits": e.get("fits")}
           for e in payload["largest"]]
    out += [f"largest S within {budget} per rank (estimator; measured at that S):",
            format_table(big, [("method", "method"), ("P", "P"), ("causal", "causal"), ("largest S", "S"),
                               ("measured", "meas"), ("x budget", "x"), ("fits", "fits")])]
    for r in payload["results"]:
        if r["method"] == "ring" and r["P"] == 4 and r.get("mem_vs_single"):
            out.append(f"ring P=4 S={r['S']}{' causal' if r['causal'] else ''}: peak per rank "
                       f"{r['mem_vs_single']:.2f}x single-process (issue 5 target <= 0.35x)")
    out += [f"P={r['P']} not run: {r['reason']}" for r in payload.get("skipped", [])]
    return "\n".join(out)


def plots(payload: dict[str, Any], out_dir: str) -> list[str]:
    """Memory vs S (measured points, estimator alongside) and bytes per local token vs S."""
    if payload.get("kind") == "model":
        return []
    from seqpar.bench.report import plot_series

    def key(r: dict[str, Any]) -> str:
        return r["method"] + ("" if r["P"] == 1 else f" P={r['P']}")

    masks = {False: "full (non-causal)", True: "causal"}
    meas: dict[str, dict[str, list[tuple[float, float]]]] = {}
    per_tok: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for r in payload["results"]:
        m, t = meas.setdefault(masks[r["causal"]], {}), per_tok.setdefault(masks[r["causal"]], {})
        m.setdefault(key(r), []).append((r["S"], r["peak_bytes"] / 2**20))
        m.setdefault(key(r) + " (estimate)", []).append((r["S"], r["estimate_bytes"] / 2**20))
        t.setdefault(key(r), []).append((r["S"], r["bytes_per_token"] / 2**10))
    paths = [
        plot_series(os.path.join(out_dir, "memory_vs_S.png"), panels=meas,
                    title="peak memory per rank: measured (solid) and estimated (dashed)",
                    xlabel="total sequence length S", ylabel="MiB", logx=True, logy=True),
        plot_series(os.path.join(out_dir, "memory_per_token.png"), panels=per_tok,
                    title="peak memory per local token (flat = O(S/P) per rank)",
                    xlabel="total sequence length S", ylabel="KiB per token held", logx=True),
    ]
    return [p for p in paths if p]
