"""The halo exchange of a sharded causal convolution: each chunk of the sequence receives the k-1
inputs that precede it in the *global* sequence from whichever rank owns them.

Layout: this rank's shard ``x`` is ``(batch, channels, seq_local)`` (channels first, as ``conv1d``
takes it), made of ``n`` equal chunks of length ``c`` (1 contiguous, 2 zigzag, m balanced; see
:func:`seqpar.sequence.sharding.chunk_ids`). The halo is ``(batch, channels, n, h)``, ``h = k - 1``:
``halo[..., j, :]`` holds global positions ``[g_j c - h, g_j c)`` of local chunk j (global chunk g_j).

Only the positions a chunk can use are sent: none before position 0, none before the document the
chunk starts in (packed documents restart the convolution), so a chunk starting a document gets a
zero halo with no message. When ``h > c`` a halo spans several earlier chunks, maybe on several ranks.
The schedule (:func:`halo_plan`) is a pure function of (P, sharding, S, cu_seqlens, h), computed alike
on every rank, so each send meets exactly one receive; the pieces between one pair of ranks travel as
one message.

The exchange is an autograd Function whose backward is its dual: the gradient of each halo piece is
sent back to the rank owning those positions and added to its input gradient. While dynamo traces
(``torch.compile``), the same exchange runs as the custom ops ``seqpar::halo_fwd`` / ``seqpar::halo_bwd``
(:func:`traced_halo_exchange`): one opaque node each (dynamo cannot trace ``batch_isend_irecv`` nor the
plan's host arithmetic), the group by name and the plan by the integers it is a pure function of.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from seqpar.comm.group_names import group_by_name, group_name
from seqpar.sequence.sharding import chunk_ids

__all__ = ["HaloPiece", "HaloPlan", "halo_plan", "halo_exchange", "traced_halo_exchange"]

# Tag of the halo messages (above the ring and segment communicators' ranges).
_HALO_TAG = 1 << 13


@dataclass(frozen=True)
class HaloPiece:
    """A run of consecutive global positions copied from one chunk's inputs into another's halo."""

    src_rank: int
    src_offset: int
    """First position in the source rank's local shard."""
    dst_rank: int
    dst_chunk: int
    """Local chunk index on the destination rank."""
    dst_offset: int
    """First slot in that chunk's halo (0..h-1)."""
    length: int


@dataclass(frozen=True)
class HaloPlan:
    """Every halo piece of one (P, sharding, S, cu_seqlens, h), for all ranks."""

    world_size: int
    chunks_per_rank: int
    chunk_len: int
    halo: int
    pieces: tuple[HaloPiece, ...]

    def sent_positions(self, rank: int) -> int:
        """Positions ``rank`` sends to other ranks in the forward (each ``batch x channels`` values)."""
        return sum(p.length for p in self.pieces if p.src_rank == rank and p.dst_rank != rank)


@functools.lru_cache(maxsize=256)
def halo_plan(world_size: int, sharding: str, seq_len: int, cu_seqlens: tuple[int, ...] | None,
              halo: int) -> HaloPlan:
    """The halo schedule.

    Args:
        world_size: P.
        sharding: ``"contiguous"``, ``"zigzag"`` or ``"balanced"``.
        seq_len: the global sequence length S (a multiple of the chunk count).
        cu_seqlens: global document boundaries ``(0, ..., S)`` as host ints, or None (one document).
        halo: h = k - 1, the positions before a chunk that its first output reads.
    """
    layout = {"seq_len": seq_len, "cu_seqlens": cu_seqlens} if sharding == "balanced" else {}
    ids = [chunk_ids(r, world_size, sharding, **layout) for r in range(world_size)]
    n = len(ids[0])
    total_chunks = n * world_size
    if seq_len % total_chunks:
        raise ValueError(
            f"causal convolution: sequence length {seq_len} cannot be cut into {total_chunks} equal chunks for "
            f"{world_size} rank(s) with sharding='{sharding}': pad it to a multiple of {total_chunks} "
            "(seqpar.sequence.batch.shard_batch pads and cuts a batch the way the swapped model expects)")
    c = seq_len // total_chunks
    owner = {g: (r, j) for r, chunks in enumerate(ids) for j, g in enumerate(chunks)}
    starts = list(cu_seqlens) if cu_seqlens is not None else [0]
    pieces = []
    for r, chunks in enumerate(ids):
        for j, g in enumerate(chunks):
            start = g * c
            doc_start = starts[bisect.bisect_right(starts, start) - 1]
            p = max(start - halo, doc_start, 0)
            while p < start:
                q = p // c
                end = min(start, (q + 1) * c)
                src_rank, src_j = owner[q]
                pieces.append(HaloPiece(src_rank, src_j * c + p - q * c, r, j, halo - (start - p), end - p))
                p = end
    return HaloPlan(world_size, n, c, halo, tuple(pieces))


