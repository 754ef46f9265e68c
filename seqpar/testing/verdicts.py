"""The fuzzer's verdict rules (:mod:`seqpar.testing.fuzz`), shared by its call and model cases: what a rank's
exception was (:func:`error_record`), whether the ranks' exceptions make a refusal or a crash
(:func:`classify_errors`), and the per-tensor tolerance (:func:`close`).

A *refusal* is a ``ValueError``, ``TypeError`` or ``NotImplementedError`` (seqpar's ``ConfigError``,
``SwapError``, ``TilingError``, ``NormError`` are ``ValueError``\\ s) raised from a frame inside the ``seqpar``
package (not ``seqpar.testing``), or from a folder the caller names (an engine runner's package, e.g.
``integrations/``: :func:`seqpar.testing.fuzz_engines.runner_dir`), of the same type on every rank; any
other exception, or one on some ranks only, is a crash.
"""

from __future__ import annotations

import math
import traceback
from pathlib import Path
from typing import Any

import torch

__all__ = ["error_record", "classify_errors", "close"]

_REFUSAL_TYPES = (ValueError, TypeError, NotImplementedError)
_SEQPAR_DIR = Path(__file__).resolve().parents[1]
_TESTING_DIR = Path(__file__).resolve().parent


def error_record(e: BaseException, also: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Type, message and whether the raising frame lies in seqpar (outside seqpar.testing) or under one of
    the folders ``also``."""
    tb = e.__traceback__
    last = None
    while tb is not None:
        last = tb.tb_frame.f_code.co_filename
        tb = tb.tb_next
    path = Path(last).resolve() if last else None
    in_seqpar = path is not None and (
        (_SEQPAR_DIR in path.parents and _TESTING_DIR not in path.parents)
        or any(root in path.parents for root in also))
    return {"type": type(e).__name__, "message": str(e)[:600], "refusal": isinstance(e, _REFUSAL_TYPES) and in_seqpar,
            "where": str(path) if path else None, "trace": traceback.format_exc()[-1500:]}


def close(got: torch.Tensor, ref: torch.Tensor, tol: float, floor: float) -> tuple[bool, float]:
    """``max|got - ref| <= tol * max|ref| + floor`` (shapes must match). Returns (ok, the error in units of
    ``max|ref| + floor / tol``, the scale it is judged on: ok exactly when the error is at most ``tol``; a
    tensor that is ~0 in exact arithmetic is then reported against the floor, not against its own noise)."""
    if got is None or tuple(got.shape) != tuple(ref.shape):
        return False, math.inf
    diff = float((got.double() - ref).abs().max()) if ref.numel() else 0.0
    scale = (float(ref.abs().max()) if ref.numel() else 0.0) + floor / tol
    if not math.isfinite(diff):
        return False, math.inf
    return diff <= tol * scale, diff / scale if scale > 0 else diff


def classify_errors(per_rank: list[dict[str, Any]]) -> tuple[str, str] | None:
    """``None`` when every rank ran; else ``("refused" | "crash", detail)``: refused when every rank raised
    a refusal (see the module docstring) of the same type."""
    errors = [r["error"] for r in per_rank if not r["ok"]]
    if not errors:
        return None
    first = errors[0]
    detail = f"{first['type']}: {first['message'][:300]}"
    if len(errors) == len(per_rank) and all(e["refusal"] for e in errors) and len({e["type"] for e in errors}) == 1:
        return "refused", detail
    if len(errors) < len(per_rank):
        detail = f"{len(errors)} of {len(per_rank)} ranks raised: {detail}"
    elif not first["refusal"]:
        detail = f"{detail} (raised at {first['where']})"
    return "crash", detail
