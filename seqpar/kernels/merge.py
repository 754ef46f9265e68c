"""Log-sum-exp merge of partial attention results over disjoint key sets.

For two partials (out_a, lse_a) and (out_b, lse_b) of the same query rows:
    lse = logaddexp(lse_a, lse_b)
    out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b = lerp(out_a, out_b, sigmoid(lse_b - lse_a))
The lerp form (ring-flash-attn's) is one fused pass over ``out`` and needs no ``-inf`` guard as long
as the block's lse is finite wherever the accumulator's is ``-inf`` (weight 1: the block replaces it).

Accumulators are initialised from the first partial that reaches each row (:class:`Partials`), not
from zeros and ``-inf``: a copy instead of a fill plus a merge. Pieces may cover only some rows (the
planners hand out row ranges); rows that no piece reaches end as out = 0, lse = -inf. A learned
per-head sink is one more term with a single logit and value 0 (:func:`add_sink`).

Layouts: out ``(batch, heads, len, v_head_dim)`` (V's head dim, which may differ from q/k's), lse
``(batch, heads, len)``; accumulators fp32 (fp64 for fp64 inputs), blocks in any float dtype.
"""

from __future__ import annotations

import functools
import importlib
import math
from collections.abc import Iterator

import torch
from torch import Tensor

__all__ = ["merge_into", "add_sink", "sink_grad", "Partials", "new_accumulators", "output_like", "in_layout_of"]


def _out_shape(q: Tensor, v_head_dim: int | None) -> tuple[int, ...]:
    # the output has q's rows and V's head dim (MLA: V's differs from q/k's)
    return (*q.shape[:-1], q.shape[-1] if v_head_dim is None else v_head_dim)


def _dim_order(q: Tensor) -> list[int]:
    # q's dimensions from outermost to innermost in memory (ties: in index order)
    return sorted(range(q.dim()), key=lambda i: -q.stride(i))


def output_like(q: Tensor, v_head_dim: int | None = None, dtype: torch.dtype | None = None) -> Tensor:
    """An uninitialised output ``(batch, heads, len, v_head_dim)`` for q ``(batch, heads, len, head_dim)``,
    laid out in memory as q is (a Hugging Face q is a ``(batch, seq, heads, dim)`` buffer seen
    transposed: the output then is too, and the caller's transpose back is free). ``v_head_dim``
    default: q's; ``dtype`` default: q's."""
    dtype = q.dtype if dtype is None else dtype
    if v_head_dim is None or v_head_dim == q.shape[-1]:
        return torch.empty_like(q, dtype=dtype)
    order = _dim_order(q)
    shape = _out_shape(q, v_head_dim)
    buf = torch.empty([shape[i] for i in order], dtype=dtype, device=q.device)
    return buf.permute([order.index(i) for i in range(q.dim())])


def in_layout_of(x: Tensor, q: Tensor) -> bool:
    """``x`` is dense in q's memory order (what :func:`output_like` makes), whatever its last dim."""
    return x.permute(_dim_order(q)).is_contiguous()


def new_accumulators(q: Tensor, acc_dtype: torch.dtype, v_head_dim: int | None = None) -> tuple[Tensor, Tensor]:
    """The empty partial for q ``(batch, heads, len, head_dim)``: out ``(batch, heads, len, v_head_dim)``
    zeros (``v_head_dim`` default: q's), laid out in memory as q is (:func:`output_like`: where ``acc_dtype``
    is q's, the output can be the accumulator itself, no copy), and lse ``(batch, heads, len)`` -inf
    (contiguous), both in ``acc_dtype``. For callers whose pieces reach rows in patterns too irregular to
    track (dilated attention: :func:`seqpar.attn.dilated_schedule.dilated_forward`)."""
    out = output_like(q, v_head_dim, dtype=acc_dtype).zero_()
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc_dtype, device=q.device)
    return out, lse


