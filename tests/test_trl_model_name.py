"""TRL's SFTTrainer given the model as a name (``model="path"``: TRL builds it in its own ``__init__``) under a seqpar
trainer's DeepSpeed path (a DeepSpeed config with a ``sequence_parallel`` block in the TrainingArguments): the model
TRL builds is swapped as a given one is, so the run equals the same run given the model object, bit for bit."""

from __future__ import annotations

import hf_tiny
import pytest
import torch
import trl_tiny

pytest.importorskip("trl")
pytest.importorskip("deepspeed")

STEPS = 2
ROWS = 2


def _run(rank: int, world: int, tmp: str, by_name: bool) -> dict:
    from transformers import LlamaForCausalLM
    from trl import SFTConfig, SFTTrainer

    from seqpar.integrations.trainer import sequence_parallel

    path = f"{tmp}/tiny"
    with hf_tiny.launcher_env(rank, world):
        if rank == 0:
            hf_tiny.tiny_llama().save_pretrained(path)
            trl_tiny.tokenizer().save_pretrained(path)
        torch.distributed.barrier()
        ds = {**trl_tiny.zero2_config(2)}
        args = SFTConfig(
            output_dir=f"{tmp}/out{int(by_name)}", deepspeed=ds, packing=True, padding_free=True, max_length=trl_tiny.MAX_LENGTH,
            max_steps=STEPS, per_device_train_batch_size=ROWS, learning_rate=hf_tiny.LR, optim="sgd",
            lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0, logging_steps=1, report_to=[],
            save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0, train_sampling_strategy="sequential",
            bf16=False, model_init_kwargs={"dtype": torch.float32})
        model = path if by_name else LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
        trainer = sequence_parallel(SFTTrainer)(model=model, args=args, train_dataset=trl_tiny.conversations(),
                                                processing_class=trl_tiny.tokenizer())
        trainer.train()
        logs = [h["loss"] for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
        return {"logs": logs}


@pytest.mark.timeout(900)
def test_sft_model_given_by_name_is_swapped_under_deepspeed(dist_pool, tmp_path):
    """SFTTrainer(model="<tiny Llama dir>") at SP 2 on 2 ranks under ZeRO-2 (seqpar's DeepSpeed trainer path): the
    logged losses equal the same run given the loaded model object, bit for bit.

    Seen failing: before, "AttributeError: 'str' object has no attribute 'named_modules'" (swap_attention given the
    name) on both ranks; with the model TRL built left unswapped (``_seqpar_take_model`` dropped from
    ``_seqpar_shard_model``'s name branch), it trained silently on each rank's shard alone: step 1's loss 3.96305
    vs 3.96250."""
    by_object = dist_pool.run(2, _run, str(tmp_path / "object"), False, timeout=420)
    by_name = dist_pool.run(2, _run, str(tmp_path / "name"), True, timeout=420)
    for a, b in zip(by_object, by_name, strict=True):
        assert len(a["logs"]) == STEPS, a
        assert b["logs"] == a["logs"], (a, b)


def _grpo_by_name(rank: int, world: int, tmp: str) -> str | None:
    from trl import GRPOConfig, GRPOTrainer

    from seqpar.config import ConfigError
    from seqpar.integrations.trainer import sequence_parallel

    with hf_tiny.launcher_env(rank, world):
        args = GRPOConfig(output_dir=tmp, deepspeed=trl_tiny.zero2_config(2), per_device_train_batch_size=4,
                          num_generations=2, max_completion_length=6, max_steps=1, report_to=[], save_strategy="no",
                          use_cpu=True, disable_tqdm=True, bf16=False)
        try:
            sequence_parallel(GRPOTrainer)(model=f"{tmp}/absent", reward_funcs=lambda completions, **kw: [0.0],
                                           args=args, train_dataset=[{"prompt": "t4 t5"}] * 4)
        except ConfigError as e:
            return str(e)
    return None


@pytest.mark.timeout(600)
def test_grpo_model_given_by_name_is_refused(dist_pool, tmp_path):
    """GRPOTrainer(model="path") under seqpar (SP 2, ZeRO-2) is refused by name on every rank, before TRL loads
    anything: seqpar notes the model's attention implementation before GRPOTrainer's ``__init__`` would build it.

    Seen failing: without the refusal, "AttributeError: 'str' object has no attribute 'modules'" in GRPOLoss's
    before_swap on both ranks."""
    for error in dist_pool.run(2, _grpo_by_name, str(tmp_path), timeout=300):
        assert error is not None and "given the model by name" in error and "pass the model object" in error, error


PAIRS = ((4, 6, 3), (6, 2, 7), (3, 9, 4), (5, 3, 3))  # (prompt, chosen, rejected) words: rows of 6-17 tokens


def _pairs():
    """A ``datasets.Dataset`` of fresh random prompt / chosen / rejected texts (words of trl_tiny's tokenizer)."""
    import datasets

    g = torch.Generator().manual_seed(13)
    words = lambda n: " ".join(f"t{i}" for i in torch.randint(4, hf_tiny.VOCAB, (n,), generator=g).tolist())  # noqa: E731
    return datasets.Dataset.from_list([{"prompt": words(p) + " ", "chosen": words(c), "rejected": words(r)}
                                       for p, c, r in PAIRS])


def _train(rank: int, world: int, tmp: str, kind: str, engine: str, by_name: bool) -> dict:
    """``kind`` "sft" or "dpo" at SP 2 on 2 ranks, on seqpar's ``engine`` path ("deepspeed": ZeRO-2; "fsdp2":
    ``seqpar_config=``), the model given by name (DPO: no ``ref_model``, TRL builds both from the name) or as
    loaded objects (DPO: the reference model too). Every parameter, whole, before and after each SGD step."""
    from transformers import LlamaForCausalLM
    from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

    from seqpar.integrations.trainer import sequence_parallel

    path = f"{tmp}/tiny"
    sp = {"size": 2, "mode": "ring", "sharding": "zigzag"}
    common = dict(output_dir=f"{tmp}/out{rank}", max_steps=STEPS, per_device_train_batch_size=ROWS,
                  learning_rate=hf_tiny.LR, optim="sgd", lr_scheduler_type="constant", weight_decay=0.0,
                  max_grad_norm=0.0, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
                  disable_tqdm=True, seed=0, train_sampling_strategy="sequential", bf16=False,
                  model_init_kwargs={"dtype": torch.float32} if by_name else None)
    if engine == "deepspeed":
        common["deepspeed"] = trl_tiny.zero2_config(2)
    extra = {} if engine == "deepspeed" else {"seqpar_config": sp}
    load = lambda: LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)  # noqa: E731
    with hf_tiny.launcher_env(rank, world):
        if rank == 0:
            hf_tiny.tiny_llama().save_pretrained(path)
            trl_tiny.tokenizer().save_pretrained(path)
        torch.distributed.barrier()
        model = path if by_name else load()
        if kind == "sft":
            args = SFTConfig(packing=True, padding_free=True, max_length=trl_tiny.MAX_LENGTH, **common)
            trainer = sequence_parallel(SFTTrainer)(model=model, args=args, train_dataset=trl_tiny.conversations(),
                                                    processing_class=trl_tiny.tokenizer(), **extra)
        else:
            trainer = sequence_parallel(DPOTrainer)(
                model=model, ref_model=None if by_name else load(), args=DPOConfig(beta=0.5, **common),
                train_dataset=_pairs(), processing_class=trl_tiny.tokenizer(), **extra)
        snapshots: list[dict[str, torch.Tensor]] = []
        trainer.add_callback(trl_tiny.snapshots_callback(trainer.model, snapshots))
        trainer.train()
        logs = [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
        return {"logs": logs, "snapshots": snapshots}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("kind,engine", [("dpo", "deepspeed"), ("sft", "fsdp2"), ("dpo", "fsdp2")])
def test_model_given_by_name_equals_the_model_object(dist_pool, tmp_path, kind, engine):
    """SP 2 on 2 ranks: DPOTrainer under ZeRO-2, and SFTTrainer and DPOTrainer on seqpar's FSDP2 path, given the
    model by name (DPO without ``ref_model``: TRL builds the policy and the reference model from the name, both
    swapped) equal the same run given the loaded objects (DPO: a loaded reference model, swapped before TRL's
    ``__init__``), bit for bit: every parameter before and after each of 2 SGD steps, and every logged value.

    Seen failing: DPO (both engines) with the reference model TRL built left unswapped (``DPOLoss.after_init``'s
    swap dropped): seqpar's guard on both ranks, "attention layer LlamaAttention (layer_idx 0) was left out by
    sequence_parallel.swap" (the by-object run's reference model is swapped before TRL's __init__); SFT on FSDP2
    with ``_seqpar_shard_model`` skipping the model TRL built from the name: step 1's update of
    ``model.embed_tokens.weight`` off by 9.8e-2 (scale 0.19), every parameter differing."""
    by_object = dist_pool.run(2, _train, str(tmp_path / "object"), kind, engine, False, timeout=420)
    by_name = dist_pool.run(2, _train, str(tmp_path / "name"), kind, engine, True, timeout=420)
    for a, b in zip(by_object, by_name, strict=True):
        assert len(a["logs"]) == STEPS and len(a["snapshots"]) == STEPS + 1, a["logs"]
        if kind == "dpo":
            assert any(h["rewards/margins"] != 0 for h in a["logs"]), a["logs"]  # the reference model counts
        got, ref = trl_tiny.sgd_gradients(b["snapshots"], hf_tiny.LR), trl_tiny.sgd_gradients(a["snapshots"], hf_tiny.LR)
        trl_tiny.assert_gradients_close(got, ref, rtol=0.0)  # each parameter's update on its own scale
        for step, (x, y) in enumerate(zip(a["snapshots"], b["snapshots"], strict=True)):
            unequal = [k for k in x if not torch.equal(x[k], y[k])]
            assert not unequal, f"after step {step}: {unequal}"
        drop = ("train_runtime",)
        assert [{k: v for k, v in h.items() if k not in drop} for h in b["logs"]] == \
               [{k: v for k, v in h.items() if k not in drop} for h in a["logs"]], (a["logs"], b["logs"])
