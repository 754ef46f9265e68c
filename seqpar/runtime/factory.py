"""The group factory: :class:`ProcessGroupManager` makes the SP, DP, SP-DP, TP and Ulysses / ring
process groups of one ``(dp, sp, tp)`` rank cube (:mod:`seqpar.runtime.grid`), or takes them from a
user's ``DeviceMesh`` (:mod:`seqpar.runtime.mesh`), and destroys what it made. It also keeps the
default manager (an edge convenience) and :func:`resolve_group`, the rule behind every ``group=None``.

The NCCL rules it follows:

- Every group is initialised when it is made, by one small collective of all its members
  (:mod:`seqpar.runtime.communicators`): NCCL would otherwise create a group's communicator at its first
  operation, which a ring rank with nothing to exchange in a step never joins. A group taken from a user's
  mesh is initialised the same way, since seqpar's ring runs on it.
- ``dist.new_group`` is collective: every rank creates every group, in the same order (each family is the
  cube with one axis moved last, each row one group, the same list on every rank).
- Single-rank groups (the model-parallel group when ``tp = 1``; the axes of size 1) are made with one
  local group creation per rank, not one collective creation per rank of the world. There is no
  pipeline parallelism: its group is this rank alone.

The SP-DP group (``dp x sp`` ranks, the whole world when ``tp = 1``) holds replicas of the same parameter
shards, so gradients are reduced over it; it is its own group object. The model-parallel group is the TP
group, for tools that ask for one (DeepSpeed's gradient clipping all-reduces the norm over it; ``None``
there would mean the whole world). The manager answers the Megatron/DeepSpeed ``mpu`` methods
(:mod:`seqpar.runtime.mpu`).
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from seqpar.config import Links
from seqpar.runtime import communicators
from seqpar.runtime.dynamic_groups import DynamicGroups
from seqpar.runtime.grid import check_ulysses_size, rank_cube
from seqpar.runtime.mesh import MeshAxes, MeshView, forget_dtensor_plans, mesh_axes
from seqpar.runtime.mpu import MpuInterface

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["ProcessGroupManager", "default_manager", "set_default_manager", "resolve_group"]

logger = logging.getLogger("seqpar")

_DEFAULT: ProcessGroupManager | None = None


class ProcessGroupManager(MeshView, MpuInterface, DynamicGroups):
    """The SP, DP, SP-DP and TP (model-parallel) groups of one ``(dp, sp, tp)`` rank cube.

    Build it once, collectively (every rank, same arguments), after
    ``torch.distributed.init_process_group``; then pass it (or its groups) to what needs them.

    Args:
        sp_size: sequence-parallel degree; must divide the world size (with ``mesh``: the mesh's SP
            size, or ``None``).
        ulysses_size: the Ulysses (all-to-all) degree inside each SP group; must divide ``sp_size``.
            The SP group splits into ``sp_size / u`` Ulysses groups of ``u`` consecutive ranks and
            ``u`` ring groups across them (see :mod:`seqpar.runtime.grid`). Default 1: no Ulysses axis.
        tp_size: tensor-parallel degree (innermost: ``tp`` consecutive ranks); ``sp_size x tp_size``
            must divide the world size (with ``mesh``: the mesh's ``"tp"`` size, or ``None``). Default 1.
        backend: backend for the new groups (default: the default group's backend).
        timeout: timeout of the new groups' collectives (default: torch's).
        high_priority_streams: NCCL groups seqpar creates run their kernels on a high-priority CUDA stream
            (:func:`seqpar.runtime.communicators.high_priority_options`); no effect on gloo. Default False.
        dynamic_min_size: make the groups of length-aware dynamic CP (``sequence_parallel.dynamic``): the
            aligned groups of every size the planner may choose, from this smallest size up (see
            :meth:`dynamic_group`). ``None`` (default): none.
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
        dynamic_min_size: int | None = None,
        high_priority_streams: bool = False,
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
        if high_priority_streams:  # NCCL: every group below runs its kernels on a high-priority stream
            kw["high_priority"] = True
        # dist.new_group is collective: every rank creates every group, in the same order. Every group
        # is initialised at once, by all its members (seqpar.runtime.communicators): NCCL would otherwise
        # create it at its first operation, which a ring rank with no hop in a step never joins.
        # The family of every axis is the cube with that axis moved last (each row one group).
        if axes is None:
            self._sp_group = self._new_groups(self._family(1), kw)
            self._dp_group = self._new_groups(self._family(0), kw)
        else:
            self._sp_group = mesh.get_group(axes.sp_dim)
            communicators.init_communicator(self._sp_group)  # the user's group, but seqpar's ring runs on it
        # the ranks holding replicas of the same parameter shards: the grid of every TP rank
        self._sp_dp_group = self._new_groups(self.cube.permute(2, 0, 1).reshape(self.tp_size, -1).tolist(), kw)
        # this rank alone (one local creation per rank), for the axes of size 1; the TP group when tp = 1
        self._self_group = self._new_groups([[r] for r in range(self._world_size)], kw)
        if self.tp_size == 1:
            self._tp_group = self._self_group
        elif axes is not None and axes.tp_dim is not None:
            self._tp_group = mesh.get_group(axes.tp_dim)
            communicators.init_communicator(self._tp_group)
        else:
            self._tp_group = self._new_groups(self._family(2), kw)
        if axes is not None:
            self._dp_group = self._mesh_dp_group(mesh, axes, kw)
        self._ulysses_group, self._ring_group = self._make_ulysses_ring_groups(kw)
        # length-aware dynamic CP: every size's aligned groups, made now, never during a step
        self._dynamic_groups: dict[int, dist.ProcessGroup] = (
            {} if dynamic_min_size is None else self._make_dynamic_groups(dynamic_min_size, kw))
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
        mine = communicators.new_groups(rank_lists, self._rank, **kw)
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
            communicators.init_communicator(group)
            return group
        try:
            flat = mesh["dp"].get_group() if "dp" not in mesh.mesh_dim_names else None
        except (KeyError, ValueError, RuntimeError):  # no flattened "dp" on this mesh
            flat = None
        if flat is not None and dist.get_process_group_ranks(flat) == self.dp_ranks:
            communicators.init_communicator(flat)
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
        forget_dtensor_plans()
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
    def self_group(self) -> dist.ProcessGroup:
        """This rank alone (made by one local creation per rank): the group of every axis of size 1, and
        the pipeline group (there is no pipeline parallelism)."""
        return self._self_group

    @property
    def sp_ranks(self) -> list[int]:
        """Global ranks of this rank's SP group, in SP-rank order."""
        return self.grid[self._dp_rank].tolist()

    @property
    def dp_ranks(self) -> list[int]:
        """Global ranks of this rank's DP group, in DP-rank order."""
        return self.grid[:, self._sp_rank].tolist()


# -------------------------------------------------------------------- default instance
def default_manager() -> ProcessGroupManager | None:
    """The manager last made by ``init_process_groups`` (or set), if any. An edge convenience."""
    return _DEFAULT


def set_default_manager(manager: ProcessGroupManager | None) -> None:
    """Record ``manager`` as the default (``None`` forgets it)."""
    global _DEFAULT
    _DEFAULT = manager


def _not_a_member(group: object) -> bool:
    """This rank is outside ``group`` (``dist.new_group(ranks)`` on a rank not in ``ranks``): torch gives it rank -1.
    Also while compiling: dynamo folds the lookup into a constant at trace time (no op in the graph), and without it
    a compiled call on such a rank failed deep inside the attention on ``AttributeError('group_name')``."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    try:
        return dist.get_rank(group) < 0
    except (RuntimeError, ValueError, TypeError, AttributeError):  # not a registered group (a test's stand-in)
        return False


def resolve_group(group: dist.ProcessGroup | None = None) -> dist.ProcessGroup | None:
    """The group a collective should use; the one rule behind every ``group=None`` in seqpar.

    - ``group`` if given (``torch.distributed.group.WORLD`` to use the whole world on purpose); a group this rank
      is not a member of is refused (``ValueError``) naming the fix;
    - else the default manager's SP group (``seqpar.init_process_groups``);
    - else ``None`` when torch.distributed is not available or not initialised (a single process:
      world size 1);
    - else ``dist.group.WORLD`` on a world of one rank (the SP group can only be that rank);
    - else (a world of more than one rank and no manager) ``ValueError``: the SP group is not known,
      and silently taking the whole world would run SP across the DP ranks of a DP x SP job.
      Every rank raises the same error (it reads only the world size and the manager).
    """
    if group is not None:
        if _not_a_member(group):
            raise ValueError(
                f"group= is a process group this rank (global rank {dist.get_rank()}) is not in: every rank that "
                "passes it to seqpar must be a member (torch gives the others a size of -1, and collectives over it "
                "return at once on them). Pass the sequence-parallel group this rank belongs to (the manager's "
                "sp_group), or leave group= out after seqpar.init_process_groups(sp_size=...)"
            )
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
