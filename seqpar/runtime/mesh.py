"""The mesh view: seqpar's rank cube and a ``DeviceMesh``, both ways.

- In: a torchtitan-style mesh can be the source of the groups (``init_process_groups(mesh=...)``): its
  ``"sp"`` or ``"cp"`` dim is SP, its ``"tp"`` dim (if any) is TP, its ``"dp"`` / ``"dp_replicate"`` /
  ``"dp_shard"`` dims, flattened in mesh order, are DP (:func:`mesh_axes`). Its cube is then the mesh's
  ranks permuted to ``(dp..., sp, tp)`` and reshaped to ``(dp, sp, tp)``, so SP groups need not be
  consecutive ranks; every property of the manager reads the cube, so it reports them as they are.
- Out: the manager's cube as a named ``DeviceMesh`` (dims ``("dp", "sp", "tp")``, or ``("dp_sp", "tp")``)
  over the manager's own groups, for FSDP2 and DTensor (:class:`MeshView`, the manager's ``mesh`` and
  ``dp_sp_tp_mesh``): ``DeviceMesh.from_group`` creates no communicator, so none is created twice.
- DTensor's plan caches, keyed by meshes, are dropped when the groups under them go
  (:func:`forget_dtensor_plans`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["SP_DIMS", "DP_DIMS", "TP_DIMS", "MeshAxes", "mesh_axes", "MeshView", "forget_dtensor_plans"]


# The DeviceMesh dim names init_process_groups(mesh=) understands (torchtitan's spellings).
SP_DIMS = ("sp", "cp")
DP_DIMS = ("dp", "dp_replicate", "dp_shard")
TP_DIMS = ("tp",)
_REFUSED_DIMS = {
    "pp": "pipeline parallelism",
    "ep": "expert parallelism",
}


@dataclass(frozen=True)
class MeshAxes:
    """What a user's ``DeviceMesh`` means to seqpar (see :func:`mesh_axes`)."""

    sp_dim: str
    """The mesh dim that is SP (``"sp"`` or ``"cp"``)."""
    dp_dims: tuple[str, ...]
    """The mesh dims that together are DP, in mesh order (flattened row-major)."""
    grid: torch.Tensor
    """The mesh's ranks as the manager's ``(dp, sp, tp)`` cube (``tp`` = 1 without a ``"tp"`` dim)."""
    tp_dim: str | None = None
    """The mesh dim that is TP (``"tp"``), or ``None``: no tensor parallelism."""


def mesh_axes(mesh: DeviceMesh, world_size: int) -> MeshAxes:
    """Read a torchtitan-style mesh: its ``"sp"`` or ``"cp"`` dim is SP; its ``"tp"`` dim, if any, is
    TP; its ``"dp"``, ``"dp_replicate"`` and ``"dp_shard"`` dims, flattened in mesh order, are DP.

    Raises:
        ValueError: unnamed dims; a ``"pp"``, ``"ep"`` or unknown dim (named); no SP dim or two; a mesh
            that does not span the world (seqpar's groups cover every rank).
    """
    names = tuple(mesh.mesh_dim_names or ())
    known = [*SP_DIMS, *DP_DIMS, *TP_DIMS]
    if len(names) != mesh.ndim:
        raise ValueError(
            f"init_process_groups(mesh=...): the mesh's dims have no names; build it with mesh_dim_names, "
            f"e.g. init_device_mesh(device_type, (dp, sp), mesh_dim_names=('dp', 'sp')) (allowed: {known})"
        )
    for name in names:
        if name in known:
            continue
        what = _REFUSED_DIMS.get(name)
        why = f"{what} is not supported with seqpar's groups" if what else "seqpar does not know this dim"
        raise ValueError(
            f"init_process_groups(mesh=...): the mesh has a {name!r} dim ({why}); pass a mesh whose dims are "
            f"among {known}: SP is 'sp' or 'cp', TP is 'tp', DP is 'dp' / 'dp_replicate' / 'dp_shard'"
        )
    sp_dims = [n for n in names if n in SP_DIMS]
    if len(sp_dims) != 1:
        raise ValueError(
            f"init_process_groups(mesh=...): the mesh has dims {list(names)}; it needs exactly one SP dim, "
            f"named 'sp' or 'cp' (got {sp_dims or 'none'})"
        )
    if mesh.mesh.numel() != world_size:
        raise ValueError(
            f"init_process_groups(mesh=...): the mesh holds {mesh.mesh.numel()} ranks but the world has "
            f"{world_size}; seqpar's groups cover every rank (dp x sp x tp = world): pass the whole-world mesh"
        )
    dp_dims = tuple(n for n in names if n in DP_DIMS)
    tp_dim = "tp" if "tp" in names else None
    order = [names.index(n) for n in (*dp_dims, sp_dims[0], *(tp_dim,) * (tp_dim is not None))]
    ranks = mesh.mesh.detach().to("cpu", torch.int64).permute(*order)  # (dp dims..., sp[, tp])
    if tp_dim is None:
        ranks = ranks.unsqueeze(-1)  # tp = 1
    sp_size, tp_size = ranks.shape[-2:]
    return MeshAxes(sp_dim=sp_dims[0], dp_dims=dp_dims, grid=ranks.reshape(-1, sp_size, tp_size).contiguous(),
                    tp_dim=tp_dim)


