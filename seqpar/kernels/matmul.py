"""``acc += a @ b`` into an fp32 accumulator by the low-precision matmul, where the device has one.

The tiled LM loss (:mod:`seqpar.memory.tiling`) sums products of bf16 / fp16 matrices (the logits' gradient
and the hidden states or the head's rows) into fp32 accumulators. The product of two bf16 (or fp16) numbers is
exact in fp32, so a low-precision matmul that accumulates and writes in fp32 (``torch.addmm(..., out_dtype=
torch.float32)``: tensor cores on CUDA) computes the same sum as the fp32 matmul of the upcast inputs, up to the
order of the additions, without the two upcast copies and at the low-precision rate (on an H100 the fp32 matmul
without TF32 runs at a fifteenth of it). torch has that kernel on CUDA only; the callers upcast elsewhere.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

__all__ = ["fp32_out_matmul_supported", "addmm_fp32_out"]


@functools.cache
def fp32_out_matmul_supported(device: str, dtype: torch.dtype) -> bool:
    """Whether ``torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)`` runs for ``dtype`` inputs on
    ``device`` (``"cuda:0"``, ...). Probed once per device and dtype with a 1 x 1 call, so a build or GPU without
    the kernel takes the upcast path instead of failing; never on CPU, where torch has no such kernel."""
    if not device.startswith("cuda"):
        return False
    try:
        acc = torch.zeros((1, 1), dtype=torch.float32, device=device)
        one = torch.ones((1, 1), dtype=dtype, device=device)
        torch.addmm(acc, one, one, out_dtype=torch.float32, out=acc)  # no read back: no host sync
    except (RuntimeError, NotImplementedError, TypeError):  # no kernel; torch < 2.8 has no out_dtype
        return False
    return True


def addmm_fp32_out(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """``acc += a @ b`` by one low-precision matmul writing fp32 into ``acc``: ``a (m, k)``, ``b (k, n)`` bf16 or
    fp16, ``acc (m, n)`` fp32 (a view is fine). Only where :func:`fp32_out_matmul_supported`."""
    torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
