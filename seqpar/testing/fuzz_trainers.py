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
(-100) at the start of some rows; for ``sft`` conversational data with a chat template, packing, ``padding_free``,
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
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["TRAINERS", "ENGINES", "MODEL_TYPES", "ENTRY_POINT_GROUP", "PLANTS", "draw_trainer", "trainer_summary",
           "trainer_task", "trainer_data", "judge_trainer", "run_trainer_case", "router_loss", "ref_adapter",
           "force_trainer"]

TRAINERS = ("trainer", "sft", "dpo", "grpo")
TRL_TRAINERS = frozenset({"sft", "dpo", "grpo"})
# Each trainer's runner is the entry point of its name in setup.cfg; seqpar's are one function
# (seqpar.integrations.fuzz_trainer:run_trainer), which dispatches on the trainer name it is given
RUNNER_NAME = {name: name for name in TRAINERS}
DPO_LOSSES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
              "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm")
BATCH_SORTED_LOSSES = frozenset({"aot", "aot_unpaired"})  # sort over the batch: DP 1 only (the module docstring)
GRPO_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo")
GRPO_REWARDS = ("word_sum", "length")
ENGINES = ("zero1", "zero2", "zero3", "fsdp2")
MODEL_TYPES = ("llama", "qwen2", "mixtral", "qwen3_moe")
MOE_TYPES = frozenset({"mixtral", "qwen3_moe"})
ENTRY_POINT_GROUP = "seqpar.fuzz_trainers"
PLANTS = ("loss_over_world", "trl_loss_over_world", "lora_grad_over_world", "adapter_grad_over_world",
          "bias_grad_over_world", "rslora_ignored")
LORA_SHARE = 0.35  # of the cases, LoRA on (most post-training runs use an adapter)
LORA_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
LORA_MLP = ("gate_proj", "up_proj", "down_proj")  # the dense types' MLP (the MoE types' experts are fused tensors)
LR = 0.1
SFT_MAX_LENGTH = 24
# fp32 ranks against a float64 reference: the logged numbers, and each parameter's update on its own scale
# (plus one fp32 rounding step of the parameter per optimizer step: the update is read from fp32 parameters)
LOSS_RTOL = 2e-5
UPDATE_RTOL = 1e-4


