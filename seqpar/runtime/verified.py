"""The verified-batch scope: a model forward whose inputs every rank of the SP group has agreed on.

The cross-rank input check (:mod:`seqpar.comm.agree`) reads its verdict on the host, a
device-to-host sync. Made once per attention call, that is one sync per layer per step, which
stalls a GPU's run-ahead. A swapped model instead checks once per batch, in a forward pre-hook that
every rank reaches together (:mod:`seqpar.swap.batch`): it compares a digest of the model's inputs
and the attention options, and then runs its forward inside this scope, where the swapped layers
(and :func:`seqpar.sequence.sharding.gather_sequence`) skip their per-call check. Their inputs follow from
the model's inputs, which the ranks agreed on.

Why there is no per-rank cache of verdicts: a rank that had already seen a signature would skip the
check while a peer with a new one entered it, and their collectives would pair up wrongly, the very
hang the check prevents. The scope is entered only after a collective check of *this* batch.

Activation checkpointing re-runs layers during backward, outside the forward. Those recomputed
calls replay the inputs of the verified forward, so inside autograd's backward the last verified
forward's verdict holds. Every rank runs the same program, so every rank takes the same decision.
"""

from __future__ import annotations

import torch

from seqpar.runtime.thread_state import ThreadState

__all__ = ["batch_verified", "enter_verified", "exit_verified", "mark_unverified"]

_local = ThreadState(depth=int)
# Process-wide, not per thread: autograd runs a CUDA backward (and its recompute) on its own thread.
_last_forward_verified = False


def _depth() -> int:
    return _local.depth


def _in_backward() -> bool:
    # -1 outside autograd's engine; a graph task id while a backward runs (recompute included).
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return task_id is not None and task_id() != -1


def batch_verified() -> bool:
    """Whether the caller runs inside a verified forward (or a backward recompute of one), so a
    per-call cross-rank check would only repeat what the batch check established."""
    return _depth() > 0 or (_last_forward_verified and _in_backward())


def enter_verified() -> None:
    """Called once the ranks agreed on this forward's inputs (collectively, by every rank)."""
    global _last_forward_verified
    _local.depth = _depth() + 1
    _last_forward_verified = True


def exit_verified() -> None:
    """The verified forward ended (normally or by an exception)."""
    _local.depth = max(_depth() - 1, 0)


def mark_unverified() -> None:
    """A swapped model's forward started without a verdict yet: a backward must not borrow the
    previous batch's."""
    global _last_forward_verified
    _last_forward_verified = False
