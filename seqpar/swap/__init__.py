"""Find the attention in an existing model and route it to :func:`seqpar.attention`.

Three routes, chosen per module:

- ``"hf"``: Hugging Face transformers attention modules (those dispatching through
  ``ALL_ATTENTION_FUNCTIONS``). A ``"seqpar"`` attention function and mask function are registered
  with transformers, and the model's attention implementation is switched to it
  (:mod:`seqpar.swap.hf`, imported only when transformers is installed). The ALiBi modules (BLOOM,
  MPT, Falcon ``alibi=True``), which compute their own scores, get a forward of their own on this route
  (:mod:`seqpar.swap.hf_alibi`).
- ``"sdpa"``: any other module whose code calls ``torch.nn.functional.scaled_dot_product_attention``
  (nanoGPT style), through one global dispatcher (:mod:`seqpar.swap.sdpa`).
- ``"mha"``: ``nn.MultiheadAttention`` is replaced by :class:`SeqParMultiheadAttention`, which keeps
  the same parameter objects and state_dict keys (:mod:`seqpar.swap.mha`).

Beside the attention, the mixers of hybrid models that seqpar makes sequence-parallel
(:mod:`seqpar.mixers`: LFM2's short convolutions) are replaced by their sharded form (report route
``"mixer"``); every other module mixing positions is refused by the position-mixing probe.

The walk over the model is :mod:`seqpar.swap.walk`; the options every swapped layer carries are
:mod:`seqpar.swap.options`. The swapped model checks its inputs across the SP group once per batch
(:mod:`seqpar.swap.batch`), so its layers make no per-call check (no host sync per layer).

Every swapped module runs on a shard of the sequence: inputs ``(batch, seq_local, ...)`` in the
configured sharding, as produced by :func:`seqpar.sequence.batch.shard_batch`. Positions must be the shard's
*global* positions (``position_ids`` from ``shard_batch``): Hugging Face models get them filled in
by the swap, but code that numbers positions from the local length (nanoGPT's
``pos = torch.arange(t)``) must take them as an argument instead. Features seqpar does not honour
(soft-capping on CUDA outside float64, attention dropout, custom or padding masks, attention
weights, ...; windows, sinks, chunks, soft-capping on CPU and ALiBi are honoured) are refused, at swap time where the model says so, else at call
time, with the layer named: never silently computed as plain attention.

Every other module that mixes information across positions (state-space, linear-attention and
convolution layers, cumulative sums, ...) is refused by name too, found by the position-mixing probe
(:mod:`seqpar.swap.probe`: two forwards of 13 tokens with self-only attention, at swap time for Hugging
Face models, at the first forward otherwise).
"""

from __future__ import annotations

from seqpar.swap.batch import install_batch_check
from seqpar.swap.mha import SeqParMultiheadAttention
from seqpar.swap.options import SwapError, SwapOptions
from seqpar.swap.walk import ROUTES, SwappedModule, SwapReport, swap_attention

__all__ = [
    "swap_attention",
    "SwapReport",
    "SwappedModule",
    "SwapError",
    "SwapOptions",
    "SeqParMultiheadAttention",
    "ROUTES",
    "install_batch_check",
]
