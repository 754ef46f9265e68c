"""The mixers' shared boundary check (seqpar.mixers.scan_layout.shard_boundaries), one process: zero-length
documents (repeats) are accepted and dropped, decreasing boundaries are refused by name (tests/test_zero_length_
documents.py feeds the mixers repeats only)."""

from __future__ import annotations

import pytest

from seqpar.mixers.scan_layout import shard_boundaries


def test_repeats_are_dropped_and_a_decrease_is_refused() -> None:
    """``(0, 4, 4, 16, 16)`` over 16 tokens is ``(0, 4, 16)``; ``(0, 10, 5, 16)`` is refused, naming the rule.

    Seen failing: the non-decreasing test dropped from the check (``any(b < a ...)`` removed: the decreasing
    boundaries were returned as the documents)."""
    assert shard_boundaries(16, group=None, cu_seqlens=(0, 4, 4, 16, 16), where="mixer") == (1, 0, 16, (0, 4, 16))
    with pytest.raises(ValueError, match="must not decrease"):
        shard_boundaries(16, group=None, cu_seqlens=(0, 10, 5, 16), where="mixer")
