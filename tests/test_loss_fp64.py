"""The losses that never hold whole logits (vocab-parallel, tiled) accumulate as the gathered loss does:
fp32 for half-precision logits, the logits' own dtype otherwise, so a float64 run is float64 throughout.

Seen failing: with ``.float()`` in place of :func:`seqpar.sequence.vocab_parallel.upcast` (the code before this
test) the losses came back fp32, 4e-8 relative off (the gradient 4e-7), against 1e-12 here.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from seqpar.memory.tiling import tiled_lm_loss
from seqpar.sequence.vocab_parallel import vocab_parallel_token_losses


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _targets(rows: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    t = torch.randint(0, vocab, (rows,), generator=gen)
    t[::5] = -100  # ignored rows
    return t


def test_vocab_parallel_cross_entropy_keeps_float64():
    gen = torch.Generator().manual_seed(1)
    rows, vocab = 23, 37
    logits = (torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * 4).requires_grad_()
    target = _targets(rows, vocab, gen)
    losses = vocab_parallel_token_losses(logits, target, vocab_start=0, group=None)
    weights = torch.rand(rows, generator=gen, dtype=torch.float64)
    (losses * weights).sum().backward()
    ref_logits = logits.detach().clone().requires_grad_()
    ref = F.cross_entropy(ref_logits, target, ignore_index=-100, reduction="none")
    (ref * weights).sum().backward()
    assert losses.dtype == torch.float64 and logits.grad.dtype == torch.float64
    assert _rel(losses.detach(), ref.detach()) < 1e-12
    assert _rel(logits.grad, ref_logits.grad) < 1e-12


def test_vocab_parallel_cross_entropy_upcasts_half_precision():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(9, 17, generator=gen).to(torch.bfloat16)
    losses = vocab_parallel_token_losses(logits, _targets(9, 17, gen), vocab_start=0, group=None)
    assert losses.dtype == torch.float32


@pytest.mark.parametrize("chunk_rows", [4, 64])
def test_tiled_loss_keeps_float64(chunk_rows):
    gen = torch.Generator().manual_seed(3)
    rows, hidden, vocab = 19, 8, 29
    h = torch.randn(rows, hidden, generator=gen, dtype=torch.float64).requires_grad_()
    w = torch.randn(vocab, hidden, generator=gen, dtype=torch.float64).requires_grad_()
    target = _targets(rows, vocab, gen)
    loss_sum, count = tiled_lm_loss(h, w, target, chunk_rows=chunk_rows)
    loss_sum.backward()
    rh, rw = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = F.cross_entropy(rh @ rw.t(), target, ignore_index=-100, reduction="sum")
    ref.backward()
    assert loss_sum.dtype == torch.float64 and int(count) == int((target != -100).sum())
    assert _rel(loss_sum.detach(), ref.detach()) < 1e-12
    assert _rel(h.grad, rh.grad) < 1e-12
    assert _rel(w.grad, rw.grad) < 1e-12


def test_gathered_sequence_parallel_loss_keeps_float64():
    """The gathered path (``seqpar.sequence.loss._token_losses``, whole logits on one process) on float64 logits:
    the loss and the logits' gradient are float64 and equal ``F.cross_entropy``'s to 1e-12, as the vocab-parallel
    and tiled losses above. Seen failing: ``acc = upcast(logits)`` made ``logits.float()`` (the loss came back
    float32, ~1e-8 relative off)."""
    from seqpar.sequence.loss import sequence_parallel_loss

    gen = torch.Generator().manual_seed(4)
    logits = (torch.randn(2, 11, 31, generator=gen, dtype=torch.float64) * 4).requires_grad_()
    targets = torch.stack([_targets(11, 31, gen) for _ in range(2)])
    loss = sequence_parallel_loss(logits, targets)
    loss.backward()
    ref_logits = logits.detach().clone().requires_grad_()
    ref = F.cross_entropy(ref_logits.reshape(-1, 31), targets.reshape(-1), ignore_index=-100)
    ref.backward()
    assert loss.dtype == torch.float64 and logits.grad.dtype == torch.float64
    assert _rel(loss.detach(), ref.detach()) < 1e-12
    assert _rel(logits.grad, ref_logits.grad) < 1e-12
