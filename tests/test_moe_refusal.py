"""MoE router losses are shard-local under SP today (issue 19 §2), so seqpar refuses them by name instead
of training on a silently wrong loss: at swap time from the config, and per batch from the forward's
``output_router_logits=True``. With router losses off, a Mixtral trains exactly (tested elsewhere)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from seqpar.swap import SwapError, swap_attention  # noqa: E402


def _tiny_mixtral(**overrides: object):  # noqa: ANN202
    config = transformers.MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=128,
        router_jitter_noise=0.0, **overrides,
    )
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(config)


def test_router_logits_in_the_config_are_refused_at_swap_time() -> None:
    model = _tiny_mixtral(output_router_logits=True)
    with pytest.raises(SwapError) as e:
        swap_attention(model, {"size": 1})
    assert "MixtralForCausalLM" in str(e.value) and "output_router_logits" in str(e.value), e.value


def test_router_logits_asked_in_the_forward_are_refused() -> None:
    model = _tiny_mixtral(output_router_logits=False)
    swap_attention(model, {"size": 1})
    ids = torch.randint(0, 64, (1, 16))
    out = model(input_ids=ids, labels=ids)  # router losses off: runs
    assert torch.isfinite(out.loss)
    with pytest.raises(ValueError, match="output_router_logits=True"):
        model(input_ids=ids, labels=ids, output_router_logits=True)
