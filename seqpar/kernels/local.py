"""Attention of one query block against one key/value block, returning ``(out, lse)``, and its backward.

Every distributed algorithm in seqpar is built from these two calls plus :func:`merge_into`:

- ``block_forward(q, k, v)`` -> ``out`` (in q's dtype) and ``lse`` = log-sum-exp of the scaled scores
  of each query row over the block's keys (fp32; fp64 for fp64 inputs).
- ``block_backward(dout, q, k, v, out, lse)`` with the *merged* ``out`` and ``lse`` of the whole row
  (over every block) returns this block's share of dq, dk, dv. Summing the shares over blocks gives the
  exact gradient: with P = exp(S - lse_merged) the softmax restricted to the block's columns, and
  delta = rowsum(dout * out_merged), dS = P * (dP - delta) is the true gradient of those columns.

Layouts: q ``(batch, q_heads, len_q, head_dim)``; k, v ``(batch, kv_heads, len_k, head_dim)`` with
q_heads a multiple of kv_heads (GQA/MQA: query head h reads kv head h // (q_heads // kv_heads)).
``causal`` is top-left aligned: query row i sees keys 0..i (the blocks the planners hand in are either
full, or diagonal with len_q == len_k).

Backends, chosen per call:
- CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` (+ backward). Handles GQA natively.
- CUDA: the flash kernel for fp16/bf16 with head_dim <= 256, else the memory-efficient kernel
  (it pads lse to a multiple of 32 rows, sliced off here); both need equal head counts, so K/V are
  expanded for GQA and dK/dV summed back over the group.
- anything else: an exact math fallback computed in fp32 (or fp64).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["block_forward", "block_backward", "lse_dtype"]

_aten = torch.ops.aten


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulator dtype for out/lse partials: fp32, or fp64 for fp64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_block(q: Tensor, k: Tensor, v: Tensor) -> int:
    """Return the GQA group size (q_heads // kv_heads)."""
    if q.shape[1] % k.shape[1]:
        raise ValueError(
            f"q has {q.shape[1]} heads and k/v have {k.shape[1]}: q_heads must be a multiple of kv_heads"
        )
    return q.shape[1] // k.shape[1]


def _expand_kv(x: Tensor, group: int) -> Tensor:
    # (B, Hkv, L, D) -> (B, Hkv * group, L, D), query head h reads kv head h // group
    if group == 1:
        return x
    b, h, n, d = x.shape
    return x[:, :, None].expand(b, h, group, n, d).reshape(b, h * group, n, d)


def _fold_kv_grad(dx: Tensor, group: int) -> Tensor:
    # (B, Hkv * group, L, D) -> (B, Hkv, L, D): the expanded copies' gradients add up
    if group == 1:
        return dx
    b, hg, n, d = dx.shape
    return dx.view(b, hg // group, group, n, d).sum(dim=2)


def _use_cuda_flash(q: Tensor) -> bool:
    return q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256 and q.shape[-1] % 8 == 0


# ---------------------------------------------------------------------------------------- forward
def block_forward(q: Tensor, k: Tensor, v: Tensor, *, scale: float, causal: bool) -> tuple[Tensor, Tensor]:
    """Attention of q against (k, v) -> ``(out, lse)``.

    Args:
        q: ``(batch, q_heads, len_q, head_dim)``.
        k, v: ``(batch, kv_heads, len_k, head_dim)``.
        scale: multiplier of q @ k^T (usually head_dim ** -0.5).
        causal: top-left aligned causal mask.
    Returns:
        out ``(batch, q_heads, len_q, head_dim)`` in q.dtype and lse ``(batch, q_heads, len_q)`` in
        fp32 (fp64 for fp64 inputs).
    """
    group = _check_block(q, k, v)
    if q.device.type == "cpu":
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale
        )
        return out, lse.to(lse_dtype(q.dtype))
    if q.device.type == "cuda" and q.dtype != torch.float64:
        return _cuda_forward(q, _expand_kv(k, group), _expand_kv(v, group), scale, causal)
    return _math_forward(q, k, v, scale, causal)


def _cuda_forward(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool) -> tuple[Tensor, Tensor]:
    if _use_cuda_flash(q):
        res = _aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return res[0], res[1].float()
    out, lse, _, _ = _aten._scaled_dot_product_efficient_attention(
        q, k, v, None, True, 0.0, causal, scale=scale
    )
    return out, lse[..., : q.shape[2]].float()


def _math_scores(q: Tensor, k: Tensor, scale: float, causal: bool) -> Tensor:
    acc = lse_dtype(q.dtype)
    group = q.shape[1] // k.shape[1]
    s = torch.matmul(q.to(acc), _expand_kv(k, group).to(acc).transpose(-1, -2)) * scale  # (B, H, Lq, Lk)
    if causal:
        lq, lk = s.shape[-2:]
        visible = torch.ones(lq, lk, dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~visible, float("-inf"))
    return s


def _math_forward(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool) -> tuple[Tensor, Tensor]:
    group = q.shape[1] // k.shape[1]
    s = _math_scores(q, k, scale, causal)
    lse = torch.logsumexp(s, dim=-1)  # (B, H, Lq)
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num_(0.0)
    out = torch.matmul(p, _expand_kv(v, group).to(p.dtype))
    return out.to(q.dtype), lse


# ---------------------------------------------------------------------------------------- backward
def block_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    *,
    scale: float,
    causal: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """This block's share of (dq, dk, dv), given the row's merged ``out`` and ``lse``.

    Args:
        dout, out: ``(batch, q_heads, len_q, head_dim)`` (out is the merged output over all blocks).
        q: ``(batch, q_heads, len_q, head_dim)``; k, v: ``(batch, kv_heads, len_k, head_dim)``.
        lse: ``(batch, q_heads, len_q)`` merged log-sum-exp (fp32 / fp64).
    Returns:
        dq like q, dk and dv like k and v (kv_heads), each in its input's dtype.
    """
    group = _check_block(q, k, v)
    if q.device.type == "cpu":
        # the CPU kernel wants lse in its own accumulation dtype (fp32 for half types)
        dq, dk, dv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse.to(lse_dtype(q.dtype)), 0.0, causal, scale=scale
        )
        return dq, dk, dv
    if q.device.type == "cuda" and q.dtype != torch.float64:
        dq, dk, dv = _cuda_backward(
            dout, q, _expand_kv(k, group), _expand_kv(v, group), out, lse, scale, causal
        )
        return dq, _fold_kv_grad(dk, group), _fold_kv_grad(dv, group)
    return _math_backward(dout, q, k, v, out, lse, scale, causal)


