"""``python -m seqpar.bench.gdn``: one Gated DeltaNet layer (Qwen3.5's), forward + backward, one process against
P gloo ranks (one core each), on one sequence of S positions. See BENCHMARKS.md ("Gated DeltaNet").

Reports, per S:

- time: one process, the P-rank sequence-parallel layer (slowest rank, median of repeats), the ideal
  (one process / P) and the ratio to it;
- a per-phase breakdown of the sharded forward on one rank (conv with halo, the summary scan of
  ``[v | 0]`` from ``[0 | I]``, the summary all-gather and prefix fold, the re-run from the true initial
  state) and the one-process forward's kernel time;
- bytes each rank sends (counted, :func:`seqpar.testing.traffic.counting`), which must not grow with S;
- peak tensor memory per rank against one process (:func:`seqpar.bench.runner.peak_memory`).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from seqpar.bench.report import fmt_bytes, format_table, machine_info
from seqpar.bench.runner import RankPool, combine, peak_memory, time_step

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

    from seqpar.mixers.conv import causal_conv_shard
    from seqpar.mixers.delta_rule import delta_rule_kernel
    from seqpar.mixers.gdn import SeqParGatedDeltaNet
    from seqpar.mixers.scan_layout import scan_layout
    from seqpar.mixers.state_passing import chunk_initial_states
    from seqpar.sequence.sharding import shard_sequence
    from seqpar.testing.traffic import counting

    world = ctx.world_size
    group = dist.group.WORLD if world > 1 else None
    layer = _layer(args)
    if world > 1:
        layer = SeqParGatedDeltaNet(layer, group=group, sharding=args.sharding)
    h = torch.randn(1, seq, args.hidden, generator=torch.Generator().manual_seed(1))
    h = shard_sequence(h, 1, group=group, sharding=args.sharding) if world > 1 else h

    def step() -> None:
        x = h.clone().requires_grad_()
        layer(x).sum().backward()

    timing = time_step(step, device=ctx.device, warmup=args.warmup, repeats=args.repeats)
    with counting(world) as traffic:
        step()
    peak = peak_memory(step, ctx.device)
    # forward phases, timed apart (no autograd): the same calls the layer makes
    phases: dict[str, float] = {}
    with torch.no_grad():
        tf = __import__(type(layer).__module__ if world == 1 else layer.transformers_module, fromlist=["x"])
        kernel = delta_rule_kernel("gdn", tf.torch_chunk_gated_delta_rule, h.device)
        mixed = layer.in_proj_qkv(h)
        t0 = time.perf_counter()
        conv = causal_conv_shard(mixed.transpose(1, 2), layer.conv1d.weight.squeeze(1), None, group=group,
                                 sharding=args.sharding)
        phases["conv+halo"] = time.perf_counter() - t0
        q, k, v = torch.split(tf.ACT2FN["silu"](conv).transpose(1, 2), [layer.key_dim, layer.key_dim,
                                                                        layer.value_dim], dim=-1)
        q, k = (t.reshape(1, -1, layer.num_k_heads, layer.head_k_dim) for t in (q, k))
        v = v.reshape(1, -1, layer.num_v_heads, layer.head_v_dim)
        beta = layer.in_proj_b(h).sigmoid()
        g = -layer.A_log.float().exp() * torch.nn.functional.softplus(layer.in_proj_a(h).float() + layer.dt_bias)
        opts = {"g": g, "beta": beta, "output_final_state": True, "use_qk_l2norm_in_kernel": True}
        if world == 1:
            t0 = time.perf_counter()
            kernel(q, k, v, initial_state=None, **opts)
            phases["scan"] = time.perf_counter() - t0
        else:
            dk, dv, heads = layer.head_k_dim, layer.head_v_dim, layer.num_v_heads
            layout = scan_layout(q.shape[1], group=group, sharding=args.sharding)
            c = layout.chunk_len
            t0 = time.perf_counter()
            eye = torch.eye(dk).expand(1, heads, dk, dk)
            start = torch.cat([eye.new_zeros(1, heads, dk, dv), eye], dim=-1)
            finals = []
            for j in range(layout.chunks):
                sl = slice(j * c, (j + 1) * c)
                wide = torch.cat([v[:, sl], v.new_zeros(1, c, heads, dk)], dim=-1)
                finals.append(kernel(q[:, sl], k[:, sl], wide, initial_state=start,
                                     **{**opts, "g": g[:, sl], "beta": beta[:, sl]})[1])
            phases["summary scan"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            state = torch.stack(finals)
            init = chunk_initial_states(state[..., dv:], state[..., :dv], apply=torch.matmul, group=group,
                                        sharding=args.sharding, seq_len=layout.seq_len)
            phases["all-gather+fold"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            for j in range(layout.chunks):
                sl = slice(j * c, (j + 1) * c)
                kernel(q[:, sl], k[:, sl], v[:, sl], initial_state=init[j], **{**opts, "g": g[:, sl],
                                                                                  "beta": beta[:, sl]})
            phases["re-run"] = time.perf_counter() - t0
    return {"timing": timing, "bytes": traffic.collective_bytes + traffic.p2p_bytes, "peak": peak,
            "phases": phases}


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
    args = p.parse_args(argv)
    seq_lens = [int(s) for s in args.seq_lens.split(",")]
    info = machine_info()
    print(f"# one GDN layer (Qwen3.5), hidden {args.hidden}, {args.k_heads} key / {args.v_heads} value heads of "
          f"{args.head_dim}, P={args.world} {args.sharding}, fwd+bwd; {info['cpu_model']}, {info['cpu_cores']} cores, load {info['load_avg_1_5_15']}")
    rows = []
    with RankPool(1) as one, RankPool(args.world) as pool:
        for seq in seq_lens:
            base = one.run(_task, args, seq)[0]
            sp = pool.run(_task, args, seq)
            t1 = combine([base["timing"]])["time_s"]
            tp = combine([r["timing"] for r in sp])["time_s"]
            rows.append({
                "S": seq, "one process": f"{t1:.3f} s", f"P={args.world}": f"{tp:.3f} s",
                "ideal (1/P)": f"{t1 / args.world:.3f} s", "x ideal": f"{tp * args.world / t1:.2f}",
                "bytes/rank": fmt_bytes(max(r["bytes"] for r in sp)),
                "peak/rank": fmt_bytes(max(r["peak"] for r in sp)), "peak one": fmt_bytes(base["peak"]),
                "peak ratio": f"{max(r['peak'] for r in sp) / base['peak']:.2f}",
                "fwd phases (rank 0)": ", ".join(f"{k} {v:.3f}" for k, v in sp[0]["phases"].items()),
                "fwd scan one": f"{base['phases']['scan']:.3f}",
            })
    columns = [(k, k) for k in rows[0]]
    print(format_table(rows, columns))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
