"""The dynamic planner names a too-long document by its index among the lengths it was given, also when a
zero-length document comes before it (audit 30; fuzzer case 304181941: the planner of the other documents named
[0, 1, 8, 4, 12]'s 12 "document 3")."""

from __future__ import annotations

import pytest

from seqpar.sequence.dynamic import plan_dynamic


@pytest.mark.parametrize("lengths,index", [([0, 1, 8, 4, 12], 4), ([0, 0, 12, 1], 2), ([12, 0, 1], 0)])
def test_a_too_long_document_is_named_by_its_given_index(lengths: list[int], index: int) -> None:
    """A pool of 2 ranks at 4 tokens a rank holds 8 tokens at most: the 12-token document is refused by its index.

    Seen failing (audit 30's D1): without the refusal before the empty documents are dropped, [0, 1, 8, 4, 12]'s
    12 was refused as "document 3" (its index among the non-empty ones)."""
    with pytest.raises(ValueError, match=rf"plan_dynamic: document {index} has 12 tokens"):
        plan_dynamic(lengths, 2, 4)