def merge_into(out_acc: Tensor, lse_acc: Tensor, block_out: Tensor, block_lse: Tensor) -> None:
    """Merge a block's partial into initialised accumulators, in place, with no block-sized temporary.

    On CUDA (fp32 accumulators, blocks in fp32/fp16/bf16, last dims contiguous, Triton present) this is
    one fused kernel (:mod:`seqpar.kernels.merge_triton`) that reads both partials once and writes the
    accumulators once; otherwise the same maths in torch, converting a block of another dtype a chunk
    of rows at a time (temporaries of at most ``_CPU_CHUNK`` elements) instead of whole.

    Args:
        out_acc: ``(batch, heads, len, head_dim)`` accumulator (fp32/fp64; may be a view).
        lse_acc: ``(batch, heads, len)`` accumulator, same dtype; ``-inf`` allowed where ``out_acc`` is 0
            (the empty partial).
        block_out: ``(batch, heads, len, head_dim)`` in any float dtype.
        block_lse: ``(batch, heads, len)``; ``-inf`` (a row that saw no key of the block) leaves the
            row as it is, also where ``lse_acc`` is ``-inf``.
    """
    if _fused(out_acc, lse_acc, block_out, block_lse):
        torch.ops.seqpar.lse_merge_(out_acc, lse_acc, block_out, block_lse)
    else:
        _merge_torch(out_acc, lse_acc, block_out, block_lse)


def add_sink(out_acc: Tensor, lse_acc: Tensor, sink: Tensor) -> None:
    """Add a per-head sink logit ``sink`` ``(heads,)`` to the softmax denominators, in place.

    A sink is a key with logit ``sink[h]`` and value 0: merging it rescales ``out`` by
    ``exp(lse - lse_new) = sigmoid(lse - sink)`` and sets ``lse_new = logaddexp(lse, sink)``. A row
    with no key (lse = -inf, out = 0) stays out = 0 and gets lse = sink. One fused kernel on CUDA
    (as :func:`merge_into`)."""
    s = sink.view(1, -1, 1).expand(lse_acc.shape)
    if _fused(out_acc, lse_acc, None, s):
        torch.ops.seqpar.lse_merge_(out_acc, lse_acc, None, s)
    else:
        _merge_torch(out_acc, lse_acc, None, s)


