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
        swapped = sorted({type(m).__name__ for m in trainer.model.modules() if "seqpar" in type(m).__module__})
        return {"logs": logs, "swapped": swapped}


@pytest.mark.timeout(900)
def test_sft_model_given_by_name_is_swapped_under_deepspeed(dist_pool, tmp_path):
    """SFTTrainer(model="<tiny Llama dir>") at SP 2 on 2 ranks under ZeRO-2 (seqpar's DeepSpeed trainer path): the
    logged losses equal the same run given the loaded model object, bit for bit, and the model trained has
    seqpar's modules.

    Seen failing: without the swap of the model TRL built (``_seqpar_take_model`` at the name), ..."""
    by_object = dist_pool.run(2, _run, str(tmp_path / "object"), False, timeout=420)
    by_name = dist_pool.run(2, _run, str(tmp_path / "name"), True, timeout=420)
    for a, b in zip(by_object, by_name, strict=True):
        assert len(a["logs"]) == STEPS, a
        assert b["logs"] == a["logs"], (a, b)
        assert b["swapped"] == a["swapped"], (a, b)
