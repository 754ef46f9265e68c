"""Two plans of session 27's code, one process: plan_dynamic with zero-length documents between others (each
document keeps its own group size) and the dilated straddle check at a local length that is neither a multiple nor
a divisor of the segment length (tests/test_zero_length_documents.py puts its empty documents where the mapping
does not show; tests/test_dilated_dist.py's straddle case is refused by either side of the check)."""

from __future__ import annotations

import pytest

from seqpar.attn.dilated_plan import check_pattern
from seqpar.sequence.dynamic import plan_dynamic


def test_each_document_keeps_its_group_size_beside_empty_ones() -> None:
    """Documents of 200, 10 and 30 tokens (pool 4, 64 tokens a rank) with empty documents before, between and
    after: each non-empty document's group size and slot are those of the plan without the empty ones, each empty
    one gets the smallest size and runs in no micro-batch.

    Seen failing: the sizes copied in the kept documents' order onto the first indices (``enumerate`` for
    ``zip(kept, ...)``: the empty document at index 0 took the 200-token document's group size 4, that
    document 1)."""
    clean = plan_dynamic([200, 10, 30], 4, 64)
    padded = plan_dynamic([0, 200, 0, 10, 30, 0], 4, 64)
    kept = [1, 3, 4]
    assert [padded.doc_sizes[i] for i in kept] == list(clean.doc_sizes), (padded.doc_sizes, clean.doc_sizes)
    smallest = min(clean.doc_sizes + (1,))
    assert all(padded.doc_sizes[i] == smallest for i in (0, 2, 5)), padded.doc_sizes
    ran = sorted(d for slot in padded.slots for mb in slot for d in mb.docs)
    assert ran == kept, ran


@pytest.mark.parametrize("seq_local,w", [(7, 2), (9, 2), (10, 4)])
def test_a_segment_straddling_a_rank_edge_is_refused(seq_local: int, w: int) -> None:
    """Two ranks, a segment length that divides the sequence (2 x seq_local) but neither divides the local length
    nor is a multiple of it: refused, naming the straddle.

    Seen failing: the straddle test as ``(seq_local % w) * (w % seq_local) > seq_local`` (7 / 2: 1 x 2 is not over
    7, accepted)."""
    with pytest.raises(ValueError, match="straddle"):
        check_pattern([w], [1], seq_local=seq_local, world_size=2, q_heads=4)
