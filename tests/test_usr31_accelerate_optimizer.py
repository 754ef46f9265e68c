"""`seqpar.integrations.accelerate.prepare` given a built optimizer, as docs/integrations.md's accelerate paragraph
and the function's docstring allow ("or an optimizer already built on model.parameters()"), usr31's new-user walk.
"""

from __future__ import annotations

import hf_tiny
import pytest
import torch


def _adamw_prepared(rank: int, world: int, cls_name: str) -> list[float]:
    from accelerate import Accelerator
    from torch.distributed.tensor import DTensor

    from seqpar.integrations.accelerate import prepare

    cls = getattr(torch.optim, cls_name)
    # eps large: Adam's first step is g / (|g| + eps), which multiplies a float64 gradient's rounding by 1 / eps
    hp = {"lr": 1e-2, "weight_decay": 0.1, "betas": (0.8, 0.9), "eps": 1e-2}
    ids = torch.randint(0, hf_tiny.VOCAB, (1, 32), generator=torch.Generator().manual_seed(3))
    reference = hf_tiny.tiny_llama(torch.float64)  # one process, float64: one step of the same optimizer
    ref_opt = cls(reference.parameters(), **hp)
    reference(input_ids=ids, labels=ids).loss.backward()
    ref_opt.step()
    with hf_tiny.launcher_env(rank, world):
        accelerator = Accelerator()
        model = hf_tiny.tiny_llama(torch.float64)
        model, opt, _ = prepare(accelerator, model, cls(model.parameters(), **hp), None,
                                config={"size": world, "sharding": "zigzag"})
        inner = getattr(opt, "optimizer", opt)  # accelerate's AcceleratedOptimizer wraps the rebuilt one
        assert type(inner) is cls and inner.defaults["weight_decay"] == 0.1, (type(inner), inner.defaults)
        assert tuple(map(float, inner.defaults["betas"])) == (0.8, 0.9), inner.defaults
        import seqpar

        model(**seqpar.shard_batch({"input_ids": ids, "labels": ids})).loss.backward()
        opt.step()
        errors = []
        initial = hf_tiny.tiny_llama(torch.float64).parameters()
        for mine, ref, init in zip(model.parameters(), reference.parameters(), initial, strict=True):
            full = mine.full_tensor() if isinstance(mine, DTensor) else mine
            step = (ref - init).detach()  # compare each parameter's update on its own scale
            errors.append(((full - init - step).abs().max() / step.abs().max().clamp_min(1e-30)).item())
        return errors


@pytest.mark.parametrize("cls_name", ["AdamW", "Adam"])
def test_a_built_optimizer_is_rebuilt_and_steps_as_one_process(dist_pool, cls_name):
    """`prepare(accelerator, model, torch.optim.AdamW(model.parameters(), ...), ...)` on 2 gloo ranks (SP 2): the
    rebuilt optimizer keeps the class and hyper-parameters, and after one step every parameter equals one
    process's float64 step (each on its own scale). Seen failing: AdamW raised `TypeError: AdamW.__init__() got
    an unexpected keyword argument 'decoupled_weight_decay'` on every rank (torch 2.13's AdamW keeps Adam's
    `decoupled_weight_decay` in its parameter groups; `_optimizer_for` passed every group key back)."""
    for errors in dist_pool.run(2, _adamw_prepared, cls_name, timeout=300):
        assert max(errors) < 1e-5, errors  # seen: <= 4e-7 (the fp32 bar; the float64 run is not bit-equal)
