"""The fuzzer's ``trainer`` kind, drawn: its constants, :func:`draw_trainer`, :func:`force_trainer` (a forced
key's stale draws re-derived) and :func:`trainer_summary`. What is drawn and why is
:mod:`seqpar.testing.fuzz_trainers`' docstring; the run and the judging are :mod:`seqpar.testing.fuzz_trainers_run`.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

TRAINERS = ("trainer", "sft", "dpo", "grpo")
TRL_TRAINERS = frozenset({"sft", "dpo", "grpo"})
DPO_LOSSES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
              "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm")
BATCH_SORTED_LOSSES = frozenset({"aot", "aot_unpaired"})  # sort over the batch: DP 1 only (fuzz_trainers' docstring)
GRPO_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo")
GRPO_REWARDS = ("word_sum", "length")
ENGINES = ("zero1", "zero2", "zero3", "fsdp2")
MODEL_TYPES = ("llama", "qwen2", "mixtral", "qwen3_moe")
MOE_TYPES = frozenset({"mixtral", "qwen3_moe"})
LORA_SHARE = 0.35  # of the cases, LoRA on (most post-training runs use an adapter)
LORA_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
LORA_MLP = ("gate_proj", "up_proj", "down_proj")  # the dense types' MLP (the MoE types' experts are fused tensors)


def draw_trainer(rng: random.Random) -> dict[str, Any]:
    """A ``trainer`` case's draws (JSON-able; see fuzz_trainers' docstring)."""
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
        draws["evaluate"] = False  # SFTTrainer's own eval loss at DP > 1 (fuzz_trainers' docstring)
    if trainer == "trainer":
        collator = rng.choice(("rows", "padded-right", "padded-left", "packed"))
        if collator == "padded-left" and dp > 1:
            collator = "padded-right"  # the trainer's own at DP > 1 (fuzz_trainers' docstring)
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
        draws["sync_ref_model"] = False  # DPOTrainer's own NotImplementedError under PEFT (fuzz_trainers' docstring)
    # LoRA's variants (fz24b): their own generator, seeded after every older draw, so the older case seeds keep
    # every draw they had (the variants are added to the adapter's config; pinned LoRA cases set them off)
    draws["lora"].update(_draw_lora_variants(random.Random(rng.randrange(2 ** 31)), draws))
    return draws


EMPTY_ROW_COLLATORS = ("packed", "padded-right")
"""The plain ``trainer`` collators a zero-length row is drawn under (:func:`draw_empty_rows`)."""


def draw_empty_rows(case_seed: int, draws: dict[str, Any]) -> list[int] | None:
    """A zero-length example for a ``trainer`` case: the index of the training row that holds no token (its
    ``lengths`` entry is kept: :func:`empty_rows` applies it at run time), or None (most cases, and every case it
    cannot carry). Drawn (from a generator of its own, ``f"{case_seed}:empty_documents"``, the other kinds'; at
    :data:`~seqpar.testing.fuzz_attention.EMPTY_DOCUMENTS_RATE`) only where the data path can carry one:

    - ``transformers.Trainer`` (``trainer``) with ``DataCollatorWithFlattening`` (``packed``: it drops an empty
      sample from the flattened row, as a zero-length document) or right padding (``padded-right``: a row of
      padding alone, no target), at ``micro`` 2, so the empty row always shares its micro-batch with a real one
      (one empty row per case; at ``micro`` 1 it would be a micro-batch of no token on one process as on the
      ranks, which no collator makes from real data);
    - not TRL's trainers. ``SFTTrainer``'s data here is conversational: an empty conversation
      (``{"messages": []}``) is refused before training by TRL (``is_conversational`` reads ``messages[0]``) and by
      transformers' ``apply_chat_template`` ("Cannot apply chat template to an empty conversation"); a
      conversation of empty turns is not zero-length (the chat template's ``<u> <a> <eos>``); with
      ``assistant_only_loss`` TRL raises on an example without assistant tokens; and with ``max_length`` (packing,
      or padding) TRL drops fully masked examples before batching and its BFD packing drops empty sequences, so
      no empty example reaches its ``DataCollatorForLanguageModeling``. DPO's pairs and GRPO's prompts are
      rendered and generated by TRL (an empty prompt is still its template's tokens).

    Every case seed keeps every draw it had before (fz29)."""
    from seqpar.testing.fuzz_attention import EMPTY_DOCUMENTS_RATE

    if not _carries_empty_row(draws):
        return None
    rng = random.Random(f"{case_seed}:empty_documents")
    if rng.random() >= EMPTY_DOCUMENTS_RATE:
        return None
    return [rng.randrange(len(draws["lengths"]))]


def _carries_empty_row(draws: dict[str, Any]) -> bool:
    return (draws.get("trainer") == "trainer" and draws.get("collator") in EMPTY_ROW_COLLATORS
            and draws.get("micro") == 2 and bool(draws.get("lengths")))


def empty_rows(draws: dict[str, Any]) -> frozenset[int]:
    """The training rows that hold no token as the run sees them: ``draws["empty_docs"]`` (:func:`draw_empty_rows`)
    where the case (forced keys included) still carries them, at most one, in range; else none."""
    picks = draws.get("empty_docs")
    if not picks or not _carries_empty_row(draws):
        return frozenset()
    flat = [j for i in picks for j in (i if isinstance(i, list | tuple) else [i])]
    return frozenset(j for j in flat[:1] if isinstance(j, int) and 0 <= j < len(draws["lengths"]))


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
    first ones or extended by new draws. The draws only DP 1 takes (fuzz_trainers' docstring: the trainer's own,
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
    """The LoRA variants a TRL + PEFT user sets (fuzz_trainers' docstring): rsLoRA (``use_rslora``: the scale
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
        out["bias"] = "none"  # peft's own: one adapter with bias per model (fuzz_trainers' docstring)
    return out


def ref_adapter(draws: dict[str, Any]) -> bool:
    """Whether TRL adds a frozen copy of a premade PeftModel's adapter ("ref"): DPO with the reference built from
    the policy, GRPO with KL (``beta > 0``)."""
    return (draws["trainer"] == "dpo" and draws["ref_model"] == "built") or \
        (draws["trainer"] == "grpo" and draws["beta"] > 0)


def router_loss(draws: dict[str, Any]) -> bool:
    """Whether the case trains with the MoE router loss: as drawn (``router_loss``), but never with LoRA under
    ZeRO-3 (DeepSpeed's or TRL's own without seqpar, fuzz_trainers' docstring). Read where the model is built, so a
    case's draws stay as drawn and ``--set peft=...`` decides."""
    return bool(draws["router_loss"]) and not (draws.get("peft") and draws.get("engine") == "zero3")


def _draw_lora(rng: random.Random, draws: dict[str, Any]) -> dict[str, Any]:
    """A LoRA adapter's config (peft's ``LoraConfig`` knobs, see fuzz_trainers' docstring): rank, alpha, 1-4 target
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
        # at DP > 1 the batch-sorted losses are DPOTrainer's own per replica (fuzz_trainers' docstring)
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
        draws["grpo_loss"] = "grpo"  # bnpo's token mean is GRPOTrainer's own per replica (fuzz_trainers' docstring)
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
        if empty_rows(d):
            parts.append(f"empty-row={min(empty_rows(d))}")
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
