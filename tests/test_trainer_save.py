"""Saving and resuming under a seqpar Trainer's FSDP2 path (``seqpar_config=``, no DeepSpeed config).

The mixin shards the model with FSDP2 itself, so transformers does not know the model is sharded: before, its
``save_model`` (and every checkpoint of the default ``save_strategy``) handed the model's FSDP2 DTensors to
safetensors and crashed ("Attempted to access the data pointer on an invalid python storage"). Now ``save_model``
writes the gathered full state dict (``from_pretrained`` loads the trained weights; a PeftModel's adapters), and a
checkpoint carries the model's and optimizer's shards (torch.distributed.checkpoint) that
``train(resume_from_checkpoint=...)`` reads back, so a resumed run continues as the straight one.
"""

from __future__ import annotations

import os

import hf_tiny
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

SP = {"size": 2, "mode": "ring", "sharding": "zigzag"}
STEPS = 4
BATCH = 2
EVAL_ROWS = 4


def _args(out: str, steps: int = STEPS, **extra):
    from transformers import TrainingArguments

    # use_cpu: the world of 2 a GPU launch gets (see tests/test_trainer.py); AdamW and a linear schedule so
    # the optimizer's and scheduler's states matter on resume; the default (random) sampler so the data order does
    return TrainingArguments(
        output_dir=out, per_device_train_batch_size=BATCH, per_device_eval_batch_size=BATCH, max_steps=steps,
        learning_rate=extra.pop("learning_rate", 1e-2), weight_decay=0.0, lr_scheduler_type="linear", optim="adamw_torch", max_grad_norm=1.0,
        logging_steps=1, prediction_loss_only=True, report_to=[], seed=0, disable_tqdm=True, use_cpu=True,
        **extra,
    )


def _lora_llama():
    from peft import LoraConfig, get_peft_model

    base = hf_tiny.tiny_llama()
    torch.manual_seed(1)
    return get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]))


def _gathered(model) -> dict[str, torch.Tensor]:
    """Every parameter whole (a collective: each rank, the same order)."""
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


def _save_run(rank: int, world: int, tmp: str, peft: bool) -> dict:
    import torch.distributed as dist

    from seqpar.integrations.trainer import SeqParTrainer

    with hf_tiny.launcher_env(rank, world):
        trainer = SeqParTrainer(model=_lora_llama() if peft else hf_tiny.tiny_llama(),
                                args=_args(f"{tmp}/out", save_strategy="no"),
                                train_dataset=hf_tiny.ListDataset(hf_tiny.samples()),
                                eval_dataset=hf_tiny.ListDataset(hf_tiny.samples()[:EVAL_ROWS]), seqpar_config=SP)
        trainer.train()
        trained = _gathered(trainer.model)
        eval_loss = trainer.evaluate()["eval_loss"]
        trainer.save_model(f"{tmp}/saved")
        dist.barrier()  # rank 0 wrote the files
        if peft:
            from peft import PeftModel

            loaded = PeftModel.from_pretrained(hf_tiny.tiny_llama(), f"{tmp}/saved")
        else:
            from transformers import LlamaForCausalLM

            loaded = LlamaForCausalLM.from_pretrained(f"{tmp}/saved")
        got = dict(loaded.named_parameters())
        mismatched = sorted(n for n, p in trained.items() if n not in got or not torch.equal(got[n].detach(), p))
        ids = torch.stack([r["input_ids"] for r in hf_tiny.samples()[:EVAL_ROWS]])
        losses = []
        for start in range(0, EVAL_ROWS, BATCH):  # the mean of the per-batch losses, as Trainer's eval loss
            with torch.no_grad():
                losses.append(loaded(input_ids=ids[start:start + BATCH], labels=ids[start:start + BATCH]).loss.item())
        initial = dict((_lora_llama() if peft else hf_tiny.tiny_llama()).named_parameters())
        moved = sum(not torch.equal(p, initial[n].detach()) for n, p in trained.items())
        return {"mismatched": mismatched, "eval_loss": eval_loss, "loaded_loss": sum(losses) / len(losses),
                "moved": moved, "count": len(trained)}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("peft", [False, True], ids=["model", "peft"])
