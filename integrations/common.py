"""Helpers every engine adapter shares: the log prefix and finding the process groups."""

from __future__ import annotations

import torch.distributed as dist

from seqpar.config import SeqParConfig
from seqpar.runtime.groups import ProcessGroupManager, default_manager, init_process_groups

__all__ = ["rank_prefix", "resolve_manager"]


def rank_prefix() -> str:
    """``"[rank N]"`` for log lines (``"[rank -]"`` before torch.distributed is initialised)."""
    return f"[rank {dist.get_rank()}]" if dist.is_available() and dist.is_initialized() else "[rank -]"


def resolve_manager(config: SeqParConfig, manager: ProcessGroupManager | None) -> ProcessGroupManager:
    """``manager`` checked against ``config``; else the default manager if it has the config's SP
    size; else a new one built from ``config`` (collective: every rank must call it). The config's
    sharding, when it declares one, is declared on the manager (so batches, attention and the loss
    follow it by default).

    Raises:
        ValueError: ``manager`` has another SP size than ``config``, or declares another sharding.
    """
    if manager is None:
        manager = default_manager()
        if manager is None or manager.sp_size != config.size:
            return init_process_groups(config=config)  # declares config.sharding itself
    elif manager.sp_size != config.size:
        raise ValueError(
            f"the manager has SP size {manager.sp_size} but the config says {config.size}; build the "
            "manager from the same config"
        )
    if config.sharding is not None and manager.sharding not in (None, config.sharding):
        raise ValueError(
            f"the manager declares sharding {manager.sharding!r} but the config says {config.sharding!r}; "
            "build the manager from the same config (init_process_groups(config=...))"
        )
    if config.sharding is not None:
        manager.sharding = config.sharding
    return manager
