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

**GRPOTrainer** (:class:`GRPOLoss`). Its training step generates rollouts for a batch of prompts,
scores them (rewards, group advantages), computes the old policy's and the reference model's per-token
log-probs, then the policy's in ``compute_loss``. Generation does not need SP (a prompt and its
completion fit one rank; training on them is what does), so it runs unsharded, with transformers' own
attention, on every rank of an SP group; the log-prob passes of policy and reference model are cut at
each fused-head call and made whole, as for DPO; every rank then holds the same rollouts, advantages,
per-token log-probs, KL and loss as one process (see the class for the normalisations).

Other TRL trainers (KTO, RLOO, reward, ...) build per-sequence sums of the per-token fields too: they
are refused by name at construction until an adapter here makes them exact.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from seqpar.sequence.batch import TOKEN_MASK_KEY, shard_batch
from seqpar.sequence.loss import all_reduce_identity_backward
from seqpar.sequence.sharding import gather_sequence

__all__ = ["SFTLoss", "DPOLoss", "GRPOLoss", "loss_adapter_for", "TRL_VERSIONS"]

TRL_VERSIONS = ">=1.16,<2"
"""The TRL releases the adapters are written against (the ``seqpar[trl]`` extra's range)."""


class SFTLoss:
    """``trl.SFTTrainer.compute_loss`` made SP-exact (see the module docstring for each step)."""

    shards_in_step = True
    """The mixin cuts the batch before ``compute_loss`` (SFTTrainer scores the shard's tokens itself)."""

    def check(self, args: Any) -> None:
        """Nothing to refuse beyond the mixin's checks."""

    def before_swap(self, args: Any, model: Any, manager: Any) -> None:
        """Nothing to note before the model is swapped."""

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
        aux = added = loss.new_zeros(())
        if getattr(trainer, "aux_loss_enabled", False) and fused and fused[-1].aux_loss is not None:
            # As SFTTrainer adds it: the coefficient, over the accumulation steps when the count is given. base
            # was always given one (the SP group's count above, in evaluation), so it added the router loss over
            # the steps: that is taken off, and SFTTrainer's own (over 1 step without a count) added.
            weighted = trainer.router_aux_loss_coef * fused[-1].aux_loss
            added = weighted / trainer.current_gradient_accumulation_steps
            aux = weighted / (trainer.current_gradient_accumulation_steps if given else 1)
        # SFTTrainer multiplied its cross-entropy by the process count whenever it had a count and
        # average_tokens_across_devices; the engines average gradients over the dp replicas only.
        multiplied = trainer.accelerator.num_processes // trainer.get_tp_size() \
            if trainer.args.average_tokens_across_devices else 1
        wanted = manager.dp_size if (given and trainer.args.average_tokens_across_devices) else 1
        cross_entropy = (loss - added) * (wanted / multiplied)
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
    process, which repeats each SP group's rows), vision batches, and ``sync_ref_model=True`` under
    seqpar's FSDP2 (TR-DPO's update mixes FSDP2-sharded policy parameters into the whole reference model).
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

    def before_swap(self, args: Any, model: Any, manager: Any) -> None:
        """Nothing to note before the model is swapped."""

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
        _refuse_sync_under_fsdp2(trainer)
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


