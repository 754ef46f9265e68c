"""FairScale's FullyShardedDataParallel with sequence parallelism (optional; CUDA only).

Same group and scaling as :mod:`seqpar.integrations.fsdp`: parameters are sharded and gradients
reduced over the sequence-data-parallel group (all ``dp x sp`` ranks), and the total gradient divide
factor is the DP size, so the reduced gradient is the DP mean of the full-sequence gradient (each SP
rank's backward of :func:`seqpar.sequence.loss.sequence_parallel_loss` yields a share of it). FairScale splits
the division into a pre- and a post-divide, both applied only when > 1; seqpar splits the DP size
the same way (:func:`divide_factors`).

FairScale 0.4.13's FSDP creates CUDA streams unconditionally, so it cannot run on CPU: use
:mod:`seqpar.integrations.fsdp` (PyTorch FSDP) there. The wrapping logic (:func:`fairscale_kwargs`,
:func:`divide_factors`) needs no GPU and is tested on CPU.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from seqpar.config import SeqParConfig
from seqpar.integrations.common import BlockOptions, resolve_manager
from seqpar.runtime.groups import ProcessGroupManager

__all__ = ["FairScaleOptions", "wrap", "fairscale_kwargs", "divide_factors", "import_fairscale_fsdp"]

logger = logging.getLogger("seqpar")

INSTALL_HINT = "pip install fairscale==0.4.13 (or pip install 'seqpar[fairscale]')"
CPU_MESSAGE = (
    "FairScale FSDP needs CUDA; use seqpar.integrations.fsdp on CPU (PyTorch FSDP: FairScale "
    "0.4.13 creates CUDA streams unconditionally)"
)


def import_fairscale_fsdp() -> type:
    """FairScale's ``FullyShardedDataParallel`` class, or an ImportError that says how to install it."""
    try:
        from fairscale.nn.data_parallel import FullyShardedDataParallel
    except ImportError as e:
        raise ImportError(
            f"seqpar.integrations.fairscale needs FairScale, which is not installed: {INSTALL_HINT}"
        ) from e
    return FullyShardedDataParallel


class FairScaleOptions(BlockOptions):
    """The ``"fairscale"`` section of a seqpar JSON; keys map one to one onto FairScale's FSDP.

    Args:
        mixed_precision: keep fp32 master weights, compute in fp16 (FairScale's flag).
        compute_dtype: ``"bf16"``/``"fp16"``/``"fp32"`` with ``mixed_precision`` (default fp16).
        fp32_reduce_scatter: reduce gradients in fp32 under mixed precision.
        reshard_after_forward: free full parameters after forward (ZeRO-3 like).
        flatten_parameters: one flat buffer per FSDP unit.
        wrap_classes: class names of the blocks wrapped as their own units (default: found by name).
    """

    BLOCK = "fairscale"
    KEYS = ("mixed_precision", "compute_dtype", "fp32_reduce_scatter", "reshard_after_forward",
            "flatten_parameters", "wrap_classes")

    def __init__(
        self,
        mixed_precision: bool = False,
        compute_dtype: str | None = None,
        fp32_reduce_scatter: bool = False,
        reshard_after_forward: bool = True,
        flatten_parameters: bool = True,
        wrap_classes: list[str] | tuple[str, ...] | None = None,
    ) -> None:
        from seqpar.integrations.fsdp import dtype_from_name

        if compute_dtype is not None and not mixed_precision:
            raise ValueError("fairscale.compute_dtype needs \"mixed_precision\": true")
        self.mixed_precision = bool(mixed_precision)
        self.compute_dtype = dtype_from_name(compute_dtype)
        self.fp32_reduce_scatter = bool(fp32_reduce_scatter)
        self.reshard_after_forward = bool(reshard_after_forward)
        self.flatten_parameters = bool(flatten_parameters)
        self.wrap_classes = tuple(wrap_classes) if wrap_classes is not None else None


