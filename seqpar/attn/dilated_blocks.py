"""The kernel calls of :mod:`seqpar.attn.dilated` on one rank: gathering a (pattern, offset)'s selected rows into a
compact ``(batch * n_seg, heads, rows, head_dim)`` tensor (one copy), one block kernel call over all its segments,
merging or scatter-adding the results back through strided views; the local patterns whole, and :class:`Span`:
this rank's part of a spanning pattern against any member's K/V block (packed flat). No communication here: the
exchanges are :mod:`seqpar.attn.dilated_schedule`'s."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from seqpar.attn.dilated_plan import DilatedOptions, OffsetPlan, PatternPlan
from seqpar.kernels import block_backward, block_forward, merge_into

__all__ = ["kv_index", "local_forward", "local_backward", "Span"]


# ------------------------------------------------------------------------------ gathers / scatters
@dataclass(frozen=True)
class _Rows:
    """Rows ``start::step`` of a local shard, cut into ``n_seg`` segments of ``m`` rows."""

    start: int
    step: int
    n_seg: int
    m: int

    def view(self, x: Tensor) -> Tensor:
        """``(b, h, seq_local, *rest)`` -> strided view ``(b, h, n_seg, m, *rest)``."""
        return x[:, :, self.start :: self.step].unflatten(2, (self.n_seg, self.m))


def kv_index(off: OffsetPlan, q_heads: int, group: int, device: torch.device) -> Tensor:
    """``off.kv_heads`` as an index tensor, made on ``device`` by an arange (a tensor built from host
    ints would be a blocking host-to-device copy in every layer). The i-th entry is the kv head of the
    query head ``q[i * per]`` of the offset's heads ``q``, ``per`` = query heads per entry."""
    heads = range(q_heads)[off.q_heads]
    per = len(heads) // len(off.kv_heads)
    return torch.arange(heads.start, heads.stop, heads.step * per, device=device).div_(group, rounding_mode="floor")


