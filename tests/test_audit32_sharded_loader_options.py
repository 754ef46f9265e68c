"""The engine adapters' loader wrappers (accelerate's ``ShardedBatches``, DeepSpeed's ``ShardedDeepSpeedLoader``, both
:class:`seqpar.integrations.common.ShardedLoader` since session 31) pass every option they are given to
``shard_batch``: the SP group (accelerate's read from the manager), the sharding, ``causal_lm``, ``ignore_index`` and
``pad_token_id``. A dropped option is a silent wrong batch (labels shifted for a non-causal model, padding with
another token or label), and the only tests of the wrappers (tests/test_sharded_loader.py) never reach
``shard_batch``.

One process, no process group: ``shard_batch`` with ``group=None`` cuts for one rank; zigzag sharding pads an odd
length to a multiple of 2 with the pad token and the ignore label, so both show in the batch.
"""

from __future__ import annotations

import types

import pytest
import torch

from seqpar.sequence.batch import shard_batch


class _Loader:
    """One dict batch of ``(1, seq)`` random token ids and labels (fresh each test)."""

    def __init__(self, seq: int) -> None:
        g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
        self.batch = {"input_ids": torch.randint(1, 1000, (1, seq), generator=g),
                      "labels": torch.randint(1, 1000, (1, seq), generator=g)}

    def __iter__(self):
        yield {k: v.clone() for k, v in self.batch.items()}

    def __len__(self) -> int:
        return 1


def _wrap(which: str, loader: _Loader, group, **options):  # noqa: ANN001, ANN202
    from seqpar.integrations.accelerate import ShardedBatches
    from seqpar.integrations.deepspeed import ShardedDeepSpeedLoader

    if which == "accelerate":
        return ShardedBatches(loader, manager=types.SimpleNamespace(sp_group=group), **options)
    return ShardedDeepSpeedLoader(loader, group=group, **options)


@pytest.mark.parametrize("which", ["accelerate", "deepspeed"])
@pytest.mark.parametrize("seq,causal_lm", [(7, True), (8, False)])
def test_every_option_reaches_shard_batch(which: str, seq: int, causal_lm: bool) -> None:
    """The wrapper's batch equals ``shard_batch``'s with the same options (an odd length under zigzag: padded with
    pad token 5 and ignore label -7; an even one with ``causal_lm=False``: the labels not shifted), and differs from
    the defaults' batch, so a dropped option shows.

    Seen failing (session 31's code, audit 32): ``ShardedLoader.shard`` passing ``causal_lm=True`` (I3: the
    non-causal labels shifted, ``shift_labels`` for ``labels``), ``ignore_index=-100`` (I4: the pad label -100 for
    -7), ``pad_token_id=0`` (I5: the pad token 0 for 5)."""
    loader = _Loader(seq)
    options = dict(sharding="zigzag", causal_lm=causal_lm, ignore_index=-7, pad_token_id=5)
    (got,) = list(_wrap(which, loader, None, **options))
    want = shard_batch(next(iter(loader)), group=None, **options)
    default = shard_batch(next(iter(loader)), group=None, sharding="zigzag")
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    for key in want:
        assert torch.equal(got[key], want[key]), (key, got[key], want[key])
    assert sorted(default) != sorted(want) or any(not torch.equal(default[k], want[k]) for k in want)


@pytest.mark.parametrize("which", ["accelerate", "deepspeed"])
def test_the_sp_group_reaches_shard_batch(which: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The group ``shard_batch`` gets is the one given (accelerate's: ``manager.sp_group``), not the default (the
    whole world: every rank's shard of the whole world's sequence, under DP x SP). ``shard_batch`` is stood in by a
    recorder, since one process has no subgroup.

    Seen failing: ``ShardedBatches`` passing ``group=None`` to ``ShardedLoader`` (I6: None for the manager's
    group)."""
    import seqpar.integrations.common as common

    seen = []
    monkeypatch.setattr(common, "shard_batch", lambda batch, **kw: seen.append(kw) or batch)
    group = object()
    list(_wrap(which, _Loader(8), group, sharding="zigzag"))
    assert len(seen) == 1 and seen[0]["group"] is group, seen
