"""Attention of one query block against one key/value block, returning ``(out, lse)``, and its backward.

Every distributed algorithm in seqpar is built from these two calls plus :func:`merge_into`:

- ``block_forward(q, k, v)`` -> ``out`` (in q's dtype) and ``lse`` = log-sum-exp of the scaled scores
  of each query row over the block's keys (fp32; fp64 for fp64 inputs).
- ``block_backward(dout, q, k, v, out, lse)`` with the *merged* ``out`` and ``lse`` of the whole row
  (over every block) returns this block's share of dq, dk, dv. Summing the shares over blocks gives the
  exact gradient: with P = exp(S - lse_merged) the softmax restricted to the block's columns, and
  delta = rowsum(dout * out_merged), dS = P * (dP - delta) is the true gradient of those columns.

Layouts: q, k ``(batch, q_heads | kv_heads, len, head_dim)``; v ``(batch, kv_heads, len_k, v_head_dim)``
with q_heads a multiple of kv_heads (GQA/MQA: query head h reads kv head h // (q_heads // kv_heads)).
``v_head_dim`` may differ from ``head_dim`` (MLA: DeepSeek-V2/V3 have 192 and 128); ``out`` and ``dout``
then have ``v_head_dim`` columns.
``causal`` is top-left aligned: query row i sees keys 0..i (the blocks the planners hand in are either
full, or diagonal with len_q == len_k).

Backends, chosen per call:
- CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` (+ backward). Handles GQA natively.
- CUDA: the kernel torch's SDPA would choose for the same shapes, flags and device
  (:mod:`seqpar.kernels.backends`). Grouped-query attention never expands K/V on a block that can do
  without (see "GQA" below). Head dims the kernel cannot take are zero-padded and sliced back (exact).
  Unequal Q/K and V head dims: flash and cuDNN (and the CPU kernel) take one head dim for q, k and v,
  so the narrower side is zero-padded to the wider one (exact: zero q/k columns add nothing to q.k^T,
  zero v columns give zero output columns, which are sliced off; their dout is zero, so delta =
  rowsum(dout * out) is unchanged). The memory-efficient kernel takes a V head dim of its own natively
  (torch's SDPA sends such calls there), so only each side's alignment padding applies.
- anything else (fp64, ROCm, every fused kernel refused): an exact math fallback in fp32 (or fp64).
- logit soft-capping (``softcap=c``: scores ``s -> c * tanh(s / c)``, Gemma 2) on any device: the math
  kernel, which has the scores; its backward multiplies dS by ``1 - tanh(s / c) ** 2``. The fused
  kernels have no score modifier (the public entry refuses soft-capping on CUDA outside fp64).

GQA (q_heads = g * kv_heads, g > 1) on CUDA, per kernel:
- flash: native. torch's op hands K/V at kv_heads to flash-attn's ``mha_fwd``/``mha_bwd``, which read
  kv head h // g and sum dK/dV over each group themselves.
- cuDNN: native. The op takes K/V at kv_heads and returns dK/dV at kv_heads (its shape function's
  contract; torch 2.11's SDPA picks cuDNN for GQA shapes, gpu-check's choice stage on an H200).
- memory-efficient: the op needs equal head counts (its backward checks them and returns dK/dV at the
  query head count, torch 2.11-2.13). A block without a causal mask is *folded*: q
  ``(B, kv_heads * g, L, D)`` is seen as ``(B, kv_heads, g * L, D)`` (query head kv * g + j becomes rows
  j * L .. j * L + L - 1 of kv head kv), which is exact because no mask relates a row's position to a
  key's, and the lse is reshaped back. K/V go in as they are and dK/dV come back at kv_heads. The
  kernel writes its outputs (out, dq) heads-innermost, so unfolding them is one output-sized copy, and
  the backward copies dout and out into the folded order (q too, unless its rows fold as a view):
  cheaper than expanding K and V to g times their size, and summing dK/dV back. A causal block (the
  diagonal) has a row-position mask, which folding would break: there K/V are expanded to q's head count
  and dK/dV summed back over the group.

Layouts: the fused kernels read q/k/v through their strides (unit stride on the head dim required), so
Hugging Face's ``(batch, seq, heads, dim)`` buffers seen transposed and the zigzag halves (row ranges of
a shard) go in as views, with no copy. The flash and memory-efficient backwards read ``dout`` and
``out`` densely in ``(batch, len, heads, dim)`` order (they copy them into it otherwise, on every call;
the memory-efficient kernel in half precision even reads ``out`` assuming that order, whatever its
strides); cuDNN's backward gets them in q's memory order (as torch's SDPA hands them):
:func:`backward_layout` lays them out once per backward in the order the plan's kernel reads, and the
kernels here copy only what still is not (a row range of a batch > 1: its rows are not dense across
the batch). The lse a
kernel reads is dense ``(batch, heads, len)``: a row range of it is copied (fp32, ``1 / head_dim`` of the
piece's output).

The philox seed/offset tensors the backward ops take are read only with dropout, which seqpar never
uses: an empty tensor is passed (no memory).

The module uses ``narrow``/``unsqueeze``/``view``/``expand`` and never Python indexing of tensors:
indexing a fake CUDA tensor on a CPU-only build raises, and views keep the code traceable.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import Tensor

import seqpar.kernels.backends as backends
from seqpar.kernels.backends import (
    Backend,
    BlockSpec,
    DeviceCaps,
    choose_backend,
    efficient_alignment,
)

__all__ = ["block_forward", "block_backward", "backward_layout", "cuda_backend", "lse_dtype"]

# Private ops (schemas not covered by torch's BC policy) are called by keyword only: torch 2.11 and
# 2.13 share these schemas, and a renamed or reordered argument then fails loudly ("unexpected
# keyword") instead of binding to the wrong slot. tests/test_cuda_fake.py checks every keyword used
# against the installed torch's schemas.
_aten = torch.ops.aten


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulator dtype for out/lse partials: fp32, or fp64 for fp64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_block(q: Tensor, k: Tensor, v: Tensor) -> int:
    """Return the GQA group size (q_heads // kv_heads)."""
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k head dims differ ({q.shape[-1]} vs {k.shape[-1]}): q.k^T needs them equal")
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
    return x.unsqueeze(2).expand(b, h, group, n, d).reshape(b, h * group, n, d)


def _fold_kv_grad(dx: Tensor, group: int) -> Tensor:
    # (B, Hkv * group, L, D) -> (B, Hkv, L, D): the expanded copies' gradients add up
    if group == 1:
        return dx
    b, hg, n, d = dx.shape
    return dx.reshape(b, hg // group, group, n, d).sum(dim=2)


def _common_head_dim(q: Tensor, v: Tensor) -> int:
    # the one head dim a kernel that takes equal q/k/v dims sees (before its own alignment padding)
    return max(q.shape[-1], v.shape[-1])


def _pad_to(x: Tensor, head_dim: int, multiple: int) -> Tensor:
    # zero columns up to head_dim, then up to the kernel's multiple (exact, see the module docstring)
    target = head_dim + (-head_dim) % multiple
    return F.pad(x, (0, target - x.shape[-1])) if x.shape[-1] != target else x


def _unpad(x: Tensor, head_dim: int) -> Tensor:
    return x if x.shape[-1] == head_dim else x.narrow(-1, 0, head_dim)


def _kernel_ready(x: Tensor, alignment: int = 1) -> Tensor:
    # fused kernels need a unit stride on the head dim and (efficient, sm80+) storage offsets aligned
    # to the head-dim multiple; anything else (an expanded dout, an odd view) gets a dense copy
    if x.stride(-1) == 1 and x.storage_offset() % alignment == 0:
        return x
    return x.clone(memory_format=torch.contiguous_format)


def _dense(x: Tensor) -> Tensor:
    # not x.contiguous(): on a CPU-only build that raises for a non-contiguous fake CUDA tensor
    return x if x.is_contiguous() else x.clone(memory_format=torch.contiguous_format)


def _bshd_dense(x: Tensor) -> bool:
    # x (B, H, L, D) stored densely in (B, L, H, D) order: what the fused backwards read dout/out in
    return x.transpose(1, 2).is_contiguous()


def _bshd_rows(x: Tensor) -> bool:
    # rows dense across heads in (B, L, H, D) order, the batch stride aside (a row range of a batch > 1):
    # the memory-efficient backward reads ``out`` with row stride heads * dim whatever its strides say
    _, h, n, d = x.shape
    return x.stride(-1) == 1 and (h == 1 or x.stride(1) == d) and (n == 1 or x.stride(2) == h * d)


def _to_bshd(x: Tensor) -> Tensor:
    """``x`` ``(B, H, L, D)`` itself when dense in ``(B, L, H, D)`` order, else one copy stored so."""
    if _bshd_dense(x):
        return x
    return _dense(x.transpose(1, 2)).transpose(1, 2)


def _dim_order(x: Tensor) -> list[int]:
    # x's dims from outermost to innermost in memory (ties, e.g. size-1 dims: in index order)
    return sorted(range(x.dim()), key=lambda i: (-x.stride(i), i))


def _in_order_of(x: Tensor, ref: Tensor) -> Tensor:
    """``x`` copied densely into ``ref``'s memory order (dims sorted by ref's strides)."""
    order = sorted(range(ref.dim()), key=lambda i: -ref.stride(i))
    return _dense(x.permute(order)).permute([order.index(i) for i in range(ref.dim())])


def _view_or_copy(x: Tensor, *shape: int) -> Tensor:
    # x.view(shape) when the strides allow it, else a dense copy viewed so (never x.reshape: on a
    # CPU-only build it raises for a non-contiguous fake CUDA tensor)
    try:
        return x.view(*shape)
    except (RuntimeError, ValueError):  # ValueError: fake tensors (torch._refs)
        return _dense(x).view(*shape)


def _fold_rows(x: Tensor, group: int) -> Tensor:
    # (B, Hkv * g, n, D) -> (B, Hkv, g * n, D): query head kv * g + j becomes rows j * n .. j * n + n - 1
    # of kv head kv. A view when head j + 1's rows start where head j's end (a contiguous full block)
    b, h, n, d = x.shape
    return _view_or_copy(x, b, h // group, group * n, d)


def _fold_rows_bshd(x: Tensor, group: int) -> Tensor:
    # _fold_rows, stored densely in (B, g * n, Hkv, D) order (the efficient backward's dout/out): one copy
    b, h, n, d = x.shape
    buf = _dense(x.view(b, h // group, group, n, d).permute(0, 2, 3, 1, 4))  # (B, g, n, Hkv, D)
    return buf.view(b, group * n, h // group, d).transpose(1, 2)


def _unfold_rows(x: Tensor, group: int) -> Tensor:
    # inverse of _fold_rows: (B, Hkv, g * n, D) -> (B, Hkv * g, n, D). The efficient kernel writes its
    # outputs heads-innermost ((B, g * n, Hkv, D) in memory), which no view unfolds (unless Hkv == 1):
    # one copy, stored in (B, n, H, D) order (the order the backwards read out in)
    b, hk, gn, d = x.shape
    n = gn // group
    x5 = x.view(b, hk, group, n, d)
    try:
        return x5.view(b, hk * group, n, d)
    except (RuntimeError, ValueError):  # ValueError: fake tensors (torch._refs)
        out = _dense(x5.permute(0, 3, 1, 2, 4))  # (B, n, Hkv, g, D)
        return out.view(b, n, hk * group, d).transpose(1, 2)


def backward_layout(
    dout: Tensor, out: Tensor, q: Tensor | None = None, k: Tensor | None = None,
    blocks: Iterable[tuple[int, int, bool]] = (), *, v_head_dim: int | None = None, caps: DeviceCaps | None = None,
) -> tuple[Tensor, Tensor]:
    """``dout`` and ``out`` ``(batch, heads, len, v_head_dim)`` laid out once per backward the way this
    device's kernels read them, so that no kernel call copies them again.

    Args:
        q: ``(batch, q_heads, len, head_dim)``, k: ``(batch, kv_heads, len_k, head_dim)``: the backward's
            query rows and a K/V block (their shapes and q's memory order; nothing is read).
        blocks: ``(len_q, len_k, causal)`` of every kernel call the backward will make with row ranges of
            these ``dout``/``out`` (the plan's calls; empty: unknown).
        v_head_dim: V's head dim when it differs from ``head_dim``; caps: as in :func:`block_backward`.

    CUDA: the kernel decides. cuDNN's backward reads them in q's memory order (:func:`_cudnn_backward`);
    the flash and memory-efficient backwards dense in ``(batch, len, heads, dim)`` order (they transpose
    both to that order and copy them unless contiguous there: torch's ``_flash_attention_backward`` and
    ``_efficient_attention_backward``; the memory-efficient kernel in half precision reads ``out`` with
    that order's row stride). So: in q's memory order when ``q``, ``k`` and ``blocks`` are given and cuDNN
    runs every block, else dense in ``(batch, len, heads, dim)`` order (Hugging Face's layout, in which
    both coincide). Returned as they are when already so, else one copy each. With a contiguous q and a
    plan mixing cuDNN with another kernel (a shape cuDNN refuses), the cuDNN calls re-lay them per call.
    CPU: ``dout`` contiguous, ``out`` as it is (the CPU kernel reads strides).
    """
    if dout.device.type != "cuda":
        return _dense(dout), out
    if q is not None and k is not None and _all_cudnn(q, k, blocks, v_head_dim, caps):
        return _in_order_of(dout, q), _in_order_of(out, q)
    return _to_bshd(dout), _to_bshd(out)


def _all_cudnn(
    q: Tensor, k: Tensor, blocks: Iterable[tuple[int, int, bool]], v_head_dim: int | None, caps: DeviceCaps | None
) -> bool:
    # the kernel each planned call will get (cuda_backend's choice, from the call's shape alone)
    specs = [
        BlockSpec(q.dtype, q.shape[-1], q.shape[-1] if v_head_dim is None else v_head_dim, q.shape[1], k.shape[1],
                  len_q, len_k, causal, q.shape[0])
        for len_q, len_k, causal in blocks
    ]
    if not specs or q.dtype == torch.float64:
        return False
    caps = _caps(q, caps)
    return not caps.rocm and all(choose_backend(spec, caps) is Backend.CUDNN for spec in specs)


def _warn_rocm() -> None:
    warnings.warn(
        "seqpar on ROCm: the fused attention kernels return their log-sum-exp in layouts seqpar has not "
        "verified (CK flash: (batch, seq, heads); efficient: unpadded), so every block runs seqpar's exact "
        "math kernel (slow, O(len_q * len_k) memory per block). Use smaller blocks (more ranks, "
        "head_chunks) or a CUDA GPU.",
        RuntimeWarning,
        stacklevel=3,
    )


def cuda_backend(
    q: Tensor, k: Tensor, causal: bool, caps: DeviceCaps | None = None, *, v_head_dim: int | None = None
) -> Backend:
    """The kernel :func:`block_forward` / :func:`block_backward` use for a CUDA block right now.

    Args:
        q: ``(batch, q_heads, len_q, head_dim)`` on a CUDA device; k: ``(batch, kv_heads, len_k, head_dim)``.
        causal: top-left aligned causal mask.
        caps: the device's capabilities (default: read from ``q.device``; tests inject their own).
        v_head_dim: V's head dim when it differs from ``head_dim`` (default: the same).
    """
    if q.dtype == torch.float64:
        return Backend.MATH  # no fused kernel takes fp64; SDPA uses math too
    caps = _caps(q, caps)
    if caps.rocm:
        _warn_rocm()
    return choose_backend(BlockSpec.of(q, k, causal, v_head_dim=v_head_dim), caps)


def _caps(q: Tensor, caps: DeviceCaps | None) -> DeviceCaps:
    return backends.device_caps(q.device) if caps is None else caps


# ---------------------------------------------------------------------------------------- forward
def block_forward(
    q: Tensor, k: Tensor, v: Tensor, *, scale: float, causal: bool, caps: DeviceCaps | None = None,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention of q against (k, v) -> ``(out, lse)``.

    Args:
        q: ``(batch, q_heads, len_q, head_dim)``.
        k: ``(batch, kv_heads, len_k, head_dim)``; v: ``(batch, kv_heads, len_k, v_head_dim)``.
        scale: multiplier of q @ k^T (usually head_dim ** -0.5).
        causal: top-left aligned causal mask.
        caps: CUDA only: the device's capabilities (default read from the device; tests inject them).
        softcap: scores ``s -> softcap * tanh(s / softcap)`` before the softmax (math kernel).
    Returns:
        out ``(batch, q_heads, len_q, v_head_dim)`` in q.dtype and lse ``(batch, q_heads, len_q)`` in
        fp32 (fp64 for fp64 inputs).
    """
    _check_block(q, k, v)
    if softcap is not None:
        return _math_forward(q, k, v, scale, causal, softcap)
    if q.device.type == "cpu":
        # the CPU kernel takes one head dim for q, k and v: pad the narrower side (exact)
        dv, d = v.shape[-1], _common_head_dim(q, v)
        qp, kp, vp = (_pad_to(x, d, 1) for x in (q, k, v))
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
            query=qp, key=kp, value=vp, dropout_p=0.0, is_causal=causal, scale=scale
        )
        return _unpad(out, dv), lse.to(lse_dtype(q.dtype))
    if q.device.type == "cuda":
        backend = cuda_backend(q, k, causal, caps, v_head_dim=v.shape[-1])
        if backend is not Backend.MATH:
            return _cuda_forward(q, k, v, scale, causal, backend, efficient_alignment(_caps(q, caps), q.dtype))
    return _math_forward(q, k, v, scale, causal)


def _cuda_forward(
    q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, backend: Backend, align: int
) -> tuple[Tensor, Tensor]:
    """One fused kernel's forward; ``align``: the efficient kernel's head-dim multiple."""
    if backend is Backend.FLASH:
        return _flash_forward(q, k, v, scale, causal)
    if backend is Backend.CUDNN:
        return _cudnn_forward(q, k, v, scale, causal)
    group = q.shape[1] // k.shape[1]
    if group > 1 and not causal:  # GQA folded into the query length (module docstring)
        b, hq, lq, _ = q.shape
        out_f, lse_f = _efficient_forward(_fold_rows(q, group), k, v, scale, False, align)
        return _unfold_rows(out_f, group), _view_or_copy(lse_f, b, hq, lq)
    return _efficient_forward(q, _expand_kv(k, group), _expand_kv(v, group), scale, causal, align)


def _flash_forward(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool) -> tuple[Tensor, Tensor]:
    # GQA native: torch's op (aten/src/ATen/native/transformers/cuda/attention.cu,
    # _scaled_dot_product_flash_attention_cuda) checks only that K and V have the same length, then
    # transposes to (B, S, H, D) and calls flash-attn's mha_fwd, which checks num_heads % num_heads_k
    # == 0 and reads kv head h / (num_heads / num_heads_k) (cuda/flash_attn/flash_api.cpp,
    # params.h_h_k_ratio). Its head dim must be a multiple of 8 ("ensured by padding", which SDPA does
    # in attention.cpp and seqpar does here). lse: (B, H, len_q) fp32.
    # Unequal q/k and v head dims: all three padded to the wider one (exact, see the module docstring).
    d = _common_head_dim(q, v)
    qp, kp, vp = (_kernel_ready(_pad_to(x, d, 8)) for x in (q, k, v))
    res = _aten._scaled_dot_product_flash_attention(
        query=qp, key=kp, value=vp, dropout_p=0.0, is_causal=causal, return_debug_mask=False, scale=scale
    )
    return _unpad(res[0], v.shape[-1]), res[1]


def _efficient_forward(
    q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, align: int
) -> tuple[Tensor, Tensor]:
    # k, v at q's head count (expanded, or q folded). lse comes back padded to a multiple of 32 rows: sliced off.
    # V's head dim may differ from q/k's: the kernel takes it natively (out has V's). Both are
    # multiples of the alignment (backends: the kernel is refused otherwise, as torch does).
    lq = q.shape[2]
    qp, kp, vp = (_kernel_ready(x, align) for x in (q, k, v))
    out, lse, _, _ = _aten._scaled_dot_product_efficient_attention(
        query=qp, key=kp, value=vp, attn_bias=None, compute_log_sumexp=True, dropout_p=0.0, is_causal=causal,
        scale=scale,
    )
    return out, lse.narrow(-1, 0, lq)


def _cudnn_forward(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool) -> tuple[Tensor, Tensor]:
    # GQA native (k, v at kv_heads); q/k/v through their strides, as torch's SDPA hands them (Hugging
    # Face's transposed layout included); head dims multiples of 8 (the backend rules). lse: (B, H, len_q, 1).
    # Unequal q/k and v head dims: padded to the wider one, as for flash (torch 2.11's cuDNN path is not
    # known here to take a V head dim of its own; padding is exact either way).
    d = _common_head_dim(q, v)
    qc, kc, vc = (_kernel_ready(_pad_to(x, d, 1)) for x in (q, k, v))
    res = _aten._scaled_dot_product_cudnn_attention(
        query=qc, key=kc, value=vc, attn_bias=None, compute_log_sumexp=True, dropout_p=0.0, is_causal=causal,
        return_debug_mask=False, scale=scale,
    )
    return _unpad(res[0], v.shape[-1]), res[1].squeeze(-1)


def _math_scores(q: Tensor, k: Tensor, scale: float, causal: bool, softcap: float | None = None) -> Tensor:
    acc = lse_dtype(q.dtype)
    group = q.shape[1] // k.shape[1]
    s = torch.matmul(q.to(acc), _expand_kv(k, group).to(acc).transpose(-1, -2)) * scale  # (B, H, Lq, Lk)
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    if causal:
        lq, lk = s.shape[-2:]
        # keys after the query row; triu(1) rather than ~tril(): `~` on a fake CUDA tensor raises
        hidden = torch.ones(lq, lk, dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(hidden, float("-inf"))
    return s


def _math_forward(
    q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, softcap: float | None = None
) -> tuple[Tensor, Tensor]:
    group = q.shape[1] // k.shape[1]
    s = _math_scores(q, k, scale, causal, softcap)
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
    caps: DeviceCaps | None = None,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """This block's share of (dq, dk, dv), given the row's merged ``out`` and ``lse``.

    Args:
        dout, out: ``(batch, q_heads, len_q, v_head_dim)`` (out is the merged output over all blocks).
        q: ``(batch, q_heads, len_q, head_dim)``; k: ``(batch, kv_heads, len_k, head_dim)``;
            v: ``(batch, kv_heads, len_k, v_head_dim)``.
        lse: ``(batch, q_heads, len_q)`` merged log-sum-exp (fp32 / fp64).
        caps: CUDA only: the device's capabilities (default read from the device; tests inject them).
        softcap: as in :func:`block_forward` (math kernel).
    Returns:
        dq like q, dk and dv like k and v (kv_heads), each in its input's dtype.

    The kernel is chosen again here from the flags current at this call (any kernel's backward is
    exact given the merged out/lse, whichever kernel ran the forward).
    """
    _check_block(q, k, v)
    if softcap is not None:
        return _math_backward(dout, q, k, v, out, lse, scale, causal, softcap)
    if q.device.type == "cpu":
        # the CPU kernel wants lse in its own accumulation dtype (fp32 for half types); unequal head
        # dims padded as in the forward (zero dout columns: delta = rowsum(dout * out) is unchanged)
        dk_dim, dv_dim, d = q.shape[-1], v.shape[-1], _common_head_dim(q, v)
        dop, qp, kp, vp, outp = (_pad_to(x, d, 1) for x in (dout, q, k, v, out))
        dq, dk, dv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out=dop, query=qp, key=kp, value=vp, out=outp, logsumexp=lse.to(lse_dtype(q.dtype)), dropout_p=0.0,
            is_causal=causal, scale=scale,
        )
        return _unpad(dq, dk_dim), _unpad(dk, dk_dim), _unpad(dv, dv_dim)
    if q.device.type == "cuda":
        backend = cuda_backend(q, k, causal, caps, v_head_dim=v.shape[-1])
        if backend is not Backend.MATH:
            align = efficient_alignment(_caps(q, caps), q.dtype)
            return _cuda_backward(dout, q, k, v, out, lse, scale, causal, backend, align)
    return _math_backward(dout, q, k, v, out, lse, scale, causal)


def _cuda_backward(dout, q, k, v, out, lse, scale, causal, backend, align):  # noqa: ANN001, ANN202 (private)
    """One fused kernel's backward; dK/dV at kv_heads (flash and cuDNN natively, the memory-efficient
    kernel with q folded, or on a causal block with K/V expanded and dK/dV summed back)."""
    if backend is Backend.FLASH:
        return _flash_backward(dout, q, k, v, out, lse, scale, causal)
    if backend is Backend.CUDNN:
        return _cudnn_backward(dout, q, k, v, out, lse, scale, causal)
    group = q.shape[1] // k.shape[1]
    if group > 1 and not causal:  # GQA folded into the query length (module docstring)
        b, hq, lq, _ = q.shape
        lse_f = _dense(lse.float()).view(b, hq // group, group * lq)
        dq, dk, dv = _efficient_backward(
            _fold_rows_bshd(dout, group), _fold_rows(q, group), k, v, _fold_rows_bshd(out, group), lse_f, scale,
            False, align,
        )
        return _unfold_rows(dq, group), dk, dv
    k_e, v_e = _expand_kv(k, group), _expand_kv(v, group)
    dq, dk, dv = _efficient_backward(dout, q, k_e, v_e, out, lse, scale, causal, align)
    return dq, _fold_kv_grad(dk, group), _fold_kv_grad(dv, group)


def _unused_rng(device: torch.device) -> Tensor:
    # philox seed/offset: the backward ops read them only when dropout_p > 0 (torch's flash_api.cpp
    # mha_bwd and _efficient_attention_backward under `if (is_dropout)`; cuDNN builds its dropout nodes
    # only then), and seqpar never drops out: an empty tensor, which takes no memory
    return torch.empty(0, dtype=torch.int64, device=device)


def _flash_backward(dout, q, k, v, out, lse, scale, causal):  # noqa: ANN001, ANN202 (private)
    # Mirrors what torch's own autograd and context_parallel pass: dense (non-varlen) calls have
    # undefined cum_seq tensors. dK/dV come back at kv_heads: mha_bwd checks num_heads % num_heads_k,
    # computes dK/dV at the query head count (dk_expanded) and sums each group itself (at::sum_out
    # over the group axis) -- pytorch/pytorch aten/src/ATen/native/transformers/cuda/flash_attn/
    # flash_api.cpp and, identically, Dao-AILab/flash-attention csrc/flash_attn/flash_api.cpp.
    dk_dim, dv_dim, lq, lk = q.shape[-1], v.shape[-1], q.shape[2], k.shape[2]
    d = _common_head_dim(q, v)
    qp, kp, vp, dop, outp = (_kernel_ready(_pad_to(x, d, 8)) for x in (q, k, v, dout, out))
    rng = _unused_rng(q.device)
    dq, dk, dv = _aten._scaled_dot_product_flash_attention_backward(
        grad_out=dop, query=qp, key=kp, value=vp, out=outp, logsumexp=_dense(lse.float()), cum_seq_q=None,
        cum_seq_k=None, max_q=lq, max_k=lk, dropout_p=0.0, is_causal=causal, philox_seed=rng, philox_offset=rng,
        scale=scale,
    )
    return _unpad(dq, dk_dim), _unpad(dk, dk_dim), _unpad(dv, dv_dim)


def _efficient_backward(dout, q, k, v, out, lse, scale, causal, align):  # noqa: ANN001, ANN202 (private)
    # k, v at q's head count (expanded, or q folded). The kernel reads lse padded to a multiple of 32
    # rows. V's head dim may differ from q/k's (taken natively, as in the forward). dout: copied by the
    # kernel unless dense in (B, L, H, D) order, so made so here (no copy when it is: backward_layout).
    # out: in half precision the kernel computes rowsum(dout * out) itself reading out with row stride
    # heads * v_head_dim (cutlass kernel_backward.h o_strideM(); torch passes only out's batch and head
    # strides), so out must have that layout or dQ/dK come out wrong (H200, torch 2.11, bf16, d = 128: dQ
    # off by 1.49 and dK by 1.21 with a (B,H,S,D)-contiguous out, 0.007 with a (B,S,H,D) one; fp32 exact
    # either way, its rowsum is computed outside the kernel): copied when it has not.
    lq = q.shape[2]
    dout = dout if _bshd_dense(dout) else _to_bshd(dout)
    out = out if _bshd_rows(out) else _to_bshd(out)
    qp, kp, vp, dop, outp = (_kernel_ready(x, align) for x in (q, k, v, dout, out))
    lse_p = _dense(F.pad(lse.float(), (0, (-lq) % 32)))
    rng = _unused_rng(q.device)
    dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
        grad_out_=dop, query=qp, key=kp, value=vp, attn_bias=None, out=outp, logsumexp=lse_p, philox_seed=rng,
        philox_offset=rng, dropout_p=0.0, grad_input_mask=[True, True, True, False], is_causal=causal, scale=scale,
    )
    return dq, dk, dv


def _cudnn_backward(dout, q, k, v, out, lse, scale, causal):  # noqa: ANN001, ANN202 (private)
    # Keywords (as every private op here): philox_seed/offset come BEFORE attn_bias, unlike the flash
    # backward. GQA native, q/k/v through their strides (as in the forward). dout in out's strides
    # (torch's cuDNN backward otherwise permutes a copy of it into them, with a warning); lse back to
    # cuDNN's (B, H, len_q, 1).
    rng = _unused_rng(q.device)
    dk_dim, dv_dim, d = q.shape[-1], v.shape[-1], _common_head_dim(q, v)
    qc, kc, vc, doc, outc = (_kernel_ready(_pad_to(x, d, 1)) for x in (q, k, v, dout, out))
    # out (and dout with it) in q's memory order, as torch's own SDPA always hands them (its out is the
    # forward's, laid out as q): on an H200 (cuDNN 9.19) bf16 gradients of a Hugging Face-layout q were
    # outside SDPA's rounding with out (B, H, S, D)-contiguous (tests/test_cuda.py, the strided GQA blocks),
    # while every case with out in q's order was exact
    if _dim_order(outc) != _dim_order(qc):
        outc = _in_order_of(outc, qc)
    if doc.stride() != outc.stride():
        doc = _in_order_of(doc, outc)
    dq, dk, dv = _aten._scaled_dot_product_cudnn_attention_backward(
        grad_out=doc, query=qc, key=kc, value=vc, out=outc,
        logsumexp=_dense(lse.float().unsqueeze(-1)),
        philox_seed=rng, philox_offset=rng, attn_bias=None, cum_seq_q=None, cum_seq_k=None,
        max_q=q.shape[2], max_k=k.shape[2], dropout_p=0.0, is_causal=causal, scale=scale,
    )
    return _unpad(dq, dk_dim), _unpad(dk, dk_dim), _unpad(dv, dv_dim)


def _math_backward(dout, q, k, v, out, lse, scale, causal, softcap=None):  # noqa: ANN001, ANN202 (private)
    group = q.shape[1] // k.shape[1]
    s = _math_scores(q, k, scale, causal, softcap)
    acc = s.dtype
    p = torch.exp(s - lse.to(acc).unsqueeze(-1)).nan_to_num_(0.0)  # (B, H, Lq, Lk)
    dout_a = dout.to(acc)
    v_e = _expand_kv(v, group).to(acc)
    dv = torch.matmul(p.transpose(-1, -2), dout_a)
    dp = torch.matmul(dout_a, v_e.transpose(-1, -2))
    delta = (dout_a * out.to(acc)).sum(-1, keepdim=True)
    ds = p * (dp - delta) * scale
    if softcap is not None:
        # d/dx [c tanh(x / c)] = 1 - tanh(x / c)^2 = 1 - (s / c)^2; the clamp turns a masked score's
        # -inf into a factor 0 (its p is 0 too) instead of 0 * inf = NaN
        ds = ds * (1 - (s / softcap).clamp(-1, 1).square())
    dq = torch.matmul(ds, _expand_kv(k, group).to(acc))
    dk = torch.matmul(ds.transpose(-1, -2), q.to(acc))
    return (
        dq.to(q.dtype),
        _fold_kv_grad(dk, group).to(k.dtype),
        _fold_kv_grad(dv, group).to(v.dtype),
    )
