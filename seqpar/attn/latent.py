"""MLA latent transfer: the ring (or all-gather) moves each block's compressed latent instead of its
expanded K/V.

Multi-head latent attention (DeepSeek-V2/V3, Kimi, GLM-4.5 lite, MiniCPM3) computes every head's K
and V from one small per-token latent: ``c`` (``kv_lora_rank`` values, after the model's norm) and a
rotated rope key ``r`` (``qk_rope_head_dim`` values, shared by the heads):

    [k_nope_h | v_h] = (c @ W^T)[h]        (W = kv_b_proj.weight: (H * (d_nope + d_v), kv_lora_rank))
    k_h = [k_nope_h | r]

so a token's K/V is ``H * (d_nope + d_rope + d_v)`` values against ``kv_lora_rank + d_rope`` for the
latent: 576 against 128 x (192 + 128) = 40960 for DeepSeek-V3, 71x fewer. The ring sends the latent
``(c, r)`` and every rank expands the blocks it attends (:class:`MLAExpander`), at a cost of one
``kv_b_proj`` matmul per block (``2 L r H (d_nope + d_v)`` flops, ``kv_lora_rank / L`` of the block's
attention work).

Backward, exact: the expansion is linear, so a block's K/V gradient shares (from this rank's queries)
map to latent shares ``dc = [dk_nope | dv] @ W`` and ``dr = sum_h dk_rope_h``, which travel back round
the ring in place of dK/dV (also ~71x fewer bytes); each rank adds ``[dk_nope | dv]^T c`` of every
block it expanded to ``W``'s gradient. Summed over the SP ranks (as every replicated weight's
gradient is), that is one process's gradient: each token's K/V gradient is the sum of its shares.

Layouts: q ``(batch, heads, seq_local, d_nope + d_rope)``; the latent ``c`` ``(batch, 1,
seq_local, kv_lora_rank)`` and ``r`` ``(batch, 1, seq_local, d_rope)`` (transformers' MLA modules view
them so); output ``(batch, heads, seq_local, d_v)``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from seqpar.attn.allgather import allgather_backward, allgather_forward
from seqpar.attn.common import AttentionOptions
from seqpar.attn.ring import ring_backward, ring_forward
from seqpar.comm.group_names import group_by_name, group_name
from seqpar.comm.ring import RingComm, RingExchange
from seqpar.kernels import in_layout_of, output_like, sink_grad

__all__ = [
    "MLADims", "MLAExpander", "LatentRingAttention", "LatentAllGatherAttention", "latent_bytes_per_token", "expanded_bytes_per_token",
    "ring_bytes_per_rank", "TRANSFERS", "compiled_latent_attention",
]

TRANSFERS = ("latent", "expanded")


@dataclass(frozen=True)
class MLADims:
    """The head dims of one MLA layer (transformers' config names)."""

    heads: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    kv_lora_rank: int

    @property
    def latent_width(self) -> int:
        """Values per token that travel in latent mode: ``kv_lora_rank + qk_rope_head_dim``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def expanded_width(self) -> int:
        """Values per token of the expanded K and V: ``heads * (d_nope + d_rope + d_v)``."""
        return self.heads * (self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim)


def latent_bytes_per_token(dims: MLADims, elem_bytes: int) -> int:
    """Bytes of one token's latent (the forward's travelling block)."""
    return dims.latent_width * elem_bytes


def expanded_bytes_per_token(dims: MLADims, elem_bytes: int) -> int:
    """Bytes of one token's expanded K and V."""
    return dims.expanded_width * elem_bytes


def ring_bytes_per_rank(
    dims: MLADims, *, seq_local: int, world: int, transfer: str, elem_bytes: int, batch: int = 1,
    acc_bytes: int = 4,
) -> int:
    """Bytes one rank sends for one layer over a dense ring (no documents or window), forward +
    backward: P-1 blocks forward, the same P-1 blocks again in the backward and P-1 travelling
    gradient accumulators (``acc_bytes`` per value: fp32, fp64 for fp64 inputs), each block
    ``batch * seq_local`` tokens of ``dims.latent_width`` values (``transfer="latent"``) or
    ``dims.expanded_width`` (``"expanded"``: K and V)."""
    if transfer not in TRANSFERS:
        raise ValueError(f"transfer={transfer!r} is invalid: choose one of {list(TRANSFERS)}")
    width = dims.latent_width if transfer == "latent" else dims.expanded_width
    return (world - 1) * batch * seq_local * width * (2 * elem_bytes + acc_bytes)


