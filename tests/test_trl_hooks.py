"""GRPO's unsharded generation block (``seqpar.integrations.trl._unsharded``): seqpar's forward hooks set aside
inside it and put back at their places afterwards, pre-hooks as well as post-hooks, on error as well, and the
top models' attention implementation switched for the block and back. One process, a ``Linear``: no trainer."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")


class _Top:
    """Stands in for a top model: records the attention implementations it is given."""

    def __init__(self) -> None:
        self.given: list[str] = []

    def set_attn_implementation(self, name: str) -> None:
        self.given.append(name)


def _hook(calls: list[str], name: str, *, ours: bool, kwargs: bool = False):  # noqa: ANN202
    def pre_kw(module, args, kw):  # noqa: ANN001, ANN202
        calls.append(name)

    def hook(module, *rest):  # noqa: ANN001, ANN202
        calls.append(name)

    fn = pre_kw if kwargs else hook
    fn.__module__ = "seqpar.swap.frame" if ours else "deepspeed.runtime.zero"  # what _unsharded tells apart
    return fn


def test_generation_block_sets_aside_seqpars_pre_and_post_hooks_and_restores_them_in_place_on_error() -> None:
    """A module with hooks of others around seqpar's, before and after its forward (seqpar's pre-hook taking
    kwargs, as seqpar.swap.frame registers it): inside the block only the others run, and the top model runs
    the implementation recorded before the swap; after the block, left by an exception, every hook runs again
    in its registered order, seqpar's pre-hook still given the kwargs, and the top model is back on seqpar's
    implementation.

    Seen failing: only the post-hook dict searched (``(module._forward_pre_hooks, module._forward_hooks)`` ->
    ``(module._forward_hooks,)``: seqpar's pre-hook ran inside the block); seqpar's hooks put back after the
    others instead of at their places (``hooks.update`` of ours at the end: order pre-B before seqpar's);
    the implementation's reset moved out of ``finally`` (after the ``yield``: the exception left the block's
    implementation on)."""
    from seqpar.integrations.trl import _unsharded
    from seqpar.swap.hf_route import ATTN_IMPLEMENTATION

    calls: list[str] = []
    layer = torch.nn.Linear(2, 2)
    handles = [
        layer.register_forward_pre_hook(_hook(calls, "pre-A", ours=False)),
        layer.register_forward_pre_hook(_hook(calls, "pre-seqpar", ours=True, kwargs=True), with_kwargs=True),
        layer.register_forward_pre_hook(_hook(calls, "pre-B", ours=False)),
        layer.register_forward_hook(_hook(calls, "post-C", ours=False)),
        layer.register_forward_hook(_hook(calls, "post-seqpar", ours=True), always_call=True),
        layer.register_forward_hook(_hook(calls, "post-D", ours=False)),
    ]
    everything = ["pre-A", "pre-seqpar", "pre-B", "post-C", "post-seqpar", "post-D"]
    layer(torch.randn(1, 2))
    assert calls == everything, calls
    top = _Top()
    with pytest.raises(RuntimeError, match="generation failed"), _unsharded(layer, [(top, "sdpa")]):
        calls.clear()
        layer(torch.randn(1, 2))
        assert calls == ["pre-A", "pre-B", "post-C", "post-D"], calls  # seqpar's set aside, both kinds
        assert top.given == ["sdpa"]
        raise RuntimeError("generation failed")
    assert top.given == ["sdpa", ATTN_IMPLEMENTATION]
    calls.clear()
    layer(torch.randn(1, 2))
    assert calls == everything, calls
    for handle in handles:
        handle.remove()
    assert not layer._forward_pre_hooks and not layer._forward_hooks
    assert not layer._forward_pre_hooks_with_kwargs and not layer._forward_hooks_always_called


class _Accelerator:
    def unwrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model


class _Trainer:
    """The attributes the kinds' ``after_init`` read before refusing: ``args.sync_ref_model`` and the policy."""

    def __init__(self, model: torch.nn.Module, sync: bool) -> None:
        self.model, self.accelerator = model, _Accelerator()
        self.args = type("Args", (), {"sync_ref_model": sync})()


def _policy(shards: int) -> torch.nn.Module:
    """Two linears, the first ``shards`` of whose parameters look like FSDP2's DTensor shards (``full_tensor``)."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    for p in list(model.parameters())[:shards]:
        p.full_tensor = lambda p=p: p
    return model


@pytest.mark.parametrize("kind", ["DPOLoss", "GRPOLoss"])
def test_sync_ref_model_under_fsdp2_is_refused_by_both_trainer_kinds(kind: str) -> None:
    """TR-DPO's reference update (``sync_ref_model=True``) under seqpar's FSDP2 is refused by DPO's and by GRPO's
    kind (both document it; the 2-process DPO test in test_trl_dpo builds DPOTrainer only), and by any policy
    parameter that is an FSDP2 shard; without the option, or with no shard (DeepSpeed), nothing is refused.

    Seen failing: GRPO's call dropped (``_refuse_sync_under_fsdp2(trainer)`` removed from GRPOLoss.after_init:
    GRPO went on to read its manager); every parameter required to be a shard (``any`` -> ``all``: a policy
    with one parameter left whole by FSDP2's ``ignored_params`` was let through)."""
    from seqpar.config import ConfigError
    from seqpar.integrations import trl as seqpar_trl

    loss = getattr(seqpar_trl, kind)()
    for shards in (4, 1):
        with pytest.raises(ConfigError, match=r"sync_ref_model=True under seqpar's FSDP2.*Set sync_ref_model=False"):
            loss.after_init(_Trainer(_policy(shards), sync=True), swap=lambda model: None)
    for trainer in (_Trainer(_policy(4), sync=False), _Trainer(_policy(0), sync=True)):
        try:  # past the refusal: GRPO's after_init goes on to read what the stand-in lacks (its manager)
            loss.after_init(trainer, swap=lambda model: None)
        except AttributeError as e:
            assert kind == "GRPOLoss" and "seqpar_manager" in str(e), e


def test_hooks_others_change_inside_the_generation_block_stay_as_the_block_left_them() -> None:
    """Under ZeRO-3 TRL's ``unwrap_model_for_generation`` takes DeepSpeed's module hooks off inside the block and
    registers new ones (fuzzer case 845186468): after the block the hooks others removed stay removed, the ones
    they added stay (after the others), and seqpar's are back at their places.
    Seen failing (audit 24): ``hooks.update(now)`` dropped from ``_unsharded``'s ``finally`` (the hook added inside
    the block were gone: ``pre-E`` and ``post-E`` missing, DeepSpeed's parameter left "active in submodules" in the fuzzer case)."""
    from seqpar.integrations.trl import _unsharded

    calls: list[str] = []
    layer = torch.nn.Linear(2, 2)
    removed = layer.register_forward_pre_hook(_hook(calls, "pre-A", ours=False))
    layer.register_forward_pre_hook(_hook(calls, "pre-seqpar", ours=True))
    layer.register_forward_hook(_hook(calls, "post-C", ours=False))
    layer.register_forward_hook(_hook(calls, "post-seqpar", ours=True))
    with _unsharded(layer, []):
        removed.remove()  # DeepSpeed's hook taken off ...
        layer.register_forward_pre_hook(_hook(calls, "pre-E", ours=False))  # ... and new ones registered
        layer.register_forward_hook(_hook(calls, "post-E", ours=False))
        layer(torch.randn(1, 2))
        assert calls == ["pre-E", "post-C", "post-E"], calls
    calls.clear()
    layer(torch.randn(1, 2))
    assert calls == ["pre-seqpar", "pre-E", "post-C", "post-seqpar", "post-E"], calls
