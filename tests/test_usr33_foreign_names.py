"""``seqpar.attention`` called with another library's argument names (flash-attn, ring-flash-attn, Megatron-LM /
TransformerEngine context parallelism, SDPA, transformers): a TypeError naming seqpar's form of each, while an
unknown name (a typo of a real argument included) still gets Python's "unexpected keyword argument".

One process: the refusal is made from the arguments alone, before any collective and before the call is resolved,
so a rank that passes the name raises it as every other does (the ranks of an SP group call alike or the
cross-rank check refuses their call). The window translations are checked by running them: seqpar's suggested
``window=`` against flash-attn's ``window_size`` rule applied to a float64 reference."""

from __future__ import annotations

import inspect
import re

import pytest
import torch

import seqpar
from seqpar.attn.dispatch import FOREIGN_KEYWORDS
from seqpar.attn.resolve import resolve_attention

# name -> words its message must hold (seqpar's form)
EXPECTED = {
    "softmax_scale": ["scale="], "dropout_p": ["no attention dropout", "leave dropout_p out"],
    "deterministic": ["leave it out"], "return_attn_probs": ["not supported", "output only"],
    "return_softmax_lse": ["not supported"], "cu_seqlens_q": ["cu_seqlens=", "[0, ..., S]"],
    "cu_seqlens_k": ["cu_seqlens="], "max_seqlen": ["leave it out"], "max_seqlen_q": ["leave it out"],
    "max_seqlen_k": ["leave it out"], "heads_k_stride": ["head_chunks=", "mode='allgather'"],
    "local_k_slice": ["leave it out"], "cp_group": ["group="], "process_group": ["group="],
    "sequence_process_group": ["group="], "cp_global_ranks": ["leave it out"], "cp_stream": ["leave it out"],
    "is_causal": ["causal="], "attn_mask": ["causal=", "window=", "cu_seqlens="], "enable_gqa": ["leave it out"],
    "attn_mask_type": ["causal=True"], "qkv_format": ["layout='bshd'"], "sliding_window": ["window="],
    "s_aux": ["sinks="], "block_table": ["not supported"],
    "attention_mask": ["padding mask", "cu_seqlens=", "shard_batch"],
    "key_padding_mask": ["padding mask", "cu_seqlens=", "shard_batch"],
}


def _qkv(seq: int = 12, heads: int = 2, dim: int = 4, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, heads, seq, dim, generator=g, dtype=torch.float64) for _ in range(3))


def _refused(**kwargs: object) -> str:
    q, k, v = _qkv()
    with pytest.raises(TypeError) as e:
        seqpar.attention(q, k, v, **kwargs)
    return str(e.value)


def test_every_known_foreign_keyword_names_seqpars_form() -> None:
    assert set(EXPECTED) == set(FOREIGN_KEYWORDS)  # a name added to the table gets its words here
    for name, words in EXPECTED.items():
        message = _refused(**{name: 0.0})
        assert f"got {name}=" in message and "another library's argument name" in message, message
        for w in words:
            assert w in message, (name, w, message)


def test_a_foreign_keyword_is_refused_beside_valid_ones_and_unknown_names_get_pythons_message() -> None:
    assert "pass scale=" in _refused(causal=True, softmax_scale=0.5, mode="ring")
    for typo in ("casual", "scal", "windw", "head_chunk", "cu_seqlen", "foo"):
        message = _refused(**{typo: 1})
        assert message == f"attention() got an unexpected keyword argument '{typo}'", message


def test_the_signature_is_unchanged() -> None:
    """The real arguments and their defaults (resolve_attention's, which the entry passes on), no ``**kwargs``, and
    no foreign name shadowing a real one."""
    params = inspect.signature(seqpar.attention).parameters
    assert all(p.kind is not inspect.Parameter.VAR_KEYWORD for p in params.values())
    want = inspect.signature(resolve_attention).parameters
    assert list(params) == list(want)
    assert all(params[n].default == want[n].default and params[n].kind == want[n].kind for n in params)
    assert not set(FOREIGN_KEYWORDS) & set(params) and not {"window_size", "cp_comm_type"} & set(params)


