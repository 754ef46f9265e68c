"""Process groups for sequence parallelism, all cut from one rank grid.

Axis order (outermost first)::

    grid = torch.arange(world_size).view(dp_size, sp_size)   # (dp, sp)

- SP group i = row i = ranks ``[i*sp, (i+1)*sp)``: consecutive ranks, so SP traffic (the heavy,
  latency-bound K/V exchange) stays inside a node when ranks are numbered node by node.
- DP group j = column j = ranks ``j, j+sp, j+2*sp, ...``: the strided complement.
- SP-DP group = every rank: all ranks hold replicas of the same parameters (no tensor or pipeline
  parallelism here), so gradients are reduced over the whole world. It is its own group object.
- Model-parallel group = this rank alone (size 1), for tools that ask for one.

With ``ulysses_size = u`` (u divides sp), each SP group is itself a ``(sp/u, u)`` grid::

    sp_grid = sp_ranks.view(sp // u, u)   # (ring, ulysses)

- Ulysses group = row = ``u`` consecutive SP ranks (the inner, intra-node axis: all-to-all traffic);
- ring group = column = SP ranks ``i, i+u, i+2u, ...`` (the outer axis: point-to-point ring traffic).
``u = 1`` (the default) makes no new groups (Ulysses group = this rank, ring group = the SP group), and
``u = sp`` neither (Ulysses group = the SP group, ring group = this rank).

``ProcessGroupManager`` exposes the Megatron/DeepSpeed ``mpu`` methods, so it can be handed to
``deepspeed.initialize(mpu=manager)``: DeepSpeed then reduces gradients over
``get_sequence_data_parallel_group()`` and sizes its data loader by ``get_data_parallel_*``.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from seqpar.config import SeqParConfig

__all__ = [
    "ProcessGroupManager",
    "init_process_groups",
    "destroy_process_groups",
    "default_manager",
    "set_default_manager",
    "resolve_group",
    "rank_grid",
    "check_divisible",
    "single_process_env",
    "timeout_of",
    "check_ulysses_size",
    "node_layout_problems",
]

logger = logging.getLogger("seqpar")

_DEFAULT: ProcessGroupManager | None = None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_divisible(world_size: int, sp_size: int) -> None:
    """Raise ``ValueError`` unless ``sp_size`` is a positive divisor of ``world_size``."""
    if isinstance(sp_size, bool) or not isinstance(sp_size, int) or sp_size < 1:
        raise ValueError(
            f"sequence_parallel.size must be a positive integer, got {sp_size!r}; choose a size "
            f"that divides the number of ranks {tuple(_divisors(world_size))}"
        )
    if world_size % sp_size:
        raise ValueError(
            f"world size {world_size} is not divisible by sequence_parallel.size {sp_size}; "
            f"choose a size that divides the number of ranks ({', '.join(map(str, _divisors(world_size)))})"
        )


def check_ulysses_size(sp_size: int, ulysses_size: int) -> None:
    """Raise ``ValueError`` unless ``ulysses_size`` is a positive divisor of ``sp_size``."""
    fix = f"choose a ulysses_size that divides sequence_parallel.size {sp_size} ({', '.join(map(str, _divisors(sp_size)))})"
    if isinstance(ulysses_size, bool) or not isinstance(ulysses_size, int) or ulysses_size < 1:
        raise ValueError(f"ulysses_size must be a positive integer or 'auto', got {ulysses_size!r}; {fix}")
    if sp_size % ulysses_size:
        raise ValueError(f"ulysses_size {ulysses_size} does not divide sequence_parallel.size {sp_size}; {fix}")


def rank_grid(world_size: int, sp_size: int) -> torch.Tensor:
    """The rank grid ``(dp_size, sp_size)``: row i is SP group i, column j is DP group j."""
    check_divisible(world_size, sp_size)
    return torch.arange(world_size).view(world_size // sp_size, sp_size)  # (dp, sp)


class ProcessGroupManager:
    """The SP, DP, SP-DP and model-parallel groups of one ``(dp, sp)`` rank grid.

    Build it once, collectively (every rank, same arguments), after
    ``torch.distributed.init_process_group``; then pass it (or its groups) to what needs them.

    Args:
        sp_size: sequence-parallel degree; must divide the world size.
        ulysses_size: the Ulysses (all-to-all) degree inside each SP group; must divide ``sp_size``.
            The SP group splits into ``sp_size / u`` Ulysses groups of ``u`` consecutive ranks and
            ``u`` ring groups across them (see the module docstring). Default 1: no Ulysses axis.
        backend: backend for the new groups (default: the default group's backend).
        timeout: timeout of the new groups' collectives (default: torch's).
    """

    def __init__(
        self,
        sp_size: int,
        *,
        ulysses_size: int = 1,
        backend: str | None = None,
        timeout: timedelta | None = None,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "ProcessGroupManager needs torch.distributed to be initialised; call "
                "seqpar.init_process_groups(...) (which initialises it from the environment) or "
                "torch.distributed.init_process_group(...) first"
            )
        self._world_size = dist.get_world_size()
        self._rank = dist.get_rank()
        self.grid = rank_grid(self._world_size, sp_size)  # (dp, sp)
        check_ulysses_size(sp_size, ulysses_size)
        self._dp_rank, self._sp_rank = divmod(self._rank, sp_size)
        self._ulysses_size = ulysses_size
        # link figures for mode="auto" (seqpar.attn.choose.Links); None = probe on first use
        self.links: Any = None
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
        # dist.new_group is collective: every rank creates every group, in the same order.
        self._sp_group = self._new_groups(self.grid.tolist(), kw)
        self._dp_group = self._new_groups(self.grid.t().tolist(), kw)
        self._sp_dp_group = self._new_groups([list(range(self._world_size))], kw)
        self._mp_group = self._new_groups([[r] for r in range(self._world_size)], kw)
        self._ulysses_group, self._ring_group = self._make_ulysses_ring_groups(kw)
        logger.info(
            "[rank %d] seqpar groups: world %d = dp %d x sp %d; sp group %s, dp group %s",
            self._rank,
            self._world_size,
            self.dp_size,
            self.sp_size,
            self.sp_ranks,
            self.dp_ranks,
        )

    def _new_groups(self, rank_lists: list[list[int]], kw: dict[str, Any]) -> dist.ProcessGroup:
        """Create one group per list on every rank; return the one that holds this rank."""
        mine = None
        for ranks in rank_lists:
            group = dist.new_group(ranks, **kw)
            if self._rank in ranks:
                mine = group
                self._created.append(group)  # other ranks' groups are not objects on this rank
        assert mine is not None
        return mine

    def _make_ulysses_ring_groups(self, kw: dict[str, Any]) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
        """The (Ulysses, ring) groups of this rank; new groups only when ``1 < u < sp``."""
        u, sp = self._ulysses_size, self.sp_size
        if u == 1:
            return self._mp_group, self._sp_group
        if u == sp:
            return self._sp_group, self._mp_group
        # every SP group's (sp/u, u) grid, stacked: (dp, ring, ulysses); collective, same order everywhere
        cube = self.grid.view(self.dp_size, sp // u, u)
        ulysses = self._new_groups(cube.reshape(-1, u).tolist(), kw)
        ring = self._new_groups(cube.transpose(1, 2).reshape(-1, sp // u).tolist(), kw)
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
        if default_manager() is self:
            set_default_manager(None)
        if self.owns_world:
            dist.destroy_process_group()

    def __repr__(self) -> str:
        return (
            f"ProcessGroupManager(rank={self._rank}, world_size={self._world_size}, "
            f"dp={self.dp_size}, sp={self.sp_size}, ulysses={self.ulysses_size})"
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
        return self._world_size

    def get_sequence_data_parallel_rank(self) -> int:
        return self._rank

    def get_model_parallel_group(self) -> dist.ProcessGroup:
        """A group holding only this rank: there is no tensor or pipeline parallelism."""
        return self._mp_group

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0

    # Newer Megatron/DeepSpeed spellings of the same (trivial) model-parallel axis.
    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_rank = get_model_parallel_rank

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self._rank

    get_pipeline_model_parallel_group = get_model_parallel_group
    get_pipeline_model_parallel_world_size = get_model_parallel_world_size
    get_pipeline_model_parallel_rank = get_model_parallel_rank


# -------------------------------------------------------------------- default instance
def default_manager() -> ProcessGroupManager | None:
    """The manager last made by ``init_process_groups`` (or set), if any. An edge convenience."""
    return _DEFAULT


def set_default_manager(manager: ProcessGroupManager | None) -> None:
    """Record ``manager`` as the default (``None`` forgets it)."""
    global _DEFAULT
    _DEFAULT = manager


def resolve_group(group: dist.ProcessGroup | None = None) -> dist.ProcessGroup | None:
    """The group a collective should use.

    ``group`` if given; else the default manager's SP group; else ``dist.group.WORLD`` when
    torch.distributed is initialised; else ``None`` (single process: treat as world size 1).
    """
    if group is not None:
        return group
    if _DEFAULT is not None:
        return _DEFAULT.sp_group
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return None


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


def _check_same_on_every_rank(sp_size: object, ulysses_size: object) -> None:
    """All-gather the requested sizes on the default group and raise on every rank if they differ:
    ranks that disagree would create different groups and hang in ``new_group``."""
    def code(x: object) -> int:
        return x if isinstance(x, int) and not isinstance(x, bool) else (0 if x == "auto" else -1)

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    mine = torch.tensor([code(sp_size), code(ulysses_size)], dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    rows = [t.cpu().tolist() for t in everyone]
    if any(row != rows[0] for row in rows):
        detail = "; ".join(f"rank {r}: sp_size={a}, ulysses_size={'auto' if b == 0 else b}" for r, (a, b) in enumerate(rows))
        raise ValueError(
            f"init_process_groups: the ranks asked for different group sizes ({detail}); "
            "call it on every rank with the same sp_size and ulysses_size (the same config)"
        )


def node_layout_problems(world_size: int, sp_size: int, ulysses_size: int, node_size: int | None) -> list[str]:
    """Why the SP / Ulysses groups of this layout would cross node boundaries (empty: they do not).

    Ranks are assumed numbered node by node (torchrun, the DeepSpeed launcher and SLURM do so), so
    the groups of consecutive ranks stay inside a node when their size divides the node size, or
    span whole nodes when it is a multiple of it.
    """
    if not node_size or node_size < 1 or node_size >= world_size:
        return []
    problems = []
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


def init_process_groups(
    sp_size: int | None = None,
    *,
    ulysses_size: int | str | None = None,
    config: SeqParConfig | None = None,
    backend: str | None = None,
    timeout: timedelta | None = None,
    heads: tuple[int, int] | None = None,
) -> ProcessGroupManager:
    """Build the SP/DP (and Ulysses/ring) groups, initialising torch.distributed from the environment
    if needed.

    Collective: call it on every rank with the same arguments.

    Args:
        sp_size: SP degree; default ``config.size``, or 1 when neither is given.
        ulysses_size: Ulysses degree ``u`` inside the SP group (divides ``sp_size``); default
            ``config.ulysses_size``, or 1. ``"auto"`` chooses it once, here, with
            :func:`seqpar.attn.choose.choose_ulysses_size` (the largest divisor of ``sp_size`` that fits
            in a node and, when ``heads`` is given, divides the query and K/V head counts).
        config: a ``SeqParConfig`` whose ``size`` / ``ulysses_size`` are used when the arguments are ``None``.
        backend: for a fresh ``init_process_group`` (``"nccl"`` when CUDA is available, else
            ``"gloo"``) and for the new groups.
        timeout: for a fresh ``init_process_group`` and the new groups' collectives (default:
            ``config.timeout_s``; a world group created before keeps its own).
        heads: ``(q_heads, kv_heads)`` of the model, used only by ``ulysses_size="auto"``.

    Returns:
        The manager, also recorded as the default (see ``default_manager``).

    Raises:
        ValueError (on every rank): the world size is not divisible by the SP size, ``ulysses_size``
        does not divide the SP size, or the ranks passed different sizes.
    """
    if sp_size is None:
        sp_size = config.size if config is not None else 1
    timeout = timeout_of(config, timeout)
    if ulysses_size is None:
        ulysses_size = getattr(config, "ulysses_size", 1) if config is not None else 1
    owns_world = not dist.is_initialized()
    if owns_world:
        _init_from_env(backend, timeout)
    _check_same_on_every_rank(sp_size, ulysses_size)
    check_divisible(dist.get_world_size(), sp_size)
    if ulysses_size == "auto":
        from seqpar.attn.choose import choose_ulysses_size

        node = config.links.get("node_size") if config is not None and getattr(config, "links", None) else None
        ulysses_size = choose_ulysses_size(sp_size, heads=heads, node_size=node)
        logger.info("[rank %d] seqpar: ulysses_size='auto' chose %d for sp_size %d", dist.get_rank(), ulysses_size, sp_size)
    check_ulysses_size(sp_size, ulysses_size)
    node_size = os.environ.get("LOCAL_WORLD_SIZE", "")  # set by torchrun / deepspeed / our SLURM script
    for problem in node_layout_problems(dist.get_world_size(), sp_size, int(ulysses_size),
                                        int(node_size) if node_size.isdigit() else None):
        if dist.get_rank() == 0:
            logger.warning("seqpar: group layout: %s", problem)
    manager = ProcessGroupManager(sp_size, ulysses_size=ulysses_size, backend=backend, timeout=timeout)
    manager.owns_world = owns_world
    from seqpar.runtime import liveness

    # names the lost rank when a collective fails (a heartbeat in the rendezvous store; no collectives)
    manager.liveness = liveness.start(dist.get_rank(), dist.get_world_size(), timeout.total_seconds() if timeout else None)
    if config is not None and getattr(config, "links", None):
        from seqpar.attn.choose import Links

        manager.links = Links(**config.links)
    set_default_manager(manager)
    return manager


def destroy_process_groups(manager: ProcessGroupManager | None = None) -> None:
    """Destroy what :func:`init_process_groups` created: ``manager``'s groups (default: the default
    manager's), and the world group if seqpar initialised it. Collective; a no-op when none is left."""
    manager = manager if manager is not None else default_manager()
    if manager is not None:
        manager.destroy()
