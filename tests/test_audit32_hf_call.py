"""``seqpar.swap.hf_call.refuse_cache`` turns ``use_cache`` off for a call that does not pass it (the usual training
call: ``model(input_ids=..., labels=...)``): the bound arguments then hold no ``use_cache`` key, and the forward's
default (``config.use_cache``, True for most models) would build a KV cache of the shard. tests/test_hf_call.py checks
a call passing ``use_cache=None`` only.
"""

from __future__ import annotations

import torch

from seqpar.swap.hf_call import refuse_cache


def test_use_cache_is_turned_off_when_the_call_does_not_pass_it() -> None:
    """A forward taking ``use_cache`` (in ``names``), called without it: ``use_cache=False`` is added; a forward
    without the parameter gets none.

    Seen failing (audit 32): the rule keyed on the call's arguments, ``"use_cache" in arguments`` (H3: nothing
    added, the model's default left to build a cache)."""
    ids = torch.randint(0, 100, (2, 8))
    arguments = {"input_ids": ids}
    refuse_cache(arguments, ("input_ids", "labels", "use_cache"), "Llama")
    assert arguments == {"input_ids": ids, "use_cache": False}
    arguments = {"input_ids": ids}
    refuse_cache(arguments, ("input_ids",), "Llama")
    assert arguments == {"input_ids": ids}
