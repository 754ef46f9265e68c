"""fz33's bf16 dK/dV wire judges at their bounds' edges (audit 34), on made-up results as test_fz33_fuzz_draws.py:

- the ``engine`` kind under TP: the wire's hops are the SP group's (``world / (tp_size x dp)``), not
  ``world / dp``: with TP 2 x SP 2 a gradient off by twice the SP-2 bound is WRONG (counting the TP ranks as ring
  hops triples the bound and passes it);
- the ``trainer`` kind: an update is judged at ``min(0.5, steps x bound)`` of its norm (each step's gradient carries
  the wire's error into the parameters): over 4 steps an update off by twice the one-step bound is exact, one off
  by 1.5 x the 4-step allowance WRONG.

Seen failing (mut34): Z2 (``sp = world // dp`` in run_engine_case) -> the far gradients judged exact; Z8
(``min(0.5, bound)``, one step's) -> the near update called WRONG.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from seqpar.testing import fuzz, fuzz_engines_run, fuzz_models, fuzz_trainers_run
from seqpar.testing.fuzz_models import kind_dkv_wire_bound


def _engine_draws_under_tp() -> dict[str, Any]:
    for s in fuzz.case_seeds(1001, 800):
        d = fuzz.draw_case(s, ("engine",))
        if d["dkv_wire"] and d["tp_size"] >= 2 and d["world"] // (d["tp_size"] * d.get("dp", 1)) >= 2:
            return d
    raise AssertionError("no wired engine case under TP with SP >= 2 in 800 seeds")


def test_the_engine_kinds_wire_counts_the_sp_groups_hops_not_the_tp_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    draws = _engine_draws_under_tp()
    sp = draws["world"] // (draws["tp_size"] * draws.get("dp", 1))
    bound = kind_dkv_wire_bound(sp, fuzz_models.decoder_layers(draws["model_type"]))
    # the bound with the TP ranks counted as hops would pass twice the SP group's: the far case tells them apart
    wide = kind_dkv_wire_bound(draws["world"] // draws.get("dp", 1), fuzz_models.decoder_layers(draws["model_type"]))
    assert 0 < 2 * bound < wide, (bound, wide)
    g = torch.Generator().manual_seed(5)
    ref_grads = {"lm_head.weight": torch.randn(16, 4, generator=g, dtype=torch.float64),
                 "k_proj.weight": torch.randn(8, 4, generator=g, dtype=torch.float64)}
    state: dict[str, Any] = {}

    def ranks(pools, d, ref, task, batches, plant, timeout):  # noqa: ANN001, ANN202
        return None, [{"ok": True, "loss": 2.0, "replica": r, "grads": state["grads"]} for r in range(d.get("dp", 1))]

    monkeypatch.setattr(fuzz_models, "case_batches", lambda d: [])
    monkeypatch.setattr(fuzz_models, "run_ranks", ranks)
    monkeypatch.setattr(fuzz_engines_run, "dp_reference", lambda d, b: {
        "ok": True, "dtype": "float64", "losses": [2.0] * d.get("dp", 1), "loss": 2.0, "grads": ref_grads})
    state["grads"] = {n: t * (1 + 0.5 * bound) for n, t in ref_grads.items()}
    assert fuzz_engines_run.run_engine_case(None, draws, 60.0)[0] == "exact"
    state["grads"] = {**ref_grads, "k_proj.weight": ref_grads["k_proj.weight"] * (1 + 2 * bound)}
    verdict, detail = fuzz_engines_run.run_engine_case(None, draws, 60.0)
    assert verdict == "WRONG" and "k_proj.weight" in detail, (bound, detail)


def _trainer_result(before: dict[str, torch.Tensor], update: dict[str, torch.Tensor], losses: list[float]
                    ) -> dict[str, Any]:
    return {"logs": [{"loss": x} for x in losses], "evals": [], "before": before,
            "after": {n: before[n] - update[n] for n in before}}


def test_the_trainer_kinds_updates_are_judged_at_the_steps_bound() -> None:
    steps = 4
    draws = {"trainer": "trainer", "steps": steps, "max_grad_norm": 0.0, "model_type": "llama", "sp": 2,
             "dkv_wire": "bf16", "peft": False}
    bound = kind_dkv_wire_bound(2, fuzz_models.decoder_layers("llama"))
    assert 0 < steps * bound < 0.5 / 1.5
    g = torch.Generator().manual_seed(11)
    before = {"a": torch.randn(8, 4, generator=g, dtype=torch.float64)}
    update = {"a": 0.1 * torch.randn(8, 4, generator=g, dtype=torch.float64)}
    losses = [3.0, 2.9, 2.8, 2.7]
    ref = _trainer_result(before, update, losses)
    near = _trainer_result(before, {"a": update["a"] * (1 + 2 * bound)}, losses)
    verdict, detail = fuzz_trainers_run.judge_trainer(draws, ref, [near])
    assert verdict == "exact", detail
    far = _trainer_result(before, {"a": update["a"] * (1 + 1.5 * steps * bound)}, losses)
    verdict, detail = fuzz_trainers_run.judge_trainer(draws, ref, [far])
    assert verdict == "WRONG" and "update of a" in detail, detail
