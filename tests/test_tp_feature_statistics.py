"""Tensor parallelism refuses a module that takes a statistic over features the plan splits.

Gemma 3n's MLP with activation sparsity sets its cutoff from the mean and standard deviation of ``gate_proj``'s
output over its features; the plan's ``colwise`` ``gate_proj`` gives each TP rank half of them, so each rank cut
at its own half's statistics (the fuzzer's case 1320238728: TP 2, loss 7.2e-3 off, silently).

Seen failing: with the check in ``apply_tensor_parallel`` removed, ``test_found_cases[1320238728]`` (pinned
"refused" in tests/test_fuzz.py) judged WRONG again; with ``feature_statistics_problem`` returning None, the
cases below.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from seqpar.integrations.tp import expand_tp_plan, feature_statistics_problem  # noqa: E402
from seqpar.testing.tiny_models import build_model  # noqa: E402


def test_gemma3n_activation_sparsity_is_named() -> None:
    model = build_model("gemma3n_text", torch.float32)
    sparse = [f"model.layers.{i}.mlp" for i, p in enumerate(model.config.activation_sparsity_pattern) if p > 0]
    assert sparse, "the tiny Gemma 3n must have sparse layers for this test to mean anything"
    problem = feature_statistics_problem(model, expand_tp_plan(model, model.tp_plan))
    assert problem is not None and str(sparse) in problem and "activation_sparsity_pattern" in problem
    # without the MLP entries every MLP stays replicated: nothing to refuse
    plan = {k: v for k, v in model.tp_plan.items() if ".mlp." not in k}
    assert feature_statistics_problem(model, expand_tp_plan(model, plan)) is None


@pytest.mark.parametrize("kind", ["llama", "gemma3_text"])
def test_other_models_pass(kind: str) -> None:
    model = build_model(kind, torch.float32)
    assert feature_statistics_problem(model, expand_tp_plan(model, model.tp_plan)) is None
