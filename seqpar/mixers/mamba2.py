"""Mamba2 layers, sequence-parallel: Falcon-H1's ``FalconH1Mixer``, Bamba's ``BambaMixer``, Nemotron-H's
``NemotronHMamba2Mixer``, Granite-4 hybrid's ``GraniteMoeHybridMambaLayer``, Zamba2's ``Zamba2MambaMixer``
and ``Mamba2Mixer``.

In transformers 5.24 these layers share one torch forward (read in each installed modeling file)::

    h          = h * ssm_in_multiplier                              # Falcon-H1 only
    zxbcdt     = in_proj(h) (* mup_vector: Falcon-H1)               # (batch, seq, ...)
    gate, xBC, dt = split(zxbcdt)
    xBC        = act(causal_conv(xBC))                              # depthwise over x, B and C
    x, B, C    = split(xBC)                                         # B, C: (batch, seq, n_groups, d_state)
    y          = mamba2_chunk_scan(x, dt, A=-exp(A_log), B, C, D, dt_bias, dt_limit)   # seqpar.mixers.ssd
    y          = norm(y, gate)             # gated RMS norm per group (Falcon-H1: optional, else y * silu(gate))
    out        = out_proj(y)

(their fused CUDA path, ``mamba2_split_conv1d_scan_combined``, computes the same). The only differences
are Falcon-H1's multipliers and optional norm: fields of each class's :class:`Mamba2Spec`
(:data:`MAMBA2_SPECS`), read by the one forward. Zamba2's shared blocks are attention and MLP (swapped as
attention); its Mamba2 layers are ordinary ones.

Sequence-parallel form (:class:`SeqParMamba2Mixer`, same parameters, buffers and child modules): the
convolution is :func:`seqpar.mixers.conv.causal_conv_shard` (halo exchange, documents restart), the
scan :func:`seqpar.mixers.ssd.ssd_shard` (transformers' own torch scan or mamba_ssm's kernel per local
chunk, one all-gather of chunk summaries, a correction), and the rest is position-wise. Packed documents
reach the layer as the ``cu_seq_lens_q`` of its own call or through
:func:`seqpar.mixers.documents.feed_documents`.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from seqpar.mixers.family import SwappedMixer, has_mixer_parts, is_transformers_class
from seqpar.mixers.ssd import ssd_shard

__all__ = ["MAMBA2_CLASSES", "MAMBA2_SPECS", "Mamba2Spec", "SeqParMamba2Mixer", "is_mamba2_mixer",
           "find_mamba2_mixers", "FAMILY"]


@dataclass(frozen=True)
class Mamba2Spec:
    """What one transformers Mamba2 class adds to the shared forward (module docstring). Each field names a
    layer attribute, or is None where the class has no such step."""

    input_multiplier: str | None = None
    """The scalar the hidden states are multiplied by before ``in_proj`` (Falcon-H1: ``ssm_in_multiplier``)."""
    projection_multiplier: str | None = None
    """The buffer ``in_proj``'s output is multiplied by (Falcon-H1: ``mup_vector``)."""
    norm_switch: str | None = None
    """The flag that turns the gated RMS norm on; when it is off the output is the plain gate ``y * silu(gate)``
    (Falcon-H1: ``mamba_rms_norm``). None: always the gated norm."""


MAMBA2_SPECS: dict[str, Mamba2Spec] = {
    "FalconH1Mixer": Mamba2Spec(input_multiplier="ssm_in_multiplier", projection_multiplier="mup_vector",
                                norm_switch="mamba_rms_norm"),
    "BambaMixer": Mamba2Spec(),
    "NemotronHMamba2Mixer": Mamba2Spec(),
    "GraniteMoeHybridMambaLayer": Mamba2Spec(),
    "Zamba2MambaMixer": Mamba2Spec(),
    "Mamba2Mixer": Mamba2Spec(),
}
"""Each transformers class :class:`SeqParMamba2Mixer` reproduces (read in transformers 5.24), and its spec."""

MAMBA2_CLASSES = frozenset(MAMBA2_SPECS)
"""transformers classes whose forward :class:`SeqParMamba2Mixer` reproduces (read in transformers 5.24)."""