class GRPOLoss:
    """``trl.GRPOTrainer``'s step made SP-exact: generation unsharded, scoring and loss cut per call.

    - **Generation** (``_generate_single_turn``, which TRL's single- and multi-turn paths call) runs on
      the whole prompt batch on every rank of the SP group, through transformers' own attention: the
      model's attention implementation is set back to the one it had before the swap and seqpar's
      forward hooks (input preparer, batch check, router frames) stand aside for the call, so
      ``generate`` takes its usual path (padding mask, KV cache) and no layer shards. Before it, the
      SP group's first rank's RNG state (CPU and, if present, CUDA) is broadcast over the group, so
      every rank samples the same tokens and makes the same number of decoding steps (under ZeRO-3 or
      FSDP2 each step's forward gathers parameters: the ranks must step in lockstep); after it, the
      first rank's completions are broadcast anyway, so the ranks train on the same rollouts even where
      a device's sampling is not bit-reproducible. The shared RNG state also keeps the order in which
      TRL shuffles the scored rows (``shuffle_sequence_dict``, torch's RNG) the same on every rank.
      (Generating on the first rank alone would leave the other ranks out of ZeRO-3's / FSDP2's
      gathers, and would hang there.)
    - **Scoring**: each fused-head call of the policy and of the reference model (``beta > 0``) runs on
      this rank's shard and returns TRL's per-token fields whole (:class:`DPOLoss`'s cut, gradient
      ``"slice"``). GRPO's rows are ``[left-padded prompt | right-padded completion]``; seqpar takes no
      key mask, so each row is rotated to put its leading pads at the end before the cut and the
      gathered fields are rotated back (rotary positions then count from the first real token, as
      transformers' ``generate`` counts them; the attention scores depend on position differences
      only, so the values equal one process's up to rounding).
    - **Normalisations**: every rank of an SP group holds the same rows, so TRL's reductions over all
      processes see each SP group's rows SP times: means, minima, maxima and ratios of sums (``loss``
      per sequence or per token, ``num_items_in_batch / num_processes``, ``kl``, ``entropy``, clip
      ratios, group advantages) are one process's as they are; ``num_tokens`` is divided by SP; the
      logged reward standard deviations are recomputed over one copy of each row.
    - **Batch sizes**: ``generation_batch_size`` counts the DP replicas, not the processes
      (``per_device_train_batch_size x dp x steps_per_generation``), so each SP group generates for the
      prompts one process would.

    Refused by name: vLLM and transformers' continuous batching (generation outside the model's own
    ``generate``), ``scale_rewards="batch"`` and ``multi_objective_aggregation="normalize_then_sum"``
    (a standard deviation over the duplicated rows), ``sync_ref_model=True`` under seqpar's FSDP2 (as for
    DPO), ``top_entropy_quantile < 1`` (a quantile over
    them), a per-rank generation batch that splits a prompt's group across DP ranks, and models with
    seqpar layers of their own (mixers, ALiBi, MLA latent transfer), which the unsharded generation
    does not switch off, and models without rotary embeddings (the rotation above shifts positions).
    """

    shards_in_step = False
    """The mixin passes the full batch on; the cut happens at each fused-head call."""

    def __init__(self) -> None:
        self._attn_implementations: list[tuple[Any, str]] = []  # (top PreTrainedModel, before the swap)

    def check(self, args: Any) -> None:
        from seqpar.config import ConfigError

        refusals = {
            "use_vllm": "vLLM generates outside the model's generate, which seqpar does not set up; "
                        "set use_vllm=False",
            "use_transformers_continuous_batching": "continuous batching generates through its own "
                                                    "attention path; set use_transformers_continuous_batching=False",
        }
        for name, why in refusals.items():
            if getattr(args, name, False):
                raise ConfigError(f"GRPOTrainer with {name}=True under sequence parallelism: {why}")
        if getattr(args, "scale_rewards", "group") == "batch" or \
                getattr(args, "multi_objective_aggregation", "") == "normalize_then_sum":
            raise ConfigError(
                "GRPOTrainer with scale_rewards='batch' or multi_objective_aggregation='normalize_then_sum' "
                "under sequence parallelism: the standard deviation over all processes' rewards would count "
                "each SP group's rows SP times; use scale_rewards='group' (or 'none') and 'sum_then_normalize'"
            )
        if getattr(args, "top_entropy_quantile", 1.0) < 1.0:
            raise ConfigError(
                "GRPOTrainer with top_entropy_quantile < 1 under sequence parallelism: the quantile over all "
                "processes' entropies would count each SP group's tokens SP times; set top_entropy_quantile=1.0"
            )
        per_rank = args.per_device_train_batch_size * args.steps_per_generation
        if per_rank % args.num_generations:
            raise ConfigError(
                f"GRPOTrainer under sequence parallelism needs whole prompt groups on each rank: "
                f"per_device_train_batch_size x steps_per_generation ({per_rank}) must be a multiple of "
                f"num_generations ({args.num_generations}) (TRL's group statistics run over all processes' "
                "rows, which hold each SP group's rows SP times)"
            )

    def before_swap(self, args: Any, model: Any, manager: Any) -> None:
        """Remember the attention implementation generation goes back to; count the generation batch
        over the DP replicas (GRPOConfig counted every process). ``model`` a name (``model="path"``): the batch
        only, before GRPOTrainer's ``__init__`` reads it; the mixin calls this again with the model GRPOTrainer
        built, before swapping it (it crashed on the string: "'str' object has no attribute 'modules'")."""
        from seqpar.swap.hf_route import top_pretrained

        if not isinstance(model, str):
            _refuse_absolute_positions(model)
            self._attn_implementations = [(top, top.config._attn_implementation)
                                          for top in top_pretrained(model)]
        args.generation_batch_size = (args.per_device_train_batch_size * manager.dp_size
                                      * args.steps_per_generation)

    def prepare(self, args: Any, kwargs: dict[str, Any], swap: Callable[[Any], None]) -> None:
        """A given reference model would be swapped here; GRPOTrainer builds its own (see after_init)."""

    def after_init(self, trainer: Any, swap: Callable[[Any], None]) -> None:
        """Swap the reference model GRPOTrainer built, and put the unsharded generation and the cut
        scoring around GRPOTrainer's own methods (instance attributes: this trainer only)."""
        policy = trainer.accelerator.unwrap_model(trainer.model)
        _refuse_own_layers(policy)
        _refuse_sync_under_fsdp2(trainer)
        ref = getattr(trainer, "ref_model", None)
        if ref is not None:
            swap(_hf_model(ref))
        manager = trainer.seqpar_manager
        group, sharding = manager.sp_group, trainer.seqpar_config.sharding
        sp_rank = torch.distributed.get_rank(group) if manager.sp_size > 1 else 0
        device = trainer.accelerator.device
        # Which processes are their SP group's first rank: their rows are the one copy to keep.
        firsts = trainer.accelerator.gather(torch.tensor([int(sp_rank == 0)], device=device)).bool().tolist()
        generate_single_turn = trainer._generate_single_turn
        generate_and_score = trainer._generate_and_score_completions
        calculate_rewards = trainer._calculate_rewards
        implementations = self._attn_implementations

        def generate(*args: Any, **kwargs: Any) -> Any:
            _share_rng_state(group, manager.sp_size)
            with _unsharded(policy, implementations):
                result = generate_single_turn(*args, **kwargs)
            if manager.sp_size > 1:
                shared = [result]
                torch.distributed.broadcast_object_list(shared, group=group, group_src=0)
                result = shared[0]
            return result

        gathered_rewards: list[torch.Tensor] = []

        def rewards(*args: Any, **kwargs: Any) -> torch.Tensor:
            out = calculate_rewards(*args, **kwargs)
            gathered_rewards.append(out)
            return out

        def score(generation_batch: Any) -> Any:
            models = [policy]
            if ref is not None and _hf_model(ref) is not policy:
                models.append(_hf_model(ref))
            tokens_before = trainer.state.num_input_tokens_seen
            gathered_rewards.clear()
            with contextlib.ExitStack() as stack:
                for m in models:
                    stack.enter_context(_cut_fused_calls(m, group, sharding, left_padding=True))
                out = generate_and_score(generation_batch)
            mode = "train" if trainer.model.training else "eval"
            if mode == "train" and manager.sp_size > 1:  # summed over all processes: SP copies of each row
                counted = trainer.state.num_input_tokens_seen - tokens_before
                trainer.state.num_input_tokens_seen = tokens_before + counted // manager.sp_size
                trainer._metrics[mode]["num_tokens"] = [trainer.state.num_input_tokens_seen]
            if gathered_rewards and manager.sp_size > 1:
                _one_copy_reward_stds(trainer, mode, gathered_rewards[-1], firsts)
            return out

        trainer._generate_single_turn = generate
        trainer._calculate_rewards = rewards
        trainer._generate_and_score_completions = score

    def compute_loss(self, trainer: Any, base: Callable[..., Any], model: Any, inputs: dict[str, Any],
                     return_outputs: bool, num_items_in_batch: Any) -> Any:
        """Args: as :meth:`SFTLoss.compute_loss`, with ``inputs`` GRPOTrainer's full rollout batch
        (``prompt_ids``/``prompt_mask`` ``(B, P)`` left-padded, ``completion_ids``/``completion_mask``
        ``(B, C)``, ``advantages`` ``(B,)``, old and reference log-probs ``(B, C)``)."""
        if getattr(trainer, "aux_loss_enabled", False):
            _router_loss_of_the_sequence()
        manager = trainer.seqpar_manager
        policy = trainer.accelerator.unwrap_model(model)
        with _cut_fused_calls(policy, manager.sp_group, trainer.seqpar_config.sharding, left_padding=True):
            return base(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)


