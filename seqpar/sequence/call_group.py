"""The SP group of one call (length-aware dynamic CP, issue 32 §2).

Under dynamic CP each micro-batch runs over a group of its own size (:mod:`seqpar.sequence.dynamic`), so
the group is state of one forward: it travels with the call as the keyword argument :data:`GROUP_KEY` of
the swapped model (``model(**inputs, seqpar_group=group)``;
:func:`seqpar.sequence.batch.rank_micro_batches` puts it in every micro-batch's inputs).
transformers threads a model call's extra keyword arguments down to every attention call and to the loss
function, and its activation checkpointing saves them with each layer's call, so a recompute in the
backward replays its own micro-batch's group. The swapped layers take the group from there, never from
the process-group manager or a module attribute (:func:`call_group`); without it in the call they use the
group the swap was given, as before.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["GROUP_KEY", "call_group", "dynamic_graph_bound", "guard_group", "raise_recompile_limit"]

GROUP_KEY = "seqpar_group"
"""The keyword argument of a swapped model's call (and of the attention and loss calls transformers makes
from it) that carries the call's SP group."""


def call_group(kwargs: Mapping[str, Any], default: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The call's SP group: ``kwargs[GROUP_KEY]`` when given, else ``default`` (the swap's group)."""
    group = kwargs.get(GROUP_KEY)
    return default if group is None else guard_group(group)


def guard_group(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """``group``, made a guarded constant of the graph while torch.compile traces a call that carries it.

    Dynamo folds ``dist.get_world_size(group)`` and ``dist.get_rank(group)`` to constants without guarding
    which group it was given (torch 2.13), so a graph traced for a micro-batch's 1-rank group would be
    reused for the next micro-batch's 4-rank group (silently, or failing in the op). Branching on the
    group's name makes dynamo guard on it: each group gets a graph of its own (a rank of a pool of P is
    given at most one group per power-of-two size, so at most ``log2(P) + 1``). Eagerly: nothing."""
    if torch.compiler.is_compiling() and not group.group_name:
        raise ValueError("seqpar: the call's seqpar_group has no name; pass a group made by "
                         "seqpar.init_process_groups")
    return group


def dynamic_graph_bound(pool_size: int) -> int:
    """The graphs one compiled block (or model) may need on one rank under dynamic CP over a pool of
    ``pool_size`` ranks: each micro-batch's group is a guarded constant of the graph (:func:`guard_group`),
    and a rank is given at most one group per power-of-two size (``log2(pool) + 1`` groups); per group one
    graph of the first length seen and one recompile that marks the length dynamic (dynamo's automatic
    dynamic shapes), plus one for an empty micro-batch (dynamo specialises a 0-length dimension)."""
    return 2 * max(pool_size, 1).bit_length() + 1


def raise_recompile_limit(pool_size: int) -> int:
    """Raise ``torch._dynamo.config.recompile_limit`` to :func:`dynamic_graph_bound` (never lower it);
    returns the limit now in force. Past the limit (8 by default, torch 2.13) dynamo runs a code object
    eagerly from then on with only a warning, so a large pool's groups would silently lose compile."""
    import torch._dynamo

    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, dynamic_graph_bound(pool_size))
    return config.recompile_limit
