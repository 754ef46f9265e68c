"""Session 32's migrating user swaps attention in Hugging Face models that seqpar cannot route: docs/models.md's
all-models table and the swap's refusal must say the same true thing, whichever route the user names.

RWKV (a linear-attention WKV and a time-shift pad), xGLM, GPT-NeoX-Japanese and XLNet (softmax attention whose
scores the model computes in its own code, not through transformers' attention interface or
F.scaled_dot_product_attention) are refused at swap time. The table listed them as "mixes positions outside
attention (state space, linear attention, convolution)", false for the three that are attention; and with
``swap="sdpa"`` the refusal said only "found nothing to swap ... Set sequence_parallel.swap to a route or to class
names", naming no module and no reason (the position-mixing probe ran for the "hf" route only)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from all_models import MIXES_POSITIONS, refusal_reason

from seqpar.swap import SwapError, swap_attention
from seqpar.testing.tiny_models import build_model

PAGE = Path(__file__).resolve().parents[1] / "docs" / "models.md"
MODELS = ("rwkv", "xglm", "gpt_neox_japanese", "xlnet")


def _docs_row(model_type: str) -> tuple[str, str]:
    """``(reason, refused class)`` docs/models.md's refusal table gives ``model_type``."""
    for line in PAGE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2:
            m = re.search(rf"(?:^|, ){re.escape(model_type)} \((\w+)\)", cells[1])
            if m:
                return cells[0], m.group(1)
    raise AssertionError(f"docs/models.md lists no refusal for {model_type}")


@pytest.mark.parametrize("swap", ["auto", "sdpa"])
@pytest.mark.parametrize("model_type", MODELS)
def test_the_refusal_says_what_the_docs_say(model_type: str, swap: str) -> None:
    """Every route refuses the model at swap time with the probe's message, which names the module the docs name
    and the reason the docs give (the docs' reason is ``all_models.refusal_reason`` of this message), and the
    reason covers attention computed in a model's own code. Seen failing: with ``swap="sdpa"`` every model's
    message was "found nothing to swap" alone (no module, reason "no attention seqpar can route", not the docs'
    row); with ``"auto"`` the docs' reason read "outside attention (state space, linear attention, convolution)"
    for xGLM / GPT-NeoX-Japanese / XLNet, whose refused modules are their attention."""
    reason, cls = _docs_row(model_type)
    assert reason == MIXES_POSITIONS
    torch.manual_seed(0)
    model = build_model(model_type, torch.float32)
    with pytest.raises(SwapError) as refused:
        swap_attention(model, {"size": 1, "swap": swap})
    message = str(refused.value)
    assert "found nothing to swap" in message and f"({cls}): its output changed" in message, message
    assert refusal_reason(message) == (reason, cls), message
    assert "an attention whose scores the model computes in its own code" in message, message
