"""The cost model behind ``mode="auto"`` and ``ulysses_size="auto"``: which SP algorithm is cheapest.

Per attention layer (forward + backward), per rank, with ``L = S/P`` tokens per rank, ``e`` bytes per
element of the input dtype, ``B`` batch, ``d`` head_dim, ``Hq``/``Hkv`` query/K/V heads, ``u`` the
Ulysses degree and ``h = max(Hkv/u, 1)`` the K/V heads a Ulysses rank receives:

================  ===============================================================  ==================
mode              bytes sent per rank (forward + backward)                         link
================  ===============================================================  ==================
ring              (P-1) * 2 B Hkv L d * (2e + w)        (K/V twice, dK/dV at w)     ring link
allgather         (P-1) * 2 B Hkv L d * (2e + 4), one all-gather / reduce-scatter  ring link
                  per chunk (its dK/dV reduce-scatter is fp32 whatever the wire option)
ulysses (u = P)   (P-1)/P * 2 B L d e * (2 Hq + 2 P h)  (q,k,v + out; dout + grads)  all-to-all link
hybrid (u < P)    ulysses over u, plus the ring across P/u super-ranks with blocks  both
                  of B h (u L) d: (P/u - 1) * 2 B h u L d * (2e + w)
================  ===============================================================  ==================

``w`` is the bytes of a travelling dK/dV value on the ring's wire: 4 (fp32, the default) or 2 with
``dkv_wire_dtype="bf16"``.

Links: the all-to-all of a Ulysses group of ``u`` consecutive ranks runs at ``intra_gbps`` while the
group fits in a node (``u <= node_size``), else at ``inter_gbps``; a ring over the whole SP group (ring,
all-gather) crosses nodes as soon as ``P > node_size`` (so it runs at ``inter_gbps``), and the ring
across hybrid super-ranks likewise when ``P > node_size``.

Overlap: attention compute per rank is ``C = 4 B Hq S^2 d / P`` FLOPs forward (half of it when causal)
and 2.5x that backward, at ``flops`` FLOP/s. The ring hides each step's transfer behind the step's
compute, so its time is ``sum over steps of max(compute step, transfer step)``; Ulysses and all-gather
pipeline their collectives over ``G`` head chunks, leaving ``1/G`` of the transfer exposed plus whatever
of the rest exceeds the compute. A fixed ``latency_s`` per message round stands for the per-collective
cost. Memory traffic around the kernels, at ``mem_gbps``: the ring and all-gather merge a fp32 partial
output into the accumulator for each of the P-1 remote blocks (read + write of the accumulator and the
partial, ~3 fp32 outputs per merge) and add a fp32 dq share per block in backward; Ulysses packs and
unpacks what it sends (~2x its bytes); the hybrid pays both at its own sizes. The model ranks modes; it
does not predict absolute times.

Validity (never chosen when it would fail): Ulysses/hybrid need ``Hq >= u`` and ``Hq`` a multiple of
``Hkv`` (:func:`ulysses_heads_accepted`); a mode lacking a feature the call uses (documents, windows, sinks,
dilated patterns: :data:`MODE_FEATURES`) is skipped. Where ``u`` does not split the heads evenly, the
slowest rank holds ``qmax = ceil(Hq/u)`` query heads and ``kmax`` K/V heads (the largest union of the K/V
heads a rank's query heads read): its compute and its all-to-all bytes, ``(u-1) * 2 B L d e * 2 (qmax +
kmax)``, are what an uneven call costs, in one head pass. The choice depends only on integers every rank
shares (shapes, group sizes) and on link figures that are either configured or probed once and broadcast from one rank,
so it is identical on every rank and the same on every call, activation-checkpoint recompute included;
it is logged once per distinct call shape, with the reason.
"""

from __future__ import annotations

import logging
import math
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.fx.experimental.symbolic_shapes import guard_scalar

# Plain data and pure integer rules that the process groups need too: they live below attention (Links
# with the config, the Ulysses-size rules with the groups), so runtime never imports attention; kept
# importable from here, where the cost model uses them.
from seqpar.attn.checks import CompileOnlyRefusal
from seqpar.config import Links
from seqpar.runtime.grid import ulysses_heads_accepted, ulysses_shares
from seqpar.runtime.groups import choose_ulysses_size, ulysses_heads_ok

if TYPE_CHECKING:
    from seqpar.runtime.groups import ProcessGroupManager

__all__ = [
    "Links", "CallShape", "ModeCost", "MODE_FEATURES", "ulysses_heads_ok", "mode_costs", "rank_modes",
    "choose_mode", "choose_ulysses_size", "probe_links",
]

