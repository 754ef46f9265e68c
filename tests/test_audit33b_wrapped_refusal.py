"""A user's wrapper around a transformers model seqpar cannot route is refused with the probe's message, naming
the modules, under ``swap="sdpa"`` as the model itself is (mut33b). The H6 mutant (any model probed) survived
session 32's tests, which showed that the probe's condition (``isinstance(model, PreTrainedModel)``) was too
narrow: a wrapper's ``swap="sdpa"`` refusal said only "found nothing to swap", naming no module and no reason."""

from __future__ import annotations

import pytest
import torch
from all_models import refusal_reason
from torch import nn

from seqpar.swap import SwapError, swap_attention
from seqpar.testing.tiny_models import build_model


class _Wrapper(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, **kwargs):
        return self.inner(**kwargs)


def _refusal(model: nn.Module, swap: str) -> str:
    with pytest.raises(SwapError) as refused:
        swap_attention(model, {"size": 1, "swap": swap})
    return str(refused.value)


@pytest.mark.parametrize("swap", ["sdpa", "mha"])
@pytest.mark.parametrize("model_type", ["rwkv", "xglm"])
def test_a_wrapped_model_is_refused_as_the_model_is(model_type: str, swap: str) -> None:
    torch.manual_seed(0)
    direct = _refusal(build_model(model_type, torch.float32), swap)
    torch.manual_seed(0)
    wrapped = _refusal(_Wrapper(build_model(model_type, torch.float32)), swap)
    assert "found nothing to swap in _Wrapper" in wrapped, wrapped
    assert "its output changed" in wrapped and "'inner." in wrapped, wrapped
    assert refusal_reason(wrapped) == refusal_reason(direct), (wrapped, direct)
