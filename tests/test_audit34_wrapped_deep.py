"""A transformers model two wrappers deep (a user's module around a PEFT-style holder around the model) is probed
under ``swap="sdpa"`` as the model itself is, naming its modules (audit 34, on mut33b's wrapper probe): PEFT's own
``PeftModelForCausalLM`` holds the transformers model two levels down (``base_model.model``), so a user's wrapper
around it is three.

Seen failing (mut34): W1 (only the wrapper and its children searched for a ``PreTrainedModel``) -> the bare
"found nothing to swap", no module named.
"""

from __future__ import annotations

import pytest
import torch
from all_models import refusal_reason
from torch import nn

from seqpar.swap import SwapError, swap_attention
from seqpar.testing.tiny_models import build_model


class _Holder(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.model = inner

    def forward(self, **kwargs):
        return self.model(**kwargs)


def _refusal(model: nn.Module) -> str:
    with pytest.raises(SwapError) as refused:
        swap_attention(model, {"size": 1, "swap": "sdpa"})
    return str(refused.value)


def test_a_model_two_wrappers_deep_is_refused_as_the_model_is() -> None:
    torch.manual_seed(0)
    direct = _refusal(build_model("rwkv", torch.float32))
    torch.manual_seed(0)
    wrapped = _refusal(_Holder(_Holder(build_model("rwkv", torch.float32))))
    assert "found nothing to swap in _Holder" in wrapped, wrapped
    assert "its output changed" in wrapped and "'model.model." in wrapped, wrapped
    assert refusal_reason(wrapped) == refusal_reason(direct), (wrapped, direct)
