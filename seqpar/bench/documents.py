"""Packed documents, windows and the balanced layout: ``python -m seqpar.bench.documents`` (issue 10).

Three figures, printed as markdown tables (``--json PATH`` also writes them):

1. Time: one process, fp32 forward + backward of ``seqpar.attention`` at equal S: dense causal (the
   SDPA path) against documents of mean length S/8 (equal and long-tailed lengths) and a causal
   window of S/8, on the planner's pieces. The work is about 1/8 of dense causal.
2. Balance: per-rank visible pairs max/mean, causal, documents log-uniform 64..S/2, zigzag against
   the balanced layout, P = 2, 4, 8 (counted from the attention planner's calls).
3. Bytes: the ring's bytes per rank on P = 4 ThreadRing virtual ranks (contiguous, causal), against
   the hop plan's theory (per block: how far it travels) and the dense ring.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Sequence

import torch

import seqpar
from seqpar.attn.common import AttentionOptions, block_calls, block_hops
from seqpar.attn.masks import visible_pair_count
from seqpar.attn.ring import ring_attention_backward, ring_attention_forward
from seqpar.comm.ring import ThreadRing
from seqpar.sequence.boundaries import host_boundaries
from seqpar.sequence.sharding import shard_index

__all__ = ["main", "time_documents", "balance", "ring_bytes", "ring_bytes_theory"]


def _equal_docs(seq: int, n: int) -> list[int]:
    return [seq * i // n for i in range(n + 1)]


def _long_tailed(seq: int, lo: int, hi: int, seed: int) -> list[int]:
    rng, cu = random.Random(seed), [0]
    while cu[-1] < seq:
        cu.append(min(seq, cu[-1] + int(math.exp(rng.uniform(math.log(lo), math.log(hi))))))
    return cu


def _fwd_bwd_seconds(seq: int, heads: int, dim: int, repeats: int, **kwargs: object) -> float:
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, heads, seq, dim, generator=g) for _ in range(4))
    times = []
    for _ in range(repeats + 1):  # the first run warms up
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        t0 = time.perf_counter()
        seqpar.attention(qq, kk, vv, causal=True, **kwargs).backward(dout)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def time_documents(seq: int, heads: int, dim: int, repeats: int) -> list[dict]:
    """Seconds per forward + backward, one process; ratio against dense causal."""
    tailed = _long_tailed(seq, seq // 32, seq // 4, seed=1)
    variants = [
        ("dense causal (SDPA)", {}),
        ("8 equal documents (S/8)", {"cu_seqlens": torch.tensor(_equal_docs(seq, 8))}),
        (f"long-tailed, {len(tailed) - 1} documents (mean S/{seq * (len(tailed) - 1) // seq})",
         {"cu_seqlens": torch.tensor(tailed)}),
        ("causal window S/8", {"window": seq // 8}),
    ]
    rows, dense = [], None
    for name, kwargs in variants:
        s = _fwd_bwd_seconds(seq, heads, dim, repeats, **kwargs)
        dense = dense if dense is not None else s
        cu = kwargs.get("cu_seqlens")
        opts = AttentionOptions(causal=True, scale=1.0, window=kwargs.get("window"),
                                cu_seqlens=host_boundaries(cu))
        work = visible_pair_count(block_calls(opts, 1, 0, 0, seq)) / (seq * (seq + 1) // 2)
        rows.append({"variant": name, "seconds": round(s, 3), "vs_dense": round(s / dense, 3),
                     "work_vs_dense": round(work, 3)})
    return rows


def balance(seq: int, worlds: Sequence[int], mixes: int) -> list[dict]:
    """Per-rank visible pairs max/mean (mean and worst over ``mixes`` long-tailed mixes)."""
    rows = []
    for world in worlds:
        for sharding in ("contiguous", "zigzag", "balanced"):
            ratios = []
            for seed in range(mixes):
                cu = tuple(_long_tailed(seq, 64, seq // 2, seed))
                opts = AttentionOptions(causal=True, scale=1.0, sharding=sharding, cu_seqlens=cu)
                work = [sum(visible_pair_count(block_calls(opts, world, r, s, seq // world)) for s in range(world))
                        for r in range(world)]
                ratios.append(max(work) * world / sum(work))
            rows.append({"P": world, "sharding": sharding, "mean": round(statistics.mean(ratios), 3),
                         "worst": round(max(ratios), 3)})
    return rows


def ring_bytes(world: int, seq_local: int, heads: int, dim: int) -> list[dict]:
    """Bytes each rank's ring sends (forward + backward, fp32) and the plan's theory."""
    seq = world * seq_local
    cases = [
        ("dense causal", None, None),
        ("documents < shard", _equal_docs(seq, 3 * world + 1), None),
        ("a document over 3 shards", [0, seq_local // 2, seq_local // 2 + 2 * seq_local + 1, seq], None),
        ("window < shard", None, seq_local // 2),
    ]
    rows = []
    block = 2 * heads * seq_local * dim * 4  # K and V of one rank, fp32
    for name, cu, window in cases:
        opts = AttentionOptions(causal=True, scale=dim ** -0.5, window=window,
                                cu_seqlens=None if cu is None else tuple(cu))
        g = torch.Generator().manual_seed(0)
        full = [torch.randn(1, heads, seq, dim, generator=g) for _ in range(4)]

        def body(comm, full: list = full, opts: AttentionOptions = opts) -> int:  # noqa: ANN001
            q, k, v, dout = (t[:, :, shard_index(seq, comm.rank, world)] for t in full)
            out, lse = ring_attention_forward(q, k, v, comm, opts)
            ring_attention_backward(dout, q, k, v, out, lse, comm, opts)
            return comm.bytes_sent

        sent = ThreadRing(world, timeout=120).run(body)
        hops = block_hops(opts, world, seq_local)
        rows.append({"case": name, "hops per block": list(hops), "bytes per rank": sent,
                     "theory": ring_bytes_theory(hops, world, block), "dense ring": 3 * (world - 1) * block})
    return rows


def ring_bytes_theory(hops: Sequence[int], world: int, block: int) -> list[int]:
    """Bytes per rank from the hop plan: rank r passes block r - s on at step s while s + 1 <= that
    block's hops (forward, and again in the backward) and sends its accumulator once (on, or home
    after the last hop) for every s in 1..hops; K/V and accumulators are both fp32 here."""
    out = []
    for r in range(world):
        kv = sum(1 for s in range(world) if s + 1 <= hops[(r - s) % world])
        dkv = sum(1 for s in range(1, world) if s <= hops[(r - s) % world])
        out.append((2 * kv + dkv) * block)
    return out


def _table(rows: list[dict]) -> str:
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m seqpar.bench.documents", description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=8192, help="sequence length of the timing (default 8192)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--balance-seq", type=int, default=32768)
    p.add_argument("--mixes", type=int, default=20)
    p.add_argument("--json", default=None, help="also write the figures here")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    res = {
        "time": time_documents(args.seq, args.heads, args.head_dim, args.repeats),
        "balance": balance(args.balance_seq, (2, 4, 8), args.mixes),
        "bytes": ring_bytes(4, 256, 2, 16),
        "command": " ".join(["python -m seqpar.bench.documents", *argv]),
        "torch": torch.__version__, "threads": args.threads,
    }
    for key in ("time", "balance", "bytes"):
        print(f"\n{key}\n" + _table(res[key]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
