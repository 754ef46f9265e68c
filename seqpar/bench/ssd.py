"""``python -m seqpar.bench ssd``: one Mamba2 layer (transformers' ``Mamba2Mixer``, torch path),
forward + backward, sequence-parallel on P gloo ranks against one process on the whole sequence.

Reports (see BENCHMARKS.md, "Mamba2 / SSD layer"):

- time: the slowest rank's wall time per step (median of the repeats) and the largest per-rank thread
  CPU time, against the ideal (one process's time / P); the forward's phases on the SP ranks (projections
  and norm, convolution with its halo, the zero-state scans, the summary all-gather and prefix, the
  correction) measured by wrapping the functions :mod:`seqpar.mixers.mamba2` calls;
- counted bytes per rank (:mod:`seqpar.testing.traffic`) at several S: flat in S;
- peak tensor memory per rank (:func:`seqpar.bench.runner.peak_memory`) against one process.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch
import torch.distributed as dist

from seqpar.bench.report import machine_info
from seqpar.bench.runner import Phases, RankPool, combine, peak_memory, time_step

__all__ = ["main", "layer", "run"]


def layer(hidden: int, heads: int, state: int, chunk: int) -> torch.nn.Module:
    """transformers' ``Mamba2Mixer`` (expand 2, one group, conv width 4), seeded, fp32."""
    import transformers

    cfg = transformers.Mamba2Config(hidden_size=hidden, num_heads=heads, head_dim=2 * hidden // heads,
                                    state_size=state, n_groups=1, expand=2, conv_kernel=4, chunk_size=chunk,
                                    num_hidden_layers=1, use_cache=False)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).backbone.layers[0].mixer.float()


