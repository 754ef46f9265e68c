"""Tensor parallelism sums the gradient of an MLP activation's own parameters over the TP group.

Apertus' MLP applies XIELU (learnable scalars ``alpha_p``, ``alpha_n``) to ``up_proj``'s output, which the plan's
``colwise`` splits: each TP rank's gradient of the scalars covers its half of the features. The plan says nothing
of ``act_fn``, so each rank kept its partial sum (the fuzzer's case 880891029: tiny Apertus under TP 2, loss
exact, ``alpha_p``'s gradient 60% off, silently). ``apply_tensor_parallel`` now gives such an activation
transformers' ``replicated_with_grad_allreduce`` (``split_feature_activations``).

Seen failing: with the ``split_feature_activations`` call in ``apply_tensor_parallel`` removed,
``test_found_cases[880891029]`` (pinned "exact" in tests/test_fuzz.py) judged WRONG again (alpha_p 60% off);
with ``split_feature_activations`` returning ``{}``, the Apertus case below.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from seqpar.integrations.tp import expand_tp_plan, split_feature_activations  # noqa: E402
from seqpar.testing.tiny_models import build_model  # noqa: E402


def test_apertus_activation_gradients_are_summed_over_tp() -> None:
    model = build_model("apertus", torch.float32)
    layers = model.config.num_hidden_layers
    got = split_feature_activations(model, expand_tp_plan(model, model.tp_plan))
    assert got == {f"model.layers.{i}.mlp.act_fn": "replicated_with_grad_allreduce" for i in range(layers)}
    # without the MLP entries the MLP stays replicated: its activation sees every feature
    plan = {k: v for k, v in model.tp_plan.items() if ".mlp." not in k}
    assert split_feature_activations(model, expand_tp_plan(model, plan)) == {}


@pytest.mark.parametrize("kind", ["llama", "minicpm3", "qwen3"])
def test_other_models_are_unchanged(kind: str) -> None:
    """Parameter-free activations (SiLU), and MiniCPM3's replicated low-rank projections and norms, which see
    the whole replicated input (their gradients are whole on every TP rank: summing would multiply them by tp)."""
    model = build_model(kind, torch.float32)
    assert split_feature_activations(model, expand_tp_plan(model, model.tp_plan)) == {}