def _refuse_sync_under_fsdp2(trainer: Any) -> None:
    """TR-DPO's reference update (``sync_ref_model=True``, TRL's ``SyncRefModelCallback``) mixes each policy
    parameter into the reference model's in place. Under seqpar's FSDP2 (``seqpar_config=``) the policy's
    parameters are FSDP2 shards (DTensors) while the reference model stays whole: the mix fails in the first
    synchronisation (``add_`` of a DTensor into a tensor), after a full optimizer step. Refused at construction,
    on every rank (the same arguments everywhere)."""
    if not getattr(trainer.args, "sync_ref_model", False):
        return
    policy = trainer.accelerator.unwrap_model(trainer.model)
    if any(hasattr(p, "full_tensor") for p in policy.parameters()):  # FSDP2's DTensor shards
        from seqpar.config import ConfigError

        raise ConfigError(
            f"{type(trainer).__name__} with sync_ref_model=True under seqpar's FSDP2 (seqpar_config=): the policy's "
            "parameters are FSDP2 shards and the reference model is kept whole, which TRL's reference update "
            "cannot mix. Set sync_ref_model=False, or train under DeepSpeed (TrainingArguments(deepspeed=...) "
            "with a sequence_parallel block)"
        )


def _refuse_absolute_positions(model: Any) -> None:
    """GRPO's left-padded rows are rotated before the cut (leading pads to the end), so a row's first real
    token sits at position 0 instead of at its count of pads. Attention under rotary embeddings depends on
    position differences only, so that equals one process; learned or absolute position embeddings would
    not (GPT-2's ``wpe``): refused, as is a model without a rotary embedding module."""
    from seqpar.config import ConfigError

    if any("Rotary" in type(m).__name__ for m in model.modules()):
        return
    raise ConfigError(
        f"GRPOTrainer under sequence parallelism takes rotary-embedding models only ({type(model).__name__} has "
        "no rotary embedding module): seqpar moves each left-padded row's pads to its end before cutting it, "
        "which shifts the row's positions; rotary attention depends on position differences only, absolute or "
        "learned position embeddings do not. Train this model without sequence parallelism"
    )


