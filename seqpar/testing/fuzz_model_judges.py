"""The ``model`` kind's verdicts (:mod:`seqpar.testing.fuzz_models`), also the ``engine``, ``dynamic``, ``trainer``
and ``compile`` kinds': :func:`judge_model`, exact against the one-process float64 reference, and the judges of a
``dkv_wire_dtype: "bf16"`` run at the wire's derived bound (:func:`dkv_wire_bound` against the same run at the fp32
wire, :func:`kind_dkv_wire_bound` against the reference). A run's result is ``{"loss", "grads"}`` (rank 0's, the
gradients summed over the SP ranks); a verdict is ``("exact" | "WRONG", detail)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["judge_model", "dkv_wire_bound", "judge_dkv_wire", "decoder_layers", "kind_dkv_wire_bound",
           "judge_model_wire"]

_TOL = {"float64": (1e-4, 1e-8), "float32": (2e-3, 1e-5)}
"""Per reference dtype, ``(tol, floor)``: the loss's relative tolerance and each gradient's (of its own max|g_ref|);
``floor`` adds that share of the model's largest max|g_ref| to every gradient's allowance (:func:`judge_model`)."""


_BF16_UNIT_ROUNDOFF = 2.0 ** -8  # bf16 keeps 8 significant bits: round-to-nearest is off by at most 2**-8 relative
_DKV_WIRE_CONDITIONING = 4.0  # the backward's linear maps from a layer's dK/dV to a weight gradient (see below)
_DKV_WIRE_CAP = 0.5  # never a bound that a factor of 2 in dK/dV (an error of 100% of a gradient's norm) could pass


def dkv_wire_bound(draws: dict[str, Any], layers: int) -> float:
    """The norm-relative bound of each parameter gradient of a ``dkv_wire_dtype: "bf16"`` run against the same run
    with the wire at ``"fp32"`` (``layers``: the model's decoder layers, each with at most one ring attention).

    Why: in the ring backward a block's dK/dV accumulator is rounded to bf16 once per hop (the receiver adds its own
    share in fp32 and rounds once when it stores; :func:`seqpar.attn.common.dkv_wire_dtype`), and it makes at most
    ``h`` hops, ``h = P - 1`` on a ring (``P / u - 1`` on hybrid's ring of ``P / u`` ranks, ``P - 1`` under ``auto``,
    whose choice the driver does not see). With the unit roundoff ``u = 2**-8``, each rounding is off by at most ``u``
    of the accumulator, so one layer's dK and dV are off by at most ``h u`` of their partial sums; the attention
    kind's judge, at ``4 (P - 1) 2**-9 = 2 h u`` of dk/dv's scale, allows the factor of 2 for partial sums above
    the final value (tests/test_dkv_wire.py, docs/configuration.md: 1.4e-3 measured at P = 4, S = 4096). A weight
    gradient is a linear map of every layer's dK/dV above it (the K/V projections' of their own layer's, the
    layers below of all those above), so the errors of the ``layers`` layers add: ``layers * 2 h u``, times
    :data:`_DKV_WIRE_CONDITIONING` = 4 for those maps, which are not isometries (a norm, not a max, so that a
    gradient summed over tokens is not judged by one element of it). Capped at :data:`_DKV_WIRE_CAP`: a bound of
    0.5 of a gradient's norm still calls doubling dK or dV WRONG (fz31's break: dk doubled on the bf16 path gives
    the K projections' gradients off by about 100% of their norm)."""
    world, mode = draws["world"], draws["mode"]
    hops = world // draws["ulysses_size"] - 1 if mode == "hybrid" else world - 1
    return min(_DKV_WIRE_CAP, _DKV_WIRE_CONDITIONING * max(layers, 1) * 2 * hops * _BF16_UNIT_ROUNDOFF)


def _decoder_layers(model_type: str) -> int:
    from seqpar.testing.tiny_models import tiny_config

    config = tiny_config(model_type)
    return int(getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None) or 4)


