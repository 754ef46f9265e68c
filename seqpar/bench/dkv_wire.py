"""The error of dK/dV on a bf16 wire against float64 (issue 29 §5): ``python -m seqpar.bench.dkv_wire``.

Runs the ring (forward and backward) on ``--world`` virtual ranks in one process
(:class:`~seqpar.comm.ring.ThreadRing`: the real ring code and kernels, one thread per rank) with
fp32 inputs, once per ``dkv_wire_dtype``, and compares out, dq, dk, dv with one float64 SDPA call on
the full sequence. Per wire it prints the norm-relative error ``|x - ref| / |ref|`` and the largest
element error relative to the largest reference element (in brackets), and the dK/dV bytes the backward
sent (all ranks); for scale, the same errors of one SDPA call on the whole sequence in bf16 (the error a
bf16 model has anyway). ``--out DIR`` writes ``DIR/dkv_wire.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from seqpar.attn.ring import AttentionOptions, ring_attention_backward, ring_forward
from seqpar.comm.ring import ThreadRing
from seqpar.sequence.sharding import chunk_ids, num_chunks

__all__ = ["measure", "main"]

_DKV_CHANNELS = (1, 2)  # seqpar.attn.ring's channels of the travelling and homecoming accumulators


class _Counting:
    """A ThreadRing rank's communicator that adds up the bytes it sends per channel."""

    def __init__(self, inner, sent: dict[int, int]) -> None:  # noqa: ANN001
        self.inner, self.rank, self.world_size, self.sent = inner, inner.rank, inner.world_size, sent
        self.bytes_sent = 0

    def exchange(self, tensors, out=None, *, channel=0, shift=1, send=True, recv=True):  # noqa: ANN001, ANN201
        if send:
            self.sent[channel] = self.sent.get(channel, 0) + sum(t.numel() * t.element_size() for t in tensors)
        return self.inner.exchange(tensors, out, channel=channel, shift=shift, send=send, recv=recv)


def _shard(x: torch.Tensor, rank: int, world: int, sharding: str) -> torch.Tensor:
    c = x.shape[2] // num_chunks(world, sharding)
    return torch.cat([x[:, :, i * c:(i + 1) * c] for i in chunk_ids(rank, world, sharding)], dim=2)


def _unshard(parts: Sequence[torch.Tensor], world: int, sharding: str) -> torch.Tensor:
    c = parts[0].shape[2] // len(chunk_ids(0, world, sharding))
    chunks = {}
    for rank, part in enumerate(parts):
        for j, i in enumerate(chunk_ids(rank, world, sharding)):
            chunks[i] = part[:, :, j * c:(j + 1) * c]
    return torch.cat([chunks[i] for i in sorted(chunks)], dim=2)


def measure(
    *, world: int = 4, seq_len: int = 4096, heads: int = 8, kv_heads: int = 8, head_dim: int = 64,
    causal: bool = True, sharding: str = "zigzag", seed: int = 0, wires: Sequence[str] = ("fp32", "bf16"),
) -> dict:
    """Errors of the ring's out/dq/dk/dv against float64, per wire dtype (see the module)."""
    g = torch.Generator().manual_seed(seed)
    full = {n: torch.randn(1, heads if n in ("q", "dout") else kv_heads, seq_len, head_dim, generator=g,
                           dtype=torch.float64) for n in ("q", "k", "v", "dout")}
    q, k, v = (full[n].clone().requires_grad_() for n in "qkv")
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=heads != kv_heads)
    out.backward(full["dout"])
    ref = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    result = {"world": world, "seq_len": seq_len, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
              "causal": causal, "sharding": sharding, "inputs": "fp32", "reference": "float64 SDPA", "wires": {}}
    for wire in wires:
        opts = AttentionOptions(causal=causal, scale=head_dim ** -0.5, sharding=sharding, dkv_wire_dtype=wire)

        def body(comm, opts=opts):  # noqa: ANN001, ANN202
            sent: dict[int, int] = {}  # this rank's bytes per channel (the forward uses channel 0 only)
            rank_comm = _Counting(comm, sent)
            q, k, v, dout = (_shard(full[n], comm.rank, world, sharding).float() for n in ("q", "k", "v", "dout"))
            out_acc, lse = ring_forward(q, k, v, rank_comm, opts)
            o = out_acc.to(q.dtype)
            return [o, *ring_attention_backward(dout, q, k, v, o, lse, rank_comm, opts), sent]

        start = time.perf_counter()
        per_rank = ThreadRing(world, timeout=600.0).run(body)
        seconds = time.perf_counter() - start
        dkv_bytes = sum(n for r in per_rank for ch, n in r[4].items() if ch in _DKV_CHANNELS)
        row = {"seconds": round(seconds, 2), "dkv_bytes": dkv_bytes}
        for j, name in enumerate(("out", "dq", "dk", "dv")):
            got = _unshard([per_rank[r][j] for r in range(world)], world, sharding).double()
            diff = got - ref[name]
            row[name] = {"norm_rel": (diff.norm() / ref[name].norm()).item(),
                         "max_rel": (diff.abs().max() / ref[name].abs().max()).item()}
        result["wires"][wire] = row
    # for scale: one process's SDPA on bf16 inputs, the error a bf16 model has anyway
    q, k, v = (full[n].bfloat16().requires_grad_() for n in "qkv")
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=heads != kv_heads)
    out.backward(full["dout"].bfloat16())
    low = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    result["sdpa_bf16_inputs"] = {
        name: {"norm_rel": ((low[name].double() - ref[name]).norm() / ref[name].norm()).item(),
               "max_rel": ((low[name].double() - ref[name]).abs().max() / ref[name].abs().max()).item()}
        for name in low}
    return result


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m seqpar.bench.dkv_wire", description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--causal", choices=("yes", "no"), default="yes")
    p.add_argument("--sharding", choices=("contiguous", "zigzag"), default="zigzag")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="directory for dkv_wire.json")
    args = p.parse_args(argv)
    result = measure(world=args.world, seq_len=args.seq_len, heads=args.heads,
                     kv_heads=args.kv_heads or args.heads, head_dim=args.head_dim, causal=args.causal == "yes",
                     sharding=args.sharding, seed=args.seed)
    result["command"] = " ".join(["python -m seqpar.bench.dkv_wire", *(argv if argv is not None else sys.argv[1:])])
    print(f"P={result['world']} S={result['seq_len']} heads={result['heads']}/{result['kv_heads']} "
          f"d={result['head_dim']} causal={result['causal']} {result['sharding']}, fp32 inputs vs float64")
    print("| wire | out | dq | dk | dv | dK/dV bytes |")
    print("|---|---|---|---|---|---|")
    for wire, row in result["wires"].items():
        cells = " | ".join(f"{row[n]['norm_rel']:.2e} ({row[n]['max_rel']:.1e})" for n in ("out", "dq", "dk", "dv"))
        print(f"| {wire} wire | {cells} | {row['dkv_bytes']} |")
    low = result["sdpa_bf16_inputs"]
    cells = " | ".join(f"{low[n]['norm_rel']:.2e} ({low[n]['max_rel']:.1e})" for n in ("out", "dq", "dk", "dv"))
    print(f"| for scale: one SDPA call on bf16 inputs | {cells} | |")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "dkv_wire.json"), "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