def _my_rows(pat: PatternPlan, off: OffsetPlan) -> _Rows:
    return _Rows(off.start, pat.rate, pat.n_seg, off.counts[pat.index] // pat.n_seg)


def _compact(x5: Tensor) -> Tensor:
    """``(b, h, n_seg, m, *rest)`` -> ``(b * n_seg, h, m, *rest)``: segments folded into the batch (a copy)."""
    return x5.transpose(1, 2).flatten(0, 1)


def _uncompact(x: Tensor, batch: int) -> Tensor:
    """``(b * n_seg, h, m, *rest)`` -> view ``(b, h, n_seg, m, *rest)``, the inverse of :func:`_compact`."""
    return x.unflatten(0, (batch, -1)).transpose(1, 2)


def _gather_q(x: Tensor, rows: _Rows, heads: slice) -> Tensor:
    # (b, H, L, ...) -> (b * n_seg, h_sel, m, ...)
    return _compact(rows.view(x)[:, heads])


def _gather_kv(x: Tensor, rows: _Rows, idx: Tensor) -> Tensor:
    # (b, Hkv, L, d) -> (b, n_seg, Hkv, m, d) view -> select kv heads (the one copy) -> (b * n_seg, kv_sel, m, d)
    return rows.view(x).transpose(1, 2).index_select(2, idx).flatten(0, 1)


def _scatter_kv_(acc: Tensor, rows: _Rows, idx: Tensor, grad: Tensor) -> None:
    # grad (b * n_seg, kv_sel, m, d) added into the rows/heads of acc (b, Hkv, L, d); repeated heads add up
    b = acc.shape[0]
    rows.view(acc).transpose(1, 2).index_add_(2, idx, grad.unflatten(0, (b, -1)).to(acc.dtype))


def _pack(tensors: Sequence[Tensor]) -> Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _unpack(flat: Tensor, shapes: Sequence[tuple[int, ...]]) -> list[Tensor]:
    sizes = [math.prod(s) for s in shapes]
    return [t.view(s) for t, s in zip(flat.split(sizes), shapes, strict=True)]


def _block_shapes(
    pat: PatternPlan, member: int, batch: int, head_dim: int, v_head_dim: int
) -> list[tuple[int, ...]]:
    """Shapes of the K/V block of segment member ``member``: ``[K_o, V_o]`` per offset,
    ``(batch, kv_sel, rows, head_dim)`` and ``(batch, kv_sel, rows, v_head_dim)``."""
    shapes = []
    for off in pat.offsets:
        rows = (batch, len(off.kv_heads), off.counts[member])
        shapes += [(*rows, head_dim), (*rows, v_head_dim)]
    return shapes



# ------------------------------------------------------------------------- local patterns (no comm)
def local_forward(q: Tensor, k: Tensor, v: Tensor, pat: PatternPlan, opts: DilatedOptions,
                   out_acc: Tensor, lse_acc: Tensor) -> None:
    b = q.shape[0]
    for off in pat.offsets:
        rows = _my_rows(pat, off)
        idx = kv_index(off, q.shape[1], q.shape[1] // k.shape[1], k.device)
        o, lse = block_forward(
            _gather_q(q, rows, off.q_heads), _gather_kv(k, rows, idx), _gather_kv(v, rows, idx),
            scale=opts.scale, causal=opts.causal,
        )
        merge_into(rows.view(out_acc)[:, off.q_heads], rows.view(lse_acc)[:, off.q_heads],
                   _uncompact(o, b), _uncompact(lse, b))


def local_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                    pat: PatternPlan, opts: DilatedOptions,
                    dq_acc: Tensor, dk_acc: Tensor, dv_acc: Tensor) -> None:
    b = q.shape[0]
    for off in pat.offsets:
        rows = _my_rows(pat, off)
        idx = kv_index(off, q.shape[1], q.shape[1] // k.shape[1], k.device)
        dq, dk, dv = block_backward(
            _gather_q(dout, rows, off.q_heads), _gather_q(q, rows, off.q_heads),
            _gather_kv(k, rows, idx), _gather_kv(v, rows, idx),
            _gather_q(out, rows, off.q_heads), _gather_q(lse, rows, off.q_heads),
            scale=opts.scale, causal=opts.causal,
        )
        rows.view(dq_acc)[:, off.q_heads].add_(_uncompact(dq, b))
        _scatter_kv_(dk_acc, rows, idx, dk)
        _scatter_kv_(dv_acc, rows, idx, dv)


# ------------------------------------------------------------------- spanning patterns: the kernels
class Span:
    """This rank's part of one spanning pattern: its compact queries, its K/V block, and the block
    kernels against any member's block (packed flat, in the layout of :func:`_block_shapes`)."""

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, pat: PatternPlan, opts: DilatedOptions) -> None:
        self.pat, self.opts = pat, opts
        self.batch, self.head_dim, self.v_head_dim = q.shape[0], q.shape[-1], v.shape[-1]
        self.dtype, self.device = k.dtype, k.device
        self.rows = [_my_rows(pat, off) for off in pat.offsets]
        self.idx = [kv_index(off, q.shape[1], q.shape[1] // k.shape[1], k.device) for off in pat.offsets]
        self.q = [_gather_q(q, r, off.q_heads) for r, off in zip(self.rows, pat.offsets, strict=True)]
        own = []
        for r, i in zip(self.rows, self.idx, strict=True):
            own += [_gather_kv(k, r, i), _gather_kv(v, r, i)]
        self.own = _pack(own)

    def shapes(self, j: int) -> list[tuple[int, ...]]:
        return _block_shapes(self.pat, j, self.batch, self.head_dim, self.v_head_dim)

    def numel(self, j: int) -> int:
        return sum(math.prod(s) for s in self.shapes(j))

    def empty(self, j: int, dtype: torch.dtype | None = None) -> Tensor:
        return torch.empty(self.numel(j), dtype=dtype or self.dtype, device=self.device)

    def _pairs(self, j: int) -> list[int]:
        me = self.pat.index
        return [n for n, off in enumerate(self.pat.offsets) if off.counts[me] and off.counts[j]]

    def forward(self, j: int, kv: Tensor, out_acc: Tensor, lse_acc: Tensor) -> None:
        blocks = _unpack(kv, self.shapes(j))
        causal = self.opts.causal and j == self.pat.index  # diagonal block; others fully visible
        for n in self._pairs(j):
            off, rows = self.pat.offsets[n], self.rows[n]
            o, lse = block_forward(self.q[n], blocks[2 * n], blocks[2 * n + 1], scale=self.opts.scale, causal=causal)
            merge_into(rows.view(out_acc)[:, off.q_heads], rows.view(lse_acc)[:, off.q_heads],
                       _uncompact(o, self.batch), _uncompact(lse, self.batch))

    def prepare_backward(self, dout: Tensor, out: Tensor, lse: Tensor) -> None:
        pairs = list(zip(self.rows, self.pat.offsets, strict=True))
        self.dout = [_gather_q(dout, r, off.q_heads) for r, off in pairs]
        self.out = [_gather_q(out, r, off.q_heads) for r, off in pairs]
        self.lse = [_gather_q(lse, r, off.q_heads) for r, off in pairs]

    def backward(self, j: int, kv: Tensor, dkv_acc: Tensor, dq_acc: Tensor) -> None:
        """Add block ``j``'s share of dq into ``dq_acc`` and its dK/dV into ``dkv_acc`` (packed, fp32)."""
        blocks, grads = _unpack(kv, self.shapes(j)), _unpack(dkv_acc, self.shapes(j))
        causal = self.opts.causal and j == self.pat.index
        for n in self._pairs(j):
            off, rows = self.pat.offsets[n], self.rows[n]
            dq, dk, dv = block_backward(
                self.dout[n], self.q[n], blocks[2 * n], blocks[2 * n + 1], self.out[n], self.lse[n],
                scale=self.opts.scale, causal=causal,
            )
            rows.view(dq_acc)[:, off.q_heads].add_(_uncompact(dq, self.batch))
            grads[2 * n].add_(dk)
            grads[2 * n + 1].add_(dv)

    def scatter_own(self, dkv_acc: Tensor, dk_acc: Tensor, dv_acc: Tensor) -> None:
        """Add this rank's finished (packed) dK/dV into the full-shard accumulators."""
        grads = _unpack(dkv_acc, self.shapes(self.pat.index))
        for n, (rows, idx) in enumerate(zip(self.rows, self.idx, strict=True)):
            if rows.m:
                _scatter_kv_(dk_acc, rows, idx, grads[2 * n])
                _scatter_kv_(dv_acc, rows, idx, grads[2 * n + 1])