class MLAExpander:
    """Expands latent blocks with ``kv_b_proj``'s ``weight`` and reduces their K/V gradients back
    (a :class:`~seqpar.attn.common.BlockExpander`); ``grad_weight`` accumulates ``weight``'s gradient
    (fp32, fp64 for fp64 inputs) over every block reduced."""

    def __init__(self, weight: Tensor, dims: MLADims) -> None:
        self.weight, self.dims = weight, dims
        self.v_head_dim = dims.v_head_dim
        self.grad_weight: Tensor | None = None

    def expand(self, c: Tensor, r: Tensor) -> tuple[Tensor, Tensor]:
        """``c`` ``(B, 1, L, kv_lora_rank)``, ``r`` ``(B, 1, L, d_rope)`` -> k ``(B, H, L, d_nope + d_rope)``,
        v ``(B, H, L, d_v)``, as transformers' ``expand_kv`` builds them."""
        d = self.dims
        b, _, n, _ = c.shape
        kv = torch.matmul(c.squeeze(1), self.weight.t().to(c.dtype))  # (B, L, H * (d_nope + d_v))
        kv = kv.view(b, n, d.heads, d.qk_nope_head_dim + d.v_head_dim).transpose(1, 2)  # (B, H, L, d_nope + d_v)
        # one cat, not copies into narrowed views of an empty k (those raise on fake CUDA tensors)
        k = torch.cat((kv.narrow(-1, 0, d.qk_nope_head_dim), r.expand(b, d.heads, n, d.qk_rope_head_dim)), dim=-1)
        return k, kv.narrow(-1, d.qk_nope_head_dim, d.v_head_dim)

    def reduce(self, c: Tensor, r: Tensor, dk: Tensor, dv: Tensor) -> tuple[Tensor, Tensor]:
        """The latent's share ``(dc (B, 1, L, kv_lora_rank), dr (B, 1, L, d_rope))`` from K/V shares
        ``dk`` ``(B, H, L, d_nope + d_rope)`` and ``dv`` ``(B, H, L, d_v)``, in their (fp32) dtype; adds
        this block's term to :attr:`grad_weight`."""
        d = self.dims
        acc = dk.dtype
        b, _, n, _ = c.shape
        dkv = torch.cat((dk.narrow(-1, 0, d.qk_nope_head_dim), dv.to(acc)), dim=-1)  # (B, H, L, d_nope + d_v)
        dkv = dkv.transpose(1, 2).reshape(b * n, -1)  # (B * L, H * (d_nope + d_v)), kv_b_proj's output layout
        dc = torch.matmul(dkv, self.weight.to(acc)).view(b, 1, n, d.kv_lora_rank)
        dr = dk.narrow(-1, d.qk_nope_head_dim, d.qk_rope_head_dim).sum(dim=1, keepdim=True)  # shared by the heads
        term = torch.matmul(dkv.t(), c.reshape(b * n, d.kv_lora_rank).to(acc))  # (H * (d_nope + d_v), kv_lora_rank)
        self.grad_weight = term if self.grad_weight is None else self.grad_weight.add_(term)
        return dc, dr


def _function_forward(ctx: Any, run: Callable[..., tuple[Tensor, Tensor]], q: Tensor, c: Tensor, r: Tensor,
                      weight: Tensor, comm: Any, opts: AttentionOptions, dims: MLADims,
                      sinks: Tensor | None) -> Tensor:
    """The forward of both latent Functions: ``run`` (``ring_forward`` over a :class:`RingExchange`, or
    ``allgather_forward`` over a process group ``comm``) with an :class:`MLAExpander`; ``out`` in q's dtype and
    memory layout (the accumulator itself where it already is: a fresh tensor either way)."""
    opts = replace(opts, head_chunks=1)  # every head reads the one latent: no head passes
    out_acc, lse = run(q, c, r, comm, opts, sinks, expander=MLAExpander(weight, dims))
    out = out_acc if out_acc.dtype == q.dtype and in_layout_of(out_acc, q) else \
        output_like(q, dims.v_head_dim).copy_(out_acc)
    ctx.save_for_backward(q, c, r, weight, out, lse, sinks)
    ctx.comm, ctx.opts, ctx.dims = comm, opts, dims
    return out


def _function_backward(ctx: Any, run: Callable[..., tuple[Tensor, Tensor, Tensor]], dout: Tensor) -> tuple:
    """The backward of both latent Functions (``run``: ``ring_backward`` or ``allgather_backward``): the
    gradients of q, c, r, weight and the sinks, None for the rest."""
    q, c, r, weight, out, lse, sinks = ctx.saved_tensors
    expander = MLAExpander(weight, ctx.dims)
    dq, dc, dr = run(dout, q, c, r, out, lse, ctx.comm, ctx.opts, expander=expander)
    d_weight = expander.grad_weight.to(weight.dtype)
    dsinks = None if sinks is None else sink_grad(dout, out, lse, sinks)
    return dq, dc, dr, d_weight, None, None, None, dsinks