def _inputs(seq: int, hidden: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    from seqpar.sequence.sharding import shard_sequence

    g = torch.Generator().manual_seed(1)
    h = torch.randn(1, seq, hidden, generator=g)
    grad = torch.randn(1, seq, hidden, generator=g)
    if world == 1:
        return h, grad
    group = dist.group.WORLD
    return (shard_sequence(h, 1, group=group, sharding="contiguous"),
            shard_sequence(grad, 1, group=group, sharding="contiguous"))


def _rank(ctx: Any, seq: int, hidden: int, heads: int, state: int, chunk: int, warmup: int, repeats: int,
          byte_seqs: list[int]) -> dict[str, Any]:
    from seqpar.mixers import mamba2, ssd, state_passing
    from seqpar.mixers.mamba2 import SeqParMamba2Mixer
    from seqpar.testing.traffic import counting

    world = ctx.world_size
    base = layer(hidden, heads, state, chunk)
    module = base if world == 1 else SeqParMamba2Mixer(base, group=dist.group.WORLD, sharding="contiguous")
    device = torch.device("cpu")

    def step(s: int = seq) -> None:
        h, grad = _inputs(s, hidden, ctx.rank, world)
        h.requires_grad_()
        (module(h) * grad).sum().backward()

    timing = time_step(step, device=device, warmup=warmup, repeats=repeats)
    out: dict[str, Any] = {"timing": timing}
    fwd = []
    for _ in range(repeats):
        h, _ = _inputs(seq, hidden, ctx.rank, world)
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        with torch.no_grad():
            module(h)
        fwd.append(time.perf_counter() - t0)
    out["forward_s"] = sorted(fwd)[len(fwd) // 2]
    if world > 1:
        h, _ = _inputs(seq, hidden, ctx.rank, world)
        phases = Phases()
        phases.wrap(mamba2, "causal_conv_shard", "conv + halo")
        phases.wrap(ssd, "_zero_state_runs", "zero-state scans")
        phases.wrap(state_passing, "chunk_initial_states", "summary all-gather + prefix")
        _, out["phases_s"] = phases.time_forward(lambda: module(h), "correction, projections, norm", barrier=True)
        out["bytes"] = {}
        for s in byte_seqs:
            with counting(world) as traffic:
                step(s)
            out["bytes"][s] = traffic.collective_bytes + traffic.p2p_bytes
    out["peak_bytes"] = peak_memory(step, device, repeats=2)
    return out


def run(seq: int = 8192, world: int = 2, hidden: int = 128, heads: int = 8, state: int = 64, chunk: int = 256,
        warmup: int = 1, repeats: int = 3, byte_seqs: tuple[int, ...] = (2048, 4096, 8192)) -> dict[str, Any]:
    """Both measurements (one process, then ``world`` ranks); returns every figure."""
    args = (seq, hidden, heads, state, chunk, warmup, repeats, list(byte_seqs))
    with RankPool(1) as pool:
        one = pool.run(_rank, *args)
    with RankPool(world) as pool:
        sp = pool.run(_rank, *args)
    t1, tp = combine([one[0]["timing"]]), combine([r["timing"] for r in sp])
    ideal_wall, ideal_cpu = t1["time_s"] / world, t1["cpu_s"] / world
    return {
        "shape": {"seq": seq, "world": world, "hidden": hidden, "heads": heads, "head_dim": 2 * hidden // heads,
                  "state": state, "chunk": chunk, "batch": 1, "dtype": "float32"},
        "one_process": {"time_s": t1["time_s"], "cpu_s": t1["cpu_s"], "forward_s": one[0]["forward_s"],
                        "peak_bytes": one[0]["peak_bytes"]},
        "sp": {"time_s": tp["time_s"], "cpu_s": tp["cpu_s"], "forward_s": max(r["forward_s"] for r in sp),
               "rank_time_s": tp["rank_time_s"], "peak_bytes": [r["peak_bytes"] for r in sp],
               "phases_s": [r["phases_s"] for r in sp], "bytes_per_rank": [r["bytes"] for r in sp]},
        "vs_ideal_wall": tp["time_s"] / ideal_wall,
        "vs_ideal_cpu": tp["cpu_s"] / ideal_cpu,
        "peak_vs_one_process": max(r["peak_bytes"] for r in sp) / one[0]["peak_bytes"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m seqpar.bench ssd", description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--state", type=int, default=64)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--byte-seqs", default="2048,4096,8192", help="S values at which bytes are counted")
    p.add_argument("--out", metavar="FILE", help="also write every figure as JSON")
    a = p.parse_args(argv)
    result = run(a.seq, a.world, a.hidden, a.heads, a.state, a.chunk, repeats=a.repeats,
                 byte_seqs=tuple(int(s) for s in a.byte_seqs.split(",")))
    result["machine"] = machine_info()
    one, sp = result["one_process"], result["sp"]
    print(f"Mamba2 layer fwd+bwd, S={a.seq}, P={a.world}, shape {result['shape']}")
    print(f"  one process: {one['time_s']:.3f} s wall, {one['cpu_s']:.3f} s CPU, forward {one['forward_s']:.3f} s, "
          f"peak {one['peak_bytes'] / 2**20:.1f} MiB")
    print(f"  P={a.world}: {sp['time_s']:.3f} s wall (ranks {[round(t, 3) for t in sp['rank_time_s']]}), "
          f"{sp['cpu_s']:.3f} s CPU, forward {sp['forward_s']:.3f} s")
    print(f"  vs ideal (one process / P): {result['vs_ideal_wall']:.2f}x wall, {result['vs_ideal_cpu']:.2f}x CPU")
    for r, phases in enumerate(sp["phases_s"]):
        print(f"  rank {r} forward phases: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in phases.items()))
    for r, counted in enumerate(sp["bytes_per_rank"]):
        print(f"  rank {r} bytes sent per fwd+bwd: " + ", ".join(f"S={s}: {b}" for s, b in counted.items()))
    print(f"  peak per rank: {[round(b / 2**20, 1) for b in sp['peak_bytes']]} MiB = "
          f"{result['peak_vs_one_process']:.2f}x one process")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1, default=str)
    return 0