class MeshView:
    """The ``mesh`` and ``dp_sp_tp_mesh`` properties of :class:`seqpar.runtime.factory.ProcessGroupManager`,
    which inherits them: read from its ``cube``, ``dp_group``, ``sp_group``, ``tp_group``,
    ``sp_dp_group`` and ``tp_size``; ``_device_type`` is the source mesh's device type (``None``: none)."""

    if TYPE_CHECKING:  # provided by the manager
        cube: torch.Tensor
        dp_group: dist.ProcessGroup
        sp_group: dist.ProcessGroup
        tp_group: dist.ProcessGroup
        sp_dp_group: dist.ProcessGroup
        tp_size: int
    _device_type: str | None = None
    _mesh: DeviceMesh | None = None  # built on first use of .mesh
    _dp_sp_tp_mesh: DeviceMesh | None = None  # built on first use of .dp_sp_tp_mesh

    @property
    def mesh(self) -> DeviceMesh:
        """The ``(dp, sp, tp)`` cube as a named ``DeviceMesh`` (dims ``"dp"``, ``"sp"``, ``"tp"``) over
        this manager's own groups (``mesh["sp"].get_group()`` is :attr:`sp_group`,
        ``mesh["dp"].get_group()`` is :attr:`dp_group`, ``mesh["tp"].get_group()`` is :attr:`tp_group`):
        ``DeviceMesh.from_group`` creates no communicator. For FSDP2
        (``fully_shard(..., mesh=manager.mesh["dp"])``) and DTensor (``mesh["tp"]``). Built on first use, on this rank
        only (no collective). Its device type is the source mesh's, else ``"cuda"`` on NCCL and
        ``"cpu"`` otherwise."""
        if self._mesh is None:
            from torch.distributed.device_mesh import DeviceMesh

            device_type = self._device_type
            if device_type is None:
                device_type = "cuda" if "nccl" in str(dist.get_backend(self.sp_group)) else "cpu"
            self._mesh = DeviceMesh.from_group(
                [self.dp_group, self.sp_group, self.tp_group], device_type, mesh=self.cube,
                mesh_dim_names=("dp", "sp", "tp"),
            )
        return self._mesh

    @property
    def dp_sp_tp_mesh(self) -> DeviceMesh:
        """The cube as a 2-D named ``DeviceMesh`` ``(dp x sp, tp)`` (dims ``"dp_sp"``, ``"tp"``) over
        :attr:`sp_dp_group` and :attr:`tp_group`: FSDP2 shards over ``"dp_sp"`` the DTensor parameters
        tensor parallelism placed on ``"tp"`` (FSDP2 + TP needs both dims of one mesh). Built on first
        use, on this rank only (no collective), with :attr:`mesh`'s device type."""
        if self._dp_sp_tp_mesh is None:
            from torch.distributed.device_mesh import DeviceMesh

            self._dp_sp_tp_mesh = DeviceMesh.from_group(
                [self.sp_dp_group, self.tp_group], self.mesh.device_type,
                mesh=self.cube.reshape(-1, self.tp_size), mesh_dim_names=("dp_sp", "tp"),
            )
        return self._dp_sp_tp_mesh


def forget_dtensor_plans() -> None:
    """Drop DTensor's cached sharding and redistribution plans (torch 2.13). They are keyed by meshes,
    and two meshes over the same ranks compare equal whatever their process groups: a later manager of
    the same layout in this process would be handed plans naming this manager's destroyed groups
    ("Could not resolve the process group registered under the name ..."). Torch exposes the clearing
    only in its debug module; where it is missing there is nothing to clear."""
    try:
        from torch.distributed.tensor import debug
    except ImportError:
        return
    getattr(debug, "_clear_sharding_prop_cache", lambda: None)()
