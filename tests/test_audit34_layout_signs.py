"""The bshd-sign check names ``layout='bshd'`` only where the bshd reading fits (audit 34).

A call without ``layout=`` whose q and k agree on dim 1 and not on dim 2 reads as GQA in ``bshd`` only when the
query heads are a multiple of the K/V heads and the head dims agree; otherwise the bshd reading fails too, and
telling the user to pass ``layout='bshd'`` sends them to a second refusal. Such calls keep the shape-mismatch
refusal, which names no layout fix; the fitting call still names it. One process: seq_local (dim 2 as bhsd)
larger than the heads (dim 1), so the older ambiguity check passes them.

Seen failing (mut34): R2 (the GQA sign without ``q.shape[2] % k.shape[2] == 0``) -> "q (1, 4, 5, 6) named
layout='bshd'"; R7 (the sign without ``q.shape[3] == k.shape[3]``) -> "q (1, 4, 6, 6) named layout='bshd'" for
k's head dim 4.
"""

from __future__ import annotations

import pytest
import torch

import seqpar


def _refusal(q_shape: tuple[int, ...], k_shape: tuple[int, ...]) -> str:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(*q_shape, generator=g, dtype=torch.float64)
    k = torch.randn(*k_shape, generator=g, dtype=torch.float64)
    with pytest.raises(ValueError) as e:
        seqpar.attention(q, k, k.clone(), causal=True)
    return str(e.value)


@pytest.mark.parametrize("q_shape, k_shape", [((1, 4, 5, 6), (1, 4, 2, 6)),  # 5 query heads over 2: no GQA
                                              ((1, 4, 6, 6), (1, 4, 2, 4)),  # head dims 6 and 4
                                              ((1, 4, 6, 6), (2, 4, 2, 6))],  # batches 1 and 2
                         ids=["heads_not_a_multiple", "head_dims_differ", "batches_differ"])
def test_a_call_unfit_in_both_layouts_is_not_told_to_pass_bshd(q_shape, k_shape) -> None:  # noqa: ANN001
    message = _refusal(q_shape, k_shape)
    assert "layout='bshd'" not in message, f"q {q_shape} named layout='bshd' for k {k_shape}: {message}"
    assert "must agree" in message, message


def test_the_fitting_gqa_call_names_bshd() -> None:
    message = _refusal((1, 4, 6, 6), (1, 4, 2, 6))
    assert "pass layout='bshd'" in message and "(GQA)" in message, message
