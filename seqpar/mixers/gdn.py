"""Gated DeltaNet and KDA layers, sequence-parallel: Qwen3-Next, Qwen3.5 / Qwen3.5-MoE (and Lara-Mini's
layer, which has the same forward; Qwen4-Exp's too, but that model stays refused for its DSA attention, so its
GDN layer is left to the refusal), OLMo-hybrid, and Kimi-Linear's KDA.

The layer (transformers' torch path; read in transformers 5.24)::

    q, k, v = split(act(causal_conv(proj_qkv(h))))     # depthwise conv of width linear_conv_kernel_dim
    beta    = sigmoid(proj_b(h))        (x 2 for OLMo-hybrid's allow_neg_eigval)
    g       = -exp(A_log) softplus(proj_a(h) + dt_bias)           GDN: (batch, seq, v_heads)
            = forget_gate(h)                                      KDA: (batch, seq, heads, d_k)
    o       = chunk_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    out     = out_proj(gated_norm(o, gate(h)))

The projections differ per model (:data:`GDN_CLASSES` names each layout); the rest is shared.

Sequence-parallel form (:class:`SeqParGatedDeltaNet`, same child modules and parameters):

- the convolution is :func:`seqpar.mixers.conv.causal_conv_shard` (halo exchange, documents restart);
- the delta rule is :func:`seqpar.mixers.delta_rule.delta_rule_shard`: transformers' own kernel per local
  chunk (scanned wide, ``[v | 0]`` from ``[0 | I]``), chunk summaries ``(T, S_local)`` all-gathered, each
  chunk's output from its true initial state ``h`` read off the same scan as ``o_zero + O_I h``
  (flash-linear-attention's kernels on CUDA when importable).

Packed documents reach the layer as ``cu_seq_lens_q`` of its own call (the decoder layers pass their
keyword arguments on), or through :func:`seqpar.mixers.documents.feed_documents`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from seqpar.mixers.conv import causal_conv_shard, is_causal_depthwise_conv
from seqpar.mixers.delta_rule import delta_rule_kernel, delta_rule_shard
from seqpar.mixers.family import SwappedMixer

__all__ = ["GDN_CLASSES", "SeqParGatedDeltaNet", "is_gated_delta_net", "FAMILY"]

GDN_CLASSES = {
    "Qwen3NextGatedDeltaNet": "qkvz",
    "Qwen3_5GatedDeltaNet": "qkv_z",
    "Qwen3_5MoeGatedDeltaNet": "qkv_z",
    "LaraMiniGatedDeltaNet": "qkv_z",
    "OlmoHybridGatedDeltaNet": "olmo",
    "KimiLinearDeltaAttention": "kda",
}
"""transformers classes whose forward :class:`SeqParGatedDeltaNet` reproduces, and their projection layout:
``qkvz`` (fused q/k/v/z and b/a projections, ``fix_query_key_value_ordering``), ``qkv_z`` (``in_proj_qkv``,
``in_proj_z``, ``in_proj_b``, ``in_proj_a``), ``olmo`` (separate ``q/k/v/a/b/g_proj``), ``kda`` (Kimi-Linear:
separate projections, per-channel ``forget_gate``, low-rank output gate)."""

_REQUIRED = {
    "qkvz": ("in_proj_qkvz", "in_proj_ba", "norm", "out_proj"),
    "qkv_z": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "norm", "out_proj"),
    "olmo": ("q_proj", "k_proj", "v_proj", "a_proj", "b_proj", "g_proj", "o_norm", "o_proj"),
    "kda": ("q_proj", "k_proj", "v_proj", "forget_gate", "b_proj", "g_a_proj", "g_b_proj", "o_norm", "o_proj"),
}
_KERNEL_FUNCTION = {"kda": "chunk_kimi_delta_attention"}  # the others: torch_chunk_gated_delta_rule


def is_gated_delta_net(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers GDN / KDA layer that seqpar can shard."""
    cls = type(module)
    layout = GDN_CLASSES.get(cls.__name__)
    if layout is None or not cls.__module__.startswith("transformers."):
        return False
    conv = getattr(module, "conv1d", None)
    return (is_causal_depthwise_conv(conv)
            and all(isinstance(getattr(module, name, None), nn.Module) for name in _REQUIRED[layout]))


