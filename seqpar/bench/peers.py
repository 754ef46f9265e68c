"""The ``peers`` suite: what a user would pick instead, on the same shapes, in the same run.

- ``sdpa``: single-process SDPA on the full sequence (the reference; ideal = its time / P).
- ``seqpar ring`` / ``seqpar allgather``: :func:`seqpar.attention` (causal: zigzag).
- ``seqpar ulysses``: ``mode="ulysses"`` (contiguous shards: after its all-to-all each rank holds the
  whole sequence). ``seqpar hybrid``: ``mode="hybrid"`` on a (P/2) x 2 grid (Ulysses pairs, ring across
  them; causal: zigzag), at P >= 4.
- ``deepspeed ulysses``: ``deepspeed.sequence.layer.DistributedAttention`` with SDPA as its local
  attention. Its inputs are ``(batch, seq_local, heads, head_dim)`` (what it expects with
  ``scatter_idx=2, gather_idx=1, batch_dim_idx=0``); the local attention transposes to SDPA's layout
  and back (views). Contiguous sharding: after its all-to-all every rank holds the whole sequence for
  ``heads / P`` heads, so causal masking needs no load balancing. It needs ``kv_heads`` divisible by P.
- ``torch context_parallel``: ``torch.distributed.tensor.experimental.context_parallel`` around SDPA
  (its ring, with its own causal load balancer). On CUDA only: in torch 2.13 the CPU SDPA backward has
  no DTensor sharding strategy. On CPU the suite makes one toy attempt and records the error it gets
  as the reason (``--tiny`` reads DTensor's sharding registry instead: the attempt takes ~20 s).
- ``ring-flash-attn``: ``ring_flash_attn.zigzag_ring_flash_attn_func`` / ``ring_flash_attn_func``,
  when ``flash_attn`` and ``ring_flash_attn`` import and a GPU per rank exists.

Every peer is timed by the same :func:`~seqpar.bench.runner.time_step` (one thread per rank, warm-up,
repeats, median of the slowest rank) with the same seeds; one that cannot run is listed with why.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from seqpar.bench.attention import (
    BenchShape,
    Settings,
    make_inputs,
    run_case,
    shape_from_args,
    summarize_case,
)
from seqpar.bench.runner import (
    PoolError,
    PoolSet,
    RankContext,
    combine,
    merge_rounds,
    peak_memory,
    suite_pools,
    time_step,
)

__all__ = [
    "PEERS", "PeersConfig", "SDPALocal", "deepspeed_ready", "ulysses_inputs",
    "configure", "count", "run", "render", "plots",
]

PEERS = ("sdpa", "ring", "allgather", "seqpar_ulysses", "hybrid", "ulysses", "context_parallel", "ring_flash_attn")
_LABELS = {
    "sdpa": "single-process SDPA", "ring": "seqpar ring", "allgather": "seqpar allgather",
    "seqpar_ulysses": "seqpar ulysses", "hybrid": "seqpar hybrid (P/2 x 2)",
    "ulysses": "deepspeed ulysses", "context_parallel": "torch context_parallel", "ring_flash_attn": "ring-flash-attn",
}


@dataclass(frozen=True)
class PeersConfig:
    """What one ``peers`` run covers."""

    seq_lens: list[int]
    worlds: list[int]
    causal: list[bool]
    shape: BenchShape
    settings: Settings
    device: str = "cpu"
    attempt_cpu_context_parallel: bool = True
    """On CPU, run context_parallel once at a toy shape to record its real error (about 20 s: DTensor
    decomposes the CPU kernel before giving up); otherwise read torch's sharding registry."""


# ------------------------------------------------------------------------------------ Ulysses
class SDPALocal(nn.Module):
    """Ulysses' local attention: ``(batch, seq, heads, head_dim)`` in and out, SDPA inside."""

    def __init__(self, causal: bool) -> None:
        super().__init__()
        self.causal = causal

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        # (B, S, H/P, D) -> (B, H/P, S, D) views for SDPA, and back
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=self.causal,
            enable_gqa=q.shape[2] != k.shape[2],
        )
        return out.transpose(1, 2)


def deepspeed_ready(device: torch.device) -> None:
    """Start DeepSpeed's communication layer on the running process group (once per process)."""
    import deepspeed

    if not deepspeed.comm.is_initialized():
        deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo", verbose=False)


