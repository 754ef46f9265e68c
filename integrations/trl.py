"""TRL's trainers under sequence parallelism: what seqpar changes in their losses and metrics, and why.

Use them through :func:`seqpar.integrations.trainer.sequence_parallel`::

    from trl import SFTConfig, SFTTrainer
    from seqpar.integrations.trainer import sequence_parallel

    trainer = sequence_parallel(SFTTrainer)(model=model, args=SFTConfig(..., deepspeed="ds.json"), ...)

Supported: TRL ``>=1.16,<2`` (the ``seqpar[trl]`` extra), whose trainers score tokens through a fused
LM head (``model(..., fused_lm_head=True)`` returns per-token ``log_probs``, ``entropy``, ``is_top1``
and ``label_mask``, zero where the label is -100) and accept the pre-shifted ``shift_labels`` that
:func:`seqpar.sequence.batch.shard_batch` produces. Every per-token field is therefore this rank's
shard; what a trainer builds from them decides what seqpar must do.

**SFTTrainer** (:class:`SFTLoss`). Its loss is ``sum(-log_probs) / num_items_in_batch`` (times the
process count when Trainer summed the count over processes), plus the MoE router loss:

- the cross-entropy part is linear in the per-token terms, so each rank's part is its share of one
  process's loss; its *value* is summed over the SP group with an identity backward
  (:func:`seqpar.sequence.loss.all_reduce_identity_backward`), so the logged loss is one process's
  and the gradients stay the shares that DeepSpeed / FSDP2 sum over the SP ranks (without it the
  logged loss was each rank's share: 1/SP of the true one at SP = 2);
- Trainer's process-count factor is brought to the DP size (the engines average over DP only);
- without ``num_items_in_batch`` (evaluation) SFTTrainer divides by the shard's own token count: the
  count over the SP group is passed instead;
- the router loss (``aux_loss``) is the whole sequence's on every rank (seqpar's dispatcher,
  :mod:`seqpar.swap.moe`, computes it from statistics summed over the SP group; TRL calls Mixtral's
  function for every MoE family, so the dispatcher is put there too) and is left as it is;
- entropy and mean token accuracy are sums over the tokens of every process divided by their count
  (``gather_for_metrics``), which the shards of an SP group partition: one process's numbers as they
  are. ``num_tokens`` counted seqpar's end padding; it is recounted without it.

Other TRL trainers (DPO, GRPO, KTO, RLOO, reward, ...) build per-sequence sums of the per-token
fields, which a shard holds only part of: they are refused by name at construction until an adapter
here makes them exact.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from seqpar.sequence.batch import TOKEN_MASK_KEY
from seqpar.sequence.loss import all_reduce_identity_backward

__all__ = ["SFTLoss", "loss_adapter_for", "TRL_VERSIONS"]

TRL_VERSIONS = ">=1.16,<2"
"""The TRL releases the adapters are written against (the ``seqpar[trl]`` extra's range)."""


class SFTLoss:
    """``trl.SFTTrainer.compute_loss`` made SP-exact (see the module docstring for each step)."""

    def compute_loss(self, trainer: Any, base: Callable[..., Any], model: Any, inputs: dict[str, Any],
                     return_outputs: bool, num_items_in_batch: Any) -> Any:
        """Args: ``trainer`` the SFTTrainer (with the seqpar mixin), ``base`` SFTTrainer's own bound
        ``compute_loss``, then ``compute_loss``'s arguments with ``inputs`` already cut by
        :func:`seqpar.sequence.batch.shard_batch` (``shift_labels`` ``(B, S_local)``)."""
        manager = trainer.seqpar_manager
        given = num_items_in_batch is not None
        if getattr(trainer, "aux_loss_enabled", False):  # at SP = 1 too: seqpar's end padding must not count
            _router_loss_of_the_sequence()
        if not given:  # evaluation: the targets of the whole sequence, not of this shard
            num_items_in_batch = _sp_target_count(inputs, manager.sp_group)
        fused: list[Any] = []

        def keep_fused_output(module: Any, args: Any, kwargs: dict[str, Any], output: Any) -> None:
            if kwargs.get("fused_lm_head"):
                fused.append(output)

        inner = trainer.accelerator.unwrap_model(model)
        hook = inner.register_forward_hook(keep_fused_output, with_kwargs=True)
        tokens_before = getattr(trainer, "_total_train_tokens", None)
        try:
            result = base(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        finally:
            hook.remove()
        loss, outputs = (result[0], result[1]) if return_outputs else (result, None)
        aux = loss.new_zeros(())
        if getattr(trainer, "aux_loss_enabled", False) and fused and fused[-1].aux_loss is not None:
            # As SFTTrainer adds it: the coefficient, over the accumulation steps when the count is given.
            steps = trainer.current_gradient_accumulation_steps if given else 1
            aux = trainer.router_aux_loss_coef * fused[-1].aux_loss / steps
        # SFTTrainer multiplied its cross-entropy by the process count whenever it had a count and
        # average_tokens_across_devices; the engines average gradients over the dp replicas only.
        multiplied = trainer.accelerator.num_processes // trainer.get_tp_size() \
            if trainer.args.average_tokens_across_devices else 1
        wanted = manager.dp_size if (given and trainer.args.average_tokens_across_devices) else 1
        cross_entropy = (loss - aux) * (wanted / multiplied)
        loss = all_reduce_identity_backward(cross_entropy, group=manager.sp_group) + aux
        if tokens_before is not None and trainer.model.training and "attention_mask" not in inputs:
            _recount_tokens(trainer, inputs, tokens_before)
        return (loss, outputs) if return_outputs else loss


def _router_loss_of_the_sequence() -> None:
    """TRL's fused head computes every MoE family's router loss with Mixtral's function; seqpar's swap
    made only the model's own modules' functions the sequence's (summed over the SP group, seqpar's end
    padding left out, also at SP = 1), so Mixtral's is made so too."""
    from transformers.models.mixtral import modeling_mixtral

    from seqpar.swap.moe import install_dispatcher

    install_dispatcher(modeling_mixtral)


def _sp_target_count(inputs: dict[str, Any], group: Any) -> torch.Tensor:
    """Targets (labels not -100) of the whole SP group's sequences: the sum of the shards' counts."""
    labels = inputs.get("shift_labels", inputs.get("labels"))
    count = (labels != -100).sum()
    return all_reduce_identity_backward(count, group=group)


def _recount_tokens(trainer: Any, inputs: dict[str, Any], tokens_before: int) -> None:
    """SFTTrainer's ``num_tokens`` without seqpar's end padding: each shard's real tokens (the token
    mask ``shard_batch`` adds when it pads), summed over all processes as SFTTrainer sums them."""
    mask = inputs.get(TOKEN_MASK_KEY)
    ids = inputs["input_ids"]
    local = mask.sum() if mask is not None else torch.tensor(ids.shape[1], device=ids.device)
    total = trainer.accelerator.gather_for_metrics(local.reshape(1)).sum().item()
    trainer._total_train_tokens = tokens_before + total // trainer._tp_size
    trainer._metrics["train"]["num_tokens"] = [trainer._total_train_tokens]


def _trl_class(module: str, name: str) -> type | None:
    import sys

    mod = sys.modules.get(module)
    return getattr(mod, name, None) if mod is not None else None


def loss_adapter_for(owner: type) -> Any:
    """The adapter for a trainer class whose ``compute_loss`` is ``owner``'s, or None when seqpar has
    none (the caller refuses it). Never imports TRL: a class from TRL is loaded already."""
    if owner is _trl_class("trl.trainer.sft_trainer", "SFTTrainer"):
        return SFTLoss()
    return None
