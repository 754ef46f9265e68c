"""The ``attention`` suite: forward+backward time and peak memory per rank, over S and P.

Methods, all on the same total sequence S and the same per-rank inputs:

- ``sdpa``: single-process ``F.scaled_dot_product_attention`` on the full sequence (P = 1), the
  reference; the *ideal* time of a P-rank method is ``sdpa time / P``.
- ``ring``, ``allgather``: :func:`seqpar.attention` (causal: zigzag sharding; full: contiguous).
- ``dilated``: :func:`seqpar.dilated_attention` with LongNet's pattern ``w = (S/4, S/2, S)``,
  ``r = (1, 2, 4)`` (contiguous sharding); its reference is the same call on one process.
- on request (``--methods``): ``seqpar_ulysses`` (``mode="ulysses"`` over all P ranks, contiguous) and
  ``hybrid`` (``mode="hybrid"`` on a (P/2) x 2 grid; zigzag when causal).

Each case is timed with :func:`seqpar.bench.runner.time_step` (one thread per rank, warm-up, repeats,
median of the slowest rank) and measured once more for peak tensor memory per rank (inputs, outputs
and their gradients included; MemTracker on CPU, ``max_memory_allocated`` on CUDA), with
:func:`seqpar.memory.attention.estimate_attention_memory`'s prediction beside it.

``--profile`` splits each method's step into phases (:mod:`seqpar.bench.phases`) by wrapping the functions the algorithms call
(block kernels, LSE merges, communication launches and waits, collectives, the cross-rank input check,
the ring's own bookkeeping, the all-to-alls' packing and unpacking copies), in wall and thread-CPU seconds, each
phase exclusive of the phases it calls; what is left (``other``) is Python, autograd and allocation.

On a single GPU, :func:`simulate_rank` plays one rank of a P-rank ring: a loopback communicator hands
the rank its own K/V back at every step, so it runs the exact ring code with blocks of the right shape
and the right causal plan; transfers are device copies on a side stream. It reports the step time with
and without overlap, compute alone, the copies alone, and the rank's peak memory.
"""

from __future__ import annotations

import importlib
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from seqpar.bench.phases import PhaseTimer, phase_patches, profile_step
from seqpar.bench.runner import (
    PoolSet,
    RankContext,
    combine,
    merge_rounds,
    peak_memory,
    suite_pools,
    time_step,
)
from seqpar.comm.loopback import LoopbackComm

__all__ = [
    "BenchShape",
    "Settings",
    "METHODS",
    "EXTRA_METHODS",
    "make_inputs",
    "dilated_pattern",
    "dilated_problem",
    "case_problem",
    "forward_fn",
    "PhaseTimer",
    "phase_patches",
    "run_case",
    "LoopbackComm",
    "simulate_rank",
    "run_suite",
]

METHODS = ("sdpa", "ring", "allgather", "dilated")
"""The methods the suite runs by default; ``sdpa`` is single-process only."""

EXTRA_METHODS = ("seqpar_ulysses", "hybrid")
"""Methods run only when asked for (``--methods``): seqpar's Ulysses over all P ranks (``u = P``, contiguous
sharding) and the (P/2) x 2 hybrid (Ulysses pairs, ring across them; zigzag when causal)."""

LINKS_GBPS = {"NVLink4 (450 GB/s)": 450.0, "PCIe5 x16 (64 GB/s)": 64.0, "IB NDR 400 Gb/s (50 GB/s)": 50.0}
"""One-direction link bandwidths for the simulated rank's transfer-time projection."""


@dataclass(frozen=True)
class BenchShape:
    """Attention shape shared by every method of a run (the sequence length varies per case)."""

    batch: int = 1
    q_heads: int = 8
    kv_heads: int = 8
    head_dim: int = 64
    dtype: str = "float32"
    """torch dtype name: float32, bfloat16, float16."""
    head_chunks: int | str = "auto"
    """``seqpar.attention``'s head_chunks for the ring and all-gather (an int or ``"auto"``)."""

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


