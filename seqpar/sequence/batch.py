"""Cut training batches along the sequence for sequence parallelism, and feed them to every rank.

Every rank of one SP group receives the *same* sample and keeps its own piece of the sequence;
ranks of different DP groups receive different samples. ``shard_batch`` does the cut for one batch,
``ShardedDataLoader`` wraps a ``DataLoader`` so that both rules hold for a whole epoch.

Causal-LM labels are shifted **before** the cut: ``shift_labels[:, t]`` is the target of the
logits at position ``t`` (the token at ``t + 1``), so the last token of a shard keeps its true next
token even though that token lives on another rank. ``shard_batch`` returns them under the key
``shift_labels`` and drops ``labels``, so a Hugging Face model called as ``model(**batch)`` cannot
compute a silently wrong per-shard loss; compute the loss with
:func:`seqpar.sequence.loss.sequence_parallel_loss` (or pass ``shift_labels=`` to transformers'
``ForCausalLMLoss``, then reduce with :func:`seqpar.sequence.loss.sequence_parallel_mean`).

Why padding goes at the end only: seqpar attention takes no key mask. A length that does not divide
into ``P`` (``2P`` for zigzag) chunks is padded at the end; under causal attention a real token never
attends to a later position, so end padding cannot change any real token's output, and the padded
positions get ``ignore_index`` labels so they add nothing to the loss. Right-padded batches (an
``attention_mask`` of ones followed by zeros) are the same situation and are accepted the same way.
Left padding, holes, and any padding under non-causal attention would need a key mask: they are
refused with a message that says what to do.

Packed documents (batch 1, as ``transformers.DataCollatorWithFlattening`` makes them): the *global*
boundaries are derived from the full batch before the cut (:func:`document_boundaries`):
``cu_seq_lens_q``/``cu_seq_lens_k`` when given (they win), else the restarts of ``position_ids``.
``shard_batch`` returns them as ``cu_seq_lens_q``/``cu_seq_lens_k`` (int32, on the host, identical
on every rank; ``max_length_q/k`` updated), which the swapped attention hands to
``seqpar.attention(cu_seqlens=...)``. For a packed batch the end padding is **one more segment**
(its positions restart at 0, it sees only itself) instead of continuing the last document's count:
the boundaries, not the positions, tell documents apart there. Unpacked batches keep the old rule
(padded positions count on, so the padding never looks like a new document).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
)

from seqpar.runtime.groups import default_manager, resolve_group
from seqpar.sequence.boundaries import (
    boundary_tensor,
    drop_empty_documents,
    host_boundaries,
    known_boundaries,
)
from seqpar.sequence.call_group import GROUP_KEY
from seqpar.sequence.dynamic import CostModel, DynamicPlan, plan_from_config
from seqpar.sequence.dynamic_batch import packed_micro_batches, step_targets
from seqpar.sequence.sharding import length_multiple, resolve_sharding, shard_index

__all__ = ["shard_batch", "global_positions", "ShardedDataLoader", "sp_rank_and_size",
           "document_boundaries", "PACKED_KEYS", "TOKEN_MASK_KEY", "rank_micro_batches",
           "dynamic_budget_problem"]

logger = logging.getLogger("seqpar")

# transformers' flash-varlen keyword inputs of a packed batch (DataCollatorWithFlattening).
PACKED_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")

TOKEN_MASK_KEY = "seqpar_token_mask"
"""Added by :func:`shard_batch` only when the batch has padding (seqpar's end padding, or a right-padded
``attention_mask``): ``(B, S_local)`` int64, 1 where one process would have a token its attention mask
keeps. Statistics over the tokens of a call (MoE router losses and expert counts) must skip the rest;
the swapped Hugging Face model takes the key out of the call (:mod:`seqpar.swap.moe`)."""

# Keys whose padding value is fixed by their meaning; any other cut tensor is padded with 0.
_LABEL_KEYS = ("labels", "shift_labels")


def sp_rank_and_size(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """This rank's position in the SP group and the group's size; ``(0, 1)`` without a group.

    ``group=None`` means the default manager's SP group; without one on a world > 1 it is an error
    (see :func:`seqpar.runtime.groups.resolve_group`).
    """
    group = resolve_group(group)
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


# The global positions a rank holds: one definition, in seqpar.sequence.sharding (kept here under its old name).
global_positions = shard_index


def _check_boundaries(bounds: tuple[int, ...], seq_len: int, where: str) -> tuple[int, ...]:
    """``bounds`` checked, without zero-length documents (repeated entries: flash-attn, Megatron and
    TransformerEngine accept them, e.g. a fixed-size ``cu_seqlens`` padded with copies of S): an empty document
    holds no token, so every consumer of the batch's boundaries (attention, positions, mixers, loss) sees the
    same documents it would without it."""
    if (not bounds or bounds[0] != 0 or bounds[-1] != seq_len
            or any(b < a for a, b in zip(bounds, bounds[1:]))):
        raise ValueError(
            f"{where}: packed-document boundaries {list(bounds[:8])}{'...' if len(bounds) > 8 else ''} must "
            f"start at 0, never decrease (a repeat, a zero-length document, is allowed) and end at the sequence "
            f"length {seq_len} (the cu_seq_lens_q of transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True))"
        )
    return drop_empty_documents(bounds)


def document_boundaries(batch: Mapping[str, Any], seq_len: int) -> tuple[int, ...] | None:
    """Global packed-document boundaries ``(0, l1, l1+l2, ..., seq_len)`` of a full batch, or ``None``.

    ``cu_seq_lens_q`` (else ``cu_seq_lens_k``) wins when given; otherwise a ``position_ids`` row that
    does not go up by one (transformers' own rule, ``find_packed_sequence_indices``) starts a new
    document. Unpacked batches (no key, positions counting up) give ``None``. Given boundaries are
    read with one device-to-host copy (:func:`seqpar.sequence.boundaries.host_boundaries`).

    Raises:
        ValueError: packed with batch size > 1 (boundaries are per sequence, as for flash varlen);
            ``cu_seq_lens_q`` and ``cu_seq_lens_k`` that differ; malformed boundaries.
    """
    cu_q, cu_k = batch.get("cu_seq_lens_q"), batch.get("cu_seq_lens_k")
    ref = next((batch[k] for k in ("input_ids", "inputs_embeds", "labels", "shift_labels")
                if isinstance(batch.get(k), Tensor)), None)
    batch_size = ref.shape[0] if ref is not None else 1
    if cu_q is not None or cu_k is not None:
        bounds = _given_boundaries(cu_q, cu_k)
    else:
        pos = batch.get("position_ids")
        if not isinstance(pos, Tensor) or pos.dim() != 2 or pos.shape[-1] != seq_len:
            return None
        restarts = pos.diff(dim=-1) != 1
        if not bool(restarts.any()):
            return None
        if pos.shape[0] != 1 or batch_size != 1:
            raise ValueError(
                f"packed sequences (position_ids restart) need batch size 1, got {batch_size}: pack "
                "the documents into one row (transformers.DataCollatorWithFlattening does)"
            )
        starts = restarts[0].nonzero().reshape(-1) + 1  # where documents 2, 3, ... begin
        bounds = (0, *host_boundaries(starts), seq_len)
    if batch_size != 1:
        raise ValueError(
            f"packed documents (cu_seq_lens_q) need batch size 1, got {batch_size}: pack the "
            "documents into one row (transformers.DataCollatorWithFlattening does)"
        )
    return _check_boundaries(bounds, seq_len, "packed batch")


def _given_boundaries(cu_q: Any, cu_k: Any) -> tuple[int, ...]:
    """``cu_seq_lens_q``/``cu_seq_lens_k`` as host ints, checked equal: one copy to the host for
    both (a batch moved to an accelerator key by key holds them as two tensors)."""
    flat_q, flat_k = (t.reshape(-1) if isinstance(t, Tensor) and t.dim() != 1 else t for t in (cu_q, cu_k))
    if flat_q is None or flat_k is None or flat_k is flat_q:
        return host_boundaries(flat_q if flat_q is not None else flat_k)
    known = [known_boundaries(t) if isinstance(t, Tensor) else None for t in (flat_q, flat_k)]
    if None not in known:  # both read before (shard_batch's, boundary_tensor's): no copy at all
        bounds, bounds_k = known
    elif isinstance(flat_q, Tensor) and isinstance(flat_k, Tensor) and flat_q.device == flat_k.device:
        both = host_boundaries(torch.cat([flat_q, flat_k.to(flat_q.dtype)]))
        bounds, bounds_k = both[: flat_q.numel()], both[flat_q.numel():]
    else:
        bounds, bounds_k = host_boundaries(flat_q), host_boundaries(flat_k)
    if bounds_k != bounds:
        raise ValueError("packed batch: cu_seq_lens_q and cu_seq_lens_k differ; seqpar supports "
                         "self-attention over one packed sequence (they must be equal)")
    return bounds


def _is_right_padded(mask: Tensor) -> bool:
    """True when every row of a (batch, seq) 0/1 mask is ones followed by zeros."""
    m = mask.bool().to(torch.int8)
    # Once a row turns 0 it must stay 0: the sequence never increases.
    return bool((m[:, 1:] <= m[:, :-1]).all())


def _shift_left(labels: Tensor, ignore_index: int) -> Tensor:
    # (B, S, ...) -> (B, S, ...): out[:, t] = labels[:, t + 1], the last position has no target.
    tail = torch.full_like(labels[:, :1], ignore_index)
    return torch.cat([labels[:, 1:], tail], dim=1)


def _pad_end(x: Tensor, pad: int, value: int | float | bool) -> Tensor:
    # (B, S, ...) -> (B, S + pad, ...), `value` in the new positions.
    if pad == 0:
        return x
    fill = torch.full((x.shape[0], pad, *x.shape[2:]), value, dtype=x.dtype, device=x.device)
    return torch.cat([x, fill], dim=1)


def shard_batch(
    batch: Mapping[str, Any],
    *,
    group: dist.ProcessGroup | None = None,
    sharding: str | None = None,
    causal_lm: bool = True,
    ignore_index: int = -100,
    pad_token_id: int = 0,
) -> dict[str, Any]:
    """This rank's piece of a batch, cut along the sequence (dim 1).

    Every tensor whose dim 1 has the sequence length ``S`` (taken from ``input_ids``, else
    ``inputs_embeds``, else ``labels``) is cut: ``input_ids`` ``(B, S)``, ``labels``,
    ``position_ids`` ``(B, S)`` or ``(1, S)``, ``attention_mask`` ``(B, S)``, ``inputs_embeds``
    ``(B, S, H)``, ... Everything else is passed through unchanged.

    Args:
        batch: the full batch, identical on every rank of the SP group.
        group: the SP group (default: the default manager's SP group; without one on a world > 1: an
            error, see :func:`seqpar.runtime.groups.resolve_group`).
        sharding: ``"contiguous"``, ``"zigzag"`` or ``"balanced"`` (packed batches: the layout
            comes from their boundaries), as configured for attention. Default: the run's declared
            sharding, else ``"contiguous"`` (:func:`seqpar.sequence.sharding.resolve_sharding`).
        causal_lm: the model is a causal LM: ``labels`` are shifted by one before the cut and
            returned as ``shift_labels`` (``labels`` is dropped), and end padding needs no key mask.
            With ``False``, ``labels`` are cut as they are and any padding is refused.
        ignore_index: label of positions that must not count in the loss.
        pad_token_id: ``input_ids`` value of padded positions.

    Returns:
        A new dict: cut tensors ``(B, S_pad // P, ...)`` in this rank's sharding order, where
        ``S_pad`` is ``S`` rounded up to a multiple of ``P`` (``2P`` for zigzag); ``position_ids``
        (created as ``0..S_pad-1`` when absent) hold *global* positions so rotary and absolute
        position embeddings see the true positions; ``shift_labels`` when ``causal_lm`` and
        ``labels`` were given; for packed batches (see the module docstring) the global
        boundaries as ``cu_seq_lens_q``/``cu_seq_lens_k`` (end padding as one more document) and
        ``max_length_q``/``max_length_k``.

    Raises:
        ValueError: no sequence tensor found; an ``attention_mask`` that is not right padding;
            padding needed with ``causal_lm=False``; ``sharding`` contradicts the run's declared one.
    """
    sharding = resolve_sharding(sharding, where="shard_batch")
    rank, world_size = sp_rank_and_size(group)
    out: dict[str, Any] = dict(batch)
    batch_size, seq_len, device = _sequence_shape(out)
    multiple = length_multiple(world_size, sharding)
    pad = (-seq_len) % multiple
    bounds = document_boundaries(out, seq_len)  # global, before the cut
    given_mask = out.get("attention_mask")
    _accept_right_padding(out, causal_lm=causal_lm, ignore_index=ignore_index)
    if pad or (isinstance(given_mask, Tensor) and given_mask is not out.get("attention_mask")):
        kept = given_mask.long() if isinstance(given_mask, Tensor) and given_mask.dim() == 2 else None
        out[TOKEN_MASK_KEY] = kept if kept is not None else torch.ones(batch_size, seq_len, dtype=torch.long,
                                                                       device=device)
    if pad and not causal_lm:
        raise ValueError(
            f"sequence length {seq_len} is not a multiple of {multiple} ({sharding} sharding over "
            f"{world_size} ranks) and causal_lm=False: padding a non-causal model would need a key "
            f"mask, which seqpar attention does not take. Use a length divisible by {multiple}"
        )
    _shift_labels_and_add_positions(out, causal_lm=causal_lm, ignore_index=ignore_index,
                                    batch_size=batch_size, seq_len=seq_len, device=device)
    padded_bounds = None if bounds is None else ((*bounds, seq_len + pad) if pad else bounds)
    keep = global_positions(seq_len + pad, rank, world_size, sharding, device=device,
                            cu_seqlens=padded_bounds)
    for key, value in out.items():
        if isinstance(value, Tensor) and value.dim() >= 2 and value.shape[1] == seq_len:
            padded = _pad_sequence_tensor(key, value, seq_len=seq_len, pad=pad, packed=bounds is not None,
                                          ignore_index=ignore_index, pad_token_id=pad_token_id)
            out[key] = padded.index_select(1, keep.to(padded.device))
    if padded_bounds is not None:
        _set_boundaries(out, padded_bounds)
    if pad:
        logger.debug("shard_batch: padded sequence length %d -> %d at the end", seq_len, seq_len + pad)
    return out


def _sequence_shape(batch: Mapping[str, Any]) -> tuple[int, int, torch.device]:
    """``(batch size, sequence length, device)`` of the batch's reference tensor: ``input_ids``, else
    ``inputs_embeds``, ``labels``, ``shift_labels``."""
    ref = next((batch[k] for k in ("input_ids", "inputs_embeds", "labels", "shift_labels")
                if isinstance(batch.get(k), Tensor)), None)
    if ref is None or ref.dim() < 2:
        raise ValueError(
            "shard_batch needs 'input_ids' (B, S), 'inputs_embeds' (B, S, H) or 'labels' (B, S) "
            f"to find the sequence length; got keys {sorted(batch)}"
        )
    return ref.shape[0], ref.shape[1], ref.device


def _accept_right_padding(out: dict[str, Any], *, causal_lm: bool, ignore_index: int) -> None:
    """Turn a right-padded ``attention_mask`` into all ones, its pads' labels into ``ignore_index``
    (in place); refuse any other mask (see the module docstring: seqpar attention takes no key mask)."""
    mask = out.get("attention_mask")
    if not isinstance(mask, Tensor):
        return
    if mask.dim() != 2:
        raise ValueError(
            f"shard_batch takes a 2D attention_mask (batch, seq); got shape {tuple(mask.shape)}. "
            "seqpar attention takes no custom (4D) mask"
        )
    if bool(mask.bool().all()):
        return
    if not causal_lm:
        raise ValueError(
            "the batch has padding (attention_mask has zeros) but causal_lm=False: non-causal "
            "attention would need a key mask, which seqpar attention does not take. Use "
            "unpadded sequences of a length divisible by the SP size"
        )
    if not _is_right_padded(mask):
        raise ValueError(
            "attention_mask is not right padding (ones then zeros in every row): left "
            "padding or holes need a key mask, which seqpar attention does not take. Pad on "
            "the right (tokenizer.padding_side = 'right'); for packed documents, train on "
            "unpacked sequences"
        )
    # Right padding under causal attention: real tokens never see the later pads, so the
    # mask can become all ones, provided pads carry no loss.
    if "labels" in out and isinstance(out["labels"], Tensor):
        valid = mask.bool().reshape(mask.shape + (1,) * (out["labels"].dim() - 2))
        out["labels"] = out["labels"].masked_fill(~valid, ignore_index)
    out["attention_mask"] = torch.ones_like(mask)


def _shift_labels_and_add_positions(out: dict[str, Any], *, causal_lm: bool, ignore_index: int,
                                    batch_size: int, seq_len: int, device: torch.device) -> None:
    """In place: causal-LM ``labels`` -> ``shift_labels`` (shifted on the full sequence, before the
    cut, so a shard's last token keeps its target); ``position_ids`` ``0..S-1`` when absent."""
    if causal_lm and isinstance(out.get("labels"), Tensor):
        out["shift_labels"] = _shift_left(out.pop("labels"), ignore_index)
    if not isinstance(out.get("position_ids"), Tensor):
        out["position_ids"] = torch.arange(seq_len, device=device).expand(batch_size, seq_len)


def _pad_sequence_tensor(key: str, value: Tensor, *, seq_len: int, pad: int, packed: bool,
                         ignore_index: int, pad_token_id: int) -> Tensor:
    """``value`` (``(B, S, ...)``) padded at the end of dim 1 by ``pad``, with what its key means."""
    if key == "position_ids" and packed:
        # Packed: the padding is one more document, so its positions restart at 0.
        tail = torch.arange(pad, device=value.device, dtype=value.dtype).expand(value.shape[0], pad)
        return torch.cat([value, tail], dim=1)
    if key == "position_ids":
        # Padded tokens continue the count (S, S+1, ...): the positions stay increasing by one,
        # so nothing downstream mistakes the padding for a new packed document.
        tail = torch.arange(seq_len, seq_len + pad, device=value.device, dtype=value.dtype)
        return torch.cat([value, (value[:, -1:] - (seq_len - 1)) + tail], dim=1) if pad else value
    if key in _LABEL_KEYS:
        return _pad_end(value, pad, ignore_index)
    if key == "input_ids":
        return _pad_end(value, pad, pad_token_id)
    if key == "attention_mask":
        return _pad_end(value, pad, 1)  # causal: pads need no key mask (module docstring)
    return _pad_end(value, pad, 0)


def _set_boundaries(out: dict[str, Any], bounds: tuple[int, ...]) -> None:
    # On the host on purpose: the attention plan is built from host integers, so a GPU copy would
    # cost a device-to-host read; int32 like DataCollatorWithFlattening's; their host ints known.
    longest = max(b - a for a, b in zip(bounds, bounds[1:]))
    out.update(cu_seq_lens_q=boundary_tensor(bounds), cu_seq_lens_k=boundary_tensor(bounds),
               max_length_q=longest, max_length_k=longest)
    for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
        # a compiled swapped model takes the boundaries as a tensor (seqpar.swap.traced): their number
        # varies by batch, so dynamo traces it as a size symbol from the first batch on, not one graph
        # per number of documents
        torch._dynamo.maybe_mark_dynamic(out[key], 0)


def dynamic_budget_problem(max_tokens_per_rank: int, sharding: str) -> str | None:
    """What is wrong with a dynamic-CP token budget under ``sharding`` (``None``: nothing).

    :func:`shard_batch` pads each rank's share of a micro-batch to a multiple of ``length_multiple(1, sharding)``
    (1 contiguous, 2 zigzag, 8 balanced); the planner keeps a micro-batch of ``c`` ranks within
    ``c * max_tokens_per_rank`` tokens, so unless the budget is such a multiple a rank's cut holds more than the
    budget (fuzzer case 1146194759: balanced sharding, max_tokens_per_rank 6, one rank holding 8). The runtime
    (:func:`rank_micro_batches`) and the launcher's ``--validate-only`` both ask this, so the two say the same.
    """
    multiple = length_multiple(1, sharding)
    if max_tokens_per_rank % multiple == 0:
        return None
    return (f"sequence_parallel.dynamic.max_tokens_per_rank = {max_tokens_per_rank} is not a multiple of {multiple}, "
            f"and {sharding} sharding pads each rank's share of a micro-batch to a multiple of {multiple}, over the "
            f"budget: choose max_tokens_per_rank a multiple of {multiple} (e.g. "
            f"{max(multiple, max_tokens_per_rank - max_tokens_per_rank % multiple)})")


def rank_micro_batches(
    plan: DynamicPlan, docs: list[Tensor], manager: Any, *, labels: list[Tensor] | None = None,
    sharding: str | None = None, pad_token_id: int = 0, ignore_index: int = -100,
) -> list[dict[str, Any]]:
    """Length-aware dynamic CP: this rank's model inputs for every slot of ``plan``
    (:mod:`seqpar.sequence.dynamic_batch`), the same number on every rank of the pool.

    Args:
        plan: the step's plan (the same on every rank), over ``manager``'s pool.
        docs: the step's documents, 1-D token tensors, ``docs[i]`` of length ``plan.lengths[i]``.
        manager: the process-group manager built with the ``sequence_parallel.dynamic`` block.
        labels: each document's labels (default: its tokens); a document's first label never counts.
        sharding, pad_token_id, ignore_index: as for :func:`shard_batch`.

    Returns:
        ``plan.num_slots`` dicts: :func:`shard_batch`'s cut of the slot's packed micro-batch over its group,
        plus ``num_items_in_batch`` (the targets of the whole step over the pool) and
        :data:`~seqpar.sequence.call_group.GROUP_KEY` (the group); pass each as ``model(**inputs)``. The loss
        is then the per-token mean over the pool's step once summed over slots and groups; sum the gradients
        over the pool once per step.

    Raises:
        ValueError: ``plan.max_tokens_per_rank`` is not a multiple of what the sharding pads each rank's share to
            (2 for zigzag, 8 for balanced): the cut would hold more than the budget.
    """
    sharding = resolve_sharding(sharding, manager=manager, where="rank_micro_batches")
    problem = dynamic_budget_problem(plan.max_tokens_per_rank, sharding)
    if problem is not None:
        raise ValueError("dynamic CP: " + problem)
    targets = step_targets(docs, labels, ignore_index)
    out = []
    for batch, group in packed_micro_batches(plan, docs, manager, labels=labels, pad_token_id=pad_token_id,
                                             ignore_index=ignore_index):
        inputs = shard_batch(batch, group=group, sharding=sharding, ignore_index=ignore_index,
                             pad_token_id=pad_token_id)
        if "cu_seq_lens_q" not in batch:  # an empty micro-batch: no token counts in router statistics either
            inputs[TOKEN_MASK_KEY] = torch.zeros_like(inputs["input_ids"])
        inputs["num_items_in_batch"] = targets
        inputs[GROUP_KEY] = group
        out.append(inputs)
    return out


class ShardedDataLoader:
    """A ``DataLoader`` whose batches are cut for sequence parallelism.

    The wrapped loader's dataset, batch size and collate function are kept; its sampler is replaced
    by a ``DistributedSampler`` over the **DP** axis, so ranks of one SP group draw the same samples
    (and keep distinct shards of them) while DP replicas draw distinct samples. Shuffling follows
    the wrapped loader (``RandomSampler`` -> shuffled, seeded by ``seed`` and the epoch).

    Args:
        dataloader: a map-style ``DataLoader`` yielding dict batches. A loader that already has a
            ``DistributedSampler`` is kept as it is, provided that sampler is over the DP axis.
        manager: the ``ProcessGroupManager`` (default: ``seqpar.runtime.groups.default_manager()``; without
            one, the SP group is ``group`` and there is no data parallelism).
        group: SP group override (default: the manager's SP group; with neither on a world > 1: an
            error at construction, see :func:`seqpar.runtime.groups.resolve_group`).
        sharding, causal_lm, ignore_index, pad_token_id: as for :func:`shard_batch` (``sharding``
            defaults to the manager's declared sharding).
        seed: shuffling seed, the same on every rank.

    ``len(loader)`` is the number of batches per epoch; call ``loader.set_epoch(epoch)`` (or
    ``loader.sampler.set_epoch``) each epoch to reshuffle.

    Dynamic mode (``dynamic=``, length-aware dynamic CP: the ``sequence_parallel.dynamic`` block, a
    ``DynamicConfig`` or a dict ``{"max_tokens_per_rank": N, "min_size": 1}``; ``cost``: the planner's
    :class:`~seqpar.sequence.dynamic.CostModel`): each batch of the wrapped loader is one step's documents,
    the **same on every rank of the pool** (its sampler is kept; the samples are not split over DP), given
    as a dict of ``input_ids`` (and optionally ``labels``), each a list of 1-D tensors (a ``collate_fn``
    that keeps the documents apart, e.g. ``lambda s: {k: [x[k] for x in s] for k in s[0]}``). The step is
    planned over the manager's pool and the loader yields, per step, this rank's list of micro-batch inputs
    (:func:`rank_micro_batches`: as many on every rank, each carrying its group).
    """

    def __init__(
        self,
        dataloader: DataLoader,
        *,
        manager: Any | None = None,
        group: dist.ProcessGroup | None = None,
        sharding: str | None = None,
        causal_lm: bool = True,
        ignore_index: int = -100,
        pad_token_id: int = 0,
        seed: int = 0,
        dynamic: Any = None,
        cost: CostModel | None = None,
    ) -> None:
        manager = manager if manager is not None else default_manager()
        self.dynamic, self.cost, self.manager = dynamic, cost, manager
        if dynamic is not None:
            if isinstance(dynamic, Mapping):
                from seqpar.config import DynamicConfig

                self.dynamic = DynamicConfig.from_dict(dynamic)
            if manager is None or not manager.dynamic_sizes:
                raise ValueError(
                    "ShardedDataLoader(dynamic=...) needs the process-group manager built with the same "
                    "sequence_parallel.dynamic block (init_process_groups(config=...)), which makes the groups")
        if manager is not None:
            dp_rank, dp_size = manager.get_data_parallel_rank(), manager.get_data_parallel_world_size()
            group = group if group is not None else manager.get_sequence_parallel_group()
        else:
            dp_rank, dp_size = 0, 1
            if group is None:
                resolve_group(None)  # no manager on a world > 1: the error now, not at the first batch
        self.group = group
        # resolved here, against the manager's declaration: a contradiction fails before the first batch
        self.sharding = resolve_sharding(sharding, manager=manager, where="ShardedDataLoader")
        self.causal_lm = causal_lm
        self.ignore_index = ignore_index
        self.pad_token_id = pad_token_id
        # dynamic CP plans over the whole pool: every rank draws the same documents
        self.dataloader = dataloader if dynamic is not None else self._with_dp_sampler(dataloader, dp_rank, dp_size,
                                                                                      seed)

    @staticmethod
    def _with_dp_sampler(dl: DataLoader, dp_rank: int, dp_size: int, seed: int) -> DataLoader:
        if isinstance(dl.dataset, IterableDataset):
            raise ValueError(
                "ShardedDataLoader needs a map-style dataset to give DP replicas distinct samples and "
                "SP ranks the same ones; an IterableDataset must do that itself: yield the same "
                "samples on every rank of an SP group, then call seqpar.sequence.batch.shard_batch per batch"
            )
        if isinstance(dl.sampler, DistributedSampler):
            if (dl.sampler.num_replicas, dl.sampler.rank) != (dp_size, dp_rank):
                raise ValueError(
                    f"the loader's DistributedSampler has num_replicas={dl.sampler.num_replicas}, "
                    f"rank={dl.sampler.rank}, but the data-parallel axis is size {dp_size}, rank "
                    f"{dp_rank}: ranks of one SP group must draw the same samples. Build it with "
                    "num_replicas=manager.dp_size, rank=manager.dp_rank, or pass a plain loader"
                )
            return dl
        if dl.batch_size is None or type(dl.batch_sampler) is not BatchSampler:
            raise ValueError(
                "ShardedDataLoader cannot re-split a loader with a custom batch_sampler (or "
                "batch_size=None) across DP replicas; give it a loader built with batch_size=..."
            )
        sampler = DistributedSampler(
            dl.dataset, num_replicas=dp_size, rank=dp_rank,
            shuffle=isinstance(dl.sampler, RandomSampler), seed=seed, drop_last=dl.drop_last,
        )
        return DataLoader(
            dl.dataset, batch_size=dl.batch_size, sampler=sampler, collate_fn=dl.collate_fn,
            num_workers=dl.num_workers, pin_memory=dl.pin_memory, drop_last=dl.drop_last,
            timeout=dl.timeout, worker_init_fn=dl.worker_init_fn,
            persistent_workers=dl.persistent_workers,
        )

    @property
    def sampler(self) -> Any:
        """The (DP-axis) sampler; ``set_epoch`` reshuffles."""
        return self.dataloader.sampler

    @property
    def dataset(self) -> Any:
        return self.dataloader.dataset

    @property
    def batch_size(self) -> int | None:
        return self.dataloader.batch_size

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for ``epoch`` (the same order on every rank of an SP group)."""
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.dataloader)

    def __iter__(self) -> Iterator[Any]:
        if self.dynamic is not None:
            yield from self._dynamic_steps()
            return
        for batch in self.dataloader:
            if not isinstance(batch, Mapping):
                raise TypeError(
                    f"ShardedDataLoader needs dict batches (e.g. {{'input_ids': ..., 'labels': ...}}), "
                    f"got {type(batch).__name__}; return a dict from the dataset or collate_fn"
                )
            yield shard_batch(
                batch, group=self.group, sharding=self.sharding, causal_lm=self.causal_lm,
                ignore_index=self.ignore_index, pad_token_id=self.pad_token_id,
            )

    def _dynamic_steps(self) -> Iterator[list[dict[str, Any]]]:
        """Dynamic mode: per step, this rank's planned micro-batches (see the class docstring)."""
        for batch in self.dataloader:
            docs = batch.get("input_ids") if isinstance(batch, Mapping) else None
            if not isinstance(docs, (list, tuple)) or not all(isinstance(d, Tensor) and d.dim() == 1 for d in docs):
                raise TypeError(
                    "ShardedDataLoader(dynamic=...) needs each batch as one step's documents: a dict whose "
                    "'input_ids' (and 'labels', if any) is a list of 1-D tensors; give the loader a collate_fn that "
                    "keeps them apart, e.g. lambda s: {k: [x[k] for x in s] for k in s[0]}")
            labels = batch.get("labels")
            plan = plan_from_config([int(d.numel()) for d in docs], self.manager.pool_size, self.dynamic,
                                    cost=self.cost, sharding=self.sharding)
            yield rank_micro_batches(plan, list(docs), self.manager, labels=None if labels is None else list(labels),
                                     sharding=self.sharding, pad_token_id=self.pad_token_id,
                                     ignore_index=self.ignore_index)
