"""Sequence-parallel mixers other than softmax attention: the layers of hybrid models that mix
information across positions with a convolution, a linear recurrence or linear attention.

A *mixer* here is a module whose output at position t depends on the inputs at other positions,
outside seqpar's attention. Run on each rank's shard as it is, a mixer silently computes another
model (the position-mixing probe, :mod:`seqpar.swap.probe`, refuses every one seqpar does not handle).
This package holds the sequence-parallel implementation of each handled family; the swap
(:func:`seqpar.swap.swap_attention`) puts them in place beside the attention layers (route ``"mixer"``).

Design facts every family builds on:

- **Halos.** A causal convolution of width k (LFM2's short convolutions, and the convolution in front
  of Mamba / GDN) needs, at each chunk's first position, the previous k-1 inputs of the *global*
  sequence: a halo, fetched from the rank that owns those positions by one small point-to-point
  exchange (:mod:`seqpar.mixers.halo`). Its backward sends the halo's gradient home.
- **Linear-in-state recurrences.** GDN / KDA, Mamba2 and lightning attention are linear in their
  incoming state: after a chunk, ``state = T_chunk state_in + state_local`` (T a per-head scalar for
  Mamba2 and lightning, a d_k x d_k matrix for GDN / KDA). So no sequential pipeline is needed: every
  rank scans its chunks from zero, the *chunk summaries* ``(T_chunk, state_local)`` are exchanged
  (O(heads x state) bytes, independent of S), each chunk takes the exclusive prefix over the chunks
  before it in global order, and corrects its outputs or re-runs with the true initial state.
- **Chunks, not ranks.** Sharding gives a rank one chunk (contiguous), two (zigzag) or several
  (balanced) of the global sequence (:mod:`seqpar.sequence.sharding`); halos and prefixes are taken
  over chunks in global order, wherever the previous chunk lives.
- **Documents.** With packed documents (``cu_seqlens``) every mixer restarts at each document start,
  as if each document ran alone: a halo reaching before a document start is masked away, and a
  prefix is reset there.

Each family module defines its :class:`seqpar.mixers.family.MixerFamily` (how to recognise its layers and
build their sequence-parallel form); :data:`seqpar.mixers.registry.FAMILIES` lists the families the swap
puts in place. Linear recurrences share :func:`seqpar.mixers.state_passing.chunk_initial_states` (the
scalar-decay ones its whole step, :func:`seqpar.mixers.state_passing.scalar_decay_correction`); convolutions
:func:`seqpar.mixers.conv.is_causal_depthwise_conv` and :func:`seqpar.mixers.conv.causal_conv_shard`.

Families handled: short causal convolutions (:mod:`seqpar.mixers.conv`, LFM2 / LFM2-MoE / LFM3
``*ShortConv`` layers via :mod:`seqpar.mixers.short_conv`); Mamba (v1) selective scans
(:mod:`seqpar.mixers.mamba`: Jamba, Zamba, and the ``MambaMixer`` / ``FalconMambaMixer`` layers); Mamba2 / SSD layers (:mod:`seqpar.mixers.mamba2` over the
scan of :mod:`seqpar.mixers.ssd`: Falcon-H1, Bamba, Nemotron-H, Granite-4 hybrid, Zamba2, ``Mamba2Mixer``);
lightning attention (:mod:`seqpar.mixers.lightning`: MiniMax); RG-LRU blocks (:mod:`seqpar.mixers.rglru`:
RecurrentGemma). Mixers whose decoder layer does not pass them the batch's ``cu_seq_lens_q`` get it from
:func:`seqpar.mixers.documents.feed_documents`. Every other family is refused by name.
"""

from seqpar.mixers.conv import causal_conv_shard, conv_layout
from seqpar.mixers.family import MixerFamily
from seqpar.mixers.halo import HaloPlan, halo_exchange, halo_plan
from seqpar.mixers.lightning import SeqParLightningAttention
from seqpar.mixers.mamba import SeqParMambaMixer
from seqpar.mixers.mamba2 import SeqParMamba2Mixer
from seqpar.mixers.rglru import SeqParRecurrentBlock
from seqpar.mixers.short_conv import SeqParShortConv, find_short_convs, is_short_conv
from seqpar.mixers.state_passing import chunk_initial_states

__all__ = [
    "causal_conv_shard",
    "conv_layout",
    "HaloPlan",
    "halo_plan",
    "halo_exchange",
    "SeqParShortConv",
    "is_short_conv",
    "find_short_convs",
    "MixerFamily",
    "chunk_initial_states",
    "SeqParMambaMixer",
    "SeqParMamba2Mixer",
    "SeqParLightningAttention",
    "SeqParRecurrentBlock",
]
