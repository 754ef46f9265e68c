"""Packed-document boundaries (``cu_seqlens``: ``[0, l1, l1 + l2, ..., S]``) as host integers.

The attention plan, the balanced layout and the cross-rank checks all read the boundaries as Python
ints. :func:`host_boundaries` is the one place a boundary tensor is copied to the host, and it copies
a given tensor once: a swapped model's layers all receive the same tensor, so a batch costs one
device-to-host copy, not one per layer. :func:`boundary_tensor` builds the host tensor handed to
models (``cu_seq_lens_q``) from ints already known, so reading it back costs no copy at all.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["host_boundaries", "boundary_tensor", "known_boundaries", "remember_boundaries", "drop_empty_documents"]

_INT_DTYPES = (torch.int32, torch.int64)

# id(tensor) -> (weak reference, version counter, host ints). The weak reference proves it is the
# same tensor (not a new one at a reused address), the version counter that it was not written in
# place since.
_HOST_COPIES: dict[int, tuple[weakref.ref, int, tuple[int, ...]]] = {}
_MAX_ENTRIES = 64  # past this, the entries of tensors that are gone are dropped


def host_boundaries(cu_seqlens: Tensor | Sequence[int] | None) -> tuple[int, ...] | None:
    """``cu_seqlens`` as a tuple of host ints (``None`` stays ``None``).

    Args:
        cu_seqlens: a 1-D int32/int64 tensor on any device, or a tuple/list of ints.

    Returns:
        The boundaries as ints. A tensor is copied to the host at most once while it is unchanged
        (the same tensor again, or one made by :func:`boundary_tensor`, costs nothing); a tuple or
        list costs no copy.

    Raises:
        TypeError: anything but a 1-D int32/int64 tensor or a sequence of ints.
    """
    if cu_seqlens is None:
        return None
    if isinstance(cu_seqlens, Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in _INT_DTYPES:
            raise TypeError(
                f"cu_seqlens must be a 1-D int32/int64 tensor of document boundaries, got shape "
                f"{tuple(cu_seqlens.shape)} and dtype {cu_seqlens.dtype}"
            )
        return _cached_copy(cu_seqlens)
    if isinstance(cu_seqlens, (list, tuple)) and not any(isinstance(x, bool) for x in cu_seqlens):
        try:
            return tuple(operator.index(x) for x in cu_seqlens)
        except TypeError:
            pass
    raise TypeError(
        f"cu_seqlens must be a 1-D int32/int64 tensor or a tuple of ints, got {type(cu_seqlens).__name__}"
    )


def drop_empty_documents(bounds: tuple[int, ...]) -> tuple[int, ...]:
    """``bounds`` (non-decreasing, already checked) without their repeated entries: a repeat is a zero-length
    document (flash-attn's varlen kernels, Megatron and TransformerEngine accept them, e.g. a fixed-size
    ``cu_seqlens`` padded with trailing copies of S to keep shapes static, or an empty sample), which holds no
    token and so changes no mask. ``(0, 4, 4, 16, 16)`` -> ``(0, 4, 16)``; ``bounds`` itself when it has none."""
    if all(a != b for a, b in zip(bounds, bounds[1:])):
        return bounds
    return tuple(b for i, b in enumerate(bounds) if i == 0 or b != bounds[i - 1])


def boundary_tensor(bounds: Sequence[int]) -> Tensor:
    """``bounds`` as a host int32 tensor (the dtype of transformers' ``cu_seq_lens_q``) whose
    :func:`host_boundaries` is known already: reading it back costs no copy."""
    ints = tuple(operator.index(b) for b in bounds)
    with torch.inference_mode(False):  # a normal tensor keeps a version counter, so it can be cached
        cu = torch.tensor(ints, dtype=torch.int32)
    _remember(cu, ints)
    return cu


def known_boundaries(t: Tensor) -> tuple[int, ...] | None:
    """The host ints of ``t`` when :func:`host_boundaries` already holds them (no copy), else None."""
    try:
        version = t._version
    except RuntimeError:
        return None
    hit = _HOST_COPIES.get(id(t))
    return hit[2] if hit is not None and hit[0]() is t and hit[1] == version else None


def remember_boundaries(t: Tensor, ints: Sequence[int]) -> None:
    """Record ``ints`` as the host values of ``t``, read by the caller in a combined host copy (the
    HF route reads all of a batch's device inputs at once): :func:`host_boundaries` then costs nothing."""
    _remember(t, tuple(operator.index(i) for i in ints))


def _cached_copy(t: Tensor) -> tuple[int, ...]:
    try:
        version = t._version
    except RuntimeError:  # an inference-mode tensor keeps no version counter: copy every time
        return _copy_to_host(t)
    hit = _HOST_COPIES.get(id(t))
    if hit is not None and hit[0]() is t and hit[1] == version:
        return hit[2]
    ints = _copy_to_host(t)
    _remember(t, ints)
    return ints


def _copy_to_host(t: Tensor) -> tuple[int, ...]:
    return tuple(int(x) for x in t.tolist())  # the device-to-host copy (a sync on an accelerator)


def _remember(t: Tensor, ints: tuple[int, ...]) -> None:
    try:
        version = t._version
    except RuntimeError:
        return
    if len(_HOST_COPIES) >= _MAX_ENTRIES:
        for key in [key for key, (ref, _, _) in _HOST_COPIES.items() if ref() is None]:
            del _HOST_COPIES[key]
    _HOST_COPIES[id(t)] = (weakref.ref(t), version, ints)
