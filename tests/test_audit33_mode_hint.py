"""Audit 33: usr32's refusals of a migrating user's mode and tensor rank. ``seqpar.config.foreign_mode_hint`` (usr32: Megatron's ``cp_comm_type`` names given as ``mode``) on a mode
that is no string. Its ``isinstance(mode, str)`` guard keeps an unhashable mode (a list, as a JSON ``"mode":
["ring"]`` or a user's ``mode=["ring"]`` reads) out of the dict lookup; without it the refusal itself crashed with
TypeError (unhashable type: 'list') instead of naming the valid modes. And ``check_local``'s flash-varlen hint is for a 3-D tensor only."""

from __future__ import annotations

import pytest
import torch

import seqpar
from seqpar.config import ConfigError, SeqParConfig, foreign_mode_hint


def test_a_mode_that_is_no_string_is_refused_by_name() -> None:
    """``mode=["ring"]`` to ``seqpar.attention`` and in the config block: a ValueError naming the valid modes (no
    Megatron hint), never a TypeError from the hint's lookup.

    Seen failing (audit 33): with the guard reduced to ``mode in COMM_TYPES`` (H1): TypeError: unhashable type:
    'list', at seqpar.attention's check."""
    assert foreign_mode_hint(["ring"]) == "" and foreign_mode_hint(None) == ""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 16, generator=g, dtype=torch.float64) for _ in range(3))
    with pytest.raises(ValueError, match=r"mode=\['ring'\] is invalid: choose one of \['ring', 'allgather'"):
        seqpar.attention(q, k, v, causal=True, mode=["ring"])
    with pytest.raises(ConfigError, match=r"sequence_parallel.mode = \['ring'\] is invalid"):
        SeqParConfig.load({"size": 2, "mode": ["ring"]})


def test_only_a_3d_tensor_is_called_flash_varlens_packed_layout() -> None:
    """A 5-D q (a user's packed (batch, seq, 3, heads, dim) qkv) is told the two accepted layouts, not that it is
    flash varlen's 3-D ``(total_tokens, heads, head_dim)`` with ``unsqueeze(0)`` as the fix (which would make it 6-D).

    Seen failing (audit 33): with the varlen hint on every rank but 4 (``t.dim() == 3`` -> ``!= 4``, H4): the 5-D
    refusal named flash varlen and unsqueeze(0)."""
    q = torch.randn(1, 8, 3, 4, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"with layout='bshd'") as refused:
        seqpar.attention(q, q, q, causal=True)
    assert "varlen" not in str(refused.value) and "unsqueeze" not in str(refused.value), refused.value
