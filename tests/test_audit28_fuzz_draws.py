"""Draw rules of the fuzzer's attention and compile kinds (seqpar.testing.fuzz_attention, fuzz_compile) over many
case seeds, draws only (no case is run): each combination a rule keeps out never drawn, and each axis a rule makes
room for drawn (tests/test_fuzz.py's draw tests pin a few seeds; a rule loosened or tightened there went
unseen: audit 27's unrun F12-F22)."""

from __future__ import annotations

from seqpar.testing import fuzz


def test_attention_draw_rules_hold_over_600_seeds() -> None:
    """``group_arg="manager"`` only without a drawn group; ``grad="frozen_kv"`` never with the fused (one leaf) q, k,
    v; the expanded MQA K/V (``expand_kv``) only with one K/V head and never fused; balanced sharding drawn
    without documents too.

    Seen failing: ``group_arg`` drawn whatever the group (F18); ``frozen_kv`` with fused views (F19); ``expand_kv``
    with fused views (F21); the balanced switch taken with documents instead of without (F22: no balanced case
    without documents)."""
    balanced_without_documents = 0
    for seed in range(600):
        d = fuzz.draw_case(seed, ("attention",))
        assert d["group_arg"] is None or d["group"] is None, seed
        assert not (d["grad"] == "frozen_kv" and d["strided"] == "fused"), seed
        assert not d["expand_kv"] or (d["heads"][1] == 1 and d["strided"] != "fused"), seed
        balanced_without_documents += d["sharding"] == "balanced" and not any(c.get("cu") for c in d["calls"])
    assert balanced_without_documents >= 10, balanced_without_documents


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