def ulysses_inputs(shape: BenchShape, seq_local: int, device: torch.device, seed: int) -> tuple[Tensor, ...]:
    """``q, k, v, dout`` with the same values as :func:`make_inputs`, laid out ``(batch, seq_local, heads, head_dim)``
    as DeepSpeed's ``DistributedAttention`` takes them."""
    q, k, v, dout = make_inputs(shape, seq_local, device, seed, requires_grad=False)
    return tuple(x.transpose(1, 2).contiguous().requires_grad_(i < 3) for i, x in enumerate((q, k, v, dout)))


def _time_and_peak(
    ctx: RankContext, shape: BenchShape, seq_local: int, settings: Settings,
    call: Callable[[Tensor, Tensor, Tensor], Tensor],
) -> dict[str, Any]:
    """Time fwd+bwd of ``call(q, k, v)`` on ``(batch, seq_local, heads, head_dim)`` inputs, and (with
    ``settings.memory``) its peak memory over one step on fresh inputs."""
    def inputs() -> tuple[Tensor, ...]:
        return ulysses_inputs(shape, seq_local, ctx.device, settings.seed + ctx.rank)

    q, k, v, dout = inputs()

    def step() -> None:
        call(q, k, v).backward(dout)
        q.grad = k.grad = v.grad = None

    rec: dict[str, Any] = {
        "timing": time_step(step, device=ctx.device, warmup=settings.warmup, repeats=settings.repeats)
    }
    if settings.memory:
        def fresh_step() -> None:
            q2, k2, v2, dout2 = inputs()
            call(q2, k2, v2).backward(dout2)

        rec["peak_bytes"] = peak_memory(fresh_step, ctx.device)
    return rec


def run_ulysses(ctx: RankContext, seq_len: int, causal: bool, shape: BenchShape, settings: Settings) -> dict[str, Any]:
    """Time DeepSpeed Ulysses forward+backward on this rank (contiguous shards)."""
    from deepspeed.sequence.layer import DistributedAttention

    deepspeed_ready(ctx.device)
    seq_local = seq_len // ctx.world_size
    attn = DistributedAttention(SDPALocal(causal), dist.group.WORLD, scatter_idx=2, gather_idx=1)

    return _time_and_peak(ctx, shape, seq_local, settings, lambda q, k, v: attn(q, k, v, 0))


# ------------------------------------------------------------------------ torch context_parallel
def run_context_parallel(ctx: RankContext, seq_len: int, causal: bool, shape: BenchShape, settings: Settings) -> dict[str, Any]:
    """Time PyTorch's ``context_parallel`` (SDPA inside the context) on this rank.

    Every rank builds the *full* inputs from one seed; the context shards them in place (its own
    load-balanced layout under causal masking). Gradients are switched on inside the context (it
    refuses buffers that require grad)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import _cp_options

    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))

    def sharded_step(body: Callable[[Tensor, Tensor, Tensor, Tensor], None]) -> None:
        q, k, v, dout = make_inputs(shape, seq_len, ctx.device, settings.seed, requires_grad=False)
        # torch balances the load only for causal masks: its CUDA ring raises "Load balancing requires
        # `is_causal=True`" for a full mask with balancing on (the default), so it is on for causal only
        # (the option is module state of torch's: restored after the step)
        balanced = _cp_options.enable_load_balance
        _cp_options.enable_load_balance = causal
        try:
            with context_parallel(mesh, buffers=[q, k, v, dout], buffer_seq_dims=[2, 2, 2, 2],
                                  no_restore_buffers={q, k, v, dout}):
                body(q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), dout)
        finally:
            _cp_options.enable_load_balance = balanced

    rec: dict[str, Any] = {}

    def timed(q: Tensor, k: Tensor, v: Tensor, dout: Tensor) -> None:
        def step() -> None:
            F.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(dout)
            q.grad = k.grad = v.grad = None

        rec["timing"] = time_step(step, device=ctx.device, warmup=settings.warmup, repeats=settings.repeats)

    sharded_step(timed)
    if settings.memory:
        def measured(q: Tensor, k: Tensor, v: Tensor, dout: Tensor) -> None:
            def step() -> None:
                F.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(dout)
            # the full-sequence inputs exist before sharding; count what the step itself holds
            rec["peak_bytes"] = peak_memory(step, ctx.device)

        sharded_step(measured)
    return rec


# ------------------------------------------------------------------------------- ring-flash-attn
def _ring_flash_problem(device: str) -> str | None:
    for mod in ("flash_attn", "ring_flash_attn"):
        try:
            importlib.import_module(mod)
        except Exception as e:  # noqa: BLE001 - reported as the reason
            return f"`import {mod}` fails ({type(e).__name__}: {e}); it needs CUDA and the flash-attn wheels"
    if device != "cuda":
        return "ring-flash-attn runs flash-attn CUDA kernels only (CPU run)"
    return None


def run_ring_flash(ctx: RankContext, seq_len: int, causal: bool, shape: BenchShape, settings: Settings) -> dict[str, Any]:
    """Time ring-flash-attn (zigzag under causal) on this rank; inputs ``(B, S_local, H, D)``."""
    import ring_flash_attn as rfa

    fn = rfa.zigzag_ring_flash_attn_func if causal else rfa.ring_flash_attn_func
    seq_local = seq_len // ctx.world_size

    return _time_and_peak(ctx, shape, seq_local, settings, lambda q, k, v: fn(q, k, v, causal=causal))


# ------------------------------------------------------------------------------------- the suite
def configure(args: Any) -> PeersConfig:
    """A :class:`PeersConfig` from the CLI's resolved arguments."""
    return PeersConfig(
        seq_lens=list(args.seq_lens), worlds=list(args.worlds), causal=list(args.causal_list),
        shape=shape_from_args(args),
        settings=Settings(warmup=args.warmup, repeats=args.repeats, seed=args.seed, memory=not args.no_memory,
                          rounds=args.rounds),
        device=args.device, attempt_cpu_context_parallel=args.preset != "tiny",
    )


