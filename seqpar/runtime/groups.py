"""Process groups for sequence parallelism: the entry points, and the names callers import.

:func:`init_process_groups` starts torch.distributed from the launcher's environment if needed (or a
world of one under a plain ``python script.py``), checks that every rank asked for the same sizes and
sharding, chooses ``ulysses_size="auto"``, warns when groups would cross node boundaries, makes the
:class:`ProcessGroupManager` and records it as the default; :func:`destroy_process_groups` undoes it.

The parts live in their own modules, and every public name is re-exported here:

- :mod:`seqpar.runtime.grid`: the rank grid, ``(dp, sp, tp)`` with TP innermost and each SP group a
  ``(ring, ulysses)`` grid, and the checks on its sizes (integer arithmetic, no groups);
- :mod:`seqpar.runtime.factory`: the group factory, :class:`ProcessGroupManager` (every group cut from
  the grid and initialised at creation, NCCL's rule), the default manager and :func:`resolve_group`;
- :mod:`seqpar.runtime.mesh`: the mesh view, a torchtitan-style ``DeviceMesh`` as the source of the
  groups (:func:`mesh_axes`) and the manager's groups as a named ``DeviceMesh`` (``manager.mesh``);
- :mod:`seqpar.runtime.mpu`: the Megatron/DeepSpeed ``mpu`` methods, so the manager can be handed to
  ``deepspeed.initialize(mpu=manager)``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from seqpar.config import SHARDINGS, SeqParConfig
from seqpar.runtime.factory import (
    ProcessGroupManager,
    default_manager,
    resolve_group,
    set_default_manager,
)
from seqpar.runtime.grid import (
    check_divisible,
    check_layout,
    check_ulysses_size,
    choose_ulysses_size,
    divisors,
    dynamic_group_sizes,
    node_layout_problems,
    rank_cube,
    rank_grid,
    tp_heads_problem,
    ulysses_heads_ok,
)
from seqpar.runtime.mesh import DP_DIMS, SP_DIMS, TP_DIMS, MeshAxes, mesh_axes

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
                              tp_size: object = 1, dynamic_min_size: int | None = None) -> None:
    """All-gather the requested sizes (and declared sharding) on the default group and raise on every
    rank if they differ: ranks that disagree would create different groups and hang in ``new_group``,
    or cut one sequence two ways."""
    def code(x: object) -> int:
        return x if isinstance(x, int) and not isinstance(x, bool) else (0 if x == "auto" else -1)

    names = (None, *SHARDINGS)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    mine = torch.tensor([code(sp_size), code(ulysses_size), names.index(sharding) if sharding in names else -1,
                         code(tp_size), dynamic_min_size or 0], dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    rows = [t.cpu().tolist() for t in everyone]
    if any(row != rows[0] for row in rows):
        def shown(c: int) -> str:
            return repr(names[c]) if 0 <= c < len(names) else "invalid"

        detail = "; ".join(f"rank {r}: sp_size={a}, ulysses_size={'auto' if b == 0 else b}, sharding={shown(c)}, "
                           f"tp_size={t}, dynamic.min_size={m or 'off'}" for r, (a, b, c, t, m) in enumerate(rows))
        raise ValueError(
            f"init_process_groups: the ranks asked for different group sizes or shardings ({detail}); "
            "call it on every rank with the same sp_size, ulysses_size, tp_size, sharding and "
            "sequence_parallel.dynamic (the same config)"
        )


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
            ``links`` are used where the arguments are ``None``; its ``high_priority_streams`` puts the NCCL
            groups seqpar creates on high-priority streams. Its ``dynamic`` block (length-aware
            dynamic CP) also makes the aligned groups of every size the planner may choose
            (``manager.dynamic_group(size, index)``).
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
            ``heads``, ``ulysses_size`` does not divide the SP size, the ranks passed different sizes or
            shardings, ``sharding`` contradicts the config's, or the mesh has a dim seqpar cannot represent.
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
    dynamic_min = cfg.dynamic.min_size if cfg.dynamic is not None else None
    _check_same_on_every_rank(sp_size, ulysses_size, declared, tp_size, dynamic_min)
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
    if dynamic_min is not None:  # the pool must hold a group of min_size (every rank raises alike)
        dynamic_group_sizes(dist.get_world_size() // tp_size, dynamic_min)
    manager = ProcessGroupManager(sp_size, ulysses_size=ulysses_size, backend=backend, timeout=timeout, mesh=mesh,
                                  tp_size=tp_size, dynamic_min_size=dynamic_min,
                                  high_priority_streams=cfg.high_priority_streams)
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