def test_flash_attn_positional_options_are_refused_naming_keywords() -> None:
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="4th is dropout_p") as e:
        seqpar.attention(q, k, v, 0.0, None, True)  # flash_attn_func(q, k, v, dropout_p, softmax_scale, causal)
    assert "by keyword" in str(e.value)


def test_cp_comm_type_names_the_mode() -> None:
    for theirs, ours in (("p2p", "ring"), ("all_gather", "allgather"), ("a2a", "ulysses"), ("a2a+p2p", "hybrid")):
        assert f"pass mode='{ours}'" in _refused(cp_comm_type=theirs), theirs
    assert "'a2a+p2p' 'hybrid'" in _refused(cp_comm_type="bogus")
    # the hybrid's a2a degree is the groups' (tst34: the hint's second half was not asserted)
    assert "init_process_groups(ulysses_size=u)" in _refused(cp_comm_type="a2a+p2p")
    assert "ulysses_size" not in _refused(cp_comm_type="a2a")


def _flash_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, left: int, right: int,
                     causal: bool) -> torch.Tensor:
    """flash-attn's rule in float64: key j is seen by query i iff -left <= j - i <= right (-1: unbounded); causal
    takes right as 0."""
    s = q.shape[2]
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    right = 0 if causal else right
    seen = torch.ones(s, s, dtype=torch.bool)
    if left >= 0:
        seen &= j - i >= -left
    if right >= 0:
        seen &= j - i <= right
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return torch.softmax(scores.masked_fill(~seen, float("-inf")), -1) @ v


@pytest.mark.parametrize(("window_size", "causal"), [((3, 0), True), ((5, 7), True), ((0, 0), True), ((2, 2), False),
                                                     ((4, 4), False), ((-1, -1), False), ((-1, -1), True),
                                                     ((-1, 0), False)])
def test_the_window_size_translation_runs_flash_attns_window(window_size: tuple[int, int], causal: bool) -> None:
    """The message's suggestion, run: equal to flash-attn's window rule on one process in float64."""
    message = _refused(window_size=window_size, causal=causal)
    found = re.search(r"pass window=(\d+)", message)
    kwargs: dict = {"causal": causal}
    if found:
        kwargs["window"] = int(found.group(1))
    elif "pass causal=True" in message:
        kwargs["causal"] = True
    else:
        assert "leave window out" in message, message
    q, k, v = _qkv(seed=sum(window_size) + 10 * causal)
    got = seqpar.attention(q, k, v, **kwargs)
    want = _flash_reference(q, k, v, *window_size, causal)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_an_asymmetric_window_size_has_no_seqpar_form() -> None:
    message = _refused(window_size=(3, 1))
    assert "has no seqpar form" in message and "window=left + 1" in message, message
    assert "window=left + 1" in _refused(window_size="wide")  # not a pair of ints: the general rule


def test_a_foreign_keyword_reaches_a_fullgraph_caller_as_eagers_type_error() -> None:
    """Traced by dynamo (as the compile tests trace ``seqpar.attention``): the refusal is deferred to the graph's run
    (seqpar.attn.ops.refusal) and raised there as the eager TypeError, its text whole; a valid call compiles."""
    q, k, v = _qkv()
    eager = _refused(softmax_scale=0.5)

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return seqpar.attention(q, k, v, causal=True, softmax_scale=0.5)

    with pytest.raises(TypeError) as e:
        torch.compile(call, fullgraph=True, backend="eager")(q, k, v)
    assert str(e.value) == eager
    ok = torch.compile(lambda q, k, v: seqpar.attention(q, k, v, causal=True, scale=0.5), fullgraph=True,
                       backend="eager")
    torch.testing.assert_close(ok(q, k, v), seqpar.attention(q, k, v, causal=True, scale=0.5), rtol=0, atol=0)
