"""The compile kind's dilated draws (seqpar.testing.fuzz_compile._draw_dilated_tail) over many case seeds, draws only
(no case is run): its fit rule's spanning side and its one-graph promise, which tests/test_fuzz.py's
test_fz26b_axes_are_drawn does not assert (audit 27's unrun F12, F13; that test catches F11 and F18-F22)."""

from __future__ import annotations

from seqpar.testing import fuzz


def test_compiled_dilated_draws_span_ranks_and_promise_one_graph_only_unchecked() -> None:
    """The compile kind's dilated draws (``sub="dilated"``): every segment length divides every call's length and
    is local or spanning on each call's shard; some are spanning (a segment longer than a call's shard at SP > 1:
    the pattern exchanged between ranks); ``fullgraph`` only with ``check_inputs`` off.

    Seen failing: the fit rule without its spanning side (``w % (s // sp) == 0`` dropped, F12: no spanning
    segment drawn); ``fullgraph`` drawn with the cross-rank check on (F13)."""
    dilated = spanning = 0
    for seed in range(1500):
        d = fuzz.draw_case(seed, ("compile",))
        if d.get("sub") != "dilated":
            continue
        dilated += 1
        assert not (d["fullgraph"] and d["check_inputs"]), seed
        for w in d["segment_lengths"]:
            for c in d["calls"]:
                s, sp = c["seq"], c["sp"]
                assert s % w == 0 and (sp == 1 or (s // sp) % w == 0 or w % (s // sp) == 0), (seed, w, s, sp)
                spanning += sp > 1 and w > s // sp
    assert dilated >= 20 and spanning >= 3, (dilated, spanning)
