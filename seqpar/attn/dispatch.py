"""Exact attention across the ranks of a sequence-parallel group.

One module per algorithm (``ring``, ``allgather``, ``dilated``), their shared options and piece kernels in
``common``, the kernel planning in ``plan`` (chunks) and ``masks`` (documents, windows), and the input
checks in ``checks``; :func:`attention` is the public entry that picks one.
"""

from __future__ import annotations

import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from seqpar.attn.allgather import AllGatherAttention
from seqpar.attn.checks import (
    check_across_ranks,
    check_local,
    check_options,
    resolve_head_chunks,
)
from seqpar.attn.common import AttentionOptions, SingleRank
from seqpar.attn.hybrid import hybrid_attention, ulysses_attention
from seqpar.attn.masks import check_mask_inputs, host_boundaries, mask_digest
from seqpar.attn.ring import RingAttention
from seqpar.comm.ring import RingComm
from seqpar.runtime.groups import default_manager, resolve_group

__all__ = ["attention"]

_HYBRID_NEEDS_MANAGER = (
    "mode='hybrid' needs the Ulysses and ring groups of a process-group manager: call "
    "seqpar.init_process_groups(sp_size=P, ulysses_size=u) on every rank first"
)


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    mode: str = "ring",
    group: dist.ProcessGroup | None = None,
    sharding: str = "contiguous",
    overlap: bool = True,
    check_inputs: bool = True,
    head_chunks: int | str = "auto",
    cu_seqlens: Tensor | None = None,
    window: int | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Exact softmax attention of this rank's queries over the whole sequence held by the SP group.

    Args:
        q: ``(batch, q_heads, seq_local, head_dim)``, this rank's shard of the queries.
        k, v: ``(batch, kv_heads, seq_local, head_dim)``; q_heads a multiple of kv_heads (GQA/MQA).
        causal: causal masking over the *global* positions of the sharded sequence.
        scale: score multiplier, default ``head_dim ** -0.5``.
        mode: ``"ring"`` (P2P ring, O(S/P) memory), ``"allgather"`` (gathered K/V, O(S) memory),
            ``"ulysses"`` (all-to-all to head shards over the whole SP group; q_heads divisible by P),
            ``"hybrid"`` (Ulysses over the manager's Ulysses groups, ring across them; see
            ``init_process_groups(ulysses_size=u)``) or ``"auto"`` (the cheapest allowed, see
            :mod:`seqpar.attn.choose`).
        group: the SP process group; ``None`` = the default manager's SP group, or a single
            process when torch.distributed is not initialised (or has one rank); without a manager on a
            world > 1 it is an error: call ``seqpar.init_process_groups(...)`` first, or pass
            ``group=torch.distributed.group.WORLD`` to use the whole world on purpose.
            Not allowed with ``mode="hybrid"``, which needs the manager's two axes (the default
            manager's own SP group is accepted: it is the same as ``None``).
        sharding: how the sequence was cut, ``"contiguous"``, ``"zigzag"`` or ``"balanced"`` (per-batch
            layout from ``cu_seqlens``; cut with ``shard_sequence(..., cu_seqlens=)``; see seqpar.sequence.sharding).
        overlap: overlap ring transfers with block compute.
        check_inputs: all-gather a digest of the call first to check every rank passes the same
            shapes and options (turns a would-be hang into an error on every rank). It costs a
            host sync per call; a swapped model checks once per batch instead and passes False.
        head_chunks: run the algorithm this many times, each on ``kv_heads / head_chunks`` K/V heads
            and their query heads: the transient buffers (travelling K/V and dK/dV, gathered K/V,
            kernel outputs) shrink by that factor at the cost of more, smaller messages. Must
            divide kv_heads. ``"auto"`` = the largest divisor of kv_heads that is at most
            :data:`AUTO_HEAD_CHUNKS` (4).
        cu_seqlens: packed documents: a 1-D int32/int64 tensor (any device; a tuple of ints also
            works and needs no device-to-host copy) of the boundaries of the *whole* sequence,
            ``[0, l1, l1 + l2, ..., S]`` with ``S = seq_local * P``, the same on every rank. Query i
            sees key j only inside its document. Needs batch 1.
        window: sliding window, an int >= 1: with ``causal``, query i sees key j iff
            ``0 <= i - j < window`` (transformers' ``sliding_window``); without, iff ``|i - j| < window``.
        sinks: ``(q_heads,)`` learned per-head sink logits (GPT-OSS): ``exp(sinks[h])`` joins every
            softmax denominator of head h; the sinks get their gradient (this rank's rows' share;
            Ulysses/hybrid: the full gradient of this rank's heads, 0 for the others; summed over
            ranks like any replicated weight). ``balanced`` is refused in ``hybrid`` (1 < u < P).
    Returns:
        ``(batch, q_heads, seq_local, head_dim)`` in q's dtype and the same sharding.
    Raises:
        ValueError / TypeError naming the problem and the fix, on every rank of the group.
    """
    check_options(mode, sharding)
    manager = default_manager()
    if manager is not None and group is manager.sp_group:
        group = None  # the manager's own SP group (what the integrations pass): its two axes are known
    if mode == "hybrid" and group is not None:
        raise ValueError(
            "mode='hybrid' takes its Ulysses and ring groups from the process-group manager: drop group= and "
            "call seqpar.init_process_groups(sp_size=P, ulysses_size=u) first (or use mode='ulysses' / 'ring' with group=)"
        )
    explicit_group = group is not None
    if mode == "hybrid" and manager is None and dist.is_available() and dist.is_initialized() \
            and dist.get_world_size() > 1:
        raise ValueError(_HYBRID_NEEDS_MANAGER)  # resolve_group would raise too, less specifically
    group = resolve_group(group)
    world = 1 if group is None else dist.get_world_size(group)
    bounds, bad_bounds = None, None
    try:
        bounds = host_boundaries(cu_seqlens)  # the call's one device-to-host copy, when documents are given
    except TypeError as e:  # raised after the cross-rank check, so that no rank is left waiting in it
        bad_bounds = e
    if check_inputs and world > 1:
        extra = mask_digest(bounds, window, sinks)
        check_across_ranks(
            q, k, v, group=group, causal=causal, mode=mode, sharding=sharding, head_chunks=head_chunks,
            extra=[-2, *extra[1:]] if bad_bounds is not None else extra,
        )
    if bad_bounds is not None:
        raise bad_bounds
    check_local(q, k, v, world_size=world, sharding=sharding)
    check_mask_inputs(bounds, window, sinks, q=q, seq_len=q.shape[2] * world, world=world, sharding=sharding)
    chunks = resolve_head_chunks(head_chunks, k.shape[1])
    if scale is None:
        scale = q.shape[-1] ** -0.5
    masked = bounds is not None or window is not None or sinks is not None
    if world == 1 and not masked:
        # one rank holds the whole sequence in order (zigzag with P=1 is chunks [0, 1])
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )
    opts = AttentionOptions(
        causal=causal, scale=float(scale), sharding=sharding, overlap=overlap, head_chunks=chunks,
        window=window, cu_seqlens=bounds,
    )
    if world == 1:  # documents, windows or sinks on one rank: the planner, no exchange
        return RingAttention.apply(q, k, v, SingleRank(), opts, sinks)
    if explicit_group:
        manager = None
    if mode == "auto":
        from seqpar.attn.choose import choose_mode

        mode = choose_mode(
            q, k, world=world, manager=manager, causal=causal, group=group, head_chunks=chunks,
            features=_mask_features(bounds, window, sinks, sharding),
        )
    if mode == "hybrid":
        if manager is None:
            raise ValueError(_HYBRID_NEEDS_MANAGER)
        if manager.ulysses_size == manager.sp_size:
            mode = "ulysses"  # u = P: no ring axis
        elif manager.ulysses_size > 1:
            if sharding == "balanced":
                raise ValueError(
                    "mode='hybrid' does not take sharding='balanced' (its Ulysses groups' chunks are no balanced "
                    "layout across the ring): use sharding='zigzag' or 'contiguous', or mode='ulysses' / 'ring' / "
                    "'allgather' (or mode='auto', which only picks modes that support the call's features)"
                )
            return hybrid_attention(q, k, v, manager, opts, head_chunks, sinks)
        else:
            mode = "ring"  # u = 1: the ring
    if mode == "ulysses":
        return ulysses_attention(q, k, v, group, opts, head_chunks, sinks)
    if mode == "ring":
        return RingAttention.apply(q, k, v, RingComm(group), opts, sinks)
    return AllGatherAttention.apply(q, k, v, group, opts, sinks)


def _mask_features(bounds: object, window: int | None, sinks: Tensor | None, sharding: str) -> set[str]:
    """The features of a call that :func:`seqpar.attn.choose.choose_mode` must find in a mode."""
    used = {"documents": bounds is not None, "window": window is not None, "sinks": sinks is not None,
            "balanced": sharding == "balanced"}
    return {name for name, on in used.items() if on}
