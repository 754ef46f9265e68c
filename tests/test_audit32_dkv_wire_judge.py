"""The fuzzer's judges that session 31 added, on made-up results (one process, no ranks): the model kind's
``dkv_wire_dtype: "bf16"`` judge (``judge_dkv_wire`` at ``dkv_wire_bound``) and its place in ``run_model_case``, and
the attention kind's disagreement verdict (every rank ran although the last one passed another option under
``check_inputs=True``). A judge that passes what it should call WRONG hides every later break from the fuzzer, and
the tests of these judges (tests/test_fuzz.py) check a doubled gradient of one size, the bound from below only,
and the runs where the judge says exact.

Note for fz32 (seqpar/testing/fuzz* this session): these call ``fuzz_models.dkv_wire_bound``, ``judge_dkv_wire``,
``run_model_case`` (with ``case_batches``, ``model_reference``, ``run_ranks`` and ``judge_model`` stood in) and
``fuzz.run_case`` with a stand-in pool.
"""

from __future__ import annotations

import pytest
import torch

from seqpar.testing import fuzz, fuzz_models
from seqpar.testing.fuzz_models import dkv_wire_bound, judge_dkv_wire

U = 2.0 ** -8


def _grads() -> dict[str, torch.Tensor]:
    """A large gradient (norm about 8) and a small one (norm about 0.01), fresh random float64."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    return {"lm_head.weight": torch.randn(16, 4, generator=g, dtype=torch.float64),
            "k_proj.weight": 1e-3 * torch.randn(8, 4, generator=g, dtype=torch.float64) + 2e-3}


def test_the_wire_bound_counts_the_hops_of_the_ring() -> None:
    """``4 * layers * 2 * hops * 2**-8`` with hops P - 1 on a ring (and under auto), P / u - 1 on hybrid's ring of
    P / u ranks, capped at 0.5 (values from the docstring's rule).

    Seen failing (audit 32): hybrid's hops taken as P - 1 (F3: 0.09375 for 0.03125 at P = 4, u = 2: a judge three
    times looser), the hops taken as P (F6: 0.125 for 0.09375 at P = 4 ring)."""
    for world, mode, u, layers, hops in ((4, "hybrid", 2, 1, 1), (4, "ring", 1, 1, 3), (2, "ring", 1, 2, 1),
                                         (4, "auto", 1, 1, 3), (4, "hybrid", 4, 3, 0)):
        d = {"world": world, "mode": mode, "ulysses_size": u}
        assert dkv_wire_bound(d, layers) == min(0.5, 4 * layers * 2 * hops * U), (world, mode, u, layers)
    assert dkv_wire_bound({"world": 4, "mode": "ring", "ulysses_size": 1}, 40) == 0.5


def test_each_gradient_is_judged_on_its_own_norm() -> None:
    """A small gradient doubled is WRONG although its error is far below the bound times the model's largest
    gradient norm (the bound is of each gradient's own norm); a rounding-sized change of it is exact.

    Seen failing (audit 32): the bound taken of the model's largest norm (F2: the doubled small gradient passed)."""
    base = _grads()
    d = {"world": 2, "mode": "ring", "ulysses_size": 1, "model_type": "llama"}
    ref = {"dtype": "float64"}
    doubled = {**base, "k_proj.weight": 2 * base["k_proj.weight"]}
    verdict, detail = judge_dkv_wire(d, ref, {"loss": 1.0, "grads": base}, {"loss": 1.0, "grads": doubled})
    assert verdict == "WRONG" and "k_proj.weight" in detail, detail
    near = {**base, "k_proj.weight": base["k_proj.weight"] * (1 + U)}
    assert judge_dkv_wire(d, ref, {"loss": 1.0, "grads": base}, {"loss": 1.0, "grads": near})[0] == "exact"


def test_a_gradient_of_one_run_only_and_a_moved_loss_are_wrong() -> None:
    """A gradient present in the bf16-wire run only is WRONG (as one present in the fp32 run only); a loss moved
    by twice the exact tolerance (float64: 1e-4 relative) is WRONG.

    Seen failing (audit 32): the missing set one-sided, fp32 minus bf16 (F1: the bf16 run's extra gradient
    passed), the loss tolerance ten times the exact one (F4: 2e-4 passed)."""
    base = _grads()
    d = {"world": 2, "mode": "ring", "ulysses_size": 1, "model_type": "llama"}
    ref = {"dtype": "float64"}
    extra = {**base, "v_proj.weight": torch.ones(2, 2, dtype=torch.float64)}
    for a, b in ((base, extra), (extra, base)):
        verdict, detail = judge_dkv_wire(d, ref, {"loss": 1.0, "grads": a}, {"loss": 1.0, "grads": b})
        assert verdict == "WRONG" and "one run only" in detail and "v_proj.weight" in detail, detail
    verdict, detail = judge_dkv_wire(d, ref, {"loss": 1.0, "grads": base}, {"loss": 1.0 + 2e-4, "grads": base})
    assert verdict == "WRONG" and "loss" in detail, detail


def test_run_model_case_returns_the_wire_judges_wrong(monkeypatch: pytest.MonkeyPatch) -> None:
    """``run_model_case`` of a ``dkv_wire`` case: the bf16 run first, then the fp32 one; the fp32 run exact against
    one process, and the bf16 run's doubled gradient makes the case WRONG (the ranks, the batches and the
    one-process reference stood in).

    Seen failing (audit 32): ``run_model_case`` returning exact whatever the wire judge said (F5)."""
    base = _grads()
    runs = []

    def ranks(pools, draws, ref, task, batches, plant, timeout):  # noqa: ANN001, ANN202
        runs.append(draws.get("dkv_wire"))
        grads = base if draws.get("dkv_wire") is None else {**base, "k_proj.weight": 2 * base["k_proj.weight"]}
        return None, [{"loss": 1.0, "grads": grads}]

    monkeypatch.setattr(fuzz_models, "case_batches", lambda draws: [])
    monkeypatch.setattr(fuzz_models, "model_reference", lambda draws, batches: {"dtype": "float64"})
    monkeypatch.setattr(fuzz_models, "run_ranks", ranks)
    monkeypatch.setattr(fuzz_models, "judge_model", lambda ref, got: ("exact", "stood in"))
    draws = {"world": 2, "mode": "ring", "ulysses_size": 1, "model_type": "llama", "dkv_wire": "bf16"}
    verdict, detail = fuzz_models.run_model_case(None, draws, 60.0)
    assert runs == ["bf16", None], runs
    assert verdict == "WRONG" and "k_proj.weight" in detail, detail
    runs.clear()
    assert fuzz_models.run_model_case(None, {**draws, "dkv_wire": None}, 60.0) == ("exact", "stood in")
    assert runs == [None]


class _EveryRankRan:
    """A stand-in rank pool whose ranks all return ok (no refusal), without running anything."""

    def run(self, world: int, task: object, *args: object, **kwargs: object) -> list:
        return [{"ok": True, "calls": []} for _ in range(world)]


def test_a_disagreeing_case_that_ran_is_wrong_before_the_reference() -> None:
    """An attention case whose last rank passes another option (fz31's case 1699289319: causal) and whose ranks all
    ran is WRONG, "no refusal", before any reference is judged; the same draws without the disagreement go on to
    the reference (here a driver error on the stand-in's empty results, not that verdict).

    Seen failing (audit 32): the disagreement verdict taken out of ``run_case`` (F7: the reference judged the
    stand-in's results, "crash ... driver")."""
    draws = fuzz.draw_case(1699289319, ("attention",))
    assert draws["disagree"] == "causal", fuzz.summary(draws)
    rec = fuzz.run_case(_EveryRankRan(), draws)
    assert rec["verdict"] == "WRONG" and "no refusal" in rec["detail"] and "causal" in rec["detail"], rec["detail"]
    rec = fuzz.run_case(_EveryRankRan(), {**draws, "disagree": None})
    assert "no refusal" not in rec["detail"], rec["detail"]
