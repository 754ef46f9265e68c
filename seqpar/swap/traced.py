"""A swapped model's per-batch preparation while ``torch.compile`` traces it (issue 31 §2).

``torch.compile(model)`` traces the model's forward pre-hooks with its forward, and under
``fullgraph=True`` whatever dynamo cannot trace is an error: a host read of a tensor's values (the
padding-mask verdict, the position check, the boundaries' host copy), a collective whose verdict is
read on the host (the cross-rank input check), ``inspect.signature(...).bind_partial``. So while dynamo
traces (:func:`tracing`), per-batch work that needs a tensor's values or a collective does not run in
the forward; what it would establish is taken from the batch as :func:`seqpar.sequence.batch.shard_batch`
(or :class:`~seqpar.sequence.batch.ShardedDataLoader`) prepared it, eagerly:

- ``position_ids``: the shard's *global* positions, as ``shard_batch`` always passes them. A batch
  without them was not cut by ``shard_batch`` and is refused at trace time (:func:`unprepared_error`);
- ``attention_mask``: none given, an all-ones one is filled in, as eagerly. A mask the caller passes is
  refused at trace time (:func:`given_mask_refusal`): its values cannot be read in the graph, and a
  padding mask taken on trust would be ignored silently. ``shard_batch`` turns right padding into
  ignored labels, so its batch runs without its all-ones mask;
- ``shift_labels`` (passed on as ``labels``);
- the cross-rank check of the batch and the first-forward probe: not run (no collective, no host
  read in the graph). Run one eager forward first where a check matters (the probe must have run: a
  model whose probe is still pending is refused at trace time, naming the fix).

Packed documents (``cu_seq_lens_q/k``, batch 1): the boundaries stay tensors in the graph. Every layer
hands ``cu_seq_lens_q`` to its compiled attention op, which reads it on the host at run time (once per
tensor; ``shard_batch``'s are host tensors, so no device sync) and checks it there; a new layout is the same
graph, a new number of documents one recompile in all (dynamo then marks the size dynamic). What the eager
forward checks across the two keys and ranks is taken from ``shard_batch`` (:func:`prepared_documents`):
``cu_seq_lens_k`` is taken to equal ``cu_seq_lens_q``, and ``position_ids`` to be the per-document positions.
The ``max_length_q/k`` ints are dropped (seqpar attention does not read them; as ints in the graph they
would be constants, a recompile per layout).

What stays checked while tracing is what the arguments' structure tells: a KV cache or
``use_cache=True`` refused, ``use_cache`` turned off, ``labels=`` of a non-token loss under SP refused.
Positional arguments are bound by the forward's parameter names read at swap time
(:func:`remember_forward_names`), not by ``inspect`` while tracing.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["tracing", "remember_forward_names", "bind_traced", "unprepared_error", "prepared_documents",
           "given_mask_refusal"]

# class -> (names of the forward's positional-or-keyword parameters less self, whether it takes **kwargs)
_FORWARD_NAMES: dict[type, tuple[tuple[str, ...], bool]] = {}


def tracing() -> bool:
    """Whether dynamo is tracing the running code (``torch.compile``): per-batch work that reads
    tensor values or communicates must not run (see the module docstring)."""
    return torch.compiler.is_compiling()


def remember_forward_names(cls: type) -> None:
    """Read ``cls.forward``'s parameter names eagerly (at swap time), for :func:`bind_traced`."""
    try:
        params = list(inspect.signature(cls.forward).parameters.values())[1:]  # less self
    except (TypeError, ValueError):  # no signature to read: a compiled call then names the problem
        return
    names = tuple(p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                        inspect.Parameter.POSITIONAL_OR_KEYWORD))
    _FORWARD_NAMES[cls] = (names, any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params))