def _cuda_backward(dout, q, k, v, out, lse, scale, causal):  # noqa: ANN001, ANN202 (private)
    # Mirrors what torch's own autograd and context_parallel pass: dense (non-varlen) calls have
    # undefined cum_seq tensors, and with dropout 0 the philox state is never read.
    # NOTE: written against the 2.13 schemas, not yet run on a GPU (no device in the session that wrote it).
    lq, lk = q.shape[2], k.shape[2]
    rng = torch.zeros(2, dtype=torch.int64, device=q.device)
    if _use_cuda_flash(q):
        dq, dk, dv = _aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse.float().contiguous(), None, None, lq, lk, 0.0, causal,
            rng, rng, scale=scale,
        )
        return dq, dk, dv
    # the efficient kernel reads lse padded to a multiple of 32 rows
    lse_p = torch.nn.functional.pad(lse.float(), (0, (-lq) % 32)).contiguous()
    dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, None, out, lse_p, rng, rng, 0.0, [True, True, True, False], causal, scale=scale,
    )
    return dq, dk, dv


def _math_backward(dout, q, k, v, out, lse, scale, causal):  # noqa: ANN001, ANN202 (private)
    group = q.shape[1] // k.shape[1]
    s = _math_scores(q, k, scale, causal)
    acc = s.dtype
    p = torch.exp(s - lse.to(acc).unsqueeze(-1)).nan_to_num_(0.0)  # (B, H, Lq, Lk)
    dout_a = dout.to(acc)
    v_e = _expand_kv(v, group).to(acc)
    dv = torch.matmul(p.transpose(-1, -2), dout_a)
    dp = torch.matmul(dout_a, v_e.transpose(-1, -2))
    delta = (dout_a * out.to(acc)).sum(-1, keepdim=True)
    ds = p * (dp - delta) * scale
    dq = torch.matmul(ds, _expand_kv(k, group).to(acc))
    dk = torch.matmul(ds.transpose(-1, -2), q.to(acc))
    return (
        dq.to(q.dtype),
        _fold_kv_grad(dk, group).to(k.dtype),
        _fold_kv_grad(dv, group).to(v.dtype),
    )
