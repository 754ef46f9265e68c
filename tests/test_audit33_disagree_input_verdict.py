"""Audit 33: the fuzzer's verdict on an attention case whose last rank passed other inputs (fz32's
``disagree_input``) and whose ranks all ran, on made-up results (a stand-in pool, one process), as
tests/test_audit32_dkv_wire_judge.py judges the option disagreement: WRONG, "no refusal", before any reference.
tests/test_fuzz.py's runs of these cases see the refusal only, so a verdict that let a run through was unseen."""

from __future__ import annotations

from test_audit32_dkv_wire_judge import _EveryRankRan

from seqpar.testing import fuzz


def test_a_case_whose_inputs_disagree_and_that_ran_is_wrong_before_the_reference() -> None:
    """fz32's case 148912333 (the last rank passes other documents): every rank "ran" is WRONG naming the input;
    the same draws without the disagreement go on to the reference (not that verdict).

    Seen failing (audit 33): with the ``input_disagreement`` verdict taken out of ``fuzz.run_case`` (Z6): a
    crash verdict from the reference on the stand-in's empty results, no "no refusal"."""
    draws = fuzz.draw_case(148912333, ("attention",))
    assert draws["disagree_input"] == "documents", fuzz.summary(draws)
    rec = fuzz.run_case(_EveryRankRan(), draws)
    assert rec["verdict"] == "WRONG" and "no refusal" in rec["detail"] and "documents" in rec["detail"], rec["detail"]
    rec = fuzz.run_case(_EveryRankRan(), {**draws, "disagree_input": None})
    assert "no refusal" not in rec["detail"], rec["detail"]
