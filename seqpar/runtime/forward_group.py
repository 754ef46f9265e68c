"""The process group a model's forward communicates over outside seqpar's attention: an engine that
shards parameters gathers them in the forward (DeepSpeed ZeRO-3 on each module's entry, PyTorch FSDP1 and
FSDP2 on each wrapped unit's), so every rank of that group must run the same modules in the same order.

seqpar's own checks on a forward (the batch check, the first-forward position-mixing probe) agree their
verdicts over the SP group, or over a call's group under dynamic CP. Where the parameters are gathered
over a wider group (DP x SP with ZeRO-3, or a dynamic-CP pool whose call groups are pairs), a rank that
skips a probe forward, or raises where another does not, leaves the others waiting in a gather until the
collective timeout: such a verdict must be agreed over this group as well (:func:`forward_group`).
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

__all__ = ["forward_group"]


def forward_group(model: nn.Module) -> dist.ProcessGroup | None:
    """The group ``model``'s forward gathers parameters over, or None when it gathers none (or the group
    has one rank).

    Found from the parameters and modules themselves, so it holds whatever wrapped the model:
    DeepSpeed ZeRO-3's partitioned parameters carry their group (``ds_process_group``); an FSDP1 unit
    holds its ``process_group``; FSDP2's parameters are DTensors on its mesh (a 1-D mesh gives its group;
    a mesh of several dimensions, e.g. HSDP or FSDP x TP, the world, which every rank of the mesh is in).
    """
    if not dist.is_available() or not dist.is_initialized():
        return None
    group = _zero3_group(model) or _fsdp1_group(model) or _fsdp2_group(model)
    if group is None or dist.get_world_size(group) <= 1:
        return None
    return group


def _zero3_group(model: nn.Module) -> dist.ProcessGroup | None:
    for p in model.parameters():
        group = getattr(p, "ds_process_group", None)
        if group is not None:
            return group
    return None


def _fsdp1_group(model: nn.Module) -> dist.ProcessGroup | None:
    from torch.distributed.fsdp import FullyShardedDataParallel

    for module in model.modules():
        if isinstance(module, FullyShardedDataParallel):
            return module.process_group
    return None


def _fsdp2_group(model: nn.Module) -> dist.ProcessGroup | None:
    from torch.distributed.tensor import DTensor

    for p in model.parameters():
        if isinstance(p, DTensor):
            mesh = p.device_mesh
            return mesh.get_group() if mesh.ndim == 1 else dist.group.WORLD
    return None
