"""ALiBi (BLOOM, MPT, Falcon ``alibi=True``) as extra query/key columns, exact under any sharding.

ALiBi adds ``-m_h (i - j)`` to the score of query i and key j in head h. Softmax ignores a per-row
constant, so that is the per-key bias ``m_h j`` (transformers' BLOOM and MPT build exactly such a
per-key bias), and a per-key bias is one more term of the dot product: with
``q' = [q, m_h / scale]`` and ``k' = [k, j]`` the kernels' ``scale * q'.k'`` is ``scale * q.k + m_h j``
(v unchanged: the kernels take a K head dim other than V's). ``j`` is the key's *global*
position, so the columns travel with K/V through every mode (ring, all-gather, Ulysses, hybrid) and
every kernel unchanged, and the slopes stay on the query side (GQA needs no K/V expansion).

Half precision: bf16 holds integers exactly only up to 256 and ``m_h / scale`` to 8 bits, so
``m_h j`` rounded as one column is off by several logits at j = 8192. Instead ``j`` is split into its
base-256 digits (``j = sum_t d_t 256^t``, each ``d_t 256^t`` exact) and ``m_h / scale`` into three
parts (``m0 + m1 + m2``, ~24 bits); the columns hold every product, which the kernels accumulate in
fp32. fp32 / fp64 use one column each (positions exact up to 2^24).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["alibi_columns", "with_alibi"]

_PARTS_HALF = 3  # parts of m_h / scale in bf16 / fp16: ~8 bits each


def alibi_columns(
    slopes: Tensor, positions: Tensor, scale: float, dtype: torch.dtype, max_position: int
) -> tuple[Tensor, Tensor]:
    """``(q_cols (q_heads, n), k_cols (len, n))`` in ``dtype`` with ``scale * q_cols[h] . k_cols[j]`` =
    ``slopes[h] * positions[j]`` (to fp32 accuracy).

    Args:
        slopes: ``(q_heads,)`` ALiBi slopes ``m_h``.
        positions: ``(len,)`` global key positions (int64).
        scale: the kernels' score multiplier.
        max_position: the largest global position of the sequence (a host int: no device read).
    """
    m = slopes.detach().to(torch.float64) / scale  # (H,)
    pos = positions.to(torch.float64)
    if dtype in (torch.float32, torch.float64):
        return m.to(dtype)[:, None], pos.to(dtype)[:, None]
    top = max_position
    digits = max(1, math.ceil(math.log(top + 1, 256)))
    if dtype == torch.float16 and top >= 65536:
        raise ValueError(
            f"ALiBi in float16 at global positions up to {top}: a 256^2 digit overflows float16 (max 65504); "
            "use bfloat16 or float32 for sequences longer than 65536"
        )
    m_parts, rest = [], m
    for _ in range(_PARTS_HALF):
        part = rest.to(dtype)
        m_parts.append(part)
        rest = rest - part.to(torch.float64)
    j_parts, rest_j = [], positions.to(torch.int64)
    for t in range(digits):
        j_parts.append(((rest_j % 256) * 256**t).to(dtype))
        rest_j = rest_j // 256
    q_cols = torch.stack([mp for _ in j_parts for mp in m_parts], dim=-1)  # (H, digits * parts)
    k_cols = torch.stack([jp for jp in j_parts for _ in m_parts], dim=-1)  # (len, digits * parts)
    return q_cols, k_cols


def with_alibi(
    q: Tensor, k: Tensor, v: Tensor, slopes: Tensor, positions: Tensor, scale: float, max_position: int
) -> tuple[Tensor, Tensor, Tensor]:
    """q, k ``(batch, heads, seq_local, head_dim)`` widened by the ALiBi columns, v as it is (the
    attention takes a Q/K head dim other than V's); ``positions``: ``(seq_local,)`` global positions of
    this rank's rows, the largest in the whole sequence ``max_position``. Gradients reach q and k
    through the concatenation."""
    b, hq, n, _ = q.shape
    hkv = k.shape[1]
    q_cols, k_cols = alibi_columns(slopes.to(q.device), positions.to(q.device), scale, q.dtype, max_position)
    extra = q_cols.shape[-1]
    q2 = torch.cat([q, q_cols.view(1, hq, 1, extra).expand(b, hq, n, extra)], dim=-1)
    k2 = torch.cat([k, k_cols.view(1, 1, n, extra).expand(b, hkv, n, extra).to(k.dtype)], dim=-1)
    return q2, k2, v
