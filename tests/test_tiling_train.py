"""Tiling is exact under the engines: a Hugging Face Llama swapped from the config (attention, tiled
loss, tiled MLP) trained 3 steps under FSDP2 and DeepSpeed ZeRO-2/3 at SP = 1, 2, 4 gives the same
per-step losses (fp32, relative 1e-5) and the same first-step reduced gradients of every parameter as
the same run without tiling. The gradients are read after the engine has reduced them, so a chunk's
partial gradient reduced too early would show here."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from seqpar.testing.deepspeed_teardown import releases_deepspeed_engines

pytest.importorskip("transformers")

VOCAB, SEQ, STEPS = 300, 64, 3
RTOL = 1e-5


def _model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                      tie_word_embeddings=False, use_cache=False, bos_token_id=1, eos_token_id=2)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def _batch(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def _loss(model: Any, batch: dict[str, torch.Tensor], tiled: bool, group: Any) -> torch.Tensor:
    from seqpar.sequence.loss import sequence_parallel_loss

    if tiled is True:
        return model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                     shift_labels=batch["shift_labels"]).loss
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    return sequence_parallel_loss(logits, batch["shift_labels"], group=group)


def _sp_block(sp: int, tiled: bool | str) -> dict[str, Any]:
    block = {"size": sp, "mode": "ring", "sharding": "zigzag"}
    if tiled is True:
        block.update(tiled_loss=True, tiled_mlp=3)
    elif tiled == "recompute_norm":  # the lean RMSNorms alone, against the same run without
        block.update(recompute_norm=True)
    return block


@releases_deepspeed_engines
def _run(rank: int, world: int, engine: str, stage: int, tiled: bool | str) -> tuple[list[float], dict]:
    from seqpar.sequence.batch import shard_batch

    model = _model()
    if engine == "fsdp2":
        import seqpar
        from seqpar.config import SeqParConfig
        from seqpar.integrations import fsdp

        cfg = SeqParConfig.from_dict(_sp_block(world, tiled))
        manager = seqpar.init_process_groups(config=cfg)
        model = fsdp.wrap(model, cfg, manager=manager, fsdp={"version": 2})
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    else:
        from seqpar.integrations.deepspeed import initialize

        config = {
            "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0, "torch_adam": True}},
            "zero_optimization": {"stage": stage}, "gradient_clipping": 0.0, "steps_per_print": 10**6,
            "sequence_parallel": _sp_block(world, tiled),
        }
        model, _, _, _ = initialize(model=model, config=config)
        manager = model.seqpar_manager
    losses, grads = [], {}
    for step in range(STEPS):
        batch = shard_batch(_batch(step), group=manager.sp_group, sharding="zigzag")
        loss = _loss(model, batch, tiled, manager.sp_group)
        if engine == "fsdp2":
            loss.backward()
            if step == 0:
                grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
            opt.step()
            opt.zero_grad()
        else:
            from deepspeed.utils import safe_get_full_grad

            model.backward(loss)
            if step == 0:
                grads = {n: safe_get_full_grad(p).detach().clone() for n, p in model.module.named_parameters()}
            model.step()
        losses.append(loss.item())
    return losses, grads


@pytest.mark.parametrize(
    "engine,stage,world",
    # SP 1/2/4 under FSDP2 and under DeepSpeed ZeRO-2 and ZeRO-3 (a few seconds each once DeepSpeed's
    # CPU comm op is built).
    [("fsdp2", 0, 1), ("fsdp2", 0, 2), ("fsdp2", 0, 4),
     ("deepspeed", 2, 1), ("deepspeed", 2, 2), ("deepspeed", 2, 4),
     ("deepspeed", 3, 1), ("deepspeed", 3, 2), ("deepspeed", 3, 4)],
)
def test_tiling_equals_untiled_under_engines(dist_pool, engine: str, stage: int, world: int) -> None:
    _check_equal(dist_pool, engine, stage, world, True)


@pytest.mark.parametrize("engine,stage", [("fsdp2", 0), ("deepspeed", 3)])
def test_recompute_norm_equals_hf_norms_under_engines(dist_pool, engine: str, stage: int) -> None:
    # SP = 2 only: the norm is token-wise, the engines' reduction of its weight's gradient is the point
    _check_equal(dist_pool, engine, stage, 2, "recompute_norm")


def _check_equal(dist_pool, engine: str, stage: int, world: int, tiled: bool | str) -> None:
    plain = dist_pool.run(world, _run, engine, stage, False, timeout=240)
    tiled = dist_pool.run(world, _run, engine, stage, tiled, timeout=240)
    for (ref_losses, ref_grads), (losses, grads) in zip(plain, tiled):
        for i, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
            assert abs(a - b) <= RTOL * abs(b), f"step {i}: tiled {a} vs untiled {b}"
        assert grads.keys() == ref_grads.keys() and grads
        for name, g in grads.items():
            r = ref_grads[name]
            scale = r.abs().max().item()
            assert scale > 0, name
            assert (g - r).abs().max().item() <= RTOL * 10 * scale, name


def _num_items_run(rank: int, world: int, num_items: int) -> tuple[float, dict[str, torch.Tensor]]:
    """SP = ``world``: the swapped, tiled Llama called as transformers' Trainer calls it (``num_items_in_batch``);
    the loss on this rank and every parameter's gradient summed over the SP group (what the engines' reduction
    adds up), in float64 on the CPU."""
    import torch.distributed as dist

    import seqpar
    from seqpar.config import SeqParConfig
    from seqpar.sequence.batch import shard_batch
    from seqpar.swap import swap_attention

    cfg = SeqParConfig.from_dict({**_sp_block(world, False), "tiled_loss": True})
    manager = seqpar.init_process_groups(config=cfg)
    model = _model()
    swap_attention(model, cfg, group=manager.sp_group)
    batch = shard_batch(_batch(0), group=manager.sp_group, sharding="zigzag")
    loss = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                 shift_labels=batch["shift_labels"], num_items_in_batch=num_items).loss
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.detach().clone()
        dist.all_reduce(g, group=manager.sp_group)
        grads[name] = g.double()
    return loss.item(), grads


def test_tiled_loss_with_num_items_in_batch_at_sp2(dist_pool) -> None:
    """The tiled loss's ``num_items_in_batch`` path (transformers' Trainer: a sum over the step's tokens divided
    by the step's count) at SP = 2: every rank's loss is the whole sequence's sum over ``num_items`` and the
    gradients summed over the SP group are those of that loss, each parameter against its own scale, all
    against one float64 process. ``num_items`` (37) is not the batch's own count, so a path that used the
    local or the global count instead would show.
    Seen failing: the SP all-reduce of the loss sum dropped (``loss_sum / num_items``: each rank's own
    shard's sum, loss off by half the sequence), and the all-reduce's identity backward replaced by a plain
    all-reduce (every gradient doubled)."""
    num_items = 37
    per_rank = dist_pool.run(2, _num_items_run, num_items, timeout=240)
    ref_model = _model().double()
    batch = _batch(0)
    logits = ref_model(input_ids=batch["input_ids"]).logits
    ref = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), batch["labels"][:, 1:].reshape(-1),
                                            reduction="sum") / num_items
    ref.backward()
    ref_grads = {n: p.grad for n, p in ref_model.named_parameters()}
    for loss, grads in per_rank:
        assert abs(loss - ref.item()) <= RTOL * abs(ref.item()), (loss, ref.item())
        assert grads.keys() == ref_grads.keys()
        for name, g in grads.items():
            r = ref_grads[name]
            scale = r.abs().max().item()
            assert scale > 0, name
            assert (g - r).abs().max().item() <= 1e-4 * scale, (name, (g - r).abs().max().item(), scale)
