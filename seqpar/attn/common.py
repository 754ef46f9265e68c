"""What the attention algorithms share: their options, the plan of each (query block, key block)
pair, and the kernels of one planned piece.

Every algorithm asks :func:`block_calls` what to compute between this rank's queries and one rank's
K/V block. Dense masks go to the shardings' chunk planner (:func:`seqpar.attn.plan.plan_blocks`);
documents and windows to the mask planner (:func:`seqpar.attn.masks.plan_pieces`). Plans depend on
host integers only and are cached, so a layer repeats no planning work and no rank can disagree.

Layouts: q ``(batch, q_heads, seq_local, head_dim)``, k/v ``(batch, kv_heads, seq_local, head_dim)``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from seqpar.attn.masks import MaskSpec, plan_pieces
from seqpar.attn.plan import BlockCall, plan_blocks
from seqpar.kernels import Partials, block_backward, block_forward, sink_grad
from seqpar.sequence.sharding import chunk_ids

__all__ = [
    "AttentionOptions", "BlockExpander", "SingleRank", "rank_chunks", "block_calls", "piece_forward", "piece_backward",
    "forward_block", "block_grads", "ring_hops", "block_hops", "forward_pieces", "backward_pieces",
    "packed_views", "dkv_wire_dtype", "function_forward", "function_backward",
]


@dataclass(frozen=True)
class AttentionOptions:
    """Static options of one distributed attention call (hashable: plans are cached on it).

    ``window``, ``cu_seqlens`` (global document boundaries ``(0, ..., S)``), ``chunk_size`` and
    ``softcap`` are validated at the public entry, :func:`seqpar.attention`."""

    causal: bool
    scale: float
    sharding: str = "contiguous"
    overlap: bool = True
    head_chunks: int = 1  # heads processed in this many independent passes (resolved, >= 1)
    window: int | None = None
    cu_seqlens: tuple[int, ...] | None = None
    chunk_size: int | None = None
    softcap: float | None = None  # scores s -> softcap * tanh(s / softcap) (Gemma 2), in the kernels
    # the dtype the travelling dK/dV accumulators are sent in: "fp32" (the accumulation dtype: exact) or
    # "bf16" (half the bytes, each hop adds in fp32 and rounds once for the wire): see dkv_wire_dtype()
    dkv_wire_dtype: str = "fp32"

    @property
    def mask(self) -> MaskSpec:
        return MaskSpec(self.causal, self.window, self.cu_seqlens, self.chunk_size)


class BlockExpander(Protocol):
    """A compressed K/V block (what travels) and its expansion to K/V (what the kernels take): MLA's
    latent, :mod:`seqpar.attn.latent`. The ring (:func:`seqpar.attn.ring.ring_forward`) calls
    :meth:`expand` on every block it attends and, in the backward, :meth:`reduce` on every block's
    K/V gradient shares, so that the shares travel compressed too."""

    v_head_dim: int

    def expand(self, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
        """The block's ``(k, v)``: ``(batch, kv_heads, len, head_dim)`` and ``(..., v_head_dim)``."""
        ...

    def reduce(self, a: Tensor, b: Tensor, dk: Tensor, dv: Tensor) -> tuple[Tensor, Tensor]:
        """The gradients of the compressed block ``(a, b)`` from its K/V shares ``dk``, ``dv`` (fp32),
        in fp32; parameters of the expansion accumulate their own gradients on the expander."""
        ...


