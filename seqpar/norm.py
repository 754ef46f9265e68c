"""A memory-lean RMSNorm for Hugging Face decoders of the Llama family: ``recompute_norm``.

Why: in low precision, a Hugging Face RMSNorm keeps three tensors of the hidden states' size alive
for backward per call: the fp32 upcast of its input (saved by ``pow`` and by the multiplication by
the reciprocal RMS: two bf16 units), the normalised value in the input dtype (saved by the
multiplication by the weight: one unit), besides its output, which the next projection saves anyway.
Two norms per layer make that ~6 of the ~15 hidden-sized units a recomputed layer holds.

:class:`LeanRMSNorm` computes the same forward with the same operations in the same order (so the
output is bitwise that of the module it replaces), saves only its input (which is usually alive
anyway: the layer's input, or the residual sum), and recomputes the norm in backward, one call at a
time, to differentiate it with autograd. The gradients are therefore those of the Hugging Face
module (the same operations run in backward), and the recompute's fp32 transients live only during
that norm's own backward.

Two formulas, as in transformers 5.x:

- Llama / Qwen2 / Mistral / Phi3: ``weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)``;
- Gemma: ``(x.float() * rsqrt(mean(x.float()^2) + eps) * (1 + weight.float())).type_as(x)``.

:func:`apply_recompute_norm` swaps the forward of every such norm inside a causal LM (the module
objects, their parameters and hooks stay as they are, so the engines see no difference); a norm
class it does not know is refused, naming the module.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch
from torch import Tensor, nn

__all__ = ["NormError", "LLAMA_NORM_CLASSES", "GEMMA_NORM_CLASSES", "lean_rms_norm", "apply_recompute_norm",
           "norm_problems"]

# Checked against transformers 5.x modeling files: the formula each class computes.
LLAMA_NORM_CLASSES = ("LlamaRMSNorm", "Qwen2RMSNorm", "MistralRMSNorm", "Phi3RMSNorm")
GEMMA_NORM_CLASSES = ("GemmaRMSNorm",)


class NormError(ValueError):
    """A norm module cannot be made lean exactly; the message names the module and the fix."""


def _llama_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    # the exact operations of LlamaRMSNorm.forward (bitwise-identical output)
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(input_dtype)


def _gemma_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    # the exact operations of GemmaRMSNorm.forward
    h = x.float()
    out = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = out * (1.0 + weight.float())
    return out.type_as(x)


_FORMULAS: dict[str, Callable[[Tensor, Tensor, float], Tensor]] = {"llama": _llama_norm, "gemma": _gemma_norm}


class _LeanRMSNorm(torch.autograd.Function):
    """Forward without autograd; backward recomputes the norm from the saved input."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float, formula: str) -> Tensor:  # type: ignore[override]
        fn = _FORMULAS[formula]
        out = fn(x, weight, eps)  # autograd is off inside a Function's forward: nothing is saved
        ctx.save_for_backward(x)
        # the weight as an attribute, not a saved tensor: ZeRO-3 / FSDP2 refill parameter storages
        # between forward and backward (as for the tiled MLP)
        ctx.weight, ctx.eps, ctx.fn = weight, eps, fn
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        weight = ctx.weight
        want_x, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        x_ = x.detach().requires_grad_(want_x)
        with torch.enable_grad():
            w_ = weight.detach().requires_grad_(want_w)
            out = ctx.fn(x_, w_, ctx.eps)
        inputs = [t for t, want in ((x_, want_x), (w_, want_w)) if want]
        if not inputs:
            return None, None, None, None
        grads = list(torch.autograd.grad(out, inputs, grad_out))
        dx = grads.pop(0) if want_x else None
        dw = grads.pop(0) if want_w else None
        return dx, dw, None, None