def test_fsdp2_trainer_save_model_writes_the_trained_weights(dist_pool, tmp_path, peft):
    """``trainer.save_model()`` at SP 2 on 2 ranks (seqpar's FSDP2): the files hold exactly the trained model's
    gathered weights (a PeftModel: its adapters, on the saved base), and the loaded model's loss on the eval rows
    is the trainer's eval loss.

    Seen failing, both: with ``SequenceParallelMixin.save_model`` removed, "RuntimeError: Attempted to access the
    data pointer on an invalid python storage" (safetensors given the model's DTensors) on rank 0."""
    if peft:
        pytest.importorskip("peft")
    for r in dist_pool.run(2, _save_run, str(tmp_path), peft, timeout=540):
        assert r["mismatched"] == [], r["mismatched"]
        assert r["moved"] > 0  # training changed the weights the test compares
        assert abs(r["loaded_loss"] - r["eval_loss"]) <= 1e-5 * abs(r["eval_loss"]), r


def _resume_run(rank: int, world: int, tmp: str, peft: bool, sp: dict = SP) -> dict:
    import torch.distributed.checkpoint as dcp

    from seqpar.integrations.trainer import SeqParTrainer

    def build():
        return _lora_llama() if peft else hf_tiny.tiny_llama()

    def trainer(out: str):
        return SeqParTrainer(model=build(), args=_args(out, save_strategy="steps", save_steps=2),
                             train_dataset=hf_tiny.ListDataset(hf_tiny.samples()), seqpar_config=sp)

    def losses(t) -> list[float]:
        return [h["loss"] for h in t.state.log_history if "loss" in h]

    with hf_tiny.launcher_env(rank, world):
        straight = trainer(f"{tmp}/straight")
        straight.train()  # checkpoints at steps 2 and 4 (the default save path, which crashed before)
        resumed = trainer(f"{tmp}/resumed")
        load, loads = dcp.load, []  # the checkpoint's reads while resuming: one (model and optimizer together)

        def counted(*args, **kwargs):
            loads.append(1)
            return load(*args, **kwargs)

        dcp.load = counted
        try:
            resumed.train(resume_from_checkpoint=f"{tmp}/straight/checkpoint-2")
        finally:
            dcp.load = load
        a, b = _gathered(straight.model), _gathered(resumed.model)
        initial = dict(build().named_parameters())
        return {"straight": losses(straight), "resumed": losses(resumed),
                "weights_differ": sorted(n for n in a if not torch.equal(a[n], b[n])),
                "lr": (straight.lr_scheduler.get_last_lr(), resumed.lr_scheduler.get_last_lr()),
                "untrained_equal": all(torch.equal(p, initial[n].detach()) for n, p in a.items()), "dcp_loads": len(loads),
                "checkpoint_files": sorted(os.listdir(f"{tmp}/straight/checkpoint-2")) if rank == 0 else None}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("peft", [False, True], ids=["model", "peft"])
