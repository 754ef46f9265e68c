"""One rank's peak memory in a P-rank ring against one process's SDPA, and where each byte goes (issue 29).

``python -m seqpar.bench ring-memory [--worlds 4,8] [--seq-len 8192] [--heads 8] [--head-dim 64]
[--head-chunks auto] [--causal yes|no] [--dkv-wire-dtype fp32|bf16] [--out DIR]``

Method (issue 29's, item 7): CPU, fp32, batch 1. For each rank r of a P-rank ring, this process plays
r alone over :class:`~seqpar.comm.loopback.LoopbackComm` (it "receives" a copy of what it sends: the
buffers of a real rank, with the shapes and causal plan of rank r; overlap on, as by default). Inputs
``q, k, v`` ``(1, H, S/P, D)`` and ``dout`` are created inside the measured region; the figure is the
peak of tensor bytes over forward+backward (:class:`~seqpar.memory.tracker.TensorMemoryTracker`:
every live storage counted once, whichever op made it). ``ratio`` = the highest rank's peak / the peak
of ``F.scaled_dot_product_attention`` forward+backward on the whole sequence in one process, measured
the same way. ``causal`` runs zigzag sharding, full attention contiguous.

Breakdown: the storages alive at the peak, by role (in *blocks*: one block is ``(1, H, S/P, D)`` in
the input dtype), beside :func:`theory`. Roles are read from the storages themselves: the inputs,
``out`` and ``lse`` (the forward's), the gradients (``q.grad`` ...), what the communicator received
or was handed to send (K/V on the K/V channel; dK/dV accumulators on the others), the attention
kernels' outputs (:mod:`seqpar.kernels.local`), and ``other`` (anything else: widened or copied
temporaries). With ``--head-chunks 1`` the ring's dq, dk, dv are the own block's kernel outputs, which
autograd copies into q's layout after the step, so at the peak they read as kernel outputs: compare
totals there.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from seqpar.memory.tracker import TensorMemoryTracker

__all__ = ["RingMemoryCase", "ROLES", "sdpa_peak", "rank_peak", "theory", "run", "render", "main"]

ROLES = ("inputs", "out", "lse", "gradients", "K/V in flight", "dK/dV in flight", "kernel outputs", "other")
_KV_CHANNEL = 0  # seqpar.attn.ring's channel of the K/V blocks; its other channels carry dK/dV accumulators


@dataclass(frozen=True)
class RingMemoryCase:
    """One measured configuration: a ``world``-rank ring over ``seq_len`` tokens of ``heads`` query
    heads and ``kv_heads`` K/V heads of ``head_dim``, batch 1, fp32 on CPU; ``dkv_wire_dtype``: the ring's
    option of that name (the travelling dK/dV accumulators in fp32 or bf16)."""

    world: int
    seq_len: int
    causal: bool = True
    heads: int = 8
    kv_heads: int = 8
    head_dim: int = 64
    head_chunks: int | str = "auto"
    dkv_wire_dtype: str = "fp32"

    @property
    def seq_local(self) -> int:
        return self.seq_len // self.world

    @property
    def block_bytes(self) -> int:
        """One ``(1, heads, S/P, head_dim)`` fp32 block."""
        return self.heads * self.seq_local * self.head_dim * 4

    def options(self) -> Any:
        from seqpar.attn import resolve_head_chunks
        from seqpar.attn.common import AttentionOptions

        return AttentionOptions(causal=self.causal, scale=self.head_dim ** -0.5,
                                sharding="zigzag" if self.causal else "contiguous", overlap=True,
                                head_chunks=resolve_head_chunks(self.head_chunks, self.kv_heads),
                                dkv_wire_dtype=self.dkv_wire_dtype)


def _inputs(heads: int, kv_heads: int, seq: int, head_dim: int, seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(1, h, seq, head_dim, generator=g) for h in (heads, kv_heads, kv_heads, heads))
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), dout


def sdpa_peak(seq_len: int, *, causal: bool = True, heads: int = 8, kv_heads: int = 8, head_dim: int = 64) -> int:
    """Peak tensor bytes of one process's SDPA forward+backward on the whole sequence (inputs inside)."""
    tracker = TensorMemoryTracker("cpu", count_existing=False)
    with tracker:
        q, k, v, dout = _inputs(heads, kv_heads, seq_len, head_dim, 0)
        F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=heads != kv_heads).backward(dout)
        del q, k, v, dout
    return tracker.peak


class _LabelledComm:
    """A communicator that labels, for the tracker, what it receives and what it is handed to send."""

    def __init__(self, comm: Any, tracker: TensorMemoryTracker) -> None:
        self.comm, self.tracker = comm, tracker
        self.rank, self.world_size = comm.rank, comm.world_size

    def exchange(self, tensors: Sequence[Tensor], out: Sequence[Tensor] | None = None, *, channel: int = 0,
                 **kw: Any) -> Any:
        role = "K/V in flight" if channel == _KV_CHANNEL else "dK/dV in flight"
        if channel != _KV_CHANNEL and kw.get("send", True):  # sent K/V are the inputs or received blocks
            for t in tensors:
                self.tracker.label(t, role)
        with self.tracker.tag(role):
            return self.comm.exchange(tensors, out, channel=channel, **kw)