def lean_rms_norm(x: Tensor, weight: Tensor, eps: float, formula: str = "llama") -> Tensor:
    """RMSNorm over the last dimension that saves only ``x`` for backward.

    Args:
        x: ``(..., hidden)`` in any dtype, e.g. ``(batch, seq_local, hidden)``.
        weight: ``(hidden,)``.
        eps: added to the mean square.
        formula: ``"llama"`` (Llama, Qwen2, Mistral, Phi3) or ``"gemma"`` (``1 + weight``, scaled in fp32).

    Returns:
        Bitwise the output of the Hugging Face module of that formula; gradients those of its autograd.
    """
    if formula not in _FORMULAS:
        raise ValueError(f"formula={formula!r}: choose one of {list(_FORMULAS)}")
    return _LeanRMSNorm.apply(x, weight, eps, formula)


def _formula_of(module: nn.Module) -> str | None:
    name = type(module).__name__
    return "llama" if name in LLAMA_NORM_CLASSES else "gemma" if name in GEMMA_NORM_CLASSES else None


def _eps_of(module: nn.Module) -> float | None:
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    return float(eps) if isinstance(eps, (int, float)) else None


def _lean_forward(module: nn.Module, formula: str) -> Callable[[Tensor], Tensor]:
    def forward(self: nn.Module, hidden_states: Tensor) -> Tensor:
        if not torch.is_grad_enabled():
            return _FORMULAS[formula](hidden_states, self.weight, _eps_of(self))
        return _LeanRMSNorm.apply(hidden_states, self.weight, _eps_of(self), formula)

    return types.MethodType(forward, module)


def _is_norm(module: nn.Module) -> bool:
    return "norm" in type(module).__name__.lower()


def _scan(model: nn.Module, prefix: str) -> tuple[list[tuple[str, nn.Module, str]], list[str]]:
    """``(name, module, formula)`` of the norms to change, and the problems that stop the change."""
    known = LLAMA_NORM_CLASSES + GEMMA_NORM_CLASSES
    found: list[tuple[str, nn.Module, str]] = []
    problems: list[str] = []
    for name, module in model.named_modules():
        if not _is_norm(module):
            continue
        where = f"'{prefix + name}' ({type(module).__name__})"
        formula = _formula_of(module)
        if formula is None:
            problems.append(f"{where} is not an RMSNorm seqpar knows ({', '.join(known)}): "
                            "recompute_norm cannot replace it exactly")
        elif not isinstance(getattr(module, "weight", None), Tensor) or _eps_of(module) is None:
            problems.append(f"{where} has no weight / epsilon where transformers puts them")
        else:
            found.append((prefix + name, module, formula))
    if not found and not problems:
        problems.append(f"'{prefix.rstrip('.') or type(model).__name__}' has no RMSNorm seqpar knows "
                        f"({', '.join(known)})")
    return found, problems


def norm_problems(model: nn.Module, prefix: str = "") -> list[str]:
    """Why :func:`apply_recompute_norm` would refuse ``model`` (empty: it would not)."""
    return _scan(model, prefix)[1]


def apply_recompute_norm(model: nn.Module, prefix: str = "") -> list[str]:
    """Make every RMSNorm of a Llama-family Hugging Face model lean (:func:`lean_rms_norm`), in place.

    Args:
        model: the causal LM (or any module holding the norms).
        prefix: prepended to the module names in the result and in errors.

    Returns:
        The qualified names of the norms changed (already-lean ones included).

    Raises:
        NormError: naming every norm-like module (class name containing ``Norm``) of a class seqpar
            does not know, or with no ``weight`` / epsilon; nothing is changed then.
    """
    found, problems = _scan(model, prefix)
    if problems:
        raise NormError("seqpar cannot apply sequence_parallel.recompute_norm exactly:\n  - "
                        + "\n  - ".join(problems) + "\nSet \"recompute_norm\": false; nothing was changed.")
    for _, module, formula in found:
        if not getattr(module, "_seqpar_lean_norm", False):
            module.forward = _lean_forward(module, formula)
            module._seqpar_lean_norm = True
    return [name for name, _, _ in found]
