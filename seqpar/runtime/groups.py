"""Process groups for sequence parallelism, all cut from one rank grid.

Axis order (outermost first)::

    cube = torch.arange(world_size).view(dp_size, sp_size, tp_size)   # (dp, sp, tp)
    grid = cube[:, :, tp_rank]                                        # (dp, sp): this rank's slice

- TP group = ``tp`` consecutive ranks (innermost: tensor parallelism exchanges activations in every
  layer, the heaviest traffic, so it gets the closest ranks). ``tp = 1`` (the default): this rank alone.
- SP group i = row i of the grid = ranks ``[i*sp, (i+1)*sp)`` when ``tp = 1``, strided by ``tp``
  otherwise: consecutive ranks next, so SP traffic (the heavy, latency-bound K/V exchange) stays
  inside a node when ranks are numbered node by node and ``sp x tp`` fits in one.
- DP group j = column j of the grid: the strided complement.
- SP-DP group = the grid (``dp x sp`` ranks, the whole world when ``tp = 1``): these ranks hold
  replicas of the same parameter shards, so gradients are reduced over it. It is its own group object.
- Model-parallel group = the TP group (this rank alone when ``tp = 1``), for tools that ask for one
  (DeepSpeed's gradient clipping all-reduces the norm over it; ``None`` there would mean the whole
  world). Single-rank groups are made with one local group creation per rank, not one collective
  creation per rank of the world. There is no pipeline parallelism: its group is this rank alone.

Every group is initialised when it is made, by one small collective of all its members
(:mod:`seqpar.runtime.communicators`): NCCL would otherwise create a group's communicator at its first
operation, which a ring rank with nothing to exchange in a step never joins.

With ``ulysses_size = u`` (u divides sp), each SP group is itself a ``(sp/u, u)`` grid (Ulysses and
hybrid then share the ``heads / tp`` heads that TP leaves each rank)::

    sp_grid = sp_ranks.view(sp // u, u)   # (ring, ulysses)

- Ulysses group = row = ``u`` consecutive SP ranks (the inner, intra-node axis: all-to-all traffic);
- ring group = column = SP ranks ``i, i+u, i+2u, ...`` (the outer axis: point-to-point ring traffic).
``u = 1`` (the default) makes no new groups (Ulysses group = this rank, ring group = the SP group), and
``u = sp`` neither (Ulysses group = the SP group, ring group = this rank).

The same cube as a named ``DeviceMesh`` (dims ``("dp", "sp", "tp")``, over the manager's own groups:
no communicator is created twice) is ``manager.mesh``, for FSDP2 and DTensor. A torchtitan-style mesh
can be the source instead (``init_process_groups(mesh=...)``): its ``"sp"`` or ``"cp"`` dim is SP, its
``"tp"`` dim (if any) is TP, its ``"dp"`` / ``"dp_replicate"`` / ``"dp_shard"`` dims, flattened in mesh
order, are DP, and the manager takes the mesh's groups. Its cube is then the mesh's ranks permuted to
``(dp..., sp, tp)`` and reshaped to ``(dp, sp, tp)``, so SP groups need not be consecutive ranks; every
property reads the cube, so the manager reports them as they are.

``ProcessGroupManager`` exposes the Megatron/DeepSpeed ``mpu`` methods, so it can be handed to
``deepspeed.initialize(mpu=manager)``: DeepSpeed then reduces gradients over
``get_sequence_data_parallel_group()`` and sizes its data loader by ``get_data_parallel_*``.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from seqpar.config import SHARDINGS, Links, SeqParConfig
from seqpar.runtime.communicators import init_communicator, new_groups

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "ProcessGroupManager",
    "init_process_groups",
    "destroy_process_groups",
    "default_manager",
    "set_default_manager",
    "resolve_group",
    "rank_grid",
    "rank_cube",
    "check_layout",
    "tp_heads_problem",
    "check_divisible",
    "single_process_env",
    "timeout_of",
    "check_ulysses_size",
    "node_layout_problems",
    "divisors",
    "ulysses_heads_ok",
    "choose_ulysses_size",
    "MeshAxes",
    "mesh_axes",
    "SP_DIMS",
    "DP_DIMS",
    "TP_DIMS",
]

logger = logging.getLogger("seqpar")

_DEFAULT: ProcessGroupManager | None = None


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n``, ascending (the sizes an axis of ``n`` ranks can be cut into)."""
    return [d for d in range(1, n + 1) if n % d == 0]


def check_divisible(world_size: int, sp_size: int) -> None:
    """Raise ``ValueError`` unless ``sp_size`` is a positive divisor of ``world_size``."""
    if isinstance(sp_size, bool) or not isinstance(sp_size, int) or sp_size < 1:
        raise ValueError(
            f"sequence_parallel.size must be a positive integer, got {sp_size!r}; choose a size "
            f"that divides the number of ranks {tuple(divisors(world_size))}"
        )
    if world_size % sp_size:
        raise ValueError(
            f"world size {world_size} is not divisible by sequence_parallel.size {sp_size}; "
            f"choose a size that divides the number of ranks ({', '.join(map(str, divisors(world_size)))})"
        )


