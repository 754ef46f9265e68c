"""The fuzzer's ``trainer`` cases (:mod:`seqpar.testing.fuzz`): the trainers users run, with seqpar, against the
same trainer without it.

Drawn: the trainer (``trainer``: ``transformers.Trainer`` / :class:`~seqpar.integrations.trainer.SeqParTrainer`;
``sft``: TRL's ``SFTTrainer`` / ``sequence_parallel(SFTTrainer)``), the world (1-4 ranks) and its DP x SP split
(``dp`` a divisor of the world, SP = world / dp), the engine (DeepSpeed ZeRO-1/2/3 through
``TrainingArguments(deepspeed=...)``, or FSDP2 through ``seqpar_config=``), the ring mode and sharding, a tiny
model (:data:`MODEL_TYPES`, rotary Llama-family and MoE models, the trainer tests' kinds; the MoE router loss on
or off), and the trainer's knobs: per-device batch 1-2, gradient accumulation 1-2, one or two optimizer steps,
``max_grad_norm`` (off, 1.0, or 0.05, which clips), ``average_tokens_across_devices``, ``label_smoothing_factor``
now and then (seqpar refuses it by name), an evaluation after every step (``eval_steps=1``); for ``trainer`` the
collator (equal-length rows with transformers' default collator, right- or left-padded rows with
``DataCollatorForSeq2Seq``, packed documents with ``DataCollatorWithFlattening``) and prompt tokens masked
(-100) at the start of some rows, and (from a generator of its own, at a per-device batch of 2) now and then one
row of no token (:func:`~seqpar.testing.fuzz_trainers_draw.draw_empty_rows`: packed or right-padded; TRL's
trainers get none, and it says why); for ``sft`` conversational data with a chat template, packing, ``padding_free``,
``assistant_only_loss`` and ``loss_type`` (``nll``, ``dft``). The optimizer is plain SGD (Adam hides a factor
of P).

The contract judged (docs/integrations.md, tests/test_trainer.py, tests/test_trl_sft.py): a seqpar trainer on
DP x SP ranks trains as the same trainer without seqpar on one process whose per-device batch is the global
batch (``micro x dp``; the same accumulation and steps; the eval batch ``dp`` rows, one per replica: with
``average_tokens_across_devices`` transformers 5.2x's eval loss of a step is the token mean over the global
eval batch). The reference is that run
(:func:`run_trainer_case`), in float64 (fp32 ranks): the logged loss of every step (and ``grad_norm`` when
clipping), every evaluation's loss, and every parameter's total update ``p_before - p_after`` (the sum of the
SGD steps, each parameter judged on its own scale) must agree. Tolerances (:data:`LOSS_RTOL`, :data:`UPDATE_RTOL`): the logged numbers 2e-5 relative; each update
1e-4 of its own largest value, plus one fp32 rounding step of the parameter per optimizer step (the update is read
from fp32 parameters: a norm weight near 1.0 resolves its update to ~1.2e-7, which is most of its tolerance in the
``worst`` figure of an exact case). With clipping (``max_grad_norm``) a gradient off by a constant factor is
scaled back to the same update: the logged loss and ``grad_norm`` show it (the planted ``loss_over_world`` in
tests/test_fuzz.py is such a case).

Not drawn, because the trainer itself breaks the contract without seqpar (the reference would differ from a
plain DP run, whatever seqpar does):

- ``average_tokens_across_devices=False`` with DP > 1: each replica's loss is the mean over its own tokens and
  DDP averages the replicas (``transformers.Trainer`` documents this as the per-device mean), not the global
  token mean one process computes. Drawn at DP 1 only;
- the MoE router loss with DP > 1: it is a per-batch statistic (expert load x router probability over the
  batch's tokens), not a sum over tokens, so one process's router loss of the global batch is not the mean of
  the replicas'. Drawn at DP 1 only. Plain ``SFTTrainer`` at DP 2 (no seqpar, ``--set engine=plain``), tiny
  Mixtral with the router loss: ``embed_tokens``' update 6.7e-3 off one process's (case 495490371, found when
  SFTTrainer still turned the router loss on by its coefficient; the draw now sets the coefficient to 0 when the
  router loss is off);
- left-padded rows (``padded-left``) with DP > 1: transformers shifts the labels on the padded row, so the first
  real token of a left-padded row becomes a target predicted from the pad before it; how many rows are padded
  depends on how the global batch is split, so one process (all rows padded to the global batch's longest)
  trains on other targets than DP replicas. Plain ``Trainer`` at DP 2 (no seqpar): step 1's loss 1.9e-3 off one
  process's (case 1588844063 with ``--set engine=plain``). Drawn at DP 1 only (seqpar refuses left padding
  at SP > 1 by name);
- evaluation under ``SFTTrainer`` with DP > 1: its own ``prediction_step`` passes no target count, so each
  process's eval loss is its own batch's token mean and the logged one their mean, not the token mean over the
  global eval batch that one process computes (transformers' ``Trainer.prediction_step`` counts the global
  batch's targets). Drawn at DP 1 only.

**DPO and GRPO** (``dpo``: ``sequence_parallel(trl.DPOTrainer)``, ``grpo``: ``sequence_parallel(trl.GRPOTrainer)``;
about 40% of the cases, drawn from a generator of their own seeded after every older draw, so the older case
seeds keep their compositions). The contract is the one above (docs/integrations.md, tests/test_trl_dpo.py,
tests/test_trl_grpo.py): the same TRL trainer without seqpar on one process over the same global batch, float64,
SGD; judged as above (the logged loss, ``grad_norm`` when clipping, DPO's evaluation loss, every parameter's
update), plus the logged metrics seqpar promises equal to one process's (:data:`METRICS`): DPO's rewards
(chosen, rejected, margins, accuracies), log-probs, entropy, logits, mean token accuracy and ``num_tokens``;
GRPO's ``kl``, entropy, clip ratios, rewards (their mean and standard deviation, each reward function's too),
completion length and ``num_tokens``. A number that is a small difference of large ones is judged against their
scale too (:func:`_floor`).

- DPO draws: one or two loss types of TRL's 15 (with ``loss_weights`` now and then), ``label_smoothing``
  (``dpo_smoothing``), ``beta``, ``ld_alpha``, WPO weighting (``use_weighting``), a given reference model (a second
  copy of the weights) or the one DPOTrainer builds from the policy's folder, ``sync_ref_model`` (TR-DPO, every
  step; seqpar refuses it by name under its FSDP2), ``precompute_ref_log_probs`` now and then (seqpar refuses it by
  name), accumulation, DP x SP, clipping,
  evaluation, preference pairs of 1-7 prompt and 1-9 completion words.
- GRPO draws: ``num_generations`` (2, 3), one or two prompt groups per rank and step, ``num_iterations`` (1, 2),
  ``scale_rewards`` (``group``, ``none``, now and then ``batch``, refused by name), ``loss_type`` (``grpo``,
  ``bnpo``, ``dr_grpo``, ``dapo``), ``beta`` (0: no reference model; 0.2: KL), ``epsilon``, one or two
  deterministic reward functions with or without ``reward_weights``, ``max_completion_length`` 3-6, prompts of 1-6
  words. Rollouts must be the same on both sides: the runner samples them with the Gumbel-max trick under noise
  drawn from each row's prompt, its place in its group and the decoding step (not torch's RNG), so one process
  and DP replicas holding the prompts in other batches sample the same completions (SP ranks share them anyway).
  A case whose advantages are all 0 (each group scored its completions alike) and without KL moves nothing; then
  seqpar's run must not move anything either. Accumulation is 1 (GRPOTrainer shuffles the rows of a generation batch over the accumulation steps with torch's
  RNG, which no split over replicas can match; its per-micro-batch metrics depend on that split).
- Not drawn: TRL 1.16's DPOTrainer has no ``reference_free`` or ``use_logits_to_keep`` any more, and its
  ``padding_free`` falls back to padding (a warning), so they are not knobs; vLLM generation, continuous batching,
  ``top_entropy_quantile < 1`` and other GRPO loss types (``cispo``, ``sapo``, ...) are not drawn (refused by
  seqpar, or not yet); models without rotary embeddings are never drawn (all of :data:`MODEL_TYPES` are rotary).
- Not drawn, DPOTrainer's own without seqpar: WPO weighting (``use_weighting``) with the ``hinge`` loss (TRL
  multiplies the relu's output in place: autograd's "modified by an inplace operation", plain DPOTrainer on one
  process too, ``--case-seed 494186300 --set world=1 --set sp=1 --set engine=plain``) or the ``aot`` losses
  (DPOTrainer raises NotImplementedError); ``exo_pair`` without label smoothing (DPOConfig refuses it: drawn with
  1e-3).
- Not drawn at DP > 1, the trainers' own behaviour without seqpar: GRPO's ``bnpo`` divides by the replica's own
  completion tokens (each replica's token mean, averaged by the engine), not the global batch's: plain
  GRPOTrainer on 2 processes, ``--case-seed 1687088778 --set grpo_loss=bnpo --set engine=plain``, step 1's loss
  5.6e-2 and ``embed_tokens``' update 3.8e-2 off one process's. DPO's ``aot`` and ``aot_unpaired`` losses sort
  the log-ratios over the batch, each replica its own rows, not the global batch: by reading TRL's code, not yet
  shown (``--case-seed 1235500454 --set 'dpo_loss=["aot"]' --set loss_weights=null --set engine=plain``, one pair
  per replica, was exact: at the first step every delta is 0, whatever the order).

**PEFT/LoRA** (``peft``: about 35% of the cases, every trainer, every engine, DP x SP; drawn from a generator of
its own seeded after every older draw; the adapter's config, ``lora``, is drawn in every case so that ``--set
peft=true`` forces LoRA on with each case's own config). Wired as a user wires it: ``peft.get_peft_model(model,
LoraConfig(...))`` before ``Trainer`` / SeqParTrainer, ``peft_config=LoraConfig(...)`` to SFT, DPO and GRPO (TRL
wraps the model itself). Drawn: the rank (1, 2, 4, 8), ``lora_alpha`` (1, 4, 8, 16), 1-4 target modules among
``q/k/v/o_proj`` and, on the dense types, ``gate/up/down_proj``, peft's default init (B = 0: at step 1 only B
moves) or ``init_lora_weights=False`` (A and B random: step 1 moves both), ``modules_to_save`` (``lm_head`` or
``embed_tokens``, a trainable copy) now and then. DPO's reference is then the policy with its adapters disabled
when none is given (``ref="built"``: DPOTrainer builds no second model under PEFT), a second model when given;
GRPO's KL reference (``beta > 0``) is the adapter-disabled policy. The reference run is the same trainer with the
same LoRA config on one process; the adapter's random init is drawn under the case's seed (``lora["seed"]``) in
fp32 by peft and cast, so both sides start from the same adapters (judged: "differs before training"). Judged
besides the above: the same parameters are trainable on both sides, all of them adapters (``lora_``) or
``modules_to_save`` copies, and every frozen parameter (the base, the originals of ``modules_to_save``) ends
bit-for-bit where it started; each trainable parameter's update on its own scale (as every parameter's above).

- LoRA's variants (fz24b; drawn in every case's ``lora`` from a generator of their own seeded after every older
  draw, so the older case seeds keep every draw they had): rsLoRA (``use_rslora``, about 30%), ``bias``
  (``"lora_only"``, ``"all"``: 20% each; only qwen2 has biases, on q/k/v), LoRA on ``embed_tokens`` (25%; not with
  ``modules_to_save=["embed_tokens"]``), DoRA (``use_dora``, 20%), and for TRL's trainers (half the cases) a
  ``PeftModel`` made by ``get_peft_model`` before the trainer instead of ``peft_config=`` (``premade``;
  DPOTrainer with the reference built from the policy, and GRPOTrainer with KL, then add a
  frozen copy of the adapter, "ref", and compute the reference through it). Judged as above; the trainable
  biases (all of them under ``"all"``, the adapted layers' ``base_layer.bias`` under ``"lora_only"``) are
  trainable parameters of their own. Plants (:data:`PLANTS`): ``adapter_grad_over_world`` (every LoRA layer's
  adapter branch, Linear or Embedding, DoRA's magnitude included), ``bias_grad_over_world``, ``rslora_ignored``.
- Exact since ref25 (refused by name before, drawn all along): under seqpar's FSDP2, a premade PeftModel given to DPO
  with the reference built from the policy (TRL adds its "ref" adapter and copies the adapter into it: after the
  mixin had sharded the model, "aten.copy_.default got mixed torch.Tensor and DTensor", case 1171), or to GRPO with
  ``beta != 0`` (the same "ref" adapter; 1720900617 with ``beta=0.2``). The mixin shards the model Trainer's
  ``__init__`` receives, after TRL's ``__init__`` added the adapter. GRPO's generation under FSDP2 with a PeftModel
  crashed until fz24d ("aten.embedding.default ...", case 1720900617 with ``--set beta=0.0``: ``fsdp.wrap`` runs a
  PeftModel's ``generate`` as a forward of FSDP2's root).
- Not drawn, PEFT's own without seqpar: ``bias`` other than ``"none"`` with a premade PeftModel to which TRL adds
  its "ref" adapter (peft's "LoraModel supports only 1 adapter with bias" from ``add_adapter``; plain DPOTrainer
  on one process too: case 638403696 with ``--set peft=true`` as first drawn, and 1171 with ``--set
  engine=plain``, bias ``"all"``, premade): the draw sets ``bias="none"`` there.
- Dropout is always 0: LoRA's dropout masks come from torch's RNG on each process, drawn over each rank's
  shard of the sequence and batch, which no split over ranks can draw as one process does.
- Exact since ref25 (refused by name before, drawn all along): a TRL trainer's ``peft_config=`` under seqpar's FSDP2
  (``seqpar_config=``; the mixin sharded the model before TRL added the adapters, which were then sharded and never
  gathered: peft's "size of tensor a (16) must match ... b (8)" at the first step, case 188540536 with ``--set
  peft=true``). Trainer with ``get_peft_model`` under FSDP2 is exact.
- Not drawn, TRL's own without seqpar: ``sync_ref_model`` with PEFT (DPOTrainer and GRPOTrainer raise
  NotImplementedError whenever the model is a PEFT model, trl 1.16's ``dpo_trainer.py`` / ``grpo_trainer.py``;
  case 2076377569 with ``--set peft=true`` before the draw dropped it: ``sync_ref_model`` is False under PEFT).
- Not drawn, DeepSpeed's or TRL's own without seqpar: the router loss with LoRA under ZeRO-3 (case 1410858051 with
  LoRA: DPO, tiny Mixtral, the router loss, ZeRO-3, two steps: ``grad_norm`` 7e-5 relative and a ``lora_A`` update
  1.5e-3 of its scale off at step 2, the same with TRL's DPOTrainer under ZeRO-3 on one process without seqpar;
  exact under ZeRO-2, without the router loss, or with one step): :func:`router_loss` turns it off there.
- Not drawn (not yet, or not on CPU): LoRA on the MoE types' experts (fused 3D tensors: peft's
  ``target_parameters``), other PEFT methods (prefix tuning, IA3), QLoRA (bitsandbytes' quantized layers need an
  accelerator), LoRA's own bias on B (``lora_bias``), ``init_lora_weights`` other than peft's default and
  ``False`` (PiSSA, OLoRA, LoftQ ...).

Runners are found through the entry-point group :data:`ENTRY_POINT_GROUP` (seqpar's own,
``seqpar.integrations.fuzz_trainer:run_trainer``, declared in setup.cfg), as the ``engine`` kind finds its
engine runners: the harness never imports ``seqpar.integrations``.

The kind is two modules, re-exported here: :mod:`seqpar.testing.fuzz_trainers_draw` (the constants, the draws,
:func:`force_trainer`, :func:`trainer_summary`) and :mod:`seqpar.testing.fuzz_trainers_run` (the data, the installed
runner, the plants, the pool task, the judging, :func:`run_trainer_case`).
"""