_ATTRIBUTES = ("layer_idx", "num_heads", "head_dim", "n_groups", "ssm_state_size", "intermediate_size", "conv_dim",
               "chunk_size", "time_step_limit", "activation")
# the plain attributes the specs name (a buffer, such as Falcon-H1's mup_vector, is taken over as a buffer)
_SPEC_ATTRIBUTES = tuple(sorted({name for spec in MAMBA2_SPECS.values()
                                 for name in (spec.input_multiplier, spec.norm_switch) if name is not None}))


def is_mamba2_mixer(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers Mamba2 layer that seqpar can shard."""
    if not is_transformers_class(module, MAMBA2_CLASSES):
        return False
    return (has_mixer_parts(module, "conv1d", linears=("in_proj", "out_proj"), parameters=("A_log", "D", "dt_bias"))
            and all(hasattr(module, name) for name in _ATTRIBUTES[1:]))


class SeqParMamba2Mixer(SwappedMixer):
    """A sequence-parallel drop-in for a transformers Mamba2 layer (:data:`MAMBA2_CLASSES`); see
    :class:`seqpar.mixers.family.SwappedMixer` for the arguments. The class's :class:`Mamba2Spec` is
    :attr:`spec`."""

    COPIED = _ATTRIBUTES + _SPEC_ATTRIBUTES
    SPECS = MAMBA2_SPECS
    spec: Mamba2Spec

    def forward(self, hidden_states: Tensor, cache: Any = None, attention_mask: Tensor | None = None,
                **kwargs: Any) -> Tensor:
        """hidden_states ``(batch, seq_local, hidden)`` -> ``(batch, seq_local, hidden)``."""
        self.refuse_cache(cache, kwargs.get("cache_params"))
        tf = sys.modules[self.transformers_module]
        dtype = hidden_states.dtype
        batch, seq_local, _ = hidden_states.shape
        spec = self.spec
        hidden_states, cu, layout = self.open_call(hidden_states, attention_mask, kwargs)
        if spec.input_multiplier is not None:
            hidden_states = hidden_states * getattr(self, spec.input_multiplier)
        projected = self.in_proj(hidden_states)
        if spec.projection_multiplier is not None:
            projected = projected * getattr(self, spec.projection_multiplier)
        A = -torch.exp(self.A_log.float())
        gate, xbc, dt = projected.split([self.intermediate_size, self.conv_dim, self.num_heads], dim=-1)
        conv = self.conv_shard(self.conv1d, xbc.transpose(1, 2), cu)
        xbc = self.act(conv).to(xbc.dtype)  # transformers: activation in the weight's dtype, then the input's
        xbc = tf.apply_mask_to_padding_states(xbc.transpose(1, 2), attention_mask)
        groups_state = self.n_groups * self.ssm_state_size
        x, B, C = torch.split(xbc, [self.intermediate_size, groups_state, groups_state], dim=-1)
        scan = inspect.unwrap(tf.mamba2_chunk_scan)  # the torch path (mamba_ssm is dispatched in ssd_shard)
        y = ssd_shard(scan, x.reshape(batch, seq_local, self.num_heads, self.head_dim), dt, A,
                      B.reshape(batch, seq_local, self.n_groups, -1), C.reshape(batch, seq_local, self.n_groups, -1),
                      self.D, self.dt_bias, chunk_size=self.chunk_size, dt_limit=tuple(self.time_step_limit),
                      layout=layout, group=self.group, sharding=self.sharding, mixer_kernels=self.mixer_kernels)
        y = y.reshape(batch, seq_local, -1)
        if spec.norm_switch is not None and not getattr(self, spec.norm_switch):  # the norm off: the plain gate
            y = y * F.silu(gate)
        else:
            y = self.norm(y, gate)
        return self.out_proj(y.to(dtype))


FAMILY = SeqParMamba2Mixer.family("mamba2", is_mamba2_mixer)
"""The Mamba2 / SSD family's entry in :data:`seqpar.mixers.registry.FAMILIES`."""


def find_mamba2_mixers(model: nn.Module) -> Sequence[tuple[str, nn.Module]]:
    """``(qualified name, module)`` of every Mamba2 layer in ``model`` (swapped ones included)."""
    return [(name, m) for name, m in model.named_modules() if FAMILY.matches(m)]