def rank_peak(case: RingMemoryCase, rank: int) -> dict[str, Any]:
    """Rank ``rank``'s peak over forward+backward and its breakdown by role (bytes)."""
    from seqpar.attn.ring import RingAttention
    from seqpar.comm.loopback import LoopbackComm

    tracker = TensorMemoryTracker("cpu", count_existing=False, record_peak=True)
    with tracker:
        with tracker.tag("inputs"):
            q, k, v, dout = _inputs(case.heads, case.kv_heads, case.seq_local, case.head_dim, rank)
        out = RingAttention.apply(q, k, v, _LabelledComm(LoopbackComm(rank, case.world), tracker), case.options())
        saved = {t.untyped_storage().data_ptr() for t in out.grad_fn.saved_tensors if t is not None}
        roles = {t.untyped_storage().data_ptr(): "inputs" for t in (q, k, v, dout)}
        roles[out.untyped_storage().data_ptr()] = "out"
        lse = saved - set(roles)  # the forward saves q, k, v, out and lse
        out.backward(dout)
        roles.update({p: "lse" for p in lse})
        roles.update({t.grad.untyped_storage().data_ptr(): "gradients" for t in (q, k, v)})
        del q, k, v, dout, out
    breakdown = dict.fromkeys(ROLES, 0)
    for label, nbytes, ptr in tracker.peak_live:
        if ptr in roles:
            role = roles[ptr]
        elif label in ROLES:
            role = label
        else:
            role = "kernel outputs" if label.startswith("local.py:") else "other"
        breakdown[role] += nbytes
    return {"rank": rank, "peak_bytes": tracker.peak, "breakdown": breakdown}