def count(cfg: PeersConfig) -> int:
    """Progress steps of :func:`run` (one per peer and case)."""
    n = len(cfg.seq_lens) * len(cfg.causal)
    return (n + n * len(cfg.worlds) * (len(PEERS) - 1)) * cfg.settings.rounds


def _skip(rows: list[dict[str, Any]], peer: str, world: int, seq_len: int, causal: bool, reason: str) -> None:
    rows.append({"method": peer, "P": world, "S": seq_len, "causal": causal, "status": "skipped", "reason": reason})


def try_context_parallel(ctx: RankContext) -> str | None:
    """One toy ``context_parallel`` forward+backward; the error it raises here, or ``None``."""
    tiny = BenchShape(batch=1, q_heads=2, kv_heads=2, head_dim=8, dtype="float32")
    try:
        run_context_parallel(ctx, 8 * ctx.world_size, False, tiny, Settings(warmup=0, repeats=1, memory=False))
    except Exception as e:  # noqa: BLE001 - the message is the finding
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"
    return None


def _cp_registry_reason() -> str | None:
    """Why context_parallel cannot run backward on CPU, read off DTensor's sharding registry, or
    ``None`` when the CPU SDPA ops have strategies (or the private registry moved)."""
    try:
        from torch.distributed.tensor import DTensor

        prop = DTensor._op_dispatcher.sharding_propagator
        registered = {**prop.op_strategy_funcs, **prop.op_to_rules}
    except Exception:  # noqa: BLE001 - a private API; fall back to the attempt
        return None
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    if op in registered:
        return None
    return (f"no CPU path in torch {torch.__version__}: DTensor registers no sharding strategy for {op} "
            f"(the CPU SDPA backward); runs on CUDA")


def _cp_reason(error: str | None) -> str | None:
    if error is None:
        return None
    return f"no CPU path in torch {torch.__version__} (a toy attempt failed: {error}); runs on CUDA"


