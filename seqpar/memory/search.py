"""The longest length a memory model fits into a budget: :func:`largest_fitting`, for
:func:`seqpar.memory.attention.max_seq_len` and :func:`seqpar.memory.training.longest_sequence`.

Their estimates grow about linearly in the length, so after doubling to a bracket the search guesses the crossing
from the two ends' estimates (a secant), and bisects once whenever two guesses in a row moved the same end. A ring estimate
under a window replays one kernel call per piece, about 0.1 s at 6M tokens: the bisection made about 20 calls near
the answer's length (7 to 9 s for ``max_seq_len`` with a window at 6M), the secant 2 to 4.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["largest_fitting"]


def largest_fitting(cost: Callable[[int], float], budget: float, *, limit: int | None = None) -> int:
    """The largest ``n >= 1`` with ``cost(n) <= budget``, for a ``cost`` that does not decrease with ``n``; 0 when
    ``cost(1)`` is over. ``limit``: the search stops there (returns ``limit`` when that still fits). The same answer
    as doubling then bisecting, in fewer calls of ``cost`` where it is near linear."""
    c = cost(1)
    if c > budget:
        return 0
    lo, c_lo = 1, c
    while True:  # doubling: lo fits; the first n that does not is hi
        n = 2 * lo if limit is None else min(2 * lo, limit)
        if n == lo:
            return lo
        c = cost(n)
        if c > budget:
            hi, c_hi = n, c
            break
        lo, c_lo = n, c
    moved = None  # the end the last guess moved: two guesses moving the same end make the next a bisection
    halve = False
    while hi - lo > 1:
        if halve:
            guess = (lo + hi) // 2
        else:  # the secant's crossing, inside the bracket
            guess = lo + int((budget - c_lo) * (hi - lo) / (c_hi - c_lo))
            guess = min(max(guess, lo + 1), hi - 1)
        c = cost(guess)
        end = c <= budget
        if end:
            lo, c_lo = guess, c
        else:
            hi, c_hi = guess, c
        halve = not halve and end == moved
        moved = end
    return lo
