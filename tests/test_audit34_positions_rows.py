"""A batch of three rows, the first right, the second restarting halfway (packed sequences cut as if whole) and the
third wrong everywhere: the refusal judges the *first* wrong row, a row wrong in only some positions included, so it
says the positions restart and shows that row (audit 34, on mut33b's ``_wrong_row``).

Seen failing (mut34): H2 (a row counted wrong only where every position differs: the half-right second row was
skipped, the third judged) -> "pass the global positions" instead of "they restart"; H3 (the last wrong row, not the
first) -> the same.
"""

from __future__ import annotations

import torch
from hf_tiny import swapped_one_layer_llama


def _run(rank: int, world: int) -> str:
    model = swapped_one_layer_llama(world)
    local = 48 // world
    ids = torch.randint(0, 64, (3, local), generator=torch.Generator().manual_seed(3 + rank))
    right = torch.arange(rank * local, (rank + 1) * local)
    half = local // 2
    restarting = torch.cat([right[:half], torch.arange(local - half)])  # right first half, then from 0 again
    positions = torch.stack([right, restarting, right + 100])
    try:
        model(input_ids=ids, position_ids=positions)
    except ValueError as e:
        return str(e)
    return "no refusal"


def test_the_first_wrong_row_is_judged_even_when_partly_right(dist_pool) -> None:
    for rank, message in enumerate(dist_pool.run(2, _run, timeout=120)):
        lo = rank * 24
        assert f"position_ids on SP rank {rank} of 2 are not the global positions" in message, message
        assert "they restart (packed sequences)" in message, message
        # the row shown as "got" is row 1 (its right first half), not row 0 or row 2
        shown = message.replace("tensor(", "")
        assert f"got [{lo}, {lo + 1}" in shown and f"got [{lo + 100}" not in shown, message