def test_fsdp2_trainer_resume_from_checkpoint_continues_exactly(dist_pool, tmp_path, peft):
    """SP 2 on 2 ranks (seqpar's FSDP2), a model and a PeftModel (only its adapters train), AdamW with a linear
    schedule and the random sampler: 4 steps straight
    (checkpoints at steps 2 and 4) vs. a new trainer resumed from ``checkpoint-2`` to step 4: the logged losses and
    the final weights are equal, bit for bit (model, every rank's optimizer shard, scheduler, RNG and data order
    come back).

    Seen failing: with ``SequenceParallelMixin._save_optimizer_and_scheduler`` removed (model), the checkpoint has
    no seqpar_fsdp2/ and resume is refused by name on both ranks; with ``_load_from_checkpoint`` removed (model),
    transformers' own load: "aten.copy_.default got mixed torch.Tensor and DTensor" for every parameter; with the
    optimizer not reloaded (``None`` for it in ``_load_optimizer_and_scheduler``; model and peft), step 4's loss
    differs (AdamW restarts its moments)."""
    if peft:
        pytest.importorskip("peft")
    out = dist_pool.run(2, _resume_run, str(tmp_path), peft, timeout=540)
    files = out[0]["checkpoint_files"]  # checkpoint-2 as rank 0 sees it
    assert {"seqpar_fsdp2", "adapter_model.safetensors" if peft else "model.safetensors", "scheduler.pt",
            "rng_state_0.pth", "rng_state_1.pth", "trainer_state.json"} <= set(files), files
    for r in out:
        assert len(r["straight"]) == STEPS, r
        assert r["resumed"] == r["straight"], r
        assert r["weights_differ"] == [], r["weights_differ"]
        assert r["lr"][0] == r["lr"][1], r["lr"]
        assert not r["untrained_equal"]  # the run trained
        assert r["dcp_loads"] == 1, r["dcp_loads"]  # model and optimizer in one read


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", ["sp1_dp2", "sp2_dp2"])
def test_fsdp2_trainer_resume_at_dp2_continues_exactly(dist_pool, tmp_path, layout):
    """As :func:`test_fsdp2_trainer_resume_from_checkpoint_continues_exactly` at SP 1 x DP 2 on 2 ranks and at
    SP 2 x DP 2 on 4 ranks (each DP replica its own samples, FSDP2 over every rank): 4 steps straight vs. resumed
    from ``checkpoint-2``, bit for bit, with the checkpoint read once.

    Seen failing: with the optimizer not reloaded (``None`` for it in ``_load_optimizer_and_scheduler``), step 4's
    loss differs (both layouts); with the model loaded in ``_load_from_checkpoint`` as well (session 25's code), 2 DCP
    reads."""
    world, sp = (2, {"size": 1}) if layout == "sp1_dp2" else (4, SP)
    for r in dist_pool.run(world, _resume_run, str(tmp_path), False, sp, timeout=840):
        assert len(r["straight"]) == STEPS, r
        assert r["resumed"] == r["straight"], r
        assert r["weights_differ"] == [], r["weights_differ"]
        assert r["lr"][0] == r["lr"][1], r["lr"]
        assert not r["untrained_equal"]
        assert r["dcp_loads"] == 1, r["dcp_loads"]


def _best_run(rank: int, world: int, tmp: str) -> dict:
    from safetensors.torch import load_file

    from seqpar.integrations.trainer import SeqParTrainer

    with hf_tiny.launcher_env(rank, world):
        trainer = SeqParTrainer(
            model=hf_tiny.tiny_llama(),
            args=_args(f"{tmp}/out", save_strategy="steps", save_steps=1, eval_strategy="steps", eval_steps=1,
                       load_best_model_at_end=True, metric_for_best_model="eval_loss", learning_rate=0.3),
            train_dataset=hf_tiny.ListDataset(hf_tiny.samples()),
            eval_dataset=hf_tiny.ListDataset(hf_tiny.samples()[:EVAL_ROWS]), seqpar_config=SP)
        trainer.train()
        best = trainer.state.best_model_checkpoint
        final = f"{tmp}/out/checkpoint-{STEPS}"
        got = _gathered(trainer.model)
        saved = load_file(f"{best}/model.safetensors")
        last = load_file(f"{final}/model.safetensors")
        return {"best": best, "final": final, "differ": sorted(n for n in saved if not torch.equal(saved[n], got[n])),
                "last_differs": any(not torch.equal(last[n], saved[n]) for n in saved)}


@pytest.mark.timeout(600)
def test_fsdp2_trainer_load_best_model_at_end_loads_the_best_checkpoint(dist_pool, tmp_path):
    """``load_best_model_at_end=True`` at SP 2 on 2 ranks (seqpar's FSDP2), a checkpoint and an eval each step and a
    learning rate large enough that the last step is not the best: after ``train`` the model's gathered weights
    are the best checkpoint's saved ones.

    Seen failing: with ``SequenceParallelMixin._load_best_model`` removed, transformers' own load: "aten.copy_.default
    got mixed torch.Tensor and DTensor"."""
    for r in dist_pool.run(2, _best_run, str(tmp_path), timeout=540):
        assert r["best"] != r["final"] and r["last_differs"], r  # the best is not where training ended
        assert r["differ"] == [], r


