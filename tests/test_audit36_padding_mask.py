"""Audit 36 (session 37), ``SwappedMixer.padding_mask`` on a swapped mixer called directly at P = 2 (gloo, zigzag):

- a one-row padding mask ``(1, seq)``, which transformers' ``apply_mask_to_padding_states`` broadcasts over the
  batch, is accepted as this rank's shard and gives exactly what transformers' layer gives on the whole sequence
  with the whole one-row mask (float64; LFM2's short convolution and Mamba);
- a mask of a wrong length that is not the whole sequence's (``2 x seq_local - 1`` tokens) is refused without the
  claim that it is the whole sequence's mask;
- the refusal names the rank in the mixer's own SP group (a one-rank group on global rank 1 is "SP rank 0 of 1").

Seen failing: the batch test as ``== batch`` (audit 36's MX2) -> the one-row mask refused ("has batch 1"); the
whole-sequence test as ``> seq_local`` (MX5) -> the 15-token mask called the whole sequence's; the rank taken from
the world (MX7) -> "SP rank 1 of 1"."""

from __future__ import annotations

import pytest
import test_mixers_padding_mask
import torch
import torch.distributed as dist

from seqpar.sequence.sharding import gather_sequence, shard_sequence

transformers = pytest.importorskip("transformers")


def _short_conv() -> tuple[torch.nn.Module, type]:
    return test_mixers_padding_mask._short_conv()[:2]  # LFM2's short conv and its seqpar class


def _mamba() -> tuple[torch.nn.Module, type]:
    return test_mixers_padding_mask._mamba()[:2]


LAYERS = {"short_conv": _short_conv, "mamba": _mamba}


def _one_row_mask(rank: int, world: int, name: str) -> float:
    layer, sp_class = LAYERS[name]()
    seq, batch = 8 * world, 2
    g = torch.Generator().manual_seed(11)
    h = torch.randn(batch, seq, 16, generator=g, dtype=torch.float64)
    mask = torch.ones(1, seq, dtype=torch.long)
    mask[0, :3] = 0  # left padding shared by every row
    mask[0, seq - 2] = 0
    with torch.no_grad():
        ref = layer(h, attention_mask=mask)
    cut = dict(group=dist.group.WORLD, sharding="zigzag")
    sp = sp_class(layer, **cut)
    with torch.no_grad():
        out = sp(shard_sequence(h, 1, **cut), attention_mask=shard_sequence(mask, 1, **cut))
    got = gather_sequence(out, 1, **cut)
    return float((got - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_a_one_row_mask_is_broadcast_as_transformers_does(dist_pool, name: str) -> None:
    errs = dist_pool.run(2, _one_row_mask, name, timeout=120)
    # the convolution is float64 throughout; Mamba's scan runs partly in fp32 (test_mixers_mamba)
    tol = 1e-12 if name == "short_conv" else 1e-6
    assert all(e <= tol for e in errs), errs


def _refusals(rank: int, world: int) -> tuple[str, str]:
    layer, sp_class = _short_conv()
    seq_local = 8
    h = torch.randn(2, seq_local, 16, dtype=torch.float64)
    sp = sp_class(layer, group=dist.group.WORLD, sharding="zigzag")
    with pytest.raises(ValueError) as wrong_length:
        sp(h, attention_mask=torch.ones(2, seq_local * world - 1))
    groups = [dist.new_group([r]) for r in range(world)]  # every rank makes every group (torch's rule)
    alone = sp_class(layer, group=groups[rank], sharding="zigzag")
    with pytest.raises(ValueError) as own_group:
        alone(h, attention_mask=torch.ones(2, seq_local + 1))
    return str(wrong_length.value), str(own_group.value)


def test_refusals_name_the_mask_and_the_groups_rank(dist_pool) -> None:
    for rank, (wrong_length, own_group) in enumerate(dist_pool.run(2, _refusals, timeout=120)):
        assert "does not match" in wrong_length and "whole sequence" not in wrong_length, (rank, wrong_length)
        assert "seqpar.shard_sequence" in wrong_length, (rank, wrong_length)
        assert "on SP rank 0 of 1" in own_group, (rank, own_group)
