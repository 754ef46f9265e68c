"""A memory-lean RMSNorm for Hugging Face decoders of the Llama family: ``recompute_norm``.

Why: in low precision, a Hugging Face RMSNorm keeps three tensors of the hidden states' size alive
for backward per call: the fp32 upcast of its input (saved by ``pow`` and by the multiplication by
the reciprocal RMS: two bf16 units), the normalised value in the input dtype (saved by the
multiplication by the weight: one unit), besides its output, which the next projection saves anyway.
Two norms per layer make that 6 of the ~11 hidden-sized units a recomputed layer holds with the
tiled MLP (measured by ``python -m seqpar.bench.layer_memory``).

:func:`lean_rms_norm` computes the same forward with the same operations in the same order (so the
output is bitwise that of the module it replaces), saves only its input (which is usually alive
anyway: the layer's input, or the residual sum), and recomputes the norm in backward. Both run over
chunks of rows (at most ~64 MiB of fp32 and an eighth of the rows each), so that the fp32 copies
stay small. The input's gradient goes through autograd of the same row-wise operations (bitwise
the module's); the weight's is summed over the chunks in fp32 (the module sums products already
rounded to the input dtype, so this is at least as accurate; fp32: equal to rounding).

Two formulas, as in transformers 5.x:

- Llama / Qwen2 / Mistral / Phi3: ``weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)``;
- Gemma: ``(x.float() * rsqrt(mean(x.float()^2) + eps) * (1 + weight.float())).type_as(x)``.

:func:`apply_recompute_norm` swaps the forward of every such norm inside a causal LM (the module
objects, their parameters and hooks stay as they are, so the engines see no difference); a norm
class it does not know is refused, naming the module.
"""

from __future__ import annotations

import math
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


def _llama_normed(x: Tensor, eps: float) -> Tensor:
    # LlamaRMSNorm.forward up to the weight, with its exact operations
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return h.to(input_dtype)


def _llama_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return weight * _llama_normed(x, eps)  # bitwise LlamaRMSNorm.forward


def _gemma_normed(x: Tensor, eps: float) -> Tensor:
    # GemmaRMSNorm.forward up to the weight (fp32)
    h = x.float()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


def _gemma_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    out = _gemma_normed(x, eps) * (1.0 + weight.float())
    return out.type_as(x)  # bitwise GemmaRMSNorm.forward


_FORMULAS: dict[str, Callable[[Tensor, Tensor, float], Tensor]] = {"llama": _llama_norm, "gemma": _gemma_norm}
_NORMED: dict[str, Callable[[Tensor, float], Tensor]] = {"llama": _llama_normed, "gemma": _gemma_normed}

# rows per chunk: at most about 64 MiB of one fp32 row-chunk and at most an eighth of the rows, so
# the recompute's fp32 copies stay small beside the layer's saved tensors at any sequence length
_CHUNK_BYTES = 64 * 2**20
_MIN_CHUNKS = 8


