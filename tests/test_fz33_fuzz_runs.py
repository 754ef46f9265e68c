"""fz33's fuzzer draws run on ranks (the rank pool of tests/test_fuzz.py, its timeouts): a ``disagree_shape`` case of
each option (the last rank's heads, head dim or dtype apart; dilated: its shard or batch too) refused by the
cross-rank check on every rank, and a ``dkv_wire`` case of each of the ``engine``, ``dynamic`` and ``trainer`` kinds
exact at the wire's bound against its float64 reference. The draws and judges without ranks: test_fz33_fuzz_draws.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from seqpar.testing import fuzz
from seqpar.testing.fuzz_attention import DILATED_DISAGREE_INPUTS, DISAGREE_SHAPES


@pytest.fixture(scope="module")
def fuzzer() -> Iterator[fuzz.Fuzzer]:
    with fuzz.Fuzzer(timeout=90.0, model_timeout=300.0) as f:
        yield f


@pytest.mark.timeout(900)
@pytest.mark.parametrize(("kind", "options"), [("attention", DISAGREE_SHAPES), ("dilated", DILATED_DISAGREE_INPUTS)])
def test_disagreeing_shapes_are_refused_on_every_rank(fuzzer: fuzz.Fuzzer, kind: str, options: tuple[str, ...]) -> None:
    """The first ring case of seed 3331 per option is refused on every rank by the cross-rank check, naming each
    rank's inputs (no run, no hang, no crash in a collective). Seen failing: with ``check_across_ranks`` returning
    at once (``seqpar.attn.checks``): attention 403875020 (dtype, P = 2) a crash, rank 1 aborted (exit -6); dilated
    1066249336 (head_dim) refused by a later local check, not by the cross-rank one."""
    seen: dict[str, dict] = {}
    for s in fuzz.case_seeds(3331, 20000):
        d = fuzz.draw_case(s, (kind,))
        if d["disagree_shape"] and d["disagree_shape"] not in seen and d["mode"] == "ring":
            seen[d["disagree_shape"]] = d
        if len(seen) == len(options):
            break
    assert set(seen) == set(options)
    for option, draws in seen.items():
        rec = fuzzer.run(draws)
        assert rec["verdict"] == "refused" and "different inputs or options" in rec["detail"], \
            (option, draws["case_seed"], fuzz.summary(draws), rec["detail"])


@pytest.mark.timeout(600)
def test_a_dynamic_wire_case_is_judged_on_the_pools_ring(fuzzer: fuzz.Fuzzer) -> None:
    """Found by fz33's hunt: 1922611699 (tiny Kimi-Linear, P = 4 as dp 4 x sp 1, ring, balanced, the bf16 wire) is
    exact at the wire's bound: the planner's groups span the whole pool, so the bound counts ``world - 1`` hops, not
    ``sp - 1`` (0 here, which judged the bf16 wire exactly). Seen failing: with the bound of ``draws["sp"]`` (the
    hunt's run): WRONG, "grad model.embed_tokens.weight off by 2.6e-04 of its max (tol 1e-04)"."""
    draws = fuzz.draw_case(1922611699, ("dynamic",))
    assert draws["dkv_wire"] == "bf16" and draws["sp"] == 1 and draws["world"] == 4, fuzz.summary(draws)
    rec = fuzzer.run(draws)
    assert rec["verdict"] == "exact" and "dkv=bf16 within" in rec["detail"], (fuzz.summary(draws), rec["detail"])
