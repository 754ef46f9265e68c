"""``max_seq_len`` under chunked attention (seqpar.memory.attention): the length it returns is the longest whose
estimate, with the same ``chunk_size``, fits the budget (tests/test_memory_masks.py asks it with a window only)."""

from __future__ import annotations

import pytest

from seqpar.memory.attention import estimate_attention_memory, max_seq_len


@pytest.mark.parametrize("masks", [{"chunk_size": 64}, {"chunk_size": 256}, {"window": 256}, {"sinks": True}],
                         ids=["chunk64", "chunk256", "window256", "sinks"])
def test_max_seq_len_is_the_longest_that_fits_under_the_mask(masks: dict) -> None:
    """P = 4 ring, causal (zigzag), 8 / 8 heads, head_dim 16, a 16 MiB budget: the returned S fits, S plus one step
    (2 P x 64 tokens) does not, each with the mask given.

    Seen failing: ``max_seq_len`` not passing ``chunk_size`` on to the estimate (chunk 256: the dense figure's
    S = 11776, whose chunked estimate 16927744 is over the 16777216 budget)."""
    kw = {"world_size": 4, "mode": "ring", "batch": 1, "q_heads": 8, "kv_heads": 8, "head_dim": 16, "causal": True}
    budget = 2 ** 24
    best = max_seq_len(budget, multiple=64, **masks, **kw)
    assert best > 0
    assert estimate_attention_memory(best, **masks, **kw) <= budget < estimate_attention_memory(best + 512, **masks, **kw)
