"""Audit 25: ``seqpar.testing.fuzz.force`` re-derives a drawn ``head_chunks`` that a forced ``heads`` makes stale.
No process group."""

from __future__ import annotations

from seqpar.testing import fuzz


def test_forced_heads_rederive_a_head_chunks_they_do_not_divide() -> None:
    """``--set heads=...`` on an ``attention`` case whose drawn int ``head_chunks`` does not divide the forced K/V
    heads makes it ``"auto"`` (else the call would be refused, "head_chunks=N does not divide", a verdict that is
    the harness's); a drawn ``head_chunks`` that still divides them, or one forced with them, is kept. Seen failing:
    ``force`` without that re-derivation (``head_chunks=2`` kept for one K/V head)."""
    stale = kept = 0
    for seed in range(400):
        d = fuzz.draw_case(seed, ("attention",))
        if d["kind"] != "attention" or d["head_chunks"] == "auto":
            continue
        for heads in ((4, 1), (6, 3), (8, 4)):
            f, conflict = fuzz.force(d, {"heads": heads})
            assert conflict is None and f["heads"] == heads, (seed, heads, conflict)
            if heads[1] % d["head_chunks"]:
                assert f["head_chunks"] == "auto", (seed, heads, d["head_chunks"], f["head_chunks"])
                stale += 1
            else:
                assert f["head_chunks"] == d["head_chunks"], (seed, heads)
                kept += 1
            g, _ = fuzz.force(d, {"heads": heads, "head_chunks": d["head_chunks"]})  # forced together: as given
            assert g["head_chunks"] == d["head_chunks"], (seed, heads)
    assert stale > 10 and kept > 10, (stale, kept)