logger = logging.getLogger("seqpar")

# What each mode supports beyond dense causal/full attention. The engineers adding documents
# (cu_seqlens), windows and sinks to a mode add the feature name to its entry here.
MODE_FEATURES: dict[str, frozenset[str]] = {
    "ring": frozenset({"dilated", "documents", "window", "sinks", "balanced"}),
    "allgather": frozenset({"dilated", "documents", "window", "sinks", "balanced"}),
    "ulysses": frozenset({"documents", "window", "sinks", "balanced"}),
    "hybrid": frozenset({"documents", "window", "sinks"}),  # not balanced: see seqpar.attn.hybrid
}


@dataclass(frozen=True)
class CallShape:
    """The integers one attention call is decided on (the same on every rank once checked)."""

    batch: int
    q_heads: int
    kv_heads: int
    seq_local: int
    head_dim: int
    elem_bytes: int
    causal: bool
    sp_size: int
    ulysses_size: int  # the manager's Ulysses degree (1: no hybrid axis)
    head_chunks: int = 4
    v_head_dim: int | None = None  # V's head dim where it differs from q/k's (MLA); None: head_dim
    dkv_bytes: int = 4  # a travelling dK/dV value on a ring's wire: fp32, or 2 with dkv_wire_dtype="bf16"
    # head_chunks is the caller's int, not "auto" (which each mode resolves on the K/V heads its ranks hold): it must
    # divide the K/V heads a Ulysses / hybrid rank holds too, else that mode refuses the call
    head_chunks_given: bool = False

    @property
    def qkv_dims(self) -> int:
        """Q/K head dim + V head dim (2 head_dim for ordinary attention): K and V travel together, and a
        kernel's work is q.k^T (head_dim) plus P.v (v_head_dim)."""
        return self.head_dim + (self.head_dim if self.v_head_dim is None else self.v_head_dim)


@dataclass(frozen=True)
class ModeCost:
    mode: str
    seconds: float  # modelled time of forward + backward of one layer
    bytes_sent: int  # per rank, forward + backward
    exposed_s: float  # modelled communication time not hidden behind compute
    # (bytes over the link or the all-to-all, ring bytes, the ring's super-ranks, the ranks or "inter"/"intra"):
    # :attr:`reason` formats them only when read (a log line), never while dynamo traces, where sizes may be
    # SymInts and torch 2.13's dynamo crashes on a format spec of a symbolic value (fuzz_compile.TORCH_FORMAT_BUG)
    why: tuple = field(default=(), repr=False, compare=False)

    @property
    def reason(self) -> str:
        """Why the mode costs what it does, for the log line (formatted on demand)."""
        if self.mode in ("ring", "allgather"):
            sent, link = self.why
            return f"{sent / 2**20:.1f} MiB over the {link}-node ring link"
        a2a, u, ring_sent, supers = self.why
        reason = f"{a2a / 2**20:.1f} MiB all-to-all over {u} ranks"
        if supers > 1:
            reason += f" + {ring_sent / 2**20:.1f} MiB ring over {supers} super-ranks"
        return reason


def _compute_s(c: CallShape, links: Links) -> float:
    s = c.seq_local * c.sp_size
    fwd = 2 * c.batch * c.q_heads * s * s * c.qkv_dims / c.sp_size * (0.5 if c.causal else 1.0)
    return 3.5 * fwd / links.flops  # forward + backward (2.5x)


def _merge_s(c: CallShape, links: Links, world: int, q_heads: int, tokens: int) -> float:
    """Memory time of the P-1 fp32 merges (forward) and dq additions (backward) of a ring/all-gather."""
    rows = c.batch * q_heads * tokens * 4
    out_acc, dq_acc = rows * (c.qkv_dims - c.head_dim), rows * c.head_dim  # fp32 out (V's dim), dq (q's)
    return (world - 1) * (3 * out_acc + 2 * dq_acc) / (links.mem_gbps * 1e9)


def _ring_cost(
    c: CallShape, links: Links, world: int, q_heads: int, kv_heads: int, tokens: int, gbps: float,
    dkv_bytes: int,
) -> tuple[float, int, float]:
    """(time, bytes, exposed) of a ring over ``world`` ranks, each holding ``tokens`` tokens of ``q_heads``
    query and ``kv_heads`` K/V heads, its dK/dV travelling at ``dkv_bytes`` per value."""
    compute = _compute_s(c, links)
    if world == 1:
        return compute, 0, 0.0
    compute += _merge_s(c, links, world, q_heads, tokens)
    kv_block = c.batch * kv_heads * tokens * c.qkv_dims  # K and V of one rank
    sent = (world - 1) * kv_block * (2 * c.elem_bytes + dkv_bytes)
    step_compute = compute / world
    step_comm = sent / (world - 1) / (gbps * 1e9) + links.latency_s
    exposed = (world - 1) * max(0.0, step_comm - step_compute)
    return compute + exposed, sent, exposed