def _save_only_model_run(rank: int, world: int, tmp: str) -> dict:
    from seqpar.config import ConfigError
    from seqpar.integrations.trainer import SeqParTrainer

    def trainer(out: str, **extra):
        return SeqParTrainer(model=hf_tiny.tiny_llama(), args=_args(out, steps=2, save_strategy="steps", save_steps=2,
                                                                    save_only_model=True, **extra),
                             train_dataset=hf_tiny.ListDataset(hf_tiny.samples()),
                             eval_dataset=hf_tiny.ListDataset(hf_tiny.samples()[:EVAL_ROWS]), seqpar_config=SP)

    errors = {}
    with hf_tiny.launcher_env(rank, world):
        trainer(f"{tmp}/out").train()
        files = sorted(os.listdir(f"{tmp}/out/checkpoint-2"))
        try:
            trainer(f"{tmp}/resumed").train(resume_from_checkpoint=f"{tmp}/out/checkpoint-2")
        except ConfigError as e:
            errors["resume"] = str(e)
    with hf_tiny.launcher_env(rank, world):
        try:
            trainer(f"{tmp}/best", eval_strategy="steps", eval_steps=2, load_best_model_at_end=True)
        except ConfigError as e:
            errors["best"] = str(e)
    return {"files": files, **errors}


@pytest.mark.timeout(600)
def test_fsdp2_trainer_save_only_model_checkpoint_is_refused_on_resume(dist_pool, tmp_path):
    """``save_only_model=True`` at SP 2 on 2 ranks: the checkpoint holds the model's weights only (no
    ``seqpar_fsdp2/``, no optimizer or RNG state), and ``train(resume_from_checkpoint=...)`` from it is refused by
    name on every rank before any step, as is ``load_best_model_at_end=True`` with it at construction (transformers
    refuses both for its own FSDP).

    Seen failing: with the check removed (``_dcp_problem`` returning None), DCP's own error on both ranks, not naming
    save_only_model ("CheckpointException ... metadata is None; ... No such file or directory: .../seqpar_fsdp2/
    .metadata"); with the constructor's check removed, "KeyError: 'best'" (no refusal: the run would have failed
    only at its end, loading the best checkpoint)."""
    for r in dist_pool.run(2, _save_only_model_run, str(tmp_path), timeout=540):
        assert "model.safetensors" in r["files"] and "seqpar_fsdp2" not in r["files"], r["files"]
        assert "save_only_model=True" in r["resume"] and "seqpar_fsdp2" in r["resume"], r
        assert "save_only_model=True with load_best_model_at_end=True" in r["best"], r


def _each_node_run(rank: int, world: int, tmp: str) -> dict:
    import shutil

    import torch.distributed as dist
    from safetensors.torch import load_file

    from seqpar.config import ConfigError
    from seqpar.integrations.trainer import SeqParTrainer

    node = f"{tmp}/node{rank}"  # each rank a node of its own, with a disk of its own

    def trainer(out: str):
        return SeqParTrainer(model=hf_tiny.tiny_llama(), args=_args(out, save_strategy="steps", save_steps=2,
                                                                    save_on_each_node=True),
                             train_dataset=hf_tiny.ListDataset(hf_tiny.samples()), seqpar_config=SP)

    def losses(t) -> list[float]:
        return [h["loss"] for h in t.state.log_history if "loss" in h]

    with hf_tiny.launcher_env(rank, world):
        os.environ.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")  # 2 nodes of one process: both are local writers
        straight = trainer(f"{node}/straight")
        straight.train()  # checkpoints 2 and 4, each written on both nodes
        straight.save_model(f"{node}/saved")
        trained = _gathered(straight.model)
        files = {name: load_file(f"{node}/{name}/model.safetensors") for name in ("saved", "straight/checkpoint-4")}
        differ = {name: sorted(n for n in trained if not torch.equal(got[n], trained[n])) for name, got in files.items()}
        error = None
        try:  # each node resumes from its own disk, which has its own ranks' shards only
            trainer(f"{node}/resumed").train(resume_from_checkpoint=f"{node}/straight/checkpoint-2")
        except ConfigError as e:
            error = str(e)
        dist.barrier()
        if rank == 0:  # the fix the error names: every node's shards in one directory all ranks read
            shutil.copytree(f"{node}/straight/checkpoint-2", f"{tmp}/shared", dirs_exist_ok=True)
            shutil.copytree(f"{tmp}/node1/straight/checkpoint-2/seqpar_fsdp2", f"{tmp}/shared/seqpar_fsdp2",
                            dirs_exist_ok=True)
        dist.barrier()
        partly = None
        try:  # node 0's disk completed, node 1's not: rank 0 alone could read it
            own = f"{tmp}/shared" if rank == 0 else f"{node}/straight/checkpoint-2"
            trainer(f"{node}/resumed1").train(resume_from_checkpoint=own)
        except ConfigError as e:
            partly = str(e)
        resumed = trainer(f"{node}/resumed2")
        resumed.train(resume_from_checkpoint=f"{tmp}/shared")
        b = _gathered(resumed.model)
        return {"differ": differ, "error": error, "partly": partly, "straight": losses(straight), "resumed": losses(resumed),
                "resumed_differ": sorted(n for n in trained if not torch.equal(trained[n], b[n]))}


