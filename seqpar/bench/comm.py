"""The ``comm`` suite: bytes each rank sends per attention call (one layer), against the theory.

Bytes are counted inside the ranks by :func:`seqpar.testing.traffic.counting`, which wraps
torch.distributed's own entry points (and seqpar's collective helpers) while one forward+backward
runs, so the figure is what goes on the wire, not what seqpar's counters say; its docstring gives the
bytes charged per call.

Theory per rank, with ``B`` one rank's K (or V) block in the input dtype and ``B32`` the same in fp32:

- ring:      forward 2 (P-1) B;   backward 2 (P-1) B + 2 (P-1) B32 (the K/V again, the travelling dK/dV)
- allgather: forward 2 (P-1) B;   backward 2 (P-1) B + 2 (P-1) B32 (re-gather, reduce-scatter dK/dV)
- ulysses:   forward (P-1)/P (2 Q + 2 K) (all-to-all of q, k, v and of the output); backward the same
- seqpar_ulysses (u = P) / hybrid (u = 2, ring over P/2 super-ranks), with ``h = max(kv_heads / u, 1)``
  K/V heads per rank and ``Qr``, ``Kr`` one rank's q / one K/V head's block: forward (u-1)/u ((2 q_heads
  + 2 u h) Kr) (one packed q/k/v all-to-all + the output's); backward the same (dout + packed dq/dk/dv);
  the hybrid adds the ring across super-ranks on blocks of h heads x u L rows: 2 (P/u - 1) blocks
  forward, 2 (P/u - 1) blocks + 2 (P/u - 1) fp32 dK/dV backward
  With uneven heads (``u`` does not split them evenly, :func:`seqpar.runtime.grid.ulysses_shares`) each
  Ulysses rank j sends its q/k/v blocks of every other rank's share and its own share's output (backward:
  the others' dout blocks and its own dq/dk/dv), so ranks differ: theory and measurement are the largest
  rank's (:func:`_ulysses_rank_heads`; the even case is the formula above)
- dilated:   see :mod:`seqpar.attn.dilated` (depends on the pattern); measured only

plus a few bytes for seqpar's cross-rank shape check. The suite also times one K/V block exchange
between ring neighbours to show what the transport costs next to the compute of a block.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from seqpar.bench.attention import (
    BenchShape,
    dilated_problem,
    forward_fn,
    make_inputs,
    shape_from_args,
)
from seqpar.bench.runner import PoolSet, RankContext, suite_pools, sync
from seqpar.testing.traffic import counting

__all__ = ["CommConfig", "count_bytes", "theory", "configure", "count", "run", "render", "plots"]

_MODES = ("ring", "allgather", "ulysses", "seqpar_ulysses", "hybrid", "dilated")


@dataclass(frozen=True)
class CommConfig:
    """What one ``comm`` run covers."""

    seq_lens: list[int]
    worlds: list[int]
    causal: list[bool]
    shape: BenchShape
    seed: int = 0
    device: str = "cpu"
    repeats: int = 5


def count_bytes(ctx: RankContext, mode: str, seq_len: int, causal: bool, shape: BenchShape, seed: int) -> dict[str, int]:
    """Bytes this rank sends in one forward and one backward of ``mode``."""
    seq_local = seq_len // ctx.world_size
    if mode == "ulysses":
        from deepspeed.sequence.layer import DistributedAttention

        from seqpar.bench.peers import SDPALocal, deepspeed_ready, ulysses_inputs

        deepspeed_ready(ctx.device)
        attn = DistributedAttention(SDPALocal(causal), dist.group.WORLD, scatter_idx=2, gather_idx=1)
        q, k, v, dout = ulysses_inputs(shape, seq_local, ctx.device, seed + ctx.rank)

        def fwd() -> torch.Tensor:
            return attn(q, k, v, 0)
    else:
        f = forward_fn(mode, causal, seq_len, shape.head_chunks)
        q, k, v, dout = make_inputs(shape, seq_local, ctx.device, seed + ctx.rank)

        def fwd() -> torch.Tensor:
            return f(q, k, v)

    with counting(ctx.world_size) as sent:
        out = fwd()
        f = sent.snapshot()
        out.backward(dout)
    f_total, total = f.p2p_bytes + f.collective_bytes, sent.p2p_bytes + sent.collective_bytes
    return {"fwd": f_total, "bwd": total - f_total, "fwd_p2p": f.p2p_bytes, "bwd_p2p": sent.p2p_bytes - f.p2p_bytes}


def exchange_time(ctx: RankContext, seq_len: int, shape: BenchShape, seed: int, repeats: int) -> float:
    """Median seconds of one ring exchange of this rank's K and V blocks (send next, receive previous)."""
    from seqpar.comm.ring import RingComm

    comm = RingComm()
    _, k, v, _ = make_inputs(shape, seq_len // ctx.world_size, ctx.device, seed + ctx.rank, requires_grad=False)
    times = []
    for i in range(repeats + 1):
        dist.barrier()
        sync(ctx.device)
        t0 = time.perf_counter()
        comm.exchange([k, v]).wait()
        sync(ctx.device)
        if i:  # the first exchange sets up the connections
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def theory(mode: str, seq_len: int, world: int, shape: BenchShape) -> dict[str, int] | None:
    """Bytes per rank per forward / backward from the formulas in the module docstring."""
    e = torch.tensor([], dtype=shape.torch_dtype).element_size()
    a = 8 if shape.torch_dtype == torch.float64 else 4
    elems_kv = shape.batch * shape.kv_heads * (seq_len // world) * shape.head_dim
    elems_q = shape.batch * shape.q_heads * (seq_len // world) * shape.head_dim
    if mode in ("ring", "allgather"):
        return {"fwd": 2 * (world - 1) * elems_kv * e, "bwd": 2 * (world - 1) * elems_kv * (e + a)}
    if mode == "ulysses":
        per = (2 * elems_q + 2 * elems_kv) * e * (world - 1) // world
        return {"fwd": per, "bwd": per}
    if mode in ("seqpar_ulysses", "hybrid"):
        u = world if mode == "seqpar_ulysses" else 2
        head = elems_kv // shape.kv_heads * e  # bytes of one head of one rank's rows
        fwd, bwd = zip(*(_ulysses_rank_heads(j, shape.q_heads, shape.kv_heads, u, world // u, a / e)
                         for j in range(u)))
        return {"fwd": round(max(fwd) * head), "bwd": round(max(bwd) * head)}
    return None


def _ulysses_rank_heads(j: int, q_heads: int, kv_heads: int, u: int, ring: int, acc: float) -> tuple[float, float]:
    """Ulysses rank ``j``'s (forward, backward) bytes in units of one head of one rank's rows in the input
    dtype, from the head shares (:func:`seqpar.runtime.grid.ulysses_shares`; even or not): forward, its
    q/k/v blocks for every other rank's share and its own heads' output rows for every other rank; backward,
    the other ranks' dout blocks and its own heads' packed dq/dk/dv; with ``ring`` > 1 super-ranks (the
    hybrid), its K/V heads over ``u`` ranks' rows around the ring, forward and backward, plus the travelling
    dK/dV in the accumulation dtype (``acc``: its element size over the input's)."""
    from seqpar.runtime.grid import ulysses_shares

    shares = [(q, kv) for _, q, _, kv in ulysses_shares(q_heads, kv_heads, u)]
    q_j, kv_j = shares[j]
    others = [s for r, s in enumerate(shares) if r != j]
    fwd = sum(q + 2 * kv for q, kv in others) + (u - 1) * q_j
    bwd = sum(q for q, _ in others) + (u - 1) * (q_j + 2 * kv_j)
    block = kv_j * u  # one of its K (or V) blocks on the ring
    return fwd + 2 * (ring - 1) * block, bwd + 2 * (ring - 1) * block * (1 + acc)


def configure(args: Any) -> CommConfig:
    """A :class:`CommConfig` from the CLI's resolved arguments."""
    worlds = args.worlds if "worlds" in args.explicit or args.preset == "tiny" else [2, 4]
    return CommConfig(
        seq_lens=list(args.seq_lens), worlds=list(worlds), causal=list(args.causal_list),
        shape=shape_from_args(args),
        seed=args.seed, device=args.device, repeats=max(3, args.repeats),
    )


def count(cfg: CommConfig) -> int:
    """Progress steps of :func:`run`."""
    return len(cfg.worlds) * len(cfg.seq_lens) * (len(cfg.causal) * len(_MODES) + 1)


def _problem(mode: str, seq_len: int, world: int, causal: bool, shape: BenchShape) -> str | None:
    if mode == "ulysses" and (shape.kv_heads % world or shape.q_heads % world):
        return f"Ulysses needs q_heads and kv_heads divisible by P={world}"
    if mode in ("seqpar_ulysses", "hybrid"):
        from seqpar.runtime.grid import ulysses_heads_problem

        u = world if mode == "seqpar_ulysses" else 2
        if mode == "hybrid" and (world < 4 or world % 2):
            return f"the (P/2) x 2 hybrid needs an even P >= 4, not P={world}"
        if problem := ulysses_heads_problem(shape.q_heads, shape.kv_heads, u):  # uneven shares run
            return f"q_heads={shape.q_heads}, kv_heads={shape.kv_heads} over {u} Ulysses ranks: {problem}"
    if mode == "dilated":
        return dilated_problem(seq_len, world, shape)
    if seq_len % (2 * world if causal else world):
        return f"S={seq_len} does not split into {2 * world if causal else world} chunks"
    return None


def run(cfg: CommConfig, progress: Callable[[str], None], *, pools: PoolSet | None = None) -> dict[str, Any]:
    """Count every mode's bytes at every (P, S, causal) and time a block exchange; returns the payload.

    ``pools``: rank pools to run on (left running); else each world size gets its own pool, closed before
    the next one starts."""
    from seqpar.runtime.grid import ulysses_shares, ulysses_split_even

    rows: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    exchanges: list[dict[str, Any]] = []
    for world in cfg.worlds:
        if cfg.device == "cuda" and torch.cuda.device_count() < world:
            skipped.append({"P": world, "reason": f"needs {world} GPUs, this machine has {torch.cuda.device_count()}"})
            continue
        with suite_pools(cfg.device, pools) as world_pools:
            for seq_len in cfg.seq_lens:
                for causal in cfg.causal:
                    for mode in _MODES:
                        progress(f"{mode} P={world} S={seq_len}")
                        why = _problem(mode, seq_len, world, causal, cfg.shape)
                        row: dict[str, Any] = {"mode": mode, "P": world, "S": seq_len, "causal": causal}
                        if why:
                            rows.append({**row, "status": "skipped", "reason": why})
                            continue
                        per_rank = world_pools.run(world, count_bytes, mode, seq_len, causal, cfg.shape, cfg.seed)
                        row.update(status="ok", fwd_bytes=max(r["fwd"] for r in per_rank),
                                   bwd_bytes=max(r["bwd"] for r in per_rank), per_rank=per_rank)
                        if mode in ("seqpar_ulysses", "hybrid"):
                            u = world if mode == "seqpar_ulysses" else 2
                            if not ulysses_split_even(cfg.shape.q_heads, cfg.shape.kv_heads, u):
                                # ranks hold different head counts and send different bytes: the row's
                                # figures (measured and theory) are the largest rank's
                                row["uneven_shares"] = [[q, kv] for _, q, _, kv in
                                                        ulysses_shares(cfg.shape.q_heads, cfg.shape.kv_heads, u)]
                        th = theory(mode, seq_len, world, cfg.shape)
                        if th:
                            row.update(theory_fwd=th["fwd"], theory_bwd=th["bwd"],
                                       vs_theory=(row["fwd_bytes"] + row["bwd_bytes"]) / (th["fwd"] + th["bwd"]))
                        rows.append(row)
                progress(f"exchange P={world} S={seq_len}")
                secs = max(world_pools.run(world, exchange_time, seq_len, cfg.shape, cfg.seed, cfg.repeats))
                nbytes = 2 * cfg.shape.batch * cfg.shape.kv_heads * (seq_len // world) * cfg.shape.head_dim \
                    * torch.tensor([], dtype=cfg.shape.torch_dtype).element_size()
                exchanges.append({"P": world, "S": seq_len, "bytes": nbytes, "seconds": secs,
                                  "GB_per_s": nbytes / secs / 1e9})
    return {"config": {"seq_lens": cfg.seq_lens, "worlds": cfg.worlds, "causal": cfg.causal,
                       "shape": asdict(cfg.shape), "device": cfg.device},
            "results": rows, "exchange": exchanges, "skipped": skipped}


def render(payload: dict[str, Any]) -> str:
    """Measured bytes per rank per layer against the theory, and the block-exchange timings."""
    from seqpar.bench.report import fmt_bytes, fmt_s, format_table

    ok = [r for r in payload["results"] if r["status"] == "ok"]
    rows = [{
        "mode": r["mode"], "P": r["P"], "S": r["S"], "causal": "yes" if r["causal"] else "no",
        "fwd": fmt_bytes(r["fwd_bytes"]), "tfwd": fmt_bytes(r.get("theory_fwd")),
        "bwd": fmt_bytes(r["bwd_bytes"]), "tbwd": fmt_bytes(r.get("theory_bwd")), "x": r.get("vs_theory"),
    } for r in ok]
    cols = [("mode", "mode"), ("P", "P"), ("S", "S"), ("causal", "causal"), ("fwd sent", "fwd"),
            ("theory", "tfwd"), ("bwd sent", "bwd"), ("theory", "tbwd"), ("x theory", "x")]
    out = ["comm: bytes sent per rank per attention call (measured at torch.distributed)", format_table(rows, cols)]
    uneven = {(r["mode"], r["P"]): r["uneven_shares"] for r in ok if r.get("uneven_shares")}
    for (mode, world), shares in uneven.items():
        out.append(f"{mode} P={world}: uneven Ulysses heads, (query, K/V) heads per Ulysses rank {shares}: the "
                   "ranks send different bytes; fwd / bwd are the largest rank's (measured and theory)")
    skipped = [r for r in payload["results"] if r["status"] == "skipped"]
    if skipped:
        out.append("not run:")
        out += [f"  {r['mode']} P={r['P']} S={r['S']}: {r['reason']}" for r in skipped]
    ex = [{"P": e["P"], "S": e["S"], "bytes": fmt_bytes(e["bytes"]), "t": fmt_s(e["seconds"]),
           "bw": f"{e['GB_per_s']:.2f} GB/s"} for e in payload["exchange"]]
    out += ["one ring exchange of a rank's K and V blocks (slowest rank, median):",
            format_table(ex, [("P", "P"), ("S", "S"), ("K+V bytes", "bytes"), ("time", "t"), ("bandwidth", "bw")])]
    out += [f"P={r['P']} not run: {r['reason']}" for r in payload.get("skipped", [])]
    return "\n".join(out)


def plots(payload: dict[str, Any], out_dir: str) -> list[str]:
    """Bytes per rank per layer (fwd+bwd) against S, measured and theory."""
    from seqpar.bench.report import plot_series

    series: dict[str, list[tuple[float, float]]] = {}
    for r in payload["results"]:
        if r["status"] != "ok" or r["causal"]:
            continue
        series.setdefault(f"{r['mode']} P={r['P']}", []).append((r["S"], (r["fwd_bytes"] + r["bwd_bytes"]) / 2**20))
        if r.get("theory_fwd") is not None:
            series.setdefault(f"{r['mode']} P={r['P']} (theory)", []).append(
                (r["S"], (r["theory_fwd"] + r["theory_bwd"]) / 2**20))
    path = plot_series(os.path.join(out_dir, "comm_bytes_vs_S.png"), series,
                       title="bytes sent per rank per attention call, fwd+bwd (non-causal)",
                       xlabel="total sequence length S", ylabel="MiB", logx=True, logy=True)
    return [path] if path else []