def _global(group: dist.ProcessGroup | None, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def _exchange(
    group: dist.ProcessGroup | None, sends: dict[int, Tensor], recv_shapes: dict[int, tuple[int, ...]],
    like: Tensor,
) -> dict[int, Tensor]:
    """Send ``sends[peer]`` to each peer and receive a tensor of ``recv_shapes[peer]`` from each."""
    recvs = {peer: like.new_empty(shape) for peer, shape in recv_shapes.items()}
    ops = [dist.P2POp(dist.isend, t.contiguous(), _global(group, peer), group, _HALO_TAG)
           for peer, t in sorted(sends.items())]
    ops += [dist.P2POp(dist.irecv, buf, _global(group, peer), group, _HALO_TAG)
            for peer, buf in sorted(recvs.items())]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return recvs


def _halo_forward(x: Tensor, plan: HaloPlan, rank: int, group: dist.ProcessGroup | None) -> Tensor:
    """x ``(batch, channels, seq_local)`` -> halo ``(batch, channels, n, h)``."""
    batch, channels, _ = x.shape
    halo = x.new_zeros(batch, channels, plan.chunks_per_rank, plan.halo)
    sends: dict[int, list[Tensor]] = {}
    recv_len: dict[int, int] = {}
    for p in plan.pieces:
        if p.src_rank == rank and p.dst_rank == rank:
            halo[:, :, p.dst_chunk, p.dst_offset:p.dst_offset + p.length] = x[..., p.src_offset:p.src_offset + p.length]
        elif p.src_rank == rank:
            sends.setdefault(p.dst_rank, []).append(x[..., p.src_offset:p.src_offset + p.length])
        elif p.dst_rank == rank:
            recv_len[p.src_rank] = recv_len.get(p.src_rank, 0) + p.length
    received = _exchange(group, {peer: torch.cat(ts, dim=-1) for peer, ts in sends.items()},
                         {peer: (batch, channels, n) for peer, n in recv_len.items()}, x)
    used = dict.fromkeys(received, 0)
    for p in plan.pieces:  # the same order as the sender packed them
        if p.dst_rank == rank and p.src_rank != rank:
            at = used[p.src_rank]
            halo[:, :, p.dst_chunk, p.dst_offset:p.dst_offset + p.length] = received[p.src_rank][..., at:at + p.length]
            used[p.src_rank] = at + p.length
    return halo


def _halo_backward(grad_halo: Tensor, seq_local: int, plan: HaloPlan, rank: int,
                   group: dist.ProcessGroup | None) -> Tensor:
    """The dual of :func:`_halo_forward`: grad_halo ``(batch, channels, n, h)`` -> grad_x
    ``(batch, channels, seq_local)``, each piece's gradient sent back to (and added on) its owner."""
    batch, channels = grad_halo.shape[:2]
    grad_x = grad_halo.new_zeros(batch, channels, seq_local)
    sends: dict[int, list[Tensor]] = {}
    recv_len: dict[int, int] = {}
    for p in plan.pieces:
        piece = grad_halo[:, :, p.dst_chunk, p.dst_offset:p.dst_offset + p.length]
        if p.src_rank == rank and p.dst_rank == rank:
            grad_x[..., p.src_offset:p.src_offset + p.length] += piece
        elif p.dst_rank == rank:
            sends.setdefault(p.src_rank, []).append(piece)
        elif p.src_rank == rank:
            recv_len[p.dst_rank] = recv_len.get(p.dst_rank, 0) + p.length
    received = _exchange(group, {peer: torch.cat(ts, dim=-1) for peer, ts in sends.items()},
                         {peer: (batch, channels, n) for peer, n in recv_len.items()}, grad_halo)
    used = dict.fromkeys(received, 0)
    for p in plan.pieces:
        if p.src_rank == rank and p.dst_rank != rank:
            at = used[p.dst_rank]
            grad_x[..., p.src_offset:p.src_offset + p.length] += received[p.dst_rank][..., at:at + p.length]
            used[p.dst_rank] = at + p.length
    return grad_x


class _HaloExchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, plan: HaloPlan, rank: int, group: dist.ProcessGroup | None) -> Tensor:
        ctx.plan, ctx.rank, ctx.group, ctx.seq_local = plan, rank, group, x.shape[-1]
        return _halo_forward(x, plan, rank, group)

    @staticmethod
    def backward(ctx, grad_halo: Tensor) -> tuple[Tensor, None, None, None]:
        return _halo_backward(grad_halo.contiguous(), ctx.seq_local, ctx.plan, ctx.rank, ctx.group), None, None, None


