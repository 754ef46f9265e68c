"""Input preparation of the ``"hf"`` route: :func:`prepare_inputs`, run on every swapped
``PreTrainedModel`` (by the swapped model's batch check, :mod:`seqpar.swap.batch`, for the outermost
model; a forward pre-hook of its own for models nested in something else). It

- fills ``position_ids`` with the *global* positions of this rank's shard when they are absent
  (transformers would number the shard from 0, which is wrong for rotary and absolute positions),
  and checks given ones (per-document positions for packed batches);
- reads packed documents (batch 1): ``cu_seq_lens_q/k`` (as :func:`seqpar.sequence.batch.shard_batch` or
  ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` give them; they win), or on one rank
  restarting ``position_ids``; the *global* boundaries go to the host once per batch, are compared
  across ranks by the batch check, and every layer passes them to ``seqpar.attention(cu_seqlens=)``,
  so each document sees only itself, with or without ``use_cache`` given;
- passes an all-ones ``attention_mask`` when none is given: without one, transformers reads the jump
  in a zigzag shard's positions as two packed documents;
- refuses a padding mask with zeros, a KV cache and ``use_cache=True`` (a cache of a sharded
  sequence is meaningless), and turns ``use_cache`` off when it is not given;
- passes ``shift_labels`` (as :func:`seqpar.sequence.batch.shard_batch` returns them) on as ``labels`` too, so
  ``model(**shard_batch(batch)).loss`` is computed;
- refuses ``labels=`` under SP for models whose loss is not token-level (sequence classification ...).

Everything it needs from the device is read in one host copy per batch (:func:`_read_batch`); the
verdicts are noted per tensor, so an inner model's preparer and transformers' mask factory
(:func:`all_ones`) read nothing again.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import weakref
from typing import Any

import torch
from torch import Tensor, nn

from seqpar.sequence.batch import (
    PACKED_KEYS,
    TOKEN_MASK_KEY,
    document_boundaries,
    global_positions,
    sp_rank_and_size,
)
from seqpar.sequence.boundaries import boundary_tensor, known_boundaries, remember_boundaries
from seqpar.sequence.call_group import call_group
from seqpar.sequence.sharding import SHARDINGS
from seqpar.swap import moe
from seqpar.swap.hf_call import reference_input, refuse_cache
from seqpar.swap.hf_loss import TOKEN_LOSSES, model_loss_type
from seqpar.swap.hf_padding import fill_padding
from seqpar.swap.hf_traced import prepare_traced
from seqpar.swap.options import SwapOptions
from seqpar.swap.state import is_probing

__all__ = ["prepare_inputs", "forward_signature", "padding_error", "all_ones"]


@functools.cache
def forward_signature(cls: type) -> inspect.Signature:
    """The signature of ``cls.forward`` (cached per class)."""
    return inspect.signature(cls.forward)


def padding_error(where: str) -> ValueError:
    """The error for an attention mask that marks padding (``where``: the model, or ``"mask"``)."""
    return ValueError(
        f"seqpar ({where}): the attention_mask marks padding, but seqpar attention takes no key "
        "mask. Cut batches with seqpar.sequence.batch.shard_batch, which accepts right padding under causal "
        "attention (real tokens never see later pads) and ignores the pads' labels; left padding "
        "and holes cannot be honoured"
    )


def prepare_inputs(
    options: SwapOptions, module: nn.Module, args: tuple, kwargs: dict[str, Any], *, nested: bool = False
) -> tuple[tuple, dict[str, Any]]:
    """Forward pre-hook of a swapped PreTrainedModel (see the module docstring): ``(args, kwargs)`` to
    call it with. While torch.compile traces the model: :func:`seqpar.swap.hf_traced.prepare_traced`
    (``nested``: ``module`` holds other PreTrainedModels, whose preparers run too)."""
    if torch.compiler.is_compiling():
        return prepare_traced(options, module, args, kwargs, nested=nested)
    group = call_group(kwargs, options.group)  # dynamic CP: the micro-batch's group travels with the call
    if group is not options.group:
        options = dataclasses.replace(options, group=group)
    try:
        bound = forward_signature(type(module)).bind_partial(module, *args, **kwargs)
    except TypeError:
        return args, kwargs  # let the model raise its own error for a bad call
    arguments = bound.arguments
    params = forward_signature(type(module)).parameters
    ref = reference_input(arguments)
    if ref is None:
        return args, kwargs
    where = type(module).__name__

    refuse_cache(arguments, params, where)
    extra = _var_keyword(arguments, params)
    fill_padding(module, arguments, extra.get(TOKEN_MASK_KEY))  # no zero pad embedding (seqpar.swap.hf_padding)
    moe.take_token_mask(extra)  # padding the router statistics must skip
    known = _read_batch(arguments, params, options, ref)
    _fill_attention_mask(arguments, params, ref, where, known)
    _prepare_labels(arguments, params, module, options, where)
    if "position_ids" in params:
        _fill_positions(arguments, params, options, ref, where, known)
    return _as_keywords(bound, params)


def _read_batch(arguments: dict[str, Any], params: Any, options: SwapOptions, ref: Tensor) -> dict[str, Any]:
    """Everything the input checks need from the device, read in **one** host copy per batch.

    On a GPU each read waits for the device, so the checks below read nothing of their own: this
    gathers, as int64 on the inputs' device, whether ``attention_mask`` is all ones, the
    ``cu_seq_lens_q/k`` values (unless already on the host), and the ``position_ids``: for a packed
    batch their values (the expected per-document positions need the boundaries on the host first),
    else whether they equal the shard's global positions. One ``tolist()`` of their concatenation;
    the boundaries are remembered for every later :func:`seqpar.sequence.boundaries.host_boundaries`
    (the layers', the batch check's), the mask verdict for :func:`seqpar.swap.hf_attention.seqpar_mask`.
    Returns ``{"mask": bool, "positions": list | bool}`` for what was read."""
    pieces: list[tuple[str, Any, Tensor]] = []
    known: dict[str, Any] = {}
    mask = arguments.get("attention_mask") if "attention_mask" in params else None
    if isinstance(mask, Tensor) and mask.dim() == 2:
        noted = _noted(mask, "mask")
        if noted is not None:  # an inner PreTrainedModel called by the outer one with its checked inputs
            known["mask"] = noted
        else:
            pieces.append(("mask", mask, mask.bool().all().reshape(1)))
    extra = _var_keyword(arguments, params)
    cus = {k: extra[k] for k in ("cu_seq_lens_q", "cu_seq_lens_k") if isinstance(extra.get(k), Tensor)}
    for key, cu in cus.items():
        if cu.dim() == 1 and cu.dtype in (torch.int32, torch.int64) and known_boundaries(cu) is None:
            pieces.append((key, cu, cu))
    given = arguments.get("position_ids") if "position_ids" in params else None
    seq_local = ref.shape[1]
    if isinstance(given, Tensor) and given.shape[-1] == seq_local and _noted(given, "positions"):
        known["positions"] = True  # checked (or filled) by the outer model's preparer this batch
        known["unpacked"] = bool(_noted(given, "unpacked"))
    elif isinstance(given, Tensor) and given.shape[-1] == seq_local:
        if cus:  # packed: compared on the host, against positions built from the boundaries
            pieces.append(("positions", given, given.reshape(-1, seq_local)[0]))
        else:
            rank, world_size, sharding = _shard_view(options)
            expected = global_positions(seq_local * world_size, rank, world_size, sharding,
                                        device=given.device)
            pieces.append(("positions", given, (given == expected).all().reshape(1)))
    if not pieces:
        return known
    device = pieces[0][2].device
    flat = torch.cat([p.reshape(-1).to(device=device, dtype=torch.int64) for _, _, p in pieces])
    values = flat.tolist()  # the one host copy
    at = 0
    for key, source, piece in pieces:
        part, at = values[at:at + piece.numel()], at + piece.numel()
        if key == "mask":
            known["mask"] = bool(part[0])
            _note(source, "mask", bool(part[0]))
        elif key == "positions":
            known["positions"] = part if cus else bool(part[0])
            known["unpacked"] = not cus and bool(part[0])  # the shard's global positions: no restart
        else:
            remember_boundaries(source, part)
    return known


# What this batch's input checks found, by tensor: (weak reference, version counter, kind, verdict).
# The attention mask's verdict is read once per batch (_read_batch), and not again by an inner
# PreTrainedModel's preparer, nor by the mask factory transformers calls for every layer type, which
# gets the same mask converted (``.to(torch.bool)``: a new tensor of the same shape); checked or
# filled-in position_ids are not read again by the inner model's preparer. Weak references: once the
# forward that holds the tensors ends, its notes are void.
_NOTES: list[tuple[Any, int, str, bool]] = []


def _note(t: Tensor, kind: str, verdict: bool) -> None:
    try:
        version = t._version
    except RuntimeError:  # inference mode: no version counter, not noted
        return
    _NOTES[:] = [n for n in _NOTES if n[0]() is not None and n[2] != kind] + [(weakref.ref(t), version, kind, verdict)]


def _noted(t: Tensor, kind: str) -> bool | None:
    """The verdict noted for ``t`` itself (unchanged since), else None."""
    for ref, version, k, verdict in _NOTES:
        if k == kind and ref() is t and t._version == version:
            return verdict
    return None


def all_ones(mask: Tensor) -> bool:
    """Whether a 2D attention mask marks no padding: the batch's note when ``mask`` is the batch's
    mask or its conversion (alive, unchanged, same shape and device), else read here."""
    for ref, version, kind, verdict in _NOTES:
        noted = ref()
        if (kind == "mask" and noted is not None and noted._version == version and noted.shape == mask.shape
                and noted.device == mask.device and (mask is noted or mask.dtype == torch.bool)):
            return verdict
    return bool(mask.bool().all())


def _fill_attention_mask(arguments: dict[str, Any], params: Any, ref: Tensor, where: str,
                         known: dict[str, Any]) -> None:
    """An all-ones mask when none is given (see the module docstring); a padding mask is refused."""
    if "attention_mask" not in params:
        return
    mask = arguments.get("attention_mask")
    if mask is None:
        batch, seq_local = ref.shape[0], ref.shape[1]
        arguments["attention_mask"] = torch.ones(batch, seq_local, dtype=torch.long, device=ref.device)
        _note(arguments["attention_mask"], "mask", True)
    elif isinstance(mask, Tensor) and mask.dim() == 2 and not known.get("mask", True):
        raise padding_error(where)


def _fill_positions(
    arguments: dict[str, Any], params: Any, options: SwapOptions, ref: Tensor, where: str,
    known: dict[str, Any],
) -> None:
    """Fill in ``position_ids`` (global, or per document for a packed batch) or check given ones
    (against the values or verdict of :func:`_read_batch`: no host read of its own)."""
    batch, seq_local = ref.shape[0], ref.shape[1]
    rank, world_size, sharding = _shard_view(options)
    bounds = _packed_boundaries(arguments, params, batch, seq_local, world_size, where,
                                unpacked=bool(known.get("unpacked")))
    given = arguments.get("position_ids")
    if bounds is not None:
        # built on the host from host ints, then one asynchronous copy (no device read, no blocking copy)
        host = _document_positions(global_positions(seq_local * world_size, rank, world_size, sharding,
                                                    device="cpu", cu_seqlens=bounds)[None], bounds)
        expected = host.to(ref.device, non_blocking=True)
        if given is None:
            arguments["position_ids"] = expected
        elif given.shape[-1] != seq_local or not _packed_positions_ok(given, host, known):
            row = _wrong_row(given, host)
            cut = _other_cut(row, rank, world_size, sharding, bounds) if given.shape[-1] == seq_local else None
            if cut is not None:
                raise _undeclared_cut(where, rank, world_size, cut, sharding)
            raise ValueError(
                f"seqpar ({where}): position_ids on SP rank {rank} of {world_size} are not the "
                f"per-document positions of this rank's {sharding} shard of the packed "
                f"sequence with boundaries {_short(torch.tensor(bounds))} (expected "
                f"{_short(expected[0])}, got {_short(row)}). "
                "Cut packed batches with seqpar.sequence.batch.shard_batch"
            )
        _note(arguments["position_ids"], "positions", True)
        return
    expected = global_positions(seq_local * world_size, rank, world_size, sharding,
                                device=ref.device)[None]  # (1, S_local)
    if given is None:
        arguments["position_ids"] = expected.expand(batch, seq_local)
    elif given.shape[-1] != seq_local or not known.get("positions", True):
        _refuse_positions(given, expected, rank, world_size, sharding, where)
    _note(arguments["position_ids"], "positions", True)
    _note(arguments["position_ids"], "unpacked", True)  # an inner model's preparer reads no restarts


def _shard_view(options: SwapOptions) -> tuple[int, int, str]:
    """``(rank, world_size, sharding)`` of the call being prepared. While the position-mixing probe runs
    (:mod:`seqpar.swap.probe`) nothing is communicated and its call (13 tokens, or the first forward's
    batch cut to them, with its documents and positions made to describe the cut) is a whole sequence on
    one process: ``(0, 1, "contiguous")``, as for the probe's loss."""
    if is_probing():
        return 0, 1, "contiguous"
    rank, world_size = sp_rank_and_size(options.group)
    return rank, world_size, options.sharding


