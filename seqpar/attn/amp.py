"""Attention under ``torch.autocast`` (mixed precision): seqpar's entries do what torch's SDPA does there.

SDPA is on autocast's lower-precision list: under ``torch.autocast(dtype=torch.bfloat16)`` it casts q, k and v to
bfloat16 and returns bfloat16, whatever mix of float32 and bfloat16 it was given. A Hugging Face model under autocast
(the HF Trainer's and accelerate's ``bf16`` / ``fp16`` mixed precision) hands its attention exactly such a mix: a
Llama's q and k leave the rotary embedding in float32 (its cos / sin follow the float32 hidden states) while v leaves
``v_proj`` in bfloat16. seqpar refused that call ("q, k, v dtypes differ"), which a swapped model's user cannot fix.

:func:`autocast_inputs` casts the call's floating inputs as autocast casts them (float64 is left alone, as autocast
leaves it), and :func:`autocast_off` runs the algorithm with autocast off, so that its float32 accumulators and
merges stay float32 (autocast would lower their matmuls) and every rank computes in the dtype it was handed.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import Tensor

__all__ = ["autocast_inputs", "autocast_off"]


@torch.compiler.assume_constant_result
def _autocast_known(device_type: str) -> bool:
    """Whether autocast knows ``device_type``: a constant to dynamo, which cannot trace the lookup itself before
    torch 2.13 (torch 2.11 broke every ``fullgraph`` compile of an attention call on it)."""
    return torch.amp.is_autocast_available(device_type)


def _autocast_on(device_type: str) -> bool:
    # known first: is_autocast_enabled raises on a device type autocast does not know ("meta")
    return _autocast_known(device_type) and torch.is_autocast_enabled(device_type)


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    return torch.get_autocast_dtype(device_type) if _autocast_on(device_type) else None


def autocast_inputs(*tensors: Any) -> tuple[Any, ...]:
    """``tensors`` as SDPA sees them under autocast: each floating tensor other than float64 cast to the autocast
    dtype of its device type (differentiably: a float32 leaf gets its gradient in float32); unchanged without
    autocast, and anything not a tensor passes through (the entry's checks name it)."""
    out = []
    for t in tensors:
        if isinstance(t, Tensor) and t.is_floating_point() and t.dtype != torch.float64:
            dtype = _autocast_dtype(t.device.type)
            if dtype is not None and t.dtype != dtype:
                t = t.to(dtype)
        out.append(t)
    return tuple(out)


def autocast_off(t: Any) -> contextlib.AbstractContextManager:
    """A context with autocast off for ``t``'s device type where it is on (else a no-op)."""
    if isinstance(t, Tensor) and _autocast_on(t.device.type):
        return torch.autocast(t.device.type, enabled=False)
    return contextlib.nullcontext()
