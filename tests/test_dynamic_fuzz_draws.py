"""The dynamic fuzzer's draws stay what they were (its seeds name cases in BENCHMARKS.md and in tests).

Session 21 (mut21d, loose end 3c): ``seqpar.testing.fuzz_dynamic`` drew group sizes from a copy of
:func:`seqpar.runtime.grid.dynamic_group_sizes` (``_pow2_divisors``); it now calls that. The drawn cases of 600
seeds were compared before and after (identical); this digest of 300 of them keeps them so.
Seen failing: ``dynamic_group_sizes(world)[::-1]`` in ``draw_dynamic`` (``min_size`` draws another size): the
digest changes.
Session 25 (fz25c) added the ``knobs`` key (drawn after every other draw) and the ``edge`` corner (a document at the
edge of the largest group's room), which lengthens one document in 23 of these 300 draws; the other 277 are the
earlier draws plus ``knobs`` (compared key by key against 9273f0a's ``draw_dynamic``), and no pinned dynamic case
of tests/test_fuzz.py draws the edge corner.
"""

from __future__ import annotations

import hashlib
import json
import random

from seqpar.testing.fuzz_dynamic import draw_dynamic

DIGEST = "fcf5b051281ac43204e283ccb00f549aa690c54d64f4d9d87de69bee44e38ffd"


def test_dynamic_draws_of_300_seeds_are_unchanged() -> None:
    draws = [draw_dynamic(random.Random(seed)) for seed in range(300)]
    text = json.dumps(draws, sort_keys=True, default=str)
    assert hashlib.sha256(text.encode()).hexdigest() == DIGEST
    # the sizes it draws are the planner's: min_size and the exact-multiple corner
    assert {d["min_size"] for d in draws} == {1, 2, 4}
    assert any("exact4x" in d["corners"] for d in draws)
