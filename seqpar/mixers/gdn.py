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

The projections, the decay, the heads' sizes and the norm's names differ per model: fields of each class's
:class:`DeltaNetSpec` (:data:`GDN_CLASSES`), read by the one forward.

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
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from seqpar.mixers.delta_rule import delta_rule_kernel, delta_rule_shard
from seqpar.mixers.family import SwappedMixer, has_mixer_parts, is_transformers_class

__all__ = ["GDN_CLASSES", "GDN_SPECS", "DeltaNetSpec", "SeqParGatedDeltaNet", "is_gated_delta_net", "FAMILY"]


@dataclass(frozen=True)
class DeltaNetSpec:
    """What one transformers GDN / KDA class computes its own way around the shared forward (module docstring).
    Names are the layer's attributes (child modules, sizes, flags)."""

    layout: str
    """The projection layout's name, as :data:`GDN_CLASSES` documents it."""
    fused: tuple[str, str] | None = None
    """The fused q/k/v/z and b/a projections, split by the layer's own ``fix_query_key_value_ordering``
    (Qwen3-Next); then :attr:`qkv`, :attr:`gate`, :attr:`beta` and :attr:`decay` are unused."""
    qkv: tuple[str, ...] = ()
    """The projection(s) whose outputs, concatenated, are the convolution's input."""
    gate: tuple[str, ...] = ()
    """The projections applied in turn to the hidden states: the output gate (KDA's is low rank)."""
    beta: str | None = None
    """The projection of beta's logits."""
    decay: str | None = None
    """The projection of ``a`` in ``g = -exp(A_log) softplus(a + dt_bias)`` (per head)."""
    forget_gate: str | None = None
    """A module mapping the hidden states to the log decay itself (KDA: per channel); replaces :attr:`decay`."""
    head_dims: tuple[str, str] = ("head_k_dim", "head_v_dim")
    """The key and value head sizes."""
    splits: tuple[str, str, str] = ("key_dim", "key_dim", "value_dim")
    """The sizes of q, k and v in the convolution's output."""
    beta_doubling: str | None = None
    """The flag that doubles beta (eigenvalues down to -1: OLMo-hybrid's ``allow_neg_eigval``)."""
    norm: str = "norm"
    """The gated output norm."""
    out_proj: str = "out_proj"
    """The output projection."""
    norm_per_head: bool = False
    """The norm takes ``(batch, seq, heads, d_v)`` (KDA); else rows of ``d_v``."""
    rule: str = "gdn"
    """The delta rule (``"gdn"`` or ``"kda"``), which names flash-linear-attention's kernel
    (:data:`seqpar.mixers.delta_rule.FLA_KERNELS`)."""
    torch_kernel: str = "torch_chunk_gated_delta_rule"
    """transformers' torch function of the rule, in the model's module."""

    @property
    def required(self) -> tuple[str, ...]:
        """The child modules the layer must have."""
        named = (*(self.fused or ()), *self.qkv, *self.gate, self.beta, self.decay, self.forget_gate, self.norm,
                 self.out_proj)
        return tuple(name for name in named if name is not None)


_QKV_Z = DeltaNetSpec("qkv_z", qkv=("in_proj_qkv",), gate=("in_proj_z",), beta="in_proj_b", decay="in_proj_a")

GDN_CLASSES: dict[str, DeltaNetSpec] = {
    "Qwen3NextGatedDeltaNet": DeltaNetSpec("qkvz", fused=("in_proj_qkvz", "in_proj_ba")),
    "Qwen3_5GatedDeltaNet": _QKV_Z,
    "Qwen3_5MoeGatedDeltaNet": _QKV_Z,
    "LaraMiniGatedDeltaNet": _QKV_Z,
    "OlmoHybridGatedDeltaNet": DeltaNetSpec("olmo", qkv=("q_proj", "k_proj", "v_proj"), gate=("g_proj",),
                                            beta="b_proj", decay="a_proj", beta_doubling="allow_neg_eigval",
                                            norm="o_norm", out_proj="o_proj"),
    "KimiLinearDeltaAttention": DeltaNetSpec("kda", qkv=("q_proj", "k_proj", "v_proj"), gate=("g_a_proj", "g_b_proj"),
                                             beta="b_proj", forget_gate="forget_gate", head_dims=("head_dim", "head_dim"),
                                             splits=("qkv_dim", "qkv_dim", "qkv_dim"), norm="o_norm", out_proj="o_proj",
                                             norm_per_head=True, rule="kda", torch_kernel="chunk_kimi_delta_attention"),
}
"""transformers classes whose forward :class:`SeqParGatedDeltaNet` reproduces, and their spec, whose layouts are
``qkvz`` (fused q/k/v/z and b/a projections, ``fix_query_key_value_ordering``), ``qkv_z`` (``in_proj_qkv``,
``in_proj_z``, ``in_proj_b``, ``in_proj_a``), ``olmo`` (separate ``q/k/v/a/b/g_proj``), ``kda`` (Kimi-Linear:
separate projections, per-channel ``forget_gate``, low-rank output gate)."""

