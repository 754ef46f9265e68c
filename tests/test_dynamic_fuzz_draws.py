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
Session 26 (fz26): a direct planner call no longer pairs ``pad_multiple`` 8 with a budget under 8 (the planner refuses
every document of such a step: a wasted draw); such a pair draws ``pad_multiple`` 2 instead, with the same generator
calls. Compared key by key against 17c9970's ``draw_dynamic``: 10 of these 300 draws changed (145 of seeds 0..2999,
8 of tests/test_fuzz.py's ``case_seeds(20, 300)``), each in ``planner["pad_multiple"]`` alone (8 -> 2, budget under
8), every other key equal; of the pinned dynamic cases only 1056038257 draws it, pinned back to its pad 8 there.
"""

from __future__ import annotations

import hashlib
import json
import random

from seqpar.testing.fuzz_dynamic import draw_dynamic

DIGEST = "1e65bdae1bb1513ff3e814fe7d88d28dd011c72807ca6f2af542e7ab69c11868"


def test_dynamic_draws_of_300_seeds_are_unchanged() -> None:
    draws = [draw_dynamic(random.Random(seed)) for seed in range(300)]
    text = json.dumps(draws, sort_keys=True, default=str)
    assert hashlib.sha256(text.encode()).hexdigest() == DIGEST
    # the sizes it draws are the planner's: min_size and the exact-multiple corner
    assert {d["min_size"] for d in draws} == {1, 2, 4}
    assert any("exact4x" in d["corners"] for d in draws)


def test_a_direct_planner_call_never_pads_past_its_budget() -> None:
    """A direct ``plan_dynamic`` draw's ``pad_multiple`` is at most its budget: a group pads each rank's share to a
    multiple of it, so under a smaller budget no document fits and the planner refuses the whole step (a wasted
    draw: 145 of seeds 0..2999 drew pad 8 with a budget of 3..7 before). Both pads are still drawn, and budgets
    under 8 still meet a direct call (with pad 2).
    Seen failing: with the ``pad > budget`` re-draw removed from ``draw_dynamic`` (the first assertion)."""
    direct = [d for d in (draw_dynamic(random.Random(seed)) for seed in range(3000)) if d["planner"]["how"] == "direct"]
    assert not [d["max_tokens_per_rank"] for d in direct if d["planner"]["pad_multiple"] > d["max_tokens_per_rank"]]
    assert {d["planner"]["pad_multiple"] for d in direct} == {2, 8}
    assert any(d["max_tokens_per_rank"] < 8 for d in direct)