def halo_exchange(x: Tensor, plan: HaloPlan, rank: int, group: dist.ProcessGroup | None) -> Tensor:
    """Each local chunk's halo (differentiable; see the module docstring).

    Args:
        x: this rank's shard ``(batch, channels, seq_local)``.
        plan: :func:`halo_plan` of the batch (the same on every rank).
        rank: this rank in ``group``.
        group: the SP group (None with ``plan.world_size == 1``: no communication).
    Returns:
        ``(batch, channels, n, h)``; zeros where a chunk has nothing before it (sequence or document start).
    """
    if x.shape[-1] != plan.chunks_per_rank * plan.chunk_len:
        raise ValueError(f"halo_exchange: shard length {x.shape[-1]} is not {plan.chunks_per_rank} chunks of "
                         f"{plan.chunk_len} (the plan's); cut the sequence with seqpar.sequence.batch.shard_batch")
    return _HaloExchange.apply(x, plan, rank, group)


def _cu(cu_seqlens: list[int] | None) -> tuple[int, ...] | None:
    return None if cu_seqlens is None else tuple(cu_seqlens)


@torch.library.custom_op("seqpar::halo_fwd", mutates_args=())
def halo_fwd(x: Tensor, group: str, world: int, rank: int, sharding: str, seq_len: int,
             cu_seqlens: list[int] | None, halo: int) -> Tensor:
    """:func:`halo_exchange` as a custom op: x ``(batch, channels, seq_local)`` -> ``(batch, channels, n, h)``
    for the plan ``halo_plan(world, sharding, seq_len, cu_seqlens, halo)``, over the group named ``group``
    (``""``: one process)."""
    plan = halo_plan(world, sharding, seq_len, _cu(cu_seqlens), halo)
    return _halo_forward(x, plan, rank, group_by_name(group))


@halo_fwd.register_fake
def _(x, group, world, rank, sharding, seq_len, cu_seqlens, halo):  # noqa: ANN001, ANN202
    # Only the chunk count is needed, which contiguous and zigzag fix without the length: under dynamic shapes
    # seq_len is a SymInt, which halo_plan's cache cannot hash ("unhashable type: non-nested SymInt": a tiny
    # Zamba2 compiled on rows of changing lengths crashed at its second length, fuzzer case 192080593).
    if sharding != "balanced":
        return x.new_empty(x.shape[0], x.shape[1], len(chunk_ids(rank, world, sharding)), halo)
    plan = halo_plan(world, sharding, seq_len, _cu(cu_seqlens), halo)
    return x.new_empty(x.shape[0], x.shape[1], plan.chunks_per_rank, halo)


@torch.library.custom_op("seqpar::halo_bwd", mutates_args=())
def halo_bwd(grad_halo: Tensor, seq_local: int, group: str, world: int, rank: int, sharding: str, seq_len: int,
             cu_seqlens: list[int] | None, halo: int) -> Tensor:
    """The dual of :func:`halo_fwd`: grad_halo ``(batch, channels, n, h)`` -> grad_x ``(batch, channels,
    seq_local)``."""
    plan = halo_plan(world, sharding, seq_len, _cu(cu_seqlens), halo)
    return _halo_backward(grad_halo.contiguous(), seq_local, plan, rank, group_by_name(group))


@halo_bwd.register_fake
def _(grad_halo, seq_local, group, world, rank, sharding, seq_len, cu_seqlens, halo):  # noqa: ANN001, ANN202
    return grad_halo.new_empty(grad_halo.shape[0], grad_halo.shape[1], seq_local)


def _halo_setup(ctx, inputs, output) -> None:  # noqa: ANN001
    x, *rest = inputs
    ctx.seq_local, ctx.rest = x.shape[-1], rest  # group name, world, rank and the plan's integers


def _halo_op_backward(ctx, grad_halo: Tensor):  # noqa: ANN001, ANN202
    return halo_bwd(grad_halo, ctx.seq_local, *ctx.rest), *([None] * len(ctx.rest))


halo_fwd.register_autograd(_halo_op_backward, setup_context=_halo_setup)


def traced_halo_exchange(x: Tensor, *, group: dist.ProcessGroup | None, world: int, rank: int, sharding: str,
                         seq_len: int, cu_seqlens: tuple[int, ...] | None, halo: int) -> Tensor:
    """:func:`halo_exchange` for a traced forward (the custom op ``seqpar::halo_fwd``; same arguments as
    :func:`halo_plan`, ``group`` the SP group, None with ``world == 1``). Returns ``(batch, channels, n, h)``."""
    return halo_fwd(x, group_name(group) if world > 1 else "", world, rank, sharding, seq_len,
                    None if cu_seqlens is None else list(cu_seqlens), halo)