def draw_trainer(rng: random.Random) -> dict[str, Any]:
    """A ``trainer`` case's draws (JSON-able; see the module docstring)."""
    trainer = rng.choice(("trainer", "trainer", "trainer", "sft", "sft"))
    world = rng.randint(1, 4)
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    dp = 1 if rng.random() < 0.5 else rng.choice(divisors)
    model_type = rng.choice(MODEL_TYPES)
    micro = rng.choice((1, 1, 2))
    accumulation = rng.choice((1, 1, 2))
    steps = rng.choice((1, 2))
    rows = micro * dp * accumulation * steps
    draws: dict[str, Any] = {
        "kind": "trainer", "trainer": trainer, "world": world, "dp": dp, "sp": world // dp,
        "engine": rng.choice(ENGINES), "model_type": model_type,
        "mode": rng.choice(("ring", "ring", "allgather")), "sharding": rng.choice(("zigzag", "contiguous")),
        "micro": micro, "accumulation": accumulation, "steps": steps,
        "max_grad_norm": rng.choice((0.0, 0.0, 1.0, 0.05)),
        "average_tokens": True if dp > 1 else rng.random() < 0.7,  # False at DP > 1: the trainer's own (docstring)
        "label_smoothing": 0.1 if rng.random() < 0.08 else 0.0,
        "router_loss": model_type in MOE_TYPES and dp == 1 and rng.random() < 0.5,  # DP 1 only (docstring)
        "evaluate": rng.random() < 0.3, "data_seed": rng.randrange(2 ** 31),
    }
    if trainer == "sft" and dp > 1:
        draws["evaluate"] = False  # SFTTrainer's own eval loss at DP > 1 (the module docstring)
    if trainer == "trainer":
        collator = rng.choice(("rows", "padded-right", "padded-left", "packed"))
        if collator == "padded-left" and dp > 1:
            collator = "padded-right"  # the trainer's own at DP > 1 (the module docstring)
        if collator == "rows":
            n = rng.randint(3, 20)
            lengths = [n] * rows
        else:
            lengths = [rng.randint(1 if collator == "packed" else 2, 20) for _ in range(rows)]
        masked = [rng.randint(1, max(1, n // 2)) if rng.random() < 0.3 else 0 for n in lengths]
        draws.update(collator=collator, lengths=lengths, masked=masked)
    else:
        packing = rng.random() < 0.5
        draws.update(packing=packing, padding_free=packing or rng.random() < 0.5,
                     assistant_only_loss=rng.random() < 0.6, loss_type=rng.choice(("nll", "nll", "dft")),
                     turns=[[rng.randint(1, 6), rng.randint(1, 9)] for _ in range(max(rows, 1) * 3)])
    # DPO and GRPO: drawn from their own generator, seeded after every older draw, so that the cases drawn before
    # them (FOUND's pinned seeds) keep their compositions
    trl = random.Random(rng.randrange(2 ** 31))
    pick = trl.random()
    if pick < 0.4:
        _draw_trl(trl, draws, "dpo" if pick < 0.2 else "grpo")
    # LoRA: its own generator, seeded after every older draw (DPO / GRPO's included), so the older case seeds keep
    # their compositions; the adapter's config is drawn in every case and used where ``peft`` is (``--set
    # peft=true`` forces it on, with each case's own config)
    lora = random.Random(rng.randrange(2 ** 31))
    draws["peft"] = lora.random() < LORA_SHARE
    draws["lora"] = _draw_lora(lora, draws)
    if draws["peft"] and draws.get("sync_ref_model"):
        draws["sync_ref_model"] = False  # DPOTrainer's own NotImplementedError under PEFT (the module docstring)
    # LoRA's variants (fz24b): their own generator, seeded after every older draw, so the older case seeds keep
    # every draw they had (the variants are added to the adapter's config; pinned LoRA cases set them off)
    draws["lora"].update(_draw_lora_variants(random.Random(rng.randrange(2 ** 31)), draws))
    return draws


def _resize(items: list[Any], n: int, draw: Callable[[], Any]) -> list[Any]:
    """``items`` cut to its first ``n`` or extended to ``n`` by ``draw()``."""
    return list(items[:n]) + [draw() for _ in range(n - len(items))]


def force_trainer(draws: dict[str, Any], free: list[str], rng: random.Random) -> str | None:
    """Re-derive, in place, what forced keys (``--set``, :func:`seqpar.testing.fuzz.force`) make stale in a
    ``trainer`` case's ``draws``; ``free`` names the keys not forced (only those are re-derived), ``rng`` draws
    what must be new. Returns the conflict (the case is then ``skipped``, never judged) or None.

    The split: ``world == dp x sp`` (a forced ``dp`` re-derives ``sp``, a forced ``sp`` ``dp``, a forced ``world``
    the drawn ``dp`` if it still divides it, else the largest divisor under it). The data: the global batch's rows
    (``micro x dp x accumulation x steps``; GRPO's prompts ``micro / num_generations x dp x steps``) cut to the
    first ones or extended by new draws. The draws only DP 1 takes (the module docstring: the trainer's own,
    without seqpar): at DP > 1 ``average_tokens`` on, no router loss, no SFT evaluation, right padding for
    left, no batch-sorted DPO loss (``sigmoid`` if none is left), GRPO's ``bnpo`` as ``grpo``."""
    world, dp, sp = draws["world"], draws["dp"], draws["sp"]
    for key, v in (("dp", dp), ("sp", sp), ("world", world)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            return f"{key}={v!r} (a positive int)"
    if world != dp * sp:
        if "sp" in free and world % dp == 0:
            sp = world // dp
        elif "dp" in free and world % sp == 0:
            dp = world // sp
        elif "dp" in free and "sp" in free:
            dp = max(d for d in range(1, dp + 1) if world % d == 0)
            sp = world // dp
        else:
            return f"world={world} != dp={dp} x sp={sp} (each rank is one DP replica's SP rank)"
    draws.update(dp=dp, sp=sp)
    trainer = draws["trainer"]
    rows = draws["micro"] * dp * draws["accumulation"] * draws["steps"]
    if trainer == "trainer":
        n = draws["lengths"][0] if draws["lengths"] else rng.randint(3, 20)
        data = {"lengths": lambda: n if draws["collator"] == "rows" else
                rng.randint(1 if draws["collator"] == "packed" else 2, 20), "masked": lambda: 0}
    elif trainer == "sft":
        rows = max(rows, 1) * 3
        data = {"turns": lambda: [rng.randint(1, 6), rng.randint(1, 9)]}
    elif trainer == "dpo":
        data = {"pairs": lambda: [rng.randint(1, 7), rng.randint(1, 9), rng.randint(1, 9)]}
    else:
        rows = max(1, draws["micro"] // draws["num_generations"]) * dp * draws["steps"]
        data = {"prompts": lambda: rng.randint(1, 6)}
    for key, draw in data.items():
        if len(draws[key]) != rows:
            if key not in free:
                return f"{key} ({len(draws[key])} rows) != the {rows} rows of the global batch at dp={dp}"
            draws[key] = _resize(draws[key], rows, draw)
    if dp > 1:
        rules = {"average_tokens": True, "router_loss": False}
        if trainer == "sft":
            rules["evaluate"] = False
        if trainer == "trainer" and draws["collator"] == "padded-left":
            rules["collator"] = "padded-right"
        if trainer == "grpo" and draws["grpo_loss"] == "bnpo":
            rules["grpo_loss"] = "grpo"
        if trainer == "dpo" and BATCH_SORTED_LOSSES & set(draws["dpo_loss"]):
            keep = [i for i, x in enumerate(draws["dpo_loss"]) if x not in BATCH_SORTED_LOSSES]
            rules["dpo_loss"] = [draws["dpo_loss"][i] for i in keep] or ["sigmoid"]
            if draws["loss_weights"] and "loss_weights" in free and "dpo_loss" in free:
                draws["loss_weights"] = [draws["loss_weights"][i] for i in keep] or [1.0]
        draws.update({k: v for k, v in rules.items() if k in free})
    return None


LORA_VARIANTS_OFF = {"rslora": False, "bias": "none", "embed": False, "dora": False, "premade": False}
"""The LoRA variants' values that leave an adapter as drawn before them (fz24b): ``--set`` them, or merge them into
a pinned case's ``lora``, to train it as it was drawn then."""


def _draw_lora_variants(rng: random.Random, draws: dict[str, Any]) -> dict[str, Any]:
    """The LoRA variants a TRL + PEFT user sets (the module docstring): rsLoRA (``use_rslora``: the scale
    ``alpha / sqrt(r)``), ``bias`` (``"lora_only"``: the adapted layers' biases train; ``"all"``: every bias; only
    the biased types, qwen2's q/k/v, have any), LoRA on ``embed_tokens`` (never with ``modules_to_save`` of it: peft
    refuses a module both adapted and saved), DoRA (``use_dora``), and for TRL's trainers a ``PeftModel`` made by
    ``get_peft_model`` before the trainer (``premade``) instead of ``peft_config=`` (Trainer always takes one)."""
    out = {"rslora": rng.random() < 0.3,
           "bias": rng.choice(("none", "none", "none", "lora_only", "all")),
           "embed": rng.random() < 0.25,
           "dora": rng.random() < 0.2,
           "premade": rng.random() < 0.5}
    if draws["lora"]["modules_to_save"] == ["embed_tokens"]:
        out["embed"] = False
    if out["premade"] and ref_adapter(draws):
        out["bias"] = "none"  # peft's own: one adapter with bias per model (the module docstring)
    return out


def ref_adapter(draws: dict[str, Any]) -> bool:
    """Whether TRL adds a frozen copy of a premade PeftModel's adapter ("ref"): DPO with the reference built from
    the policy, GRPO with KL (``beta > 0``)."""
    return (draws["trainer"] == "dpo" and draws["ref_model"] == "built") or \
        (draws["trainer"] == "grpo" and draws["beta"] > 0)


def router_loss(draws: dict[str, Any]) -> bool:
    """Whether the case trains with the MoE router loss: as drawn (``router_loss``), but never with LoRA under
    ZeRO-3 (DeepSpeed's or TRL's own without seqpar, the module docstring). Read where the model is built, so a
    case's draws stay as drawn and ``--set peft=...`` decides."""
    return bool(draws["router_loss"]) and not (draws.get("peft") and draws.get("engine") == "zero3")


def _draw_lora(rng: random.Random, draws: dict[str, Any]) -> dict[str, Any]:
    """A LoRA adapter's config (peft's ``LoraConfig`` knobs, see the module docstring): rank, alpha, 1-4 target
    modules among the attention projections and (dense MLP types) the MLP projections, the init (peft's default,
    B = 0, or ``init_lora_weights=False``: B random too, so step 1 moves A), ``modules_to_save`` now and then, and
    the seed the adapter is initialized under (the same on both sides)."""
    pool = list(LORA_ATTENTION) + ([] if draws["model_type"] in MOE_TYPES else list(LORA_MLP))
    return {"r": rng.choice((1, 2, 4, 8)), "alpha": rng.choice((1, 4, 8, 16)),
            "targets": sorted(rng.sample(pool, rng.randint(1, 4))),
            "init": rng.choice(("default", "default", "random")),
            "modules_to_save": rng.choice((["lm_head"], ["embed_tokens"])) if rng.random() < 0.2 else None,
            "seed": rng.randrange(2 ** 31)}


def _draw_trl(rng: random.Random, draws: dict[str, Any], trainer: str) -> None:
    """Turn ``draws`` (a drawn ``trainer`` / ``sft`` case) into a DPO or GRPO case: the world, engine, model,
    ring mode, clipping and steps stay; the other trainers' data knobs go; the trainer's own are drawn."""
    for key in ("collator", "lengths", "masked", "packing", "padding_free", "assistant_only_loss", "loss_type",
                "turns"):
        draws.pop(key, None)
    dp = draws["dp"]
    draws.update(trainer=trainer, label_smoothing=0.0)
    if trainer == "dpo":
        # at DP > 1 the batch-sorted losses are DPOTrainer's own per replica (the module docstring)
        losses = [x for x in DPO_LOSSES if dp == 1 or x not in BATCH_SORTED_LOSSES]
        loss_types = rng.sample(losses, rng.choice((1, 1, 2)))
        pairs = draws["micro"] * dp * draws["accumulation"] * draws["steps"]
        smoothing = rng.choice((0.0, 0.0, 0.1))
        if "exo_pair" in loss_types and not smoothing:
            smoothing = 1e-3  # DPOConfig requires it for EXO (the paper's value)
        draws.update(
            dpo_loss=loss_types,
            loss_weights=[rng.choice((0.3, 1.0, 1.7)) for _ in loss_types] if rng.random() < 0.4 else None,
            dpo_smoothing=smoothing, beta=rng.choice((0.1, 0.5, 1.0)),
            ld_alpha=0.5 if rng.random() < 0.2 else None,
            # WPO: TRL's own hinge multiplies its relu output in place (autograd error), and it refuses the aot losses
            use_weighting=rng.random() < 0.2 and not {"hinge", "aot", "aot_unpaired"} & set(loss_types),
            ref_model=rng.choice(("given", "built")), sync_ref_model=draws["steps"] > 1 and rng.random() < 0.15,
            precompute_ref=rng.random() < 0.04,
            pairs=[[rng.randint(1, 7), rng.randint(1, 9), rng.randint(1, 9)] for _ in range(pairs)])
        return
    generations = rng.choice((2, 2, 3))
    groups = rng.choice((1, 1, 2))  # prompt groups per rank and optimizer step
    iterations = rng.choice((1, 2))
    draws.update(
        micro=generations * groups, accumulation=1, evaluate=False, num_generations=generations,
        num_iterations=iterations,
        scale_rewards=rng.choice(("group", "group", "none")) if rng.random() < 0.92 else "batch", grpo_loss=rng.choice(GRPO_LOSSES), beta=rng.choice((0.0, 0.2)),
        epsilon=rng.choice((0.2, 0.05)), rewards=rng.choice((["word_sum"], ["length"], ["word_sum", "length"])),
        max_completion_length=rng.randint(3, 6),
        prompts=[rng.randint(1, 6) for _ in range(groups * dp * draws["steps"])])
    if draws["grpo_loss"] == "bnpo" and dp > 1:
        draws["grpo_loss"] = "grpo"  # bnpo's token mean is GRPOTrainer's own per replica (the module docstring)
    draws["reward_weights"] = [rng.choice((0.5, 1.0, 2.0)) for _ in draws["rewards"]] \
        if len(draws["rewards"]) > 1 and rng.random() < 0.5 else None


def trainer_summary(draws: dict[str, Any]) -> str:
    """One short line naming the case's composition."""
    d = draws
    parts = [f"trainer {d['trainer']} {d['engine']} P={d['world']}", f"dp={d['dp']}x sp={d['sp']}", d["model_type"],
             d["mode"], d["sharding"], f"micro={d['micro']} ga={d['accumulation']} steps={d['steps']}"]
    if d["trainer"] == "trainer":
        lengths = f"{d['lengths'][0]}x{len(d['lengths'])}" if d["collator"] == "rows" else str(d["lengths"])
        parts.append(f"{d['collator']}={lengths}" + (f" masked={d['masked']}" if any(d["masked"]) else ""))
    elif d["trainer"] == "dpo":
        parts.append(f"loss={'+'.join(d['dpo_loss'])}" + (f" weights={d['loss_weights']}" if d["loss_weights"] else "")
                     + f" beta={d['beta']} ref={d['ref_model']} pairs={len(d['pairs'])}")
        for key, name in (("dpo_smoothing", "dpo-smoothing"), ("ld_alpha", "ld_alpha"), ("use_weighting", "wpo"),
                          ("sync_ref_model", "sync-ref"), ("precompute_ref", "precompute-ref")):
            if d[key]:
                parts.append(name if d[key] is True else f"{name}={d[key]}")
    elif d["trainer"] == "grpo":
        parts.append(f"loss={d['grpo_loss']} G={d['num_generations']} prompts={d['prompts']} "
                     f"iterations={d['num_iterations']} scale={d['scale_rewards']} beta={d['beta']} "
                     f"eps={d['epsilon']} rewards={'+'.join(d['rewards'])}"
                     + (f" weights={d['reward_weights']}" if d["reward_weights"] else "")
                     + f" completion<={d['max_completion_length']}")
    else:
        parts.append(("packing " if d["packing"] else "") + ("padding-free " if d["padding_free"] else "")
                     + ("assistant-only " if d["assistant_only_loss"] else "") + f"loss={d['loss_type']}")
    if d.get("peft"):
        lo = d["lora"]
        parts.append(f"lora r={lo['r']} alpha={lo['alpha']} on={'+'.join(t[:-5] for t in lo['targets'])}"
                     + (" init=random" if lo["init"] == "random" else "")
                     + (f" save={'+'.join(lo['modules_to_save'])}" if lo["modules_to_save"] else "")
                     + (" +embed" if lo.get("embed") else "") + (" rslora" if lo.get("rslora") else "")
                     + (" dora" if lo.get("dora") else "")
                     + (f" bias={lo['bias']}" if lo.get("bias", "none") != "none" else "")
                     + (" premade" if lo.get("premade") and d["trainer"] in TRL_TRAINERS else ""))
    if d["max_grad_norm"]:
        parts.append(f"clip={d['max_grad_norm']}")
    if not d["average_tokens"]:
        parts.append("no-avg-tokens")
    if d["label_smoothing"]:
        parts.append(f"smoothing={d['label_smoothing']}")
    if router_loss(d):
        parts.append("router-loss")
    if d["evaluate"]:
        parts.append("eval")
    return " ".join(parts)


# --------------------------------------------------------------------------------------------------
# Data (rebuilt on each rank from the draws: the same everywhere)
# --------------------------------------------------------------------------------------------------

PAD, USER, ASSISTANT, EOS = 0, 1, 2, 3  # the chat tokenizer's special tokens; words t4 .. t<VOCAB-1> are the rest
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}<u> {{ m['content'] }} "
    "{% else %}<a> {% generation %}{{ m['content'] }} <eos>{% endgeneration %} {% endif %}{% endfor %}"
)


def _tokenizer(padding_side: str = "right") -> Any:
    """A word-level tokenizer over the tiny models' vocabulary (one token per word ``t<id>``), with a chat
    template marking the assistant's tokens (``{% generation %}``): nothing is downloaded."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from seqpar.testing.tiny_models import VOCAB

    vocab = {"<pad>": PAD, "<u>": USER, "<a>": ASSISTANT, "<eos>": EOS, **{f"t{i}": i for i in range(4, VOCAB)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>",
                                  padding_side=padding_side, model_input_names=["input_ids", "attention_mask"])
    tok.chat_template = CHAT_TEMPLATE
    return tok


class _Rows(torch.utils.data.Dataset):
    def __init__(self, items: list[dict[str, Any]]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.items[i]


def trainer_data(draws: dict[str, Any]) -> dict[str, Any]:
    """The case's data sets, collator and tokenizer (from ``data_seed``): ``{"train", "eval", "collator",
    "tokenizer"}`` as :func:`seqpar.integrations.fuzz_trainer.run_trainer` takes them. Evaluation: ``2 x dp``
    rows, one per rank and evaluation step (the reference takes ``dp`` rows a step: the global eval batch)."""
    import transformers

    from seqpar.testing.tiny_models import VOCAB

    g = torch.Generator().manual_seed(draws["data_seed"])
    n_eval = 2 * draws["dp"] if draws["evaluate"] else 0
    if draws["trainer"] in ("dpo", "grpo"):
        import datasets

        def text(n: int) -> str:
            return " ".join(f"t{i}" for i in torch.randint(4, VOCAB, (n,), generator=g).tolist())

        if draws["trainer"] == "grpo":
            rows = [{"prompt": text(n)} for n in draws["prompts"]]
            return {"train": datasets.Dataset.from_list(rows), "eval": None, "collator": None,
                    "tokenizer": _tokenizer("left")}
        # the prompt ends in a space: DPOTrainer joins prompt and completion texts as they are
        pairs = [{"prompt": text(p) + " ", "chosen": text(c), "rejected": text(r)} for p, c, r in draws["pairs"]]
        evals = [{"prompt": text(3) + " ", "chosen": text(4), "rejected": text(2)} for _ in range(n_eval)]
        return {"train": datasets.Dataset.from_list(pairs),
                "eval": datasets.Dataset.from_list(evals) if n_eval else None, "collator": None,
                "tokenizer": _tokenizer()}
    if draws["trainer"] == "sft":
        import datasets

        def words(n: int) -> str:
            return " ".join(f"t{i}" for i in torch.randint(4, VOCAB, (n,), generator=g).tolist())

        convs = [{"messages": [{"role": "user", "content": words(u)}, {"role": "assistant", "content": words(a)}]}
                 for u, a in draws["turns"]]
        evals = [{"messages": [{"role": "user", "content": words(3)}, {"role": "assistant", "content": words(4)}]}
                 for _ in range(n_eval)]
        return {"train": datasets.Dataset.from_list(convs), "eval": datasets.Dataset.from_list(evals) if n_eval else None,
                "collator": None, "tokenizer": _tokenizer()}

    def row(n: int, masked: int) -> dict[str, Any]:
        ids = torch.randint(4, VOCAB, (n,), generator=g).tolist()
        return {"input_ids": ids, "labels": [-100] * masked + ids[masked:]}

    train = [row(n, m) for n, m in zip(draws["lengths"], draws["masked"], strict=True)]
    evals = [row(draws["lengths"][i % len(draws["lengths"])], 0) for i in range(n_eval)]
    collator = draws["collator"]
    tok = _tokenizer("left" if collator == "padded-left" else "right")
    if collator == "packed":
        fn = transformers.DataCollatorWithFlattening()
    elif collator.startswith("padded"):
        fn = transformers.DataCollatorForSeq2Seq(tok, padding=True, label_pad_token_id=-100)
    else:
        fn = None
    return {"train": _Rows(train), "eval": _Rows(evals) if n_eval else None, "collator": fn, "tokenizer": tok}


def _build_model(draws: dict[str, Any], dtype: torch.dtype) -> Any:
    from seqpar.testing.tiny_models import build_model

    model = build_model(draws["model_type"], dtype)
    model.config.use_cache = False
    if draws["model_type"] in MOE_TYPES:
        model.config.output_router_logits = router_loss(draws)
        # SFTTrainer turns the router loss on whenever the coefficient is not 0, whatever output_router_logits says
        model.config.router_aux_loss_coef = 0.5 if router_loss(draws) else 0.0
    return model


# --------------------------------------------------------------------------------------------------
# The pool task
# --------------------------------------------------------------------------------------------------

def trainer_runner(trainer: str) -> Any:
    """The installed runner of ``trainer`` (the entry point of that name in :data:`ENTRY_POINT_GROUP`).

    Raises:
        LookupError: none is installed (``pip install -e .`` declares seqpar's own).
    """
    from seqpar.testing.fuzz_engines import engine_runner

    return engine_runner(RUNNER_NAME.get(trainer, trainer), ENTRY_POINT_GROUP, "trainer runner", "run_trainer")


def _plant(name: str | None, world: int, sp: int) -> Any:
    """A deliberately broken composition, for the fuzzer's own tests (undo callable returned):
    ``"lora_grad_over_world"``: every LoRA adapter's gradient times ``dp / world`` (:func:`_plant_lora_grad`);
    ``"trl_loss_over_world"``: DPOTrainer's and GRPOTrainer's own ``compute_loss`` (which seqpar's adapters wrap)
    times ``sp / world`` (the loss divided by the world instead of SP: at DP > 1 every gradient ``1 / dp`` of one
    process's); ``"loss_over_world"``: ``transformers.Trainer.compute_loss``'s result times ``sp / world``, so that
    SeqParTrainer's division of Trainer's process-count factor by ``sp`` divides by the world instead (the
    gradient is ``1 / dp`` of one process's; the ``trainer`` trainer, DP > 1 shows it)."""
    if name is None:
        return lambda: None
    if name not in PLANTS:
        raise ValueError(f"unknown plant {name!r}: choose from {list(PLANTS)}")
    import transformers

    if name == "lora_grad_over_world":
        return _plant_lora_grad((world // sp) / world)  # dp / world
    if name == "adapter_grad_over_world":
        return _plant_adapter_grad((world // sp) / world)
    if name == "bias_grad_over_world":
        return _plant_bias_grad((world // sp) / world)
    if name == "rslora_ignored":
        return _plant_rslora_ignored()

    def scaled(original: Any) -> Any:
        def compute_loss(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(self, *args, **kwargs)
            if isinstance(result, tuple):
                return (result[0] * sp / world, *result[1:])
            return result * sp / world
        return compute_loss

    if name == "trl_loss_over_world":
        # DPOTrainer's / GRPOTrainer's own compute_loss (what seqpar's adapters call) times sp / world
        import trl

        return _patch((trl.DPOTrainer, trl.GRPOTrainer), "compute_loss", scaled)
    return _patch((transformers.Trainer,), "compute_loss", scaled)


def _patch(classes: tuple[type, ...], name: str, planted: Any) -> Any:
    """Replace the method ``name`` of each class in ``classes`` (its own, in its ``__dict__``) by
    ``planted(original)``, the plants' one way to install; the undo callable (restoring each) returned."""
    originals = {cls: cls.__dict__[name] for cls in classes}
    for cls, original in originals.items():
        setattr(cls, name, planted(original))

    def undo() -> None:
        for cls, original in originals.items():
            setattr(cls, name, original)
    return undo


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the incoming gradient times ``factor`` backward (a planted bug)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


def _plant_lora_grad(factor: float) -> Any:
    """``"lora_grad_over_world"``: every LoRA adapter's gradient times ``dp / world`` (= ``1 / sp``: divided by the
    world where DP is due, or an SP share left unsummed). The forward is unchanged (the logged loss is right); the
    gradient flowing into each ``lora_B`` output is scaled, so A's and B's gradients (and what flows on through the
    adapter branch) are. Undo callable returned."""
    from peft.tuners.lora import layer

    def planted(original: Any) -> Any:
        def forward(self: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            handles = [m.register_forward_hook(lambda mod, inp, out: _ScaleGrad.apply(out, factor))
                       for m in self.lora_B.values()]
            try:
                return original(self, x, *args, **kwargs)
            finally:
                for h in handles:
                    h.remove()
        return forward

    return _patch((layer.Linear,), "forward", planted)


def _plant_adapter_grad(factor: float) -> Any:
    """``"adapter_grad_over_world"``: the gradient of every LoRA layer's adapter branch (its output less its base
    layer's: A, B, DoRA's magnitude, on ``nn.Linear`` and ``nn.Embedding`` alike) times ``factor`` (``dp / world``);
    the forward unchanged (to a rounding). Undo callable returned."""
    from peft.tuners.lora import layer

    def planted(original: Any) -> Any:
        def forward(self: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            out = original(self, x, *args, **kwargs)
            if not torch.is_grad_enabled() or self.disable_adapters:
                return out
            base = self.base_layer(x, *args, **{k: v for k, v in kwargs.items() if k != "adapter_names"})
            return base + _ScaleGrad.apply(out - base, factor)
        return forward

    return _patch((layer.Linear, layer.Embedding), "forward", planted)


def _plant_bias_grad(factor: float) -> Any:
    """``"bias_grad_over_world"``: every trainable ``nn.Linear`` bias's gradient times ``factor`` (``dp / world``;
    LoRA's ``bias="lora_only"`` / ``"all"``), the forward unchanged. Undo callable returned."""
    def planted(original: Any) -> Any:  # the original is restored by the undo, not called
        def forward(self: Any, x: torch.Tensor) -> torch.Tensor:
            bias = self.bias
            if bias is not None and bias.requires_grad and torch.is_grad_enabled():
                bias = _ScaleGrad.apply(bias, factor)
            return torch.nn.functional.linear(x, self.weight, bias)
        return forward

    return _patch((torch.nn.Linear,), "forward", planted)


def _plant_rslora_ignored() -> Any:
    """``"rslora_ignored"``: ``use_rslora`` dropped when peft builds an adapter (its scale ``alpha / r``, not
    ``alpha / sqrt(r)``). Undo callable returned."""
    from peft.tuners.lora import layer

    def planted(original: Any) -> Any:
        def update_layer(self: Any, adapter_name: str, r: int, lora_alpha: int, *args: Any, **kwargs: Any) -> Any:
            result = original(self, adapter_name, r, lora_alpha, *args, **kwargs)
            self.scaling[adapter_name] = lora_alpha / r
            return result
        return update_layer

    return _patch((layer.LoraLayer, layer.Embedding), "update_layer", planted)


def trainer_task(ctx: Any, draws: dict[str, Any], role: str, dtype_name: str, plant: str | None = None) -> dict[str, Any]:
    """Pool task (every rank): the case's trainer, ``role`` ``"seqpar"`` (the drawn engine and SP block, on the
    case's world) or ``"reference"`` (the trainer without seqpar on one process, the global batch per step).
    Every rank returns ``{"ok": True, "logs", "evals", "dp_sp"}``, rank 0 the parameter snapshots too
    (``before``, ``after``); ``{"ok": False, "error"}`` on an exception."""
    import warnings

    import transformers

    from seqpar.testing.deepspeed_teardown import released_deepspeed_engines
    from seqpar.testing.fuzz_engines import runner_dir
    from seqpar.testing.launcher_env import launcher_env
    from seqpar.testing.verdicts import error_record

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    env = contextlib.ExitStack()
    env.enter_context(launcher_env(ctx.rank, ctx.world_size))
    runner = None
    undo = _plant(plant if role == "seqpar" else None, draws["world"], draws["sp"])
    try:
        runner = trainer_runner(draws["trainer"])
        reference = role == "reference"
        knobs = {"micro": draws["micro"] * (draws["dp"] if reference else 1), "accumulation": draws["accumulation"],
                 "steps": draws["steps"], "lr": LR, "max_grad_norm": draws["max_grad_norm"],
                 "average_tokens": draws["average_tokens"], "label_smoothing": draws["label_smoothing"],
                 "eval_batch": draws["dp"] if reference else 1}
        if draws["trainer"] == "sft":
            knobs.update(packing=draws["packing"], padding_free=draws["padding_free"],
                         assistant_only_loss=draws["assistant_only_loss"], loss_type=draws["loss_type"],
                         # TRL refuses max_length with padding_free and no packing (it would not truncate)
                         max_length=SFT_MAX_LENGTH if draws["packing"] or not draws["padding_free"] else None)
        if draws["trainer"] == "dpo":
            knobs.update({k: draws[k] for k in ("dpo_loss", "loss_weights", "dpo_smoothing", "beta", "ld_alpha",
                                                "use_weighting", "ref_model", "sync_ref_model", "precompute_ref")})
        if draws["trainer"] == "grpo":
            knobs.update({k: draws[k] for k in ("num_generations", "num_iterations", "scale_rewards", "grpo_loss",
                                                "beta", "epsilon", "rewards", "reward_weights",
                                                "max_completion_length")})
        knobs["lora"] = draws["lora"] if draws.get("peft") else None
        if knobs["lora"] is not None and "sync_ref_model" in knobs:
            knobs["sync_ref_model"] = False  # --set peft=true on a TR-DPO case: DPOTrainer's own refusal otherwise
        config = {"size": draws["sp"], "mode": draws["mode"], "sharding": draws["sharding"]}
        model = _build_model(draws, getattr(torch, dtype_name))
        with warnings.catch_warnings(), released_deepspeed_engines():
            warnings.simplefilter("ignore")
            out = runner(draws["trainer"], "plain" if reference else draws["engine"], model, trainer_data(draws),
                         knobs, config)
        if ctx.rank != 0:
            out = {**out, "before": None, "after": None}
        return {"ok": True, **out}
    except Exception as e:  # noqa: BLE001 - classified by the driver
        return {"ok": False, "error": error_record(e, also=() if runner is None else (runner_dir(runner),))}
    finally:
        undo()
        env.close()
        transformers.logging.set_verbosity(verbosity)


# --------------------------------------------------------------------------------------------------
# Verdict
# --------------------------------------------------------------------------------------------------

# The logged metrics judged beside the loss (and grad_norm): those seqpar promises equal to one process's
# (integrations/trl.py; tests/test_trl_dpo.py, tests/test_trl_grpo.py). A key ending in "/" stands for every logged
# key under it (GRPO's per-reward-function mean and std).
METRICS = {
    "dpo": ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
            "logps/rejected", "entropy", "logits/chosen", "logits/rejected", "mean_token_accuracy", "num_tokens"),
    "grpo": ("kl", "entropy", "clip_ratio/", "reward", "reward_std", "rewards/", "completions/mean_length",
             "num_tokens"),
}


def _floor(draws: dict[str, Any], key: str, ref_log: dict[str, Any]) -> float:
    """The absolute difference below which a logged number counts as equal (its own relative tolerance above):
    a number that is a small difference of large ones carries their rounding. DPO's rewards and margins are
    ``beta x`` differences of per-sequence log-prob sums (0 at the first step, the policy being its reference);
    GRPO's loss is a mean of advantages (0 at the first step with group scaling, the advantages summing to 0 in
    each group) of the rewards' scale, and ``kl`` a difference of log-probs (0 at the first step); DPO's mean
    logits are means of logits that cancel, judged within ``LOSS_RTOL x 0.01`` absolute too."""
    if draws["trainer"] == "dpo" and key.startswith("rewards/") and key != "rewards/accuracies":
        scale = max(abs(ref_log.get("logps/chosen", 0.0)), abs(ref_log.get("logps/rejected", 0.0)))
        return LOSS_RTOL * draws["beta"] * scale
    if draws["trainer"] == "dpo" and key.startswith("logits/"):
        # the mean logit over the vocabulary and the completion tokens: ~1e-3, a sum of logits of order 0.1-1 that
        # cancel (fp32 rounding of the sum 2e-10 in case 647925007, 5.8e-5 of the mean)
        return LOSS_RTOL * 1e-2
    if draws["trainer"] == "grpo" and key in ("loss", "kl"):
        return LOSS_RTOL * max(1.0, abs(ref_log.get("reward", 0.0)))
    return 0.0


def _rel(got: float, ref: float) -> float:
    return abs(got - ref) / max(abs(ref), 1e-30)


def judge_trainer(draws: dict[str, Any], ref: dict[str, Any], per_rank: list[dict[str, Any]]) -> tuple[str, str]:
    """``("exact" | "WRONG", detail)``: every rank logged the reference's steps (loss within :data:`LOSS_RTOL`
    relative, ``grad_norm`` too when clipping) and evaluations; rank 0's total update of every parameter,
    ``before - after``, within ``UPDATE_RTOL x`` that parameter's reference update ``+ 1e-8 x`` the model's
    largest update ``+ steps x`` one fp32 rounding step of the parameter (its largest value x eps). A WRONG
    detail names the first problem of each sort (logs, updates), so a wrong logged number with right updates
    (a logging error) reads apart from wrong updates."""
    n_logs = len(ref["logs"])
    if n_logs != draws["steps"]:
        return "WRONG", f"the reference logged {n_logs} steps, not {draws['steps']}"
    problems: list[str] = []
    worst = ("", 0.0)
    for rank, r in enumerate(per_rank):
        if len(r["logs"]) != n_logs or len(r["evals"]) != len(ref["evals"]):
            return "WRONG", (f"rank {rank} logged {len(r['logs'])} steps and {len(r['evals'])} evaluations "
                             f"(reference {n_logs}, {len(ref['evals'])})")
        keys = ("loss", "grad_norm", *METRICS.get(draws["trainer"], ()))
        pairs = [(f"step {i + 1}: {key}", g.get(key, float("nan")), e[key], _floor(draws, key, e))
                 for i, (g, e) in enumerate(zip(r["logs"], ref["logs"], strict=True))
                 for key in keys if (key in e or key.endswith("/")) and (key != "grad_norm" or draws["max_grad_norm"])
                 for key in ([key] if not key.endswith("/") else sorted(k for k in e if k.startswith(key)))]
        pairs += [(f"evaluation {i + 1}: eval_loss", g["eval_loss"], e["eval_loss"], 0.0)
                  for i, (g, e) in enumerate(zip(r["evals"], ref["evals"], strict=True))]
        for what, g, e, floor in pairs:
            # (a NaN, or a number missing on one side, is never within the floor)
            rel = 0.0 if abs(float(g) - float(e)) <= floor else _rel(float(g), float(e))
            if not rel <= LOSS_RTOL:
                problems.append(f"rank {rank} {what} {g} vs {e} ({rel:.1e} relative, tol {LOSS_RTOL:.0e})")
                break
            worst = max(worst, (what.split(": ")[1], rel), key=lambda x: x[1])
        if problems:
            break
    got = per_rank[0]
    if set(got["before"]) != set(ref["before"]):
        return "WRONG", f"parameters on one side only: {sorted(set(got['before']) ^ set(ref['before']))[:4]}"
    eps = torch.finfo(torch.float32).eps
    deltas = {n: ref["before"][n].double() - ref["after"][n].double() for n in ref["before"]}
    model_max = max(float(d.abs().max()) for d in deltas.values())
    if model_max == 0.0 and draws["trainer"] != "grpo":
        return "WRONG", "the reference did not move any parameter"
    if draws.get("peft"):
        # LoRA: the same parameters train on both sides, only adapters (and modules_to_save's copies), and every
        # frozen one (the base weights, the originals of modules_to_save) is bit-for-bit where it started
        trainable = set(got.get("trainable", ()))
        if trainable != set(ref.get("trainable", ())) or not trainable:
            return "WRONG", (f"trainable parameters differ: {sorted(trainable ^ set(ref.get('trainable', ())))[:4]}"
                             if trainable else "no trainable parameter under LoRA")
        bias = draws["lora"].get("bias", "none") if draws.get("lora") else "none"
        # bias="all": every bias trains; "lora_only": the adapted layers' (their base_layer's) biases
        biases = (lambda n: n.endswith(".bias")) if bias == "all" else \
            (lambda n: n.endswith(".base_layer.bias")) if bias == "lora_only" else (lambda n: False)
        stray = sorted(n for n in trainable if "lora_" not in n and ".modules_to_save." not in n and not biases(n))
        if stray:
            return "WRONG", f"base parameters trainable under LoRA: {stray[:4]}"
        for name in sorted(set(deltas) - trainable):
            moved = float((got["before"][name] - got["after"][name]).abs().max())
            if moved or float(deltas[name].abs().max()):
                return "WRONG", f"frozen {name} moved by {moved:.1e} (reference {float(deltas[name].abs().max()):.1e})"
    # GRPO without KL (beta 0) whose groups each scored their completions alike has every advantage 0 and moves
    # nothing: seqpar's run must not move anything either (the tolerance below is then one rounding step)
    for name, d_ref in deltas.items():
        start = ref["before"][name].double()
        # DoRA's magnitude is not drawn but computed at init, in the model's dtype, as the norm of each row of
        # W + scale x BA (fp32 on the ranks: 1.2 eps of the largest norm, ~39, on embed_tokens, case 1171 with DoRA)
        slack = 4 if "lora_magnitude_vector" in name else 1
        if float((got["before"][name].double() - start).abs().max()) > slack * eps * float(start.abs().max()) + 1e-12:
            return "WRONG", f"{name} differs before training (the case's models are not the same)"
        d_got = got["before"][name].double() - got["after"][name].double()
        own = float(d_ref.abs().max())
        tol = UPDATE_RTOL * own + 1e-8 * model_max + draws["steps"] * eps * float(start.abs().max())
        diff = float((d_got - d_ref).abs().max())
        if not diff <= tol:
            problems.append(f"update of {name} off by {diff / max(own, 1e-300):.1e} of its max "
                            f"(tol {tol / max(own, 1e-300):.1e})")
            break
        worst = max(worst, (f"update {name}", diff / tol if tol else 0.0), key=lambda x: x[1])  # tol 0: nothing moved (a zero-init LoRA B)
    if problems:
        return "WRONG", "; ".join(problems) + ("" if len(problems) > 1 else " (the other checks pass)")
    return "exact", f"worst {worst[0]} {worst[1]:.1e} (logs: relative error; updates: of the tolerance)"


def run_trainer_case(pools: Any, draws: dict[str, Any], timeout: float, plant: str | None = None) -> tuple[str, str]:
    """Verdict and detail of a ``trainer`` case: the seqpar run on the case's world first (a refusal or crash
    decides there), then the reference on one process (``"skipped"`` when it cannot run), then
    :func:`judge_trainer`."""
    from seqpar.testing.verdicts import classify_errors

    if draws["world"] != draws["dp"] * draws["sp"]:  # fuzz.force re-derives or skips a forced split: a bug
        raise ValueError(f"trainer draws inconsistent: world {draws['world']} != dp {draws['dp']} x sp {draws['sp']}")
    per_rank = pools.run(draws["world"], trainer_task, draws, "seqpar", "float32", plant, timeout=timeout)
    bad = classify_errors(per_rank)
    if bad is not None:
        return bad
    ref = pools.run(1, trainer_task, draws, "reference", "float64", timeout=timeout)[0]
    if not ref["ok"]:
        return "skipped", f"cannot run without seqpar: {ref['error']['type']}: {ref['error']['message'][:200]}"
    return judge_trainer(draws, ref, per_rank)
