"""The LSE merge as one Triton kernel: one read of the accumulator and the block, one write of each.

Imported lazily by :mod:`seqpar.kernels.merge` (Triton ships with torch's CUDA build; a CPU build has
none). The maths is the torch path's:

    w_acc = sigmoid(lse - block_lse),  w_blk = sigmoid(block_lse - lse)    (1 and 0 where block_lse = -inf)
    out   = w_acc * out + w_blk * block_out
    lse   = max + log1p(exp(-|lse - block_lse|))                           (-inf where both are -inf)

computed in fp64 from the fp32 accumulators and the block's own dtype, so each merge rounds once, on
the store (fp64 ``exp``/``log`` lower to libdevice's ``__nv_exp``/``__nv_log``: PTX has no approximate
fp64 forms; ``log(1 + x)`` in fp64 is far inside fp32's rounding). fp32 arithmetic was measured at 3-4 ulp of the row's largest term (the weights' rounding is
amplified by |block_out - out|), and the kernel is bound by memory traffic, not arithmetic, on the GPUs
this serves. A sink (no ``block_out``) rescales instead: ``out *= sigmoid(lse - sink)``.

Layouts: ``out`` / ``block_out`` ``(batch, heads, len, dim)`` with any strides over the first three
dims and a dense last dim (the caller checks); ``lse`` / ``block_lse`` ``(batch, heads, len)`` with
any strides (0 for broadcast dims: a sink is ``(heads,)`` seen as ``(batch, heads, len)``). Each
program owns ``BLOCK_R`` whole rows, so every row's lse is read and written by one program.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

__all__ = ["launch_merge", "merge_kernel", "block_sizes"]


@triton.jit
def merge_kernel(
    out_ptr, lse_ptr, blk_ptr, blk_lse_ptr,  # noqa: ANN001
    rows, heads, length, dim,  # noqa: ANN001
    so_b, so_h, so_n, sl_b, sl_h, sl_n,  # noqa: ANN001
    sb_b, sb_h, sb_n, sbl_b, sbl_h, sbl_n,  # noqa: ANN001
    HAS_BLOCK_OUT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # flat row index over (batch, heads, len)
    r_ok = r < rows
    n = (r % length).to(tl.int64)
    h = ((r // length) % heads).to(tl.int64)
    b = (r // (length * heads)).to(tl.int64)
    lse_off = b * sl_b + h * sl_h + n * sl_n
    a = tl.load(lse_ptr + lse_off, mask=r_ok, other=0.0).to(tl.float64)
    c = tl.load(blk_lse_ptr + (b * sbl_b + h * sbl_h + n * sbl_n), mask=r_ok, other=0.0).to(tl.float64)

    # weights in the merged softmax; a = -inf gives (0, 1): the block replaces the empty partial;
    # c = -inf gives (1, 0): the row stays as it is (also where a = -inf, instead of NaN)
    empty = c == float("-inf")
    w_acc = tl.where(empty, 1.0, 1.0 / (1.0 + tl.exp(c - a)))
    cols = tl.arange(0, BLOCK_D)
    mask = r_ok[:, None] & (cols < dim)[None, :]
    out_off = (b * so_b + h * so_h + n * so_n)[:, None] + cols[None, :]
    res = tl.load(out_ptr + out_off, mask=mask, other=0.0).to(tl.float64) * w_acc[:, None]
    if HAS_BLOCK_OUT:
        w_blk = tl.where(empty, 0.0, 1.0 / (1.0 + tl.exp(a - c)))
        blk = tl.load(blk_ptr + (b * sb_b + h * sb_h + n * sb_n)[:, None] + cols[None, :], mask=mask, other=0.0)
        res += blk.to(tl.float64) * w_blk[:, None]
    tl.store(out_ptr + out_off, res.to(out_ptr.dtype.element_ty), mask=mask)

    m = tl.maximum(a, c)
    none = m == float("-inf")
    d = tl.where(none, 0.0, tl.abs(a - c))  # both -inf: no NaN from -inf - -inf
    lse = tl.where(none, m, m + tl.log(1.0 + tl.exp(-d)))
    tl.store(lse_ptr + lse_off, lse.to(lse_ptr.dtype.element_ty), mask=r_ok)


def block_sizes(dim: int) -> tuple[int, int]:
    """``(BLOCK_R, BLOCK_D)``: the row width padded to a power of two, and rows per program so that a
    program holds about 2048 elements (16 fp64 values per thread and operand at 4 warps)."""
    block_d = triton.next_power_of_2(max(dim, 1))
    return max(1, 2048 // block_d), block_d


def launch_merge(out: Tensor, lse: Tensor, block_out: Tensor | None, block_lse: Tensor, kernel=None) -> None:  # noqa: ANN001
    """Merge ``(block_out, block_lse)`` into ``(out, lse)`` in place with one kernel launch.

    ``out`` ``(batch, heads, len, dim)`` fp32 with a dense last dim; ``block_out`` the same shape and a
    dense last dim, in fp32/fp16/bf16, or None for a sink; ``lse`` ``(batch, heads, len)`` fp32,
    ``block_lse`` the same shape (an expanded view is fine). ``kernel``: the jitted kernel (default
    :func:`merge_kernel`; tests pass one built under ``TRITON_INTERPRET=1``)."""
    kernel = merge_kernel if kernel is None else kernel
    batch, heads, length, dim = out.shape
    rows = batch * heads * length
    if rows == 0 or dim == 0:
        return
    block_r, block_d = block_sizes(dim)
    blk = out if block_out is None else block_out  # the sink's kernel never reads it
    grid = (triton.cdiv(rows, block_r),)
    kernel[grid](
        out, lse, blk, block_lse,
        rows, heads, length, dim,
        out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1), lse.stride(2),
        blk.stride(0), blk.stride(1), blk.stride(2), block_lse.stride(0), block_lse.stride(1), block_lse.stride(2),
        HAS_BLOCK_OUT=block_out is not None, BLOCK_R=block_r, BLOCK_D=block_d,
        num_warps=4,
    )