class LatentRingAttention(torch.autograd.Function):
    """Ring attention whose blocks travel as MLA latents; a thin wrapper of the ring's forward and
    backward with an :class:`MLAExpander`. Gradients: q, the latent ``c`` and ``r`` (this rank's
    tokens, summed over every rank's queries), ``weight`` (this rank's share, summed over SP by the
    usual gradient reduction of a replicated weight) and the sinks (this rank's rows' share)."""

    @staticmethod
    def forward(  # noqa: ANN001
        ctx, q: Tensor, c: Tensor, r: Tensor, weight: Tensor, comm: RingExchange, opts: AttentionOptions,
        dims: MLADims, sinks: Tensor | None = None,
    ) -> Tensor:
        return _function_forward(ctx, ring_forward, q, c, r, weight, comm, opts, dims, sinks)

    @staticmethod
    def backward(ctx, dout: Tensor):  # noqa: ANN001, ANN205
        return _function_backward(ctx, ring_backward, dout)


class LatentAllGatherAttention(torch.autograd.Function):
    """All-gather attention whose blocks are gathered as MLA latents and expanded per block (the
    backward reduce-scatters latent gradients); gradients as :class:`LatentRingAttention`'s."""

    @staticmethod
    def forward(  # noqa: ANN001
        ctx, q: Tensor, c: Tensor, r: Tensor, weight: Tensor, group: dist.ProcessGroup, opts: AttentionOptions,
        dims: MLADims, sinks: Tensor | None = None,
    ) -> Tensor:
        return _function_forward(ctx, allgather_forward, q, c, r, weight, group, opts, dims, sinks)

    @staticmethod
    def backward(ctx, dout: Tensor):  # noqa: ANN001, ANN205
        return _function_backward(ctx, allgather_backward, dout)


# --------------------------------------------------------------------------------------------------
# Under torch.compile: the latent ring and all-gather as custom ops (issue 31)
# --------------------------------------------------------------------------------------------------
# dynamo cannot trace the ring's isend/irecv nor an async collective (each a graph break), so while it
# traces, :func:`compiled_latent_attention` runs the two classes above as a forward and a backward custom
# op (as seqpar.attn.ops does for the expanded K/V): one opaque node each, a fake implementation for the
# shapes and a registered autograd formula; inside, the same eager algorithms. A custom op takes tensors and
# primitives only: the group by name (seqpar.comm.group_names), MLADims and AttentionOptions as their
# fields. Document boundaries traced as a tensor are refused before (SwapOptions.latent_attention).


def _latent_comm(algorithm: str, group: str) -> Any:
    resolved = group_by_name(group)
    return RingComm(resolved) if algorithm == "ring" else resolved


def _latent_opts(causal: bool, scale: float, sharding: str, overlap: bool, window: int | None,
                 cu_seqlens: list[int] | None, chunk_size: int | None, softcap: float | None,
                 dkv_wire_dtype: str) -> AttentionOptions:
    return AttentionOptions(causal=causal, scale=scale, sharding=sharding, overlap=overlap, head_chunks=1,
                            window=window, cu_seqlens=None if cu_seqlens is None else tuple(cu_seqlens),
                            chunk_size=chunk_size, softcap=softcap, dkv_wire_dtype=dkv_wire_dtype)


@torch.library.custom_op("seqpar::latent_attention_fwd", mutates_args=())
def latent_attention_fwd(
    q: Tensor, c: Tensor, r: Tensor, weight: Tensor, sinks: Tensor | None, algorithm: str, group: str, heads: int,
    qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, kv_lora_rank: int, causal: bool, scale: float,
    sharding: str, overlap: bool, window: int | None, cu_seqlens: list[int] | None, chunk_size: int | None,
    softcap: float | None, dkv_wire_dtype: str,
) -> tuple[Tensor, Tensor]:
    """``(out, lse)``: ``out`` ``(batch, heads, seq_local, v_head_dim)`` laid out as q (never aliasing an
    input), lse ``(batch, heads, seq_local)`` fp32 (fp64 for fp64 inputs)."""
    dims = MLADims(heads, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, kv_lora_rank)
    opts = _latent_opts(causal, scale, sharding, overlap, window, cu_seqlens, chunk_size, softcap, dkv_wire_dtype)
    comm = _latent_comm(algorithm, group)
    run = ring_forward if algorithm == "ring" else allgather_forward
    out_acc, lse = run(q, c, r, comm, opts, sinks, expander=MLAExpander(weight, dims))
    return output_like(q, v_head_dim).copy_(out_acc), lse.contiguous()  # the fake's layout (see seqpar.attn.ops)