def _packed_positions_ok(given: Tensor, expected: Tensor, known: dict[str, Any]) -> bool:
    """``given`` (``(B, S_local)``) equals the host ``expected`` (``(1, S_local)``) in every row; the
    first row's values come from the batch's one read, further rows (rare: packed batches have one) are
    compared on the device."""
    first = known.get("positions")
    if first is True:  # checked this batch already (the outer model's preparer)
        return True
    if not isinstance(first, list):  # not read with the batch (e.g. on the host already): compare here
        return bool((given == expected.to(given.device)).all())
    if first != expected[0].tolist():
        return False
    return given.shape[0] == 1 or bool((given == expected.to(given.device)).all())


def _wrong_row(given: Tensor, expected: Tensor) -> Tensor:
    """The first row of ``given`` (``(B, S_local)``) that differs from ``expected`` (``(1, S_local)``), else
    the first row. Only on the error path (a host read): a batch whose first row is right and a later one wrong
    is refused for the later one, which the message shows and whose cut :func:`_other_cut` judges (mut33b)."""
    rows = given.reshape(-1, given.shape[-1]).cpu()
    if rows.shape[-1] == expected.shape[-1]:
        wrong = (rows != expected[0].cpu().to(rows.dtype)).any(-1).nonzero()
        if wrong.numel():
            return rows[int(wrong[0, 0])]
    return rows[0]


