"""A refusal raised on every rank of a group together: :func:`raise_together`, shared by the batch check
(:mod:`seqpar.swap.batch`) and the first-forward probe (:mod:`seqpar.swap.probe_batch`), once the ranks have
agreed (one all-reduced flag per rank, :func:`seqpar.comm.agree.flagged_ranks`) that some refused."""

from __future__ import annotations

from typing import Any, NoReturn

import torch.distributed as dist

from seqpar.swap.options import SwapError

__all__ = ["raise_together"]


def raise_together(group: dist.ProcessGroup, refused: list[int], error: BaseException | None, head: str,
                    where: str) -> NoReturn:
    """Every rank of ``group`` raises, once ``refused`` (the same list on every rank) is not empty: a rank that
    refused its own ``error``, the others one error (``SwapError`` when the first refusing rank's was one, else
    ``ValueError``) opening with ``head`` and quoting that rank's message. One object all-gather, on this error
    path only."""
    said: list[Any] = [None] * dist.get_world_size(group)
    mine = None if error is None else (isinstance(error, SwapError), str(error))
    dist.all_gather_object(said, mine, group=group)
    if error is not None:
        raise error
    swap_error, text = said[refused[0]]
    raise (SwapError if swap_error else ValueError)(
        f"{head}; every rank stops here instead of waiting for them in {where}. Rank {refused[0]} said: {text}"
    )
