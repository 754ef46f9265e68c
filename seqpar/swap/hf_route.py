"""The route table of the ``"hf"`` route: which transformers modules take it, which layers it refuses
and why, and which keyword arguments of transformers' attention call it honours.

- A module takes the route when it is a transformers attention module that dispatches through
  ``ALL_ATTENTION_FUNCTIONS`` (:func:`is_hf_attention`), or one of the ALiBi modules (BLOOM, MPT, Falcon
  with ``alibi=True``), whose attention modules compute their own scores and get a forward of their own
  (:mod:`seqpar.swap.hf_alibi`) that runs ``seqpar.attention`` with ``alibi_slopes=`` at global positions.
- Layer features refused when swapping (named with the layer, :func:`swap_problems`): a
  ``"chunked_attention"`` layer without ``attention_chunk_size``, soft-capping on CUDA (outside float64),
  cross-attention, ``output_attentions`` in the config, attention dropout in training.
- Keyword arguments of the attention call outside :data:`ATTENTION_KWARGS` (DSA's ``indices=``) are
  refused by name at every call (:func:`refuse_unknown_kwargs`).

Also the names every step shares: the implementation name ``"seqpar"``, the attribute holding a swapped
layer's options, the layer's name and its chunk size, and the outermost models holding the layers.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
import transformers
from torch import nn

from seqpar.swap.hf_alibi import alibi_problems, is_alibi_attention

__all__ = [
    "ATTN_IMPLEMENTATION",
    "OPTIONS_ATTR",
    "layer_name",
    "is_hf_attention",
    "layer_chunk_size",
    "swap_problems",
    "top_pretrained",
    "ATTENTION_KWARGS",
    "refuse_unknown_kwargs",
]

ATTN_IMPLEMENTATION = "seqpar"
OPTIONS_ATTR = "_seqpar_options"
"""The attribute of a swapped attention layer holding its :class:`seqpar.swap.options.SwapOptions`."""


def layer_name(module: nn.Module) -> str:
    """The layer's name in the swapped model (its class name when it has none)."""
    return getattr(module, "_seqpar_name", type(module).__name__)


@functools.cache
def _dispatches_through_interface(cls: type) -> bool:
    if not cls.__module__.startswith("transformers"):
        return False
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    return "ALL_ATTENTION_FUNCTIONS" in source


def is_hf_attention(module: nn.Module) -> bool:
    """A transformers attention module that dispatches through ``ALL_ATTENTION_FUNCTIONS``, or one of
    the ALiBi modules (BLOOM, MPT, Falcon with alibi=True) served by :mod:`seqpar.swap.hf_alibi`."""
    return _dispatches_through_interface(type(module)) or is_alibi_attention(module)


def _dropout_p(module: nn.Module) -> float:
    for attr in ("attention_dropout", "attn_dropout", "dropout"):
        value = getattr(module, attr, None)
        if isinstance(value, nn.Dropout):
            return float(value.p)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return 0.0


def _layer_type(module: nn.Module) -> str | None:
    """The layer's entry of ``config.layer_types`` (or its own ``layer_type``), None if unknown."""
    layer_type = getattr(module, "layer_type", None)
    layer_types = getattr(getattr(module, "config", None), "layer_types", None)
    layer_idx = getattr(module, "layer_idx", None)
    if layer_type is None and layer_types is not None and isinstance(layer_idx, int):
        if 0 <= layer_idx < len(layer_types):
            layer_type = layer_types[layer_idx]
    return layer_type


def layer_chunk_size(module: nn.Module) -> int | None:
    """Llama 4's chunked local attention: ``config.attention_chunk_size`` on ``"chunked_attention"`` layers."""
    if _layer_type(module) != "chunked_attention":
        return None
    return getattr(getattr(module, "config", None), "attention_chunk_size", None)