def check_ulysses_size(sp_size: int, ulysses_size: int) -> None:
    """Raise ``ValueError`` unless ``ulysses_size`` is a positive divisor of ``sp_size``."""
    fix = f"choose a ulysses_size that divides sequence_parallel.size {sp_size} ({', '.join(map(str, divisors(sp_size)))})"
    if isinstance(ulysses_size, bool) or not isinstance(ulysses_size, int) or ulysses_size < 1:
        raise ValueError(f"ulysses_size must be a positive integer or 'auto', got {ulysses_size!r}; {fix}")
    if sp_size % ulysses_size:
        raise ValueError(f"ulysses_size {ulysses_size} does not divide sequence_parallel.size {sp_size}; {fix}")


def tp_heads_problem(q_heads: int, kv_heads: int, tp: int) -> str | None:
    """Why ``tp`` tensor-parallel ranks cannot share the model's heads (``None``: they can). Each TP
    rank holds ``q_heads / tp`` query and ``kv_heads / tp`` K/V heads (the column-parallel q/k/v
    projections are cut on head boundaries), so ``tp`` must divide both counts."""
    if tp == 1 or (q_heads % tp == 0 and kv_heads % tp == 0):
        return None
    fits = divisors(math.gcd(q_heads, kv_heads))
    return (
        f"sequence_parallel.tp_size {tp} does not divide the model's heads ({q_heads} query, {kv_heads} K/V): "
        f"each TP rank holds heads / tp_size of each; choose tp_size in {fits} (a common divisor), and put "
        "the remaining ranks on the SP axis (sequence_parallel.size)"
    )


def ulysses_heads_ok(q_heads: int, kv_heads: int, u: int, tp: int = 1) -> bool:
    """Whether ``u`` Ulysses ranks can share the heads without expanding K/V (see seqpar.attn.ulysses):
    ``u`` divides the query heads, and the K/V head count is a multiple or a divisor of ``u``. With
    ``tp`` > 1 the heads are those TP leaves each rank (``q_heads / tp``, ``kv_heads / tp``; ``tp`` must
    divide both, :func:`tp_heads_problem`), so e.g. K/V heads < ``tp x u`` needs ``u`` to be a multiple
    of ``kv_heads / tp``."""
    if tp_heads_problem(q_heads, kv_heads, tp):
        return False
    q_heads, kv_heads = q_heads // tp, kv_heads // tp
    return q_heads % u == 0 and (kv_heads % u == 0 or u % kv_heads == 0)


def choose_ulysses_size(
    sp_size: int, *, heads: tuple[int, int] | None = None, node_size: int | None = None, tp: int = 1
) -> int:
    """``ulysses_size="auto"`` at init: the largest divisor of ``sp_size`` that fits in a node (Ulysses
    all-to-all on the fast intra-node links, the ring across nodes hides the slow ones) and, when the
    model's ``heads = (q_heads, kv_heads)`` are known, satisfies the head-count rule
    (:func:`ulysses_heads_ok`, on the heads ``tp`` leaves each rank; a Ulysses group of ``u`` spans
    ``u x tp`` consecutive ranks, which must fit in the node).

    ``node_size`` defaults to ``LOCAL_WORLD_SIZE`` from the launcher, else ``sp_size x tp`` (one node).
    Integer arithmetic on the group layout only, so it lives with the groups (no attention import).

    Raises:
        ValueError: ``tp`` does not divide the head counts (:func:`tp_heads_problem`, naming the fix).
    """
    if heads is not None and (problem := tp_heads_problem(heads[0], heads[1], tp)):
        raise ValueError(problem)
    if node_size is None:
        node_size = int(os.environ.get("LOCAL_WORLD_SIZE", sp_size * tp))
    fits = [u for u in divisors(sp_size)
            if u * tp <= max(node_size, tp) and (heads is None or ulysses_heads_ok(heads[0], heads[1], u, tp))]
    return max(fits)