def _refuse_own_layers(model: Any) -> None:
    """Generation switches seqpar off by restoring transformers' attention and setting seqpar's hooks
    aside; a model with seqpar modules or forwards of its own would still run them sharded."""
    from seqpar.config import ConfigError

    own = [name for name, m in model.named_modules()
           if type(m).__module__.startswith("seqpar.") or _from_seqpar(m.__dict__.get("forward"))]
    if own:
        raise ConfigError(
            f"GRPOTrainer under sequence parallelism generates with transformers' own attention, but this "
            f"model has seqpar layers of its own ({', '.join(own[:3])}{', ...' if len(own) > 3 else ''}: "
            "mixers, ALiBi or MLA latent transfer), which unsharded generation does not switch off yet; "
            "train a model whose only swapped layers are transformers attention"
        )


def _from_seqpar(fn: Any) -> bool:
    """Whether a hook or forward is seqpar's own (a function, bound method or partial of one)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    fn = getattr(fn, "__func__", fn)
    return fn is not None and (getattr(fn, "__module__", None) or "").startswith("seqpar.")


@contextlib.contextmanager
def _unsharded(model: Any, implementations: list[tuple[Any, str]]) -> Iterator[None]:
    """Within the block ``model`` runs as before the swap, on whole sequences: its top models' attention
    implementation is the one recorded before the swap, and seqpar's forward hooks on its modules are
    set aside (put back afterwards at their places, also on error). Only seqpar's: hooks others removed or added
    inside the block stay as the block left them (under ZeRO-3, TRL's ``unwrap_model_for_generation`` takes
    DeepSpeed's module hooks off and registers new ones; putting the whole dicts back as they were brought back
    the old ones and dropped the new on every module with a seqpar hook, a MoE router among them, whose parameter
    then stayed "active in submodules": DeepSpeed raised on the next generation, fuzzer case 845186468)."""
    from seqpar.swap.hf_route import ATTN_IMPLEMENTATION

    saved = []  # (hook dict, its keys in order before the block, seqpar's hooks in it by key)
    for module in model.modules():
        for hooks in (module._forward_pre_hooks, module._forward_hooks):
            ours = {k: h for k, h in hooks.items() if _from_seqpar(h)}
            if ours:
                saved.append((hooks, list(hooks), ours))
                for key in ours:
                    del hooks[key]
    try:
        for top, implementation in implementations:
            top.set_attn_implementation(implementation)
        yield
    finally:
        for top, _ in implementations:
            top.set_attn_implementation(ATTN_IMPLEMENTATION)
        for hooks, order, ours in saved:
            now = dict(hooks)  # what the block left
            hooks.clear()
            for key in order:  # seqpar's back at their places, the others as the block left them
                if key in ours:
                    hooks[key] = ours[key]
                elif key in now:
                    hooks[key] = now.pop(key)
            hooks.update(now)  # hooks added inside the block, after


def _share_rng_state(group: Any, sp_size: int) -> None:
    """Every rank of the SP group takes its first rank's RNG state (CPU, and the current CUDA device's)."""
    if sp_size == 1:
        return
    states = [torch.get_rng_state(), torch.cuda.get_rng_state() if torch.cuda.is_available() else None]
    torch.distributed.broadcast_object_list(states, group=group, group_src=0)
    torch.set_rng_state(states[0])
    if states[1] is not None:
        torch.cuda.set_rng_state(states[1])


def _one_copy_reward_stds(trainer: Any, mode: str, gathered: torch.Tensor, firsts: list[bool]) -> None:
    """Recompute the logged reward standard deviations over one copy of each row: ``gathered``
    ``(processes x B, F)`` holds each SP group's rows once per rank; ``firsts`` marks the SP groups'
    first ranks. The rest of TRL's reward statistics (means, group advantages) are unchanged by copies."""
    from trl.trainer.utils import nanstd

    per_rank = gathered.shape[0] // len(firsts)
    keep = torch.tensor(firsts, device=gathered.device).repeat_interleave(per_rank)
    rows = gathered[keep]  # (dp x B, F)
    metrics = trainer._metrics[mode]
    for i, name in enumerate(trainer.reward_func_names):
        metrics[f"rewards/{name}/std"][-1] = nanstd(rows[:, i]).item()
    rewards = (rows * trainer.reward_weights.to(rows.device).unsqueeze(0)).nansum(dim=1)
    rewards[torch.isnan(rows).all(dim=1)] = torch.nan
    metrics["reward_std"][-1] = nanstd(rewards).item()


