"""The loss of the ``"hf"`` route: a swapped model's ``loss_function`` becomes
:class:`SequenceParallelLMLoss`.

Losses: the model's ``loss_function`` becomes :class:`SequenceParallelLMLoss`. Under SP, transformers'
own causal-LM loss would shift the labels inside each shard (losing every shard's last target) and
average per rank: a wrong loss. seqpar's is token-weighted over the whole sequence, with the shift
done before the cut (``shift_labels``) or across shards (``labels`` cut unshifted), and its backward
gives every rank its share of the full-sequence gradient (see :mod:`seqpar.sequence.loss`).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn
from transformers.loss.loss_utils import LOSS_MAPPING

from seqpar.sequence.batch import sp_rank_and_size
from seqpar.sequence.loss import sequence_parallel_loss, shift_labels_across_shards
from seqpar.sequence.vocab_parallel import vocab_sharded_logits
from seqpar.swap.options import SwapOptions
from seqpar.swap.state import is_probing

__all__ = ["SequenceParallelLMLoss", "model_loss_type", "TOKEN_LOSSES"]


def model_loss_type(model: nn.Module) -> str:
    """The model's transformers loss type (a key of ``LOSS_MAPPING``)."""
    # transformers' own rule (PreTrainedModel.loss_function): an unknown type means ForCausalLM.
    loss_type = getattr(model, "loss_type", None)
    return loss_type if loss_type in LOSS_MAPPING else "ForCausalLM"


# Losses that are a mean over tokens, so a token-weighted mean over the SP group is exact.
TOKEN_LOSSES = ("ForCausalLM", "ForMaskedLM")


class SequenceParallelLMLoss:
    """A swapped model's ``loss_function``: transformers' token-level loss, exact under SP.

    Called by transformers as ``loss_function(logits=..., labels=..., vocab_size=..., **kwargs)``
    with this rank's ``logits`` ``(batch, seq_local, vocab)`` and ``labels`` ``(batch, seq_local)``.

    - Causal LM: the targets are ``shift_labels`` when given (shifted before the cut, as
      :func:`seqpar.sequence.batch.shard_batch` returns them), else ``labels`` cut unshifted like
      ``input_ids``, shifted across shard boundaries here (one tiny all-gather).
    - Masked LM: ``labels`` as cut.
    - ``num_items_in_batch`` (given by transformers' Trainer): the loss is the sum over the whole
      sequences divided by it, so it must count the target tokens of the *full* sequences of this
      replica's batch; without it, the token-weighted mean over the SP group.

    With one rank it is transformers' own loss. The value is the same on every SP rank, and each
    rank's backward gives its share of the full-sequence gradient (sum them over the SP group).
    """

    def __init__(self, options: SwapOptions, loss_type: str) -> None:
        self.options = options
        self.loss_type = loss_type

    def __call__(
        self,
        logits: Tensor,
        labels: Tensor,
        vocab_size: int | None = None,
        num_items_in_batch: Tensor | int | None = None,
        ignore_index: int = -100,
        shift_labels: Tensor | None = None,
        **kwargs: Any,
    ) -> Tensor:
        options = self.options.for_call(kwargs)  # dynamic CP: the micro-batch's group travels with the call
        # While the position-mixing probe runs, nothing is communicated: the loss stays this rank's.
        world_size = 1 if is_probing() else sp_rank_and_size(options.group)[1]
        # logits split on the vocabulary over TP (tp_sequence_parallel) take seqpar's vocab-parallel loss,
        # at any SP size: transformers' would gather them
        vocab_split = vocab_sharded_logits(logits) is not None
        if (world_size == 1 and not vocab_split) or self.loss_type not in TOKEN_LOSSES:
            return LOSS_MAPPING[self.loss_type](
                logits, labels, vocab_size=vocab_size, num_items_in_batch=num_items_in_batch,
                ignore_index=ignore_index, shift_labels=shift_labels, **kwargs,
            )
        if self.loss_type == "ForCausalLM":
            targets = shift_labels if shift_labels is not None else shift_labels_across_shards(
                labels, group=options.group, sharding=options.sharding,
                ignore_index=ignore_index,
            )
        else:
            targets = labels
        if num_items_in_batch is None:
            return sequence_parallel_loss(logits, targets, group=options.group,
                                          ignore_index=ignore_index, reduction="mean")
        total = sequence_parallel_loss(logits, targets, group=options.group,
                                       ignore_index=ignore_index, reduction="sum")
        if isinstance(num_items_in_batch, Tensor):
            num_items_in_batch = num_items_in_batch.to(total.device)
        return total / num_items_in_batch
