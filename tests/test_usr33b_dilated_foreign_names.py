"""``seqpar.dilated_attention`` called with another library's argument names (torchscale's LongNet,
dilated-attention-pytorch, flash-attn, context-parallel libraries): a TypeError naming seqpar's form of each, while an
unknown name (a typo of a real argument included) still gets Python's "unexpected keyword argument".

One process: the refusal is made from the arguments alone, before any collective (the wrapper runs before the entry's
body), so a rank that passes the name raises it as every other does."""

from __future__ import annotations

import inspect

import pytest
import torch

import seqpar
from seqpar.attn.foreign import DILATED_FOREIGN_KEYWORDS

# name -> words its message must hold (seqpar's form)
EXPECTED = {
    "softmax_scale": ["scale="], "is_causal": ["causal="], "dropout_p": ["no attention dropout"],
    "attention_dropout": ["no attention dropout"], "dropout": ["no attention dropout"],
    "segment_length": ["segment_lengths=", "[2048, 4096]"], "dilated_ratio": ["dilation_rates="],
    "dilation_rate": ["dilation_rates="], "seq_parallel": ["group="], "op": ["leave it out"],
    "attn_mask": ["segment_lengths=", "dilation_rates="], "key_padding_mask": ["not supported"],
    "cp_group": ["group="], "process_group": ["group="], "sequence_process_group": ["group="],
    "cp_comm_type": ["mode=", "'ring'"], "layout": ["transpose(1, 2)"], "return_attn_probs": ["not supported"],
}
PATTERN = {"segment_lengths": [4, 8], "dilation_rates": [1, 2]}


def _qkv(seq: int = 8, heads: int = 2, dim: int = 4, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, heads, seq, dim, generator=g, dtype=torch.float64) for _ in range(3))


def _refused(*args: object, **kwargs: object) -> str:
    q, k, v = _qkv()
    with pytest.raises(TypeError) as e:
        seqpar.dilated_attention(q, k, v, *args, **kwargs)
    return str(e.value)


def test_every_known_foreign_keyword_names_seqpars_form() -> None:
    assert set(EXPECTED) == set(DILATED_FOREIGN_KEYWORDS)  # a name added to the table gets its words here
    for name, words in EXPECTED.items():
        message = _refused(**PATTERN, **{name: 0.0})
        assert message.startswith(f"seqpar.dilated_attention() got {name}=, another library's argument name"), message
        for w in words:
            assert w in message, (name, w, message)


def test_a_foreign_keyword_is_refused_without_the_pattern_and_unknown_names_get_pythons_message() -> None:
    # the wrapper runs before the signature binds: the foreign name is named, not the missing segment_lengths
    assert "pass scale=" in _refused(softmax_scale=0.5)
    for typo in ("casual", "segment_lenghts", "dilation_rate_", "foo"):
        message = _refused(**PATTERN, **{typo: 1})
        assert message == f"dilated_attention() got an unexpected keyword argument '{typo}'", message


def test_the_signature_is_unchanged_and_no_foreign_name_shadows_a_real_one() -> None:
    params = inspect.signature(seqpar.dilated_attention).parameters
    assert all(p.kind is not inspect.Parameter.VAR_KEYWORD for p in params.values())
    assert list(params)[:5] == ["q", "k", "v", "segment_lengths", "dilation_rates"]
    assert params["causal"].default is False and params["mode"].default == "ring"
    assert not set(DILATED_FOREIGN_KEYWORDS) & set(params)


def test_dilated_attention_pytorchs_positional_is_causal_is_refused_naming_keywords() -> None:
    message = _refused(True, **PATTERN)  # DilatedAttention.forward(query, key, value, is_causal)
    assert "4th is is_causal" in message and "by keyword" in message, message


def test_a_foreign_keyword_reaches_a_fullgraph_caller_as_eagers_type_error() -> None:
    """Traced by dynamo, the refusal is deferred to the graph's run (seqpar.attn.ops) and raised there as the eager
    TypeError, its text whole; the call written with seqpar's names compiles and equals eager."""
    q, k, v = _qkv()
    eager = _refused(causal=True, softmax_scale=0.5, **PATTERN)

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return seqpar.dilated_attention(q, k, v, causal=True, softmax_scale=0.5, **PATTERN)

    with pytest.raises(TypeError) as e:
        torch.compile(call, fullgraph=True, backend="eager")(q, k, v)
    assert str(e.value) == eager
    ok = torch.compile(lambda q, k, v: seqpar.dilated_attention(q, k, v, causal=True, scale=0.5, **PATTERN),
                       fullgraph=True, backend="eager")
    torch.testing.assert_close(ok(q, k, v), seqpar.dilated_attention(q, k, v, causal=True, scale=0.5, **PATTERN),
                               rtol=0, atol=0)
