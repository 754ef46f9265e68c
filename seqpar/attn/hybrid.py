"""2-D hybrid sequence parallelism: Ulysses inside groups of ``u`` consecutive ranks, ring across them
(USP in yunchang, ``a2a+p2p`` in TransformerEngine, Double-Ring in LoongTrain).

The SP group of ``P`` ranks is a ``(P/u, u)`` grid (:class:`seqpar.runtime.groups.ProcessGroupManager`): rows are
Ulysses groups, columns ring groups. The all-to-all inside a Ulysses group turns its ``u`` sequence
shards into one "super-rank" holding all ``u`` shards for ``Hq/u`` query heads; rank i of every Ulysses
group holds the same heads, so the ``u`` ring groups (one per head share) run the ring attention of
:mod:`seqpar.attn.ring` across the ``P/u`` super-ranks, overlapped and zigzag-aware as ever.

Why the sharding still fits: super-rank g holds the chunks of SP ranks ``g*u .. g*u+u-1``. Contiguous:
chunks ``g*u .. g*u+u-1``, i.e. super-chunk g of ``P/u``. Zigzag over P (rank r holds chunks r and
2P-1-r of 2P): chunks ``g*u .. g*u+u-1`` and ``2P-g*u-u .. 2P-1-g*u``, i.e. super-chunks g and
``2(P/u)-1-g`` of ``2P/u`` chunks of ``u`` each: the zigzag over P/u. Once sorted into ascending order
(:func:`seqpar.attn.ulysses.sequence_order`), the ring code sees an ordinary P/u-rank sharding, so
one sharding serves every mode and the user never re-shards.

Uneven heads (``u`` does not split them evenly, see :mod:`seqpar.attn.ulysses`) work here too: rank i of
every Ulysses group holds the same uneven share, so each ring group is uniform and runs the ring on it
(once per GQA-regular piece of the share).

Edge cases: ``u = 1`` is the ring (dispatched to it directly), ``u = P`` is Ulysses (no ring step).
Compute per ring step is ``u`` times that of a plain ring at the same P, with the same K/V bytes per
step, which is what hides a slow inter-node link.

dK/dV: the ring across super-ranks moves its accumulators as :mod:`seqpar.attn.ring` does, in
``opts.dkv_wire_dtype`` (bf16 halves them on the slow link); the all-to-all back then carries finished
gradients in the input dtype, as in Ulysses.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor

from seqpar.attn.ulysses import UlyssesAttention, UlyssesPlan
from seqpar.comm.ring import RingComm
from seqpar.runtime.groups import ProcessGroupManager

__all__ = ["hybrid_attention", "ulysses_attention"]


def ulysses_attention(
    q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup, plan: UlyssesPlan, sinks: Tensor | None = None,
) -> Tensor:
    """Ulysses over the whole of ``group`` (``u = P``): q ``(batch, q_heads, seq_local, head_dim)``, k/v
    ``(batch, kv_heads, seq_local, head_dim)`` -> like q. ``plan``: the call's head split and chunk
    order (:mod:`seqpar.attn.resolve`). Documents, windows, sinks and every sharding, ``balanced`` included."""
    return UlyssesAttention.apply(q, k, v, group, None, plan, sinks)


def hybrid_attention(
    q: Tensor, k: Tensor, v: Tensor, manager: ProcessGroupManager, plan: UlyssesPlan, sinks: Tensor | None = None,
) -> Tensor:
    """Ulysses over ``manager.ulysses_group`` and the ring across ``manager.ring_group`` (``1 < u < P``;
    the resolver sends ``u = 1`` to the ring and ``u = P`` to Ulysses). Layouts as
    :func:`ulysses_attention`; contiguous or zigzag only (the resolver refuses ``balanced``: its
    super-ranks' chunks are no ``P/u``-rank layout)."""
    ring = RingComm(manager.ring_group) if manager.ring_size > 1 else None
    return UlyssesAttention.apply(q, k, v, manager.ulysses_group, ring, plan, sinks)
