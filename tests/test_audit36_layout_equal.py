"""Audit 36 (session 37), the heads == seq_local refusal (``seqpar.attn.resolve._check_equal_sizes``) refuses only
the call it is about, a multi-head q and K/V of q's two sizes, on one process without ``layout=``:

- a grouped-query ``bshd`` call with heads == seq_local (q ``(1, 4, 4, d)``, K/V ``(1, 4, 2, d)``) fits only the
  ``bshd`` reading: it is refused naming ``layout='bshd'``, not called ambiguous, and with ``layout='bshd'`` it equals
  a float64 one-process reference;
- a V that fits neither reading (its tokens as bhsd, its heads as bshd, apart from K's) is refused for that V, not
  told "K/V ... fit both readings".

Seen failing: K/V compared on dim 1 only (audit 36's R3) -> the GQA call told it is ambiguous; K alone compared
(R2) -> the wrong V told it is ambiguous."""

from __future__ import annotations

import pytest
import torch

import seqpar


def _reference_bshd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One process, float64, causal grouped-query attention, bshd in and out."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q.shape[2]
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    seen = torch.arange(s)[None, :] <= torch.arange(s)[:, None]
    return (torch.softmax(scores.masked_fill(~seen, float("-inf")), -1) @ v).transpose(1, 2)


def test_a_gqa_bshd_call_at_heads_equal_to_tokens_is_named_bshd_not_ambiguous() -> None:
    g = torch.Generator().manual_seed(6)
    q = torch.randn(1, 4, 4, 6, generator=g, dtype=torch.float64)  # bshd: 4 tokens, 4 query heads
    k, v = (torch.randn(1, 4, 2, 6, generator=g, dtype=torch.float64) for _ in range(2))  # 2 K/V heads
    with pytest.raises(ValueError) as err:
        seqpar.attention(q, k, v, causal=True)
    message = str(err.value)
    assert "layout='bshd'" in message and "ambiguous" not in message, message
    out = seqpar.attention(q, k, v, causal=True, layout="bshd")
    torch.testing.assert_close(out, _reference_bshd(q, k, v), rtol=0, atol=1e-12)


def test_a_v_that_fits_neither_reading_is_not_called_ambiguous() -> None:
    g = torch.Generator().manual_seed(5)
    q, k = (torch.randn(1, 4, 4, 6, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, 4, 5, 6, generator=g, dtype=torch.float64)  # 5 tokens as bhsd, 5 heads as bshd: neither fits
    with pytest.raises(ValueError) as err:
        seqpar.attention(q, k, v, causal=True)
    assert "ambiguous" not in str(err.value), str(err.value)


def test_a_k_of_another_rank_is_not_called_ambiguous() -> None:
    """K 3-D (batch, 4, 4): neither reading; refused for its rank. Seen failing: only q's rank checked (R6)."""
    g = torch.Generator().manual_seed(7)
    q, v = (torch.randn(1, 4, 4, 6, generator=g, dtype=torch.float64) for _ in range(2))
    k = torch.randn(1, 4, 4, generator=g, dtype=torch.float64)
    with pytest.raises(ValueError) as err:
        seqpar.attention(q, k, v, causal=True)
    assert "ambiguous" not in str(err.value), str(err.value)
