"""A sequence-parallel causal depthwise convolution of width k (``padding = k - 1``, the output cut
to the input length: LFM2's short convolutions, the convolution in front of Mamba / GDN).

Each rank holds ``n`` chunks of the global sequence (:mod:`seqpar.sequence.sharding`). Output ``t``
reads inputs ``t - k + 1 .. t``; the ones before a chunk start come from the halo
(:mod:`seqpar.mixers.halo`, one point-to-point exchange). With packed documents the convolution
restarts at each document start: lag ``l`` contributes to position ``t`` only when ``t`` is at least
``l`` positions into its document, as if every document ran alone (zero-padded on the left).

The local maths is k shifted multiply-adds on ``(batch, channels, n, h + c)``, left to autograd: only
the exchange needs a hand-written backward.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from seqpar.mixers.halo import HaloPlan, halo_exchange, halo_plan, traced_halo_exchange
from seqpar.mixers.scan_layout import shard_boundaries
from seqpar.runtime.groups import resolve_group
from seqpar.sequence.sharding import chunk_ids, shard_index

__all__ = ["ConvLayout", "conv_layout", "causal_conv_shard", "causal_conv_chunks", "is_causal_depthwise_conv"]


def is_causal_depthwise_conv(conv: object) -> bool:
    """Whether ``conv`` is the convolution :func:`causal_conv_shard` reproduces: an ``nn.Conv1d`` with one
    filter per channel (``groups == in_channels == out_channels``), stride and dilation 1, and ``k - 1``
    positions of padding (cut back to the input length by the layer: causal)."""
    return (isinstance(conv, nn.Conv1d) and conv.groups == conv.in_channels == conv.out_channels
            and conv.padding == (conv.kernel_size[0] - 1,) and conv.stride == (1,) and conv.dilation == (1,))


@dataclass(frozen=True)
class ConvLayout:
    """Where this rank's positions sit: the halo plan and each local position's offset in its document."""

    plan: HaloPlan
    rank: int
    doc_pos: Tensor
    """``(n, c)`` int64: position of each local position inside its document (global position when
    there are no documents), on the input's device (made once per batch layout: no copy per layer)."""


@functools.lru_cache(maxsize=256)
def _layout(world: int, rank: int, sharding: str, seq_len: int, cu: tuple[int, ...] | None, halo: int,
            device: torch.device) -> ConvLayout:
    plan = halo_plan(world, sharding, seq_len, cu, halo)
    doc_pos = _doc_positions(world, rank, sharding, seq_len, cu, plan.chunks_per_rank)
    # asynchronous: a blocking copy would make the batch's first convolution layer wait for the device
    # (pageable memory is staged by the driver at the call, so the host tensor may go at once)
    return ConvLayout(plan, rank, doc_pos.to(device, non_blocking=True))


def _doc_positions(world: int, rank: int, sharding: str, seq_len: int, cu: tuple[int, ...] | None, chunks: int,
                   device: torch.device | None = None) -> Tensor:
    """``(chunks, seq_local // chunks)`` int64: each local position's offset in its document (its global
    position without documents), made on ``device``."""
    positions = shard_index(seq_len, rank, world, sharding, cu_seqlens=cu, device=device)  # (seq_local,)
    if cu is not None:
        edges = torch.tensor(cu, dtype=torch.long, device=device)
        positions = positions - edges[torch.searchsorted(edges, positions, right=True) - 1]
    return positions.view(chunks, -1)


def conv_layout(seq_local: int, kernel_size: int, *, group: dist.ProcessGroup | None, sharding: str,
                cu_seqlens: Tensor | Sequence[int] | None = None,
                device: torch.device | str = "cpu") -> ConvLayout:
    """The layout of this rank's shard (cached per batch shape and boundaries).

    Args:
        seq_local: this rank's shard length.
        kernel_size: k.
        group: the SP group (resolved as everywhere in seqpar: None -> the default manager's).
        sharding: how the sequence was cut (``"contiguous"``, ``"zigzag"``, ``"balanced"``).
        cu_seqlens: global document boundaries ``[0, ..., S]`` (host ints are read once per batch).
        device: where ``doc_pos`` lives (the input's device).
    """
    world, rank, seq_len, cu = shard_boundaries(seq_local, group=group, cu_seqlens=cu_seqlens,
                                                where="causal convolution")
    return _layout(world, rank, sharding, seq_len, cu, kernel_size - 1, torch.device(device))


