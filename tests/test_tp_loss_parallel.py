"""TP's loss layout in ``seqpar.integrations.fsdp.wrap``: ``sequence_parallel.tp_loss_parallel`` (true / false /
``"auto"``) and ``wrap(..., tp_loss_parallel=...)``.

One pool of 4 gloo ranks, two grids: TP2 x SP2 (ring, zigzag) and DP2 x TP2 (SP 1, both replicas on the same
batch). Tiny Llama (8 query heads, 4 K/V heads, vocabulary 53: TP slices of 27 + 26) in fp32, through
``wrap`` (the swap, TP from the model's plan, FSDP2 over dp x sp), with ``tp_sequence_parallel`` off and on and
each loss setting. The loss is ``sequence_parallel_loss`` of the logits, whatever their layout. Against one
process in float64 on the whole sequence (the same weights, cast): the loss and every FSDP2-reduced gradient
(each on its own scale, to fp32's 1e-5). Not fp64 under TP: the vocab-parallel cross-entropy
(``seqpar.sequence.vocab_parallel``) computes in fp32 whatever the logits' dtype. The logits' layout is asserted too: a DTensor ``Shard(-1)`` of local ``(2, S_local, 27 | 26)`` when
the setting asks the loss to be vocab-parallel, a plain ``(2, S_local, 53)`` tensor when it asks them gathered.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

VOCAB = 53
SEQ = 16
GRIDS = {"tp2_sp2": {"size": 2, "tp_size": 2, "mode": "ring", "sharding": "zigzag"}, "dp2_tp2": {"size": 1, "tp_size": 2}}
# (tp_sequence_parallel, how the setting is given): "auto" / True / False as the config key, ("arg", v) as
# wrap's argument over a config key saying the opposite
SETTINGS = [(tp_sp, loss) for tp_sp in (False, True) for loss in ("auto", True, False, ("arg", True), ("arg", False))]


def _model():  # noqa: ANN202
    from test_tp_train import _model as tiny

    return tiny("llama")


def _batch() -> dict:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    labels[0, 2] = labels[1, 11] = -100
    return {"input_ids": ids, "labels": labels}


def _expected_split(tp_sp: bool, loss) -> bool:  # noqa: ANN001
    value = loss[1] if isinstance(loss, tuple) else loss
    return tp_sp if value == "auto" else value


def _one(manager, grid: str, tp_sp: bool, loss) -> dict:  # noqa: ANN001
    """One wrap + forward/backward; asserts the loss and every gradient against one process in float64 and
    returns the logits' layout."""
    from torch.distributed.tensor import DTensor, Shard

    from seqpar.integrations.fsdp import wrap
    from seqpar.sequence.batch import shard_batch
    from seqpar.sequence.loss import sequence_parallel_loss

    config = {**GRIDS[grid], "tp_sequence_parallel": tp_sp}
    kwargs = {}
    if isinstance(loss, tuple):  # the argument wins over a key that says the opposite
        config["tp_loss_parallel"] = not loss[1]
        kwargs["tp_loss_parallel"] = loss[1]
    else:
        config["tp_loss_parallel"] = loss
    what = f"{grid} tp_sequence_parallel={tp_sp} tp_loss_parallel={loss}"
    model = _model()
    ref = copy.deepcopy(model).double()
    wrap(model, config, manager=manager, fsdp={"version": 2}, **kwargs)
    batch = _batch()
    logits_ref = ref(input_ids=batch["input_ids"]).logits
    shifted = F.pad(batch["labels"][:, 1:], (0, 1), value=-100)
    loss_ref = F.cross_entropy(logits_ref.reshape(-1, VOCAB), shifted.reshape(-1), ignore_index=-100)
    loss_ref.backward()

    sharding = config.get("sharding", "contiguous")
    local = shard_batch(batch, group=manager.sp_group, sharding=sharding)
    logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits
    split = isinstance(logits, DTensor)
    layout = (split, tuple(logits.to_local().shape if split else logits.shape),
              tuple(logits.placements) == (Shard(2),) if split else None)
    got = sequence_parallel_loss(logits, local["shift_labels"], group=manager.sp_group)
    got.backward()
    # fp32 under TP against float64 on one process: fp32's tolerances
    torch.testing.assert_close(got.detach().double(), loss_ref.detach(), rtol=1e-5, atol=0,
                               msg=lambda m: f"{what}: loss: {m}")
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        grad, want = p.grad.full_tensor(), ref_params[name].grad  # FSDP2 reduced over dp x sp
        torch.testing.assert_close(grad.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item(),
                                   msg=lambda m, name=name: f"{what}: grad of {name}: {m}")
    return {"layout": layout, "loss": got.item()}


def _refusal(fn) -> str | None:  # noqa: ANN001
    try:
        fn()
    except ValueError as e:
        return f"{type(e).__name__}: {e}"
    return None