def judge_dkv_wire(draws: dict[str, Any], ref: dict[str, Any], fp32_wire: dict[str, Any], bf16_wire: dict[str, Any]
                   ) -> tuple[str, str]:
    """``("exact" | "WRONG", detail)`` of a ``dkv_wire_dtype: "bf16"`` run (rank 0's ``{"loss", "grads"}``) against
    the same run with the wire at ``"fp32"``: the loss within the exact tolerance of ``ref["dtype"]`` (the wire is the
    backward's; the forward must not move), the same parameters with gradients, each gradient within
    :func:`dkv_wire_bound` of its own norm, plus the exact tolerance (``tol`` of its own norm, ``floor`` of the
    model's largest gradient norm). The bound is applied to every parameter: the driver does not know which ones sit
    above every ring attention (the LM head, the last norm), where the two runs agree to the last bit anyway."""
    tol, floor = _TOL[ref["dtype"]]
    base = fp32_wire["loss"]
    loss_rel = abs(bf16_wire["loss"] - base) / max(abs(base), 1e-30)
    if not loss_rel <= tol:
        return "WRONG", f"dkv_wire_dtype=bf16: loss off the fp32-wire run's by {loss_rel:.1e} relative (tol {tol:.0e})"
    a, b = fp32_wire["grads"], bf16_wire["grads"]
    missing = sorted(set(a) ^ set(b))
    if missing:
        return "WRONG", f"dkv_wire_dtype=bf16: gradients present in one run only: {missing[:4]}"
    bound = dkv_wire_bound(draws, _decoder_layers(draws["model_type"]))
    model_norm = max((float(g.double().norm()) for g in a.values() if g.numel()), default=0.0)

    def measure(g: Any, g_bf16: Any) -> tuple[float, float, float]:
        own = float(g.double().norm())
        return float((g_bf16.double() - g.double()).norm()), own, bound * own + tol * own + floor * model_norm

    within, name, rel = _worst_gradient(a, b, measure)
    if not within:
        return "WRONG", (f"dkv_wire_dtype=bf16: grad {name} off the fp32-wire run's by {rel:.1e} "
                         f"of its norm (bound {bound:.1e}); loss rel {loss_rel:.1e}")
    return "exact", f"dkv=bf16 within {bound:.1e}: worst grad {name} {rel:.1e} of its norm"


def decoder_layers(model_type: str) -> int:
    """The decoder layers of the tiny ``model_type`` (each with at most one ring attention)."""
    return _decoder_layers(model_type)


def kind_dkv_wire_bound(sp: int, layers: int) -> float:
    """The norm-relative bound of each gradient of a ``dkv_wire_dtype: "bf16"`` run on SP groups of at most ``sp``
    ranks against one process in float64: :func:`dkv_wire_bound`'s rule (``4 * layers * 2 * hops * 2**-8``, capped at
    0.5) with ``hops = sp - 1``, the ring's, an upper bound of the hops of hybrid's ring of ``sp / u`` ranks and of
    the dynamic kind's planned groups (smaller than ``sp`` now and then, which the driver does not follow). 0 at
    ``sp = 1``: no hop, the wire is never used, and the run must be exact."""
    return min(_DKV_WIRE_CAP, _DKV_WIRE_CONDITIONING * max(layers, 1) * 2 * max(sp - 1, 0) * _BF16_UNIT_ROUNDOFF)


def judge_model_wire(ref: dict[str, Any], got: dict[str, Any], bound: float) -> tuple[str, str]:
    """``("exact" | "WRONG", detail)`` of a ``dkv_wire_dtype: "bf16"`` run (``{"loss", "grads"}``, as
    :func:`judge_model` takes) against the one-process reference ``ref``: the loss within the exact tolerance (the wire
    is the backward's: the forward must not move), the same parameters with gradients, and each gradient ``g`` within
    ``bound`` (:func:`kind_dkv_wire_bound`) of its reference's norm plus the exact judge's own allowance in norm:
    ``|g - g_ref| <= bound |g_ref| + sqrt(n) (tol max|g_ref| + floor max|g_ref| over the model)`` (a gradient
    :func:`judge_model` passes passes here too). ``bound`` 0 (no hop): :func:`judge_model` itself."""
    if bound <= 0:
        return judge_model(ref, got)
    tol, floor = _TOL[ref["dtype"]]
    wrong, loss_rel, model_max = _loss_and_gradient_names(ref, got, tol, "dkv_wire_dtype=bf16: ",
                                                          "; the wire is the backward's")
    if wrong is not None:
        return wrong

    def measure(g_ref: Any, g: Any) -> tuple[float, float, float]:
        g_ref = g_ref.double()
        own = float(g_ref.norm())
        allowance = bound * own + g_ref.numel() ** 0.5 * (tol * float(g_ref.abs().max()) + floor * model_max)
        return float((g.double() - g_ref).norm()), own, allowance

    within, name, rel = _worst_gradient(ref["grads"], got["grads"], measure)
    if not within:
        return "WRONG", (f"dkv_wire_dtype=bf16: grad {name} off by {rel:.1e} of its norm "
                         f"(bound {bound:.1e}); loss rel {loss_rel:.1e}")
    return "exact", f"dkv=bf16 within {bound:.1e}: loss rel {loss_rel:.1e}, worst grad {name} {rel:.1e} of its norm"