def _jobs(cfg: PeersConfig, rows: list[dict[str, Any]], pools: PoolSet) -> list[tuple[str, int, int, bool]]:
    """The runnable (peer, P, S, causal) cases; the others go into ``rows`` as skipped, with why."""
    dev = cfg.device
    ring_flash_why = _ring_flash_problem(dev)
    jobs = [("sdpa", 1, s, c) for s in cfg.seq_lens for c in cfg.causal]
    for world in cfg.worlds:
        cases = [(s, c) for s in cfg.seq_lens for c in cfg.causal]
        if dev == "cuda" and torch.cuda.device_count() < world:
            for s, c in cases:
                for peer in PEERS[1:]:
                    _skip(rows, peer, world, s, c, f"needs {world} GPUs, this machine has {torch.cuda.device_count()}")
            continue
        cp_why = None
        if dev == "cpu" and not cfg.attempt_cpu_context_parallel:
            cp_why = _cp_registry_reason()
        if dev == "cpu" and cp_why is None:  # both ranks fail alike on CPU; a hang ends at the timeout
            try:
                cp_why = _cp_reason(pools.run(world, try_context_parallel, timeout=120)[0])
            except PoolError as e:
                cp_why = _cp_reason(str(e).strip().splitlines()[-1][:300])
        uly_why = None
        if cfg.shape.kv_heads % world or cfg.shape.q_heads % world:
            uly_why = (f"Ulysses splits heads over ranks: q_heads={cfg.shape.q_heads} and kv_heads="
                       f"{cfg.shape.kv_heads} must be multiples of P={world}")
        from seqpar.runtime.grid import ulysses_heads_problem

        hq, hkv = cfg.shape.q_heads, cfg.shape.kv_heads
        # uneven head shares run (seqpar.runtime.grid.ulysses_shares); what stays refused is named
        uly_problem = ulysses_heads_problem(hq, hkv, world)
        pair_problem = ulysses_heads_problem(hq, hkv, 2)
        ours_why = {
            "seqpar_ulysses": None if uly_problem is None else f"q_heads={hq}, kv_heads={hkv} over P={world}: {uly_problem}",
            "hybrid": None if world >= 4 and world % 2 == 0 and pair_problem is None else
            f"the (P/2) x 2 hybrid needs an even P >= 4 (P={world}) and heads that split in two"
            + (f": {pair_problem}" if pair_problem else ""),
        }
        for s, c in cases:
            jobs += [("ring", world, s, c), ("allgather", world, s, c)]
            for mode, why in ours_why.items():
                if why:
                    _skip(rows, mode, world, s, c, why)
                else:
                    jobs.append((mode, world, s, c))
            for peer, why in (("ulysses", uly_why), ("context_parallel", cp_why), ("ring_flash_attn", ring_flash_why)):
                if why:
                    _skip(rows, peer, world, s, c, why)
                else:
                    jobs.append((peer, world, s, c))
    return jobs


_RUNNERS: dict[str, Callable[..., dict[str, Any]]] = {
    "ulysses": run_ulysses, "context_parallel": run_context_parallel, "ring_flash_attn": run_ring_flash,
}


def run(cfg: PeersConfig, progress: Callable[[str], None], *, pools: PoolSet | None = None) -> dict[str, Any]:
    """Every peer on every (S, P, causal), interleaved round by round; returns ``{"config", "results"}``
    (skipped peers inside, with the reason). ``pools``: rank pools to run on (left running), else the
    suite starts its own."""
    rows: list[dict[str, Any]] = []
    with suite_pools(cfg.device, pools) as pools:
        jobs = _jobs(cfg, rows, pools)
        raw: dict[tuple[str, int, int, bool], list[list[dict[str, Any]]]] = {j: [] for j in jobs}
        for rnd in range(cfg.settings.rounds):
            settings = cfg.settings.first_round(rnd)
            for job in jobs:
                peer, world, seq_len, causal = job
                progress(f"{peer} P={world} S={seq_len}{' causal' if causal else ''}")
                if peer in _RUNNERS:
                    per_rank = pools.run(world, _RUNNERS[peer], seq_len, causal, cfg.shape, settings)
                else:
                    per_rank = pools.run(world, run_case, peer, seq_len, causal, cfg.shape, settings)
                raw[job].append(per_rank)
    for (peer, world, seq_len, causal), rounds in raw.items():
        per_rank = merge_rounds(rounds)
        if peer in _RUNNERS:
            rows.append(_row(peer, seq_len, world, causal, per_rank))
        else:
            rows.append(summarize_case(peer, seq_len, world, causal, cfg.shape, per_rank))
    _attach(rows)
    from seqpar.runtime.grid import ulysses_shares, ulysses_split_even

    for row in rows:  # uneven heads: the ranks' shares differ, and the row is its slowest / largest rank's
        u = {"seqpar_ulysses": row["P"], "hybrid": 2}.get(row["method"])
        if row["status"] == "ok" and u and not ulysses_split_even(cfg.shape.q_heads, cfg.shape.kv_heads, u):
            row["uneven_shares"] = [[q, kv] for _, q, _, kv in ulysses_shares(cfg.shape.q_heads, cfg.shape.kv_heads, u)]
    return {"config": {"seq_lens": cfg.seq_lens, "worlds": cfg.worlds, "causal": cfg.causal,
                       "shape": asdict(cfg.shape), "settings": asdict(cfg.settings), "device": cfg.device},
            "results": rows}