def divide_factors(dp_size: int) -> tuple[float, float]:
    """``(pre, post)`` with ``pre * post == dp_size`` and ``1 <= pre <= post``, ``pre`` the largest
    power of two dividing ``dp_size`` that fits (pre-dividing guards fp16 sums against overflow)."""
    pre = 1
    while dp_size % (2 * pre) == 0 and dp_size / (2 * pre) >= 2 * pre:
        pre *= 2
    return float(pre), dp_size / pre


def fairscale_kwargs(manager: ProcessGroupManager, opts: FairScaleOptions) -> dict[str, Any]:
    """Keyword arguments for FairScale's ``FullyShardedDataParallel`` (every unit gets the same)."""
    pre, _ = divide_factors(manager.dp_size)
    kw: dict[str, Any] = {
        "process_group": manager.sp_dp_group,
        "reshard_after_forward": opts.reshard_after_forward,
        "mixed_precision": opts.mixed_precision,
        "fp32_reduce_scatter": opts.fp32_reduce_scatter,
        "flatten_parameters": opts.flatten_parameters,
        "gradient_predivide_factor": pre,
    }
    if opts.compute_dtype is not None:
        kw["compute_dtype"] = opts.compute_dtype
    return kw


def wrap(
    model: nn.Module,
    config: SeqParConfig | Mapping[str, Any] | str | os.PathLike | None = None,
    *,
    manager: ProcessGroupManager | None = None,
    fairscale: FairScaleOptions | Mapping[str, Any] | None = None,
    swap: bool = True,
) -> nn.Module:
    """Swap attention, then shard ``model`` with FairScale FSDP over the sequence-data-parallel group.

    Every block (see :func:`seqpar.integrations.fsdp.find_block_classes`) becomes its own unit,
    then the root. The model should be on the current CUDA device (or FairScale moves it).

    Returns:
        The FairScale ``FullyShardedDataParallel`` root; ``.seqpar_manager`` is set on it.

    Raises:
        ImportError: FairScale is not installed (the message has the pip command).
        RuntimeError: no CUDA device (use :mod:`seqpar.integrations.fsdp`).
    """
    fsdp_cls = import_fairscale_fsdp()
    if not torch.cuda.is_available():
        raise RuntimeError(CPU_MESSAGE)
    from seqpar.integrations.fsdp import find_block_classes

    sp_config = SeqParConfig.load(config)
    opts = fairscale if isinstance(fairscale, FairScaleOptions) else FairScaleOptions.from_dict(fairscale)
    manager = resolve_manager(sp_config, manager)
    if swap and sp_config.swap != "none":
        from seqpar.swap import swap_attention

        swap_attention(model, sp_config, group=manager.sp_group)
    if sp_config.apex:
        from seqpar.integrations.apex import apply_fused_norms

        apply_fused_norms(model)
    return _wrap_units(fsdp_cls, model, manager, opts, find_block_classes(model, opts.wrap_classes))


def _wrap_units(
    fsdp_cls: type, model: nn.Module, manager: ProcessGroupManager, opts: FairScaleOptions,
    block_classes: set[type[nn.Module]], compute_device: torch.device | None = None,
) -> nn.Module:
    """Wrap the blocks, then the root, and set the divide factors on every unit.

    ``compute_device`` is for tests: FairScale's constructor runs on CPU with it (forward does not).
    """
    kw = fairscale_kwargs(manager, opts)
    if compute_device is not None:
        kw["compute_device"] = compute_device
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if type(child) in block_classes:
                setattr(module, child_name, fsdp_cls(child, **kw))
    root = fsdp_cls(model, **kw)
    pre, post = divide_factors(manager.dp_size)
    root.set_gradient_divide_factors(pre, post, recursive=True)
    root.seqpar_manager = manager
    logger.info(
        "[rank %d] seqpar: FairScale FSDP over %d ranks (dp %d x sp %d); gradient divide %g x %g",
        manager.rank, manager.world_size, manager.dp_size, manager.sp_size, pre, post,
    )
    return root
