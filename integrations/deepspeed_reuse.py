"""Under DeepSpeed ZeRO-2/3 with reentrant activation checkpointing, a parameter used twice in one forward (at least
once inside a checkpointed call) has its gradient computed twice in one backward: :func:`refuse_reentrant_reuse`
refuses it by name, in the forward, on every rank. A step of :func:`seqpar.integrations.deepspeed.initialize`
(which calls it for ZeRO-2 and ZeRO-3), kept apart because it reads transformers' checkpointing, not DeepSpeed."""

from __future__ import annotations

from typing import Any

import torch

from seqpar.config import ConfigError

__all__ = ["refuse_reentrant_reuse"]


def _reentrant(module: torch.nn.Module) -> bool:
    """Whether transformers checkpoints ``module`` (a ``GradientCheckpointingLayer``) reentrantly now: only in
    training (``GradientCheckpointingLayer`` runs an eval-mode layer as is, even with grad enabled)."""
    func = getattr(module, "_gradient_checkpointing_func", None)
    return module.training and bool(getattr(module, "gradient_checkpointing", False)) and bool(
        getattr(func, "keywords", {}).get("use_reentrant", True))


def _outermost_checkpoint_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """transformers' ``GradientCheckpointingLayer``s of ``model`` that no other one contains."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # no transformers: no transformers checkpointing
        return []
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, GradientCheckpointingLayer)]
    names = {name for name, _ in layers}
    return [(name, m) for name, m in layers if not any(name.startswith(f"{other}.") for other in names)]


def refuse_reentrant_reuse(model: torch.nn.Module, stage: int) -> None:
    """Refuse, by name in the forward, a parameter that two reentrantly checkpointed calls use in one forward.

    Under reentrant checkpointing each checkpointed call's recompute runs a backward of its own, so a parameter
    two such calls use has its gradient accumulated, and ZeRO-2/3's per-parameter reduction hook fired, twice in
    one backward (DeepSpeed's "Gradient computed twice"). Two shapes of it were found: a block several layers hold
    (Zamba's shared transformer block, fuzzer case 1789442528) and a layer one forward calls more than once
    (Dory's looped layers, 1601891524); both are this one rule.

    Counted per forward of ``model``, over the outermost transformers ``GradientCheckpointingLayer`` calls that
    checkpoint reentrantly (read at each call: checkpointing may be enabled after ``initialize``); a call holds
    every parameter of its layer. The count lives in a closure, started by the model's forward pre-hook and
    dropped by its forward hook (``always_call``, so also after an error): two forwards before one backward each
    count their own calls. Recomputes in the backward run the layers' ``forward`` inside the checkpoint, without
    module hooks, and outside the model's forward, and are not counted. The count is the model's structure, the
    same on every rank, so every rank raises at the same call, before that call's collectives.

    A third shape is the same rule: a parameter one reentrant call uses and a module outside every checkpointed
    call uses too (a Linear held by layer 0 and called again by the model after the layers): the recompute's
    backward and the outer backward each accumulate its gradient (ZeRO-2's "Gradient computed twice", ZeRO-3's
    bare AssertionError; tests/test_deepspeed_tied_reentrant.py). Such uses are counted by a pre-hook on each module
    reachable without entering a checkpointed layer that holds one of a layer's parameters, at calls with grad
    enabled (torch's reentrant checkpoint runs its forward without grad, so calls inside a reentrant layer are that
    layer's). Tied input / output embeddings used outside the layers only are one outer backward: not refused.
    """
    layers = _outermost_checkpoint_layers(model)
    if not layers:
        return
    outside = "outside every checkpointed layer"
    # id(parameter) -> (its name, the layer whose call used it first, or `outside`) in the running forward; None
    # outside one
    frame: dict[str, dict[int, tuple[str, str]] | None] = {"used": None}

    def start(module: torch.nn.Module, args: Any) -> None:
        # a forward without grad (torch.no_grad, inference) has no backward: nothing is reduced, nothing counted
        frame["used"] = {} if torch.is_grad_enabled() else None

    def stop(module: torch.nn.Module, args: Any, output: Any) -> None:
        frame["used"] = None

    def count(name: str) -> Any:
        def hook(module: torch.nn.Module, args: Any) -> None:
            # not torch.is_grad_enabled() here: transformers 5.17 runs a layer's hooks inside its reentrant checkpoint,
            # without grad (5.24 checkpoints forward only), so that check let every reuse through on 5.17
            used = frame["used"]
            if used is None or not _reentrant(module):
                return
            for pname, p in module.named_parameters():
                first = used.get(id(p))
                if first is None:
                    used[id(p)] = (f"{name}.{pname}", name)
                    continue
                what = (f"its forward calls the checkpointed layer {name} more than once, a looped or recurrent "
                        "layer") if first[1] == name else (
                        f"the checkpointed layers {first[1]} and {name} both use it, a block shared across layers "
                        "as Zamba's shared transformer is") if first[1] != outside else (
                        f"the checkpointed layer {name} uses it and so does a module {outside}, e.g. a shared Linear")
                raise ConfigError(_reuse_message(model, stage, first[0], what))
        return hook

    def count_outside(name: str) -> Any:
        def hook(module: torch.nn.Module, args: Any) -> None:
            # inside a reentrant call grad is off (torch's reentrant checkpoint runs the forward without it): that
            # call's layer hook counted the use; a non-reentrant layer's call is the outer graph's, an outside use
            used = frame["used"]
            if used is None or not torch.is_grad_enabled():
                return
            for pname, p in module.named_parameters(recurse=False):
                first = used.get(id(p))
                if first is None:
                    used[id(p)] = (f"{name}.{pname}", outside)
                elif first[1] != outside:
                    raise ConfigError(_reuse_message(model, stage, first[0], (
                        f"the checkpointed layer {first[1]} uses it and so does a module {outside}, e.g. a shared "
                        "Linear")))
        return hook

    model.register_forward_pre_hook(start)
    model.register_forward_hook(stop, always_call=True)
    for name, layer in layers:
        layer.register_forward_pre_hook(count(name))
    # the modules reachable without entering a checkpointed layer that hold one of its parameters (a module shared
    # with a layer, or tied to one of its modules); none in most models, so nothing else is hooked
    in_layers = {id(p) for _, layer in layers for p in layer.parameters()}
    layer_ids = {id(layer) for _, layer in layers}
    seen, stack = set(), [("", model)]
    while stack:
        name, module = stack.pop()
        if id(module) in layer_ids or id(module) in seen:
            continue
        seen.add(id(module))
        if any(id(p) in in_layers for p in module.parameters(recurse=False)):
            module.register_forward_pre_hook(count_outside(name))
        stack += [(f"{name}.{child_name}" if name else child_name, child) for child_name, child in module.named_children()]


def _reuse_message(model: torch.nn.Module, stage: int, param: str, what: str) -> str:
    """The refusal of :func:`refuse_reentrant_reuse`: ``param`` used twice in one forward, ``what`` says how."""
    return (
        f"DeepSpeed ZeRO-{stage} with reentrant activation checkpointing cannot train {type(model).__name__}: the "
        f"parameter {param} is used twice in one forward, at least once inside a checkpointed call ({what}), so each "
        "recompute computes its gradient again in one backward and DeepSpeed's reduction hook fires twice ('Gradient "
        "computed twice'). Enable non-reentrant checkpointing (model.gradient_checkpointing_enable("
        "gradient_checkpointing_kwargs={'use_reentrant': False})), or use ZeRO-1 or FSDP2"
    )
