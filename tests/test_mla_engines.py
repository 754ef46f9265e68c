"""MLA latent transfer under the engines that hold ``kv_b_proj``'s weight elsewhere than on the module
(issue 28 §1): DeepSpeed ZeRO-3 (gathers each submodule's parameters around its own forward), FSDP2 with
``kv_b_proj`` a unit of its own (unshards it around its own forward), and TP2 x SP2 (``kv_b_proj`` colwise:
each TP rank holds its heads' rows). Each runs the latent ring (every layer's verdict "latent", with this
rank's head count) and gives one process's loss and every reduced gradient; a layer that cannot take
the latent path says so once.

A tiny MiniCPM3 (tests/test_mla_models.py: 4 heads, Q/K head dim 10, V's 6, kv_lora_rank 12) in fp32
on the engines, against one process in float64 on the whole sequence. Each parameter is judged on its
own scale: ``max|g - g_ref| <= 1e-4 * max|g_ref of that parameter| + 1e-7 * max|g_ref| over the model``.
"""

from __future__ import annotations

import logging

import pytest
import torch
from test_mla_models import SEQ, VOCAB, tiny_mla

from seqpar.sequence.batch import shard_batch
from seqpar.testing.deepspeed_teardown import releases_deepspeed_engines

transformers = pytest.importorskip("transformers")

TOL, FLOOR = 1e-4, 1e-7
CONFIG = {"size": 2, "mode": "ring", "sharding": "zigzag"}


def _batch(step: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(40 + step))
    return {"input_ids": ids, "labels": ids.clone()}


def _reference(batch: dict[str, torch.Tensor], model=None):  # noqa: ANN001, ANN202
    """float64 loss and gradients of one process without seqpar on the whole sequence."""
    ref = model if model is not None else tiny_mla("minicpm3")
    loss = ref(**batch).loss
    loss.backward()
    return float(loss.detach()), {n: p.grad.detach().clone() for n, p in ref.named_parameters()}


def check_grads(grads: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], label: str) -> None:
    """Every parameter against its own reference scale (plus a small floor on the model's scale)."""
    assert set(grads) == set(ref), (label, sorted(set(grads) ^ set(ref)))
    scale = max(float(g.abs().max()) for g in ref.values())
    for name, want in ref.items():
        err = float((grads[name].double() - want).abs().max())
        bound = TOL * float(want.abs().max()) + FLOOR * scale
        assert err <= bound, f"{label}: grad of {name}: max error {err:.3e} > {bound:.3e}"


def latent_verdicts(model: torch.nn.Module) -> list[tuple[bool | None, int | None]]:
    """Per MLA layer: (took the latent path, this rank's head count), as seqpar.swap.mla recorded them."""
    return [(m.__dict__.get("_seqpar_latent_ok"), m.__dict__.get("_seqpar_latent_heads"))
            for m in model.modules() if "_seqpar_expand_kv" in m.__dict__]


def _clean(name: str) -> str:
    for prefix in ("module.", "_fsdp_wrapped_module.", "_orig_mod."):
        name = name.replace(prefix, "")
    return name


@releases_deepspeed_engines
def _zero3(rank: int, world: int) -> dict:
    """Worker: seqpar.integrations.deepspeed.initialize, ZeRO-3, SP2; one step's loss and full gradients."""
    from deepspeed.utils import safe_get_full_grad

    from seqpar.integrations.deepspeed import initialize

    model = tiny_mla("minicpm3", torch.float32)
    config = {
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0, "torch_adam": True}},
        "zero_optimization": {"stage": 3}, "gradient_clipping": 0.0, "steps_per_print": 10**6,
        "sequence_parallel": CONFIG,
    }
    engine, _, _, _ = initialize(model=model, config=config)
    local = shard_batch(_batch(0), group=engine.seqpar_manager.sp_group, sharding="zigzag")
    loss = engine(**local).loss
    engine.backward(loss)
    grads = {_clean(n): safe_get_full_grad(p).detach().clone() for n, p in engine.module.named_parameters()}
    return {"loss": float(loss.detach()), "grads": grads, "verdicts": latent_verdicts(engine.module)}


