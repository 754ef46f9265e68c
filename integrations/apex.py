"""NVIDIA apex fused kernels where apex is installed (``sequence_parallel.apex: true``); never required.

:func:`apply_fused_norms` replaces ``nn.LayerNorm`` with ``apex.normalization.FusedLayerNorm`` and
RMS norms of the plain ``weight * x / rms(x)`` form (``nn.RMSNorm`` and the Llama / Mistral / Qwen2 /
Qwen3 / Mixtral RMSNorm classes) with ``FusedRMSNorm``, keeping the weights. Norms of another form
(Gemma's ``1 + weight``, LayerNorm without bias) are left alone. Without apex it changes nothing and
says so once in the log. Apply it before wrapping the model in an engine (the integrations do, when
the config asks).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from seqpar.integrations.common import rank_prefix

__all__ = ["apex_available", "apply_fused_norms", "RMS_NORM_CLASSES"]

logger = logging.getLogger("seqpar")

# RMS norms computing ``weight * x * rsqrt(mean(x^2) + eps)`` (in fp32, cast back), as apex does.
RMS_NORM_CLASSES = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MixtralRMSNorm")

_said_absent = False


def _import_apex_normalization() -> Any | None:
    try:
        from apex import normalization  # type: ignore[import-not-found]
    except Exception:  # noqa: BLE001 - apex fails to import in many ways (missing, built wrong)
        return None
    if not (hasattr(normalization, "FusedLayerNorm") and hasattr(normalization, "FusedRMSNorm")):
        return None  # PyPI's unrelated "apex" package, or a very old apex
    return normalization


def apex_available() -> bool:
    """Whether NVIDIA apex's fused norms can be imported."""
    return _import_apex_normalization() is not None


def _replacement(module: nn.Module, fused: Any) -> nn.Module | None:
    """The fused equivalent of ``module`` with its weights, or None when there is none."""
    if isinstance(module, nn.LayerNorm):
        if module.elementwise_affine and module.bias is None:
            return None  # LayerNorm(bias=False): apex has no such variant
        new = fused.FusedLayerNorm(
            module.normalized_shape, eps=module.eps, elementwise_affine=module.elementwise_affine
        )
    elif isinstance(module, getattr(nn, "RMSNorm", ())) or type(module).__name__ in RMS_NORM_CLASSES:
        weight = getattr(module, "weight", None)
        if isinstance(module, getattr(nn, "RMSNorm", ())):
            shape, eps = module.normalized_shape, module.eps
            affine = module.elementwise_affine
        else:
            if not isinstance(weight, torch.Tensor) or not hasattr(module, "variance_epsilon"):
                return None
            shape, eps, affine = tuple(weight.shape), module.variance_epsilon, True
        if eps is None:
            eps = torch.finfo(weight.dtype if weight is not None else torch.float32).eps
        new = fused.FusedRMSNorm(shape, eps=eps, elementwise_affine=affine)
    else:
        return None
    ref = next(iter(module.parameters()), None)
    if ref is not None:
        new = new.to(device=ref.device, dtype=ref.dtype)
        new.load_state_dict(module.state_dict())
    return new


def apply_fused_norms(model: nn.Module, *, normalization: Any | None = None) -> int:
    """Replace the model's norms with apex's fused ones, in place; returns how many were replaced.

    Args:
        model: any module.
        normalization: an ``apex.normalization``-like module (default: imported; for tests).

    Returns:
        The number of replaced modules; 0 when apex is absent (logged once per process).
    """
    global _said_absent
    fused = normalization if normalization is not None else _import_apex_normalization()
    if fused is None:
        if not _said_absent:
            logger.info(
                "%s seqpar: apex requested but NVIDIA apex is not importable; keeping PyTorch norms "
                "(install apex from https://github.com/NVIDIA/apex for fused kernels)", rank_prefix()
            )
            _said_absent = True
        return 0
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            new = _replacement(child, fused)
            if new is not None:
                setattr(parent, name, new)
                replaced += 1
    logger.info("%s seqpar: apex fused norms replaced %d module(s)", rank_prefix(), replaced)
    return replaced
