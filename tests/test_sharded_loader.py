"""The engine adapters' loader wrappers are one :class:`seqpar.integrations.common.ShardedLoader`: both refuse a
non-dict batch by name, pass ``len`` and other attributes through, and DeepSpeed's is also an iterator. No
process group: nothing here reaches ``shard_batch``."""

from __future__ import annotations

import types

import pytest


class _Loader:
    """A loader of tuple batches (what a dataset without a dict collate_fn gives), with an attribute of its own."""

    num_local_io_workers = 3

    def __iter__(self):
        yield (1, 2)

    def __len__(self) -> int:
        return 7


def _wrappers() -> list:
    from seqpar.integrations.accelerate import ShardedBatches
    from seqpar.integrations.deepspeed import ShardedDeepSpeedLoader

    return [ShardedBatches(_Loader(), manager=types.SimpleNamespace(sp_group=None), sharding=None),
            ShardedDeepSpeedLoader(_Loader(), group=None, sharding=None)]


@pytest.mark.parametrize("which", [0, 1], ids=["accelerate", "deepspeed"])
def test_a_non_dict_batch_is_refused_by_name(which: int) -> None:
    """Seen failing: with ShardedLoader.shard's Mapping check removed (shard_batch got the tuple and raised
    its own TypeError, "cannot convert dictionary update sequence element #0 to a sequence", naming neither dict
    batches nor collate_fn)."""
    loader = _wrappers()[which]
    assert len(loader) == 7 and loader.num_local_io_workers == 3
    with pytest.raises(TypeError, match=r"needs dict batches .* the loader gave tuple\. Return a dict from the "
                                        r"dataset or collate_fn"):
        next(iter(loader))


def test_the_deepspeed_loader_is_an_iterator() -> None:
    """DeepSpeed's own loader is an iterator (``next(loader)``), so its wrapper is one; accelerate's is not."""
    accelerate_loader, deepspeed_loader = _wrappers()
    with pytest.raises(TypeError, match="dict batches"):
        next(deepspeed_loader)
    assert not hasattr(type(accelerate_loader), "__next__")