GDN_SPECS = GDN_CLASSES
"""The same mapping by the name every family's spec table has (transformers class -> :class:`DeltaNetSpec`)."""


def is_gated_delta_net(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers GDN / KDA layer that seqpar can shard."""
    if not is_transformers_class(module, GDN_CLASSES):
        return False
    spec = GDN_CLASSES[type(module).__name__]
    return has_mixer_parts(module, "conv1d", modules=spec.required)


class SeqParGatedDeltaNet(SwappedMixer):
    """A sequence-parallel drop-in for a transformers GDN / KDA layer (:data:`GDN_CLASSES`); see
    :class:`seqpar.mixers.family.SwappedMixer` for the arguments."""

    SPECS = GDN_SPECS
    spec: DeltaNetSpec

    def take_over(self, original: nn.Module) -> None:
        for name, value in vars(original).items():  # sizes, activation, flags
            if not name.startswith("_") and isinstance(value, (bool, int, float, str)) and not hasattr(self, name):
                setattr(self, name, value)
        # Qwen3-Next's fused projections are split by its own method
        self.fix_ordering = getattr(original, "fix_ordering", getattr(type(original), "fix_query_key_value_ordering",
                                                                      None))

    def _inputs(self, h: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """``(mixed_qkv (batch, seq, conv_dim), gate, b, a)`` as the spec's projections compute them (``a``: None
        where a forget gate gives the decay)."""
        batch, seq, _ = h.shape
        spec = self.spec
        if spec.fused is not None:
            qkvz, ba = (getattr(self, name)(h) for name in spec.fused)
            query, key, value, z, b, a = self.fix_ordering(self, qkvz, ba)
            mixed = torch.cat([t.reshape(batch, seq, -1) for t in (query, key, value)], dim=-1)
            return mixed, z, b, a
        qkv = [getattr(self, name)(h) for name in spec.qkv]
        mixed = qkv[0] if len(qkv) == 1 else torch.cat(qkv, dim=-1)
        gate = h
        for name in spec.gate:
            gate = getattr(self, name)(gate)
        a = None if spec.decay is None else getattr(self, spec.decay)(h)
        return mixed, gate, getattr(self, spec.beta)(h), a

    def forward(self, hidden_states: Tensor, cache: Any = None, attention_mask: Tensor | None = None,
                **kwargs: Any) -> Tensor:
        """hidden_states ``(batch, seq_local, hidden)`` -> ``(batch, seq_local, hidden)``."""
        self.refuse_cache(cache, kwargs.get("cache_params"))
        tf = sys.modules[self.transformers_module]
        spec = self.spec
        hidden_states, cu, layout = self.open_call(hidden_states, attention_mask, kwargs)
        batch, seq_local, _ = hidden_states.shape
        mixed, gate, b, a = self._inputs(hidden_states)
        conv = self.conv_shard(self.conv1d, mixed.transpose(1, 2), cu)
        mixed = tf.ACT2FN[self.activation](conv).to(mixed.dtype).transpose(1, 2)  # as causal_conv1d_fn
        head_k, head_v = (getattr(self, name) for name in spec.head_dims)
        query, key, value = torch.split(mixed, [getattr(self, name) for name in spec.splits], dim=-1)
        query = query.reshape(batch, seq_local, -1, head_k)
        key = key.reshape(batch, seq_local, -1, head_k)
        value = value.reshape(batch, seq_local, -1, head_v)
        beta = b.sigmoid()
        if spec.beta_doubling is not None and getattr(self, spec.beta_doubling):
            beta = beta * 2.0
        if spec.forget_gate is not None:
            g = getattr(self, spec.forget_gate)(hidden_states)
        else:  # in fp32: in fp16, A might be -inf (transformers' comment)
            g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        kernel = delta_rule_kernel(spec.rule, getattr(tf, spec.torch_kernel), query.device, self.mixer_kernels)
        out = delta_rule_shard(kernel, query, key, value, g, beta, layout=layout, group=self.group,
                               sharding=self.sharding, use_qk_l2norm_in_kernel=True)
        norm, proj = getattr(self, spec.norm), getattr(self, spec.out_proj)
        if spec.norm_per_head:
            out = norm(out, gate.reshape(batch, seq_local, -1, head_v))
        else:
            out = norm(out.reshape(-1, head_v), gate.reshape(-1, head_v))
        return proj(out.reshape(batch, seq_local, -1))


FAMILY = SeqParGatedDeltaNet.family("gated_delta_net", is_gated_delta_net)
"""The GDN / KDA family's entry in :data:`seqpar.mixers.registry.FAMILIES`."""
