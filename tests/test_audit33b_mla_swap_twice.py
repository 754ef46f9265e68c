"""Swapping an MLA model twice (a second ``swap_attention`` on the same model is accepted) keeps kv_b_proj's own
forward once (mut33b, L6: with ``_prepare_projection`` not idempotent, the second swap stored the first wrapper as
"the own forward", which then called itself: RecursionError on the first forward). The twice-swapped model's loss
and every gradient equal a float64 one-process model without seqpar holding the same weights."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_mla_models import VOCAB, tiny_mla  # noqa: E402

from seqpar.swap import swap_attention  # noqa: E402


def _loss_and_grads(model: torch.nn.Module, ids: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return float(loss.detach()), {n: p.grad.detach().clone() for n, p in model.named_parameters()
                                  if p.grad is not None}


def test_a_second_swap_of_an_mla_model_computes_as_the_first() -> None:
    ids = torch.randint(3, VOCAB, (1, 16), generator=torch.Generator().manual_seed(3302))
    ref_loss, ref_grads = _loss_and_grads(tiny_mla("deepseek_v3"), ids)
    model = tiny_mla("deepseek_v3")
    swap_attention(model)
    swap_attention(model)
    loss, grads = _loss_and_grads(model, ids)
    # transformers' loss casts float64 logits to float32 (as in test_house32_deepcopy_mla)
    assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss), (loss, ref_loss)
    assert set(grads) == set(ref_grads) and any("kv_b_proj" in n for n in grads), sorted(grads)
    for name, ref in ref_grads.items():
        scale = float(ref.abs().max()) or 1.0
        err = float((grads[name] - ref).abs().max())
        assert err <= 1e-6 * scale, f"grad of {name} off by {err:.3e} (its largest entry {scale:.3e})"
