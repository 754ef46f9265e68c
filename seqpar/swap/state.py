"""The SDPA dispatcher's per-thread state: the stack of running swapped modules, and
:class:`suspended`; and whether the position-mixing probe is running (:class:`probing`).

Kept apart from :mod:`seqpar.swap.sdpa` (which pushes and reads frames) and
:mod:`seqpar.swap.options` (which suspends dispatch around seqpar's own kernels) so that neither
imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from torch import Tensor

from seqpar.runtime.thread_state import ThreadState

__all__ = ["Attends", "Frame", "stack", "suspended", "probing", "is_probing"]


class Attends(Protocol):
    """What a frame routes SDPA calls to (a :class:`seqpar.swap.SwapOptions`)."""

    def attention(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float | None,
                  **masked: Any) -> Tensor: ...


@dataclass
class Frame:
    """One running swapped module on this thread's stack; ``None`` frames suspend dispatch."""

    name: str
    options: Attends
    calls: int = 0


# this thread's dispatcher stack (list[Frame | None]) and probe depth, set on its first use (ThreadState: torch.compile
# guards on them, and a missing one on a new thread would recompile)
_local = ThreadState(stack=list, probing=int)


def stack() -> list[Frame | None]:
    """This thread's stack of running swapped modules (innermost last)."""
    return _local.stack


class suspended:
    """Context in which F.scaled_dot_product_attention is the plain kernel again."""

    def __enter__(self) -> None:
        stack().append(None)

    def __exit__(self, *exc: object) -> None:
        stack().pop()


class probing:
    """Context in which every swapped attention is *self-only* (each query sees only its own key, so
    the output is its own value, with no communication), the batch check stands aside and losses stay
    local: the whole model must then be position-wise, which :mod:`seqpar.swap.probe` checks."""

    def __enter__(self) -> None:
        _local.probing += 1

    def __exit__(self, *exc: object) -> None:
        _local.probing -= 1


def is_probing() -> bool:
    """Whether this thread runs the position-mixing probe (see :class:`probing`)."""
    return _local.probing > 0
