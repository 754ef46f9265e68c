"""Sequence-parallel RG-LRU blocks (seqpar.mixers.rglru, RecurrentGemma): the swapped block alone against
transformers' own block run on each document (every gradient), its summary bytes against theory, and a tiny
RecurrentGemma (one recurrent block, one attention block) swapped by swap_attention at SP=2 and SP=4, every
attention mode, contiguous and zigzag (and balanced), on a packed batch of 5 documents, against each
document run alone in one process. The RG-LRU restarts where position_ids is 0: under seqpar the shard's
position_ids are global (per document), so its resets fall where they do on one process."""

from __future__ import annotations

import pytest
import torch
from mixer_parity import (
    RING_AND_ULYSSES,
    assert_bytes_as_theory,
    assert_clear_call_errors,
    assert_left_out_refused,
    assert_modes_run,
    assert_swap_keeps_state,
    layer_bf16_errors,
    layer_parity,
    one_process_parity,
    relative_to_largest,
    sharded_parity,
)

from seqpar.mixers.rglru import SeqParRecurrentBlock
from seqpar.mixers.state_passing import summary_bytes
from seqpar.swap import swap_attention

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "RecurrentGemmaConfig"):
    pytest.skip("this transformers has no RecurrentGemma", allow_module_level=True)

WIDTH = 32


def tiny(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.RecurrentGemmaConfig(
        vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, head_dim=8, lru_width=WIDTH, conv1d_width=4, attention_window_size=64,
        block_types=["recurrent", "attention"], use_cache=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return transformers.AutoModelForCausalLM.from_config(cfg).to(dtype)


ROUTES = {"model.layers.0.temporal_block": "mixer", "model.layers.1.temporal_block": "hf"}


# ----------------------------------------------------------------------------- the block alone
def _block_parity(rank: int, world: int, sharding: str, cu: list[int]) -> tuple[int, int]:
    block = tiny(torch.float64).model.layers[0].temporal_block
    assert type(block).__name__ == "RecurrentGemmaRecurrentBlock"
    # The RG-LRU accumulates its state in fp32 even in float64 (its acc_dtype): agreement to 1e-6 of each
    # tensor's largest entry, not elementwise. The shard's position_ids are per document (the RG-LRU restarts at 0).
    counted = layer_parity(world, rank, block, SeqParRecurrentBlock,
                           lambda m, x, pos, **kw: m(x, pos, None, use_cache=False, **kw)[0], sharding, cu, 2, 32,
                           relative_to_largest(1e-6), f"{world} ranks {sharding}, cu_seqlens {cu}")
    # theory: one all-gather of each local chunk's (transition, state), both (batch, lru_width) fp32
    chunks = 2 if sharding == "zigzag" else 1
    summary = torch.empty(chunks, 2, WIDTH, dtype=torch.float32)
    return counted, summary_bytes(summary, summary, world)  # the conv's halo is P2P, not counted here


# (cu_seqlens): documents starting strictly inside chunks and at chunk starts (chunks of 24, 12 and 6 at
# 2 / 4 ranks contiguous / zigzag), one crossing several chunks.
BLOCK_CASES = [[0, 48], [0, 5, 12, 13, 30, 48], [0, 24, 47, 48]]


def test_block_one_process():
    assert_bytes_as_theory(None, 1, _block_parity, "contiguous", cases=BLOCK_CASES)


@pytest.mark.parametrize("world,sharding", [(2, "contiguous"), (2, "zigzag"), (4, "zigzag")])
def test_block_sharded_equals_each_document_alone(dist_pool, world, sharding):
    assert_bytes_as_theory(dist_pool, world, _block_parity, sharding, cases=BLOCK_CASES)


# ----------------------------------------------------------------------------- a tiny RecurrentGemma
def _parity(rank: int, world: int, sharding: str, mode_list: list[dict] | None = None) -> list[str]:
    return sharded_parity(tiny, ROUTES, world, sharding, mode_list)


def test_packed_one_process_equals_each_document_alone():
    one_process_parity(tiny)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("sharding", ["contiguous", "zigzag"])
def test_recurrent_gemma_sharded_equals_each_document_alone(dist_pool, world, sharding):
    assert_modes_run(dist_pool, world, _parity, sharding)


def test_recurrent_gemma_balanced(dist_pool):
    assert_modes_run(dist_pool, 2, _parity, "balanced", mode_list=RING_AND_ULYSSES)


# ----------------------------------------------------------------------------- errors, swap
def test_swap_keeps_parameters_and_state_dict():
    report = assert_swap_keeps_state(tiny(torch.float32), "model.layers.0.temporal_block",
                                     "RecurrentGemmaRecurrentBlock")
    assert report.routes == ROUTES


def test_recurrent_block_left_out_of_the_swap_is_still_refused():
    assert_left_out_refused(tiny(torch.float32), ("model.layers.1.temporal_block",), "model.layers.0.temporal_block",
                            "RecurrentGemmaRecurrentBlock")


def test_cache_and_bad_documents_are_clear_errors():
    model = tiny(torch.float32)
    swap_attention(model)
    assert_clear_call_errors(model.model.layers[0].temporal_block,
                             lambda m, x, pos, **kw: m(x, pos, None, **kw)[0], 32, {"use_cache": True})


def _bf16(rank: int, world: int) -> tuple[float, float]:
    block = tiny(torch.float64).model.layers[0].temporal_block
    return layer_bf16_errors(world, rank, block, SeqParRecurrentBlock,
                             lambda m, x, pos, **kw: m(x, pos, None, use_cache=False, **kw)[0], [0, 5, 29, 48], 32)


def test_bf16_no_worse_than_one_process_bf16(dist_pool):
    for ours, own in dist_pool.run(2, _bf16, timeout=300):
        assert 0 < ours <= 1.5 * own, (ours, own)
