"""The fuzzer's ``force`` (``--set``) with the pairs drawn as ``group=``: the pairs ``{0, 1}, {2, 3}`` need world 4,
so forcing another world drops them (re-derived: ``group`` None) or, when ``group`` is forced too, is a conflict the
case is skipped for, never judged (the harness's ``new_subgroups(2)`` cannot split 1 or 3 ranks)."""

from __future__ import annotations

from seqpar.testing import fuzz


def test_forcing_another_world_drops_the_pairs_or_is_a_conflict() -> None:
    """Every drawn case whose ``group`` is the pairs (attention and dilated kinds), forced to worlds 1-3: ``group``
    None; forced with ``group="pairs"`` too: a conflict naming ``group``.

    Seen failing: the dilated kind's re-derivation dropped (``world != 4`` -> ``world == 0`` in ``force``: the
    pairs kept at worlds 1-3, which the harness's subgroups cannot split)."""
    seen = {"attention": 0, "dilated": 0}
    for seed in range(1000):
        d = fuzz.draw_case(seed, ("attention", "dilated"))
        if d.get("group") != "pairs":
            continue
        seen[d["kind"]] += 1
        for w in (1, 2, 3):
            f, conflict = fuzz.force(d, {"world": w})
            assert conflict is None and f["group"] is None, (seed, d["kind"], w, conflict, f.get("group"))
            f, conflict = fuzz.force(d, {"world": w, "group": "pairs"})
            assert conflict is not None and "group" in conflict and "world=4" in conflict, (seed, w, conflict)
    assert min(seen.values()) >= 3, seen  # both kinds drew the pairs