def _other_cut(row: Tensor, rank: int, world_size: int, sharding: str,
               bounds: tuple[int, ...] | None = None) -> str | None:
    """The sharding other than ``sharding`` whose cut gives this rank exactly the positions ``row``
    (``(S_local,)``; per document with the packed ``bounds``), else None. Only on the error path (a host read)."""
    seq_len = row.shape[0] * world_size
    for other in SHARDINGS:
        if other == sharding:
            continue
        try:
            expected = global_positions(seq_len, rank, world_size, other, device="cpu", cu_seqlens=bounds)[None]
        except ValueError:  # the length cannot be cut that way
            continue
        if bounds is not None:
            expected = _document_positions(expected, bounds)
        if torch.equal(row.cpu(), expected[0].to(row.dtype)):
            return other
    return None


def _undeclared_cut(where: str, rank: int, world_size: int, cut: str, sharding: str) -> ValueError:
    """A batch cut with another sharding (``shard_batch(sharding="zigzag")`` in a run that declares none): its
    positions are right for that cut, and the fix is to declare it for the run."""
    return ValueError(
        f"seqpar ({where}): position_ids on SP rank {rank} of {world_size} are this rank's positions of a "
        f"{cut!r} cut, but the swapped model runs sharding {sharding!r} (the run's declared sharding, "
        f"'contiguous' when none is declared): declare \"sharding\": \"{cut}\" in the sequence_parallel block "
        f"(or init_process_groups(sharding={cut!r})), so that the batch's cut, the attention and the loss "
        "agree, or cut the batch with the run's sharding"
    )


