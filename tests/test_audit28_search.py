"""The length search's edges (seqpar.memory.search.largest_fitting and its two users, max_seq_len and
longest_sequence), which tests/test_memory_search.py's random float budgets do not reach: a cost equal to the budget
fits (``cost(n) <= budget``), nothing fitting is 0, and longest_sequence finds lengths past 4096 steps."""

from __future__ import annotations

from seqpar.memory.attention import estimate_attention_memory, max_seq_len
from seqpar.memory.search import largest_fitting
from seqpar.memory.training import estimate_training_memory, longest_sequence

RING = {"world_size": 4, "mode": "ring", "batch": 1, "q_heads": 8, "kv_heads": 8, "head_dim": 16, "causal": True}


def test_a_cost_equal_to_the_budget_fits() -> None:
    """``largest_fitting`` at budgets each equal to some ``cost(n)``: the answer is that n (the first length
    included).

    Seen failing: the first length compared with ``>=`` (``largest_fitting(lambda n: n, 1)`` was 0); the search's
    test ``end = c < budget`` (one length short at every exact budget: 6 for 10 n at 70)."""
    assert largest_fitting(lambda n: n, 1) == 1
    for slope, base in ((10, 0), (37, 1000), (1, 5)):
        for n in (1, 2, 3, 7, 8, 100, 513, 999):
            assert largest_fitting(lambda m, s=slope, b=base: b + s * m, base + slope * n, limit=1000) == n, (slope, n)


def test_max_seq_len_at_a_budget_equal_to_an_estimate_and_below_the_first() -> None:
    """``max_seq_len`` (P = 4 causal ring, multiple 64: steps of 512 tokens) with the budget set to the estimate at
    one step and at 9 steps returns that length; one byte under the first step's estimate returns 0.

    Seen failing: ``max(largest_fitting(...), 1) * step`` (512 returned where nothing fits); the first length
    compared with ``>=`` (0 at the one-step budget); ``end = c < budget`` (8 steps at the 9-step budget)."""
    for steps in (1, 9):
        budget = estimate_attention_memory(512 * steps, **RING)
        assert max_seq_len(budget, multiple=64, **RING) == 512 * steps, steps
    assert max_seq_len(estimate_attention_memory(512, **RING) - 1, multiple=64, **RING) == 0


def test_longest_sequence_past_4096_steps_is_the_longest_that_fits() -> None:
    """A small model (hidden 64, 2 layers) at SP 1 with granularity 1 and a 64 GiB budget: the answer is more than
    4096 steps, fits, and one step more does not.

    Seen failing: the search's limit at ``1 << 12`` steps (returned 4096, which fits, with room for far more)."""
    model = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2}
    budget = 64 * 2 ** 30
    best, breakdown = longest_sequence(model, budget, sp_size=1, granularity=1)
    assert best > 4096, best
    assert breakdown["peak"] <= budget < estimate_training_memory(model, seq_len=best + 1, sp_size=1)["peak"]
