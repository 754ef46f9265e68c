"""Resolve one attention call, once, into an :class:`AttentionPlan`; :mod:`seqpar.attn.dispatch` runs it.

Everything a call needs decided is decided here, in this order, and nowhere again downstream:

1. the layout (``bhsd`` or ``bshd``: a transpose view, no copy) and the sharding (the run's declared
   one binds, :func:`seqpar.sequence.sharding.resolve_sharding`);
2. the group and its size (the default manager's SP group, or the explicit one);
3. the cross-rank check (when ``check_inputs``): every rank agrees on shapes and options first, so
   the local checks below give the same verdict on every rank;
4. the local checks (shapes, dtypes, masks) and the head chunks;
5. the algorithm: ``"auto"`` through the cost model, ``"hybrid"`` with ``u = 1`` or ``u = P`` to the
   ring or Ulysses, and for Ulysses / hybrid the head split and its :class:`UlyssesPlan`.

A swapped layer resolves its call here as a direct call does (:mod:`seqpar.swap.options`), so that
following ``q`` from the swap to the kernels visits each check once.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import guard_scalar

from seqpar.attn.checks import (
    CompileOnlyRefusal,
    GpuCall,
    check_across_ranks,
    check_causal,
    check_dkv_wire,
    check_local,
    check_options,
    check_scale,
    dkv_wire_digest,
    resolve_head_chunks,
    shown,
    ulysses_share,
)
from seqpar.attn.common import AttentionOptions
from seqpar.attn.masks import check_mask_inputs, host_boundaries, mask_digest
from seqpar.attn.ulysses import UlyssesPlan, head_split
from seqpar.runtime.groups import ProcessGroupManager, default_manager, resolve_group
from seqpar.sequence.boundaries import drop_empty_documents
from seqpar.sequence.sharding import resolve_sharding

__all__ = ["AttentionPlan", "resolve_attention", "LAYOUTS", "to_bhsd", "from_bhsd"]

LAYOUTS = ("bhsd", "bshd")
"""``bhsd``: ``(batch, heads, seq_local, head_dim)`` (SDPA's); ``bshd``: ``(batch, seq_local, heads,
head_dim)`` (flash-attn's, ring-flash-attn's, DeepSpeed Ulysses')."""

_HYBRID_NEEDS_MANAGER = (
    "mode='hybrid' needs the Ulysses and ring groups of a process-group manager: call "
    "seqpar.init_process_groups(sp_size=P, ulysses_size=u) on every rank first"
)


@dataclass(frozen=True)
class AttentionPlan:
    """One attention call, resolved: every check made, every choice taken (the same on every rank).

    ``algorithm``: ``"sdpa"`` (one rank, nothing masked: torch's SDPA), ``"single"`` (one rank with
    documents / window / sinks: the block planner, no exchange), ``"ring"``, ``"allgather"``,
    ``"ulysses"`` or ``"hybrid"``. ``group``: the SP group (``None`` on one process); ``manager``:
    the process-group manager (``"hybrid"`` only); ``ulysses``: the head split and chunk order of a
    Ulysses or hybrid call."""

    algorithm: str
    opts: AttentionOptions
    layout: str
    group: dist.ProcessGroup | None = None
    manager: ProcessGroupManager | None = None
    ulysses: UlyssesPlan | None = None
    documents: Tensor | None = None
    """While ``torch.compile`` traces: the document boundaries as the caller's 1-D int tensor, which the
    traced call cannot read (``opts.cu_seqlens`` is then None); the compiled op reads and checks them at
    run time (:mod:`seqpar.attn.ops`). None otherwise."""
    traced: bool = False
    """Resolved while ``torch.compile`` traced: the checks of the sizes (local length, ``head_chunks``, the
    boundaries' end) and ``documents`` are left to the compiled op, so the plan runs through the op even when
    Python runs it (dynamo gave up the frame that runs it: its recompile limit, a break it cannot resume), never
    through the eager autograd Functions, which would drop the documents and skip those checks."""


def to_bhsd(t: Tensor, layout: str) -> Tensor:
    """``t`` as ``(batch, heads, seq_local, head_dim)``: itself, or a transposed view of a ``bshd`` tensor."""
    return t.transpose(1, 2) if layout == "bshd" else t


def from_bhsd(t: Tensor, layout: str) -> Tensor:
    """The inverse of :func:`to_bhsd` (a view)."""
    return t.transpose(1, 2) if layout == "bshd" else t


def _check_layout(layout: str | None) -> str:
    if layout is None:
        return "bhsd"
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is invalid: pass 'bhsd' (batch, heads, seq, dim) or 'bshd' (batch, seq, heads, dim)")
    return layout


def _check_unambiguous(q: Tensor) -> None:
    """Shapes and strides cannot tell ``bhsd`` from ``bshd``; a bhsd reading with more heads than
    tokens per rank is far more likely a bshd tensor, so without an explicit ``layout=`` it is refused."""
    if q.dim() == 4 and q.shape[1] > q.shape[2]:
        b, d1, d2, d = shown(q.shape)
        raise ValueError(
            f"seqpar.attention: q {(b, d1, d2, d)} is ambiguous: read as layout='bhsd' it has {d1} heads and "
            f"seq_local={d2}; read as layout='bshd' (flash-attn's) it has seq_local={d1} and {d2} heads. "
            "Pass layout='bhsd' or layout='bshd' explicitly (or check_inputs=False once a loop is known good)"
        )


def _check_equal_sizes(q: Tensor, k: Tensor, v: Tensor) -> None:
    """Without an explicit ``layout=``: q with ``heads == seq_local`` and K/V of q's heads and tokens reads alike as
    ``bhsd`` and as ``bshd`` (flash-attn's). Sinks, ALiBi slopes and ``cu_seqlens`` count the same either way, so
    nothing in the call can tell the two apart: refused, naming both. Decided from shapes that the cross-rank check
    has made equal on every rank when ``check_inputs``: every rank raises alike. Eager only (the caller's test):
    comparing symbolic sizes under dynamo would add a guard per shape. A GQA/MQA call is left to the other checks:
    one reading of it fails (``_check_bshd_signs`` names ``layout='bshd'`` where that is the one that fits)."""
    if not all(isinstance(t, Tensor) and t.dim() == 4 for t in (q, k, v)):
        return  # check_local names a wrong type or rank
    if q.shape[1] != q.shape[2] or any(tuple(t.shape[1:3]) != tuple(q.shape[1:3]) for t in (k, v)):
        return
    b, n, _, d = shown(q.shape)
    raise ValueError(
        f"seqpar.attention: q {(b, n, n, d)} is ambiguous: read as layout='bhsd' (the default) it has {n} heads and "
        f"seq_local={n}; read as layout='bshd' (flash-attn's) it has seq_local={n} and {n} heads, and K/V, sinks, "
        "ALiBi slopes and cu_seqlens fit both readings. Pass layout='bhsd' or layout='bshd' explicitly"
    )


def _check_bshd_signs(q: Tensor, k: Tensor, *, sinks: object, alibi_slopes: object, bounds: tuple[int, ...] | None,
                      world: int) -> None:
    """Without an explicit ``layout=``: a call the ``bhsd`` reading refuses anyway whose ``bshd`` reading fits is
    refused naming ``layout='bshd'`` (the likely cause) instead of a shape mismatch that does not say so. Only calls
    already invalid as bhsd are refused here: a bshd tensor whose bhsd reading is valid (multi-head attention
    with seq_local <= heads and nothing else that counts heads or tokens) cannot be told apart (see ``layout``
    in :func:`seqpar.attention`). Decided from the shapes, the head vectors' lengths and the boundaries, which
    the cross-rank check has made equal on every rank when ``check_inputs``: every rank raises alike."""
    if not (isinstance(q, Tensor) and isinstance(k, Tensor) and q.dim() == 4 and k.dim() == 4):
        return  # check_local names a wrong type or rank
    b, d1, d2, d = shown(q.shape)
    sign = None
    # GQA/MQA: bshd q (b, s, hq, d) and k (b, s, hkv, d) agree on dim 1 (tokens), not on dim 2 (heads); read as
    # bhsd their seq_local differ, which is no valid call
    if (q.shape[0] == k.shape[0] and q.shape[3] == k.shape[3] and q.shape[1] == k.shape[1]
            and q.shape[2] != k.shape[2] and k.shape[2] > 0 and q.shape[2] % k.shape[2] == 0):
        sign = (f"k {shown(k.shape)} agrees with it on dim 1 and not on dim 2: read as 'bhsd' their seq_local differ "
                f"({d2} and {shown(k.shape[2])}); read as 'bshd' they hold {d1} tokens each, with {d2} query heads "
                f"and {shown(k.shape[2])} K/V heads (GQA)")
    for name, vec in (("sinks", sinks), ("alibi_slopes", alibi_slopes)):
        if sign is None and isinstance(vec, Tensor) and vec.dim() == 1 and vec.shape[0] != q.shape[1] \
                and vec.shape[0] == q.shape[2]:
            sign = (f"{name} holds {shown(vec.shape[0])} values, one per query head: dim 2's count, as in 'bshd' "
                    f"(read as 'bhsd' q has {d1} heads)")
    if sign is None and bounds is not None and len(bounds) > 1 and bounds[-1] != q.shape[2] * world \
            and bounds[-1] == q.shape[1] * world:
        sign = (f"cu_seqlens ends at {bounds[-1]} = {world} x dim 1, the global length as in 'bshd' (read as 'bhsd' "
                f"it would be {world} x {d2})")
    if sign is not None:
        raise ValueError(
            f"seqpar.attention: q {(b, d1, d2, d)} read as layout='bhsd' (the default) does not fit the call: {sign}. "
            "Most likely these are flash-attn's (batch, seq_local, heads, head_dim) tensors: pass layout='bshd'"
        )


def _group_and_manager(mode: str, group: dist.ProcessGroup | None) -> tuple[dist.ProcessGroup | None, ProcessGroupManager | None]:
    """The SP group and, when the call runs on the manager's own SP group, the manager (whose
    Ulysses / ring axes ``"hybrid"`` and ``"auto"`` use)."""
    manager = default_manager()
    if manager is not None and group is manager.sp_group:
        group = None  # the manager's own SP group (what the integrations pass): its two axes are known
    if mode == "hybrid" and group is not None:
        raise ValueError(
            "mode='hybrid' takes its Ulysses and ring groups from the process-group manager: drop group= and "
            "call seqpar.init_process_groups(sp_size=P, ulysses_size=u) first (or use mode='ulysses' / 'ring' with group=)"
        )
    if group is not None:
        return resolve_group(group), None  # refuses a group this rank is not in, as every other entry point does
    if mode == "hybrid" and manager is None and dist.is_available() and dist.is_initialized() \
            and dist.get_world_size() > 1:
        raise ValueError(_HYBRID_NEEDS_MANAGER)  # resolve_group would raise too, less specifically
    return resolve_group(None), manager


def _mask_features(opts: AttentionOptions, sinks: Tensor | None, documents: bool = False) -> set[str]:
    """The features of a call that :func:`seqpar.attn.choose.choose_mode` must find in a mode
    (chunks are documents to the planner; ``documents``: boundaries given as a tensor while tracing)."""
    used = {"documents": documents or opts.cu_seqlens is not None or opts.chunk_size is not None,
            "window": opts.window is not None, "sinks": sinks is not None, "balanced": opts.sharding == "balanced"}
    return {name for name, on in used.items() if on}


def _algorithm(
    mode: str, q: Tensor, k: Tensor, *, world: int, group: dist.ProcessGroup | None,
    manager: ProcessGroupManager | None, opts: AttentionOptions, sinks: Tensor | None,
    v_head_dim: int | None = None, documents: bool = False, head_chunks_given: bool = False,
) -> str:
    """The algorithm a multi-rank call runs: ``"auto"`` through the cost model (``head_chunks_given``: the caller
    passed an int ``head_chunks``, which the chosen mode's ranks must be able to divide their K/V heads by);
    ``"hybrid"`` with ``u = 1`` is the ring and with ``u = P`` Ulysses."""
    if mode == "auto":
        from seqpar.attn.choose import choose_mode  # the cost model is only needed for "auto"

        mode = choose_mode(
            q, k, world=world, manager=manager, causal=opts.causal, group=group, head_chunks=opts.head_chunks,
            features=_mask_features(opts, sinks, documents), v_head_dim=v_head_dim, dkv_wire_dtype=opts.dkv_wire_dtype,
            head_chunks_given=head_chunks_given,
        )
    if mode != "hybrid":
        return mode
    if manager is None:
        raise ValueError(_HYBRID_NEEDS_MANAGER)
    if manager.ulysses_size == manager.sp_size:
        return "ulysses"  # u = P: no ring axis
    if manager.ulysses_size == 1:
        return "ring"  # u = 1: the ring
    if opts.sharding == "balanced":
        raise ValueError(
            "mode='hybrid' does not take sharding='balanced' (its Ulysses groups' chunks are no balanced "
            "layout across the ring): use sharding='zigzag' or 'contiguous', or mode='ulysses' / 'ring' / "
            "'allgather' (or mode='auto', which only picks modes that support the call's features)"
        )
    return "hybrid"


def _ulysses_plan(
    algorithm: str, q: Tensor, k: Tensor, *, world: int, group: dist.ProcessGroup | None,
    manager: ProcessGroupManager | None, opts: AttentionOptions, head_chunks: int | str,
) -> UlyssesPlan:
    """The head split and chunk order of a Ulysses (over the whole group) or hybrid call."""
    if algorithm == "ulysses":
        u, sp, rank, first = world, world, dist.get_rank(group), 0
    else:
        assert manager is not None
        u, sp, rank, first = manager.ulysses_size, manager.sp_size, manager.ulysses_rank, manager.ring_rank * manager.ulysses_size
    # guard_scalar: head counts are a model's constants (choose_mode specialises them alike); symbolic
    # (dynamic=True), an uneven split's shares (runtime.grid.ulysses_shares' divmod) broke the graph
    kv_heads = guard_scalar(k.shape[1])
    split = head_split(guard_scalar(q.shape[1]), kv_heads, u, sp_size=sp, mode=algorithm,
                       tp=manager.tp_size if manager is not None else 1)
    # Traced, an int head_chunks against an even split's share is checked by the op at run time (ops.check_share,
    # the plan carrying the int unchecked), for the reason resolve_attention gives. An uneven split's plan runs
    # one pass whatever was asked, so the op cannot see the int: checked here, after the call's K/V heads, which
    # eager checks first (resolve_attention's options; traced, that check is left to the op, which this refusal,
    # raised by seqpar::refusal when the graph runs, comes before): the same refusal, eager's text.
    traced = torch.compiler.is_compiling() and head_chunks != "auto"
    if traced and not split.even:
        resolve_head_chunks(head_chunks, kv_heads)
    return UlyssesPlan.make(opts, split, rank=rank, first=first, sp_size=sp,
                            head_chunks=resolve_head_chunks(head_chunks, None if traced and split.even
                                                            else split.kv_per_rank, share=ulysses_share(u, kv_heads)),
                            seq_local=q.shape[2])


def _check_head_chunks_every_dynamic_size(head_chunks: int | str, q: Tensor, k: Tensor,
                                          group: dist.ProcessGroup | None) -> None:
    """Under length-aware dynamic CP with ``mode="ulysses"``, an int ``head_chunks`` must divide each rank's share of
    the K/V heads at **every** group size the planner may hand a micro-batch, checked on every rank of the pool
    alike. Checked only in the group a micro-batch got, the refusal reached that group's ranks alone and the pool's
    others waited in its next collective for good (fuzz case 1844892924: 2 K/V heads, ``head_chunks=2``, a pair
    holding 1 head a rank beside two one-rank groups). Static shapes and sizes only: no collective."""
    manager = default_manager()
    if head_chunks == "auto" or manager is None or not manager.dynamic_sizes or not manager.is_dynamic_group(group):
        return
    q_heads, kv_heads = guard_scalar(q.shape[1]), guard_scalar(k.shape[1])
    for u in manager.dynamic_sizes:
        if u == 1:
            continue
        split = head_split(q_heads, kv_heads, u, sp_size=u, mode="ulysses", tp=manager.tp_size)
        # uneven splits too: the Ulysses plan checks head_chunks against kv_per_rank for every split (audit 27, H3)
        if split.kv_per_rank % head_chunks:
            raise ValueError(
                f"head_chunks={shown(head_chunks)} does not divide the {split.kv_per_rank} K/V heads each rank holds in a "
                f"dynamic-CP group of {u} under mode='ulysses' (of the call's {kv_heads}; the planner may hand a "
                f"micro-batch any of the group sizes {list(manager.dynamic_sizes)}): set head_chunks to 'auto' or to "
                "a divisor of every such share, or raise sequence_parallel.dynamic.min_size past the sizes it fails"
            )


def _float_digest(value: object) -> int:
    """An int every rank derives alike from an optional float option (0: None, -1: not a number)."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return -1
    return zlib.crc32(repr(float(value)).encode())


def _check_softcap(softcap: object, q: Tensor) -> None:
    """Soft-capping needs the scores: seqpar's exact math kernel computes them (CPU, and fp64 anywhere);
    the fused CUDA kernels (flash, efficient, cuDNN) have no score modifier, so a CUDA call is refused."""
    if softcap is None:
        return
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not softcap > 0:
        # type(softcap)(softcap): the value itself in eager; traced with dynamic=True a float argument is symbolic,
        # whose f-string dynamo cannot build ("BUILD_STRING type error"), and float() of it is a constant (guarded)
        value = type(softcap)(softcap) if isinstance(softcap, (int, float)) else softcap
        raise ValueError(f"softcap={value!r} is invalid: pass a float > 0 (scores s -> softcap * tanh(s / softcap)) or None")
    if q.device.type == "cuda" and q.dtype != torch.float64:
        raise ValueError(
            f"softcap={shown(softcap)} on CUDA ({q.dtype}): torch's fused attention kernels (flash, memory-efficient, "
            "cuDNN) have no logit soft-capping, and seqpar's exact math kernel would materialise every block's "
            "scores. Run soft-capped attention on CPU or in float64, or drop the soft-capping "
            "(transformers: config.attn_logit_softcapping=None)"
        )


def _check_alibi(slopes: object, q: Tensor) -> None:
    if slopes is None:
        return
    if not isinstance(slopes, Tensor) or slopes.dim() != 1 or slopes.shape[0] != q.shape[1]:
        shape = tuple(slopes.shape) if isinstance(slopes, Tensor) else type(slopes).__name__
        raise ValueError(f"alibi_slopes must be a ({shown(q.shape[1])},) tensor, one ALiBi slope per query head; got "
                         f"{shown(shape)}")
    if not slopes.is_floating_point():
        raise TypeError(f"alibi_slopes must be a floating-point tensor; got {slopes.dtype}")


def resolve_attention(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, scale: float | None = None, mode: str = "ring",
    group: dist.ProcessGroup | None = None, sharding: str | None = None, overlap: bool = True,
    check_inputs: bool = True, head_chunks: int | str = "auto", cu_seqlens: Tensor | tuple[int, ...] | None = None,
    window: int | None = None, sinks: Tensor | None = None, layout: str | None = None,
    chunk_size: int | None = None, softcap: float | None = None, alibi_slopes: Tensor | None = None,
    dkv_wire_dtype: str = "fp32",
) -> AttentionPlan:
    """Check a call and take every decision it needs (arguments as :func:`seqpar.attention`; q, k, v
    in the caller's ``layout``). Collective when ``check_inputs`` and the group has more than one rank.

    Raises:
        ValueError / TypeError naming the problem and the fix, on every rank of the group.
    """
    check_options(mode, sharding if sharding is not None else "contiguous")
    explicit_layout = layout is not None
    layout = _check_layout(layout)
    sharding = resolve_sharding(sharding, where="seqpar.attention")
    qb, kb, vb = (to_bhsd(t, layout) if isinstance(t, Tensor) else t for t in (q, k, v))
    group, manager = _group_and_manager(mode, group)
    world = 1 if group is None else dist.get_world_size(group)
    bounds, bad_bounds, documents = None, None, None
    if isinstance(cu_seqlens, Tensor) and torch.compiler.is_compiling():
        # a traced call cannot read the values: the tensor goes to the compiled op, which reads and
        # checks them at run time, so a new layout is not a new graph (seqpar.attn.ops)
        documents = _traced_documents(cu_seqlens, qb, sharding)
        cu_seqlens = None
    try:
        bounds = host_boundaries(cu_seqlens)  # the call's one device-to-host copy, when documents are given
    except TypeError as e:  # raised after the cross-rank check, so that no rank is left waiting in it
        bad_bounds = e
    if check_inputs and world > 1 and torch.compiler.is_compiling():
        # Not deferred: without fullgraph dynamo gives this frame up and Python resolves the call eagerly, the check
        # included (exact); under fullgraph=True the collective broke the graph as dynamo's Unsupported "skipped
        # function", without a word of the fix
        raise CompileOnlyRefusal(
            f"seqpar.attention under torch.compile with check_inputs=True on {world} ranks: the cross-rank check "
            "is a collective whose verdict is read on the host, which cannot be part of a graph (fullgraph=True "
            "refuses it; without fullgraph the call is resolved eagerly). Pass check_inputs=False inside compiled "
            "code, and check the inputs once eagerly (a swapped model checks each batch before its layers run)"
        )
    if check_inputs and world > 1:
        extra = mask_digest(bounds, window, sinks, chunk_size) + [
            _float_digest(softcap), -1 if alibi_slopes is None else (alibi_slopes.numel() if isinstance(alibi_slopes, Tensor) else -2)]
        check_across_ranks(
            qb, kb, vb, group=group, causal=causal, mode=mode, sharding=sharding, head_chunks=head_chunks,
            scale=scale,
            # the layout too: two ranks reading the same shapes two ways would exchange garbage
            extra=[*([-2, *extra[1:]] if bad_bounds is not None else extra), -1 if not explicit_layout else LAYOUTS.index(layout),
                   dkv_wire_digest(dkv_wire_dtype)],
        )
    if bad_bounds is not None:
        raise bad_bounds
    check_dkv_wire(dkv_wire_dtype, mode)  # after the cross-rank check: every rank raises alike
    causal = check_causal(causal)
    if check_inputs and not explicit_layout:
        _check_unambiguous(q)
        if not torch.compiler.is_compiling():  # eager only: see _check_equal_sizes
            _check_equal_sizes(q, k, v)
    # a call that fails as bhsd and fits as bshd: name the layout, not the mismatch. Eager only: its comparisons of
    # symbolic sizes would add guards (a recompile per shape) where dynamo traces; the op's own checks refuse there
    if not explicit_layout and not torch.compiler.is_compiling():
        _check_bshd_signs(q, k, sinks=sinks, alibi_slopes=alibi_slopes, bounds=bounds, world=world)
    # Traced on more than one rank, the checks of the local length and the K/V head count are left to the custom op,
    # which makes them at the real sizes when it runs (seqpar.attn.ops): a refusal raised while dynamo traces reaches
    # a fullgraph=True caller as dynamo's "Unsupported: Observed exception" (or a BUILD_STRING break on a symbolic
    # size), not as the ValueError naming the fix. (World 1 may run torch's SDPA, no op: it checks here.)
    in_op = world > 1 and torch.compiler.is_compiling()
    check_local(qb, kb, vb, world_size=world, sharding=sharding, length=not in_op)
    check_mask_inputs(bounds, window, sinks, q=qb, seq_len=qb.shape[2] * world, world=world, sharding=sharding,
                      chunk_size=chunk_size, check_end=not in_op)
    if bounds is not None:  # checked: now without zero-length documents (repeats), which no plan needs to see
        bounds = drop_empty_documents(bounds)
    _check_softcap(softcap, qb)
    _check_alibi(alibi_slopes, qb)
    if alibi_slopes is not None and (sinks is not None or softcap is not None):
        # ALiBi is carried as the per-key bias m_h * j, equal to -m_h (i - j) only up to a per-row constant;
        # a sink logit or a soft-cap does not ignore that constant, so the result would be silently wrong.
        raise ValueError(
            f"alibi_slopes with {'sinks' if sinks is not None else 'softcap'}: seqpar applies ALiBi as a per-key "
            "bias that equals -m_h (i - j) only up to a per-row constant, which sinks and soft-capping do not "
            "ignore. Drop the sinks / softcap, or ALiBi (no model combines them)"
        )
    opts = AttentionOptions(
        causal=causal, scale=check_scale(scale, qb.shape[-1]), sharding=sharding,
        overlap=overlap,
        head_chunks=resolve_head_chunks(head_chunks, None if in_op and head_chunks != "auto" else kb.shape[1],
                                        GpuCall.of(qb, kb, vb, world)),
        window=window, cu_seqlens=bounds,
        chunk_size=chunk_size, softcap=None if softcap is None else float(softcap), dkv_wire_dtype=dkv_wire_dtype,
    )
    if mode == "ulysses":
        _check_head_chunks_every_dynamic_size(head_chunks, qb, kb, group)
    if world == 1:
        # one rank holds the whole sequence in order (zigzag with P=1 is chunks [0, 1])
        masked = not opts.mask.dense or documents is not None or sinks is not None or opts.softcap is not None
        return AttentionPlan("single" if masked else "sdpa", opts, layout, documents=documents,
                             traced=torch.compiler.is_compiling())
    algorithm = _algorithm(mode, qb, kb, world=world, group=group, manager=manager, opts=opts, sinks=sinks,
                           v_head_dim=vb.shape[-1], documents=documents is not None,
                           head_chunks_given=head_chunks != "auto")
    ulysses = None
    if algorithm in ("ulysses", "hybrid"):
        ulysses = _ulysses_plan(algorithm, qb, kb, world=world, group=group, manager=manager, opts=opts,
                                head_chunks=head_chunks)
    return AttentionPlan(algorithm, opts, layout, group, manager if algorithm == "hybrid" else None, ulysses,
                         documents, traced=torch.compiler.is_compiling())


def _traced_documents(cu_seqlens: Tensor, q: Tensor, sharding: str) -> Tensor:
    """The boundary tensor of a traced call, checked for what tracing can see (its values are checked
    by the compiled op at run time). The balanced layout depends on the values outside the op too (the
    Ulysses chunk order, ALiBi's positions), so it is refused under compile with a tensor."""
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(
            f"cu_seqlens must be a 1-D int32/int64 tensor of document boundaries, got shape "
            f"{shown(cu_seqlens.shape)} and dtype {cu_seqlens.dtype}"
        )
    if q.shape[0] != 1:
        raise ValueError(
            f"cu_seqlens needs batch 1 (documents packed into one sequence, as flash varlen), got batch "
            f"{shown(q.shape[0])}: pack the batch's rows into one sequence and concatenate their boundaries"
        )
    if sharding == "balanced":
        # not deferred to the graph: without fullgraph, dynamo falls back to the eager call, which is exact
        raise CompileOnlyRefusal(
            "seqpar.attention under torch.compile: sharding='balanced' with cu_seqlens as a tensor is not "
            "supported (the balanced layout is decided by the boundaries' values, which a traced call cannot "
            "read); use sharding='zigzag' or 'contiguous' when compiling, or pass cu_seqlens as a tuple of ints "
            "(a constant of the graph: each new layout recompiles)"
        )
    return cu_seqlens
