"""Checkpoints under FSDP2 x DTensor TP reshard through DCP (issue 22): saved at TP2 x SP2 (4 ranks),
resumed at SP2 (TP1, 2 ranks), saved there and resumed at TP2 x SP2 again; every step after a resume
equals the uninterrupted run (one process without seqpar).

:func:`seqpar.runtime.checkpoint.save_dcp` / :func:`~seqpar.runtime.checkpoint.load_dcp` write and read
model and optimizer state through torch's ``get_state_dict`` / ``set_state_dict`` and
``torch.distributed.checkpoint``, inside seqpar's atomic ``step<N>.tmp`` -> ``step<N>`` protocol. The
model's parameters are DTensors on a ``(dp_sp, tp)`` mesh at TP2 (Qwen3's q_norm / k_norm on ``dp_sp``
only) and on ``dp_sp`` at TP1, so the two layouts share no shard: DCP reshards.

Tiny Qwen3 (8 query / 4 K/V heads), fp32, SGD with momentum (its buffers are optimizer state that must
be resharded too; plain SGD would not show a lost buffer, and Adam would hide a gradient's scale). The
resumed model starts from other weights, so only the checkpoint can make it right. Compared at every
step after a resume: the loss and every gradient, 1e-5 relative on the gradient's scale.
"""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist
from test_tp_train import CONFIG, _model, _plain, _seqpar_loss

KIND = "qwen3"
STEPS = 5
LR, MOMENTUM = 0.01, 0.9


def _batches() -> list[dict]:
    g = torch.Generator().manual_seed(7)
    return [_plain(g) for _ in range(STEPS)]


def _reference(steps: int) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """One process, uninterrupted: each of the first ``steps`` steps' loss and gradients (before that
    step's update)."""
    ref = _model(KIND)
    opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=MOMENTUM)
    out = []
    for batch in _batches()[:steps]:
        loss = (ref(input_ids=batch["input_ids"]).logits * batch["weight"]).sum()
        loss.backward()
        out.append((loss.detach(), {n: p.grad.clone() for n, p in ref.named_parameters()}))
        opt.step()
        opt.zero_grad()
    return out


def _train(rank: int, world: int, save_dir: str, tp: int, start: int, stop: int) -> dict:
    """Steps ``start`` .. ``stop - 1`` at SP2 x TP``tp`` (FSDP2 over dp x sp): resumed from ``save_dir``'s
    latest checkpoint when ``start`` > 0, saved there as step ``stop`` at the end. Asserts each step's
    loss and (after a resume) every gradient against the uninterrupted one-process run."""
    from torch.distributed.tensor import DTensor

    from seqpar.integrations.fsdp import wrap
    from seqpar.runtime import checkpoint
    from seqpar.runtime.groups import init_process_groups, set_default_manager
    from seqpar.sequence.batch import shard_batch

    reference, batches = _reference(stop), _batches()
    manager = init_process_groups(config={**CONFIG, "tp_size": tp})
    try:
        assert (manager.dp_size, manager.sp_size, manager.tp_size) == (1, 2, tp)
        model = _model(KIND)
        if start > 0:  # other weights than the run that saved: only the checkpoint can make them right
            g = torch.Generator().manual_seed(99)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=g))
        wrap(model, CONFIG, manager=manager, fsdp={"version": 2})
        meshes = {p.device_mesh.mesh_dim_names for p in model.parameters()}
        assert meshes == ({("dp_sp", "tp"), ("dp_sp",)} if tp > 1 else {("dp_sp",)}), meshes
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        if start > 0:
            extra = checkpoint.load_dcp(save_dir, model, opt)
            assert extra["step"] == start, extra
        losses = []
        for step in range(start, stop):
            local = shard_batch(batches[step], group=manager.sp_group, sharding="zigzag")
            loss = _seqpar_loss(model, local)
            loss.backward()
            total = loss.detach().clone()
            dist.all_reduce(total, group=manager.sp_group)
            want_loss, want_grads = reference[step]
            torch.testing.assert_close(total, want_loss, rtol=1e-5, atol=1e-5 * want_loss.abs().item(),
                                       msg=lambda m, step=step: f"TP{tp} step {step} loss: {m}")
            losses.append(total.item())
            if start > 0:  # the resumed steps: every gradient
                for name, p in model.named_parameters():
                    assert isinstance(p.grad, DTensor), name
                    grad, want = p.grad.full_tensor(), want_grads[name]
                    torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-5 * want.abs().max().item(),
                                               msg=lambda m, name=name, step=step: f"TP{tp} step {step}: {name}: {m}")
            opt.step()
            opt.zero_grad()
        path = checkpoint.save_dcp(save_dir, stop, model, opt)
        return {"losses": losses, "saved": os.path.basename(path), "files": sorted(os.listdir(save_dir))}
    finally:
        manager.destroy()
        set_default_manager(None)