def causal_conv_chunks(x: Tensor, halo: Tensor, weight: Tensor, bias: Tensor | None, doc_pos: Tensor,
                       *, position_wise: bool = False) -> Tensor:
    """The local maths: x ``(batch, channels, n*c)``, halo ``(batch, channels, n, k-1)``, weight
    ``(channels, k)`` (``conv1d`` order: tap ``k-1`` is the current position), bias ``(channels,)``
    or None, doc_pos ``(n, c)`` -> ``(batch, channels, n*c)`` in the weight's dtype.

    ``position_wise``: only the current position's tap (every token its own document): what the
    position-mixing probe must see of a handled mixer (:mod:`seqpar.swap.probe`).
    """
    batch, channels, seq_local = x.shape
    n, c = doc_pos.shape
    k = weight.shape[-1]
    out_dtype = weight.dtype
    # The k products are summed in fp32 at least (as conv1d accumulates), not rounded to bf16 per tap.
    compute = torch.promote_types(weight.dtype, torch.float32)
    x, weight = x.to(compute), weight.to(compute)
    bias = None if bias is None else bias.to(compute)
    if position_wise:
        out = x * weight[:, k - 1].view(1, channels, 1)
        return (out if bias is None else out + bias.view(1, channels, 1)).to(out_dtype)
    ext = torch.cat([halo.to(compute), x.view(batch, channels, n, c)], dim=-1)  # (B, C, n, k-1+c)
    out = None
    for i in range(k):
        lag = k - 1 - i
        term = ext[..., i:i + c] * weight[:, i].view(1, channels, 1, 1)
        if lag:
            term = term * (doc_pos >= lag).to(term.dtype)  # lag l reaches before the document start
        out = term if out is None else out + term
    if bias is not None:
        out = out + bias.view(1, channels, 1, 1)
    return out.reshape(batch, channels, seq_local).to(out_dtype)


def causal_conv_shard(x: Tensor, weight: Tensor, bias: Tensor | None = None, *,
                      group: dist.ProcessGroup | None = None, sharding: str = "contiguous",
                      cu_seqlens: Tensor | Sequence[int] | None = None, position_wise: bool = False) -> Tensor:
    """Causal depthwise convolution of this rank's shard, equal to the full sequence's (each document's).

    Args:
        x: ``(batch, channels, seq_local)``, this rank's shard in ``sharding``'s layout.
        weight: ``(channels, k)`` (``nn.Conv1d(groups=channels).weight.squeeze(1)``).
        bias: ``(channels,)`` or None.
        group: the SP group (None: the default manager's; one process: no communication).
        sharding: the layout the sequence was cut in.
        cu_seqlens: global document boundaries; the convolution restarts at each.
        position_wise: see :func:`causal_conv_chunks` (no communication).
    Returns:
        ``(batch, channels, seq_local)`` in ``weight``'s dtype.
    """
    if position_wise:  # the probe's 13 tokens need not cut into chunks: no layout, no communication
        doc_pos = torch.zeros(1, x.shape[-1], dtype=torch.long, device=x.device)
        return causal_conv_chunks(x, x.new_empty(0), weight, bias, doc_pos, position_wise=True)
    if torch.compiler.is_compiling():
        return _traced_conv(x, weight, bias, group=group, sharding=sharding, cu_seqlens=cu_seqlens)
    layout = conv_layout(x.shape[-1], weight.shape[-1], group=group, sharding=sharding, cu_seqlens=cu_seqlens,
                         device=x.device)
    halo = halo_exchange(x, layout.plan, layout.rank, resolve_group(group))
    return causal_conv_chunks(x, halo, weight, bias, layout.doc_pos)


def _traced_conv(x: Tensor, weight: Tensor, bias: Tensor | None, *, group: dist.ProcessGroup | None, sharding: str,
                 cu_seqlens: Tensor | Sequence[int] | None) -> Tensor:
    """:func:`causal_conv_shard` while dynamo traces (``torch.compile``): the halo exchange as the custom op
    ``seqpar::halo_fwd``, the positions from the sharding's integers (no cached host plan in the graph).
    Packed documents are refused: their boundaries would be read on the host."""
    if cu_seqlens is not None:
        raise ValueError("causal convolution: packed documents (cu_seqlens) under torch.compile are not supported "
                         "yet (the boundaries are read as host integers); run packed batches eagerly")
    sp = resolve_group(group)
    world, rank = (1, 0) if sp is None else (dist.get_world_size(sp), dist.get_rank(sp))
    seq_local, halo = x.shape[-1], weight.shape[-1] - 1
    seq_len = seq_local * world
    doc_pos = _doc_positions(world, rank, sharding, seq_len, None, len(chunk_ids(rank, world, sharding, seq_len=seq_len)),
                             device=x.device)
    halo_x = traced_halo_exchange(x, group=sp, world=world, rank=rank, sharding=sharding, seq_len=seq_len,
                                  cu_seqlens=None, halo=halo)
    return causal_conv_chunks(x, halo_x, weight, bias, doc_pos)
