"""Session 32's user migrating from ring-flash-attn / flash-attn varlen and Megatron-LM context parallelism calls
``seqpar.attention`` with the names and layouts of the library they left. Each mistake below is refused with a
message naming the problem and the fix (local checks: every rank given the same call raises the same)."""

from __future__ import annotations

import re

import pytest
import torch

import seqpar
from seqpar.config import ConfigError, SeqParConfig


def _qkv(*shape: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(*shape, generator=g, dtype=torch.float64) for _ in range(3)]


@pytest.mark.parametrize(("cp_comm_type", "mode"), [("p2p", "ring"), ("all_gather", "allgather"), ("a2a", "ulysses"),
                                                     ("a2a+p2p", "hybrid")])
def test_megatrons_cp_comm_type_as_a_mode_names_seqpars_mode(cp_comm_type: str, mode: str) -> None:
    """Megatron's ``cp_comm_type`` value given as ``mode`` (to ``seqpar.attention`` and in the config block) is
    refused naming seqpar's mode for it. Seen failing: both said only "mode='p2p' is invalid: choose one of
    ['ring', 'allgather', 'ulysses', 'hybrid', 'auto']", leaving the user to guess that 'p2p' is the ring."""
    hint = f"'{cp_comm_type}' is Megatron's cp_comm_type name for '{mode}': write '{mode}'"
    with pytest.raises(ValueError, match=re.escape(f"mode={cp_comm_type!r} is invalid")) as called:
        seqpar.attention(*_qkv(1, 4, 8, 16), causal=True, mode=cp_comm_type)
    assert hint in str(called.value), called.value
    with pytest.raises(ConfigError) as loaded:
        SeqParConfig.load({"size": 2, "mode": cp_comm_type})
    assert hint in str(loaded.value), loaded.value
    assert SeqParConfig.load({"size": 2, "cp_comm_type": cp_comm_type}).mode == mode  # the documented spelling


def test_flash_varlens_packed_3d_tensors_are_told_to_add_a_batch_dim() -> None:
    """flash-attn varlen's ``(total_tokens, heads, head_dim)`` with ``cu_seqlens``: the refusal names the fix that
    works (``unsqueeze(0)`` and ``layout='bshd'``), and that fix runs. Seen failing: the message said "transpose
    (batch, seq, heads, dim) inputs with .transpose(1, 2)", which a 3-D tensor cannot take, and named no layout."""
    q, k, v = _qkv(32, 4, 16)  # (total_tokens, heads, head_dim), two documents
    cu = torch.tensor([0, 12, 32], dtype=torch.int32)
    with pytest.raises(ValueError) as refused:
        seqpar.attention(q, k, v, causal=True, cu_seqlens=cu)
    message = str(refused.value)
    assert "flash varlen's packed (total_tokens, heads, head_dim)" in message and "unsqueeze(0)" in message, message
    assert "layout='bshd'" in message and ".transpose(1, 2)" not in message, message
    out = seqpar.attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), causal=True, cu_seqlens=cu,
                           layout="bshd")[0]
    for lo, hi in ((0, 12), (12, 32)):  # each document alone
        ref = torch.nn.functional.scaled_dot_product_attention(
            *(t[lo:hi].transpose(0, 1) for t in (q, k, v)), is_causal=True).transpose(0, 1)
        torch.testing.assert_close(out[lo:hi], ref, rtol=0, atol=1e-12)


def test_a_tensor_of_the_wrong_rank_names_the_bshd_layout() -> None:
    """A 5-D tensor (a user's (batch, seq, 3, heads, dim) packed qkv): the message names both accepted layouts.
    Seen failing: it named only ``.transpose(1, 2)``, not ``layout='bshd'`` (which takes flash's layout with no
    copy)."""
    q = torch.randn(1, 8, 3, 4, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"\(batch, seq_local, heads, head_dim\) with layout='bshd'"):
        seqpar.attention(q, q, q, causal=True)
