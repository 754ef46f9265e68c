"""The initial state of each chunk of a sharded linear recurrence: one all-gather of chunk summaries.

GDN / KDA, Mamba / Mamba2, lightning attention and RG-LRU are linear in their incoming state. Scanned
from a zero state, a chunk ``g`` of the global sequence ends in ``state_g``; scanned from ``h`` it
ends in ``apply(T_g, h) + state_g``, where ``T_g`` is the chunk's transition (a per-head decay product
for Mamba2 and lightning, a per-channel one for Mamba and RG-LRU, a ``d_k x d_k`` matrix per head for
GDN / KDA). So the true initial state of chunk ``g`` is the exclusive prefix

    init_0 = 0,    init_{g+1} = apply(T_g, init_g) + state_g,

reset to zero where a document starts exactly at a chunk start, and ``init_{g+1} = state_g`` when a
document starts strictly inside chunk ``g`` (what came before that start does not reach past it).

Every rank scans its own chunks from zero, the ``(T, state)`` summaries of all chunks are all-gathered
in one collective (``n x P x (|T| + |state|)`` values per rank: flat in S), and each rank folds the prefix up to its own
last chunk. The fold is tiny (at most ``n x P`` ``apply`` calls) and runs on every rank alike; the
all-gather's backward is a reduce-scatter (sum), since every rank's fold reads every summary.

For the scalar-decay families (Mamba, Mamba2 / SSD, lightning attention, RG-LRU: ``T`` a decay product,
applied elementwise) the whole step after the local scans is :func:`scalar_decay_correction`: the prefix
fold, then each chunk's leading run (the positions before its first document start) corrected by what the
incoming state adds there. Each family says only what that addition is at a position.

A ring pass (each rank waits for its predecessor's prefix) sends ``|state|`` per hop instead of
``P x (|T| + |state|)`` per rank, but serialises P hops on the critical path; the all-gather is one
collective whose bytes are independent of S.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from seqpar.comm.collectives import all_gather
from seqpar.mixers.scan_layout import ScanLayout
from seqpar.runtime.groups import resolve_group
from seqpar.sequence.boundaries import host_boundaries
from seqpar.sequence.sharding import chunk_ids

__all__ = ["chunk_initial_states", "chunk_resets", "summary_bytes", "scale_state", "scalar_decay_correction"]


def chunk_resets(num_chunks: int, seq_len: int,
                 cu_seqlens: tuple[int, ...] | None) -> tuple[tuple[bool, bool], ...]:
    """For each global chunk ``g`` (``seq_len / num_chunks`` positions): ``(at_start, inside)``:
    whether a document starts at its first position (always for chunk 0), and whether one starts
    strictly inside it."""
    if cu_seqlens is None:  # one sequence (no bisect: dynamo cannot trace it)
        return tuple((g == 0, False) for g in range(num_chunks))
    c = seq_len // num_chunks
    starts = sorted(set(cu_seqlens[:-1]))
    out = []
    for g in range(num_chunks):
        lo, hi = g * c, (g + 1) * c
        first_after = bisect.bisect_right(starts, lo)
        out.append((g == 0 or lo in starts, first_after < len(starts) and starts[first_after] < hi))
    return tuple(out)


def summary_bytes(transition: Tensor, state: Tensor, world_size: int) -> int:
    """Bytes one rank sends in :func:`chunk_initial_states`' all-gather (a ring all-gather forwards each of
    the other ranks' summaries once): ``(P - 1) x n x (|T| + |S|)`` values of the state's dtype."""
    return (world_size - 1) * (transition.numel() + state.numel()) * state.element_size()


def chunk_initial_states(
    transition: Tensor,
    state: Tensor,
    *,
    apply: Callable[[Tensor, Tensor], Tensor],
    group: dist.ProcessGroup | None,
    sharding: str,
    seq_len: int,
    cu_seqlens: Tensor | Sequence[int] | None = None,
) -> Tensor:
    """The true initial state of each of this rank's chunks.

    Args:
        transition: ``(n, *T)``, one per local chunk in local order (``n`` = 1 contiguous, 2 zigzag,
            m balanced; :func:`seqpar.sequence.sharding.chunk_ids`): the linear map from the chunk's
            initial state to its final state. Ignored for a chunk with a document start inside.
        state: ``(n, *S)``: each local chunk's final state scanned from a zero state, restarting at
            every document start inside the chunk.
        apply: ``apply(T, h)``: one chunk's transition ``(*T)`` applied to a state ``(*S)``.
        group: the SP group (None: the default manager's; no group or a group of one: zeros).
        sharding: how the sequence was cut (``"contiguous"``, ``"zigzag"``, ``"balanced"``).
        seq_len: the global sequence length S.
        cu_seqlens: global document boundaries ``[0, ..., S]`` (a tensor is read on the host once per
            batch, :func:`seqpar.sequence.boundaries.host_boundaries`), or None: one sequence.

    Returns:
        ``(n, *S)`` in ``state``'s dtype: each local chunk's initial state (zero for the sequence's
        first chunk and where a document starts at the chunk's first position). For a chunk with a
        document start strictly inside, it holds only for the positions before that start.
    """
    if transition.shape[0] != state.shape[0]:
        raise ValueError(f"chunk_initial_states: {transition.shape[0]} transitions but {state.shape[0]} states: "
                         "pass one of each per local chunk")
    group = resolve_group(group)
    world = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    cu = host_boundaries(cu_seqlens)
    layout = {"seq_len": seq_len, "cu_seqlens": cu} if sharding == "balanced" else {}
    ids = [chunk_ids(r, world, sharding, **layout) for r in range(world)]
    n = state.shape[0]
    if len(ids[rank]) != n:
        raise ValueError(f"chunk_initial_states: sharding={sharding!r} gives rank {rank} {len(ids[rank])} chunk(s), "
                         f"but {n} summaries were passed: pass one per local chunk")
    resets = chunk_resets(n * world, seq_len, cu)
    # Every rank's summaries in one all-gather, (world * n, |T| + |S|) in rank-major order: row r * n + j
    # is rank r's chunk j.
    t_shape, s_shape = transition.shape[1:], state.shape[1:]
    packed = torch.cat([transition.reshape(n, -1).to(state.dtype), state.reshape(n, -1)], dim=1)
    if world > 1:
        packed = all_gather(packed, 0, group=group, grad_reduction="sum")
    all_t = packed[:, :t_shape.numel()].reshape(-1, *t_shape)
    all_s = packed[:, t_shape.numel():].reshape(-1, *s_shape)
    where = {g: r * n + j for r, chunks in enumerate(ids) for j, g in enumerate(chunks)}
    mine = ids[rank]
    inits: dict[int, Tensor] = {}
    h = torch.zeros_like(state[0])
    for g in range(max(mine) + 1):
        at_start, inside = resets[g]
        if at_start:
            h = torch.zeros_like(state[0])
        inits[g] = h
        k = where[g]
        h = all_s[k] if inside else apply(all_t[k], h) + all_s[k]
    out = torch.stack([inits[g] for g in mine])
    # Tie the result to the gathered summaries even where every local chunk starts at zero (rank 0 of a
    # contiguous cut): otherwise that rank's backward never reaches the all-gather's reduce-scatter and the
    # other ranks wait for it forever. An empty slice's sum is exactly 0 and carries a zero gradient.
    return out + packed[:0].sum() if packed.requires_grad else out


def scale_state(transition: Tensor, state: Tensor) -> Tensor:
    """``apply`` of :func:`chunk_initial_states` for a scalar (elementwise) decay: ``transition * state``
    (``transition`` broadcasts against the state: per head, per channel, or per channel and state)."""
    return transition * state


def scalar_decay_correction(
    transition: Tensor,
    state: Tensor,
    layout: ScanLayout,
    lead_correction: Callable[[int, int, Tensor], Tensor],
    *,
    dim: int,
    group: dist.ProcessGroup | None,
    sharding: str,
) -> Tensor:
    """What the true incoming states add to this rank's zero-state outputs, for a recurrence whose
    transition is an elementwise decay (Mamba, Mamba2 / SSD, lightning attention, RG-LRU).

    Each local chunk's incoming state ``h0`` comes from :func:`chunk_initial_states` (``apply`` =
    :func:`scale_state`); only the chunk's leading run (its first ``layout.lead(j)`` positions: those
    before a document start inside it) continues ``h0``, so the rest of the chunk gets zeros.

    Args:
        transition: ``(n, *T)``: each local chunk's decay product, broadcasting against ``(*S)``.
        state: ``(n, *S)``: each local chunk's final state scanned from zero (the dtype of the fold:
            fp32 at least).
        layout: :func:`seqpar.mixers.scan_layout.scan_layout` of the batch (``world > 1``).
        lead_correction: ``lead_correction(j, lead, h0)`` -> the addition at the ``lead`` first positions
            of local chunk ``j``, laid out along ``dim`` as the outputs are.
        dim: the sequence dimension of the outputs (negative: counted from the last).
        group, sharding: the SP group and the layout the sequence was cut in.
    Returns:
        The additions for all ``seq_local`` positions, along ``dim``, in the fold's dtype (the caller adds
        them to its outputs and rounds as its layer does).
    """
    if dim >= 0:
        raise ValueError(f"scalar_decay_correction: dim={dim} must be negative (counted from the last dimension)")
    init = chunk_initial_states(transition, state, apply=scale_state, group=group, sharding=sharding,
                                seq_len=layout.seq_len, cu_seqlens=layout.cu)
    corrections = []
    for j in range(layout.chunks):
        lead = layout.lead(j)
        y = lead_correction(j, lead, init[j])
        corrections.append(F.pad(y, (0, 0) * (-dim - 1) + (0, layout.chunk_len - lead)))
    return corrections[0] if len(corrections) == 1 else torch.cat(corrections, dim=dim)
