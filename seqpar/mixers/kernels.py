"""Which kernel a mixer's local scan runs: transformers' torch path, or an optional CUDA kernel.

``mixer_kernels`` (:attr:`seqpar.config.SeqParConfig.mixer_kernels`) travels from the config through
:class:`seqpar.swap.options.SwapOptions` into every swapped mixer (:class:`seqpar.mixers.family.SwappedMixer`):

- ``"torch"`` (default): transformers' own torch functions. seqpar's state correction mirrors their
  rounding (e.g. of ``dt``), and they are what the exactness tests run.
- ``"auto"``: on a kernel device, flash-linear-attention (GDN, KDA, lightning attention) and mamba_ssm
  (Mamba2's SSD Triton kernels; Mamba's ``selective_scan_fn`` through transformers' hub-kernel wrapper)
  when importable, else the torch path. Opt-in: no GPU run has proven these paths exact against the
  torch path yet (``python -m seqpar.bench.gpu_check --stages mixer-kernels`` does), and their ``dt``
  rounding differs from the torch path's.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Collection
from typing import Any

import torch

from seqpar.config import MIXER_KERNELS

__all__ = ["MIXER_KERNELS", "use_kernels", "optional_kernel"]


def use_kernels(mixer_kernels: str, device: torch.device, devices: Collection[str]) -> bool:
    """Whether a mixer may dispatch to its optional kernel: ``mixer_kernels == "auto"`` and ``device``'s
    type in ``devices`` (the family's kernel devices). Raises ValueError for any other value."""
    if mixer_kernels not in MIXER_KERNELS:
        raise ValueError(f"seqpar: mixer_kernels={mixer_kernels!r} is invalid: choose one of {list(MIXER_KERNELS)} "
                         '("torch", the default, runs transformers\' torch path)')
    return mixer_kernels == "auto" and device.type in devices


def optional_kernel(mixer_kernels: str, device: torch.device, devices: Collection[str], module: str,
                    name: str) -> Callable[..., Any] | None:
    """``module.name`` (an optional package's kernel, e.g. ``("fla.ops.simple_gla", "chunk_simple_gla")``)
    where :func:`use_kernels` allows it and it imports; else None, and the caller runs its torch path.
    ``devices`` is read at the call (the families' ``KERNEL_DEVICES``, which tests widen to "cpu")."""
    if not use_kernels(mixer_kernels, device, devices):
        return None
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None