def test_tp2_sp2_checkpoint_resumes_at_sp2_and_back(dist_pool, tmp_path) -> None:
    """Save at TP2 x SP2 after 2 steps; resume at SP2 (TP1, 2 ranks) for 2 steps and save; resume at
    TP2 x SP2 for the last step. Every resumed step's loss and gradients equal the uninterrupted run."""
    save_dir = str(tmp_path / "ckpt")
    head = dist_pool.run(4, _train, save_dir, 2, 0, 2, timeout=240)
    assert head[0]["saved"] == "step2" and head[0]["files"] == ["latest", "step2"], head[0]
    assert sorted(os.listdir(os.path.join(save_dir, "step2")))[:2] == [".metadata", "COMPLETE"]
    middle = dist_pool.run(2, _train, save_dir, 1, 2, 4, timeout=240)
    assert middle[0]["files"] == ["latest", "step2", "step4"], middle[0]
    tail = dist_pool.run(4, _train, save_dir, 2, 4, 5, timeout=240)
    for part, n in ((head, 2), (middle, 2), (tail, 1)):
        assert all(len(r["losses"]) == n and r["losses"] == part[0]["losses"] for r in part), part
    losses = head[0]["losses"] + middle[0]["losses"] + tail[0]["losses"]
    assert len(set(losses)) == STEPS, losses  # five different steps


def test_load_dcp_refuses_a_missing_checkpoint(tmp_path) -> None:
    import pytest

    from seqpar.runtime import checkpoint

    model = _model(KIND)
    with pytest.raises(FileNotFoundError, match="no complete checkpoint .* in"):
        checkpoint.load_dcp(tmp_path, model)
    os.makedirs(tmp_path / "step3.tmp")  # a torn save
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        checkpoint.load_dcp(tmp_path, model)
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        checkpoint.load_dcp(tmp_path, model, tag="step3.tmp")


def test_save_dcp_one_process_round_trip(tmp_path) -> None:
    """Without a process group (one process, plain parameters): the same save and load, atomic."""
    from seqpar.runtime import checkpoint

    model = _model(KIND)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    batch = _batches()[0]
    (model(input_ids=batch["input_ids"]).logits * batch["weight"]).sum().backward()
    opt.step()
    checkpoint.save_dcp(tmp_path, 1, model, opt, extra={"note": "x"})
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.zero_()
    other_opt = torch.optim.SGD(other.parameters(), lr=LR, momentum=MOMENTUM)
    assert checkpoint.load_dcp(tmp_path, other, other_opt) == {"note": "x", "step": 1}
    for (name, p), q in zip(model.named_parameters(), other.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(other_opt.state[q]["momentum_buffer"], opt.state[p]["momentum_buffer"],
                                   rtol=0, atol=0, msg=name)
    assert sorted(os.listdir(tmp_path)) == ["latest", "step1"]


def test_launcher_fsdp_resumes_tp2_sp2_at_sp2_and_back(dist_pool) -> None:
    """``launch/train.py`` (FSDP2, AdamW, DCP through ``seqpar.runtime.checkpoint.save_dcp``): 3 steps at
    ``--tp-size 2 --sp-size 2`` (4 ranks), saved, resumed for 2 more at SP2 on 2 ranks; and the other
    way round. Both give the 5 losses of the uninterrupted SP = 1 run."""
    from test_train import _close, _config, _reference, _resumed

    config, tp2 = _config("fsdp_ring.json"), ("--tp-size", "2")
    ref = _reference(dist_pool, "fsdp_ring.json")
    _close(_resumed(dist_pool, config, (4, tp2), (2, ())), ref)
    _close(_resumed(dist_pool, config, (2, ()), (4, tp2)), ref)