@latent_attention_fwd.register_fake
def _(q, c, r, weight, sinks, algorithm, group, heads, qk_nope_head_dim, qk_rope_head_dim, v_head_dim,  # noqa: ANN001, ANN202
      kv_lora_rank, causal, scale, sharding, overlap, window, cu_seqlens, chunk_size, softcap, dkv_wire_dtype):
    from seqpar.kernels import lse_dtype

    return output_like(q, v_head_dim), q.new_empty(q.shape[:-1], dtype=lse_dtype(q.dtype))


@torch.library.custom_op("seqpar::latent_attention_bwd", mutates_args=())
def latent_attention_bwd(
    dout: Tensor, q: Tensor, c: Tensor, r: Tensor, weight: Tensor, out: Tensor, lse: Tensor, algorithm: str, group: str,
    heads: int, qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, kv_lora_rank: int, causal: bool,
    scale: float, sharding: str, overlap: bool, window: int | None, cu_seqlens: list[int] | None,
    chunk_size: int | None, softcap: float | None, dkv_wire_dtype: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dq, dc, dr, dweight)``, each in its input's dtype and laid out as it."""
    dims = MLADims(heads, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, kv_lora_rank)
    opts = _latent_opts(causal, scale, sharding, overlap, window, cu_seqlens, chunk_size, softcap, dkv_wire_dtype)
    comm = _latent_comm(algorithm, group)
    expander = MLAExpander(weight, dims)
    run = ring_backward if algorithm == "ring" else allgather_backward
    dq, dc, dr = run(dout, q, c, r, out, lse, comm, opts, expander=expander)
    grads = (dq, dc, dr, expander.grad_weight)
    return tuple(torch.empty_like(x).copy_(g) for g, x in zip(grads, (q, c, r, weight), strict=True))


@latent_attention_bwd.register_fake
def _(dout, q, c, r, weight, out, lse, algorithm, group, heads, qk_nope_head_dim, qk_rope_head_dim,  # noqa: ANN001, ANN202
      v_head_dim, kv_lora_rank, causal, scale, sharding, overlap, window, cu_seqlens, chunk_size, softcap,
      dkv_wire_dtype):
    return torch.empty_like(q), torch.empty_like(c), torch.empty_like(r), torch.empty_like(weight)


def _latent_setup(ctx, inputs, output) -> None:  # noqa: ANN001
    q, c, r, weight, sinks, *rest = inputs
    out, lse = output
    ctx.save_for_backward(q, c, r, weight, out, lse, sinks)
    ctx.mark_non_differentiable(lse)
    ctx.rest = rest  # algorithm, group name, the dims and the flat options: primitives


def _latent_backward(ctx, dout: Tensor, dlse: Tensor | None):  # noqa: ANN001, ANN202
    q, c, r, weight, out, lse, sinks = ctx.saved_tensors
    dq, dc, dr, dweight = latent_attention_bwd(dout, q, c, r, weight, out, lse, *ctx.rest)
    dsinks = None if sinks is None else sink_grad(dout, out, lse, sinks)
    return dq, dc, dr, dweight, dsinks, *([None] * len(ctx.rest))


latent_attention_fwd.register_autograd(_latent_backward, setup_context=_latent_setup)


def compiled_latent_attention(algorithm: str, group: dist.ProcessGroup, opts: AttentionOptions, dims: MLADims,
                              q: Tensor, c: Tensor, r: Tensor, weight: Tensor, sinks: Tensor | None) -> Tensor:
    """:class:`LatentRingAttention` (``algorithm="ring"``) or :class:`LatentAllGatherAttention`
    (``"allgather"``) as custom ops, for calls while dynamo traces; same arguments and output."""
    if algorithm not in ("ring", "allgather"):
        raise ValueError(f"compiled_latent_attention: algorithm {algorithm!r} is not 'ring' or 'allgather'")
    cu = None if opts.cu_seqlens is None else list(opts.cu_seqlens)
    out, _ = latent_attention_fwd(
        q, c, r, weight, sinks, algorithm, group_name(group), dims.heads, dims.qk_nope_head_dim,
        dims.qk_rope_head_dim, dims.v_head_dim, dims.kv_lora_rank, opts.causal, opts.scale, opts.sharding,
        opts.overlap, opts.window, cu, opts.chunk_size, opts.softcap, opts.dkv_wire_dtype)
    return out