# ------------------------------------------------------------------------------------ the two paths
_CPU_CHUNK = 1 << 14  # output elements per step of the torch path (its fp64 temporaries: 128 KiB)
# the fewest output elements per step (fp64 temporaries of 32 KiB): 1/64 of a small block is a few rows,
# and a Python step per few rows cost far more than the merge (a 128 x 16 piece was 64 steps of 2 rows)
_CPU_MIN_PIECE = 1 << 12
_FUSED_BLOCK_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def cpu_merge_piece(elems: int, row: int = 1) -> int:
    """The most output elements the CPU merge (``_merge_torch``) upcasts to fp64 at a time, for an accumulator of
    ``elems`` output elements in rows of ``row``: 1/64 of it, but at least ``_CPU_MIN_PIECE`` elements (and one row)
    and at most ``_CPU_CHUNK`` (the memory estimator counts these temporaries: :mod:`seqpar.memory.attention`)."""
    return min(_CPU_CHUNK, max(row, elems // 64, _CPU_MIN_PIECE))


@functools.cache
def _triton_available() -> bool:
    """Triton imports (torch's CUDA build ships it). Asked once per process, never per call."""
    try:
        importlib.import_module("seqpar.kernels.merge_triton")
    except ImportError:
        return False
    return True


def _fused(out_acc: Tensor, lse_acc: Tensor, block_out: Tensor | None, block_lse: Tensor) -> bool:
    """Whether the fused CUDA kernel takes this merge (``block_out`` None: a sink). The kernel computes
    in fp32, so fp64 accumulators stay on the torch path; it indexes the last dim densely, so a strided
    one does too, and so does anything shaped unlike the accumulator (the torch path broadcasts)."""
    if out_acc.device.type != "cuda" or out_acc.dtype != torch.float32 or lse_acc.dtype != torch.float32:
        return False
    if out_acc.dim() != 4 or (out_acc.stride(-1) != 1 and out_acc.shape[-1] > 1):
        return False
    if block_out is not None:
        if block_out.shape != out_acc.shape or block_out.dtype not in _FUSED_BLOCK_DTYPES:
            return False
        if block_out.stride(-1) != 1 and block_out.shape[-1] > 1:
            return False
    if block_lse.dtype not in _FUSED_BLOCK_DTYPES or out_acc.numel() >= 2**31:
        return False
    return _triton_available()


@torch.library.custom_op("seqpar::lse_merge_", mutates_args=("out", "lse"), device_types="cuda")
def _lse_merge_cuda(out: Tensor, lse: Tensor, block_out: Tensor | None, block_lse: Tensor) -> None:
    # an opaque op: fake tensors (the host-sync checker, torch.compile) see its shape function below
    # and never reach the launcher
    from seqpar.kernels.merge_triton import launch_merge

    with torch.cuda.device(out.device):  # Triton launches on the current device's current stream
        launch_merge(out, lse, block_out, block_lse)


@_lse_merge_cuda.register_fake
def _(out: Tensor, lse: Tensor, block_out: Tensor | None, block_lse: Tensor) -> None:
    return None


def _merge_torch(out_acc: Tensor, lse_acc: Tensor, block_out: Tensor | None, block_lse: Tensor) -> None:
    """:func:`merge_into` (``block_out`` None: :func:`add_sink`) in torch ops, with the fused kernel's
    maths: weights and products in fp64, one rounding on the store. Temporaries: lse-sized, and at most
    ``_CPU_CHUNK`` elements (and 1/64, or ``_CPU_MIN_PIECE`` elements when that is more) of the output at a
    time."""
    a, c = lse_acc.double(), block_lse.double()
    empty = torch.isneginf(c)  # the block saw no key: keep the row (NaN weights where a = -inf too)
    rows = (*out_acc.shape[:-1], 1)  # the weights broadcast over each row, and are cut with it
    w_acc = torch.sigmoid(a - c).masked_fill_(empty, 1.0).unsqueeze(-1).expand(rows)  # = exp(lse - merged lse)
    w_blk = None if block_out is None else torch.sigmoid(c - a).masked_fill_(empty, 0.0).unsqueeze(-1).expand(rows)
    block_out = None if block_out is None else block_out.expand(out_acc.shape)
    # pieces of at most _CPU_CHUNK elements and 1/64 of the block: the fp64 temporaries stay a small
    # share of a large block (a whole block in fp64 was 4x its fp32 size at the merge); a small block's
    # pieces are _CPU_MIN_PIECE elements (32 KiB in fp64), not a Python step per few rows
    limit = cpu_merge_piece(out_acc.numel(), out_acc.shape[-1])
    for piece in _pieces(out_acc.shape, limit):
        acc = _narrow(out_acc, piece)
        merged = acc.double()  # acc itself for fp64 accumulators
        merged.mul_(_narrow(w_acc, piece))
        if w_blk is not None:
            merged.addcmul_(_narrow(block_out, piece).double(), _narrow(w_blk, piece))
        if merged is not acc:
            acc.copy_(merged)
    lse_acc.copy_(torch.logaddexp(a, c))


def _pieces(shape: torch.Size, limit: int, dim: int = 0) -> Iterator[tuple[tuple[int, int, int], ...]]:
    """Cuts of a ``(..., rows, dim)`` shape into pieces of whole rows, at most ``limit`` elements each
    (one row, if a row is longer), as tuples of ``(dim, start, length)`` narrowings: ranges along the
    outermost dim whose slices fit, else one index of it at a time and the next dim cut likewise."""
    if len(shape) < 2:
        yield ()
        return
    inner = math.prod(shape[dim + 1:])  # elements under one index of `dim`
    if inner <= limit or dim == len(shape) - 2:
        step = max(1, limit // max(inner, 1))
        for i in range(0, shape[dim], step):
            yield ((dim, i, min(step, shape[dim] - i)),)
        return
    for i in range(shape[dim]):
        for rest in _pieces(shape, limit, dim + 1):
            yield ((dim, i, 1), *rest)


def _narrow(x: Tensor, piece: tuple[tuple[int, int, int], ...]) -> Tensor:
    for dim, start, length in piece:
        x = x.narrow(dim, start, length)
    return x


def sink_grad(dout: Tensor, out: Tensor, lse: Tensor, sink: Tensor) -> Tensor:
    """Gradient of the sink logits ``(heads,)`` from these rows, in ``sink``'s dtype.

    With ``p = exp(sink - lse)`` the sink's softmax probability and ``out`` the final output,
    ``d out / d sink = -p * out``, so ``d sink[h] = -sum over batch, rows of p * rowsum(dout * out)``.
    ``dout``, ``out``: ``(batch, heads, len, head_dim)``; ``lse``: ``(batch, heads, len)`` with the sink in it.
    """
    acc = lse.dtype
    p = torch.exp(sink.to(acc).view(1, -1, 1) - lse)
    delta = (dout.to(acc) * out.to(acc)).sum(-1)
    return (-(p * delta).sum(dim=(0, 2))).to(sink.dtype)


class Partials:
    """fp32 out/lse accumulators of one query block, each row initialised by the first piece that
    reaches it (a copy), merged with :func:`merge_into` by every later one.

    Which rows have been reached is tracked on the host, from the pieces' row ranges: the planners
    build those from host integers, so this costs no device work and no sync.

    Args:
        out: ``(batch, heads, len, head_dim)`` storage (uninitialised; may be a view).
        lse: ``(batch, heads, len)`` storage, same dtype.
    """

    def __init__(self, out: Tensor, lse: Tensor) -> None:
        self.out, self.lse = out, lse
        self._reached: list[tuple[int, int]] = []  # disjoint, sorted row ranges
        self._pending: tuple[torch.Size, torch.dtype, torch.device] | None = None  # storage not made yet

    @classmethod
    def like(cls, q: Tensor, acc_dtype: torch.dtype, v_head_dim: int | None = None) -> Partials:
        """Accumulators for queries ``q`` ``(batch, heads, len, head_dim)`` and an output of
        ``v_head_dim`` columns (default: q's), made on first use: a first piece that covers every row
        in ``acc_dtype`` (a ring's own block, one kernel call) becomes the accumulator itself, with no copy."""
        acc = cls.__new__(cls)
        acc.out = acc.lse = None  # type: ignore[assignment]
        acc._reached = []
        acc._pending = (torch.Size(_out_shape(q, v_head_dim)), acc_dtype, q.device)
        return acc

    def _allocate(self) -> None:
        shape, dtype, device = self._pending  # type: ignore[misc]
        self.out = torch.empty(shape, dtype=dtype, device=device)
        self.lse = torch.empty(shape[:-1], dtype=dtype, device=device)
        self._pending = None

    def add(self, rows: slice, block_out: Tensor, block_lse: Tensor) -> None:
        """Fold a piece covering rows ``rows`` (``block_out`` ``(batch, heads, n, head_dim)``,
        ``block_lse`` ``(batch, heads, n)``, n = rows' length; every row saw at least one key).
        The piece's tensors may become the accumulators (see :meth:`like`): hand over fresh ones."""
        if self._pending is not None:
            shape, dtype, _ = self._pending
            if rows == slice(0, shape[2]) and block_out.dtype == dtype and block_lse.dtype == dtype:
                self.out, self.lse, self._pending = block_out, block_lse, None
                self._reach(rows.start, rows.stop)
                return
            self._allocate()
        start = rows.start
        for a, b, reached in self._split(rows.start, rows.stop):
            o = block_out.narrow(2, a - start, b - a)
            s = block_lse.narrow(2, a - start, b - a)
            out, lse = self.out.narrow(2, a, b - a), self.lse.narrow(2, a, b - a)
            if reached:
                merge_into(out, lse, o, s)
            else:
                out.copy_(o)
                lse.copy_(s)
        self._reach(rows.start, rows.stop)

    def finish(self) -> tuple[Tensor, Tensor]:
        """``(out, lse)``; rows no piece reached are set to out = 0, lse = -inf."""
        if self._pending is not None:
            self._allocate()
        done = 0
        for a, b in [*self._reached, (self.out.shape[2], self.out.shape[2])]:
            if a > done:
                self.out.narrow(2, done, a - done).zero_()
                self.lse.narrow(2, done, a - done).fill_(float("-inf"))
            done = b
        return self.out, self.lse

    def _split(self, a: int, b: int) -> list[tuple[int, int, bool]]:
        """``[a, b)`` cut into runs of rows reached before (True) or not (False)."""
        runs: list[tuple[int, int, bool]] = []
        pos = a
        for ra, rb in self._reached:
            if rb <= pos or ra >= b:
                continue
            if ra > pos:
                runs.append((pos, ra, False))
            runs.append((max(ra, pos), min(rb, b), True))
            pos = min(rb, b)
        if pos < b:
            runs.append((pos, b, False))
        return runs

    def _reach(self, a: int, b: int) -> None:
        merged: list[tuple[int, int]] = []
        for ra, rb in sorted([*self._reached, (a, b)]):
            if merged and ra <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], rb))
            else:
                merged.append((ra, rb))
        self._reached = merged
