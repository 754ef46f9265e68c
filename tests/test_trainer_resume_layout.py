"""Resuming a seqpar FSDP2 Trainer checkpoint (``seqpar_config=``, no DeepSpeed config) at another layout.

A checkpoint saved at SP 2 on 2 ranks holds each rank's model and optimizer shards (torch.distributed.checkpoint,
``checkpoint-N/seqpar_fsdp2``), which DCP reshards onto whatever layout loads them. What "the run continues" means
at a new layout, exactly (the new layout's global batch, and so its data order, is its own):

1. after the load (at the first resumed step) every parameter and every AdamW state (``exp_avg``, ``exp_avg_sq``,
   ``step``), gathered whole, equals the one in the checkpoint's files, bit for bit;
2. the steps after that equal those of a straight run of the new layout (its own data order, skipping the batches
   of the steps the checkpoint had done) that was handed the same weights and optimizer state at that step, bit
   for bit: the logged losses, the final weights and the learning rate.
"""

from __future__ import annotations

import os

import hf_tiny
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

STEPS = 4
RESUME_AT = 2  # the checkpoint resumed from: checkpoint-2
BATCH = 2
LAYOUTS = {  # name: (world size, seqpar block)
    "sp2": (2, {"size": 2, "mode": "ring", "sharding": "zigzag"}),
    "sp1_dp2": (2, {"size": 1}),
    "sp1_one_rank": (1, {"size": 1}),
}


def _args(out: str, **extra):
    from transformers import TrainingArguments

    # as tests/test_trainer_save.py: AdamW and a linear schedule, the random sampler
    return TrainingArguments(
        output_dir=out, per_device_train_batch_size=BATCH, max_steps=STEPS, learning_rate=1e-2, weight_decay=0.0,
        lr_scheduler_type="linear", optim="adamw_torch", max_grad_norm=1.0, logging_steps=1, report_to=[], seed=0,
        disable_tqdm=True, use_cpu=True, **extra)


def _full_state(trainer) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The model's parameters and the optimizer's state, whole (a collective), flattened to ``name -> tensor``
    (``<param>.exp_avg``, ...)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # under accelerate's wrapper
    model_sd, optim_sd = get_state_dict(trainer.model, optimizer, options=StateDictOptions(full_state_dict=True))
    optim = {f"{name}.{k}": v.detach().clone() for name, state in optim_sd["state"].items() for k, v in state.items()}
    return {n: p.detach().clone() for n, p in model_sd.items()}, optim


def _checkpoint_run(rank: int, world: int, tmp: str) -> None:
    from seqpar.integrations.trainer import SeqParTrainer

    with hf_tiny.launcher_env(rank, world):
        SeqParTrainer(model=hf_tiny.tiny_llama(), args=_args(f"{tmp}/sp2", save_strategy="steps", save_steps=2),
                      train_dataset=hf_tiny.ListDataset(hf_tiny.samples()), seqpar_config=LAYOUTS["sp2"][1]).train()


