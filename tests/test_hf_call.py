""":mod:`seqpar.swap.hf_call`: what the eager and the traced ``"hf"`` preparers both read from a call's arguments
(the reference tensor and the KV-cache refusal), checked on plain dicts; the eager preparer's refusal through a
model is tests/test_swap.py's ``test_padding_and_packed_sequences_refused_at_call_time``."""

from __future__ import annotations

import pytest
import torch

from seqpar.swap.hf_call import reference_input, refuse_cache


def test_the_reference_is_input_ids_else_inputs_embeds() -> None:
    ids, embeds = torch.zeros(2, 8, dtype=torch.long), torch.randn(2, 8, 4)
    assert reference_input({"input_ids": ids, "inputs_embeds": embeds}) is ids
    assert reference_input({"input_ids": None, "inputs_embeds": embeds}) is embeds
    assert reference_input({"input_ids": torch.zeros(8, dtype=torch.long)}) is None  # one dim: left alone
    assert reference_input({"input_ids": [[1, 2]]}) is None


def test_a_cache_is_refused_and_use_cache_turned_off() -> None:
    """Seen failing: with refuse_cache's ``arguments["use_cache"] = False`` removed (use_cache stayed None, and
    transformers would build a cache of the shard)."""
    with pytest.raises(ValueError, match=r"seqpar \(Llama\): past_key_values given; .*\(generate with the unswapped"):
        refuse_cache({"past_key_values": object()}, ("use_cache",), "Llama")
    with pytest.raises(ValueError, match=r"seqpar \(Llama\): use_cache=True is not supported .* pass use_cache=False"):
        refuse_cache({"use_cache": True}, ("use_cache",), "Llama")
    arguments = {"use_cache": None}
    refuse_cache(arguments, ("use_cache",), "Llama")
    assert arguments == {"use_cache": False}
    arguments = {}
    refuse_cache(arguments, (), "Llama")  # a forward without use_cache gets none
    assert arguments == {}