def rank_grid(world_size: int, sp_size: int) -> torch.Tensor:
    """The rank grid ``(dp_size, sp_size)``: row i is SP group i, column j is DP group j."""
    check_divisible(world_size, sp_size)
    return torch.arange(world_size).view(world_size // sp_size, sp_size)  # (dp, sp)


def check_layout(world_size: int, sp_size: int, tp_size: int = 1) -> None:
    """Raise ``ValueError`` unless the world is ``dp x sp_size x tp_size`` for a whole ``dp``."""
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"sequence_parallel.tp_size must be a positive integer, got {tp_size!r}; "
                         f"choose one that divides the number of ranks {tuple(divisors(world_size))}")
    check_divisible(world_size, sp_size)
    if world_size % (sp_size * tp_size):
        fits = [t for t in divisors(world_size) if (world_size // t) % sp_size == 0]
        raise ValueError(
            f"world size {world_size} is not dp x sequence_parallel.size {sp_size} x tp_size {tp_size} for any "
            f"whole dp: choose tp_size in {fits} for this SP size, or change the SP size or the number of ranks"
        )


def rank_cube(world_size: int, sp_size: int, tp_size: int = 1) -> torch.Tensor:
    """The rank cube ``(dp_size, sp_size, tp_size)``: TP innermost (consecutive ranks), then SP, then DP."""
    check_layout(world_size, sp_size, tp_size)
    return torch.arange(world_size).view(world_size // (sp_size * tp_size), sp_size, tp_size)  # (dp, sp, tp)


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


class ProcessGroupManager:
    """The SP, DP, SP-DP and TP (model-parallel) groups of one ``(dp, sp, tp)`` rank cube.

    Build it once, collectively (every rank, same arguments), after
    ``torch.distributed.init_process_group``; then pass it (or its groups) to what needs them.

    Args:
        sp_size: sequence-parallel degree; must divide the world size (with ``mesh``: the mesh's SP
            size, or ``None``).
        ulysses_size: the Ulysses (all-to-all) degree inside each SP group; must divide ``sp_size``.
            The SP group splits into ``sp_size / u`` Ulysses groups of ``u`` consecutive ranks and
            ``u`` ring groups across them (see the module docstring). Default 1: no Ulysses axis.
        tp_size: tensor-parallel degree (innermost: ``tp`` consecutive ranks); ``sp_size x tp_size``
            must divide the world size (with ``mesh``: the mesh's ``"tp"`` size, or ``None``). Default 1.
        backend: backend for the new groups (default: the default group's backend).
        timeout: timeout of the new groups' collectives (default: torch's).
        mesh: a named ``DeviceMesh`` over the whole world to take the SP and DP groups from instead of
            creating them (see :func:`mesh_axes` for the dims it understands; its ``"tp"`` dim's group
            is the TP group). The SP-DP group, the single-rank group, the TP group of a mesh without a
            ``"tp"`` dim, and the Ulysses/ring groups when ``1 < ulysses_size < sp``, are still
            created; so is the DP group when two or more DP dims are larger than 1 and the mesh has
            no flattened ``"dp"``.
    """

    def __init__(
        self,
        sp_size: int | None = None,
        *,
        ulysses_size: int = 1,
        backend: str | None = None,
        timeout: timedelta | None = None,
        mesh: DeviceMesh | None = None,
        tp_size: int | None = None,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "ProcessGroupManager needs torch.distributed to be initialised; call "
                "seqpar.init_process_groups(...) (which initialises it from the environment) or "
                "torch.distributed.init_process_group(...) first"
            )
        self._world_size = dist.get_world_size()
        self._rank = dist.get_rank()
        axes = mesh_axes(mesh, self._world_size) if mesh is not None else None
        if axes is not None and sp_size is not None and sp_size != axes.grid.shape[1]:
            raise ValueError(
                f"sp_size {sp_size} disagrees with the mesh's {axes.sp_dim!r} dim of size {axes.grid.shape[1]}; "
                "leave sp_size out (the mesh decides) or pass a mesh with that SP size"
            )
        if axes is not None and tp_size is not None and tp_size != axes.grid.shape[2]:
            raise ValueError(
                f"tp_size {tp_size} disagrees with the mesh's TP size {axes.grid.shape[2]} (its 'tp' dim, 1 without "
                "one); leave tp_size out (the mesh decides) or pass a mesh with that 'tp' dim"
            )
        # (dp, sp, tp): TP innermost (consecutive ranks), then SP, then DP, for seqpar's own cube
        self.cube = axes.grid if axes is not None else rank_cube(self._world_size, sp_size, tp_size or 1)
        # this rank's (dp, sp, tp) position: anywhere in a mesh's cube
        self._dp_rank, self._sp_rank, self._tp_rank = (int(i) for i in (self.cube == self._rank).nonzero()[0])
        # the (dp, sp) slice holding this rank: its SP group is a row, its DP group a column
        self.grid = self.cube[:, :, self._tp_rank]
        sp_size = self.grid.shape[1]
        check_ulysses_size(sp_size, ulysses_size)
        self._ulysses_size = ulysses_size
        self._mesh: DeviceMesh | None = None  # built on first use of .mesh
        self._dp_sp_tp_mesh: DeviceMesh | None = None  # built on first use of .dp_sp_tp_mesh
        self._device_type = mesh.device_type if mesh is not None else None
        # link figures for mode="auto" (seqpar.config.Links); None = probe on first use
        self.links: Links | None = None
        # the sharding declared for this run (config / init_process_groups(sharding=)); None = undeclared,
        # and each call's own argument decides (seqpar.sequence.sharding.resolve_sharding)
        self.sharding: str | None = None

        self._created: list[dist.ProcessGroup] = []  # what destroy() tears down
        self.owns_world = False  # set by init_process_groups when it created the world group
        # this rank's heartbeat (seqpar.runtime.liveness), started by init_process_groups, released by destroy()
        self.liveness: Any = None
        kw: dict[str, Any] = {"backend": backend}
        if timeout is not None:
            kw["timeout"] = timeout
        # dist.new_group is collective: every rank creates every group, in the same order. Every group
        # is initialised at once, by all its members (seqpar.runtime.communicators): NCCL would otherwise
        # create it at its first operation, which a ring rank with no hop in a step never joins.
        # The family of every axis is the cube with that axis moved last (each row one group).
        if axes is None:
            self._sp_group = self._new_groups(self._family(1), kw)
            self._dp_group = self._new_groups(self._family(0), kw)
        else:
            self._sp_group = mesh.get_group(axes.sp_dim)
            init_communicator(self._sp_group)  # the user's group, but seqpar's ring runs on it
        # the ranks holding replicas of the same parameter shards: the grid of every TP rank
        self._sp_dp_group = self._new_groups(self.cube.permute(2, 0, 1).reshape(self.tp_size, -1).tolist(), kw)
        # this rank alone (one local creation per rank), for the axes of size 1; the TP group when tp = 1
        self._self_group = self._new_groups([[r] for r in range(self._world_size)], kw)
        if self.tp_size == 1:
            self._tp_group = self._self_group
        elif axes is not None and axes.tp_dim is not None:
            self._tp_group = mesh.get_group(axes.tp_dim)
            init_communicator(self._tp_group)
        else:
            self._tp_group = self._new_groups(self._family(2), kw)
        if axes is not None:
            self._dp_group = self._mesh_dp_group(mesh, axes, kw)
        self._ulysses_group, self._ring_group = self._make_ulysses_ring_groups(kw)
        logger.info(
            "[rank %d] seqpar groups: world %d = dp %d x sp %d x tp %d; sp group %s, dp group %s, tp group %s",
            self._rank,
            self._world_size,
            self.dp_size,
            self.sp_size,
            self.tp_size,
            self.sp_ranks,
            self.dp_ranks,
            self.tp_ranks,
        )

    def _new_groups(self, rank_lists: list[list[int]], kw: dict[str, Any]) -> dist.ProcessGroup:
        """Create the groups of ``rank_lists`` (a partition of the world) on every rank; return the one
        that holds this rank, initialised (:func:`seqpar.runtime.communicators.new_groups`)."""
        mine = new_groups(rank_lists, self._rank, **kw)
        self._created.append(mine)  # other ranks' groups are not objects on this rank
        return mine

    def _family(self, axis: int) -> list[list[int]]:
        """The groups along ``axis`` of the cube (0 = DP, 1 = SP, 2 = TP): every line of ranks that
        differ only in that coordinate, ordered by the other coordinates (the same on every rank)."""
        others = [d for d in range(3) if d != axis]
        return self.cube.permute(*others, axis).reshape(-1, self.cube.shape[axis]).tolist()

    def _mesh_dp_group(self, mesh: DeviceMesh, axes: MeshAxes, kw: dict[str, Any]) -> dist.ProcessGroup:
        """The DP group of a user mesh: its one DP dim larger than 1, its flattened ``"dp"`` when it has
        one, this rank alone when DP is 1; else new groups over the grid's columns (collective, taken
        the same way on every rank: the mesh's shape is the same everywhere)."""
        wide = [n for n in axes.dp_dims if mesh.size(mesh.mesh_dim_names.index(n)) > 1]
        if not wide:
            return self._self_group
        if len(wide) == 1:
            group = mesh.get_group(wide[0])
            init_communicator(group)
            return group
        try:
            flat = mesh["dp"].get_group() if "dp" not in mesh.mesh_dim_names else None
        except (KeyError, ValueError, RuntimeError):  # no flattened "dp" on this mesh
            flat = None
        if flat is not None and dist.get_process_group_ranks(flat) == self.dp_ranks:
            init_communicator(flat)
            return flat
        return self._new_groups(self._family(0), kw)

    def _make_ulysses_ring_groups(self, kw: dict[str, Any]) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
        """The (Ulysses, ring) groups of this rank; new groups only when ``1 < u < sp``."""
        u, sp = self._ulysses_size, self.sp_size
        if u == 1:
            return self._self_group, self._sp_group
        if u == sp:
            return self._sp_group, self._self_group
        # every SP group's (sp/u, u) grid, stacked: (dp, ring, ulysses, tp); collective, same order everywhere
        split = self.cube.view(self.dp_size, sp // u, u, self.tp_size)
        ulysses = self._new_groups(split.permute(0, 1, 3, 2).reshape(-1, u).tolist(), kw)
        ring = self._new_groups(split.permute(0, 2, 3, 1).reshape(-1, sp // u).tolist(), kw)
        return ulysses, ring

    def destroy(self) -> None:
        """Destroy the groups this manager created (collective: every rank, once training is done).

        A barrier first: gloo can abort a peer still inside a collective of a group destroyed under it.
        The world group is destroyed too when :func:`init_process_groups` created it
        (``owns_world``); a world group the user created is theirs to destroy. The rank's heartbeat
        (:mod:`seqpar.runtime.liveness`) stops here too, marking the rank as gone cleanly. Idempotent.
        """
        if not self._created or not dist.is_initialized():
            self._created = []
            if self.liveness is not None:
                self.liveness.release()
                self.liveness = None
            return
        dist.barrier()
        if self.liveness is not None:  # after the barrier: a peer lost there is still diagnosed
            self.liveness.release()
            self.liveness = None
        for group in self._created:
            dist.destroy_process_group(group)
        self._created = []
        # Always: FSDP2 builds DTensors on meshes over this manager's groups that the manager never sees
        # (seqpar.integrations.fsdp.build_mesh), and their cached plans would outlive the groups.
        _forget_dtensor_plans()
        if default_manager() is self:
            set_default_manager(None)
        if self.owns_world:
            dist.destroy_process_group()

    def __repr__(self) -> str:
        return (
            f"ProcessGroupManager(rank={self._rank}, world_size={self._world_size}, "
            f"dp={self.dp_size}, sp={self.sp_size}, tp={self.tp_size}, ulysses={self.ulysses_size})"
        )

    # ---------------------------------------------------------------- properties
    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def rank(self) -> int:
        """Global rank."""
        return self._rank

    @property
    def sp_size(self) -> int:
        return self.grid.shape[1]

    @property
    def dp_size(self) -> int:
        return self.grid.shape[0]

    @property
    def tp_size(self) -> int:
        """Tensor-parallel degree (ranks sharing each layer's weights); 1: no tensor parallelism."""
        return self.cube.shape[2]

    @property
    def tp_rank(self) -> int:
        """Rank inside the TP group (= which ``1 / tp_size`` shard of each weight this rank holds)."""
        return self._tp_rank

    @property
    def tp_group(self) -> dist.ProcessGroup:
        """The ``tp_size`` ranks sharing each layer's weights (consecutive ranks on seqpar's cube;
        this rank alone when ``tp_size`` is 1)."""
        return self._tp_group

    @property
    def tp_ranks(self) -> list[int]:
        """Global ranks of this rank's TP group, in TP-rank order."""
        return self.cube[self._dp_rank, self._sp_rank].tolist()

    @property
    def sp_rank(self) -> int:
        """Rank inside the SP group (= position of this rank's shard in the sequence)."""
        return self._sp_rank

    @property
    def dp_rank(self) -> int:
        """Rank inside the DP group (= which data-parallel replica this rank feeds)."""
        return self._dp_rank

    @property
    def sp_group(self) -> dist.ProcessGroup:
        return self._sp_group

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self._dp_group

    @property
    def sp_dp_group(self) -> dist.ProcessGroup:
        return self._sp_dp_group

    @property
    def ulysses_size(self) -> int:
        """Ranks per Ulysses group (the inner SP axis); 1 when there is no Ulysses axis."""
        return self._ulysses_size

    @property
    def ring_size(self) -> int:
        """Ranks per ring group (the outer SP axis): ``sp_size / ulysses_size``."""
        return self.sp_size // self._ulysses_size

    @property
    def ulysses_group(self) -> dist.ProcessGroup:
        """The ``ulysses_size`` consecutive SP ranks around this rank (this rank alone when u = 1)."""
        return self._ulysses_group

    @property
    def ring_group(self) -> dist.ProcessGroup:
        """SP ranks ``i, i+u, i+2u, ...`` with ``i`` = this rank's Ulysses rank (this rank alone when u = sp)."""
        return self._ring_group

    @property
    def ulysses_rank(self) -> int:
        """Rank inside the Ulysses group."""
        return self._sp_rank % self._ulysses_size

    @property
    def ring_rank(self) -> int:
        """Rank inside the ring group (= which super-rank of ``u`` consecutive shards this rank is in)."""
        return self._sp_rank // self._ulysses_size

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
                device_type = "cuda" if "nccl" in str(dist.get_backend(self._sp_group)) else "cpu"
            self._mesh = DeviceMesh.from_group(
                [self._dp_group, self._sp_group, self._tp_group], device_type, mesh=self.cube,
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
                [self._sp_dp_group, self._tp_group], self.mesh.device_type,
                mesh=self.cube.reshape(-1, self.tp_size), mesh_dim_names=("dp_sp", "tp"),
            )
        return self._dp_sp_tp_mesh

    @property
    def sp_ranks(self) -> list[int]:
        """Global ranks of this rank's SP group, in SP-rank order."""
        return self.grid[self._dp_rank].tolist()

    @property
    def dp_ranks(self) -> list[int]:
        """Global ranks of this rank's DP group, in DP-rank order."""
        return self.grid[:, self._sp_rank].tolist()

    # ---------------------------------------------------------------- mpu interface
    def get_sequence_parallel_group(self) -> dist.ProcessGroup:
        return self._sp_group

    def get_sequence_parallel_world_size(self) -> int:
        return self.sp_size

    def get_sequence_parallel_rank(self) -> int:
        return self._sp_rank

    def get_data_parallel_group(self) -> dist.ProcessGroup:
        return self._dp_group

    def get_data_parallel_world_size(self) -> int:
        return self.dp_size

    def get_data_parallel_rank(self) -> int:
        return self._dp_rank

    def get_data_parallel_group_ranks(self) -> list[int]:
        return self.dp_ranks

    def get_sequence_data_parallel_group(self) -> dist.ProcessGroup:
        return self._sp_dp_group

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.dp_size * self.sp_size

    def get_sequence_data_parallel_rank(self) -> int:
        return dist.get_group_rank(self._sp_dp_group, self._rank)

    def get_model_parallel_group(self) -> dist.ProcessGroup:
        """The TP group (this rank alone when ``tp_size`` is 1): there is no pipeline parallelism."""
        return self._tp_group

    def get_model_parallel_world_size(self) -> int:
        return self.tp_size

    def get_model_parallel_rank(self) -> int:
        return self._tp_rank

    # Newer Megatron/DeepSpeed spellings of the same model-parallel (tensor-parallel) axis.
    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_rank = get_model_parallel_rank

    def get_tensor_model_parallel_src_rank(self) -> int:
        """Global rank of TP rank 0 in this rank's TP group (Megatron's broadcast source)."""
        return self.tp_ranks[0]

    def get_pipeline_model_parallel_group(self) -> dist.ProcessGroup:
        """This rank alone: there is no pipeline parallelism."""
        return self._self_group

    def get_pipeline_model_parallel_world_size(self) -> int:
        return 1

    def get_pipeline_model_parallel_rank(self) -> int:
        return 0


def _forget_dtensor_plans() -> None:
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


# -------------------------------------------------------------------- default instance
def default_manager() -> ProcessGroupManager | None:
    """The manager last made by ``init_process_groups`` (or set), if any. An edge convenience."""
    return _DEFAULT


def set_default_manager(manager: ProcessGroupManager | None) -> None:
    """Record ``manager`` as the default (``None`` forgets it)."""
    global _DEFAULT
    _DEFAULT = manager


def resolve_group(group: dist.ProcessGroup | None = None) -> dist.ProcessGroup | None:
    """The group a collective should use; the one rule behind every ``group=None`` in seqpar.

    - ``group`` if given (``torch.distributed.group.WORLD`` to use the whole world on purpose);
    - else the default manager's SP group (``seqpar.init_process_groups``);
    - else ``None`` when torch.distributed is not available or not initialised (a single process:
      world size 1);
    - else ``dist.group.WORLD`` on a world of one rank (the SP group can only be that rank);
    - else (a world of more than one rank and no manager) ``ValueError``: the SP group is not known,
      and silently taking the whole world would run SP across the DP ranks of a DP x SP job.
      Every rank raises the same error (it reads only the world size and the manager).
    """
    if group is not None:
        return group
    if _DEFAULT is not None:
        return _DEFAULT.sp_group
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.get_world_size()
    if world == 1:
        return dist.group.WORLD
    raise ValueError(
        f"group=None needs a process-group manager on a world of {world} ranks: call "
        "seqpar.init_process_groups(sp_size=...) on every rank first (its SP group is then the default), "
        "or pass group= explicitly (group=torch.distributed.group.WORLD to run sequence parallelism over "
        "the whole world on purpose)"
    )


def single_process_env() -> bool:
    """Under a plain ``python script.py`` (no launcher variables), set the environment of a world of
    one (``MASTER_ADDR``/``MASTER_PORT`` on a free local port, ``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``LOCAL_SIZE``), so the same code runs unlaunched. Returns whether it did."""
    if "WORLD_SIZE" in os.environ or "RANK" in os.environ:
        return False
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    os.environ.update(RANK="0", WORLD_SIZE="1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("LOCAL_SIZE", "1")
    return True


def timeout_of(config: SeqParConfig | None, timeout: timedelta | None = None) -> timedelta | None:
    """``timeout`` if given, else the config's ``timeout_s`` as a ``timedelta`` (None: torch's default)."""
    if timeout is not None or config is None or config.timeout_s is None:
        return timeout
    return timedelta(seconds=config.timeout_s)


def _init_from_env(backend: str | None, timeout: timedelta | None) -> None:
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if single_process_env():
        logger.info("[rank 0] no launcher environment found: starting a 1-rank %s group", backend)
    kw: dict[str, Any] = {"backend": backend, "init_method": "env://"}
    if timeout is not None:
        kw["timeout"] = timeout
    if backend == "nccl" and "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(**kw)


def _check_same_on_every_rank(sp_size: object, ulysses_size: object, sharding: object = None,
                              tp_size: object = 1) -> None:
    """All-gather the requested sizes (and declared sharding) on the default group and raise on every
    rank if they differ: ranks that disagree would create different groups and hang in ``new_group``,
    or cut one sequence two ways."""
    def code(x: object) -> int:
        return x if isinstance(x, int) and not isinstance(x, bool) else (0 if x == "auto" else -1)

    names = (None, *SHARDINGS)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    mine = torch.tensor([code(sp_size), code(ulysses_size), names.index(sharding) if sharding in names else -1,
                         code(tp_size)], dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    rows = [t.cpu().tolist() for t in everyone]
    if any(row != rows[0] for row in rows):
        def shown(c: int) -> str:
            return repr(names[c]) if 0 <= c < len(names) else "invalid"

        detail = "; ".join(f"rank {r}: sp_size={a}, ulysses_size={'auto' if b == 0 else b}, sharding={shown(c)}, "
                           f"tp_size={t}" for r, (a, b, c, t) in enumerate(rows))
        raise ValueError(
            f"init_process_groups: the ranks asked for different group sizes or shardings ({detail}); "
            "call it on every rank with the same sp_size, ulysses_size, tp_size and sharding (the same config)"
        )


def node_layout_problems(world_size: int, sp_size: int, ulysses_size: int, node_size: int | None,
                         tp_size: int = 1) -> list[str]:
    """Why the TP / SP / Ulysses groups of this layout would cross node boundaries (empty: they do not).

    Ranks are assumed numbered node by node (torchrun, the DeepSpeed launcher and SLURM do so), so
    the groups of consecutive ranks stay inside a node when their size divides the node size, or
    span whole nodes when it is a multiple of it. TP is innermost: a TP group must fit in a node, and
    an SP (Ulysses) group spans ``sp x tp`` (``u x tp``) consecutive ranks, judged as such.
    """
    if not node_size or node_size < 1 or node_size >= world_size:
        return []
    problems = []
    if tp_size > 1 and node_size % tp_size:
        problems.append(
            f"sequence_parallel.tp_size {tp_size} does not divide the {node_size} ranks per node: TP groups (the "
            f"per-layer activation exchange) cross nodes; choose a tp_size dividing {node_size}"
        )
    sp_size, ulysses_size = sp_size * tp_size, ulysses_size * tp_size  # the spans of consecutive ranks
    if sp_size % node_size and node_size % sp_size:
        problems.append(
            f"sequence_parallel.size {sp_size} neither divides nor is a multiple of the {node_size} ranks per "
            f"node: some SP groups straddle two nodes, so their ring exchange runs over the slow inter-node "
            f"link; choose a size dividing {node_size} or a multiple of it"
        )
    if ulysses_size > node_size or node_size % ulysses_size:
        problems.append(
            f"sequence_parallel.ulysses_size {ulysses_size} does not fit in a node of {node_size} ranks: its "
            f"all-to-all crosses nodes; choose a divisor of {node_size} (the ring axis goes across nodes)"
        )
    return problems


def _declared_sharding(sharding: str | None, config: SeqParConfig) -> tuple[str | None, str | None]:
    """``(the run's declared sharding, what is wrong with the request or None)``: the argument, else the
    config's; both given and different, or an unknown name, is an error (raised after the ranks
    compared their requests, so every rank raises it)."""
    if sharding is not None and sharding not in SHARDINGS:
        return None, f"init_process_groups: unknown sharding {sharding!r}; choose one of {list(SHARDINGS)}"
    if sharding is not None and config.sharding is not None and sharding != config.sharding:
        return None, (
            f"init_process_groups: sharding={sharding!r} contradicts the config's sequence_parallel.sharding "
            f"{config.sharding!r}; pass one of them (one sharding must cut, attend and gather)"
        )
    return (sharding if sharding is not None else config.sharding), None


def init_process_groups(
    sp_size: int | None = None,
    *,
    ulysses_size: int | str | None = None,
    config: SeqParConfig | Mapping[str, Any] | str | os.PathLike | None = None,
    sharding: str | None = None,
    mesh: DeviceMesh | None = None,
    backend: str | None = None,
    timeout: timedelta | None = None,
    heads: tuple[int, int] | None = None,
    tp_size: int | None = None,
) -> ProcessGroupManager:
    """Build the SP/DP (and Ulysses/ring) groups, initialising torch.distributed from the environment
    if needed.

    Collective: call it on every rank with the same arguments.

    Args:
        sp_size: SP degree; default ``config.size`` (1 without a config), or the mesh's SP dim.
        ulysses_size: Ulysses degree ``u`` inside the SP group (divides ``sp_size``); default
            ``config.ulysses_size``, or 1. ``"auto"`` chooses it once, here, with
            :func:`choose_ulysses_size` (the largest divisor of ``sp_size`` that fits in a node and,
            when ``heads`` is given, divides the query and K/V head counts each rank holds under TP).
        config: what ``swap_attention`` takes: a ``SeqParConfig``, a dict (the ``sequence_parallel``
            block, or a dict holding it), or a JSON path (standalone or DeepSpeed); see
            ``SeqParConfig.load``. Its ``size`` / ``ulysses_size`` / ``sharding`` / ``timeout_s`` /
            ``links`` are used where the arguments are ``None``.
        sharding: the run's sharding (``"contiguous"``, ``"zigzag"``, ``"balanced"``), kept on the
            manager: batch and sequence cuts, attention and the loss then default to it, and an
            explicit argument that contradicts it raises (see
            :func:`seqpar.sequence.sharding.resolve_sharding`). Default ``config.sharding``; ``None``
            there too: undeclared (each call decides; ``"contiguous"`` when it does not say).
        mesh: a torchtitan-style named ``DeviceMesh`` of the whole world to take the SP, DP and TP groups
            from (``"sp"`` or ``"cp"`` is SP; ``"tp"`` is TP; ``"dp"``, ``"dp_replicate"``, ``"dp_shard"``
            are DP; ``"pp"``, ``"ep"`` and other dims are refused): see :func:`mesh_axes`.
        backend: for a fresh ``init_process_group`` (``"nccl"`` when CUDA is available, else
            ``"gloo"``) and for the new groups.
        timeout: for a fresh ``init_process_group`` and the new groups' collectives (default:
            ``config.timeout_s``; a world group created before keeps its own).
        heads: ``(q_heads, kv_heads)`` of the model (all of them, before TP): checked against
            ``tp_size`` and used by ``ulysses_size="auto"``.
        tp_size: tensor-parallel degree, the innermost axis (``tp`` consecutive ranks); default
            ``config.tp_size`` (1), or the mesh's ``"tp"`` dim. The world must be ``dp x sp x tp``.

    Returns:
        The manager, also recorded as the default (see ``default_manager``).

    Raises:
        seqpar.config.ConfigError: an invalid config (before any collective: the same on every rank).
        ValueError (on every rank): the world size is not ``dp x sp x tp``, ``tp_size`` does not divide
        ``heads``, ``ulysses_size``
        does not divide the SP size, the ranks passed different sizes or shardings, ``sharding``
        contradicts the config's, or the mesh has a dim seqpar cannot represent.
    """
    cfg = SeqParConfig.load(config)  # defaults when None: size 1, ulysses 1, sharding undeclared
    owns_world = not dist.is_initialized()
    timeout = timeout_of(cfg, timeout)
    if owns_world:
        _init_from_env(backend, timeout)
    axes = mesh_axes(mesh, dist.get_world_size()) if mesh is not None else None
    if axes is not None:
        mesh_sp = axes.grid.shape[1]
        # a config's size 1 (the default) is read as "not set": the mesh decides
        for what, asked in (("sp_size", sp_size), ("sequence_parallel.size", cfg.size if cfg.size != 1 else None)):
            if asked is not None and asked != mesh_sp:
                raise ValueError(
                    f"init_process_groups: {what} {asked} disagrees with the mesh's {axes.sp_dim!r} dim of size "
                    f"{mesh_sp}; leave it out (the mesh decides) or make them equal"
                )
        sp_size = mesh_sp
        mesh_tp = axes.grid.shape[2]
        for what, asked in (("tp_size", tp_size), ("sequence_parallel.tp_size", cfg.tp_size if cfg.tp_size != 1 else None)):
            if asked is not None and asked != mesh_tp:
                raise ValueError(
                    f"init_process_groups: {what} {asked} disagrees with the mesh's TP size {mesh_tp} (its 'tp' dim, "
                    "1 without one); leave it out (the mesh decides) or make them equal"
                )
        tp_size = mesh_tp
    if sp_size is None:
        sp_size = cfg.size
    if tp_size is None:
        tp_size = cfg.tp_size
    if ulysses_size is None:
        ulysses_size = cfg.ulysses_size
    declared, sharding_problem = _declared_sharding(sharding, cfg)
    _check_same_on_every_rank(sp_size, ulysses_size, declared, tp_size)
    if sharding_problem:
        raise ValueError(sharding_problem)
    check_layout(dist.get_world_size(), sp_size, tp_size)
    if heads is not None and (problem := tp_heads_problem(heads[0], heads[1], tp_size)):
        raise ValueError(f"init_process_groups: {problem}")
    links = cfg.links_figures
    if ulysses_size == "auto":
        ulysses_size = choose_ulysses_size(sp_size, heads=heads, node_size=links.node_size if links else None,
                                           tp=tp_size)
        logger.info("[rank %d] seqpar: ulysses_size='auto' chose %d for sp_size %d", dist.get_rank(), ulysses_size, sp_size)
    check_ulysses_size(sp_size, ulysses_size)
    node_size = os.environ.get("LOCAL_WORLD_SIZE", "")  # set by torchrun / deepspeed / our SLURM script
    # the problems assume seqpar's grid (SP groups of consecutive ranks); a user's mesh is laid out by the user
    problems = [] if mesh is not None else node_layout_problems(
        dist.get_world_size(), sp_size, int(ulysses_size), int(node_size) if node_size.isdigit() else None, tp_size)
    for problem in problems:
        if dist.get_rank() == 0:
            logger.warning("seqpar: group layout: %s", problem)
    manager = ProcessGroupManager(sp_size, ulysses_size=ulysses_size, backend=backend, timeout=timeout, mesh=mesh,
                                  tp_size=tp_size)
    manager.owns_world = owns_world
    manager.sharding = declared
    from seqpar.runtime import liveness

    # names the lost rank when a collective fails (a heartbeat in the rendezvous store; no collectives)
    manager.liveness = liveness.start(dist.get_rank(), dist.get_world_size(), timeout.total_seconds() if timeout else None)
    manager.links = links
    set_default_manager(manager)
    return manager


def destroy_process_groups(manager: ProcessGroupManager | None = None) -> None:
    """Destroy what :func:`init_process_groups` created: ``manager``'s groups (default: the default
    manager's), and the world group if seqpar initialised it. Collective; a no-op when none is left."""
    manager = manager if manager is not None else default_manager()
    if manager is not None:
        manager.destroy()