def swap_problems(module: nn.Module) -> list[str]:
    """Features of this attention layer that seqpar does not honour (empty when it can swap)."""
    if is_alibi_attention(module):
        return alibi_problems(module)
    config = getattr(module, "config", None)
    problems = []
    if _layer_type(module) == "chunked_attention" and layer_chunk_size(module) is None:
        problems.append(
            "chunked_attention layer without config.attention_chunk_size: seqpar cannot tell its chunks; "
            "set attention_chunk_size"
        )
    softcap = getattr(config, "attn_logit_softcapping", None) or getattr(module, "softcap", None)
    param = next(module.parameters(), None)
    if softcap and param is not None and param.device.type == "cuda" and param.dtype != torch.float64:
        problems.append(
            f"attention logit soft-capping ({softcap}) on CUDA: torch's fused attention kernels have no "
            "soft-capping and seqpar's exact math kernel runs on CPU or in float64 only; set "
            "config.attn_logit_softcapping=None or train this model on CPU"
        )
    if getattr(module, "is_cross_attention", False):
        problems.append("cross-attention is not supported (self-attention on a sharded sequence only)")
    if getattr(config, "output_attentions", False):
        problems.append(
            "config.output_attentions=True: attention weights of a sharded sequence are never "
            "materialised; set it to False"
        )
    p = _dropout_p(module)
    if p > 0 and module.training:
        problems.append(
            f"attention dropout {p} in training is not supported; set it to 0.0 in the config "
            "(attention_dropout / attn_pdrop)"
        )
    return problems


def top_pretrained(model: nn.Module) -> list[nn.Module]:
    """The outermost PreTrainedModel instances in ``model`` (``model`` itself if it is one)."""
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if isinstance(module, transformers.PreTrainedModel) and not any(
            name.startswith(f"{n}.") or n == "" for n, _ in found
        ):
            found.append((name, module))
    return [m for _, m in found]


# The keyword arguments transformers' decoders pass to the attention function, found by running the
# installed transformers (5.24) decoders and reading their attention calls. Any other one with a value is
# refused by name: seqpar would ignore it and silently compute plain attention (DSA's ``indices=``, the
# top-k keys each query may see, is the known case).
_HONOURED_KWARGS = {
    "cu_seq_lens_q": "packed-document boundaries (seqpar attention's cu_seqlens)",
    "cu_seq_lens_k": "packed-document boundaries (the same as cu_seq_lens_q)",
    "max_length_q": "the longest document (implied by the boundaries)",
    "max_length_k": "the longest document (implied by the boundaries)",
    "sliding_window": "the layer's window (seqpar attention's window)",
    "s_aux": "attention sinks (seqpar attention's sinks)",
    "position_ids": "positions (already applied by rotary embeddings; packing comes as cu_seq_lens_q/k)",
    "output_attentions": "refused when True",
    "softcap": "logit soft-capping (seqpar attention's softcap)",
    "position_bias": "refused when set",
}
# Model-level flags that transformers threads through the layers' **kwargs down to the attention call;
# none of them changes what attention computes.
_PASS_THROUGH_KWARGS = frozenset({
    "use_cache", "output_hidden_states", "output_router_logits", "return_dict", "num_items_in_batch",
    "cache_position", "past_key_values", "past_key_value", "labels", "shift_labels", "seq_idx",
    "token_type_ids", "layer_idx",
})
ATTENTION_KWARGS = frozenset(_HONOURED_KWARGS) | _PASS_THROUGH_KWARGS
"""Keyword arguments seqpar's attention function accepts (besides ``dropout``, ``scaling``, ``is_causal``);
any other one with a value other than None is refused, naming it and the layer."""

_KWARG_HINTS = {
    "indices": "DeepSeek-V3.2 / GLM-MoE-DSA sparse attention: an indexer picks the top-k keys each query "
               "attends to, which seqpar's dense attention cannot honour",
    "sinks": "attention sinks under another name than s_aux",
    "block_indices": "block-sparse attention, which seqpar's dense attention cannot honour",
}


def refuse_unknown_kwargs(kwargs: dict[str, Any], layer: str, module: nn.Module) -> None:
    """Raise ``ValueError`` naming ``layer`` and every keyword argument of the attention call outside
    :data:`ATTENTION_KWARGS` that has a value (with what it is, when known)."""
    unknown = sorted(k for k, v in kwargs.items() if k not in ATTENTION_KWARGS and v is not None)
    if not unknown:
        return
    hints = "; ".join(f"{k}: {_KWARG_HINTS[k]}" for k in unknown if k in _KWARG_HINTS)
    raise ValueError(
        f"seqpar (layer '{layer}', {type(module).__name__}): the attention function got keyword "
        f"argument(s) {', '.join(f'{k}=' for k in unknown)} that seqpar does not know"
        f"{f' ({hints})' if hints else ''}; seqpar attention would ignore them and compute plain dense "
        "attention, a silently different model. Run this model without sequence parallelism, or teach "
        "seqpar.swap.hf the argument (seqpar attention must honour it on shards)"
    )
