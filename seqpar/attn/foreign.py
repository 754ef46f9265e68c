"""Other libraries' argument names at a public attention entry: a TypeError naming seqpar's form of each.

:func:`foreign_keyword_refuser` builds the wrapper for one entry from its own table (name -> seqpar's form, or a
function of the value that works the form out), so entries whose arguments differ (``seqpar.attention``'s
``window=``, ``cu_seqlens=`` ... against ``seqpar.dilated_attention``'s ``segment_lengths=``, ``dilation_rates=``)
each name only the arguments they take. :data:`DILATED_FOREIGN_KEYWORDS` is ``seqpar.dilated_attention``'s table
(docs/names.md).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

__all__ = ["DILATED_FOREIGN_KEYWORDS", "foreign_keyword_refuser"]

F = TypeVar("F", bound=Callable[..., Any])

# what a caller migrating from torchscale's LongNet (DilatedAttention / its config: segment_length, dilated_ratio,
# seq_parallel), dilated-attention-pytorch (softmax_scale, attention_dropout, op, is_causal), flash-attn or a
# context-parallel library passes to seqpar.dilated_attention, and seqpar's form of it
_GROUP = "pass group= (the SP process group; None: the default manager's)"
DILATED_FOREIGN_KEYWORDS: dict[str, str] = {
    "softmax_scale": "pass scale= (the same score multiplier; default head_dim ** -0.5, as theirs)",
    "is_causal": "pass causal= (causal within each sparsified segment)",
    "dropout_p": "seqpar.dilated_attention has no attention dropout: leave it out (0.0 is what it computes)",
    "attention_dropout": "seqpar.dilated_attention has no attention dropout: leave it out (0.0 is what it computes)",
    "dropout": "seqpar.dilated_attention has no attention dropout: leave it out (0.0 is what it computes)",
    "segment_length": "pass segment_lengths= (a list, one per pattern, in global positions; torchscale's string "
                      "'[2048,4096]' is segment_lengths=[2048, 4096])",
    "dilated_ratio": "pass dilation_rates= (a list, one per pattern; torchscale's string '[1,2]' is "
                     "dilation_rates=[1, 2])",
    "dilation_rate": "pass dilation_rates= (a list, one per pattern)",
    "seq_parallel": "leave it out: group= (or the default manager's SP group) decides the ranks; one rank runs "
                    "without communication",
    "op": "leave it out: seqpar.dilated_attention chooses its kernels (torch's SDPA pieces)",
    "attn_mask": "a dense mask has no seqpar form: dilated attention's structure is segment_lengths=, "
                 "dilation_rates= and causal=",
    "key_padding_mask": "not supported: seqpar.dilated_attention has no padding mask (pack documents into whole "
                        "segments instead)",
    "cp_group": _GROUP,
    "process_group": _GROUP,
    "sequence_process_group": _GROUP,
    "cp_comm_type": "pass mode= ('p2p' is 'ring', 'all_gather' 'allgather'; dilated attention has no a2a modes)",
    "layout": "seqpar.dilated_attention takes (batch, heads, seq_local, head_dim) only: pass x.transpose(1, 2) "
              "for a (batch, seq, heads, dim) tensor (dilated-attention-pytorch's layout)",
    "return_attn_probs": "not supported: seqpar.dilated_attention returns the output only; leave it out",
}


def foreign_keyword_refuser(
    entry: str,
    hints: Mapping[str, str],
    *,
    value_hints: Mapping[str, Callable[[object, Mapping[str, Any]], str]] | None = None,
    positional: int = 3,
    positional_hint: str = "",
) -> Callable[[F], F]:
    """A decorator: ``fn``'s call with a name of ``hints`` (or of ``value_hints``, whose function gets the value and
    the call's keywords) raises a TypeError ``"<entry>() got <name>=, another library's argument name: <hint>"``,
    and with more than ``positional`` positional arguments one saying the options are keyword-only
    (``positional_hint`` says whose positional option that was). Any other name is passed on, so a typo still gets
    Python's "unexpected keyword argument"; ``inspect.signature`` shows ``fn``'s. Raised before any collective, from
    the arguments alone: the same on every rank that passes them."""
    by_value = dict(value_hints or {})

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if len(args) > positional:
                raise TypeError(
                    f"{entry}() takes q, k, v positionally and its options by keyword; got {len(args)} positional "
                    f"arguments{positional_hint}: pass them by name (see docs/names.md)"
                )
            for name in kwargs:
                hint = by_value[name](kwargs[name], kwargs) if name in by_value else hints.get(name)
                if hint is not None:
                    raise TypeError(f"{entry}() got {name}=, another library's argument name: {hint} "
                                    "(docs/names.md)")
            return fn(*args, **kwargs)

        return call  # type: ignore[return-value]

    return wrap
