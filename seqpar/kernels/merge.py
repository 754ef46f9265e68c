"""Log-sum-exp merge of partial attention results over disjoint key sets.

For two partials (out_a, lse_a) and (out_b, lse_b) of the same query rows:
    lse = logaddexp(lse_a, lse_b)
    out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b
A row that has seen no key yet carries lse = -inf; a row that never sees one ends with out = 0.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["merge_into", "merge_owned_into", "new_accumulators"]


def new_accumulators(q: Tensor, acc_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Empty partials for q ``(batch, heads, len, head_dim)``: out zeros, lse -inf, in ``acc_dtype``."""
    out = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc_dtype, device=q.device)
    return out, lse


def merge_into(out_acc: Tensor, lse_acc: Tensor, block_out: Tensor, block_lse: Tensor) -> None:
    """Merge a block's partial into the accumulators, in place.

    Args:
        out_acc: ``(batch, heads, len, head_dim)`` accumulator (fp32/fp64; may be a view).
        lse_acc: ``(batch, heads, len)`` accumulator, same dtype.
        block_out: ``(batch, heads, len, head_dim)`` in any float dtype.
        block_lse: ``(batch, heads, len)``.
    """
    block_lse = block_lse.to(lse_acc.dtype)
    new_lse = torch.logaddexp(lse_acc, block_lse)
    # Where both are -inf, logaddexp is -inf and exp(-inf - -inf) would be NaN: subtract 0 there
    # instead, which makes both weights exp(-inf) = 0 and keeps the row at 0.
    ref = torch.where(torch.isneginf(new_lse), torch.zeros_like(new_lse), new_lse)
    w_acc = torch.exp(lse_acc - ref).unsqueeze(-1)
    w_blk = torch.exp(block_lse - ref).unsqueeze(-1)
    out_acc.mul_(w_acc).add_(block_out.to(out_acc.dtype) * w_blk)
    lse_acc.copy_(new_lse)


def merge_owned_into(out_acc: Tensor, lse_acc: Tensor, block_out: Tensor, block_lse: Tensor) -> None:
    """:func:`merge_into` for a ``block_out`` the caller owns and drops afterwards: it is scaled in
    place when it already has the accumulator's dtype, saving one block-sized temporary."""
    if block_out.dtype != out_acc.dtype:
        merge_into(out_acc, lse_acc, block_out, block_lse)
        return
    block_lse = block_lse.to(lse_acc.dtype)
    new_lse = torch.logaddexp(lse_acc, block_lse)
    ref = torch.where(torch.isneginf(new_lse), torch.zeros_like(new_lse), new_lse)
    out_acc.mul_(torch.exp(lse_acc - ref).unsqueeze(-1)).add_(block_out.mul_(torch.exp(block_lse - ref).unsqueeze(-1)))
    lse_acc.copy_(new_lse)
