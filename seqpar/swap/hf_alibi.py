"""The transformers ALiBi attention modules (BLOOM, MPT, Falcon with ``alibi=True``) on seqpar attention.

These modules do not dispatch through ``ALL_ATTENTION_FUNCTIONS``: each computes its scores itself,
adding a per-key ALiBi bias the model builds from *local* positions (BLOOM and Falcon from the
attention mask's cumsum, MPT from ``max_seq_len``). A swapped module's forward is replaced by one
that makes q, k, v with the module's own projections, applies the model's own bias at global key
positions (MPT: the slopes read off the fp32 bias tensor the model passes, ``bias[..., -1] -
bias[..., -2]``, whose last key has bias 0, given as ``alibi_slopes=``: :mod:`seqpar.attn.alibi`;
BLOOM and Falcon: the bias values as the model rounds them, in extra q/k columns), calls seqpar
attention, causal, then applies the module's own output projection (and BLOOM's residual dropout-add).

Per family (transformers 5.x):

- BLOOM: scores ``q.k / sqrt(d) + b_h(j)`` with ``b_h(j) = dtype(m_h * j)`` (fp32 slopes and product,
  rounded to the model's dtype key by key: in bf16 / fp16 not linear in j). Like Falcon's, those exact
  values ride in an extra q/k column (one per head: BLOOM's K/V heads are its query heads; q is
  scaled by ``1/sqrt(d)`` beforehand and the kernel's scale is 1, so the bias is not scaled);
  returns ``(dropout_add(dense(ctx), residual), None)``.
- MPT: scores ``q.k * softmax_scale + m_h (j - (L - 1))``; ``clip_qkv`` clamps the fused projection;
  returns ``(out_proj(ctx), None)``.
- Falcon (``alibi=True``): scores ``(q.k + b_h(j)) / sqrt(d)`` (the bias scaled too, eager and sdpa
  alike) where transformers builds ``b_h(j) = bf16(bf16(m_h) * j)``, rounded to bfloat16 whatever the
  model's dtype: not linear in j, so no slope reproduces it. Those exact values ride instead in one
  extra q/k column per head (``q' = [q, e_h]``, ``k' = [k, b_1(j), ..., b_H(j)]``, at global j; V keeps
  its head dim), which the kernels scale with the scores; GQA / MQA K/V heads; returns ``(dense(ctx), None)``.

Packed documents: none of the three models passes the batch's ``cu_seq_lens_q`` on to its attention
(``BloomModel``, ``FalconModel`` and ``MptModel`` call each block with the hidden states, the mask and
the bias only; one process attends across the documents of a packed row). The swap makes each block a
documents carrier (:func:`seqpar.mixers.documents.feed_documents`, as for mixers whose caller drops them),
so the swapped forward reads its own forward's boundaries (:func:`_documents`) and each document attends
to itself, as it does run alone (ALiBi at global key positions differs from the per-document bias by a
per-row constant inside a document, which softmax ignores).

Refused by name: a KV cache, ``output_attentions``, attention dropout in training, BLOOM's
``pretraining_tp > 1`` with ``slow_but_exact``, and Falcon-ALiBi on transformers' eager path, which adds
the bias twice (once to the scores, once through the mask it folds the bias into; its sdpa path adds it
once, which is what seqpar does): load it with ``attn_implementation="sdpa"``.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from seqpar.mixers.documents import carried_documents, carried_group
from seqpar.sequence.batch import global_positions, sp_rank_and_size
from seqpar.sequence.boundaries import host_boundaries
from seqpar.sequence.call_group import GROUP_KEY
from seqpar.swap.options import SwapOptions
from seqpar.swap.state import is_probing

__all__ = ["is_alibi_attention", "alibi_problems", "install"]

_OPTIONS_ATTR = "_seqpar_options"
_SLOPES_ATTR = "_seqpar_alibi_slopes"


def _family(module: nn.Module) -> str | None:
    cls = type(module)
    if not cls.__module__.startswith("transformers.models."):
        return None
    name = cls.__name__
    if name == "BloomAttention":
        return "bloom"
    if name == "MptAttention":
        return "mpt"
    if name == "FalconAttention" and getattr(getattr(module, "config", None), "alibi", False):
        return "falcon"
    return None


def is_alibi_attention(module: nn.Module) -> bool:
    """A transformers ALiBi attention module this route serves (BLOOM, MPT, Falcon with alibi=True)."""
    return _family(module) is not None


def _dropout_p(module: nn.Module) -> float:
    p = getattr(module, "attn_dropout_p", None)
    if p is None:
        drop = getattr(module, "attention_dropout", None)
        p = drop.p if isinstance(drop, nn.Dropout) else 0.0
    return float(p)


def alibi_problems(module: nn.Module) -> list[str]:
    """Features of this ALiBi layer that seqpar does not honour (empty when it can swap)."""
    problems = []
    if _family(module) == "falcon" and getattr(module.config, "_attn_implementation", None) == "eager":
        problems.append(
            "Falcon with alibi=True on transformers' eager attention adds the ALiBi bias twice (to the scores "
            "and again through the attention mask), its sdpa path once, as seqpar does; load the model with "
            "attn_implementation='sdpa' (transformers' default) so that one process and seqpar agree"
        )
    if _family(module) == "bloom" and module.pretraining_tp > 1 and module.slow_but_exact:
        problems.append("BLOOM pretraining_tp > 1 with slow_but_exact is not supported; set slow_but_exact=False")
    if getattr(getattr(module, "config", None), "output_attentions", False):
        problems.append("config.output_attentions=True: attention weights of a sharded sequence are never materialised")
    if _dropout_p(module) > 0 and module.training:
        problems.append(f"attention dropout {_dropout_p(module)} in training is not supported; set it to 0.0 in the config")
    return problems


def _check_call(module: nn.Module, cache: Any, output_attentions: bool) -> str:
    layer = getattr(module, "_seqpar_name", type(module).__name__)
    if cache is not None:
        raise ValueError(f"seqpar (layer '{layer}'): a KV cache is not supported on a sharded sequence")
    if output_attentions:
        raise ValueError(f"seqpar (layer '{layer}'): output_attentions=True is not supported")
    if _dropout_p(module) > 0 and module.training:
        raise ValueError(f"seqpar (layer '{layer}'): attention dropout {_dropout_p(module)} in training is not "
                         "supported; set the config's attention dropout to 0.0")
    return layer


def _slopes_from_first_keys(bias: Tensor, batch: int, heads: int, layer: str) -> Tensor:
    # BLOOM / Falcon: (batch * heads, 1, seq_local) with bias m_h * (local position); key 0 has bias 0
    per_key = bias.reshape(batch, heads, -1)[0]  # (heads, seq_local)
    if per_key.shape[-1] < 2:
        raise ValueError(f"seqpar (layer '{layer}'): ALiBi needs at least 2 tokens per rank to read the slopes")
    return (per_key[:, 1] - per_key[:, 0]).float()


def _documents(kwargs: dict[str, Any]) -> Tensor | None:
    """This call's packed-document boundaries: its own ``cu_seq_lens_q`` when the caller passes one, else
    those its block carries for the running forward (None: one sequence)."""
    cu = kwargs.get("cu_seq_lens_q")
    return carried_documents() if cu is None else cu


def _options(module: nn.Module, kwargs: dict[str, Any]) -> SwapOptions:
    """The swap's options with this call's SP group (dynamic CP): the one the call passes (:data:`GROUP_KEY`,
    taken out of ``kwargs``), else the one its block carries for the running forward (BLOOM, MPT and Falcon
    call their attention without the model's keyword arguments), else the swap's. Never stored on the module:
    a recompute under activation checkpointing reads its own forward's."""
    options: SwapOptions = getattr(module, _OPTIONS_ATTR)
    group = kwargs.pop(GROUP_KEY, None)
    return options.for_call({GROUP_KEY: carried_group() if group is None else group})


def _attend(options: SwapOptions, q: Tensor, k: Tensor, v: Tensor, *, scale: float, slopes: Tensor,
            layer: str, kwargs: dict[str, Any]) -> Tensor:
    """seqpar attention of q ``(batch, q_heads, seq_local, d)``, k/v ``(batch, kv_heads, seq_local, d)``
    -> ``(batch, seq_local, q_heads * d)``, over ``options``' group (the call's)."""
    out = options.attention(q, k, v, causal=True, scale=scale, layer=layer,
                            cu_seqlens=_documents(kwargs), alibi_slopes=slopes)
    b, h, n, d = out.shape
    return out.transpose(1, 2).reshape(b, n, h * d)  # (B, H, S, D) -> (B, S, H * D)


def _global_key_positions(options: SwapOptions, n: int, device: torch.device, cu: Tensor | None) -> Tensor:
    """``(seq_local,)`` int64 global positions of this rank's keys (the probe's own, local, when probing:
    its self-only attention ignores every bias)."""
    if is_probing():
        return torch.arange(n, device=device)
    rank, world = sp_rank_and_size(options.group)
    return global_positions(n * world, rank, world, options.sharding, device=device, cu_seqlens=host_boundaries(cu))


def _bloom_slopes(module: nn.Module, device: torch.device) -> Tensor:
    """BLOOM's fp32 slopes ``(heads,)`` from the model's own ``build_alibi_tensor`` (its key 1 in fp32 is
    ``m_h``), kept per device on the module: a constant of the layer, made once (transformers versions
    that build them from a Python list copy host data to the device)."""
    cache = module.__dict__.setdefault(_SLOPES_ATTR, {})
    if device not in cache:
        build = sys.modules[type(module).__module__].build_alibi_tensor
        ones = torch.ones(1, 2, dtype=torch.long, device=device)
        cache[device] = build(ones, module.num_heads, torch.float32).reshape(module.num_heads, 2)[:, 1]
    return cache[device]


def _bloom_forward(self: nn.Module, hidden_states: Tensor, residual: Tensor, alibi: Tensor,
                   attention_mask: Tensor | None, layer_past: Any = None, use_cache: bool = False,
                   output_attentions: bool = False, **kwargs: Any) -> tuple[Tensor, None]:
    layer = _check_call(self, layer_past, output_attentions)
    options = _options(self, kwargs)
    q, k, v = self._reshape(self.query_key_value(hidden_states))  # 3 x (B, H, S, D)
    b, h, n, _ = q.shape
    cu = _documents(kwargs)
    pos = _global_key_positions(options, n, q.device, cu)  # (seq_local,)
    # BLOOM's own bias (build_alibi_tensor): fp32 slopes times integer positions, rounded to the
    # model's dtype key by key. In bf16 / fp16 that rounding is part of the model (bf16(m j) is not
    # bf16(m) j, nor m j), so the rounded values ride in one extra q/k column per head (MHA: each head
    # its own K), not as slopes. The bias is not scaled: q is scaled instead and the kernel's scale is 1.
    bias = (_bloom_slopes(self, q.device)[:, None] * pos[None, :]).to(q.dtype)  # (heads, seq_local)
    q2 = torch.cat([q * self.inv_norm_factor, q.new_ones(b, h, n, 1)], dim=-1)  # (B, H, S, D + 1)
    k2 = torch.cat([k, bias.view(1, h, n, 1).expand(b, h, n, 1)], dim=-1)  # (B, H, S, D + 1)
    out = options.attention(q2, k2, v, causal=True, scale=1.0, layer=layer, cu_seqlens=cu)
    ctx = out.transpose(1, 2).reshape(b, n, -1)  # (B, H, S, D) -> (B, S, H * D)
    dropout_add = sys.modules[type(self).__module__].dropout_add
    return dropout_add(self.dense(ctx), residual, self.hidden_dropout, self.training), None


def _mpt_forward(self: nn.Module, hidden_states: Tensor, position_bias: Tensor, cache: Any = None,
                 attention_mask: Tensor | None = None, **kwargs: Any) -> tuple[Tensor, None]:
    layer = _check_call(self, cache if cache is not None else kwargs.pop("past_key_values", None),
                        bool(kwargs.get("output_attentions")))
    options = _options(self, kwargs)
    b, n = hidden_states.shape[:2]
    mixed = self.Wqkv(hidden_states)
    if self.clip_qkv:
        mixed = mixed.clamp(min=-self.clip_qkv, max=self.clip_qkv)
    q, k, v = (t.reshape(b, n, self.n_heads, self.head_dim).transpose(1, 2) for t in mixed.chunk(3, dim=2))
    # (heads, 1, max_seq_len): m_h (j - (L - 1)), so the last key has bias 0 and the one before -m_h
    slopes = (position_bias[:, 0, -1] - position_bias[:, 0, -2]).float()
    ctx = _attend(options, q, k, v, scale=self.softmax_scale, slopes=slopes, layer=layer, kwargs=kwargs)
    return self.out_proj(ctx), None


def _falcon_forward(self: nn.Module, hidden_states: Tensor, alibi: Tensor | None, attention_mask: Tensor | None,
                    position_ids: Tensor | None = None, layer_past: Any = None, use_cache: bool = False,
                    output_attentions: bool = False, position_embeddings: Any = None,
                    **kwargs: Any) -> tuple[Tensor, None]:
    layer = _check_call(self, layer_past, output_attentions)
    options = _options(self, kwargs)
    q, k, v = self._split_heads(self.query_key_value(hidden_states))  # 3 x (B, S, heads, D)
    b, n = q.shape[:2]
    kv_heads = self.num_heads if self.new_decoder_architecture else self.num_kv_heads
    q = q.transpose(1, 2).reshape(b, self.num_heads, n, self.head_dim)
    k = k.transpose(1, 2).reshape(b, kv_heads, n, self.head_dim)
    v = v.transpose(1, 2).reshape(b, kv_heads, n, self.head_dim)
    slopes = _slopes_from_first_keys(alibi, b, self.num_heads, layer)  # bf16(m_h), exactly
    cu = _documents(kwargs)
    pos = _global_key_positions(options, n, q.device, cu)  # (seq_local,)
    # transformers' own op (build_alibi_tensor): bf16 slopes times integer positions, a bf16 result
    bias = (slopes.to(q.device).bfloat16()[:, None] * pos[None, :]).to(q.dtype)  # (heads, seq_local)
    h, d = self.num_heads, self.head_dim
    q2 = torch.cat([q, torch.eye(h, dtype=q.dtype, device=q.device).view(1, h, 1, h).expand(b, h, n, h)], dim=-1)
    k2 = torch.cat([k, bias.t().reshape(1, 1, n, h).expand(b, kv_heads, n, h)], dim=-1)
    out = options.attention(q2, k2, v, causal=True, scale=self.inv_norm_factor, layer=layer, cu_seqlens=cu)
    ctx = out.transpose(1, 2).reshape(b, n, h * d)  # (B, H, S, D) -> (B, S, H * D)
    return self.dense(ctx), None


_FORWARDS: dict[str, Callable[..., tuple[Tensor, None]]] = {
    "bloom": _bloom_forward, "mpt": _mpt_forward, "falcon": _falcon_forward,
}


def install(module: nn.Module, options: SwapOptions) -> None:
    """Point one ALiBi attention module at seqpar (its forward replaced on the instance)."""
    family = _family(module)
    assert family is not None
    setattr(module, _OPTIONS_ATTR, options)
    module.forward = types.MethodType(_FORWARDS[family], module)
