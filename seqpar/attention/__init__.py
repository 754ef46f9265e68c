"""Exact attention across the ranks of a sequence-parallel group.

One module per algorithm (``ring``, ``allgather``, ``dilated``), the kernel planning in ``plan`` and the
input checks in ``checks``; :func:`attention` is the public entry that picks one.
"""

from __future__ import annotations

import inspect
import sys
import types
from typing import Any

import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from seqpar.attention.allgather import AllGatherAttention
from seqpar.attention.checks import (
    AUTO_HEAD_CHUNKS,
    check_across_ranks,
    check_local,
    check_options,
    resolve_head_chunks,
)
from seqpar.attention.hybrid import hybrid_attention, ulysses_attention
from seqpar.attention.ring import AttentionOptions, RingAttention
from seqpar.comm.ring import RingComm
from seqpar.groups import default_manager, resolve_group

__all__ = ["attention", "AttentionOptions", "AUTO_HEAD_CHUNKS", "resolve_head_chunks"]


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
            :mod:`seqpar.costmodel`).
        group: the SP process group; ``None`` = the default manager's SP group, or the whole world
            when no manager was made, or a single process when torch.distributed is not initialised.
            Not allowed with ``mode="hybrid"``, which needs the manager's two axes (the default
            manager's own SP group is accepted: it is the same as ``None``).
        sharding: how the sequence was cut, ``"contiguous"`` or ``"zigzag"`` (see seqpar.sharding).
        overlap: overlap ring transfers with block compute.
        check_inputs: all-gather a few integers first to check every rank passes the same shapes
            (turns a would-be hang into an error on every rank).
        head_chunks: run the algorithm this many times, each on ``kv_heads / head_chunks`` K/V heads
            and their query heads: the transient buffers (travelling K/V and dK/dV, gathered K/V,
            kernel outputs) shrink by that factor at the cost of more, smaller messages. Must
            divide kv_heads. ``"auto"`` = the largest divisor of kv_heads that is at most
            :data:`AUTO_HEAD_CHUNKS` (4).
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
    group = resolve_group(group)
    world = 1 if group is None else dist.get_world_size(group)
    if check_inputs and world > 1:
        check_across_ranks(
            q, k, v, group=group, causal=causal, mode=mode, sharding=sharding, head_chunks=head_chunks
        )
    check_local(q, k, v, world_size=world, sharding=sharding)
    chunks = resolve_head_chunks(head_chunks, k.shape[1])
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if world == 1:
        # one rank holds the whole sequence in order (zigzag with P=1 is chunks [0, 1])
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )
    opts = AttentionOptions(
        causal=causal, scale=float(scale), sharding=sharding, overlap=overlap, head_chunks=chunks
    )
    if explicit_group:
        manager = None
    if mode == "auto":
        from seqpar.costmodel import choose_mode

        mode = choose_mode(q, k, world=world, manager=manager, causal=causal, group=group, head_chunks=chunks)
    if mode == "hybrid":
        if manager is None:
            raise ValueError(
                "mode='hybrid' needs the Ulysses and ring groups of a process-group manager: call "
                "seqpar.init_process_groups(sp_size=P, ulysses_size=u) on every rank first"
            )
        if manager.ulysses_size == manager.sp_size:
            mode = "ulysses"  # u = P: no ring axis
        elif manager.ulysses_size > 1:
            return hybrid_attention(q, k, v, manager, opts, head_chunks)
        else:
            mode = "ring"  # u = 1: the ring
    if mode == "ulysses":
        return ulysses_attention(q, k, v, group, opts, head_chunks)
    if mode == "ring":
        return RingAttention.apply(q, k, v, RingComm(group), opts)
    return AllGatherAttention.apply(q, k, v, group, opts)


class _AttentionPackage(types.ModuleType):
    """Lets ``seqpar.attention(q, k, v, ...)`` call :func:`attention` while ``seqpar.attention`` stays
    the package of algorithm modules (so ``import seqpar.attention.ring as ring`` keeps working)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Tensor:
        return attention(*args, **kwargs)


__signature__ = inspect.signature(attention)
__wrapped__ = attention
sys.modules[__name__].__class__ = _AttentionPackage