class SeqParGatedDeltaNet(SwappedMixer):
    """A sequence-parallel drop-in for a transformers GDN / KDA layer (:data:`GDN_CLASSES`); see
    :class:`seqpar.mixers.family.SwappedMixer` for the arguments."""

    def __init__(self, original: nn.Module, *, group: dist.ProcessGroup | None, sharding: str,
                 position_wise: Callable[[], bool] = lambda: False, mixer_kernels: str = "torch") -> None:
        super().__init__(original, group=group, sharding=sharding, position_wise=position_wise,
                         mixer_kernels=mixer_kernels)
        for name, value in vars(original).items():  # sizes, activation, flags
            if not name.startswith("_") and isinstance(value, (bool, int, float, str)) and not hasattr(self, name):
                setattr(self, name, value)
        self.projections = GDN_CLASSES[self.original_class]
        # Qwen3-Next's fused projections are split by its own method
        self.fix_ordering = getattr(original, "fix_ordering", getattr(type(original), "fix_query_key_value_ordering",
                                                                      None))

    def _inputs(self, h: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``(mixed_qkv (batch, seq, conv_dim), gate, b, a)`` as each layout computes them (``a`` unused by KDA)."""
        batch, seq, _ = h.shape
        kind = self.projections
        if kind == "qkvz":
            query, key, value, z, b, a = self.fix_ordering(self, self.in_proj_qkvz(h), self.in_proj_ba(h))
            mixed = torch.cat([t.reshape(batch, seq, -1) for t in (query, key, value)], dim=-1)
            return mixed, z, b, a
        if kind == "qkv_z":
            return self.in_proj_qkv(h), self.in_proj_z(h), self.in_proj_b(h), self.in_proj_a(h)
        mixed = torch.cat([self.q_proj(h), self.k_proj(h), self.v_proj(h)], dim=-1)
        if kind == "olmo":
            return mixed, self.g_proj(h), self.b_proj(h), self.a_proj(h)
        return mixed, self.g_b_proj(self.g_a_proj(h)), self.b_proj(h), h  # kda

    def forward(self, hidden_states: Tensor, cache: Any = None, attention_mask: Tensor | None = None,
                **kwargs: Any) -> Tensor:
        """hidden_states ``(batch, seq_local, hidden)`` -> ``(batch, seq_local, hidden)``."""
        self.refuse_cache(cache, kwargs.get("cache_params"))
        tf = sys.modules[self.transformers_module]
        kind = self.projections
        position_wise = self.position_wise()
        cu = self.cu_seqlens(kwargs)
        hidden_states = tf.apply_mask_to_padding_states(hidden_states, attention_mask)
        batch, seq_local, _ = hidden_states.shape
        layout = self.layout(seq_local, cu)
        mixed, gate, b, a = self._inputs(hidden_states)
        conv = causal_conv_shard(mixed.transpose(1, 2), self.conv1d.weight.squeeze(1), self.conv1d.bias,
                                 group=self.group, sharding=self.sharding, cu_seqlens=cu, position_wise=position_wise)
        mixed = tf.ACT2FN[self.activation](conv).to(mixed.dtype).transpose(1, 2)  # as causal_conv1d_fn
        if kind == "kda":
            head_k = head_v = self.head_dim
            splits = [self.qkv_dim] * 3
        else:
            head_k, head_v = self.head_k_dim, self.head_v_dim
            splits = [self.key_dim, self.key_dim, self.value_dim]
        query, key, value = torch.split(mixed, splits, dim=-1)
        query = query.reshape(batch, seq_local, -1, head_k)
        key = key.reshape(batch, seq_local, -1, head_k)
        value = value.reshape(batch, seq_local, -1, head_v)
        beta = b.sigmoid()
        if kind == "olmo" and self.allow_neg_eigval:
            beta = beta * 2.0
        if kind == "kda":
            g = self.forget_gate(hidden_states)
        else:  # in fp32: in fp16, A might be -inf (transformers' comment)
            g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        torch_path = getattr(tf, _KERNEL_FUNCTION.get(kind, "torch_chunk_gated_delta_rule"))
        kernel = delta_rule_kernel("kda" if kind == "kda" else "gdn", torch_path, query.device, self.mixer_kernels)
        out = delta_rule_shard(kernel, query, key, value, g, beta, layout=layout, group=self.group,
                               sharding=self.sharding, use_qk_l2norm_in_kernel=True)
        if kind == "kda":
            out = self.o_norm(out, gate.reshape(batch, seq_local, -1, head_v)).reshape(batch, seq_local, -1)
            return self.o_proj(out)
        norm, proj = (self.o_norm, self.o_proj) if kind == "olmo" else (self.norm, self.out_proj)
        out = norm(out.reshape(-1, head_v), gate.reshape(-1, head_v)).reshape(batch, seq_local, -1)
        return proj(out)


FAMILY = SeqParGatedDeltaNet.family("gated_delta_net", is_gated_delta_net)
"""The GDN / KDA family's entry in :data:`seqpar.mixers.registry.FAMILIES`."""
