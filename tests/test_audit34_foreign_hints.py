"""The foreign-name refusals name only what the entry takes (audit 34).

Each hint's ``pass NAME=`` must be a keyword of the function that raised it: a hint naming a keyword the entry does
not take sends the migrating user from one TypeError to another. ``seqpar.attention``'s and
``seqpar.dilated_attention``'s tables differ (``window=`` is the first's only, ``segment_lengths=`` the second's), so
each is checked against its own signature, value-worked hints included; and Megatron's ``a2a+p2p`` names the a2a
degree it needs (``init_process_groups(ulysses_size=)``), which the other modes do not.

Seen failing (mut34): F11 (dilated's ``dilated_ratio`` hint saying ``pass dilation_rate=``) -> "seqpar.dilated_attention
hint for 'dilated_ratio' names dilation_rate=, not a keyword of it"; F13 (dilated's table given seqpar.attention's
``window`` hint) -> dilated_attention refusing seqpar.attention's own window= as another library's; F7 (``ulysses_size`` said for ``a2a`` instead of ``a2a+p2p``) ->
the hybrid assertion.
"""

from __future__ import annotations

import inspect
import re

import pytest
import torch

import seqpar
from seqpar.attn.foreign import ATTENTION_FOREIGN_KEYWORDS, DILATED_FOREIGN_KEYWORDS


def _refused(fn, **kwargs) -> str:  # noqa: ANN001
    q = k = v = torch.randn(1, 2, 8, 4, dtype=torch.float64)
    with pytest.raises(TypeError, match="another library's argument name") as e:
        fn(q, k, v, **kwargs)
    return str(e.value)


def _passed_names(message: str) -> set[str]:
    return set(re.findall(r"pass (\w+)=", message))


@pytest.mark.parametrize("fn, table", [(seqpar.attention, ATTENTION_FOREIGN_KEYWORDS),
                                       (seqpar.dilated_attention, DILATED_FOREIGN_KEYWORDS)],
                         ids=["attention", "dilated_attention"])
def test_each_hint_names_only_the_entrys_own_keywords(fn, table) -> None:  # noqa: ANN001
    own = set(inspect.signature(fn).parameters)
    for name in table:
        message = _refused(fn, **{name: 1})
        assert f"got {name}=" in message, message
        for said in _passed_names(message):
            assert said in own, f"{fn.__name__} hint for {name!r} names {said}=, not a keyword of it: {message}"


def test_value_worked_hints_name_only_attentions_keywords() -> None:
    own = set(inspect.signature(seqpar.attention).parameters)
    said: set[str] = set()
    for window_size in ((3, 0), (-1, -1), (2, 2), (-1, 0), (1, 3)):
        for causal in (True, False):
            said |= _passed_names(_refused(seqpar.attention, window_size=window_size, causal=causal))
    for mode in ("p2p", "all_gather", "a2a", "a2a+p2p", "bogus"):
        said |= _passed_names(_refused(seqpar.attention, cp_comm_type=mode))
    assert said and said <= own, said - own
    assert {"window", "causal", "mode"} <= said, said


def test_only_the_hybrid_mode_names_the_a2a_degree() -> None:
    hybrid = _refused(seqpar.attention, cp_comm_type="a2a+p2p")
    assert "pass mode='hybrid'" in hybrid and "init_process_groups(ulysses_size=" in hybrid, hybrid
    for mode in ("p2p", "all_gather", "a2a"):
        assert "ulysses_size" not in _refused(seqpar.attention, cp_comm_type=mode), mode


def test_seqpar_attentions_own_keywords_get_pythons_message_from_dilated_attention() -> None:
    """seqpar.attention's keywords that dilated_attention does not take (``window=``, ``cu_seqlens=``, ...) are no
    other library's: dilated_attention leaves them to Python's "unexpected keyword argument", as any unknown name
    (``layout=`` excepted: its own table names the layout it takes)."""
    q = k = v = torch.randn(1, 2, 8, 4, dtype=torch.float64)
    foreign_to_dilated = set(inspect.signature(seqpar.attention).parameters) - set(
        inspect.signature(seqpar.dilated_attention).parameters)
    assert {"window", "cu_seqlens"} <= foreign_to_dilated
    for name in sorted(foreign_to_dilated - set(DILATED_FOREIGN_KEYWORDS)):
        with pytest.raises(TypeError, match="unexpected keyword argument") as e:
            seqpar.dilated_attention(q, k, v, segment_lengths=[8], dilation_rates=[1], **{name: 1})
        assert "another library's" not in str(e.value), (name, str(e.value))
