"""The ``"hf"`` route's input preparer while ``torch.compile`` traces the swapped model
(:func:`prepare_traced`; what it takes from the batch instead of checking, and why: :mod:`seqpar.swap.traced`).

It does what :func:`seqpar.swap.hf_inputs.prepare_inputs` does from the arguments' structure alone, with
no host read and no collective: binds positional arguments by the names read at swap time, refuses a KV
cache and ``use_cache=True`` and turns ``use_cache`` off, hands the batch's ``seqpar_token_mask`` to the
router statistics, fills an all-ones ``attention_mask`` (a caller's own is refused: its values cannot be read), passes ``shift_labels`` on as
``labels``, takes ``position_ids`` as :func:`seqpar.shard_batch` made them (a batch without them is
refused at trace time, naming ``shard_batch``), and passes packed documents' ``cu_seq_lens_q/k`` on as
tensors, which the compiled attention ops read at run time (:mod:`seqpar.attn.ops`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from seqpar.sequence.batch import TOKEN_MASK_KEY, sp_rank_and_size
from seqpar.swap import moe
from seqpar.swap.hf_call import reference_input, refuse_cache
from seqpar.swap.hf_loss import TOKEN_LOSSES, model_loss_type
from seqpar.swap.hf_padding import fill_padding
from seqpar.swap.options import SwapOptions
from seqpar.swap.traced import (
    bind_traced,
    given_mask_refusal,
    prepared_documents,
    prepared_positions,
)

__all__ = ["prepare_traced"]


def prepare_traced(
    options: SwapOptions, module: nn.Module, args: tuple, kwargs: dict[str, Any], *, nested: bool = False
) -> tuple[tuple, dict[str, Any]]:
    """The traced counterpart of :func:`seqpar.swap.hf_inputs.prepare_inputs`: ``((), kwargs)`` to call
    the swapped PreTrainedModel ``module`` with (see the module docstring).

    ``nested``: ``module`` holds PreTrainedModels of its own (``LlamaForCausalLM`` holds ``LlamaModel``),
    whose preparers fill in the attention mask. ``torch.compile(model)`` runs the outermost model's hooks
    as a frame of their own, so a tensor made there would be a graph of its own (a graph break in
    ``torch._dynamo.explain``'s count); the nested models' hooks are traced inline with the forward."""
    bound, names = bind_traced(module, args, kwargs)
    ref = reference_input(bound)
    if ref is None:
        return args, kwargs
    where = type(module).__name__
    refuse_cache(bound, names, where)
    fill_padding(module, bound, bound.get(TOKEN_MASK_KEY))  # no zero pad embedding (seqpar.swap.hf_padding)
    moe.take_token_mask(bound)  # padding the router statistics must skip
    prepared_documents(bound, ref, where)
    if bound.get("attention_mask") is not None:  # the caller's own: its padding would be ignored unseen
        raise given_mask_refusal(where)
    if "attention_mask" in names and not nested:
        # an all-ones mask, as eagerly: without one transformers reads a zigzag shard's jump in positions
        # as two packed documents
        bound["attention_mask"] = torch.ones(ref.shape[0], ref.shape[1], dtype=torch.long, device=ref.device)
    if "position_ids" in names:
        prepared_positions(bound, ref.shape[1], where)
    if "labels" in names:
        shift = bound.get("shift_labels")
        if bound.get("labels") is None and isinstance(shift, Tensor):
            bound["labels"] = shift  # transformers computes a loss only when labels are given
        if (bound.get("labels") is not None and model_loss_type(module) not in TOKEN_LOSSES
                and sp_rank_and_size(options.group)[1] > 1):
            raise ValueError(
                f"seqpar ({where}): labels= with a {model_loss_type(module)} loss on sequence shards would give "
                "each rank a loss of its own shard only; call the model without labels"
            )
    return (), bound