@pytest.mark.timeout(600)
def test_fsdp2_trainer_save_on_each_node(dist_pool, tmp_path):
    """``save_on_each_node=True`` at SP 2 with each rank a node of its own (``LOCAL_RANK`` 0 on both) and its own
    disk: every rank gathers the full weights and writes them (``save_model`` and every checkpoint's
    model.safetensors equal the trained weights on both disks); resuming from a node's own disk, which holds only
    its ranks' DCP shards, is refused by name on every rank, also where only one node's disk lacks them (not a wait
    in DCP's collectives); once every node's shards are in one directory, the resumed run equals the straight one
    bit for bit.

    Seen failing: without ``_writes_where_trainer_says`` around ``save_model``'s ``_save``, rank 1 wrote no weights
    ("FileNotFoundError: .../node1/saved/model.safetensors": transformers' save_pretrained writes on global rank 0
    only); without ``_seqpar_require_dcp``'s cross-rank check, each rank named only its own problem (rank 0: "missing
    shard file(s)", not rank 1's missing .metadata), and where rank 0 could read the checkpoint it entered DCP's load
    alone and waited there while rank 1 raised (gloo: "Timed out waiting 60000ms for send operation to complete")."""
    for r in dist_pool.run(2, _each_node_run, str(tmp_path), timeout=540):
        assert r["differ"] == {"saved": [], "straight/checkpoint-4": []}, r["differ"]
        assert r["error"] is not None and "save_on_each_node" in r["error"] and "rank 1: no .metadata" in r["error"], r
        assert r["partly"] is not None and "rank 1: no .metadata" in r["partly"], r
        assert r["resumed"] == r["straight"], r
        assert r["resumed_differ"] == [], r["resumed_differ"]


def _given_sharded_run(rank: int, world: int, tmp: str) -> str | None:
    from seqpar.config import ConfigError
    from seqpar.integrations.fsdp import wrap
    from seqpar.integrations.trainer import SeqParTrainer

    with hf_tiny.launcher_env(rank, world):
        model = wrap(hf_tiny.tiny_llama(), SP)  # sharded (and swapped) before the trainer sees it
        try:
            SeqParTrainer(model=model, args=_args(f"{tmp}/out", save_strategy="no"),
                          train_dataset=hf_tiny.ListDataset(hf_tiny.samples()), seqpar_config=SP)
        except ConfigError as e:
            return str(e)
    return None


@pytest.mark.timeout(300)
def test_fsdp2_trainer_refuses_a_model_sharded_already(dist_pool, tmp_path):
    """A model already FSDP2-sharded (here by ``seqpar.integrations.fsdp.wrap``) given to a seqpar FSDP2 trainer is
    refused by name on every rank: the trainer swaps and shards the model itself, and whether the model is sharded
    is how it tells a model it sharded (``model_init``'s, on hyperparameter search's second pass) from one to shard.

    Seen failing: without the refusal the trainer took the sharded model as its own and went on (no error), so a
    model sharded by the user's own ``fully_shard`` would train unswapped, with FSDP2's default gradient divide."""
    for error in dist_pool.run(2, _given_sharded_run, str(tmp_path), timeout=240):
        assert error is not None and "FSDP2 module already" in error and "pass the unsharded model" in error, error