def _pipelined(compute: float, comm: float, chunks: int) -> float:
    """Exposed part of ``comm`` pipelined over ``chunks`` behind ``compute``."""
    return comm / chunks + max(0.0, comm * (chunks - 1) / chunks - compute)


def _whole(x: float) -> int | float:
    """``int(x)`` of a number; a symbolic one (a ``SymFloat`` of the batch and length while dynamo traces with
    symbolic sizes) stays as it is: ``int()`` would specialise the sizes it is made of (one graph per length)."""
    return int(x) if isinstance(x, (int, float)) else x


def mode_costs(c: CallShape, links: Links, allowed: Iterable[str]) -> list[ModeCost]:
    """Modelled cost of each mode in ``allowed`` (validity is the caller's business)."""
    p = c.sp_size
    compute = _compute_s(c, links)
    ring_gbps = links.inter_gbps if p > links.node_size else links.intra_gbps
    costs = []
    for mode in allowed:
        if mode in ("ring", "allgather"):
            # all-gather reduce-scatters fp32 dK/dV whatever the wire option (config's DKV_WIRE_NO_EFFECT)
            wire = c.dkv_bytes if mode == "ring" else 4
            t, sent, exposed = _ring_cost(c, links, p, c.q_heads, c.kv_heads, c.seq_local, ring_gbps, wire)
            if mode == "allgather":  # one collective per chunk and direction instead of P-1 steps
                comm = sent / (ring_gbps * 1e9) + 3 * c.head_chunks * links.latency_s
                exposed = _pipelined(compute, comm, c.head_chunks)
                t = compute + _merge_s(c, links, p, c.q_heads, c.seq_local) + exposed
            costs.append(ModeCost(mode, t, sent, exposed, (sent, "inter" if p > links.node_size else "intra")))
            continue
        u = p if mode == "ulysses" else c.ulysses_size
        h = max(c.kv_heads // u, 1)
        # q + out (q_heads) and k + v (u h), each at head_dim + v_head_dim, forward and backward
        a2a_sent = _whole((u - 1) / u * 2 * c.batch * c.seq_local * c.qkv_dims * c.elem_bytes * (c.q_heads + u * h))
        a2a_gbps = links.intra_gbps if u <= links.node_size else links.inter_gbps
        chunks = math.gcd(h, c.head_chunks)
        shape, q_share = c, c.q_heads // u
        if not ulysses_heads_ok(c.q_heads, c.kv_heads, u):  # uneven: the slowest rank's share, one head pass
            q_share, h = -(-c.q_heads // u), max(share[3] for share in ulysses_shares(c.q_heads, c.kv_heads, u))
            a2a_sent = (u - 1) * 2 * c.batch * c.seq_local * c.qkv_dims * c.elem_bytes * (q_share + h)
            chunks, shape = 1, replace(c, q_heads=q_share * u)  # its compute: u ranks of its size
        a2a_s = a2a_sent / (a2a_gbps * 1e9) + 4 * chunks * links.latency_s
        ring_t, ring_sent, ring_exposed = _ring_cost(shape, links, p // u, q_share, h, u * c.seq_local, ring_gbps,
                                                     c.dkv_bytes)
        a2a_exposed = _pipelined(ring_t, a2a_s, chunks)  # the all-to-alls hide behind the (ring) attention
        copies = 2 * a2a_sent * u / max(u - 1, 1) / (links.mem_gbps * 1e9)  # pack + unpack of every slot
        costs.append(ModeCost(mode, ring_t + copies + a2a_exposed, a2a_sent + ring_sent, a2a_exposed + ring_exposed,
                              (a2a_sent, u, ring_sent, p // u)))
    return costs


def allowed_modes(c: CallShape, features: Iterable[str] = ()) -> list[str]:
    """The modes that would not fail on this call: head-count rule, the manager's axes, features used."""
    features = frozenset(features)

    def chunks_fit(u: int) -> bool:  # a given head_chunks divides a Ulysses rank's K/V heads (HeadSplit.kv_per_rank)
        if not c.head_chunks_given:
            return True
        even = ulysses_heads_ok(c.q_heads, c.kv_heads, u)
        held = max(c.kv_heads // u, 1) if even else max(s[3] for s in ulysses_shares(c.q_heads, c.kv_heads, u))
        return held % c.head_chunks == 0

    modes = ["ring", "allgather"]
    if ulysses_heads_accepted(c.q_heads, c.kv_heads, c.sp_size) and chunks_fit(c.sp_size):  # evenly or not
        modes.append("ulysses")
    if (1 < c.ulysses_size < c.sp_size and ulysses_heads_accepted(c.q_heads, c.kv_heads, c.ulysses_size)
            and chunks_fit(c.ulysses_size)):
        modes.append("hybrid")
    return [m for m in modes if features <= MODE_FEATURES[m]]


def rank_modes(c: CallShape, links: Links, features: Iterable[str] = ()) -> list[ModeCost]:
    """Allowed modes, cheapest first (ties: fewer bytes, then the fixed order of ``allowed_modes``)."""
    allowed = allowed_modes(c, features)
    costs = mode_costs(c, links, allowed)
    return sorted(costs, key=lambda m: (round(m.seconds, 12), m.bytes_sent, allowed.index(m.mode)))


def _cheapest_traced(c: CallShape, links: Links, features: Iterable[str] = ()) -> list[ModeCost]:
    """``[the cheapest allowed mode]`` (empty when none is), for a call dynamo traces: one pass keeping the
    first of the cheapest, so the comparisons made are exactly "the chosen mode costs no more than each other
    mode" (strictly less than those before it). With symbolic sizes each comparison is a guard of the graph:
    it fails, and dynamo recompiles, only when another batch or length would choose another mode (sorting
    would guard the whole order, recompiling where only the runners-up swap). Eager calls use
    :func:`rank_modes`; the two agree but on near-ties within 1e-12 s, which :func:`rank_modes` rounds away and
    settles by bytes (either choice is exact, and every rank traces the same shapes, so it agrees)."""
    costs = mode_costs(c, links, allowed_modes(c, features))
    best = costs[0] if costs else None
    for m in costs[1:]:
        if m.seconds < best.seconds:
            best = m
    return [] if best is None else [best]


# ------------------------------------------------------------------------------ links: config or probe
# Keyed by the group object, held weakly: an id() key outlived its group, and a later group given the same
# address on some ranks but not others made those ranks skip the probe's collectives while the rest waited in
# them (the fuzzer's P = 3 mode='auto' cases hung after earlier cases' groups were destroyed)
_PROBED: weakref.WeakKeyDictionary[dist.ProcessGroup, Links] = weakref.WeakKeyDictionary()


DEFAULT_LINKS = Links()  # frozen: one shared default is safe


def probe_links(group: dist.ProcessGroup, base: Links = DEFAULT_LINKS, nbytes: int = 1 << 22) -> Links:
    """Measure once per group: an all-to-all of ``nbytes`` per rank and a matmul, timed on the group's
    rank 0 and broadcast from it, so every rank holds the same figures (a collective: call on every rank).
    On one machine both link figures are the measured one (node_size = the group size)."""
    if group in _PROBED:
        return _PROBED[group]
    world = dist.get_world_size(group)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
    # all_to_all_single splits the buffer evenly: a length that the group size divides (P = 3 too)
    buf = torch.zeros(max(1, nbytes // 4 // world) * world, dtype=torch.float32, device=device)
    out = torch.empty_like(buf)
    dist.all_to_all_single(out, buf, group=group)  # warm-up
    start = time.perf_counter()
    dist.all_to_all_single(out, buf, group=group)
    a2a_s = time.perf_counter() - start
    a = torch.randn(256, 256, device=device)
    start = time.perf_counter()
    for _ in range(4):
        a = a @ a
        a = a / a.norm()
    if device.type == "cuda":
        torch.cuda.synchronize()
    mm_s = max(time.perf_counter() - start, 1e-9)
    figures = torch.tensor([nbytes * (world - 1) / world / max(a2a_s, 1e-9) / 1e9, 4 * 2 * 256**3 / mm_s],
                           dtype=torch.float64, device=device)
    dist.broadcast(figures, src=dist.get_global_rank(group, 0), group=group)
    gbps, flops = figures.tolist()
    if world == 1:  # nothing crossed a link (the all-to-all moved 0 bytes): keep the base's figure, never 0 GB/s
        gbps = base.intra_gbps
    links = replace(base, intra_gbps=gbps, inter_gbps=gbps, flops=flops, node_size=world)
    _PROBED[group] = links
    logger.info("[rank %d] seqpar auto: probed links %s", dist.get_rank(), links)
    return links


def _probed_while_tracing(group: dist.ProcessGroup) -> Links:
    """The probed links of ``group`` while dynamo traces: the probe is a timed collective, which cannot
    run inside a graph, so it must have run eagerly before (every rank decided alike then)."""
    links = _PROBED.get(group)
    if links is None:
        # compile only, not deferred to the graph: without fullgraph, dynamo runs the call eagerly, which probes
        raise CompileOnlyRefusal(
            "mode='auto' under torch.compile: this SP group's links have not been probed yet (a timed "
            "collective, which cannot run inside a traced graph). Run one eager step first, or call "
            "seqpar.attn.choose.probe_links(group) on every rank before compiling, or give the links in the "
            "config (\"links\") or pass an explicit mode"
        )
    return links


# ------------------------------------------------------------------------------ the choices
_LOGGED: set[tuple] = set()


def choose_mode(
    q: torch.Tensor, k: torch.Tensor, *, world: int, manager: ProcessGroupManager | None, causal: bool,
    group: dist.ProcessGroup | None = None, head_chunks: int = 4, features: Iterable[str] = (),
    v_head_dim: int | None = None, dkv_wire_dtype: str = "fp32", head_chunks_given: bool = False,
) -> str:
    """The cheapest allowed mode for this call (see the module docstring); logs its reason once.
    ``dkv_wire_dtype`` ("fp32" or "bf16") is what a ring's dK/dV travels in: bf16 makes the ring and the
    hybrid's ring a sixth to a third cheaper in bytes. ``head_chunks_given``: ``head_chunks`` is the caller's int
    (not ``"auto"``), so a Ulysses or hybrid rank's K/V heads must be a multiple of it for that mode to be allowed.

    Links come from ``manager.links`` when set (config), else from :func:`probe_links` on ``group``
    (probed on the first call, then cached)."""
    u = manager.ulysses_size if manager is not None else 1
    compiling = torch.compiler.is_compiling()
    # While dynamo traces with symbolic sizes (dynamic=True, or the recompile after a shape change) the dims are
    # SymInts. The head counts and head dims are a model's constants: guard_scalar specialises them (a guard that
    # they equal this call's, never failing for one model; int() would not: dynamo keeps it symbolic).
    # Batch and length stay symbolic: the costs below are then expressions of them, evaluated on this call's
    # sizes (the same on every rank: the group's shapes agree), and only the comparisons that pick the mode
    # become guards (see _cheapest_traced), so another batch or length recompiles only where it would choose
    # another mode, and dynamic=True keeps one graph per decision.
    hq, hkv, d = (guard_scalar(n) for n in (q.shape[1], k.shape[1], q.shape[3]))
    # head_chunks too: an int the caller passes (an argument or a closure's) is symbolic under dynamic=True unless
    # 0 or 1, and math.gcd in mode_costs has no symbolic form (a graph break where one graph is promised)
    head_chunks = guard_scalar(head_chunks)
    vd = None if v_head_dim is None or guard_scalar(v_head_dim) == d else guard_scalar(v_head_dim)
    c = CallShape(q.shape[0], hq, hkv, q.shape[2], d, q.element_size(),
                  bool(causal), world, u, head_chunks, vd, 2 if dkv_wire_dtype == "bf16" else 4, bool(head_chunks_given))
    links = getattr(manager, "links", None) if manager is not None else None
    if links is None:
        pg = manager.sp_group if manager is not None else group
        if pg is not None and compiling:
            links = _probed_while_tracing(pg)
        else:
            links = probe_links(pg) if pg is not None else Links()
    ranked = _cheapest_traced(c, links, features) if compiling else rank_modes(c, links, features)
    if not ranked:
        raise ValueError(
            f"mode='auto': no sequence-parallel mode supports {sorted(features)} for this call "
            f"({c.q_heads} query / {c.kv_heads} K/V heads, P={world}); pass an explicit mode"
        )
    best = ranked[0]
    if compiling:  # a logger call is a graph break (and a symbolic size can't be formatted): eager calls log
        return best.mode
    key = (c, links, tuple(sorted(features)))
    if key not in _LOGGED:
        _LOGGED.add(key)
        others = "; ".join(f"{m.mode} {m.seconds * 1e3:.3g} ms ({m.reason})" for m in ranked[1:])
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        logger.info("[rank %d] seqpar auto: mode=%r for %s: %.3g ms modelled (%s); others: %s",
                    rank, best.mode, c, best.seconds * 1e3, best.reason, others or "none allowed")
    return best.mode