def theory(case: RingMemoryCase, rank: int) -> dict[str, int]:
    """What the schedule needs alive at the backward's peak, by role (bytes), for ``world >= 3``.

    Fixed: q, k, v, dout; out and lse; dq, dk, dv (with head chunks the passes accumulate straight into
    them). Per head chunk (1 / head_chunks of the heads), at the end of a remote hop s >= 2's kernels:
    the K/V block being computed on (and sent on), the next one arriving (not at the last hop), the
    dK/dV exchange in flight (the fp32 accumulator sent at hop s - 1 and the one arriving for this hop,
    waited right after these kernels), and this hop's kernel outputs (dq over its query rows, dk and dv
    over its key rows). Nothing else: no accumulators beside the gradients, no widened or zeroed
    temporaries. The maximum over the hops s >= 2 (the first hop has no dK/dV in flight). With
    ``dkv_wire_dtype="bf16"`` the dK/dV in flight are bf16 (half the bytes), and the ring's two one-element
    bf16 shape templates (4 bytes) read as ``other`` beside this.
    """
    from seqpar.attn.common import block_calls, block_hops

    if case.world < 3:
        raise ValueError(f"theory() counts a hop s >= 2, which a {case.world}-rank ring does not have; use P >= 3")
    opts = case.options()
    chunks, seq, d, f32 = opts.head_chunks, case.seq_local, case.head_dim, 4
    wire = 2 if case.dkv_wire_dtype == "bf16" else f32  # bytes of a travelling dK/dV element
    q_bytes, kv_bytes = case.heads * seq * d * f32, case.kv_heads * seq * d * f32
    fixed = {"inputs": 2 * q_bytes + 2 * kv_bytes, "out": q_bytes, "lse": case.heads * seq * f32,
             "gradients": q_bytes + 2 * kv_bytes}
    hops = block_hops(opts, case.world, seq)
    best: dict[str, int] | None = None
    for step in range(2, max(hops) + 1):
        src = (rank - step) % case.world
        calls = block_calls(opts, case.world, rank, src, seq)
        if step > hops[src] or not calls:
            continue
        if len(calls) != 1:
            raise ValueError(f"theory() counts one kernel call per remote hop; hop {step} of rank {rank} has {len(calls)}")
        rows = [(c.stop - c.start) for c in (calls[0].q_rows, calls[0].k_rows)]
        more_kv = step + 1 <= hops[(rank - 1 - step) % case.world]
        moment = {"K/V in flight": (2 + 2 * more_kv) * kv_bytes // chunks,
                  "dK/dV in flight": 4 * kv_bytes * wire // (f32 * chunks),
                  "kernel outputs": (rows[0] * q_bytes + 2 * rows[1] * kv_bytes) // (seq * chunks)}
        if best is None or sum(moment.values()) > sum(best.values()):
            best = moment
    return {**dict.fromkeys(ROLES, 0), **fixed, **(best or {})}


def run(cases: Sequence[RingMemoryCase], ranks: Sequence[int] | None = None) -> dict[str, Any]:
    """Measure every case (every rank unless ``ranks``); the JSON payload."""
    rows = []
    baselines: dict[tuple[int, bool], int] = {}
    for case in cases:
        key = (case.seq_len, case.causal)
        if key not in baselines:
            baselines[key] = sdpa_peak(case.seq_len, causal=case.causal, heads=case.heads, kv_heads=case.kv_heads,
                                       head_dim=case.head_dim)
        per_rank = []
        for r in (range(case.world) if ranks is None else [r for r in ranks if r < case.world]):
            res = rank_peak(case, r)
            if case.world >= 3:
                res["theory"] = theory(case, r)
            per_rank.append(res)
        top = max(per_rank, key=lambda x: x["peak_bytes"])
        rows.append({"P": case.world, "S": case.seq_len, "causal": case.causal, "heads": case.heads,
                     "kv_heads": case.kv_heads, "head_dim": case.head_dim, "dkv_wire_dtype": case.dkv_wire_dtype,
                     "head_chunks": case.options().head_chunks, "block_bytes": case.block_bytes,
                     "sdpa_peak_bytes": baselines[key], "peak_bytes": top["peak_bytes"], "peak_rank": top["rank"],
                     "ratio": top["peak_bytes"] / baselines[key], "ideal": 1 / case.world, "ranks": per_rank})
    return {"method": "one rank of a P-rank ring per process over LoopbackComm, inputs created inside, "
                      "TensorMemoryTracker peak of forward+backward; ratio = highest rank / one process's SDPA "
                      "forward+backward on the whole sequence, same tracker", "cases": rows}


def render(payload: dict[str, Any]) -> str:
    """The ratio per case, then each case's highest rank's breakdown at its peak vs theory, in blocks."""
    out = []
    for c in payload["cases"]:
        out.append(f"P={c['P']} S={c['S']} {'causal zigzag' if c['causal'] else 'full'} heads={c['heads']}/"
                   f"{c['kv_heads']}x{c['head_dim']} head_chunks={c['head_chunks']}: peak {c['peak_bytes'] / 2**20:.2f} "
                   f"MiB (rank {c['peak_rank']}) / sdpa {c['sdpa_peak_bytes'] / 2**20:.2f} MiB = {c['ratio']:.4f}x "
                   f"(ideal 1/P = {c['ideal']:.4f}, {c['ratio'] * c['P']:.3f}x of it)")
        for r in c["ranks"]:
            blk = c["block_bytes"]
            meas = " ".join(f"{k}={v / blk:.4g}" for k, v in r["breakdown"].items() if v)
            line = f"  rank {r['rank']}: {r['peak_bytes'] / blk:.4g} blocks: {meas}"
            if "theory" in r:
                th = r["theory"]
                diff = {k: (r["breakdown"][k] - th[k]) / blk for k in ROLES if r["breakdown"][k] != th[k]}
                line += f" | theory {sum(th.values()) / blk:.4g}" + (
                    "" if not diff else " (measured - theory: " + ", ".join(f"{k} {v:+.4g}" for k, v in diff.items()) + ")")
            out.append(line)
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m seqpar.bench ring-memory``: see the module docstring."""
    p = argparse.ArgumentParser(prog="python -m seqpar.bench ring-memory", description=__doc__.split("\n")[0])
    p.add_argument("--worlds", default="4,8", help="ring sizes P, comma-separated (default 4,8)")
    p.add_argument("--seq-len", type=int, default=8192, help="total sequence length S (default 8192)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--head-chunks", default="auto", help="'auto' (default: seqpar's default) or an integer")
    p.add_argument("--causal", choices=("yes", "no"), default="yes", help="yes: causal zigzag; no: full, contiguous")
    p.add_argument("--dkv-wire-dtype", choices=("fp32", "bf16"), default="fp32",
                   help="the ring's dkv_wire_dtype: what the travelling dK/dV accumulators are held in (default fp32)")
    p.add_argument("--ranks", default=None, help="only these ranks, comma-separated (default: every rank)")
    p.add_argument("--out", default=None, help="write DIR/ring_memory.json")
    a = p.parse_args(argv)
    chunks: int | str = a.head_chunks if a.head_chunks == "auto" else int(a.head_chunks)
    cases = [RingMemoryCase(int(w), a.seq_len, a.causal == "yes", a.heads, a.kv_heads or a.heads, a.head_dim, chunks,
                            a.dkv_wire_dtype) for w in a.worlds.split(",")]
    payload = run(cases, None if a.ranks is None else [int(r) for r in a.ranks.split(",")])
    payload["command"] = "python -m seqpar.bench ring-memory " + " ".join(sys.argv[1:] if argv is None else argv)
    print(render(payload), flush=True)
    if a.out:
        from seqpar.bench.report import machine_info, write_json

        os.makedirs(a.out, exist_ok=True)
        payload["machine"] = machine_info()
        write_json(os.path.join(a.out, "ring_memory.json"), payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