def _refuse_positions(
    given: Tensor, expected: Tensor, rank: int, world_size: int, sharding: str, where: str
) -> None:
    """Raise for ``position_ids`` that are not the shard's global positions, saying why they may be wrong."""
    row = _wrong_row(given, expected)
    restarts = bool((row.diff() < 0).any())
    what = (
        "they restart (packed sequences): on shards the global document boundaries are "
        "needed; cut packed batches (batch 1) with seqpar.sequence.batch.shard_batch, which passes "
        "them as cu_seq_lens_q/k"
        if restarts else
        "pass the global positions of the shard, or none (seqpar fills them in)"
    )
    cut = None if restarts else _other_cut(row, rank, world_size, sharding)
    if cut is not None:
        raise _undeclared_cut(where, rank, world_size, cut, sharding)
    raise ValueError(
        f"seqpar ({where}): position_ids on SP rank {rank} of {world_size} are not the global "
        f"positions of this rank's {sharding} shard (expected "
        f"{_short(expected[0])}, got {_short(row)}): {what}. seqpar.sequence.batch.shard_batch makes "
        "them right"
    )


def _as_keywords(bound: inspect.BoundArguments, params: Any) -> tuple[tuple, dict[str, Any]]:
    """The bound arguments (less ``self``) handed back by keyword: transformers' forward decorators
    also inject keywords (e.g. use_cache), which would collide with a positional copy."""
    new_kwargs: dict[str, Any] = {}
    self_name = next(iter(params))
    for pname, value in bound.arguments.items():
        kind = params[pname].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            new_kwargs.update(value)
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            return bound.args[1:], bound.kwargs  # cannot be passed by keyword; rare
        elif pname != self_name:
            new_kwargs[pname] = value
    return (), new_kwargs


