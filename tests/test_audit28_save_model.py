"""``save_model()`` on some ranks only (integrations/trainer_checkpoint.py's rendezvous before the FSDP2 gather): a
trainer that saved on every rank before is still refused by name when a later call is made on some ranks only
(tests/test_trainer_save.py's refusal test calls ``save_model`` once per trainer)."""

from __future__ import annotations

import os

import hf_tiny
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")


def _save_then_save_on_rank_0(rank: int, world: int, tmp: str) -> dict:
    """One FSDP2 SeqParTrainer (SP 2, ``ddp_timeout=4``): ``save_model`` on both ranks, then on rank 0 alone; what
    each rank saw, and whether the world's group works after (a barrier and an all-reduce)."""
    import torch.distributed as dist
    from transformers import TrainingArguments

    from seqpar.config import ConfigError
    from seqpar.integrations.trainer import SeqParTrainer

    with hf_tiny.launcher_env(rank, world):
        args = TrainingArguments(output_dir=f"{tmp}/out", per_device_train_batch_size=2, max_steps=1, report_to=[],
                                 save_strategy="no", ddp_timeout=4, use_cpu=True, disable_tqdm=True, seed=0)
        trainer = SeqParTrainer(model=hf_tiny.tiny_llama(), args=args,
                                train_dataset=hf_tiny.ListDataset(hf_tiny.samples()),
                                seqpar_config={"size": 2, "mode": "ring", "sharding": "zigzag"})
        trainer.save_model(f"{tmp}/first")  # every rank: saves
        error = None
        if rank == 0:
            try:
                trainer.save_model(f"{tmp}/second")
            except ConfigError as e:
                error = str(e)
        dist.barrier()
        total = torch.ones(1)
        dist.all_reduce(total)
        return {"error": error, "world_ok": total.item() == world, "first": sorted(os.listdir(f"{tmp}/first")),
                "second": sorted(os.listdir(f"{tmp}/second")) if os.path.isdir(f"{tmp}/second") else []}


@pytest.mark.timeout(400)
def test_a_later_save_on_some_ranks_is_refused_after_one_on_every_rank(dist_pool, tmp_path):
    """Both ranks save (``model.safetensors`` written), then rank 0 alone calls ``save_model``: it raises the
    ConfigError naming the fix within ``ddp_timeout`` and writes nothing; rank 1 goes on; the group works after.

    Seen failing: the call counter not advanced (``self._seqpar_save_calls += 1`` dropped): the second call met the
    first call's store keys and outcome ("ok"), so rank 0 went past the rendezvous into the full state dict's gather
    alone: the test failed after 166 s instead of the refusal within ``ddp_timeout`` (4 s)."""
    out = dist_pool.run(2, _save_then_save_on_rank_0, str(tmp_path), timeout=300)
    for rank, r in enumerate(out):
        assert r["world_ok"], r
        assert "model.safetensors" in r["first"], r
        assert r["second"] == [], r
        if rank == 0:
            assert r["error"] is not None and "call trainer.save_model() on every rank" in r["error"], r
        else:
            assert r["error"] is None, r