def _chunk_rows(rows: int, hidden: int) -> int:
    return max(1, min(_CHUNK_BYTES // (4 * hidden), math.ceil(rows / _MIN_CHUNKS)))


def _weight_grad_input(formula: str, grad: Tensor, weight: Tensor) -> Tensor:
    """The gradient reaching the normalised value, as autograd computes it through the weight:
    ``weight * n`` (Llama: ``grad * weight``, cast to n's dtype) or ``(n * (1 + weight.float())).type_as(x)``
    (Gemma: the fp32 gradient times ``1 + weight``)."""
    if formula == "llama":
        return grad * weight
    return grad.float() * (1.0 + weight.float())


def _chunked_forward(fn: Callable[[Tensor, Tensor, float], Tensor], x: Tensor, weight: Tensor, eps: float,
                     chunk_rows: int) -> Tensor:
    """``fn`` over row chunks into one output (row-wise: bitwise the same), so that its fp32
    temporaries are one chunk's, not the whole input's."""
    rows, hidden = x.numel() // x.shape[-1], x.shape[-1]
    if rows <= chunk_rows:
        return fn(x, weight, eps)
    x_2d = x.reshape(rows, hidden)
    first = fn(x_2d[:chunk_rows], weight, eps)
    out = torch.empty((rows, hidden), dtype=first.dtype, device=first.device)
    out[:chunk_rows] = first
    del first
    for start in range(chunk_rows, rows, chunk_rows):
        out[start:start + chunk_rows] = fn(x_2d[start:start + chunk_rows], weight, eps)
    return out.view(*x.shape[:-1], hidden)


class _LeanRMSNorm(torch.autograd.Function):
    """Forward without autograd over row chunks, saving only the input; backward recomputes the norm
    over row chunks: ``dx`` through autograd of the same operations (row-wise: bitwise the module's), the
    weight's gradient summed over chunks in fp32 (the module sums ``grad * n`` products rounded to
    the input dtype: this is at least as accurate)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float, formula: str,  # type: ignore[override]
                chunk_rows: int | None) -> Tensor:
        chunk_rows = chunk_rows or _chunk_rows(x.numel() // x.shape[-1], x.shape[-1])
        out = _chunked_forward(_FORMULAS[formula], x, weight, eps, chunk_rows)
        ctx.save_for_backward(x)
        # the weight as an attribute, not a saved tensor: ZeRO-3 / FSDP2 refill parameter storages
        # between forward and backward (as for the tiled MLP)
        ctx.weight, ctx.eps, ctx.formula = weight, eps, formula
        ctx.chunk_rows = chunk_rows
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        weight, formula = ctx.weight, ctx.formula
        want_x, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        x_2d = x.detach().reshape(-1, x.shape[-1])  # (rows, hidden): the norm is row-wise
        g_2d = grad_out.reshape(-1, x.shape[-1])
        dx = torch.empty_like(x_2d) if want_x else None
        acc = torch.promote_types(torch.promote_types(x.dtype, weight.dtype), torch.float32)  # fp32 or fp64
        dw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if want_w else None
        w = weight.detach()
        for start in range(0, x_2d.shape[0], ctx.chunk_rows):
            sl = slice(start, start + ctx.chunk_rows)
            x_c = x_2d[sl].detach().requires_grad_(want_x)
            with torch.enable_grad():
                n = _NORMED[formula](x_c, ctx.eps)
            if want_w:
                prod = g_2d[sl].to(acc, copy=True).mul_(n.detach())  # one fp32 chunk, not three
                dw += prod.sum(0)
                del prod
            if want_x:
                dn = _weight_grad_input(formula, g_2d[sl], w).to(n.dtype)
                dx[sl] = torch.autograd.grad(n, x_c, dn)[0]
            del n
        return (dx.view_as(x) if want_x else None, dw.to(weight.dtype) if want_w else None, None, None, None)


def lean_rms_norm(x: Tensor, weight: Tensor, eps: float, formula: str = "llama",
                  chunk_rows: int | None = None) -> Tensor:
    """RMSNorm over the last dimension that saves only ``x`` for backward.

    Args:
        x: ``(..., hidden)`` in any dtype, e.g. ``(batch, seq_local, hidden)``.
        weight: ``(hidden,)``.
        eps: added to the mean square.
        formula: ``"llama"`` (Llama, Qwen2, Mistral, Phi3) or ``"gemma"`` (``1 + weight``, scaled in fp32).
        chunk_rows: rows per chunk (default: at most ~64 MiB of fp32 and an eighth of the rows).

    Returns:
        Bitwise the output of the Hugging Face module of that formula; ``dx`` bitwise its autograd's,
        the weight's gradient summed in fp32.
    """
    if formula not in _FORMULAS:
        raise ValueError(f"formula={formula!r}: choose one of {list(_FORMULAS)}")
    return _LeanRMSNorm.apply(x, weight, eps, formula, chunk_rows)


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
        return _LeanRMSNorm.apply(hidden_states, self.weight, _eps_of(self), formula, None)

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
