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

**DPOTrainer** (:class:`DPOLoss`). Its losses are built from per-sequence sums of the per-token
fields (chosen and rejected rows, the reference model's too), which a shard holds only part of: the
mixin hands it the full batch, and each fused-head call of the policy and the reference model runs
on this rank's shard and returns the per-token fields gathered whole, so every DPO loss type and
metric is computed as at one process (see the class for the gradient's path).
``precompute_ref_log_probs=True`` is refused.

Other TRL trainers (GRPO, KTO, RLOO, reward, ...) build per-sequence sums of the per-token fields
too: they are refused by name at construction until an adapter here makes them exact.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from seqpar.sequence.batch import TOKEN_MASK_KEY, shard_batch
from seqpar.sequence.loss import all_reduce_identity_backward
from seqpar.sequence.sharding import gather_sequence

__all__ = ["SFTLoss", "DPOLoss", "loss_adapter_for", "TRL_VERSIONS"]

TRL_VERSIONS = ">=1.16,<2"
"""The TRL releases the adapters are written against (the ``seqpar[trl]`` extra's range)."""


class SFTLoss:
    """``trl.SFTTrainer.compute_loss`` made SP-exact (see the module docstring for each step)."""

    shards_in_step = True
    """The mixin cuts the batch before ``compute_loss`` (SFTTrainer scores the shard's tokens itself)."""

    def check(self, args: Any) -> None:
        """Nothing to refuse beyond the mixin's checks."""

    def prepare(self, args: Any, kwargs: dict[str, Any], swap: Callable[[Any], None]) -> None:
        """Nothing to swap beyond the model (the mixin's part)."""

    def after_init(self, trainer: Any, swap: Callable[[Any], None]) -> None:
        """Nothing to do once SFTTrainer is built."""

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


# The per-token fields of TRL's FusedCausalLMOutput, each (B, S - 1) without shift_labels.
_PER_TOKEN_FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask")


class DPOLoss:
    """``trl.DPOTrainer.compute_loss`` made SP-exact by cutting the batch *inside* the model call.

    DPOTrainer builds everything from per-token fields of the fused head: per-sequence log-prob sums
    (chosen and rejected rows of one concatenated batch; ``ld_alpha``'s shared-length split; WPO's
    weights), the reference model's sums, the IPO / ``sigmoid_norm`` completion lengths, the ``sft``
    term, and every metric. A shard holds part of each sequence, so all of these need the whole
    row. Rather than re-deriving each of TRL's ~15 loss types per shard, its ``compute_loss`` gets
    the *full* batch (the mixin does not cut it), and each fused-head call of the policy and of the
    reference model (a second model, or the policy itself under PEFT) is cut on the way in and made
    whole on the way out:

    - in: TRL's ``labels`` (the full rows, -100 outside the completion) with the rest of the call
      go through :func:`seqpar.sequence.batch.shard_batch` (labels shifted on the full row, then
      cut; right padding and seqpar's end padding handled there), so the swapped backbone runs on
      ``(2B, S_local)``;
    - out: every per-token field ``(2B, S_local)`` is gathered along the sequence
      (:func:`seqpar.sequence.sharding.gather_sequence`) and trimmed to TRL's ``(2B, S - 1)``, the
      layout it gets at one process. The gather's backward keeps this rank's positions of the
      incoming gradient (``grad_reduction="slice"``): every rank of the group computes the same loss
      from the same gathered values, so each rank's gradient is its own tokens' share, which
      DeepSpeed / FSDP2 with seqpar's groups sum over the SP ranks.

    Per-token fields cost 4 bytes a token each, against the backbone's activations of hidden-size
    floats a token per layer: the gathered rows are not what limits the context. The metrics are
    then one process's: the reward means are means over copies (each SP rank holds the same
    rewards), the token-weighted ones (entropy, logits, token accuracy) are ratios of sums that
    count each row SP times above and below; ``num_tokens``, a plain sum over processes, is divided
    by the SP size.

    Refused by name: ``precompute_ref_log_probs=True`` (its pass gathers per-row results over every
    process, which repeats each SP group's rows), and vision batches.
    """

    shards_in_step = False
    """The mixin passes the full batch to ``compute_loss``; the cut happens at each model call."""

    def check(self, args: Any) -> None:
        """At construction, before any process group: refuse what is not handled."""
        from seqpar.config import ConfigError

        if getattr(args, "precompute_ref_log_probs", False):
            raise ConfigError(
                "DPOTrainer with precompute_ref_log_probs=True under sequence parallelism: its pass gathers "
                "per-row log-probs over every process, which would repeat each SP group's rows. Set "
                "precompute_ref_log_probs=False (the reference model runs sharded beside the policy)"
            )

    def prepare(self, args: Any, kwargs: dict[str, Any], swap: Callable[[Any], None]) -> None:
        """Before DPOTrainer's ``__init__``: route a given reference model's attention through seqpar
        (it is fed the same shards as the policy)."""
        if kwargs.get("ref_model") is not None:
            swap(kwargs["ref_model"])

    def after_init(self, trainer: Any, swap: Callable[[Any], None]) -> None:
        """A reference model DPOTrainer loaded itself (``ref_model=None``, no PEFT) is swapped too."""
        if getattr(trainer, "_is_vision_dataset", False):
            from seqpar.config import ConfigError

            raise ConfigError("DPOTrainer on vision batches is not handled under sequence parallelism: the "
                              "image tokens' features are not cut with the sequence; train it without seqpar")
        ref = getattr(trainer, "ref_model", None)
        if ref is not None:
            swap(_hf_model(ref))  # once per model: a given reference model was swapped in prepare

    def compute_loss(self, trainer: Any, base: Callable[..., Any], model: Any, inputs: dict[str, Any],
                     return_outputs: bool, num_items_in_batch: Any) -> Any:
        """Args: as :meth:`SFTLoss.compute_loss`, with ``inputs`` the *full* DPO batch (``input_ids``,
        ``attention_mask``, ``completion_mask`` ``(2B, S)``, chosen rows then rejected rows)."""
        if return_outputs:
            raise ValueError(
                "under sequence parallelism DPOTrainer's logits would be one shard's; evaluate with "
                "prediction_loss_only=True"
            )
        manager = trainer.seqpar_manager
        if getattr(trainer, "aux_loss_enabled", False):
            _router_loss_of_the_sequence()
        models = [trainer.accelerator.unwrap_model(model)]
        ref = getattr(trainer, "ref_model", None)
        if ref is not None and _hf_model(ref) is not models[0]:
            models.append(_hf_model(ref))
        tokens_before = getattr(trainer, "_total_train_tokens", None)
        with contextlib.ExitStack() as stack:
            for m in models:
                stack.enter_context(_cut_fused_calls(m, manager.sp_group, trainer.seqpar_config.sharding))
            loss = base(model, inputs, return_outputs=False, num_items_in_batch=num_items_in_batch)
        if tokens_before is not None and trainer.model.training and manager.sp_size > 1:
            # DPOTrainer summed the full batch's attention mask over all processes: SP copies of each row.
            counted = trainer._total_train_tokens - tokens_before
            trainer._total_train_tokens = tokens_before + counted // manager.sp_size
            trainer._metrics["train"]["num_tokens"] = [trainer._total_train_tokens]
        return loss


def _hf_model(module: Any) -> Any:
    """The model inside a DeepSpeed engine (DPOTrainer's reference model is one under DeepSpeed)."""
    return getattr(module, "module", module)


@contextlib.contextmanager
def _cut_fused_calls(model: Any, group: Any, sharding: str) -> Iterator[None]:
    """Within the block, each ``model(..., labels=, fused_lm_head=True)`` call (keyword arguments, full
    rows ``(B, S)``) runs on this rank's shard and returns TRL's per-token fields whole, ``(B, S - 1)``
    (see :class:`DPOLoss`). The full length of each call travels from the pre-hook to the hook on a
    stack local to this block (the policy's and the reference model's calls do not interleave)."""
    lengths: list[int] = []

    def cut(module: Any, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
        if not kwargs.get("fused_lm_head"):
            return None
        labels = kwargs.pop("labels", None)
        if args or labels is None or kwargs.get("shift_labels") is not None:
            raise ValueError(
                "seqpar's DPO adapter expects the fused LM head called with keyword arguments and full-row "
                "labels= (TRL 1.16's DPOTrainer); this call differs: check the TRL version (seqpar[trl])"
            )
        lengths.append(labels.shape[1])
        return args, shard_batch({**kwargs, "labels": labels}, group=group, sharding=sharding)

    def whole(module: Any, args: tuple, kwargs: dict[str, Any], output: Any) -> Any:
        if not kwargs.get("fused_lm_head"):
            return None
        seq_len = lengths.pop()
        fields = {}
        for name in _PER_TOKEN_FIELDS:
            local = getattr(output, name, None)
            if local is None:
                continue
            as_bool = local.dtype == torch.bool
            full = gather_sequence(local.to(torch.uint8) if as_bool else local, 1, group=group,
                                   sharding=sharding, grad_reduction="slice")
            full = full.narrow(1, 0, seq_len - 1)  # (B, S_pad) -> (B, S - 1): TRL's unshifted layout
            fields[name] = full.bool() if as_bool else full
        # The fused head's own loss (the token mean; DPOTrainer does not read it) of the whole rows.
        loss = -fields["log_probs"].sum() / fields["label_mask"].sum().clamp(min=1)
        return type(output)(**{**{k: getattr(output, k) for k in output.keys()}, **fields, "loss": loss})

    # prepend: ahead of the swapped model's own input check, which must see the cut batch
    handles = [model.register_forward_pre_hook(cut, with_kwargs=True, prepend=True),
               model.register_forward_hook(whole, with_kwargs=True)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


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
    if owner is _trl_class("trl.trainer.dpo_trainer", "DPOTrainer"):
        return DPOLoss()
    return None