def _hf_model(module: Any) -> Any:
    """The model inside a DeepSpeed engine (DPOTrainer's reference model is one under DeepSpeed)."""
    return getattr(module, "module", module)


@contextlib.contextmanager
def _cut_fused_calls(model: Any, group: Any, sharding: str, left_padding: bool = False) -> Iterator[None]:
    """Within the block, each ``model(..., labels=, fused_lm_head=True)`` call (keyword arguments, full
    rows ``(B, S)``) runs on this rank's shard and returns TRL's per-token fields whole, ``(B, S - 1)``
    (see :class:`DPOLoss`). The full length of each call (and, with ``left_padding``, each row's count
    of leading pads, ``(B,)``) travels from the pre-hook to the hook on a stack local to this block
    (the policy's and the reference model's calls do not interleave).

    ``left_padding``: rows may start with pads (``attention_mask`` zeros, GRPO's left-padded prompts),
    which seqpar attention cannot mask; each row is rotated left by its leading pads before the cut
    (they become end padding) and the gathered fields are rotated back, zero at the leading pads."""
    lengths: list[tuple[int, Any]] = []

    def cut(module: Any, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
        if not kwargs.get("fused_lm_head"):
            return None
        labels = kwargs.pop("labels", None)
        if args or labels is None or kwargs.get("shift_labels") is not None:
            raise ValueError(
                "seqpar's DPO adapter expects the fused LM head called with keyword arguments and full-row "
                "labels= (TRL 1.16's DPOTrainer); this call differs: check the TRL version (seqpar[trl])"
            )
        call = {**kwargs, "labels": labels}
        lead = _leading_pads(call.get("attention_mask")) if left_padding else None
        if lead is not None:
            seq_len = labels.shape[1]
            # (B, S): row b's token at t + lead[b] moves to t, its leading pads to the end
            index = (torch.arange(seq_len, device=labels.device) + lead[:, None]) % seq_len
            for key in ("input_ids", "attention_mask", "labels"):
                call[key] = call[key].gather(1, index)
        lengths.append((labels.shape[1], lead))
        return args, shard_batch(call, group=group, sharding=sharding)

    def whole(module: Any, args: tuple, kwargs: dict[str, Any], output: Any) -> Any:
        if not kwargs.get("fused_lm_head"):
            return None
        seq_len, lead = lengths.pop()
        fields = {}
        for name in _PER_TOKEN_FIELDS:
            local = getattr(output, name, None)
            if local is None:
                continue
            as_bool = local.dtype == torch.bool
            full = gather_sequence(local.to(torch.uint8) if as_bool else local, 1, group=group,
                                   sharding=sharding, grad_reduction="slice")
            full = full.narrow(1, 0, seq_len - 1)  # (B, S_pad) -> (B, S - 1): TRL's unshifted layout
            if lead is not None:  # rotated rows back: position t held what the row's t - lead[b] holds
                t = torch.arange(seq_len - 1, device=full.device)[None]
                source = t - lead[:, None]  # (B, S - 1)
                full = full.gather(1, source.clamp(min=0)) * (source >= 0)
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


def _leading_pads(mask: Any) -> torch.Tensor | None:
    """``(B,)`` count of each row's leading zeros in a 2D ``attention_mask``, or None when no row has any."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return None
    lead = (mask.cumsum(1) == 0).sum(1)
    return lead if bool(lead.any()) else None  # one host read per call: most batches have none


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
    if owner is _trl_class("trl.trainer.grpo_trainer", "GRPOTrainer"):
        return GRPOLoss()
    return None
