"""Audit 25: the refusal of a PeftModel whose trainer adds a "ref" adapter under seqpar's FSDP2 keeps to that case.

``tests/test_peft.py`` checks DPO without ``ref_model`` refused and GRPO refused at ``beta=0.1`` and built at
``beta=0``; nothing built DPO with a reference model of its own, the path the refusal names as the fix.
"""

from __future__ import annotations

import hf_tiny
import pytest
from test_peft import lora_llama

pytest.importorskip("peft")
pytest.importorskip("trl")


def _dpo_with_ref_model_under_fsdp2(rank: int, world: int, tmp: str) -> str:
    """Build ``sequence_parallel(DPOTrainer)`` under seqpar's FSDP2 with a ``PeftModel`` and ``ref_model=`` (the
    reference log-probs from a model of its own: no "ref" adapter): "built", or the ConfigError."""
    import datasets
    import trl_tiny
    from trl import DPOConfig, DPOTrainer

    from seqpar.config import ConfigError
    from seqpar.integrations.trainer import sequence_parallel

    pairs = datasets.Dataset.from_list([{"prompt": "t5 t6 ", "chosen": "t7 t8", "rejected": "t9"}] * 2)
    args = DPOConfig(output_dir=f"{tmp}/d{rank}", per_device_train_batch_size=2, max_steps=1, learning_rate=0.1,
                     optim="sgd", report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, bf16=False)
    with hf_tiny.launcher_env(rank, world):
        try:
            sequence_parallel(DPOTrainer)(
                model=lora_llama(), ref_model=hf_tiny.tiny_llama(), args=args, train_dataset=pairs,
                processing_class=trl_tiny.tokenizer(), seqpar_config={"size": world, "mode": "ring"})
        except ConfigError as e:
            return str(e)
    return "built"


@pytest.mark.timeout(300)
def test_dpo_peft_model_with_its_own_ref_model_under_fsdp2_builds(dist_pool, tmp_path) -> None:
    """A ``PeftModel`` given to DPOTrainer with ``ref_model=`` under seqpar's FSDP2 (SP 2) builds: TRL adds no
    "ref" adapter then, and ``ref_model=`` is the fix the refusal of the adapter-copying path names. Seen failing:
    the DPO refusal without its ``kwargs.get("ref_model") is None`` condition (every PeftModel given to DPO refused)."""
    for got in dist_pool.run(2, _dpo_with_ref_model_under_fsdp2, str(tmp_path), timeout=250):
        assert got == "built", got
