"""The planner's thresholds and orders that the other plan tests do not pin (session 21's mutation audit, mut21d).

Each test names the mutant it was written for; each was seen failing with it applied and passing without.
"""

from __future__ import annotations

import pytest

from seqpar.sequence.dynamic import CostModel, plan_dynamic


@pytest.mark.parametrize("slot_sync", [False, True])
def test_a_spread_that_does_not_lower_the_busiest_rank_is_not_kept(slot_sync: bool) -> None:
    """``spread_heavy`` keeps a wider group only when it saves a slot or lowers the busiest rank's planned cost by
    1% at least. Pool 2, documents (100, 2), budget 128, causal pairs only (a 100-token document costs 5050 on one
    rank) and a ring step cost ``r``: spread over both ranks the busiest rank pays ``(5050 + 3) / 2 + 2 r`` (one
    ring step each way), against 5050 on one rank. At ``r`` 1262 and 1274 that is 0.01% and 0.5% *more*: the
    document stays on its rank; at ``r`` 1000 (10% less) it spreads. The random steps of
    ``test_spread_heavy_spreads_a_document_heavier_than_an_even_share`` never land within 1% of a tie.
    Seen failing: the acceptance bar at ``>= 1.01 *`` the current objective instead of ``0.99`` (spreads that raise
    the busiest rank by up to 1% kept: both cases spread)."""
    for r in (1262.0, 1274.0):
        cost = CostModel(ring_step_cost=r)
        plain = plan_dynamic([100, 2], 2, 128, cost=cost)
        spread = plan_dynamic([100, 2], 2, 128, cost=cost, spread_heavy=True, slot_sync=slot_sync)
        assert [mb.size for slot in spread.slots for mb in slot if 0 in mb.docs] == [1], (r, spread.slots)
        assert max(spread.rank_cost) <= max(plain.rank_cost), r
    cost = CostModel(ring_step_cost=1000.0)
    spread = plan_dynamic([100, 2], 2, 128, cost=cost, spread_heavy=True, slot_sync=slot_sync)
    assert [mb.size for slot in spread.slots for mb in slot if 0 in mb.docs] == [2], spread.slots
    assert max(spread.rank_cost) < 0.9 * max(plan_dynamic([100, 2], 2, 128, cost=cost).rank_cost)
