"""LFM2's gated short convolution layer, sequence-parallel.

transformers' ``Lfm2ShortConv`` (and the identical ``Lfm2MoeShortConv``, ``Lfm3ShortConv``) computes,
on ``hidden_states (batch, seq, hidden)``::

    B, C, x = in_proj(h).transpose(-1, -2).chunk(3, dim=-2)     # each (batch, hidden, seq)
    y = out_proj((C * causal_conv(B * x)).transpose(-1, -2))     # depthwise, width conv_L_cache

Only ``causal_conv`` mixes positions. :class:`SeqParShortConv` replaces the layer, keeping the same
child modules (``in_proj``, ``conv``, ``out_proj``: the same parameter objects and state_dict keys), and
runs the convolution with :func:`seqpar.mixers.conv.causal_conv_shard`: a halo exchange, documents
restarting at every ``cu_seq_lens_q`` boundary (transformers' torch path ignores them and would mix
the documents of a packed batch). A KV cache (generation) is refused: a cache of a sharded sequence
means nothing.

The layer is recognised by class name and structure, not by import (the core does not import
transformers): one of :data:`SHORT_CONV_CLASSES` from a ``transformers`` module, with a depthwise
``conv`` whose padding is ``k - 1``.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from seqpar.mixers.family import SwappedMixer, has_mixer_parts, is_transformers_class

__all__ = ["SHORT_CONV_CLASSES", "SeqParShortConv", "is_short_conv", "find_short_convs", "FAMILY"]

SHORT_CONV_CLASSES = frozenset({"Lfm2ShortConv", "Lfm2MoeShortConv", "Lfm3ShortConv"})
"""transformers classes whose forward :class:`SeqParShortConv` reproduces (read in transformers 5.2x:
the three are the same code)."""


def is_short_conv(module: nn.Module) -> bool:
    """Whether ``module`` is an LFM2-family gated short convolution layer that seqpar can shard."""
    if not is_transformers_class(module, SHORT_CONV_CLASSES):
        return False
    return has_mixer_parts(module, "conv", linears=("in_proj", "out_proj"))


def find_short_convs(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(qualified name, module)`` of every short convolution layer in ``model`` (swapped ones included)."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, SeqParShortConv) or is_short_conv(m)]


class SeqParShortConv(SwappedMixer):
    """A sequence-parallel drop-in for an LFM2-family short convolution layer (its ``in_proj``, ``conv``,
    ``out_proj`` are taken over); see :class:`seqpar.mixers.family.SwappedMixer` for the arguments
    (``position_wise``: only the current position's tap, no communication)."""

    def take_over(self, original: nn.Module) -> None:
        self.conv_kernel_size = self.conv.kernel_size[0]

    def forward(self, hidden_states: Tensor, cache: Any = None, attention_mask: Tensor | None = None,
                past_key_values: Any = None, **kwargs: Any) -> Tensor:
        """hidden_states ``(batch, seq_local, hidden)`` -> ``(batch, seq_local, hidden)``."""
        self.refuse_cache(cache, past_key_values)
        attention_mask = self.padding_mask(attention_mask, hidden_states)
        if attention_mask is not None:  # transformers' apply_mask_to_padding_states (2D padding mask)
            hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
        bcx = self.in_proj(hidden_states).transpose(-1, -2)  # (B, 3*hidden, S_local)
        b, c, x = bcx.chunk(3, dim=-2)
        conv = self.conv_shard(self.conv, b * x, self.cu_seqlens(kwargs))
        y = (c * conv.to(x.dtype)).transpose(-1, -2).contiguous()  # (B, S_local, hidden)
        return self.out_proj(y)

    def extra_repr(self) -> str:
        return f"{self.original_class}, kernel_size={self.conv_kernel_size}, sharding={self.sharding!r}"


FAMILY = SeqParShortConv.family("short_conv", is_short_conv)
"""The LFM2 family's entry in :data:`seqpar.mixers.registry.FAMILIES`."""