def _var_keyword(arguments: dict[str, Any], params: Any) -> dict[str, Any]:
    """The forward's ``**kwargs`` dict inside ``arguments`` (created when absent; ``{}`` if none)."""
    name = next((n for n, p in params.items() if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    if name is None:
        return {}
    return arguments.setdefault(name, {})


def _packed_boundaries(
    arguments: dict[str, Any], params: Any, batch: int, seq_local: int, world_size: int, where: str,
    *, unpacked: bool = False,
) -> tuple[int, ...] | None:
    """The global document boundaries of a packed batch, put on the host once for all layers.

    From ``cu_seq_lens_q/k`` (as :func:`seqpar.sequence.batch.shard_batch` or DataCollatorWithFlattening
    give them); on one rank also from restarting ``position_ids`` (the shard is the whole sequence).
    The boundaries are written back as one host int32 tensor under both keys, which transformers
    hands to every attention layer; its host ints are known (:func:`seqpar.sequence.boundaries.
    boundary_tensor`), so the batch's one device-to-host copy is the one made here, none per layer.
    """
    extra = _var_keyword(arguments, params)
    found = {k: extra[k] for k in PACKED_KEYS if k in extra}
    if "cu_seq_lens_q" not in found and "cu_seq_lens_k" not in found:
        if world_size > 1:
            return None  # restarting positions are refused by the caller with the fix
        if unpacked:  # the batch's read (or the outer preparer) found the plain positions: no restart
            return None
        found["position_ids"] = arguments.get("position_ids")
    full = {"input_ids": torch.empty(batch, seq_local * world_size, dtype=torch.long, device="meta"),
            **found}
    try:
        bounds = document_boundaries(full, seq_local * world_size)
    except ValueError as e:
        raise ValueError(f"seqpar ({where}): {e}") from None
    if bounds is None:
        return None
    cu = boundary_tensor(bounds)  # its host ints known: no layer copies it again
    longest = max(b - a for a, b in zip(bounds, bounds[1:]))
    extra.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
    return bounds


def _document_positions(global_pos: Tensor, bounds: tuple[int, ...]) -> Tensor:
    # (1, S_local) global positions (on the host) -> positions inside their document.
    edges = torch.tensor(bounds, dtype=global_pos.dtype)
    doc = torch.searchsorted(edges, global_pos, right=True) - 1
    return global_pos - edges[doc]


def _prepare_labels(
    arguments: dict[str, Any], params: Any, module: nn.Module, options: SwapOptions, where: str
) -> None:
    """``shift_labels`` alone still yields a loss; ``labels`` of a non-token loss are refused on shards."""
    if "labels" not in params:
        return
    var_kw = next((n for n, p in params.items() if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    extra = arguments.get(var_kw) or {} if var_kw else {}
    shift = arguments.get("shift_labels", extra.get("shift_labels"))
    if arguments.get("labels") is None and isinstance(shift, Tensor):
        arguments["labels"] = shift  # transformers computes a loss only when labels are given
    if arguments.get("labels") is None:
        return
    loss_type = model_loss_type(module)
    if loss_type not in TOKEN_LOSSES and sp_rank_and_size(options.group)[1] > 1:
        raise ValueError(
            f"seqpar ({where}): labels= with a {loss_type} loss on sequence shards would give each "
            "rank a loss of its own shard only. Call the model without labels and compute the loss "
            "from the gathered outputs, or for token-level losses use seqpar.sequence_parallel_loss "
            "with the shift_labels of seqpar.sequence.batch.shard_batch"
        )


def _short(x: Tensor) -> str:
    values = x.tolist()
    return str(values) if len(values) <= 8 else f"[{', '.join(map(str, values[:4]))}, ..., {values[-1]}]"
