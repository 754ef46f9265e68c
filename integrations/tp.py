"""Tensor parallelism for Hugging Face models, from the model's own plan, on seqpar's ``"tp"`` mesh dim.

transformers (5.24) carries each model's tensor-parallel plan (``config.base_model_tp_plan``, plus the
head's entries: ``model.tp_plan``, e.g. Llama's ``q/k/v/gate/up_proj -> "colwise"``,
``o/down_proj -> "rowwise"``, ``lm_head -> "colwise_gather_output"``) and applies it with its own
DTensor styles (``transformers.distributed.tensor_parallel.apply_tensor_parallelism``): this module
expands the plan's ``*`` layer wildcards to the model's module names and hands it, with the manager's
TP sub-mesh (``manager.dp_sp_tp_mesh["tp"]``, whose ``"dp_sp"`` dim FSDP2 shards over), to that
function. Nothing here re-implements a style.

Only the styles checked against one process (tests/test_tp_train.py) are accepted; any other style in
a plan is refused by name, before anything is sharded. ``replicated_with_grad_allreduce`` (Qwen3's
``q_norm`` / ``k_norm``, which see only the rank's heads) is transformers' own: it sums the weight's
gradient over the TP group in a post-accumulate hook. torch's plain ``parallelize_module`` has no such
style and would leave those gradients per-rank partial sums.

Torch 2.13 caches DTensor sharding plans keyed by meshes that compare equal when they cover the same
ranks, whatever their process groups: ``ProcessGroupManager.destroy`` drops those plans, so a later
manager of the same layout in the same process is not handed the destroyed groups.

Layering: an integration (``seqpar.integrations.tp``); it imports the core, the core never imports it.
Sequence parallelism composes with it unchanged: the attention inputs a TP rank sees are
``(batch, heads / tp, seq_local, head_dim)``, and seqpar's attention runs on them over the SP group.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn as nn

from seqpar.runtime.groups import ProcessGroupManager, default_manager, tp_heads_problem

__all__ = ["SUPPORTED_STYLES", "expand_tp_plan", "apply_tensor_parallel", "clip_grad_norm"]

SUPPORTED_STYLES = (
    "colwise",  # weight Shard(0): output features split, input replicated
    "rowwise",  # weight Shard(1): input features split, output all-reduced
    "colwise_gather_output",  # the LM head: output gathered (replicated logits)
    "embedding_rowwise",  # vocab-parallel embedding: partial lookups summed
    "replicated_with_grad_allreduce",  # per-head norms (Qwen3 q_norm/k_norm): gradient summed over TP
)
"""The transformers tensor-parallel styles seqpar applies (each checked against one process)."""


def expand_tp_plan(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """``plan`` (names with ``*`` for layer numbers, as transformers writes them) as the model's own module
    and parameter names: ``{"model.layers.0.self_attn.q_proj.weight": "colwise",
    "model.layers.0.self_attn.q_proj": "colwise", ...}`` (a parameter entry shards it, a module entry
    hooks the module's forward).

    Raises:
        ValueError: a style outside :data:`SUPPORTED_STYLES`, naming the style and its plan entry.
    """
    from transformers.distributed.parallel_utils import replace_layer_number_by_wildcard

    for key, style in plan.items():
        if style not in SUPPORTED_STYLES:
            raise ValueError(
                f"tensor parallelism: the model's tp plan maps {key!r} to style {style!r}, which seqpar does not "
                f"apply yet (supported: {list(SUPPORTED_STYLES)}); pass plan= without it, or run tp_size 1"
            )
    expanded: dict[str, str] = {}
    for module_name, module in model.named_modules():
        module_style = plan.get(replace_layer_number_by_wildcard(module_name)) if module_name else None
        # a module's own parameters first (sharded by its style, or by their own entry), then the module
        # (hooked): transformers' order (PreTrainedModel._expand_parallel_plan)
        for param_name, _ in module.named_parameters(recurse=False):
            name = f"{module_name}.{param_name}" if module_name else param_name
            style = plan.get(replace_layer_number_by_wildcard(name), module_style)
            if style is not None:
                expanded[name] = style
        if module_style is not None:
            expanded[module_name] = module_style
    return expanded


def apply_tensor_parallel(
    model: nn.Module, manager: ProcessGroupManager | None = None, *, plan: dict[str, str] | None = None,
) -> dict[str, str]:
    """Shard ``model`` over the manager's TP group with transformers' own styles, in place; return the
    expanded plan applied (empty when ``tp_size`` is 1: nothing changes).

    Call it on every rank of the TP group with the same model (same seed: each rank keeps its slice of
    the weights it already holds, so no weight is sent), before FSDP2 and the optimizer
    (:func:`seqpar.integrations.fsdp.wrap` calls it when ``tp_size`` > 1). Sharded parameters become
    DTensors on ``manager.dp_sp_tp_mesh["tp"]``; replicated ones stay plain tensors.

    Args:
        model: a transformers ``PreTrainedModel`` (anything with ``tp_plan``, or pass ``plan``).
        manager: the groups (default: :func:`seqpar.runtime.groups.default_manager`).
        plan: overrides ``model.tp_plan`` (transformers' own: ``base_model_tp_plan`` plus the head).

    Raises:
        ValueError: no manager; a model without a plan; head counts TP cannot split; an unsupported style.
    """
    manager = manager if manager is not None else default_manager()
    if manager is None:
        raise ValueError("apply_tensor_parallel needs the process groups: call seqpar.init_process_groups("
                         "tp_size=...) first or pass manager=")
    if manager.tp_size == 1:
        return {}
    if plan is None:
        plan = dict(getattr(model, "tp_plan", None) or {})
    if not plan:
        raise ValueError(
            f"tensor parallelism: {type(model).__name__} has no tensor-parallel plan (config.base_model_tp_plan); "
            "pass plan={module name pattern: style} or run tp_size 1"
        )
    config: Any = getattr(model, "config", None)
    if config is not None and hasattr(config, "num_attention_heads"):
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        if problem := tp_heads_problem(heads, kv_heads, manager.tp_size):
            raise ValueError(f"tensor parallelism: {problem}")
    expanded = expand_tp_plan(model, plan)
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    # the "tp" dim of the (dp x sp, tp) mesh, so FSDP2 can shard the same DTensors over "dp_sp"
    apply_tensor_parallelism(model, manager.dp_sp_tp_mesh["tp"], expanded)
    return expanded


def clip_grad_norm(parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for gradients that are DTensors on different meshes (FSDP2 x TP:
    the TP-sharded ones on ``(dp_sp, tp)``, the replicated ones on ``dp_sp``), which torch's own refuses
    to stack. The 2-norm of each mesh's gradients (``get_total_norm``: reduced over that mesh, then a
    plain tensor by ``full_tensor``) is squared, the squares are summed, and every gradient is scaled by ``min(1, max_norm / (norm + 1e-6))``,
    as torch does. Returns the total norm (a plain tensor, the same on every rank)."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in parameters if p.grad is not None]
    by_mesh: dict[Any, list[torch.Tensor]] = {}
    for g in grads:
        by_mesh.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    squares = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(group)
        squares.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).float() ** 2)
    total = torch.stack(squares).sum().sqrt() if squares else torch.zeros(())
    coef = min(1.0, max_norm / (total.item() + 1e-6))
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return total
