"""``python -m seqpar.bench.gdn``: one Gated DeltaNet layer (Qwen3.5's), forward + backward, one process against
P gloo ranks (one core each), on one sequence of S positions. See BENCHMARKS.md ("Gated DeltaNet").

Reports, per S:

- time: one process, the P-rank sequence-parallel layer (slowest rank's wall time, median of repeats) and
  the largest per-rank thread CPU time (the figure to trust when P ranks share fewer cores than P plus
  the machine's other load), each against the ideal (one process / P);
- the forward alone (no autograd) and its phases on each SP rank, timed by wrapping the functions
  :mod:`seqpar.mixers.gdn` / :mod:`seqpar.mixers.delta_rule` call (conv with its halo, the wide scan of
  ``[v | 0]`` from ``[0 | I]``, the summary all-gather and prefix fold; the rest: projections, gated norm
  and the ``o_zero + O_I h`` correction), and the one-process forward's kernel time;
- bytes each rank sends (counted, :func:`seqpar.testing.traffic.counting`), which must not grow with S;
- peak tensor memory per rank against one process (:func:`seqpar.bench.runner.peak_memory`).

``--recompute N`` checkpoints the wide scan in pieces of N positions (:data:`seqpar.mixers.delta_rule.RECOMPUTE`
is the default; ``--recompute 0``: none); ``--json FILE`` writes every figure.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from seqpar.bench.report import fmt_bytes, format_table, machine_info
from seqpar.bench.runner import Phases, RankPool, combine, peak_memory, time_step

__all__ = ["main"]


def _layer(args: argparse.Namespace) -> torch.nn.Module:
    import transformers
    from transformers.models.qwen3_5 import modeling_qwen3_5 as q35

    config = transformers.Qwen3_5TextConfig(
        hidden_size=args.hidden, linear_num_key_heads=args.k_heads, linear_num_value_heads=args.v_heads,
        linear_key_head_dim=args.head_dim, linear_value_head_dim=args.head_dim, linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention"], num_hidden_layers=2)
    torch.manual_seed(0)
    return q35.Qwen3_5GatedDeltaNet(config, 0)


def _task(ctx: Any, args: argparse.Namespace, seq: int) -> dict[str, Any]:
    import torch.distributed as dist

    from seqpar.mixers import delta_rule, gdn
    from seqpar.mixers.gdn import SeqParGatedDeltaNet
    from seqpar.sequence.sharding import shard_sequence
    from seqpar.testing.traffic import counting

    world = ctx.world_size
    group = dist.group.WORLD if world > 1 else None
    layer = _layer(args)
    tf = __import__(type(layer).__module__, fromlist=["x"])
    if world > 1:
        layer = SeqParGatedDeltaNet(layer, group=group, sharding=args.sharding)
        delta_rule.RECOMPUTE = args.recompute or None  # the layer's default (this rank's process only)
    h = torch.randn(1, seq, args.hidden, generator=torch.Generator().manual_seed(1))
    h = shard_sequence(h, 1, group=group, sharding=args.sharding) if world > 1 else h

    def step() -> None:
        x = h.clone().requires_grad_()
        layer(x).sum().backward()

    timing = time_step(step, device=ctx.device, warmup=args.warmup, repeats=args.repeats)
    with counting(world) as traffic:
        step()
    peak = peak_memory(step, ctx.device)
    phases = Phases()
    if world > 1:
        phases.wrap(gdn, "causal_conv_shard", "conv+halo")
        phases.wrap(delta_rule, "_wide_scan", "wide scan")
        phases.wrap(delta_rule, "chunk_initial_states", "all-gather+fold")
    else:  # transformers' layer calls its module's kernel
        phases.wrap(tf, "torch_chunk_gated_delta_rule", "scan")
    forward, seconds = phases.time_forward(lambda: layer(h), "rest", barrier=world > 1)
    return {"timing": timing, "bytes": traffic.collective_bytes + traffic.p2p_bytes, "peak": peak,
            "forward_s": forward, "phases_s": seconds}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m seqpar.bench.gdn", description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-lens", default="2048,8192", help="comma-separated S")
    p.add_argument("--world", type=int, default=2, help="P (gloo ranks, one core each)")
    p.add_argument("--sharding", default="contiguous", choices=["contiguous", "zigzag"])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--k-heads", type=int, default=2)
    p.add_argument("--v-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--recompute", type=int, default=None,
                   help="positions per checkpointed piece of the wide scan (default: the library's; 0: none)")
    p.add_argument("--json", metavar="FILE", help="also write every figure as JSON")
    args = p.parse_args(argv)
    if args.recompute is None:
        from seqpar.mixers.delta_rule import RECOMPUTE

        args.recompute = RECOMPUTE or 0
    seq_lens = [int(s) for s in args.seq_lens.split(",")]
    info = machine_info()
    print(f"# one GDN layer (Qwen3.5), hidden {args.hidden}, {args.k_heads} key / {args.v_heads} value heads of "
          f"{args.head_dim}, P={args.world} {args.sharding}, recompute {args.recompute or 'off'}, fwd+bwd; "
          f"{info['cpu_model']}, {info['cpu_cores']} cores, load {info['load_avg_1_5_15']}")
    rows, records = [], []
    with RankPool(1) as one, RankPool(args.world) as pool:
        for seq in seq_lens:
            base = one.run(_task, args, seq)[0]
            sp = pool.run(_task, args, seq)
            t1, tp = combine([base["timing"]]), combine([r["timing"] for r in sp])
            peak_sp = max(r["peak"] for r in sp)
            record = {
                "S": seq, "one_process": {"time_s": t1["time_s"], "cpu_s": t1["cpu_s"], "forward_s": base["forward_s"],
                                          "phases_s": base["phases_s"], "peak_bytes": base["peak"]},
                "sp": {"time_s": tp["time_s"], "cpu_s": tp["cpu_s"], "rank_time_s": tp["rank_time_s"],
                       "forward_s": [r["forward_s"] for r in sp], "phases_s": [r["phases_s"] for r in sp],
                       "bytes_per_rank": [r["bytes"] for r in sp], "peak_bytes": [r["peak"] for r in sp]},
                "vs_ideal_wall": tp["time_s"] * args.world / t1["time_s"],
                "vs_ideal_cpu": tp["cpu_s"] * args.world / t1["cpu_s"],
                "peak_vs_one_process": peak_sp / base["peak"],
            }
            records.append(record)
            rows.append({
                "S": seq, "one process": f"{t1['time_s']:.3f} s / {t1['cpu_s']:.3f} s",
                f"P={args.world}": f"{tp['time_s']:.3f} s / {tp['cpu_s']:.3f} s",
                "x ideal (wall / CPU)": f"{record['vs_ideal_wall']:.2f} / {record['vs_ideal_cpu']:.2f}",
                "bytes/rank": fmt_bytes(max(r["bytes"] for r in sp)),
                "peak/rank": fmt_bytes(peak_sp), "peak one": fmt_bytes(base["peak"]),
                "peak ratio": f"{record['peak_vs_one_process']:.2f}",
            })
    print("times: wall / thread CPU per fwd+bwd step (P ranks: slowest rank / largest CPU)")
    print(format_table(rows, [(k, k) for k in rows[0]]))
    for record in records:
        one = record["one_process"]
        print(f"S={record['S']} forward (no autograd): one process {one['forward_s']:.3f} s ("
              + ", ".join(f"{k} {v:.3f}" for k, v in one["phases_s"].items()) + ")")
        for r, (fwd, phases) in enumerate(zip(record["sp"]["forward_s"], record["sp"]["phases_s"])):
            print(f"  rank {r}: {fwd:.3f} s (" + ", ".join(f"{k} {v:.3f}" for k, v in phases.items()) + ")")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "machine": info, "rows": records}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