class SingleRank:
    """The ring of one rank (P = 1): the ring code runs its own block and never exchanges."""

    rank = 0
    world_size = 1

    def exchange(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError("a single-rank ring has nothing to exchange")


def dkv_wire_dtype(wire: str, acc: torch.dtype) -> torch.dtype:
    """The dtype dK/dV accumulators travel in for the option value ``wire`` (validated at the entry,
    :func:`seqpar.attn.checks.check_dkv_wire`): ``"fp32"`` keeps the accumulation dtype ``acc`` (fp32; fp64
    for fp64 inputs), ``"bf16"`` sends bfloat16 (TransformerEngine's choice). Either way the receiver adds
    its share in ``acc`` arithmetic: ``wire_tensor.add_(share_in_acc)`` computes in the promoted dtype and
    rounds once when it stores, so a bf16 accumulator is rounded once per hop, never summed in bf16."""
    return torch.bfloat16 if wire == "bf16" else acc


def rank_chunks(opts: AttentionOptions, world: int, rank: int, seq_local: int) -> list[int]:
    """Global chunk ids that ``rank`` holds, in local order (the balanced layout depends on the
    sequence length and the documents)."""
    return chunk_ids(rank, world, opts.sharding, seq_len=seq_local * world, cu_seqlens=opts.cu_seqlens)


@functools.lru_cache(maxsize=4096)
def block_calls(opts: AttentionOptions, world: int, q_rank: int, k_rank: int, seq_local: int) -> tuple[BlockCall, ...]:
    """Kernel calls of rank ``q_rank``'s queries against rank ``k_rank``'s K/V block (local rows)."""
    q_chunks, k_chunks = rank_chunks(opts, world, q_rank, seq_local), rank_chunks(opts, world, k_rank, seq_local)
    clen = seq_local // len(q_chunks)
    if opts.mask.dense:
        return tuple(plan_blocks(q_chunks, k_chunks, clen, opts.causal))
    return tuple(plan_pieces(opts.mask, _chunk_ranges(q_chunks, clen), _chunk_ranges(k_chunks, clen)))


def _chunk_ranges(chunks: Sequence[int], clen: int) -> list[tuple[int, int]]:
    """The global ``[start, stop)`` ranges of ``chunks`` (in local order), consecutive chunks joined: the
    planner then cuts along documents only, not at every chunk edge (a document whole on one rank is one
    causal call instead of a triangle per chunk and a rectangle per chunk row; the same visible pairs)."""
    ranges: list[tuple[int, int]] = []
    for c in chunks:
        if ranges and ranges[-1][1] == c * clen:
            ranges[-1] = (ranges[-1][0], (c + 1) * clen)
        else:
            ranges.append((c * clen, (c + 1) * clen))
    return ranges


@functools.lru_cache(maxsize=1024)
def block_hops(opts: AttentionOptions, world: int, seq_local: int) -> tuple[int, ...]:
    """How many hops each rank's K/V block makes round the ring: for block j, the farthest ring
    distance s (rank j + s) at which a rank still sees one of its keys; 0 when no other rank does.
    Every rank derives the same tuple from the same integers. P - 1 each for dense masks; 1 for
    causal documents (or a window) no longer than a shard under contiguous sharding."""
    if opts.mask.dense:
        return (world - 1,) * world
    return tuple(
        max((s for s in range(1, world) if block_calls(opts, world, (j + s) % world, j, seq_local)), default=0)
        for j in range(world)
    )


def ring_hops(opts: AttentionOptions, world: int, seq_local: int) -> int:
    """The most hops any block makes (the ring's number of steps beyond the own block)."""
    return max(block_hops(opts, world, seq_local), default=0)


def packed_views(buf: Tensor, *shapes: Sequence[int]) -> list[Tensor]:
    """Views of consecutive tensors packed along the last dim of ``buf`` ``(..., sum of numels)``: one
    ``(..., *shape)`` view per shape, in order. K and V of different head dims (MLA) share one
    collective buffer this way; for equal shapes it is the same memory as stacking them."""
    lead, views, at = buf.shape[:-1], [], 0
    for shape in shapes:
        n = 1
        for s in shape:
            n *= s
        views.append(buf.narrow(-1, at, n).view(*lead, *shape))
        at += n
    if at != buf.shape[-1]:
        raise ValueError(f"packed buffer holds {buf.shape[-1]} values per slot, the shapes {shapes} take {at}")
    return views


def _rows(x: Tensor, s: slice) -> Tensor:
    # narrow, not x[:, :, s]: indexing a fake CUDA tensor fails on CPU-only builds
    return x.narrow(2, s.start, s.stop - s.start)


def piece_forward(
    q: Tensor, k: Tensor, v: Tensor, call: BlockCall, scale: float, softcap: float | None = None
) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` of one planned piece, for the rows ``call.q_rows`` of ``q``.

    An anti-causal square (row x sees key y >= x) is the causal one with rows and keys reversed:
    the kernels only know top-left causal masks, and a flip is O(n) against the kernel's O(n^2)."""
    qs, ks, vs = _rows(q, call.q_rows), _rows(k, call.k_rows), _rows(v, call.k_rows)
    if call.anti:
        out, lse = block_forward(qs.flip(2), ks.flip(2), vs.flip(2), scale=scale, causal=True, softcap=softcap)
        return out.flip(2), lse.flip(2)
    return block_forward(qs, ks, vs, scale=scale, causal=call.causal, softcap=softcap)


def piece_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, call: BlockCall, scale: float,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """This piece's share of dq (rows ``call.q_rows``) and dk, dv (rows ``call.k_rows``), given the
    merged ``out`` and ``lse`` of every query row."""
    qr, kr = call.q_rows, call.k_rows
    args = [_rows(dout, qr), _rows(q, qr), _rows(k, kr), _rows(v, kr), _rows(out, qr), _rows(lse, qr)]
    if call.anti:
        args = [a.flip(2) for a in args]
    dout_r, q_r, k_r, v_r, out_r, lse_r = args
    dq, dk, dv = block_backward(
        dout_r, q_r, k_r, v_r, out_r, lse_r, scale=scale, causal=call.causal or call.anti, softcap=softcap
    )
    if call.anti:
        return dq.flip(2), dk.flip(2), dv.flip(2)
    return dq, dk, dv


# Pieces of one shape (many short documents, a window's tiles) are stacked along the batch dimension
# into one kernel call: per-call overhead dominated such pieces (512 documents of 8 tokens took 4x the
# time of 64 of 64 at 1/8 of the work). Only small pieces, and at most this many stacked query rows
# per call, so that the stacked copies stay a small transient.
BATCH_PIECE_ROWS = 512
BATCH_ROWS = 4096


def _batches(calls: Sequence[BlockCall]) -> list[list[BlockCall]]:
    """The calls in groups that run as one kernel call: same shape and mask, small; others alone."""
    groups: dict[tuple, list[BlockCall]] = {}
    out: list[list[BlockCall]] = []
    for c in calls:
        n, m = c.q_rows.stop - c.q_rows.start, c.k_rows.stop - c.k_rows.start
        if n > BATCH_PIECE_ROWS or m > BATCH_PIECE_ROWS:
            out.append([c])
            continue
        group = groups.setdefault((n, m, c.causal, c.anti), [])
        group.append(c)
        if (len(group) + 1) * n > BATCH_ROWS:
            out.append(groups.pop((n, m, c.causal, c.anti)))
    return out + list(groups.values())


def _stack(x: Tensor, spans: list[slice]) -> Tensor:
    """Rows ``spans`` of ``x`` ``(B, H, L, ...)`` stacked along the batch: ``(len(spans) * B, H, n, ...)``."""
    return _rows(x, spans[0]) if len(spans) == 1 else torch.cat([_rows(x, s) for s in spans], dim=0)


def forward_pieces(
    q: Tensor, k: Tensor, v: Tensor, calls: Sequence[BlockCall], scale: float, softcap: float | None = None
) -> Iterator[tuple[BlockCall, Tensor, Tensor]]:
    """``(call, out, lse)`` of every planned piece, same-shaped small pieces in one kernel call."""
    b = q.shape[0]
    for group in _batches(calls):
        if len(group) == 1:
            yield group[0], *piece_forward(q, k, v, group[0], scale, softcap)
            continue
        first = group[0]
        qr, kr = [c.q_rows for c in group], [c.k_rows for c in group]
        qs, ks, vs = _stack(q, qr), _stack(k, kr), _stack(v, kr)
        if first.anti:
            qs, ks, vs = qs.flip(2), ks.flip(2), vs.flip(2)
        o, o_lse = block_forward(qs, ks, vs, scale=scale, causal=first.causal or first.anti, softcap=softcap)
        if first.anti:
            o, o_lse = o.flip(2), o_lse.flip(2)
        for i, c in enumerate(group):
            yield c, o.narrow(0, i * b, b), o_lse.narrow(0, i * b, b)


def backward_pieces(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, calls: Sequence[BlockCall], scale: float,
    softcap: float | None = None,
) -> Iterator[tuple[BlockCall, Tensor, Tensor, Tensor]]:
    """``(call, dq, dk, dv)`` of every planned piece, same-shaped small pieces in one kernel call."""
    b = q.shape[0]
    for group in _batches(calls):
        if len(group) == 1:
            yield group[0], *piece_backward(dout, q, k, v, out, lse, group[0], scale, softcap)
            continue
        first = group[0]
        qr, kr = [c.q_rows for c in group], [c.k_rows for c in group]
        args = [_stack(dout, qr), _stack(q, qr), _stack(k, kr), _stack(v, kr), _stack(out, qr), _stack(lse, qr)]
        if first.anti:
            args = [a.flip(2) for a in args]
        dq, dk, dv = block_backward(*args, scale=scale, causal=first.causal or first.anti, softcap=softcap)
        if first.anti:
            dq, dk, dv = dq.flip(2), dk.flip(2), dv.flip(2)
        for i, c in enumerate(group):
            yield c, dq.narrow(0, i * b, b), dk.narrow(0, i * b, b), dv.narrow(0, i * b, b)


def forward_block(
    q: Tensor, k_blk: Tensor, v_blk: Tensor, calls: tuple[BlockCall, ...], scale: float, acc: Partials,
    softcap: float | None = None,
) -> None:
    """Attend ``q`` to one K/V block along its planned pieces, folding each into ``acc``."""
    for call, o, o_lse in forward_pieces(q, k_blk, v_blk, calls, scale, softcap):
        acc.add(call.q_rows, o, o_lse)


def block_grads(
    dout: Tensor, q: Tensor, k_blk: Tensor, v_blk: Tensor, out: Tensor, lse: Tensor,
    calls: tuple[BlockCall, ...], scale: float, dq_acc: Tensor, dk_acc: Tensor, dv_acc: Tensor,
    softcap: float | None = None,
) -> None:
    """Add one K/V block's shares of dq, dk, dv into the fp32 accumulators."""
    for call, dq, dk, dv in backward_pieces(dout, q, k_blk, v_blk, out, lse, calls, scale, softcap):
        _rows(dq_acc, call.q_rows).add_(dq)
        _rows(dk_acc, call.k_rows).add_(dk)
        _rows(dv_acc, call.k_rows).add_(dv)


def function_forward(ctx: Any, run: Callable[..., tuple[Tensor, Tensor]], q: Tensor, k: Tensor, v: Tensor, comm: Any,
                     opts: AttentionOptions, sinks: Tensor | None) -> Tensor:
    """The forward of the ring's and the all-gather's autograd Functions: ``run(q, k, v, comm, opts, sinks)``
    (``ring_attention_forward`` over a ring exchange, or ``allgather_forward`` over a process group ``comm``)
    gives ``out`` ``(batch, q_heads, seq_local, v_head_dim)`` (its accumulator, cast to q's dtype: a no-op
    where it already is) and ``lse``; both are saved with the inputs for :func:`function_backward`."""
    out_acc, lse = run(q, k, v, comm, opts, sinks)
    out = out_acc.to(q.dtype)
    ctx.save_for_backward(q, k, v, out, lse, sinks)
    ctx.comm, ctx.opts = comm, opts
    return out


def function_backward(ctx: Any, run: Callable[..., tuple[Tensor, Tensor, Tensor]], dout: Tensor) -> tuple:
    """The backward of the ring's and the all-gather's autograd Functions (``run``: ``ring_attention_backward``
    or ``allgather_backward``, called as ``run(dout, q, k, v, out, lse, comm, opts)``): the gradients of
    q, k, v and the sinks (this rank's rows' share of it), None for ``comm`` and ``opts``."""
    q, k, v, out, lse, sinks = ctx.saved_tensors
    dq, dk, dv = run(dout, q, k, v, out, lse, ctx.comm, ctx.opts)
    dsinks = None if sinks is None else sink_grad(dout, out, lse, sinks)
    return dq, dk, dv, None, None, dsinks
