"""shard_batch and ShardedDataLoader: layouts, label shift, end padding, who gets which sample."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from seqpar.runtime.groups import init_process_groups
from seqpar.sequence.batch import ShardedDataLoader, global_positions, shard_batch
from seqpar.sequence.sharding import chunk_ids, num_chunks


def test_single_rank_shift_and_positions():
    ids = torch.arange(10, 18).view(1, 8)
    out = shard_batch({"input_ids": ids, "labels": ids.clone(), "meta": "kept"})
    assert "labels" not in out and out["meta"] == "kept"
    assert out["shift_labels"].tolist() == [[11, 12, 13, 14, 15, 16, 17, -100]]
    assert out["position_ids"].tolist() == [list(range(8))]
    assert torch.equal(out["input_ids"], ids)


def test_zigzag_single_rank_pads_odd_length_at_the_end():
    ids = torch.tensor([[5, 6, 7]])
    out = shard_batch({"input_ids": ids, "labels": ids, "attention_mask": torch.ones(1, 3)},
                      sharding="zigzag", pad_token_id=0)
    # 2 chunks of 2: [5, 6] [7, pad]; one rank holds both, in order
    assert out["input_ids"].tolist() == [[5, 6, 7, 0]]
    assert out["shift_labels"].tolist() == [[6, 7, -100, -100]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 3]]
    assert out["attention_mask"].tolist() == [[1, 1, 1, 1]]  # pads need no key mask (causal)


def test_right_padding_becomes_ignored_labels_left_padding_refused():
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    out = shard_batch({"input_ids": ids, "labels": ids, "attention_mask": mask})
    assert out["attention_mask"].tolist() == [[1] * 4, [1] * 4]
    assert out["shift_labels"].tolist() == [[2, 3, 4, -100], [6, -100, -100, -100]]
    with pytest.raises(ValueError, match="not right padding"):
        shard_batch({"input_ids": ids, "attention_mask": torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])})
    with pytest.raises(ValueError, match="causal_lm=False"):
        shard_batch({"input_ids": ids, "attention_mask": mask}, causal_lm=False)
    with pytest.raises(ValueError, match="causal_lm=False"):
        shard_batch({"input_ids": ids[:, :3]}, sharding="zigzag", causal_lm=False)
    with pytest.raises(ValueError, match="needs 'input_ids'"):
        shard_batch({"x": torch.ones(3)})


def _layout(rank: int, world_size: int, sharding: str, seq_len: int) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 50, (2, seq_len), generator=g)
    embeds = torch.randn(2, seq_len, 3, generator=g)
    out = shard_batch({"input_ids": ids, "labels": ids, "inputs_embeds": embeds}, group=torch.distributed.group.WORLD,
                      sharding=sharding)
    return {k: out[k] for k in ("input_ids", "shift_labels", "position_ids", "inputs_embeds")} | {"ids": ids}


@pytest.mark.parametrize("world,sharding,seq_len", [(2, "zigzag", 13), (2, "contiguous", 8), (4, "zigzag", 16)])
def test_shards_cover_the_padded_sequence(dist_pool, world, sharding, seq_len):
    outs = dist_pool.run(world, _layout, sharding, seq_len)
    n = num_chunks(world, sharding)
    padded = -(-seq_len // n) * n
    chunk = padded // n
    ids = outs[0]["ids"]
    full_ids = torch.cat([ids, ids.new_zeros(2, padded - seq_len)], dim=1)
    full_labels = torch.cat([ids[:, 1:], torch.full((2, padded - seq_len + 1), -100)], dim=1)
    for rank, out in enumerate(outs):
        pos = torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in chunk_ids(rank, world, sharding)])
        assert torch.equal(pos, global_positions(padded, rank, world, sharding))
        assert out["position_ids"].tolist() == [pos.tolist()] * 2  # global, also for the padding
        assert torch.equal(out["input_ids"], full_ids[:, pos])
        assert torch.equal(out["shift_labels"], full_labels[:, pos])  # true next token at shard ends
        assert out["inputs_embeds"].shape == (2, padded // world, 3)


class _Samples(Dataset):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": torch.arange(8) + 100 * i, "sample": i}


def _loader_view(rank: int, world_size: int) -> dict:
    manager = init_process_groups(2)  # 4 ranks = dp 2 x sp 2
    loader = ShardedDataLoader(DataLoader(_Samples(), batch_size=2, shuffle=True), manager=manager,
                               sharding="zigzag")
    epochs = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        epochs.append([(b["sample"].tolist(), b["position_ids"][0].tolist(), b["input_ids"].tolist())
                       for b in loader])
    dist.barrier()
    return {"len": len(loader), "dp": manager.dp_rank, "sp": manager.sp_rank, "epochs": epochs}


def test_loader_same_sample_across_sp_distinct_across_dp(dist_pool):
    views = dist_pool.run(4, _loader_view)
    for v in views:
        assert v["len"] == 3  # 12 samples / dp 2 / batch 2
    by = {(v["dp"], v["sp"]): v["epochs"] for v in views}
    for epoch in range(2):
        for dp in range(2):
            a, b = by[(dp, 0)][epoch], by[(dp, 1)][epoch]
            assert [s for s, _, _ in a] == [s for s, _, _ in b], "SP ranks must see the same samples"
            for (_, pos_a, ids_a), (_, pos_b, ids_b) in zip(a, b, strict=True):
                assert not set(pos_a) & set(pos_b), "SP ranks must hold distinct shards"
                assert sorted(pos_a + pos_b) == list(range(8))
                assert ids_a != ids_b
        seen = [sum((s for s, _, _ in by[(dp, 0)][epoch]), []) for dp in range(2)]
        assert not set(seen[0]) & set(seen[1]), "DP replicas must see distinct samples"
        assert sorted(seen[0] + seen[1]) == list(range(12))
    assert by[(0, 0)][0] != by[(0, 0)][1], "set_epoch must reshuffle"


def test_loader_refuses_what_it_cannot_split():
    from torch.utils.data import DistributedSampler, IterableDataset

    class Stream(IterableDataset):
        def __iter__(self):
            yield {"input_ids": torch.arange(4)}

    with pytest.raises(ValueError, match="map-style dataset"):
        ShardedDataLoader(DataLoader(Stream(), batch_size=1))
    wrong = DistributedSampler(_Samples(), num_replicas=4, rank=1)
    with pytest.raises(ValueError, match="num_replicas=4"):
        ShardedDataLoader(DataLoader(_Samples(), batch_size=2, sampler=wrong))
    plain = ShardedDataLoader(DataLoader(_Samples(), batch_size=4))
    assert len(plain) == 3 and next(iter(plain))["input_ids"].shape == (4, 8)


def test_balanced_labels_must_be_shifted_before_the_cut():
    from seqpar.sequence.loss import shift_labels_across_shards

    with pytest.raises(ValueError, match="shard_batch"):
        shift_labels_across_shards(torch.arange(8).view(1, 8), sharding="balanced")
    out = shard_batch({"input_ids": torch.arange(5).view(1, 5), "labels": torch.arange(5).view(1, 5)},
                      sharding="balanced")  # one rank: pads to a multiple of 8, shifts before the cut
    assert out["shift_labels"].tolist() == [[1, 2, 3, 4, -100, -100, -100, -100]]
