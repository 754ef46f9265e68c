"""The trainer kind's judge (seqpar.testing.fuzz_trainers_run.judge_trainer) on hand-made results: each check that
no planted bug of tests/test_fuzz.py reaches (the planted trainer and LoRA bugs change updates only) says WRONG
when its own rule is broken, and an identical result is exact. One process, no training."""

from __future__ import annotations

import copy

import torch

from seqpar.testing.fuzz_trainers_run import judge_trainer

DRAWS = {"trainer": "trainer", "steps": 2, "max_grad_norm": 0.0, "peft": True, "lora": {"r": 4}}


def _reference() -> dict:
    """A LoRA run: the adapter ``lora_A`` moved, the base weight and ``lora_B`` frozen; two logged steps and one
    evaluation."""
    g = torch.Generator().manual_seed(28)
    before = {n: torch.randn(4, 4, generator=g) for n in ("base.weight", "lora_A.weight", "lora_B.weight")}
    after = {n: t.clone() for n, t in before.items()}
    after["lora_A.weight"] -= 0.01 * torch.randn(4, 4, generator=g)
    return {"logs": [{"loss": 2.5}, {"loss": 2.25}], "evals": [{"eval_loss": 2.0}], "before": before,
            "after": after, "trainable": ["lora_A.weight"]}


def test_the_judge_refuses_each_broken_rule_and_passes_an_identical_run() -> None:
    """The same result on both ranks is exact; one rank with an evaluation fewer, seqpar's run with an extra
    trainable parameter (left where it started), or a frozen base weight moved on seqpar's side only is WRONG.

    Seen failing: the evaluations' count not compared (``len(r["evals"])`` dropped: the judge's strict zip of the
    evaluations raised instead of saying WRONG); the trainable sets not compared (only ``not trainable`` checked: exact); a frozen parameter WRONG only when both sides moved it
    (``moved and ...``: exact)."""
    ref = _reference()
    assert judge_trainer(DRAWS, ref, [copy.deepcopy(ref), copy.deepcopy(ref)])[0] == "exact"

    fewer = copy.deepcopy(ref)
    fewer["evals"] = []
    verdict, detail = judge_trainer(DRAWS, ref, [copy.deepcopy(ref), fewer])
    assert verdict == "WRONG" and "evaluations" in detail, detail

    extra = copy.deepcopy(ref)
    extra["trainable"] = ["lora_A.weight", "lora_B.weight"]
    verdict, detail = judge_trainer(DRAWS, ref, [extra, copy.deepcopy(ref)])
    assert verdict == "WRONG" and "trainable parameters differ" in detail, detail

    moved = copy.deepcopy(ref)
    moved["after"]["base.weight"] += 1e-3
    verdict, detail = judge_trainer(DRAWS, ref, [moved, copy.deepcopy(ref)])
    assert verdict == "WRONG" and "frozen base.weight moved" in detail, detail