def bind_traced(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[dict[str, Any], tuple[str, ...]]:
    """``module``'s call as keyword arguments (a new dict) and its forward's parameter names, while tracing.

    Raises:
        ValueError: the forward's names were not read at swap time, or more positional arguments
            than it has positional parameters.
    """
    found = _FORWARD_NAMES.get(type(module))
    if found is None:
        raise ValueError(
            f"seqpar ({type(module).__name__}): compiled before seqpar.swap_attention read its forward's "
            "parameters; swap the model before torch.compile"
        )
    names, _ = found
    if len(args) > len(names):
        raise ValueError(
            f"seqpar ({type(module).__name__}): {len(args)} positional arguments for {len(names)} "
            "positional parameters; pass the batch by keyword (model(**batch))"
        )
    bound = dict(kwargs)
    for name, value in zip(names, args):
        if name in bound:
            raise TypeError(f"{type(module).__name__}.forward got multiple values for argument '{name}'")
        bound[name] = value
    return bound, names


def unprepared_error(where: str, missing: str) -> ValueError:
    """The trace-time error for a batch that ``shard_batch`` did not prepare."""
    return ValueError(
        f"seqpar ({where}): a compiled swapped model got a batch without {missing}. Under torch.compile the "
        "per-batch input checks (cross-rank agreement, padding mask, global positions) cannot run in the "
        "traced forward: cut every batch with seqpar.shard_batch (or seqpar.sequence.batch.ShardedDataLoader), "
        "which prepares it eagerly, and call the model with model(**batch)"
    )


def prepared_documents(kwargs: dict[str, Any], ref: Tensor, where: str) -> None:
    """Packed documents of a traced call (see the module docstring), in place in ``kwargs``: the boundary
    tensors checked for what tracing can see (1-D int tensors, batch 1), ``cu_seq_lens_q`` filled from
    ``cu_seq_lens_k`` when only that is given, ``max_length_q/k`` dropped."""
    found = {key: kwargs.get(key) for key in ("cu_seq_lens_q", "cu_seq_lens_k") if kwargs.get(key) is not None}
    if not found:
        return
    for key, cu in found.items():
        if not isinstance(cu, Tensor) or cu.dim() != 1 or cu.dtype not in (torch.int32, torch.int64):
            got = f"shape {tuple(cu.shape)}, {cu.dtype}" if isinstance(cu, Tensor) else type(cu).__name__
            raise ValueError(
                f"seqpar ({where}): {key} must be a 1-D int32/int64 tensor of document boundaries under "
                f"torch.compile (got {got}); cut packed batches with seqpar.shard_batch"
            )
    if ref.shape[0] != 1:
        raise ValueError(
            f"seqpar ({where}): packed documents (cu_seq_lens_q) need batch 1, got batch {ref.shape[0]}: "
            "pack the batch's rows into one sequence (seqpar.shard_batch cuts it)"
        )
    if "cu_seq_lens_q" not in found:
        kwargs["cu_seq_lens_q"] = found["cu_seq_lens_k"]
    for key in ("max_length_q", "max_length_k"):
        kwargs.pop(key, None)


def prepared_positions(kwargs: dict[str, Any], seq_local: int, where: str) -> Tensor:
    """The batch's ``position_ids`` (``(B or 1, seq_local)``), which ``shard_batch`` always passes."""
    given = kwargs.get("position_ids")
    if not isinstance(given, Tensor):
        raise unprepared_error(where, "position_ids")
    if given.shape[-1] != seq_local:
        raise ValueError(
            f"seqpar ({where}): position_ids of length {given.shape[-1]} for a shard of {seq_local} tokens; "
            "cut the batch with seqpar.shard_batch"
        )
    return given


def given_mask_refusal(where: str) -> ValueError:
    """The trace-time error for an ``attention_mask`` the caller passed to a compiled swapped model: its
    values (padding or not) cannot be read in a traced forward, so it cannot be checked as the eager
    forward checks it; taken on trust, a padding mask would be ignored silently."""
    return ValueError(
        f"seqpar ({where}): attention_mask given to a compiled swapped model: a traced forward cannot read "
        "its values, so padding in it would be ignored. Cut the batch with seqpar.shard_batch (it turns right "
        "padding into ignored labels) and pass it without attention_mask (seqpar fills an all-ones one), "
        "or run the model eagerly"
    )

