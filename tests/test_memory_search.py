"""The length search behind max_seq_len and longest_sequence (seqpar.memory.search.largest_fitting): the same answer as
doubling then bisecting, in fewer estimates."""

from __future__ import annotations

import random

from seqpar.memory.search import largest_fitting


def _brute(cost, budget: float, limit: int) -> int:  # noqa: ANN001
    best = 0
    for n in range(1, limit + 1):
        if cost(n) <= budget:
            best = n
    return best


def test_largest_fitting_is_the_largest_length_that_fits() -> None:
    """Affine, convex, concave, stepped and flat-then-steep costs (every one non-decreasing) at random budgets: the
    answer is the brute-force one, including 0 (nothing fits) and a ``limit`` that still fits; an affine cost takes at
    most 3 estimates past the doubling.

    Seen failing: the secant's guess not clamped inside the bracket (``guess = min(max(guess, lo + 1), hi - 1)``
    dropped: guesses at ``lo`` again, 25 estimates past the doubling on the affine cost); the bisection fallback off
    (``halve`` never set: 59 estimates past the doubling on the flat-then-steep cost)."""
    rng = random.Random(27)
    costs = {
        "affine": lambda n: 1000 + 37 * n,
        "convex": lambda n: 5 + n * n / 7,
        "concave": lambda n: 100 * n ** 0.5,
        "stepped": lambda n: 64 * ((n + 9) // 10),
        "flat_steep": lambda n: 10 if n < 700 else 10 + (n - 699) ** 3,
    }
    for name, cost in costs.items():
        for _ in range(40):
            budget = rng.uniform(0, cost(900))
            calls = []

            def counted(n: int, cost=cost, calls=calls) -> float:  # noqa: ANN001
                calls.append(n)
                assert len(calls) < 80, calls
                return cost(n)

            got = largest_fitting(counted, budget, limit=1000)
            assert got == _brute(cost, budget, 1000), (name, budget, got)
            doubling = next((i for i, n in enumerate(calls) if cost(n) > budget), len(calls))
            assert len(calls) - doubling <= (3 if name == "affine" else 24), (name, budget, len(calls) - doubling)
    assert largest_fitting(lambda n: n, 10 ** 9, limit=64) == 64
    assert largest_fitting(lambda n: n + 5, 3) == 0
