"""A batch of two rows whose first row holds this rank's global positions and whose second does not: the
refusal names the row that is wrong, and never calls the run's own sharding "another cut" (mut33b, H7: with
``_other_cut`` not skipping the run's own sharding, the first (right) row matched it and the refusal told the user
to declare the sharding already declared; before the fix the message showed the right first row as "got")."""

from __future__ import annotations

import torch
from hf_tiny import swapped_one_layer_llama


def _run(rank: int, world: int) -> str:
    model = swapped_one_layer_llama(world)
    local = 48 // world
    ids = torch.randint(0, 64, (2, local), generator=torch.Generator().manual_seed(3 + rank))
    right = torch.arange(rank * local, (rank + 1) * local)
    positions = torch.stack([right, right + 100])  # row 1: not this shard's positions of any cut
    try:
        model(input_ids=ids, position_ids=positions)
    except ValueError as e:
        return str(e)
    return "no refusal"


def test_a_wrong_second_row_is_named_and_the_own_cut_is_not(dist_pool) -> None:
    for rank, message in enumerate(dist_pool.run(2, _run, timeout=120)):
        lo = rank * 24
        assert f"position_ids on SP rank {rank} of 2 are not the global positions of this rank's contiguous" \
            in message, message
        assert "cut, but the swapped model runs sharding" not in message, message
        assert "declare \"sharding\"" not in message, message
        # the row shown as "got" is the wrong one (row 1), not the right first row
        assert f"got [{lo + 100}, {lo + 101}" in message.replace("tensor(", ""), message