def _save_on_some_ranks(rank: int, world: int, tmp: str, savers: tuple[int, ...], engine: str) -> dict:
    """``trainer.save_model()`` called by the ranks in ``savers`` only (``ddp_timeout=4``); what each rank saw, and
    whether the world's group still works after (a barrier and an all-reduce)."""
    import time

    import torch.distributed as dist

    from seqpar.config import ConfigError
    from seqpar.integrations.trainer import SeqParTrainer

    with hf_tiny.launcher_env(rank, world):
        if engine == "fsdp2":
            trainer = SeqParTrainer(model=hf_tiny.tiny_llama(), args=_args(f"{tmp}/out", save_strategy="no", ddp_timeout=4),
                                    train_dataset=hf_tiny.ListDataset(hf_tiny.samples()), seqpar_config=SP)
        else:  # ZeRO-3 (seqpar's block in the DeepSpeed config): the engine exists once training started
            from test_trainer import ds_config

            trainer = SeqParTrainer(model=hf_tiny.tiny_llama(), args=_args(f"{tmp}/out", steps=1, save_strategy="no",
                                                                           ddp_timeout=4, deepspeed=ds_config(2, 3)),
                                    train_dataset=hf_tiny.ListDataset(hf_tiny.samples()))
            trainer.train()
        error, start = None, time.monotonic()
        if rank in savers:
            try:
                trainer.save_model(f"{tmp}/saved")
            except ConfigError as e:
                error = str(e)
        waited = time.monotonic() - start
        dist.barrier()
        total = torch.ones(1)
        dist.all_reduce(total)
        return {"error": error, "waited": waited, "world_ok": total.item() == world,
                "files": sorted(os.listdir(f"{tmp}/saved")) if os.path.isdir(f"{tmp}/saved") else []}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("engine", ["fsdp2", "zero3"])
def test_save_model_on_some_ranks_is_refused_by_name(dist_pool, tmp_path, engine):
    """``save_model()`` under ``if trainer.is_world_process_zero():`` (and on rank 1 alone) at SP 2 on 2 ranks
    (seqpar's FSDP2, and DeepSpeed ZeRO-3, which gather every rank's shards to save): the calling rank raises a
    ConfigError naming the fix within ``ddp_timeout``, writes nothing, and the world's group works after; called on
    both ranks it saves.

    Seen failing: without ``_seqpar_meet_every_rank`` in ``save_model``, rank 0 alone entered the full state dict's
    gather and never came back (the pool killed it), while rank 1's next barrier failed on gloo's timeout ("Timed out
    waiting 60000ms for recv operation to complete"). With a gloo ``monitored_barrier`` on the world's group instead
    of the store, the calling rank raised but its timeout closed the group's connections: the barrier after failed
    on both ranks ("Application timeout caused pair closure", "Connection closed by peer"). ZeRO-3 without the check
    (its case dropped from ``_seqpar_prepare_save_check``): rank 0 alone in DeepSpeed's save_checkpoint met rank 1's
    barrier and rank 1 died ("gloo::EnforceNotMet ... Received data size doesn't match expected size", exit -6)."""
    for savers in ((0,), (1,)):
        for rank, r in enumerate(dist_pool.run(2, _save_on_some_ranks, str(tmp_path / f"s{savers[0]}"), savers,
                                               engine, timeout=300)):
            assert r["world_ok"], r
            assert r["files"] == [], r  # nothing written
            if rank in savers:
                assert r["error"] is not None and "call trainer.save_model() on every rank" in r["error"], r
                assert "ddp_timeout (4 s)" in r["error"], r
            else:
                assert r["error"] is None, r
    for r in dist_pool.run(2, _save_on_some_ranks, str(tmp_path / "both"), (0, 1), engine, timeout=300):
        # ZeRO-3 without stage3_gather_16bit_weights_on_model_save: transformers writes DeepSpeed's checkpoint
        assert r["error"] is None and r["world_ok"], r
        assert ("model.safetensors" if engine == "fsdp2" else "latest") in r["files"], r
