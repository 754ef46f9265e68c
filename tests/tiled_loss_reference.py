"""The tiled loss tests' shared float64 reference (tests/test_tiled_loss_vocab_order.py, one process, and
tests/test_tiled_loss_tp_seq.py, TP sequence parallelism): inputs, the reference loss and gradients, and the
per-gradient tolerance check."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# each gradient against its own scale: fp32 to ~1e-5; bf16 inputs and head, fp32 accumulation, to bf16's rounding
TOL = {torch.float32: 1e-5, torch.bfloat16: 2.0**-6}
LOSS_RTOL = {torch.float32: 1e-5, torch.bfloat16: 1e-3}


def inputs(seed: int, vocab: int, hidden: int, batch: int, seq: int, dtype: torch.dtype) -> tuple:
    """``(hidden (batch, seq, hidden), weight (vocab, hidden), targets (batch, seq))``: float64 tensors holding
    ``dtype``'s values, about one target in five ignored (-100), the last id a target (the last vocabulary block's
    last column)."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(batch, seq, hidden, generator=g, dtype=torch.float64).to(dtype).double()
    w = (torch.randn(vocab, hidden, generator=g, dtype=torch.float64) * 2 / hidden**0.5).to(dtype).double()
    t = torch.randint(0, vocab, (batch, seq), generator=g)
    t[torch.rand(batch, seq, generator=g) < 0.2] = -100
    t[0, 0] = vocab - 1
    return h, w, t


def reference(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> tuple:
    """float64: ``(loss sum, dhidden, dweight)``."""
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = F.cross_entropy((h @ w.T).reshape(-1, w.shape[0]), t.reshape(-1), ignore_index=-100, reduction="sum")
    loss.backward()
    return loss.detach(), h.grad, w.grad


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """``got`` within ``TOL[dtype]`` of ``want``'s largest magnitude."""
    err = (got.double() - want).abs().max().item() / want.abs().max().item()
    assert err <= TOL[dtype], f"{what}: largest error {err:.3g} of its scale (tolerance {TOL[dtype]:.3g})"