from __future__ import annotations

from seqpar.testing.fuzz_trainers_draw import (
    BATCH_SORTED_LOSSES,
    DPO_LOSSES,
    ENGINES,
    GRPO_LOSSES,
    GRPO_REWARDS,
    LORA_ATTENTION,
    LORA_MLP,
    LORA_SHARE,
    LORA_VARIANTS_OFF,
    MODEL_TYPES,
    MOE_TYPES,
    TRAINERS,
    TRL_TRAINERS,
    draw_trainer,
    force_trainer,
    ref_adapter,
    router_loss,
    trainer_summary,
)
from seqpar.testing.fuzz_trainers_run import (
    ASSISTANT,
    CHAT_TEMPLATE,
    ENTRY_POINT_GROUP,
    EOS,
    LOSS_RTOL,
    LR,
    METRICS,
    PAD,
    PLANTS,
    RUNNER_NAME,
    SFT_MAX_LENGTH,
    UPDATE_RTOL,
    USER,
    judge_trainer,
    run_trainer_case,
    trainer_data,
    trainer_runner,
    trainer_task,
)

__all__ = ["TRAINERS", "ENGINES", "MODEL_TYPES", "ENTRY_POINT_GROUP", "PLANTS", "draw_trainer", "trainer_summary",
           "trainer_task", "trainer_data", "judge_trainer", "run_trainer_case", "router_loss", "ref_adapter",
           "force_trainer", "TRL_TRAINERS", "DPO_LOSSES", "BATCH_SORTED_LOSSES", "GRPO_LOSSES", "GRPO_REWARDS",
           "MOE_TYPES", "LORA_SHARE", "LORA_ATTENTION", "LORA_MLP", "LORA_VARIANTS_OFF", "RUNNER_NAME", "LR",
           "SFT_MAX_LENGTH", "LOSS_RTOL", "UPDATE_RTOL", "PAD", "USER", "ASSISTANT", "EOS", "CHAT_TEMPLATE",
           "trainer_runner", "METRICS"]
