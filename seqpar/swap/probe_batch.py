"""The position-mixing probe on a real batch: :func:`first_forward_probe`, run at a swapped model's first
forward when the model cannot be probed on synthetic tokens at swap time (the ``"sdpa"`` and ``"mha"``
routes, Hugging Face models that need other inputs or whose parameters are not materialised yet).

It cuts the first forward's batch to :data:`seqpar.swap.probe.PROBE_LENGTH` positions, makes its
packed-document inputs describe the cut, chooses the position to change, and runs
:func:`seqpar.swap.probe.find_mixers` on it (:func:`slice_probe`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from seqpar.comm.agree import flagged_ranks
from seqpar.runtime.forward_group import forward_group
from seqpar.sequence.boundaries import boundary_tensor, host_boundaries
from seqpar.swap.options import SwapError
from seqpar.swap.probe import (
    PROBE_LENGTH,
    Mixer,
    ProbeFailed,
    find_mixers,
    is_simulated,
    mixing_refusal,
    raised_by_seqpar,
    replace_tensors,
    tensor_leaves,
)
from seqpar.swap.together import raise_together

__all__ = ["slice_probe", "first_forward_probe"]

logger = logging.getLogger("seqpar")


def slice_probe(model: nn.Module, args: tuple, kwargs: dict) -> list[Mixer] | None:
    """Probe ``model`` on the first :data:`PROBE_LENGTH` positions of a real batch (the first-forward
    probe of models without synthetic inputs: the ``"sdpa"`` and ``"mha"`` routes, and Hugging Face
    models that cannot run on synthetic tokens alone).

    The sequence input is the first tensor of at least 2 dims among the arguments (``(batch, seq, ...)``,
    the layout :func:`seqpar.sequence.batch.shard_batch` cuts); every tensor argument with the same
    dim-1 size is cut to the same positions, and a mask (last two dims the sequence) in both. Integer
    inputs (token ids) at the probed position are changed to another id seen in the batch, float inputs
    shifted by their scale.

    The cut call is a whole sequence of its own (nothing is communicated while the probe runs), so its
    packed-document inputs are made to describe the cut (:func:`_probe_documents`): ``cu_seq_lens_q``/
    ``cu_seq_lens_k``/``cu_seqlens`` ``(n_docs + 1,)`` become the documents' boundaries inside it,
    ``max_length_q/k`` the longest of them, and ``position_ids`` (``(..., seq)``) count from 0 in each.
    The probed position is the one nearest the middle whose document goes on after it (and, if possible,
    began before it), so a mixer that respects the documents still shows.

    Returns:
        The mixers, or None when the batch cannot be probed (fewer than 3 positions, one distinct id).
    """
    call = _probe_call(model, args, kwargs)
    return None if call is None else call()


def _probe_call(model: nn.Module, args: tuple, kwargs: dict) -> Callable[[], list[Mixer]] | None:
    """:func:`slice_probe` up to running the model: the probe to run, or None when the batch cannot be
    probed. Nothing runs the model or communicates before the call."""
    leaves = tensor_leaves((args, kwargs), [])
    seq_input = next((t for t in leaves if t.dim() >= 2), None)
    if seq_input is None or seq_input.shape[1] < 3:
        return None
    full = seq_input.shape[1]
    length = min(full, PROBE_LENGTH)
    cut = {id(t): _cut(t, full, length) for t in leaves
           if t.dim() >= 2 and (t.shape[1] == full or t.shape[-2:] == (full, full))}
    bounds = _probe_documents(kwargs, full, length)
    longest: dict[str, Any] = {}
    if bounds is not None:
        cut.update(_documents_as_inputs(kwargs, full, bounds))
        span = max(b - a for a, b in zip(bounds, bounds[1:]))
        longest = {k: (torch.tensor(span, dtype=kwargs[k].dtype, device=kwargs[k].device)
                       if isinstance(kwargs[k], Tensor) else span) for k in _LONGEST_KEYS if k in kwargs}
    position = _probe_position(bounds, length)
    first = cut[id(seq_input)]
    changed = first.clone()
    if first.dtype.is_floating_point:
        changed[:, position] += 1.0 + first.abs().amax()
    else:
        low, high = first.amin(), first.amax()
        if bool(low == high):
            return None
        column = changed[:, position]
        changed[:, position] = torch.where(column == high, low, high)
    plain_args, plain_kwargs = replace_tensors((args, kwargs), cut)
    perturbed_args, perturbed_kwargs = replace_tensors((args, kwargs), {**cut, id(seq_input): changed})
    plain_kwargs.update(longest)
    perturbed_kwargs.update(longest)

    def run(perturbed: bool) -> Any:
        if perturbed:
            return model(*perturbed_args, **perturbed_kwargs)
        return model(*plain_args, **plain_kwargs)

    return functools.partial(find_mixers, model, run, length, position)


def _cut(t: Tensor, full: int, length: int) -> Tensor:
    """The first ``length`` positions of a batch tensor: a mask-like one (its last two dims both the
    sequence: ``(S, S)``, ``(B, S, S)``, ``(B, H, S, S)``) in both of them, any other on dim 1
    (``(batch, seq, ...)``)."""
    if t.shape[-2:] == (full, full):
        return t.narrow(-2, 0, length).narrow(-1, 0, length)
    return t.narrow(1, 0, length)


# transformers' packed-document keywords (DataCollatorWithFlattening, seqpar.sequence.batch.shard_batch)
_BOUNDARY_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "cu_seqlens")
_LONGEST_KEYS = ("max_length_q", "max_length_k")


def _position_row(kwargs: dict, full: int) -> Tensor | None:
    """The first row of ``position_ids`` (``(..., seq)``) when given for this call's positions."""
    pos = kwargs.get("position_ids")
    if isinstance(pos, Tensor) and pos.dim() >= 1 and pos.shape[-1] == full and not pos.is_floating_point():
        return pos.reshape(-1, full)[0]
    return None