@dataclass(frozen=True)
class Settings:
    """How each case is measured."""

    warmup: int = 1
    repeats: int = 3
    seed: int = 0
    memory: bool = True
    """Also run one step under the memory tracker (untimed)."""
    profile: bool = False
    """Also run one step with phase timers (untimed)."""
    rounds: int = 1
    """Interleave the cases this many times (A, B, C, A, B, C, ...); repeats of all rounds pool."""

    def first_round(self, rnd: int) -> Settings:
        """The settings of round ``rnd``: memory and profile passes only in the first round."""
        return self if rnd == 0 else replace(self, memory=False, profile=False)


def shape_from_args(args: Any) -> BenchShape:
    """The :class:`BenchShape` of the CLI's resolved arguments."""
    return BenchShape(batch=args.batch, q_heads=args.q_heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                      dtype=args.dtype, head_chunks=getattr(args, "head_chunks", "auto"))


def make_inputs(
    shape: BenchShape, seq_local: int, device: torch.device, seed: int, *, requires_grad: bool = True
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Seeded ``q (B, Hq, L, D)``, ``k, v (B, Hkv, L, D)`` leaves and ``dout`` like q."""
    g = torch.Generator().manual_seed(seed)
    dt = shape.torch_dtype

    def rnd(heads: int) -> Tensor:
        x = torch.randn(shape.batch, heads, seq_local, shape.head_dim, generator=g, dtype=torch.float32)
        return x.to(device=device, dtype=dt).requires_grad_(requires_grad)

    q, k, v = rnd(shape.q_heads), rnd(shape.kv_heads), rnd(shape.kv_heads)
    dout = rnd(shape.q_heads).detach()
    return q, k, v, dout


def dilated_pattern(seq_len: int) -> tuple[list[int], list[int]]:
    """LongNet-style mixture used by the suite: segments ``(S/4, S/2, S)``, rates ``(1, 2, 4)``."""
    return [seq_len // 4, seq_len // 2, seq_len], [1, 2, 4]


def dilated_problem(seq_len: int, world: int, shape: BenchShape) -> str | None:
    """Why the dilated method cannot run this case, or ``None``."""
    try:
        mod = importlib.import_module("seqpar.attn.dilated")
    except Exception as e:  # noqa: BLE001 - reported, not raised
        return f"seqpar.attn.dilated does not import: {type(e).__name__}: {e}"
    ws, rs = dilated_pattern(seq_len)
    try:
        mod.check_pattern(ws, rs, q_heads=shape.q_heads, seq_local=seq_len // world, world_size=world)
    except ValueError as e:
        return f"pattern {ws}/{rs} does not fit S={seq_len}, P={world}: {e}"
    return None


def case_problem(method: str, seq_len: int, world: int, causal: bool, shape: BenchShape) -> str | None:
    """Why ``method`` cannot run at (S, P), or ``None`` when it can."""
    if method not in METHODS + EXTRA_METHODS:
        return f"unknown method {method!r}; known: {list(METHODS + EXTRA_METHODS)}"
    if method == "sdpa":
        return None if world == 1 else "sdpa is the single-process reference (P = 1 only)"
    if method == "dilated":
        return dilated_problem(seq_len, world, shape)
    if world == 1:
        return f"{method} with P = 1 is plain SDPA (measured as 'sdpa')"
    from seqpar.runtime.grid import ulysses_heads_problem

    if method == "seqpar_ulysses" and (why := ulysses_heads_problem(shape.q_heads, shape.kv_heads, world)):
        return f"{shape.q_heads} query / {shape.kv_heads} K/V heads do not split over {world} Ulysses ranks: {why}"
    if method == "hybrid" and (world < 4 or world % 2 or ulysses_heads_problem(shape.q_heads, shape.kv_heads, 2)):
        return f"the (P/2) x 2 hybrid needs an even P >= 4 (P={world}) and at least 2 query heads, a multiple of the K/V heads"
    chunks = 2 * world if causal else world
    if seq_len % chunks:
        return f"S={seq_len} is not a multiple of {chunks} chunks"
    return None


def _sharding(method: str, causal: bool) -> str:
    # Ulysses holds the whole sequence after its all-to-all: causal work is balanced whatever the cut
    return "zigzag" if causal and method in ("ring", "allgather", "hybrid") else "contiguous"


# seqpar's Ulysses under a name that does not clash with the peers suite's "ulysses" (DeepSpeed's)
SEQPAR_MODE_OF_METHOD = {"seqpar_ulysses": "ulysses"}
_HYBRID_MANAGERS: dict[int, Any] = {}


def hybrid_manager(world: int) -> Any:
    """A (P/2) x 2 process-group manager for ``method="hybrid"`` (Ulysses pairs, ring across them), made
    once per pool: group creation is collective, every rank gets here on the same call. Made again when its
    groups were destroyed since (the test pools destroy what a task leaves before the next task, on every
    rank alike: a second hybrid measurement in one pool process, e.g. the memory suite's largest S, met a
    destroyed group)."""
    if world not in _HYBRID_MANAGERS or not _alive(_HYBRID_MANAGERS[world].sp_group):
        import seqpar

        _HYBRID_MANAGERS[world] = seqpar.init_process_groups(sp_size=world, ulysses_size=2 if world % 2 == 0 else 1)
    from seqpar.runtime.groups import set_default_manager

    set_default_manager(_HYBRID_MANAGERS[world])
    return _HYBRID_MANAGERS[world]


def _alive(group: Any) -> bool:
    """Whether ``group`` is still registered with torch.distributed (not destroyed)."""
    import torch.distributed as dist

    try:
        dist.get_backend(group)
    except (ValueError, RuntimeError):
        return False
    return True


def _group() -> Any:
    """The bench's SP group: the default manager's (a hybrid run sets one) if any, else the whole world
    (``None`` without torch.distributed). Explicit, since ``group=None`` without a manager on a world > 1
    is an error."""
    import torch.distributed as dist

    from seqpar.runtime.groups import default_manager

    manager = default_manager()
    if manager is not None:
        return manager.sp_group
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def forward_fn(
    method: str, causal: bool, seq_len: int, head_chunks: int | str = "auto"
) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """The attention call of ``method`` on this rank's shard."""
    if method == "sdpa":
        def sdpa(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])
        return sdpa
    if method == "dilated":
        from seqpar.attn.dilated import dilated_attention

        ws, rs = dilated_pattern(seq_len)

        def dilated(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            return dilated_attention(q, k, v, segment_lengths=ws, dilation_rates=rs, causal=causal, group=_group())
        return dilated
    import seqpar

    sharding = _sharding(method, causal)
    mode = SEQPAR_MODE_OF_METHOD.get(method, method)
    if mode == "hybrid":
        import torch.distributed as dist

        hybrid_manager(dist.get_world_size())

    def distributed(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return seqpar.attention(q, k, v, causal=causal, mode=mode, sharding=sharding, head_chunks=head_chunks,
                                group=None if mode == "hybrid" else _group())
    return distributed


# -------------------------------------------------------------------------------------- one case
def _timed(ctx: RankContext, fwd: Callable[[Tensor, Tensor, Tensor], Tensor], shape: BenchShape,
           seq_local: int, settings: Settings) -> dict[str, Any]:
    """Time (and optionally profile) forward+backward on inputs that die when this returns."""
    inputs = make_inputs(shape, seq_local, ctx.device, settings.seed + ctx.rank)
    q, k, v, dout = inputs

    def step() -> None:
        out = fwd(q, k, v)
        out.backward(dout)
        q.grad = k.grad = v.grad = None

    rec: dict[str, Any] = {"timing": time_step(step, device=ctx.device, warmup=settings.warmup, repeats=settings.repeats)}
    if settings.profile:
        rec["profile"] = profile_step(fwd, inputs, ctx.device)
    return rec


def run_case(ctx: RankContext, method: str, seq_len: int, causal: bool, shape: BenchShape, settings: Settings) -> dict[str, Any]:
    """Body run on every rank: time ``method``'s forward+backward, then (optionally) its peak memory
    and a phase profile. Returns this rank's raw records."""
    torch.manual_seed(settings.seed)
    seq_local = seq_len // ctx.world_size
    fwd = forward_fn(method, causal, seq_len, shape.head_chunks)
    rec = _timed(ctx, fwd, shape, seq_local, settings)
    if settings.memory:
        def fresh_step() -> None:
            q2, k2, v2, d2 = make_inputs(shape, seq_local, ctx.device, settings.seed + ctx.rank)
            fwd(q2, k2, v2).backward(d2)

        rec["peak_bytes"] = peak_memory(fresh_step, ctx.device)
    return rec


def summarize_case(
    method: str, seq_len: int, world: int, causal: bool, shape: BenchShape, per_rank: Sequence[dict[str, Any]]
) -> dict[str, Any]:
    """One result row from the ranks' raw records."""
    from seqpar.memory.attention import estimate_attention_memory

    row: dict[str, Any] = {
        "method": method, "P": world, "S": seq_len, "causal": causal,
        "sharding": _sharding(method, causal) if method != "sdpa" else "-", "status": "ok",
    }
    row.update(combine([r["timing"] for r in per_rank]))
    if "peak_bytes" in per_rank[0]:
        row["peak_bytes_per_rank"] = [r["peak_bytes"] for r in per_rank]
        row["peak_bytes"] = max(row["peak_bytes_per_rank"])
        if method != "dilated":
            est_mode = {"sdpa": "single", "seqpar_ulysses": "ulysses"}.get(method, method)
            row["estimate_bytes"] = estimate_attention_memory(
                seq_len, world_size=world, mode=est_mode, batch=shape.batch, q_heads=shape.q_heads,
                kv_heads=shape.kv_heads, head_dim=shape.head_dim, dtype=shape.torch_dtype, causal=causal,
                head_chunks=shape.head_chunks, ulysses_size=2 if method == "hybrid" else None,
            )
            row["estimate_error"] = row["estimate_bytes"] / row["peak_bytes"] - 1.0
    if "profile" in per_rank[0]:
        row["profile_per_rank"] = [r["profile"] for r in per_rank]
    return row


def attach_ideal(rows: list[dict[str, Any]]) -> None:
    """Add ``ideal_s`` (reference time / P), ``ratio_to_ideal`` and ``efficiency`` (= 1/ratio), and
    the memory ratio against the single-process reference, to every distributed row."""
    ref: dict[tuple[str, int, bool], dict[str, Any]] = {}
    for r in rows:
        if r["status"] == "ok" and r["P"] == 1:
            ref[(r["method"], r["S"], r["causal"])] = r
    for r in rows:
        if r["status"] != "ok" or r["P"] == 1:
            continue
        base = ref.get(("dilated" if r["method"] == "dilated" else "sdpa", r["S"], r["causal"]))
        if base is None:
            continue
        r["reference"] = base["method"]
        r["ideal_s"] = base["time_s"] / r["P"]
        r["ratio_to_ideal"] = r["time_s"] / r["ideal_s"]
        r["efficiency"] = r["ideal_s"] / r["time_s"]
        if base.get("cpu_s"):
            r["cpu_ratio_to_ideal"] = r["cpu_s"] / (base["cpu_s"] / r["P"])
        if "peak_bytes" in r and base.get("peak_bytes"):
            r["mem_vs_single"] = r["peak_bytes"] / base["peak_bytes"]


# ---------------------------------------------------------------------------- one-GPU simulation
def _simulated_times(ctx: RankContext, seq_local: int, world: int, rank: int, opts_kw: dict[str, Any],
                     shape: BenchShape, settings: Settings) -> dict[str, Any]:
    from seqpar.attn.ring import AttentionOptions, RingAttention

    q, k, v, dout = make_inputs(shape, seq_local, ctx.device, settings.seed)
    res: dict[str, Any] = {}
    for name, transfer, overlap in (("overlap_s", True, True), ("serial_s", True, False), ("compute_s", False, True)):
        opts = AttentionOptions(overlap=overlap, **opts_kw)

        def step(opts: AttentionOptions = opts, transfer: bool = transfer) -> None:
            out = RingAttention.apply(q, k, v, LoopbackComm(rank, world, transfer=transfer), opts)
            out.backward(dout)
            q.grad = k.grad = v.grad = None

        t = time_step(step, device=ctx.device, warmup=settings.warmup, repeats=settings.repeats)
        res[name] = statistics.median(t["wall_s"])
    # the rank's transfers alone: forward (P-1) K/V; backward (P-1) K/V + (P-1) fp32 dK/dV
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    kv = [k.detach().contiguous(), v.detach().contiguous()]
    dkv = [torch.zeros(k.shape, dtype=acc, device=k.device), torch.zeros(v.shape, dtype=acc, device=v.device)]
    comm = LoopbackComm(rank, world)

    def transfers() -> None:
        for _ in range(2 * (world - 1)):
            comm.exchange(kv).wait()
        for _ in range(world - 1):
            comm.exchange(dkv).wait()

    t = time_step(transfers, device=ctx.device, warmup=settings.warmup, repeats=settings.repeats)
    res["transfer_s"] = statistics.median(t["wall_s"])
    res["bytes_sent"] = comm.bytes_sent // (settings.warmup + settings.repeats)
    return res


def simulate_rank(
    ctx: RankContext, seq_len: int, world: int, causal: bool, shape: BenchShape, settings: Settings, rank: int = 0
) -> dict[str, Any]:
    """Time one rank of a ``world``-rank ring on this process's device (see :class:`LoopbackComm`).

    Returns:
        ``overlap_s`` / ``serial_s`` (fwd+bwd with transfers overlapped / waited at once),
        ``compute_s`` (no transfers), ``transfer_s`` (the rank's copies alone), ``overlap_hidden``
        (fraction of the transfer time the overlap hid: ``(serial - overlap) / (serial - compute)``),
        ``peak_bytes``, ``bytes_sent`` per step, and projected transfer times at :data:`LINKS_GBPS`.
    """
    from seqpar.attn import resolve_head_chunks
    from seqpar.attn.checks import GpuCall
    from seqpar.attn.ring import AttentionOptions, RingAttention

    seq_local = seq_len // world
    gpu = None
    if ctx.device.type == "cuda":  # "auto" as seqpar.attention decides it there
        from seqpar.kernels.backends import device_caps

        gpu = GpuCall(device_caps(ctx.device), shape.batch, shape.q_heads, shape.kv_heads, seq_local,
                      shape.head_dim, shape.head_dim, shape.torch_dtype.itemsize, world)
    opts_kw = {"causal": causal, "scale": shape.head_dim ** -0.5, "sharding": "zigzag" if causal else "contiguous",
               "head_chunks": resolve_head_chunks(shape.head_chunks, shape.kv_heads, gpu)}
    res: dict[str, Any] = {"S": seq_len, "P": world, "causal": causal, "seq_local": seq_local, "rank": rank,
                           "device": str(ctx.device)}
    res.update(_simulated_times(ctx, seq_local, world, rank, opts_kw, shape, settings))
    hideable = res["serial_s"] - res["compute_s"]
    res["overlap_hidden"] = (res["serial_s"] - res["overlap_s"]) / hideable if hideable > 0 else None
    res["link_transfer_s"] = {name: res["bytes_sent"] / (gbps * 1e9) for name, gbps in LINKS_GBPS.items()}
    if settings.memory:
        def fresh_step() -> None:
            q2, k2, v2, d2 = make_inputs(shape, seq_local, ctx.device, settings.seed)
            opts = AttentionOptions(overlap=True, **opts_kw)
            RingAttention.apply(q2, k2, v2, LoopbackComm(rank, world), opts).backward(d2)

        res["peak_bytes"] = peak_memory(fresh_step, ctx.device)
    return res


# -------------------------------------------------------------------------------------- the suite
@dataclass
class SuiteConfig:
    """What one ``attention`` run covers."""

    seq_lens: Sequence[int]
    worlds: Sequence[int]
    methods: Sequence[str]
    causal: Sequence[bool]
    shape: BenchShape
    settings: Settings
    device: str = "cpu"
    simulate: Sequence[tuple[int, int]] = ()
    """(S, P) pairs for :func:`simulate_rank`."""


def plan_cases(cfg: SuiteConfig) -> tuple[list[tuple[str, int, int, bool]], list[dict[str, Any]]]:
    """The runnable ``(method, P, S, causal)`` cases (P = 1 references first) and the skipped ones
    with their reasons."""
    cases, skipped = [], []
    for world in sorted({1, *cfg.worlds}):
        for seq_len in cfg.seq_lens:
            for causal in cfg.causal:
                for method in cfg.methods:
                    if method == "sdpa" and world != 1:
                        continue
                    if method not in ("sdpa", "dilated") and world == 1:
                        continue
                    if method == "dilated" and world == 1 and not any(p > 1 for p in cfg.worlds):
                        continue
                    why = case_problem(method, seq_len, world, causal, cfg.shape)
                    if why is None:
                        cases.append((method, world, seq_len, causal))
                    else:
                        skipped.append({"method": method, "P": world, "S": seq_len, "causal": causal,
                                        "status": "skipped", "reason": why})
    return cases, skipped


def run_suite(cfg: SuiteConfig, progress: Callable[[str], None] | None = None, *, total_hint: list[int] | None = None,
              pools: PoolSet | None = None) -> dict[str, Any]:
    """Run every case of ``cfg``; returns ``{"config", "results", "skipped", "simulated"}``.

    ``progress(label)`` is called before each case (the CLI drives a progress bar with it). ``pools``: rank
    pools to run on (left running), else the suite starts its own (:func:`~seqpar.bench.runner.suite_pools`).
    """
    cases, skipped = plan_cases(cfg)
    device = cfg.device
    runnable = []
    for method, world, seq_len, causal in cases:
        if device == "cuda" and torch.cuda.device_count() < world:
            skipped.append({"method": method, "P": world, "S": seq_len, "causal": causal, "status": "skipped",
                            "reason": f"needs {world} GPUs for a real NCCL ring, this machine has "
                                      f"{torch.cuda.device_count()}; see the one-rank simulation"})
        else:
            runnable.append((method, world, seq_len, causal))
    raw: dict[tuple[str, int, int, bool], list[list[dict[str, Any]]]] = {c: [] for c in runnable}
    simulated: list[dict[str, Any]] = []
    with suite_pools(device, pools) as pools:
        for rnd in range(cfg.settings.rounds):
            settings = cfg.settings.first_round(rnd)
            for method, world, seq_len, causal in runnable:
                if progress:
                    progress(f"{method} P={world} S={seq_len}{' causal' if causal else ''}")
                raw[(method, world, seq_len, causal)].append(
                    pools.run(world, run_case, method, seq_len, causal, cfg.shape, settings))
        for seq_len, sim_world in cfg.simulate:  # one process plays one rank of the ring
            for causal in cfg.causal:
                if progress:
                    progress(f"simulate rank of P={sim_world} S={seq_len}")
                simulated.append(pools.run(1, simulate_rank, seq_len, sim_world, causal, cfg.shape, cfg.settings)[0])
    rows = [summarize_case(m, s, w, c, cfg.shape, merge_rounds(raw[(m, w, s, c)])) for m, w, s, c in runnable]
    attach_ideal(rows)
    return {
        "config": {
            "seq_lens": list(cfg.seq_lens), "worlds": list(cfg.worlds), "methods": list(cfg.methods),
            "causal": list(cfg.causal), "shape": asdict(cfg.shape), "settings": asdict(cfg.settings),
            "device": device, "simulate": [list(x) for x in cfg.simulate],
        },
        "results": rows,
        "skipped": skipped,
        "simulated": simulated,
    }


def count_cases(cfg: SuiteConfig) -> int:
    """How many progress steps :func:`run_suite` will report."""
    cases, _ = plan_cases(cfg)
    return len(cases) * cfg.settings.rounds + len(cfg.simulate) * len(cfg.causal)


# ------------------------------------------------------------------------------------- reporting
def _label(r: dict[str, Any]) -> str:
    world = "" if r["P"] == 1 else f" P={r['P']}"
    return f"{r['method']}{world}{' causal' if r['causal'] else ''}"


def render(payload: dict[str, Any]) -> str:
    """The suite's stdout: a results table, skipped cases with reasons, the simulation, and the
    headline (ring at P = 2 as a multiple of the ideal)."""
    from seqpar.bench.report import fmt_bytes, fmt_s, format_table

    rows = []
    for r in payload["results"]:
        rows.append({
            "method": r["method"], "P": r["P"], "S": r["S"], "causal": "yes" if r["causal"] else "no",
            "sharding": r["sharding"], "time": fmt_s(r.get("time_s")), "ideal": fmt_s(r.get("ideal_s")),
            "x_ideal": r.get("ratio_to_ideal"), "cpu_x_ideal": r.get("cpu_ratio_to_ideal"),
            "peak": fmt_bytes(r.get("peak_bytes")), "est": fmt_bytes(r.get("estimate_bytes")),
            "est_err": None if r.get("estimate_error") is None else f"{r['estimate_error']:+.1%}",
            "mem_vs_1": r.get("mem_vs_single"),
        })
    cols = [("method", "method"), ("P", "P"), ("S", "S"), ("causal", "causal"), ("sharding", "sharding"),
            ("fwd+bwd", "time"), ("ideal", "ideal"), ("x ideal", "x_ideal"), ("cpu x ideal", "cpu_x_ideal"),
            ("peak/rank", "peak"), ("estimate", "est"), ("est err", "est_err"), ("mem vs P=1", "mem_vs_1")]
    out = ["attention: forward+backward per step (median of the slowest rank), peak tensor memory per rank",
           format_table(rows, cols)]
    if payload["skipped"]:
        out.append("not run:")
        out += [f"  {s['method']} P={s['P']} S={s['S']}{' causal' if s['causal'] else ''}: {s['reason']}"
                for s in payload["skipped"]]
    profiled = [r for r in payload["results"] if r.get("profile_per_rank")]
    if profiled:
        out.append("phases (rank 0, one profiled step; CPU seconds of the rank's thread):")
        for r in profiled:
            p = r["profile_per_rank"][0]
            phases = ", ".join(f"{k} {v:.3f}" for k, v in sorted(p["phases_cpu_s"].items(), key=lambda kv: -kv[1]))
            out.append(f"  {_label(r)} S={r['S']}: fwd {p['forward_s']:.3f} bwd {p['backward_s']:.3f} | {phases}")
    for sim in payload.get("simulated", []):
        hidden = "-" if sim["overlap_hidden"] is None else f"{sim['overlap_hidden']:.0%}"
        out.append(
            f"simulated rank {sim['rank']} of a P={sim['P']} ring, S={sim['S']} ({sim['seq_local']} local"
            f"{', causal' if sim['causal'] else ''}) on {sim['device']}: overlapped {fmt_s(sim['overlap_s'])}, "
            f"serial {fmt_s(sim['serial_s'])}, compute only {fmt_s(sim['compute_s'])}, copies alone "
            f"{fmt_s(sim['transfer_s'])} ({fmt_bytes(sim['bytes_sent'])}), overlap hid {hidden} of the transfer time, "
            f"peak {fmt_bytes(sim.get('peak_bytes'))}"
        )
    out += headline(payload)
    return "\n".join(out)


def headline(payload: dict[str, Any]) -> list[str]:
    """One line per (method, S, causal) at P = 2: the time as a multiple of the ideal."""
    lines = []
    for r in payload["results"]:
        if r["P"] == 2 and r.get("ratio_to_ideal") is not None:
            lines.append(
                f"P=2 S={r['S']} {'causal' if r['causal'] else 'full'}: {r['method']} {fmt_time(r['time_s'])} = "
                f"{r['ratio_to_ideal']:.2f}x ideal ({r['reference']} {fmt_time(r['ideal_s'] * 2)} / 2)"
            )
    return lines


def fmt_time(s: float) -> str:
    from seqpar.bench.report import fmt_s

    return fmt_s(s)


def plots(payload: dict[str, Any], out_dir: str, prefix: str = "attention") -> list[str]:
    """time vs S, memory vs S, scaling efficiency vs P (PNG files in ``out_dir``), one panel per mask."""
    import os

    from seqpar.bench.report import plot_series

    ok = [r for r in payload["results"] if r["status"] == "ok"]
    masks = {False: "full (non-causal)", True: "causal"}

    def by_mask(value: Callable[[dict[str, Any]], float | None]) -> dict[str, dict[str, list[tuple[float, float]]]]:
        panels: dict[str, dict[str, list[tuple[float, float]]]] = {masks[c]: {} for c in payload["config"]["causal"]}
        for r in ok:
            y = value(r)
            if y is not None:
                world = "" if r["P"] == 1 else f" P={r['P']}"
                panels[masks[r["causal"]]].setdefault(f"{r['method']}{world}", []).append((r["S"], y))
        return panels

    paths = [
        plot_series(os.path.join(out_dir, f"{prefix}_time_vs_S.png"), panels=by_mask(lambda r: r["time_s"]),
                    title="forward+backward per step (slowest rank, median)", xlabel="total sequence length S",
                    ylabel="seconds", logx=True, logy=True),
        plot_series(os.path.join(out_dir, f"{prefix}_memory_vs_S.png"),
                    panels=by_mask(lambda r: r["peak_bytes"] / 2**20 if r.get("peak_bytes") else None),
                    title="peak tensor memory per rank, fwd+bwd (inputs, outputs, gradients included)",
                    xlabel="total sequence length S", ylabel="MiB", logx=True, logy=True),
    ]
    # efficiency vs P at the longest S; with more ranks than cores, CPU time too (dashed)
    cores = os.cpu_count() or 1
    longest = max((r["S"] for r in ok), default=0)
    oversub = payload["config"]["device"] == "cpu" and any(p > cores for p in payload["config"]["worlds"])
    panels: dict[str, dict[str, list[tuple[float, float]]]] = {masks[c]: {} for c in payload["config"]["causal"]}
    for r in ok:
        if r.get("efficiency") is None or r["S"] != longest:
            continue
        ser = panels[masks[r["causal"]]]
        ser.setdefault(r["method"], []).append((r["P"], r["efficiency"]))
        if oversub and r.get("cpu_ratio_to_ideal"):
            ser.setdefault(f"{r['method']} (cpu time)", []).append((r["P"], 1.0 / r["cpu_ratio_to_ideal"]))
    paths.append(plot_series(
        os.path.join(out_dir, f"{prefix}_efficiency_vs_P.png"), panels=panels,
        title=f"scaling efficiency at S={longest}: (reference / P) / time"
              + (f"; P > {cores} cores oversubscribes wall time, dashed = CPU time" if oversub else ""),
        xlabel="ranks P", ylabel="efficiency", hline=1.0, hline_label="ideal"))
    return [p for p in paths if p]


# ------------------------------------------------------------------------------------ CLI glue
def configure(args: Any) -> SuiteConfig:
    """A :class:`SuiteConfig` from the CLI's resolved arguments."""
    methods = args.methods.split(",") if args.methods else list(METHODS)
    bad = [m for m in methods if m not in METHODS + EXTRA_METHODS]
    if bad:
        raise SystemExit(f"--methods: unknown {bad}; choose from {list(METHODS + EXTRA_METHODS)}")
    return SuiteConfig(
        seq_lens=args.seq_lens, worlds=args.worlds, methods=methods, causal=args.causal_list,
        shape=shape_from_args(args),
        settings=Settings(warmup=args.warmup, repeats=args.repeats, seed=args.seed,
                          memory=not args.no_memory, profile=args.profile, rounds=args.rounds),
        device=args.device, simulate=args.simulate,
    )


def count(cfg: SuiteConfig) -> int:
    """Progress steps of :func:`run`."""
    return count_cases(cfg)


def run(cfg: SuiteConfig, progress: Callable[[str], None], *, pools: PoolSet | None = None) -> dict[str, Any]:
    """CLI entry of the suite (``pools``: see :func:`run_suite`)."""
    return run_suite(cfg, progress, pools=pools)
