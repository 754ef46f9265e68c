"""RecurrentGemma's recurrent block (``RecurrentGemmaRecurrentBlock``: conv1d + RG-LRU), sequence-parallel.

The block (transformers' torch path) computes::

    y = act(linear_y(h))
    x = causal_conv(linear_x(h))                             # depthwise, width conv1d_width
    a_t = exp(-8 sigmoid(W_a x_t + b_a) softplus(Lambda))    # per channel, a_t = 0 where a document starts
    x^_t = x_t sigmoid(W_x x_t + b_x) * (sqrt(1 - a_t^2), or 1 where a document starts)
    h_t = a_t h_{t-1} + x^_t                                 # (batch, lru_width), diagonal
    out = linear_out(h * y)

Document starts are the positions whose ``position_ids`` are 0 (RG-LRU's own ``segment_pos`` reset).
Under seqpar, ``position_ids`` are the shard's *global* positions (per document in a packed batch: the
Hugging Face input preparer fills or checks them), so the layer's resets fall where they do on one process.

Sequence-parallel form (:class:`SeqParRecurrentBlock`, same children): the convolution is
:func:`seqpar.mixers.conv.causal_conv_shard` (halo, documents restart); each local chunk runs through the
layer's own ``rg_lru`` from a zero state (it restarts at every position 0 itself); the chunk summaries are
the transition ``prod_t a_t`` and the final state ``(batch, lru_width)``;
:func:`seqpar.mixers.state_passing.scalar_decay_correction` gives each chunk's incoming state ``h0`` (one
all-gather, flat in S); a chunk's positions before its first document start get
``h_t += (prod_{s<=t} a_s) h0``. ``a_t`` is recomputed from the layer's gate parameters as it does.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from seqpar.mixers.family import SwappedMixer, has_mixer_parts, is_transformers_class
from seqpar.mixers.scan_layout import ScanLayout
from seqpar.mixers.state_passing import scalar_decay_correction

__all__ = ["RGLRU_CLASSES", "SeqParRecurrentBlock", "is_recurrent_block", "rglru_log_decay", "rglru_shard", "FAMILY"]

RGLRU_CLASSES = frozenset({"RecurrentGemmaRecurrentBlock"})
"""transformers classes whose forward :class:`SeqParRecurrentBlock` reproduces (read in transformers 5.24)."""


def is_recurrent_block(module: nn.Module) -> bool:
    """Whether ``module`` is a RecurrentGemma recurrent block that seqpar can shard."""
    return is_transformers_class(module, RGLRU_CLASSES) and has_mixer_parts(module, "conv_1d", modules=("rg_lru",))


def rglru_log_decay(rg_lru: nn.Module, x: Tensor) -> Tensor:
    """``log a_t`` of the RG-LRU (before its resets), as its forward computes it: x ``(batch, seq, width)``
    -> ``(batch, seq, width)``."""
    batch, seq, width = x.shape
    act = x.reshape(batch * seq, rg_lru.num_attention_heads, rg_lru.block_width).permute(1, 0, 2)
    gate = torch.baddbmm(rg_lru.recurrent_gate_bias[:, None, :], act, rg_lru.recurrent_gate_weight)
    gate = torch.sigmoid(gate.transpose(0, 1).reshape(batch, seq, width))
    return -8.0 * gate * F.softplus(rg_lru.recurrent_param)


def rglru_shard(rg_lru: nn.Module, x: Tensor, position_ids: Tensor, *, layout: ScanLayout | None,
                group: dist.ProcessGroup | None, sharding: str) -> Tensor:
    """The RG-LRU over this rank's shard, equal to the full sequence's (each document's).

    Args:
        rg_lru: transformers' ``RecurrentGemmaRglru`` (called per local chunk from a zero state).
        x: ``(batch, seq_local, lru_width)``, the convolution's output.
        position_ids: ``(batch, seq_local)`` global positions (per document): 0 restarts the recurrence.
        layout: :func:`seqpar.mixers.scan_layout.scan_layout` of the batch, whose document starts must be
            where ``position_ids`` is 0; None: every position alone (the position-mixing probe).
        group, sharding: the SP group and the layout the sequence was cut in.
    Returns:
        ``(batch, seq_local, lru_width)`` in x's dtype.
    """
    if layout is None:  # every position its own document: the RG-LRU's reset at each
        rg_lru.recurrent_states = None
        out = rg_lru(x, torch.zeros_like(position_ids))
        rg_lru.recurrent_states = None
        return out
    c = layout.chunk_len
    pieces, finals = [], []
    for j in range(layout.chunks):
        rg_lru.recurrent_states = None  # the layer's scan starts from its recurrent_states: zero
        pieces.append(rg_lru(x[:, j * c:(j + 1) * c], position_ids[:, j * c:(j + 1) * c]))
        finals.append(rg_lru.recurrent_states)  # fp32, from zero since the chunk's last document start
    rg_lru.recurrent_states = None  # no state kept between batches, as with use_cache=False
    out = torch.cat(pieces, dim=1)
    if layout.world == 1:
        return out
    n = layout.chunks
    log_a = rglru_log_decay(rg_lru, x).float().unflatten(1, (n, c))  # (batch, n, c, width)
    transition = log_a.sum(2).exp().movedim(1, 0)  # (n, batch, width)

    def lead_correction(j: int, lead: int, h0: Tensor) -> Tensor:  # h_t += (prod_{s<=t} a_s) h0
        return log_a[:, j, :lead].cumsum(1).exp() * h0[:, None]  # (batch, lead, width)

    correction = scalar_decay_correction(transition, torch.stack(finals).float(), layout, lead_correction, dim=-2,
                                         group=group, sharding=sharding)
    return (out.float() + correction).to(out.dtype)


class SeqParRecurrentBlock(SwappedMixer):
    """A sequence-parallel drop-in for RecurrentGemma's recurrent block; see
    :class:`seqpar.mixers.family.SwappedMixer` for the arguments."""

    COPIED = ("lru_width", "hidden_size", "conv1d_width")

    def forward(self, input_states: Tensor, position_ids: Tensor, attention_mask: Tensor | None = None,
                use_cache: bool = False, **kwargs: Any) -> tuple[Tensor, None]:
        """input_states ``(batch, seq_local, hidden)``, position_ids ``(batch, seq_local)`` (global, per
        document) -> ``((batch, seq_local, hidden), None)``."""
        self.refuse_cache(use_cache or None, kwargs.get("cache"))
        seq_local = input_states.shape[1]
        cu = self.cu_seqlens(kwargs)
        layout = self.layout(seq_local, cu)
        y = self.act_fn(self.linear_y(input_states))
        x = self.linear_x(input_states).transpose(1, 2)  # (batch, lru_width, seq_local)
        x = self.conv_shard(self.conv_1d, x, cu).to(x.dtype)
        x = rglru_shard(self.rg_lru, x.transpose(1, 2), position_ids.expand(input_states.shape[0], -1),
                        layout=layout, group=self.group, sharding=self.sharding)
        return self.linear_out(x * y), None


FAMILY = SeqParRecurrentBlock.family("rglru", is_recurrent_block)
"""RecurrentGemma's recurrent block's entry in :data:`seqpar.mixers.registry.FAMILIES`."""