def _worst_gradient(base: dict[str, Any], other: dict[str, Any], measure: Callable[[Any, Any], tuple[float, float, float]]
                    ) -> tuple[bool, str, float]:
    """The gradient walk every judge here makes: for each non-empty gradient of ``base`` (by name, ``other`` holds
    the same names), ``measure(base's, other's) -> (diff, own, allowance)``. ``(False, name, diff / own)`` of the
    first whose ``diff`` passes its allowance (NaN included), else ``(True, name, diff / own)`` of the worst
    (``("", 0.0)`` where there is none; ties keep the first)."""
    worst = ("", 0.0)
    for name, g in base.items():
        if not g.numel():
            continue
        diff, own, allowance = measure(g, other[name])
        if not diff <= allowance:
            return False, name, diff / max(own, 1e-300)
        worst = max(worst, (name, diff / max(own, 1e-300)), key=lambda x: x[1])
    return True, *worst


def _loss_and_gradient_names(ref: dict[str, Any], got: dict[str, Any], tol: float, tag: str = "",
                             why: str = "") -> tuple[tuple[str, str] | None, float, float]:
    """What both model judges check first: ``(WRONG verdict or None, the loss's relative error, max|g_ref| over the
    model)``. WRONG when ``got``'s loss is off by more than ``tol`` relative or the two sides' sets of parameters
    with gradients differ (``tag`` starts the detail, ``why`` ends the loss's tolerance note)."""
    loss_rel = abs(got["loss"] - ref["loss"]) / max(abs(ref["loss"]), 1e-30)
    if not loss_rel <= tol:
        return ("WRONG", f"{tag}loss off by {loss_rel:.1e} relative (tol {tol:.0e}{why})"), loss_rel, 0.0
    missing = sorted(set(ref["grads"]) ^ set(got["grads"]))
    if missing:
        return ("WRONG", f"{tag}gradients present on one side only: {missing[:4]}"), loss_rel, 0.0
    model_max = max((float(g.abs().max()) for g in ref["grads"].values() if g.numel()), default=0.0)
    return None, loss_rel, model_max


def judge_model(ref: dict[str, Any], got: dict[str, Any]) -> tuple[str, str]:
    """``("exact" | "WRONG", detail)``: ``got``'s loss within ``tol`` relative of ``ref``'s, the same parameters
    with gradients, each within ``tol * max|g_ref of that parameter| + floor * max|g_ref| over the model``
    (``tol, floor`` from ``ref["dtype"]``)."""
    tol, floor = _TOL[ref["dtype"]]
    wrong, loss_rel, model_max = _loss_and_gradient_names(ref, got, tol)
    if wrong is not None:
        return wrong

    def measure(g_ref: Any, g: Any) -> tuple[float, float, float]:
        own = float(g_ref.abs().max())
        return float((g.double() - g_ref.double()).abs().max()), own, tol * own + floor * model_max

    within, name, rel = _worst_gradient(ref["grads"], got["grads"], measure)
    if not within:
        return "WRONG", f"grad {name} off by {rel:.1e} of its max (tol {tol:.0e}); loss rel {loss_rel:.1e}"
    return "exact", f"loss rel {loss_rel:.1e}, worst grad {name} {rel:.1e}"
