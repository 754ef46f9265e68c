"""Audit 36 (session 37), the attention and compile kinds' shared draws (``draw_world_mode``, ``draw_call_options``,
46343ad) against what their docstrings promise, over many seeds (the draws are deterministic per seed; each band is
more than 4 binomial standard deviations wide):

- hybrid's Ulysses size is a divisor strictly between 1 and the world four times in five where there is one: at
  P = 4, u = 2 with probability 0.8 + 0.2 / 3 = 0.867 (else one of 1, 2, 4); at P = 2 (no such divisor), 1 or 2
  alike;
- ``chunk_size`` is drawn from 1 to ``max_chunk``, every value reached;
- the compile kind draws ``check_inputs`` mostly off (its module: "mostly off: on, the cross-rank check breaks the
  graph"), 15% of its attention cases.

Seen failing: ``1 <= u < world`` for the inner divisors (audit 36's FZ3) -> u = 2 at P = 4 in 0.48 of the hybrid draws;
``randint(1, max_chunk - 1)`` (FZ6) -> 3 never drawn; the compile kind given the attention kind's 0.7 (FZ4) -> 0.70."""

from __future__ import annotations

import random
from collections import Counter

from seqpar.testing import fuzz
from seqpar.testing.fuzz_attention import OptionRates, draw_call_options, draw_world_mode


def test_hybrids_ulysses_size_is_an_inner_divisor_four_times_in_five() -> None:
    by_world: dict[int, Counter] = {2: Counter(), 4: Counter()}
    rng = random.Random(36)
    for _ in range(40_000):
        world, mode, u = draw_world_mode(rng)
        if mode == "hybrid" and world in by_world:
            by_world[world][u] += 1
        elif mode != "hybrid":
            assert u == 1, (world, mode, u)
    four, two = by_world[4], by_world[2]
    n4, n2 = sum(four.values()), sum(two.values())
    assert n4 > 1000 and n2 > 1000, (four, two)
    assert set(four) == {1, 2, 4} and abs(four[2] / n4 - (0.8 + 0.2 / 3)) < 0.045, four
    assert set(two) == {1, 2} and abs(two[1] / n2 - 0.5) < 0.06, two


def test_chunk_size_reaches_every_value_up_to_its_maximum() -> None:
    rates = OptionRates(chunk_size=1.0, alibi=0.0, softcap=0.0, check_inputs=0.0, float64=0.0)
    rng = random.Random(7)
    seen = Counter(draw_call_options(rng, 2, 3, rates)["chunk_size"] for _ in range(3000))
    assert set(seen) == {1, 2, 3} and min(seen.values()) > 800, seen


def test_the_compile_kind_draws_check_inputs_mostly_off() -> None:
    drawn = [d["check_inputs"] for d in (fuzz.draw_case(s, ("compile",)) for s in range(600))
             if d.get("sub") == "attention"]
    assert len(drawn) > 200, len(drawn)
    assert 0.05 <= sum(drawn) / len(drawn) <= 0.3, (sum(drawn), len(drawn))
