"""``swap_attention``'s size check (seqpar.swap.walk) refuses a ``size`` smaller than the SP group's as well as a
larger one (audit 30). One process: the group's size is what ``torch.distributed.get_world_size`` says of the
``group=`` passed, stubbed here to a group of 4, so no process group is needed (the 2-rank test of a larger size
is tests/test_usr29_user_errors.py's)."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch import nn

from seqpar.swap import SwapError, swap_attention


@pytest.mark.parametrize("size", [2, 8])
def test_a_size_other_than_the_groups_is_refused_both_ways(monkeypatch: pytest.MonkeyPatch, size: int) -> None:
    """``{"size": 2}`` and ``{"size": 8}`` against a group of 4 ranks: a SwapError naming both sizes, before the
    model is looked at; ``{"size": 4}`` passes the check (and then finds no attention in a bare Linear).

    Seen failing (audit 30's W4): the check as ``cfg.size > actual``: size 2 on a group of 4 was not refused."""
    group = object()  # stands for a 4-rank process group
    monkeypatch.setattr(dist, "get_world_size", lambda g=None: 4 if g is group else 1)
    with pytest.raises(SwapError, match=rf"sequence_parallel\.size = {size} contradicts the SP group .* of 4 rank"):
        swap_attention(nn.Linear(2, 2), {"size": size}, group=group)
    with pytest.raises(SwapError) as info:
        swap_attention(nn.Linear(2, 2), {"size": 4}, group=group)
    assert "contradicts" not in str(info.value)
