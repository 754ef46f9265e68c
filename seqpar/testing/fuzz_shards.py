"""Putting the ranks' shards of an attention call back together, for the fuzzer's judges (the ``attention`` and
``dilated`` kinds' in :mod:`seqpar.testing.fuzz_attention_run`, the ``compile`` kind's in
:mod:`seqpar.testing.fuzz_compile`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["lay_shards"]


def lay_shards(like: torch.Tensor, per_rank: list[dict[str, Any]], ranks: range, call: int, tensor: int,
               positions_of: Callable[[int], torch.Tensor]) -> tuple[torch.Tensor, int | None]:
    """The full ``[B, H, S, D]`` float64 tensor (zeros like the reference's ``like``) with each rank of ``ranks`` (one
    SP group, in its order) laying its shard ``per_rank[rank]["calls"][call][tensor]`` (``[B, H, S_local, D]``) at
    its global sequence positions ``positions_of(i)`` (``i``: the rank's index in the group); and the first rank
    whose shard is None (no gradient reached its leaf: the caller's WRONG), else None."""
    full = torch.zeros_like(like)
    for i, rank in enumerate(ranks):
        got = per_rank[rank]["calls"][call][tensor]
        if got is None:
            return full, rank
        full[:, :, positions_of(i)] = got.double()
    return full, None