@pytest.fixture(scope="module")
def sp2_checkpoint(dist_pool, tmp_path_factory) -> tuple[str, dict[str, torch.Tensor]]:
    """``checkpoint-2`` of a 4-step run at SP 2 on 2 ranks, and what its files hold, read in this (one) process:
    ``name -> tensor`` as :func:`_full_state` flattens it."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    tmp = str(tmp_path_factory.mktemp("sp2"))
    dist_pool.run(2, _checkpoint_run, tmp, timeout=540)
    checkpoint = f"{tmp}/sp2/checkpoint-{RESUME_AT}"
    dcp_to_torch_save(f"{checkpoint}/seqpar_fsdp2", f"{tmp}/saved.pt")
    saved = torch.load(f"{tmp}/saved.pt", weights_only=False)
    flat = dict(saved["model"])
    flat.update({f"{name}.{k}": v for name, state in saved["optim"]["state"].items() for k, v in state.items()})
    return checkpoint, flat


def _layout_run(rank: int, world: int, tmp: str, sp: dict, checkpoint: str) -> dict:
    from transformers import TrainerCallback

    from seqpar.integrations.fsdp import load_checkpoint
    from seqpar.integrations.trainer import SeqParTrainer

    class AtResume(TrainerCallback):
        """At the first step after ``RESUME_AT``: optionally hand the model and optimizer the checkpoint's state
        (the reference run), then record both whole."""

        def __init__(self, load: bool) -> None:
            self.load, self.trainer, self.state = load, None, None

        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == RESUME_AT and self.state is None:
                if self.load:
                    optimizer = getattr(self.trainer.optimizer, "optimizer", self.trainer.optimizer)
                    load_checkpoint(f"{checkpoint}/seqpar_fsdp2", self.trainer.model, optimizer)
                self.state = _full_state(self.trainer)

    def trainer(out: str, callback: AtResume):
        t = SeqParTrainer(model=hf_tiny.tiny_llama(), args=_args(out, save_strategy="no"),
                          train_dataset=hf_tiny.ListDataset(hf_tiny.samples()), seqpar_config=sp, callbacks=[callback])
        callback.trainer = t
        return t

    def losses(t) -> dict[int, float]:
        return {h["step"]: h["loss"] for h in t.state.log_history if "loss" in h}

    with hf_tiny.launcher_env(rank, world):
        at_resume = AtResume(load=False)
        resumed = trainer(f"{tmp}/resumed", at_resume)
        resumed.train(resume_from_checkpoint=checkpoint)
        at_reference = AtResume(load=True)
        reference = trainer(f"{tmp}/reference", at_reference)
        reference.train()
        a, b = _full_state(resumed)[0], _full_state(reference)[0]
        model, optim = at_resume.state
        return {"resumed": losses(resumed), "reference": losses(reference),
                "weights_differ": sorted(n for n in a if not torch.equal(a[n], b[n])),
                "lr": (resumed.lr_scheduler.get_last_lr(), reference.lr_scheduler.get_last_lr()),
                "loaded": {**model, **optim} if rank == 0 else None,
                "reference_loaded": {**at_reference.state[0], **at_reference.state[1]} if rank == 0 else None}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", ["sp1_dp2", "sp1_one_rank"])
def test_fsdp2_trainer_resumes_an_sp2_checkpoint_at_another_layout(dist_pool, tmp_path, sp2_checkpoint, layout):
    """``checkpoint-2`` of a run at SP 2 on 2 ranks, resumed at SP 1 x DP 2 on 2 ranks and at SP 1 on one rank
    (DCP reshards): (1) at the first resumed step every parameter and AdamW state, gathered, equals the checkpoint
    files' bit for bit; (2) steps 3 and 4 (losses, final weights, learning rate) equal, bit for bit, a straight
    run of the new layout handed the checkpoint's model and optimizer state at step 3's start.

    Seen failing: with the optimizer not loaded on resume (``None`` for it in
    ``SequenceParallelMixin._load_optimizer_and_scheduler``), at both layouts: every AdamW state after the load
    differs from the checkpoint's (63 of them); with that DCP load removed (SP 1 on one rank), the weights as
    well (84 entries)."""
    checkpoint, saved = sp2_checkpoint
    world, sp = LAYOUTS[layout]
    out = dist_pool.run(world, _layout_run, str(tmp_path), sp, checkpoint, timeout=840)
    loaded = out[0]["loaded"]
    assert sorted(loaded) == sorted(saved)
    differ = sorted(n for n in saved if not torch.equal(loaded[n].to(saved[n].dtype), saved[n]))
    assert differ == [], differ
    reference_loaded = out[0]["reference_loaded"]  # the reference was handed the same state
    assert all(torch.equal(reference_loaded[n], loaded[n]) for n in loaded)
    for r in out:
        # steps 1 and 2 are the checkpoint's log (the SP 2 run's), 3 and 4 this run's
        assert sorted(r["resumed"]) == [1, 2, 3, 4], r
        assert {s: r["resumed"][s] for s in (3, 4)} == {s: r["reference"][s] for s in (3, 4)}, r
        assert r["weights_differ"] == [], r["weights_differ"]
        assert r["lr"][0] == r["lr"][1], r["lr"]
    assert os.path.isdir(f"{checkpoint}/seqpar_fsdp2")