@pytest.mark.timeout(900)
def test_latent_ring_under_zero3(dist_pool) -> None:
    """ZeRO-3 at SP2: ``kv_b_proj``'s weight is gathered only around that module's own forward; the latent
    ring still runs (each layer's verdict taken with the gathered weight) and the loss and every gradient
    reduce-scattered by ZeRO-3 equal one process's."""
    ref_loss, ref_grads = _reference(_batch(0))
    per_rank = dist_pool.run(2, _zero3, timeout=600)
    for rank, got in enumerate(per_rank):
        assert got["verdicts"] == [(True, 4)] * 2, (rank, got["verdicts"])
        assert abs(got["loss"] - ref_loss) <= 1e-5 * abs(ref_loss), (rank, got["loss"], ref_loss)
        check_grads(got["grads"], ref_grads, f"ZeRO-3 rank {rank}")


def _fsdp2(rank: int, world: int, steps: int) -> dict:
    """Worker: seqpar.integrations.fsdp.wrap, FSDP2 over SP2 with every nn.Linear (kv_b_proj among them) a
    unit of its own inside the decoder layers' units; ``steps`` SGD steps, losses and gradients."""
    import seqpar
    from seqpar.integrations import fsdp

    manager = seqpar.init_process_groups(config=CONFIG)
    try:
        model = fsdp.wrap(tiny_mla("minicpm3", torch.float32), CONFIG, manager=manager,
                          fsdp={"version": 2, "wrap_classes": ["MiniCPM3DecoderLayer", "Linear"]})
        kv_b = [m.kv_b_proj for m in model.modules() if hasattr(m, "kv_b_proj")]
        assert all(type(p).__name__.startswith("FSDP") for p in kv_b), [type(p).__name__ for p in kv_b]
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        out = {"losses": [], "grads": []}
        for step in range(steps):
            local = shard_batch(_batch(step), group=manager.sp_group, sharding="zigzag")
            loss = model(**local).loss
            loss.backward()
            out["losses"].append(float(loss.detach()))
            out["grads"].append({_clean(n): p.grad.full_tensor().clone() for n, p in model.named_parameters()})
            opt.step()
            opt.zero_grad()
        out["verdicts"] = latent_verdicts(model)
        return out
    finally:
        manager.destroy()
        seqpar.runtime.groups.set_default_manager(None)


@pytest.mark.timeout(900)
def test_latent_ring_under_fsdp2_with_kv_b_proj_wrapped(dist_pool) -> None:
    """FSDP2 at SP2, ``kv_b_proj`` a unit of its own (its weight a sharded DTensor outside its forward): the
    latent ring runs and 2 SGD steps' losses and every gradient equal one process's."""
    steps = 2
    ref = tiny_mla("minicpm3")
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    want = []
    for step in range(steps):
        want.append(_reference(_batch(step), ref))
        opt.step()
        opt.zero_grad()
    per_rank = dist_pool.run(2, _fsdp2, steps, timeout=600)
    for rank, got in enumerate(per_rank):
        assert got["verdicts"] == [(True, 4)] * 2, (rank, got["verdicts"])
        for step, (ref_loss, ref_grads) in enumerate(want):
            assert abs(got["losses"][step] - ref_loss) <= 1e-5 * abs(ref_loss), (rank, step, got["losses"], ref_loss)
            check_grads(got["grads"][step], ref_grads, f"FSDP2 rank {rank} step {step}")
    assert want[0][0] != want[1][0]


def test_fallback_says_why_once(caplog: pytest.LogCaptureFixture) -> None:
    """An MLA layer seqpar cannot move latents for keeps expanded K/V and says why, once (not per layer)."""
    from seqpar.swap.mla import install_latent_transfer
    from seqpar.swap.options import SwapOptions

    model = tiny_mla("minicpm3", torch.float32)
    layers = [m for m in model.modules() if hasattr(m, "kv_b_proj")]
    for layer in layers:  # a bias on kv_b_proj: not the expansion seqpar does
        layer.kv_b_proj.bias = torch.nn.Parameter(torch.zeros(layer.kv_b_proj.out_features))
    with caplog.at_level(logging.WARNING, logger="seqpar.swap.mla"):
        assert not any(install_latent_transfer(layer, SwapOptions()) for layer in layers)
    said = [r.getMessage() for r in caplog.records if r.name == "seqpar.swap.mla"]
    assert said == ["seqpar: MiniCPM3Attention: kv_b_proj has a bias; its ring moves expanded K/V, not the latent"], said
