"""fz33's fuzzer draws: the bf16 dK/dV wire (``dkv_wire``) in the ``engine``, ``dynamic`` and ``trainer`` kinds, and
``disagree_shape`` (the last rank's heads, head dim or dtype apart; in the ``dilated`` kind its shard and batch too).

Checked here without ranks: the old draws are untouched (each new draw comes from a generator of its own), the new
draws reach the config the ranks pass (``dkv_wire_dtype``) and the inputs the last rank passes, and the judges call
a planted WRONG WRONG: a gradient doubled or a forward moved under the wire, a disagreeing case whose ranks all ran.
The runs on ranks are in tests/test_fz33_fuzz_runs.py.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest
import torch

from seqpar.testing import fuzz, fuzz_engines_run, fuzz_models, fuzz_trainers_run
from seqpar.testing.fuzz_attention import (
    DILATED_DISAGREE_INPUTS,
    DISAGREE_SHAPES,
    disagreeing_inputs,
    input_disagreement,
)
from seqpar.testing.fuzz_models import judge_model, judge_model_wire, kind_dkv_wire_bound

PRE_FZ33_DRAWS = {
    "attention": "b85d5b2a1dabe6fa9b331113d9fcf413af110eb264ba86a2893a9adc6a4160ca",
    "dilated": "5f2af33bb11fefd323b05ca8ef34e536fbf55811512099382d11873b17de4500",
    "engine": "6e93f1c356f8ebc4cf02210c03fd7d75d8a66ca922dd0494aef47a98a907f8e5",
    "dynamic": "833ae816e5eb7d08995e0641b565ef20412fb4ac19484a2aaa13d6fd2a6ca93a",
    "trainer": "cc7b1ca1f7160202b23141ab3dcc2f2df96c6027e11cf4a16c7d4a27f53902e8",
}
"""The sha256 of each kind's whole draws of ``fuzz.case_seeds(1001, 200)`` as they were before fz33 (on 8ea8f15):
``json.dumps(list, sort_keys=True)``."""
NEW_KEYS = {"attention": "disagree_shape", "dilated": "disagree_shape", "engine": "dkv_wire", "dynamic": "dkv_wire",
            "trainer": "dkv_wire"}


def _draws(kind: str, n: int = 200) -> list[dict[str, Any]]:
    return [fuzz.draw_case(s, (kind,)) for s in fuzz.case_seeds(1001, n)]


@pytest.mark.parametrize("kind", sorted(PRE_FZ33_DRAWS))
def test_the_old_draws_are_untouched(kind: str) -> None:
    """Each kind's draws without fz33's key are those it had before (so every pinned case seed keeps its
    composition), and the new key is in every draw. Seen failing: one ``rng.random()`` added at the top of
    ``draw_engine`` (a draw taken from the case's generator): the engine digest differs."""
    draws = _draws(kind)
    key = NEW_KEYS[kind]
    assert all(key in d for d in draws)
    old = [{k: v for k, v in d.items() if k != key} for d in draws]
    assert hashlib.sha256(json.dumps(old, sort_keys=True).encode()).hexdigest() == PRE_FZ33_DRAWS[kind]


@pytest.mark.parametrize("kind", ["engine", "dynamic", "trainer"])
def test_the_wire_is_drawn_in_a_quarter_of_the_cases(kind: str) -> None:
    """``dkv_wire`` is ``"bf16"`` in about :data:`~seqpar.testing.fuzz_models.KIND_DKV_WIRE_RATE` of each kind's
    cases, in every mode the kind draws, and the summary says so; the other kinds never draw it from this generator.
    Seen failing: with ``KIND_DKV_WIRE_RATE = 0``."""
    draws = _draws(kind, 400)
    wired = [d for d in draws if d["dkv_wire"]]
    assert {d["dkv_wire"] for d in wired} == {"bf16"}
    assert 0.15 < len(wired) / len(draws) < 0.35, len(wired)
    assert all(" dkv=bf16" in fuzz.summary(d) for d in wired)
    assert not any("dkv=bf16" in fuzz.summary(d) for d in draws if not d["dkv_wire"])
    assert {d["mode"] for d in wired} == {d["mode"] for d in draws}
    assert fuzz_models.draw_kind_dkv_wire(wired[0]["case_seed"], "model") is None


class _Ctx:
    rank, world_size = 0, 2


class _Captured(Exception):
    pass


def _wired(kind: str, ok: Any = None, **want: Any) -> dict[str, Any]:
    """The first of ``kind``'s draws with the wire and ``want`` (and ``ok(draws)`` where given)."""
    for s in fuzz.case_seeds(1001, 400):
        d = fuzz.draw_case(s, (kind,))
        if d["dkv_wire"] and all(d.get(k) == v for k, v in want.items()) and (ok is None or ok(d)):
            return d
    raise AssertionError(f"no {kind} case with the wire and {want}")


def _planned(draws: dict[str, Any]) -> bool:
    from seqpar.testing.fuzz_dynamic import case_plan

    try:
        case_plan(draws)
    except ValueError:
        return False
    return True


def test_the_engine_kinds_config_carries_the_wire(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine kind's rank task passes ``dkv_wire_dtype: "bf16"`` in the config its runner gets (a stand-in runner
    records it), and none without the draw. Seen failing: the config line removed (no key)."""
    seen = []

    def runner(engine, build_model, fed, config, accumulate):  # noqa: ANN001, ANN202
        seen.append(dict(config))
        return {"loss": 0.0, "replica": 0, "grads": {}}

    monkeypatch.setattr(fuzz_engines_run, "engine_runner", lambda engine: runner)
    draws = _wired("engine", engine="fsdp2")
    for d in (draws, {**draws, "dkv_wire": None}):
        out = fuzz_engines_run.engine_task(_Ctx(), d, [[] for _ in range(d.get("dp", 1))], "float64")
        assert out["ok"], out
    assert seen[0]["dkv_wire_dtype"] == "bf16" and "dkv_wire_dtype" not in seen[1]


def test_the_dynamic_kinds_config_carries_the_wire(monkeypatch: pytest.MonkeyPatch) -> None:
    """The dynamic kind's rank task passes ``dkv_wire_dtype: "bf16"`` to ``init_process_groups`` (plain) and to its
    engine runner (an engine), and none without the draw. Seen failing: the cfg line removed (no key)."""
    import seqpar
    from seqpar.testing import fuzz_dynamic

    seen = []

    def capture(*args: Any, config: dict[str, Any], **kwargs: Any) -> None:
        seen.append(dict(config))
        raise _Captured

    def runner(engine, build_model, plan, docs, cfg, prepare):  # noqa: ANN001, ANN202
        seen.append(dict(cfg))
        raise _Captured

    monkeypatch.setattr(seqpar, "init_process_groups", capture)
    monkeypatch.setattr(fuzz_dynamic, "dynamic_engine_runner", lambda engine: runner)
    plain = _wired("dynamic", _planned, engine="plain")
    engine = _wired("dynamic", lambda d: d["engine"] != "plain" and _planned(d))
    for d in (plain, {**plain, "dkv_wire": None}, engine):
        out = fuzz_dynamic._dynamic_task(_Ctx(), d, [], "float64", None)
        assert not out["ok"] and out["error"]["type"] == "_Captured", out
    assert [c.get("dkv_wire_dtype") for c in seen] == ["bf16", None, "bf16"]


def test_the_trainer_kinds_config_carries_the_wire(monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer kind's seqpar run passes ``dkv_wire_dtype: "bf16"`` in the SP block its runner gets; the
    one-process reference never does. Seen failing: the config line removed (no key)."""
    seen = []

    def runner(trainer, engine, model, data, knobs, config):  # noqa: ANN001, ANN202
        seen.append(dict(config))
        raise _Captured

    monkeypatch.setattr(fuzz_trainers_run, "trainer_runner", lambda trainer: runner)
    draws = _wired("trainer")
    for role in ("seqpar", "reference"):
        out = fuzz_trainers_run.trainer_task(_Ctx(), draws, role, "float64")
        assert not out["ok"] and out["error"]["type"] == "_Captured", out
    assert [c.get("dkv_wire_dtype") for c in seen] == ["bf16", None]


def _grads(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"lm_head.weight": torch.randn(16, 4, generator=g, dtype=torch.float64),
            "k_proj.weight": 1e-3 * torch.randn(8, 4, generator=g, dtype=torch.float64) + 2e-3}


def test_the_wire_judge_calls_a_planted_wrong_wrong() -> None:
    """:func:`judge_model_wire` against a float64 reference: a gradient off by half the bound of its own norm is
    exact, one doubled (the small one: far below the bound times the model's largest norm) is WRONG, a loss moved by
    twice the exact tolerance is WRONG (the wire is the backward's), a gradient on one side only is WRONG; at bound 0
    it is :func:`judge_model` itself. Seen failing: the bound taken of the model's largest gradient norm (the
    doubled small gradient passed)."""
    ref = {"dtype": "float64", "loss": 2.0, "grads": _grads(3)}
    bound = kind_dkv_wire_bound(2, 2)
    assert bound == 4 * 2 * 2 * 1 * 2.0 ** -8
    noise = _grads(4)
    near = {n: g + 0.5 * bound * g.norm() * noise[n] / noise[n].norm() for n, g in ref["grads"].items()}
    assert judge_model_wire(ref, {"loss": 2.0, "grads": near}, bound)[0] == "exact"
    assert judge_model(ref, {"loss": 2.0, "grads": near})[0] == "WRONG"  # the exact judge would not pass it
    doubled = {**ref["grads"], "k_proj.weight": 2 * ref["grads"]["k_proj.weight"]}
    verdict, detail = judge_model_wire(ref, {"loss": 2.0, "grads": doubled}, bound)
    assert verdict == "WRONG" and "k_proj.weight" in detail, detail
    verdict, detail = judge_model_wire(ref, {"loss": 2.0 * (1 + 2e-4), "grads": ref["grads"]}, bound)
    assert verdict == "WRONG" and "loss" in detail, detail
    extra = {**ref["grads"], "v_proj.weight": torch.ones(2, dtype=torch.float64)}
    assert judge_model_wire(ref, {"loss": 2.0, "grads": extra}, bound)[0] == "WRONG"
    assert judge_model_wire(ref, {"loss": 2.0, "grads": near}, 0.0) == judge_model(ref, {"loss": 2.0, "grads": near})
    assert kind_dkv_wire_bound(1, 4) == 0.0 and kind_dkv_wire_bound(4, 40) == 0.5


def test_run_engine_case_judges_the_wire_at_its_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """``run_engine_case`` of a wired case: a gradient off by a tenth of the bound is exact (with the exact judge it
    would be WRONG), a doubled one WRONG (the ranks and the reference stood in). Seen failing: the wire branch
    removed from ``run_engine_case`` (the near gradients judged exactly: WRONG)."""
    draws = _wired("engine", lambda d: d["world"] // (d["tp_size"] * d.get("dp", 1)) >= 2, engine="fsdp2")
    sp = draws["world"] // (draws["tp_size"] * draws.get("dp", 1))
    bound = kind_dkv_wire_bound(sp, fuzz_models.decoder_layers(draws["model_type"]))
    ref_grads = _grads(5)
    state = {}

    def ranks(pools, d, ref, task, batches, plant, timeout):  # noqa: ANN001, ANN202
        return None, [{"ok": True, "loss": 2.0, "replica": r, "grads": state["grads"]}
                      for r in range(d.get("dp", 1))]

    monkeypatch.setattr(fuzz_models, "case_batches", lambda d: [])
    monkeypatch.setattr(fuzz_models, "run_ranks", ranks)
    monkeypatch.setattr(fuzz_engines_run, "dp_reference", lambda d, b: {
        "ok": True, "dtype": "float64", "losses": [2.0] * d.get("dp", 1), "loss": 2.0, "grads": ref_grads})
    state["grads"] = {n: g * (1 + 0.1 * bound) for n, g in ref_grads.items()}
    assert bound > 0 and fuzz_engines_run.run_engine_case(None, draws, 60.0)[0] == "exact"
    assert fuzz_engines_run.run_engine_case(None, {**draws, "dkv_wire": None}, 60.0)[0] == "WRONG"
    state["grads"] = {**ref_grads, "k_proj.weight": 2 * ref_grads["k_proj.weight"]}
    verdict, detail = fuzz_engines_run.run_engine_case(None, draws, 60.0)
    assert verdict == "WRONG" and "k_proj.weight" in detail, detail


def _trainer_result(before: dict[str, torch.Tensor], update: dict[str, torch.Tensor], losses: list[float]
                    ) -> dict[str, Any]:
    return {"logs": [{"loss": x} for x in losses], "evals": [], "before": before,
            "after": {n: before[n] - update[n] for n in before}}


def test_the_trainer_judge_widens_only_what_follows_a_backward() -> None:
    """:func:`judge_trainer` of a wired case: updates off by a tenth of the bound and a second step's loss off by
    1e-3 relative are exact (the exact judge calls both WRONG); the first step's loss off by 1e-4 relative is WRONG
    (a forward before any backward), as a doubled update is. Seen failing: every logged number at the bound (the
    first step's moved loss passed)."""
    draws = {"trainer": "trainer", "steps": 2, "max_grad_norm": 0.0, "model_type": "llama", "sp": 2,
             "dkv_wire": "bf16", "peft": False}
    g = torch.Generator().manual_seed(7)
    before = {"a": torch.randn(8, 4, generator=g, dtype=torch.float64),
              "b": torch.randn(6, generator=g, dtype=torch.float64)}
    update = {"a": 0.1 * torch.randn(8, 4, generator=g, dtype=torch.float64),
              "b": 1e-3 * torch.randn(6, generator=g, dtype=torch.float64)}
    ref = _trainer_result(before, update, [3.0, 2.5])
    near = {n: u * (1 + 0.1 * kind_dkv_wire_bound(2, fuzz_models.decoder_layers("llama"))) for n, u in update.items()}
    got = _trainer_result(before, near, [3.0, 2.5 * (1 + 1e-3)])
    assert fuzz_trainers_run.judge_trainer(draws, ref, [got])[0] == "exact"
    assert fuzz_trainers_run.judge_trainer({**draws, "dkv_wire": None}, ref, [got])[0] == "WRONG"
    moved = _trainer_result(before, update, [3.0 * (1 + 1e-4), 2.5])
    verdict, detail = fuzz_trainers_run.judge_trainer(draws, ref, [moved])
    assert verdict == "WRONG" and "step 1: loss" in detail, detail
    doubled = _trainer_result(before, {**update, "b": 2 * update["b"]}, [3.0, 2.5])
    verdict, detail = fuzz_trainers_run.judge_trainer(draws, ref, [doubled])
    assert verdict == "WRONG" and "update of b" in detail, detail


@pytest.mark.parametrize("kind", ["attention", "dilated"])
def test_disagreeing_shapes_are_drawn_where_they_can_be(kind: str) -> None:
    """``disagree_shape`` is drawn only at P >= 2 with ``check_inputs`` on, one SP group and no older disagreement,
    in about :data:`~seqpar.testing.fuzz_attention.DISAGREE_SHAPE_RATE` of those, every option reached; a forced
    ``check_inputs=false`` or ``world=1`` drops it; the summary says so. Seen failing: with
    ``DISAGREE_SHAPE_RATE = 0`` (nothing drawn)."""
    draws = _draws(kind, 2500)
    can = [d for d in draws if d["world"] >= 2 and d["check_inputs"] and d.get("group") in (None, "world")
           and not d.get("disagree") and not d.get("disagree_input")]
    drawn = [d for d in can if d["disagree_shape"]]
    assert all(d["disagree_shape"] is None for d in draws if d not in can)
    options = DILATED_DISAGREE_INPUTS if kind == "dilated" else DISAGREE_SHAPES
    assert 0.07 < len(drawn) / len(can) < 0.17 and {d["disagree_shape"] for d in drawn} == set(options), len(drawn)
    for d in drawn:
        assert input_disagreement(d) == d["disagree_shape"]
        assert f"disagree-input={d['disagree_shape']}" in fuzz.summary(d)
        assert input_disagreement(fuzz.force(d, {"check_inputs": False})[0]) is None
        assert input_disagreement(fuzz.force(d, {"world": 1})[0]) is None


def test_each_disagreeing_shape_is_the_one_named() -> None:
    """``heads`` takes one K/V head and its query heads away (GQA), one query head (MQA), doubles a single head;
    ``head_dim`` changes q's and k's last size only; ``dtype`` swaps float32 and float64. Seen failing: ``heads``
    dropping one query head under GQA (4 query heads over 2 K/V heads left 3 over 1: q's size asserted 2)."""
    def x(h: int, d: int = 4, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(2, h, 5, d, dtype=dtype)

    q, k, v, o, _ = disagreeing_inputs("heads", x(4), x(2), x(2), x(4), None, 10)
    assert [t.shape[1] for t in (q, k, v, o)] == [2, 1, 1, 2]
    q, k, v, o, _ = disagreeing_inputs("heads", x(4), x(1), x(1), x(4), None, 10)
    assert [t.shape[1] for t in (q, k, v, o)] == [3, 1, 1, 3]
    q, k, v, o, _ = disagreeing_inputs("heads", x(1), x(1), x(1), x(1), None, 10)
    assert [t.shape[1] for t in (q, k, v, o)] == [2, 2, 2, 2]
    q, k, v, o, _ = disagreeing_inputs("head_dim", x(4), x(2), x(2, 6), x(4, 6), None, 10)
    assert [t.shape[-1] for t in (q, k, v, o)] == [3, 3, 6, 6]
    q, k, v, o, _ = disagreeing_inputs("head_dim", x(4, 1), x(2, 1), x(2, 1), x(4, 1), None, 10)
    assert [t.shape[-1] for t in (q, k, v, o)] == [2, 2, 1, 1]
    for dtype, other in ((torch.float32, torch.float64), (torch.float64, torch.float32)):
        out = disagreeing_inputs("dtype", x(4, dtype=dtype), x(2, dtype=dtype), x(2, dtype=dtype), x(4, dtype=dtype),
                                 None, 10)
        assert {t.dtype for t in out[:4]} == {other}


class _EveryRankRan:
    """A stand-in rank pool whose ranks all return ok (no refusal), without running anything."""

    def run(self, world: int, task: object, *args: object, **kwargs: object) -> list:
        return [{"ok": True, "calls": []} for _ in range(world)]


@pytest.mark.parametrize("kind", ["attention", "dilated"])
def test_a_disagreeing_shape_that_ran_is_wrong(kind: str) -> None:
    """A case whose last rank passed another shape and whose ranks all ran is WRONG, "no refusal", before any
    reference. Seen failing: ``input_disagreement`` reading ``disagree_input`` only (the stand-in's empty results
    went on to the reference: "crash ... driver")."""
    draws = next(d for d in _draws(kind, 2500) if d["disagree_shape"])
    rec = fuzz.run_case(_EveryRankRan(), draws)
    assert rec["verdict"] == "WRONG" and "no refusal" in rec["detail"], rec["detail"]
    assert draws["disagree_shape"] in rec["detail"]
