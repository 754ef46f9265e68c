"""Helpers every engine adapter shares: the log prefix, finding the process groups, and the loader wrapper
that cuts each batch along the sequence."""

from __future__ import annotations

import difflib
from collections.abc import Iterator, Mapping
from typing import Any, Self

import torch.distributed as dist

from seqpar.config import SeqParConfig
from seqpar.runtime.groups import ProcessGroupManager, default_manager, init_process_groups
from seqpar.sequence.batch import shard_batch

__all__ = ["BlockOptions", "check_block_keys", "rank_prefix", "resolve_manager", "ShardedLoader"]


def check_block_keys(d: Mapping[str, Any], keys: tuple[str, ...], block: str) -> None:
    """Refuse keys of a config block (``'fsdp'``, ``'fairscale'``) that its options do not have, naming the
    closest allowed key for each typo and the whole allowed list (ValueError)."""
    unknown = sorted(set(d) - set(keys))
    if unknown:
        close = [m for key in unknown for m in difflib.get_close_matches(key, keys, n=1, cutoff=0.75)]
        hint = f" (did you mean {close}?)" if close else ""
        raise ValueError(f"unknown key(s) {unknown} in '{block}'{hint}; allowed keys are {list(keys)}")


class BlockOptions:
    """Base of the options of one engine's config block: ``KEYS`` the keys ``__init__`` takes, ``BLOCK`` the
    block's name in the JSON (``"fsdp"``, ``"fairscale"``), both set by the subclass."""

    KEYS: tuple[str, ...] = ()
    BLOCK: str = ""

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> Self:
        """The options of block ``d`` (None: every default); ValueError on a key not in ``KEYS``."""
        d = dict(d or {})
        check_block_keys(d, tuple(cls.KEYS), cls.BLOCK)
        return cls(**d)


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


class ShardedLoader:
    """A data loader whose dict batches are cut along the sequence for this rank's SP shard.

    Iterating yields ``shard_batch(batch, group=group, ...)`` for each batch of ``loader`` (each tensor
    ``(batch, seq, ...)`` becomes this rank's ``(batch, seq_local, ...)``, labels shifted first when
    ``causal_lm``; see :func:`seqpar.sequence.batch.shard_batch`); ``len`` and other attributes come
    from the wrapped loader. The engine adapters' loaders (accelerate's ``ShardedBatches``, DeepSpeed's
    ``ShardedDeepSpeedLoader``) are this one.

    Raises:
        TypeError: (while iterating) the loader gave a batch that is not a dict.
    """

    def __init__(self, loader: Any, *, group: Any, sharding: str | None, causal_lm: bool = True,
                 ignore_index: int = -100, pad_token_id: int = 0) -> None:
        self.loader = loader
        self.group = group
        self.sharding = sharding
        self.causal_lm = causal_lm
        self.ignore_index = ignore_index
        self.pad_token_id = pad_token_id

    def shard(self, batch: Any) -> dict[str, Any]:
        """One batch of the wrapped loader, cut for this rank (a non-dict batch is refused by name)."""
        if not isinstance(batch, Mapping):
            raise TypeError(
                "sequence-parallel training needs dict batches ({'input_ids': ..., 'labels': ...}) "
                f"to know which tensors to cut; the loader gave {type(batch).__name__}. Return a dict "
                "from the dataset or collate_fn"
            )
        return shard_batch(
            batch, group=self.group, sharding=self.sharding, causal_lm=self.causal_lm,
            ignore_index=self.ignore_index, pad_token_id=self.pad_token_id,
        )

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for batch in self.loader:
            yield self.shard(batch)

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["loader"], name)
