"""Other libraries' argument names at a public attention entry: a TypeError naming seqpar's form of each.

:func:`foreign_keyword_refuser` builds the wrapper for one entry from its own table (name -> seqpar's form, or a
function of the value that works the form out), so entries whose arguments differ (``seqpar.attention``'s
``window=``, ``cu_seqlens=`` ... against ``seqpar.dilated_attention``'s ``segment_lengths=``, ``dilation_rates=``)
each name only the arguments they take. :data:`ATTENTION_FOREIGN_KEYWORDS` (with flash-attn's ``window_size`` and
Megatron's ``cp_comm_type``, worked out from the value) is ``seqpar.attention``'s table, applied by
:func:`attention_foreign_keywords`; :data:`DILATED_FOREIGN_KEYWORDS` is ``seqpar.dilated_attention``'s (docs/names.md).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

__all__ = ["ATTENTION_FOREIGN_KEYWORDS", "DILATED_FOREIGN_KEYWORDS", "attention_foreign_keywords", "foreign_keyword_refuser"]

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


# What a caller migrating from flash-attn / ring-flash-attn (and its varlen / llama3 functions), Megatron-LM's or
# TransformerEngine's context parallelism, torch's SDPA or a transformers attention function passes, and seqpar's
# form of it (docs/names.md). Python's own "unexpected keyword argument" names none of that; a name absent here still
# gets Python's message (the real signature is unchanged: the wrapper looks names up, it accepts nothing).
_CP_COMM_TYPES = {"p2p": "ring", "all_gather": "allgather", "a2a": "ulysses", "a2a+p2p": "hybrid"}
_GLOBAL_BOUNDS = ("the whole packed sequence's boundaries [0, ..., S] with S = seq_local * P, the same on every rank "
                  "(q and k share them)")
ATTENTION_FOREIGN_KEYWORDS: dict[str, str] = {
    "softmax_scale": "pass scale= (the same score multiplier; default head_dim ** -0.5, as theirs)",
    "dropout_p": "seqpar.attention has no attention dropout: leave dropout_p out (dropout_p=0.0 is what it computes; "
                 "attention dropout > 0 is not supported)",
    "deterministic": "leave it out: seqpar.attention has no such switch (torch's kernels, which it runs, follow "
                     "torch.use_deterministic_algorithms)",
    "return_attn_probs": "not supported: seqpar.attention returns the output only (no probabilities, no softmax_lse); "
                         "leave it out",
    "return_softmax_lse": "not supported: seqpar.attention returns the output only (no softmax_lse); leave it out",
    "cu_seqlens_q": f"pass cu_seqlens= once: {_GLOBAL_BOUNDS}",
    "cu_seqlens_k": f"pass cu_seqlens= once: {_GLOBAL_BOUNDS}",
    "max_seqlen": "leave it out: the lengths come from cu_seqlens",
    "max_seqlen_q": "leave it out: the lengths come from cu_seqlens",
    "max_seqlen_k": "leave it out: the lengths come from cu_seqlens",
    "heads_k_stride": "pass head_chunks=kv_heads // heads_k_stride with mode='allgather' (ring-flash-attn's llama3 "
                      "all-gather of K/V in head groups)",
    "local_k_slice": "leave it out: each rank's share of the keys follows from sharding= and cu_seqlens=",
    "cp_group": "pass group= (the SP process group; None: the default manager's)",
    "process_group": "pass group= (the SP process group; None: the default manager's)",
    "sequence_process_group": "pass group= (the SP process group; None: the default manager's)",
    "cp_global_ranks": "leave it out: group= carries the ranks",
    "cp_stream": "leave it out: seqpar.attention takes no stream",
    "is_causal": "pass causal=",
    "attn_mask": "a dense mask has no seqpar form: pass its structure (causal=, window=, cu_seqlens= for packed "
                 "documents, chunk_size=)",
    "attention_mask": "a padding mask has no seqpar form: pack the unpadded rows into one sequence and pass their "
                      "boundaries as cu_seqlens= (seqpar.sequence.batch.shard_batch builds them from position_ids)",
    "key_padding_mask": "a padding mask has no seqpar form: pack the unpadded rows into one sequence and pass their "
                        "boundaries as cu_seqlens= (seqpar.sequence.batch.shard_batch builds them from position_ids)",
    "enable_gqa": "leave it out: q_heads a multiple of kv_heads is grouped-query attention, always accepted",
    "attn_mask_type": "pass causal=True for 'causal', causal=False for 'no_mask'; padding masks are packed documents "
                      "(cu_seqlens=)",
    "qkv_format": "pass layout='bshd' for 'bshd' (layout='bhsd' is SDPA's); 'sbhd' is x.transpose(0, 1) (a view) with "
                  "layout='bshd'; 'thd' is x.unsqueeze(0) with layout='bshd' and cu_seqlens=",
    "sliding_window": "pass window= (the same count: query i sees key j iff 0 <= i - j < window with causal)",
    "s_aux": "pass sinks= (the (q_heads,) sink logits)",
    "block_table": "not supported: seqpar.attention has no paged KV cache",
}


def _window_size_hint(value: object, kwargs: Mapping[str, Any]) -> str:
    """seqpar's form of flash-attn's ``window_size=(left, right)``: key j is seen iff ``-left <= j - i <= right``
    (-1: unbounded), and with ``causal`` flash-attn takes ``right`` as 0."""
    causal = kwargs.get("causal", False)
    if not (isinstance(value, (tuple, list)) and len(value) == 2 and all(type(x) is int for x in value)):
        return ("flash-attn's window_size=(left, right) is seqpar's window=left + 1 with causal=True, or window=l + 1 "
                "for (l, l) without; (-1, -1) is no window=")
    left, right = value
    if causal is True:
        return "leave window out (causal, no window)" if left < 0 else f"pass window={left + 1} with causal=True"
    if left < 0 and right < 0:
        return "leave window out (no window)"
    if left >= 0 and left == right:
        return f"pass window={left + 1} (keys with |i - j| <= {left})"
    if left < 0 and right == 0:
        return "pass causal=True (no window)"
    return (f"window_size=({left}, {right}) has no seqpar form: seqpar's windows are causal (window=left + 1 with "
            "causal=True) or symmetric ((l, l) is window=l + 1)")


def _cp_comm_type_hint(value: object, kwargs: Mapping[str, Any]) -> str:
    mode = _CP_COMM_TYPES.get(value) if isinstance(value, str) else None
    if mode is None:
        return "pass mode= ('p2p' is 'ring', 'all_gather' 'allgather', 'a2a' 'ulysses', 'a2a+p2p' 'hybrid')"
    extra = " and init_process_groups(ulysses_size=u) (the a2a degree)" if mode == "hybrid" else ""
    return f"pass mode={mode!r}{extra}"


attention_foreign_keywords = foreign_keyword_refuser(
    "seqpar.attention", ATTENTION_FOREIGN_KEYWORDS,
    value_hints={"window_size": _window_size_hint, "cp_comm_type": _cp_comm_type_hint},
    positional_hint=" (flash-attn's and ring-flash-attn's 4th is dropout_p, then softmax_scale, causal)",
)
"""``seqpar.attention``'s decorator: :data:`ATTENTION_FOREIGN_KEYWORDS`, flash-attn's ``window_size`` and Megatron's
``cp_comm_type`` (each hint worked out from the value) refused with seqpar's form (:func:`foreign_keyword_refuser`)."""