def _row(peer: str, seq_len: int, world: int, causal: bool, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    row: dict[str, Any] = {"method": peer, "P": world, "S": seq_len, "causal": causal,
                           "sharding": "contiguous" if peer == "ulysses" else "library default", "status": "ok"}
    row.update(combine([r["timing"] for r in per_rank]))
    if "peak_bytes" in per_rank[0]:
        row["peak_bytes_per_rank"] = [r["peak_bytes"] for r in per_rank]
        row["peak_bytes"] = max(row["peak_bytes_per_rank"])
    return row


def _attach(rows: list[dict[str, Any]]) -> None:
    """ideal (sdpa / P), ratio to ideal, and each seqpar mode against Ulysses of the same case."""
    ref = {(r["S"], r["causal"]): r for r in rows if r["method"] == "sdpa" and r["status"] == "ok"}
    uly = {(r["P"], r["S"], r["causal"]): r for r in rows if r["method"] == "ulysses" and r["status"] == "ok"}
    for r in rows:
        if r["status"] != "ok" or r["method"] == "sdpa":
            continue
        base = ref.get((r["S"], r["causal"]))
        if base is not None:
            r["ideal_s"] = base["time_s"] / r["P"]
            r["ratio_to_ideal"] = r["time_s"] / r["ideal_s"]
            if r.get("peak_bytes") and base.get("peak_bytes"):
                r["mem_vs_single"] = r["peak_bytes"] / base["peak_bytes"]
        u = uly.get((r["P"], r["S"], r["causal"]))
        if u is not None and r["method"] != "ulysses":
            r["vs_ulysses"] = r["time_s"] / u["time_s"]


def render(payload: dict[str, Any]) -> str:
    """Results table (peers side by side) and the reasons for peers that did not run."""
    from seqpar.bench.report import fmt_bytes, fmt_s, format_table

    ok = [r for r in payload["results"] if r["status"] == "ok"]
    rows = [{
        "peer": _LABELS[r["method"]], "P": r["P"], "S": r["S"], "causal": "yes" if r["causal"] else "no",
        "time": fmt_s(r["time_s"]), "x_ideal": r.get("ratio_to_ideal"), "vs_uly": r.get("vs_ulysses"),
        "peak": fmt_bytes(r.get("peak_bytes")), "mem": r.get("mem_vs_single"),
    } for r in ok]
    cols = [("peer", "peer"), ("P", "P"), ("S", "S"), ("causal", "causal"), ("fwd+bwd", "time"),
            ("x ideal", "x_ideal"), ("x ulysses", "vs_uly"), ("peak/rank", "peak"), ("mem vs P=1", "mem")]
    out = ["peers: forward+backward per step (median of the slowest rank), same shapes and seeds",
           format_table(rows, cols)]
    uneven = {(r["method"], r["P"]): r["uneven_shares"] for r in ok if r.get("uneven_shares")}
    for (method, world), shares in uneven.items():
        out.append(f"{_LABELS[method]} P={world}: uneven Ulysses heads, (query, K/V) heads per Ulysses rank {shares}: "
                   "time and peak/rank are the slowest / largest rank's (the largest share's)")
    reasons: dict[tuple[str, str], list[str]] = {}
    for r in payload["results"]:
        if r["status"] == "skipped":
            reasons.setdefault((r["method"], r["reason"]), []).append(
                f"P={r['P']} S={r['S']}{' causal' if r['causal'] else ''}")
    if reasons:
        out.append("not run:")
        out += [f"  {_LABELS[m]} ({len(cases)} cases): {why}" for (m, why), cases in reasons.items()]
    return "\n".join(out)


def plots(payload: dict[str, Any], out_dir: str) -> list[str]:
    """time vs S per peer (one line per peer, P and masking)."""
    import os

    from seqpar.bench.report import plot_series

    series: dict[str, list[tuple[float, float]]] = {}
    for r in payload["results"]:
        if r["status"] == "ok":
            key = _LABELS[r["method"]] + ("" if r["P"] == 1 else f" P={r['P']}") + (" causal" if r["causal"] else "")
            series.setdefault(key, []).append((r["S"], r["time_s"]))
    path = plot_series(os.path.join(out_dir, "peers_time_vs_S.png"), series,
                       title="forward+backward per step: seqpar and peers", xlabel="total sequence length S",
                       ylabel="seconds", logx=True, logy=True)
    return [path] if path else []