def _probe_documents(kwargs: dict, full: int, length: int) -> tuple[int, ...] | None:
    """The documents of the probe's call, as boundaries ``(0, ..., length)``; None when the call passes
    neither boundaries nor positions.

    A call that holds its whole packed sequence (its boundaries end at its length: one process) keeps
    its documents, cut at ``length``. A rank's shard holds pieces of the global sequence (its boundaries
    are the global ones): its pieces start where ``position_ids`` do not go up by one (a document start,
    or a seam between zigzag chunks), one piece without positions. Positions alone (no boundaries):
    the same rule, which is transformers' own for restarting positions.
    """
    given = next((kwargs[k] for k in _BOUNDARY_KEYS if isinstance(kwargs.get(k), Tensor)), None)
    row = _position_row(kwargs, full)
    if given is not None and given.dim() == 1 and given.numel() >= 2 and not given.is_floating_point():
        ints = host_boundaries(given)  # one host read, at the first forward only
        if ints[0] == 0 and ints[-1] == full:
            return (*[b for b in ints if b < length], length)
    if row is not None:
        starts = (row[:length].diff() != 1).nonzero().reshape(-1) + 1
        return (0, *starts.tolist(), length)
    return (0, length) if given is not None else None


def _documents_as_inputs(kwargs: dict, full: int, bounds: tuple[int, ...]) -> dict[int, Tensor]:
    """``id(given tensor) -> its replacement`` for the boundary and position keywords of the probe's call."""
    length = bounds[-1]
    new: dict[int, Tensor] = {}
    for key in _BOUNDARY_KEYS:
        given = kwargs.get(key)
        if isinstance(given, Tensor):
            new[id(given)] = boundary_tensor(bounds).to(device=given.device, dtype=given.dtype)
    pos = kwargs.get("position_ids")
    if _position_row(kwargs, full) is not None:
        edges = torch.tensor(bounds, dtype=pos.dtype, device=pos.device)
        index = torch.arange(length, dtype=pos.dtype, device=pos.device)
        within = index - edges[torch.searchsorted(edges, index, right=True) - 1]  # position in its document
        new[id(pos)] = within.expand(*pos.shape[:-1], length).contiguous()
    return new


def _probe_position(bounds: tuple[int, ...] | None, length: int) -> int:
    """The position whose input the probe changes: the middle, or (packed documents) the position nearest
    it whose document has a later position, preferring one whose document also has an earlier one: a
    causal mixer confined to its document then moves a position after it, an anti-causal one before."""
    middle = length // 2
    if bounds is None:
        return middle
    scored = []
    for start, end in zip(bounds, bounds[1:]):
        for p in range(start, end - 1):  # a later position in the same document
            scored.append((p == start, abs(p - middle), p))
    return min(scored)[2] if scored else middle


def first_forward_probe(model: nn.Module, args: tuple, kwargs: dict) -> None:
    """The probe at a swapped model's first forward, on the real batch cut to :data:`PROBE_LENGTH`
    positions (:func:`slice_probe`); run by the batch check (:mod:`seqpar.swap.batch`) before any
    communication, so a refusal is raised on every rank.

    Where the forward gathers parameters (ZeRO-3, FSDP: :func:`seqpar.runtime.forward_group.forward_group`),
    the probe's forwards are collective too: the ranks of that group first agree that every one of them
    can probe its batch (one that cannot, e.g. an empty micro-batch under dynamic CP or a shard of one
    token id, makes every rank skip the probe, with a warning), and afterwards agree the verdict, so a
    refusal is raised on every rank of that group, not only on those that saw it.

    Raises:
        SwapError: naming every module that mixes positions, or seqpar's refusal of a layer met while
            probing (on every rank of the forward's group when there is one).
    """
    if is_simulated(model):
        return
    group = forward_group(model)
    call = _probe_call(model, args, kwargs)
    if group is not None:
        unable = flagged_ranks(call is None, group)
        if unable:
            logger.warning("seqpar: the position-mixing probe could not run on the batch of rank(s) %s of the "
                           "%d ranks this model's forward gathers parameters over (fewer than 3 positions, or a "
                           "single distinct token id), and runs on all of them or none: modules mixing positions "
                           "are not checked", unable, dist.get_world_size(group))
            return
    refusal: BaseException | None = None
    if call is None:
        logger.warning("seqpar: the position-mixing probe could not run on this batch (fewer than 3 "
                       "positions, or a single distinct token id): modules mixing positions are not checked")
    else:
        try:
            mixers = call()
        except ProbeFailed as failed:
            if raised_by_seqpar(failed.error):
                refusal = failed.error  # seqpar's own refusal of this batch, as the forward would raise it
            else:
                logger.warning("seqpar: the position-mixing probe could not run the model on the first %d "
                               "positions of this batch (%s); modules mixing positions are not checked",
                               PROBE_LENGTH, failed)
        else:
            if mixers:
                refusal = SwapError(f"{mixing_refusal(mixers, type(model).__name__)} The model stays swapped, "
                                    "and refuses every forward.")
    if group is not None:
        refused = flagged_ranks(refusal is not None, group)  # the verdict can differ: each rank probed its own batch
        if refused:
            raise_together(group, refused, refusal, f"seqpar: the position-mixing probe refused the batch of "
                           f"rank(s) {refused} of the ranks this model's forward gathers parameters over", "a gather")
    if refusal is not None:
        raise refusal from None
