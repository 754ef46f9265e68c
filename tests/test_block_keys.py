"""The engines' option blocks (``'fsdp'``, ``'fairscale'``) refuse an unknown key by naming it, the closest
allowed key and the allowed list: one check (``seqpar.integrations.common.check_block_keys``) for both."""
from __future__ import annotations

import pytest

from seqpar.integrations.fairscale import FairScaleOptions
from seqpar.integrations.fsdp import FSDPOptions


@pytest.mark.parametrize("options, block", [(FSDPOptions, "fsdp"), (FairScaleOptions, "fairscale")])
def test_a_typo_in_an_engine_block_names_the_key_meant(options, block) -> None:
    """Seen failing: FairScale's block said only the allowed list (no "did you mean") before it shared FSDP's check."""
    with pytest.raises(ValueError) as err:
        options.from_dict({"reshard_after_forwrd": True})
    text = str(err.value)
    assert f"unknown key(s) ['reshard_after_forwrd'] in '{block}'" in text, text
    assert "did you mean ['reshard_after_forward']?" in text, text
    assert "allowed keys are [" in text and "'reshard_after_forward'" in text.split("allowed keys are")[1], text


@pytest.mark.parametrize("options", [FSDPOptions, FairScaleOptions])
def test_a_key_far_from_every_allowed_one_gets_no_guess(options) -> None:
    with pytest.raises(ValueError) as err:
        options.from_dict({"zzz": 1})
    assert "did you mean" not in str(err.value) and "allowed keys are" in str(err.value)