def _refusals(manager) -> dict:  # noqa: ANN001
    """What cannot apply, refused by name before anything is sharded (on every rank)."""
    from seqpar.integrations.fsdp import wrap
    from seqpar.integrations.tp import apply_tensor_parallel

    config = GRIDS["tp2_sp2"]
    plan = {k: v for k, v in _model().tp_plan.items() if v != "colwise_gather_output"}  # no LM head entry
    out = {
        # the tiled loss under TP is vocab-parallel: there are no logits to gather
        "tiled_gathered": _refusal(lambda: wrap(_model(), {**config, "tiled_loss": True}, manager=manager,
                                                fsdp={"version": 2}, tp_loss_parallel=False)),
        "bad_value": _refusal(lambda: wrap(_model(), config, manager=manager, fsdp={"version": 2},
                                           tp_loss_parallel="yes")),
        "no_head": _refusal(lambda: apply_tensor_parallel(_model(), manager, plan=plan, vocab_parallel=True)),
    }
    # the same plan with the layout left to "auto" (None) is not refused: nothing is asked of the head
    model = _model()
    apply_tensor_parallel(model, manager, plan=plan, vocab_parallel=None)
    out["no_head_auto_ok"] = not hasattr(model.lm_head.weight, "placements")
    return out


def _all(rank: int, world: int) -> dict:
    from seqpar.runtime.groups import init_process_groups, set_default_manager

    out: dict = {}
    for grid, config in GRIDS.items():
        manager = init_process_groups(config=config)
        try:
            for tp_sp, loss in SETTINGS:
                out[grid, tp_sp, str(loss)] = _one(manager, grid, tp_sp, loss)
            if grid == "tp2_sp2":
                out["refusals"] = _refusals(manager)
        finally:
            manager.destroy()
            set_default_manager(None)
    return out


@pytest.fixture(scope="module")
def per_rank(dist_pool) -> list:
    return dist_pool.run(4, _all, timeout=300)


@pytest.mark.parametrize("grid", list(GRIDS))
def test_each_loss_setting_matches_one_process(per_rank, grid: str) -> None:
    """Every setting, with and without ``tp_sequence_parallel``: loss and every gradient equal one process in
    float64 to 1e-5 (asserted on every rank); the logits are vocab-split exactly when the setting asks for it
    (``"auto"``: as ``tp_sequence_parallel``; the argument over the key). Seen failing: ``wrap`` passing
    ``vocab_parallel=None`` whatever the setting (``True`` without TP-SP gave gathered logits); ``_relaid_styles``
    splitting the head whenever TP-SP is on (``False`` with TP-SP gave vocab-split logits, both grids)."""
    s_local = SEQ // GRIDS[grid]["size"]
    for rank, got in enumerate(per_rank):
        for tp_sp, loss in SETTINGS:
            layout = got[grid, tp_sp, str(loss)]["layout"]
            if _expected_split(tp_sp, loss):
                assert layout[0] and layout[2], (rank, tp_sp, loss, layout)
                assert layout[1] == (2, s_local, 27 if rank % 2 == 0 else 26), (rank, tp_sp, loss, layout)
            else:
                assert layout == (False, (2, s_local, VOCAB), None), (rank, tp_sp, loss, layout)
    for tp_sp, loss in SETTINGS:  # one loss everywhere
        assert len({round(got[grid, tp_sp, str(loss)]["loss"], 6) for got in per_rank}) == 1


def test_refusals_name_the_setting_on_every_rank(per_rank) -> None:
    """``tp_loss_parallel`` false with the tiled loss, a value that is not true / false / "auto", and true on a
    plan with no LM head to split: each refused on every rank, naming the key and the fix. Seen failing:
    without the head check in ``apply_tensor_parallel`` (``no_head`` None: the run went on with no head split)."""
    for got in per_rank:
        r = got["refusals"]
        assert r["tiled_gathered"] and "tp_loss_parallel = False" in r["tiled_gathered"], r
        assert "tiled_loss" in r["tiled_gathered"] and "ConfigError" in r["tiled_gathered"], r
        assert r["bad_value"] and "tp_loss_parallel = 'yes'" in r["bad_value"] and '"auto"' in r["bad_value"], r
        assert r["no_head"] and "tp_loss_parallel" in r["no_head"] and "colwise_gather_output" in r["no_head"], r
        assert r["no_head_auto_ok"], r


def test_config_key_checked_without_processes() -> None:
    """The key's own checks, at load time: the default keeps today's layout (``"auto"``), ``true`` needs
    ``tp_size`` > 1, other values are refused naming the choices."""
    from seqpar.config import ConfigError, SeqParConfig

    assert SeqParConfig.from_dict({}).tp_loss_parallel == "auto"
    assert SeqParConfig.from_dict({"tp_size": 2, "tp_loss_parallel": True}).tp_loss_parallel is True
    assert SeqParConfig.from_dict({"tp_loss_parallel": False}).tp_loss_parallel is False  # TP 1: gathered anyway
    with pytest.raises(ConfigError, match="tp_loss_parallel = True is invalid: .*set tp_size > 1"):
        SeqParConfig.from_dict({"tp_loss_parallel": True})
    for bad in (1, 0, "true", None):
        with pytest.raises(ConfigError, match=r"tp_loss_parallel = .* is invalid: expected true, false or \"auto\""):
            SeqParConfig.from_dict({"tp_size": 2, "tp_loss_parallel": bad})
    with pytest.raises(ConfigError, match="tiled_loss under TP"):
        SeqParConfig.from_dict({"tp_size": 2, "tiled_loss": True, "tp_loss_parallel": False})
    SeqParConfig.from_dict({"tp_size": 2, "tiled_loss": True, "tp_loss_parallel": True})
