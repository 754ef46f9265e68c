"""TP2 x SP2 composed with the model parts beyond plain attention (issue 28 §2): a hybrid (Qwen3.5: Gated
DeltaNet layers beside attention), MLA (MiniCPM3: ``kv_b_proj`` colwise, ``kv_a_proj_with_mqa`` transformers'
``mla_kv_a_proj``, the ring moving the latent of each rank's heads) and an MoE with its router loss
(Qwen3-MoE, ``output_router_logits=True``): each equals one process, or is refused by name.

One pool of 4 gloo ranks; TP from the model's own plan and FSDP2 over dp x sp through
``seqpar.integrations.fsdp.wrap`` (as tests/test_tp_train.py), zigzag ring, fp32, one forward and backward
against one process in float64 on the whole sequence. Every gradient, reduced by FSDP2 and gathered over
TP, is judged on its own parameter's scale: ``max|g - g_ref| <= 1e-4 * max|g_ref of that parameter| +
1e-7 * max|g_ref| over the model``. The MoE's plan shards the experts with styles seqpar does not apply
(``packed_colwise``, ``moe_tp_experts``): refused by name on every rank before anything is sharded; with
the experts left out of the plan (the fix the refusal names) the router loss and every gradient equal
one process's.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

CONFIG = {"size": 2, "tp_size": 2, "mode": "ring", "sharding": "zigzag"}
TOL, FLOOR = 1e-4, 1e-7
KINDS = ("hybrid", "mla", "moe")


def _model(kind: str):  # noqa: ANN202
    from all_models import build_model
    from test_mla_models import tiny_mla

    if kind == "mla":
        return tiny_mla("minicpm3", torch.float32)
    model = build_model("qwen3_5_text" if kind == "hybrid" else "qwen3_moe", torch.float32)
    if kind == "moe":
        assert model.config.output_router_logits and model.config.router_aux_loss_coef > 0
    return model


def _batch(kind: str) -> dict[str, torch.Tensor]:
    from test_mla_models import SEQ, VOCAB

    ids = torch.randint(3, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(7))
    return {"input_ids": ids, "labels": ids.clone()}


def _compare(model, ref, loss: torch.Tensor, batch: dict, sp_group, sum_over_sp: bool) -> dict:  # noqa: ANN001
    """The loss and every gradient (DTensors gathered; summed over SP where no engine reduced them)
    against ``ref`` (float64, one process); returns the worst error per parameter scale."""
    from torch.distributed.tensor import DTensor

    ref_loss = ref(**batch).loss
    ref_loss.backward()
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss)), (float(loss), float(ref_loss))
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    worst, tp_sharded = 0.0, 0
    for name, p in model.named_parameters():
        grad = p.grad
        if isinstance(grad, DTensor):
            tp_sharded += "tp" in (p.device_mesh.mesh_dim_names or ()) or sum_over_sp
            grad = grad.full_tensor()
        grad = grad.detach().clone()
        if sum_over_sp:
            dist.all_reduce(grad, group=sp_group)  # each SP rank holds its tokens' share
        want = ref_grads.pop(name)
        err = float((grad.double() - want).abs().max())
        bound = TOL * float(want.abs().max()) + FLOOR * scale
        assert err <= bound, f"grad of {name}: max error {err:.3e} > {bound:.3e}"
        worst = max(worst, err / (float(want.abs().max()) + FLOOR * scale))
    assert not ref_grads, sorted(ref_grads)  # every parameter compared
    return {"loss": float(loss), "worst": worst, "tp_sharded": tp_sharded}


def _cell(manager, kind: str) -> dict:  # noqa: ANN001
    from seqpar.integrations.fsdp import wrap
    from seqpar.sequence.batch import shard_batch

    model = _model(kind)
    ref = copy.deepcopy(model).double()
    try:
        wrap(model, CONFIG, manager=manager, fsdp={"version": 2})
    except ValueError as error:
        return {"refused": str(error)}
    batch = _batch(kind)
    local = shard_batch(batch, group=manager.sp_group, sharding="zigzag")
    loss = model(**local).loss
    loss.backward()
    out = _compare(model, ref, loss.detach(), batch, manager.sp_group, sum_over_sp=False)
    out["latent"] = [(m.__dict__.get("_seqpar_latent_ok"), m.__dict__.get("_seqpar_latent_heads"))
                     for m in model.modules() if "_seqpar_expand_kv" in m.__dict__]
    return out


def _moe_without_expert_styles(manager) -> dict:  # noqa: ANN001
    """Qwen3-MoE with the experts left out of the TP plan (replicated on each TP rank), no FSDP: TP from
    the rest of the plan, the swap, the router loss of the whole sequence."""
    from seqpar.integrations.tp import apply_tensor_parallel
    from seqpar.sequence.batch import shard_batch
    from seqpar.swap import swap_attention

    model = _model("moe")
    ref = copy.deepcopy(model).double()
    swap_attention(model, CONFIG, group=manager.sp_group)
    plan = {k: v for k, v in model.tp_plan.items() if ".experts" not in k}
    applied = apply_tensor_parallel(model, manager, plan=plan)
    assert "packed_colwise" not in applied.values() and "colwise" in applied.values()
    batch = _batch("moe")
    local = shard_batch(batch, group=manager.sp_group, sharding="zigzag")
    loss = model(**local).loss
    loss.backward()
    return _compare(model, ref, loss.detach(), batch, manager.sp_group, sum_over_sp=True)


def _compose(rank: int, world: int) -> dict:
    from seqpar.runtime.groups import init_process_groups, set_default_manager

    manager = init_process_groups(config=CONFIG)
    try:
        out = {kind: _cell(manager, kind) for kind in KINDS}
        out["moe without expert styles"] = _moe_without_expert_styles(manager)
        return out
    finally:
        manager.destroy()
        set_default_manager(None)


@pytest.mark.timeout(900)
def test_tp2_sp2_hybrid_mla_moe(dist_pool) -> None:
    """Qwen3.5 (GDN + attention) and MiniCPM3 (MLA, the latent ring on each rank's 2 of 4 heads) at TP2 x
    SP2 under FSDP2: loss and every gradient equal one process's. Qwen3-MoE with its router loss: its
    plan's expert styles refused by name on every rank; without them, exact."""
    per_rank = dist_pool.run(4, _compose, timeout=800)
    for rank, got in enumerate(per_rank):
        for kind in ("hybrid", "mla"):
            assert "refused" not in got[kind], (rank, kind, got[kind])
            assert got[kind]["tp_sharded"] > 0, (rank, kind, got[kind])
        assert got["mla"]["latent"] == [(True, 2)] * 2, (rank, got["mla"]["latent"])  # 4 heads over TP2
        refusal = got["moe"].get("refused", "")
        assert "tp plan maps" in refusal and "experts" in refusal and "packed_colwise" in refusal, (rank, got["moe"])
        assert "apply_tensor_parallel without it" in refusal and "tp_size 1" in refusal, refusal
        assert got["moe without expert styles"]["tp_sharded"] > 0, got["moe without expert styles"]
    for kind in ("hybrid", "mla", "moe without expert styles"):
        assert len({r[kind]["loss"] for r in per_rank}) == 1, (kind, [r[kind]["loss"] for r in per_rank])
