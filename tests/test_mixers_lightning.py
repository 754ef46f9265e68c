"""Sequence-parallel lightning attention (seqpar.mixers.lightning, MiniMax): the swapped layer alone against
transformers' own layer run on each document (float64, every gradient; shards spanning several blocks and
ending mid-block), its summary bytes against theory, and a tiny MiniMax (one lightning layer, one softmax
attention layer) swapped by swap_attention at SP=2 and SP=4, every attention mode, contiguous and zigzag
(and balanced), on a packed batch of 5 documents, against each document run alone in one process."""

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
    elementwise,
    layer_bf16_errors,
    layer_parity,
    one_process_parity,
    sharded_parity,
    simple_gla_by_token,
)

from seqpar.mixers.lightning import SeqParLightningAttention
from seqpar.mixers.state_passing import summary_bytes
from seqpar.swap import swap_attention

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "MiniMaxConfig"):
    pytest.skip("this transformers has no MiniMax", allow_module_level=True)

BLOCK = 8  # the layer's block size: shards of 24, 12 and 6 positions span several blocks and end mid-block


def tiny(dtype: torch.dtype, layer_types: tuple[str, ...] = ("linear_attention", "full_attention")) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.MiniMaxConfig(
        vocab_size=61, hidden_size=32, intermediate_size=32, num_hidden_layers=len(layer_types), num_attention_heads=4,
        num_key_value_heads=4, head_dim=8, layer_types=list(layer_types), block_size=BLOCK, num_local_experts=2,
        num_experts_per_tok=2, initializer_range=0.2, use_cache=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    # two experts per token: with one, MiniMax renormalises the routing weight to exactly 1 and the router's
    # gradient is 0, so no test could see an error in it (seen: the router's reduced gradient doubled at SP > 1
    # passed test_minimax_sharded_equals_each_document_alone with one expert per token, fails with two).
    # grouped_mm (the MoE default) has no float64
    return transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation="eager").to(dtype)


ROUTES = {"model.layers.0.self_attn": "mixer", "model.layers.1.self_attn": "hf"}


# ----------------------------------------------------------------------------- the layer alone
def _call(layer: torch.nn.Module, x: torch.Tensor, position_ids: torch.Tensor, **kwargs) -> torch.Tensor:
    return layer(x, None, None, **kwargs)[0]  # no position embeddings, no mask: the output alone


def _layer_parity(rank: int, world: int, sharding: str, cu: list[int]) -> tuple[int, int]:
    layer = tiny(torch.float64).model.layers[0].self_attn
    assert type(layer).__name__ == "MiniMaxLightningAttention"
    with torch.no_grad():  # the decay buffers were computed in fp32 at init: recompute them in float64
        for name, value in zip(("query_decay", "key_decay", "diagonal_decay"), layer.decay_factors(layer.slope_rate)):
            getattr(layer, name).copy_(value)
    counted = layer_parity(world, rank, layer, SeqParLightningAttention, _call, sharding, cu, 2, 32,
                           elementwise(1e-10), f"{world} ranks {sharding}, cu_seqlens {cu}")
    # theory: one all-gather of each local chunk's (transition (heads, 1, 1), state (batch, heads, d, d)) float64
    chunks = 2 if sharding == "zigzag" else 1
    summary = torch.empty(chunks, 4 + 2 * 4 * 8 * 8, dtype=torch.float64)
    return counted, summary_bytes(summary[:, :4], summary[:, 4:], world)


# (cu_seqlens): documents starting strictly inside chunks and at chunk starts (chunks of 24, 12 and 6 at
# 2 / 4 ranks contiguous / zigzag), one crossing several chunks; every chunk spans or cuts blocks of 8.
LAYER_CASES = [[0, 48], [0, 5, 12, 13, 30, 48], [0, 24, 47, 48]]


def test_layer_one_process():
    assert_bytes_as_theory(None, 1, _layer_parity, "contiguous", cases=LAYER_CASES)


@pytest.mark.parametrize("world,sharding", [(2, "contiguous"), (2, "zigzag"), (4, "zigzag")])
def test_layer_sharded_equals_each_document_alone(dist_pool, world, sharding):
    assert_bytes_as_theory(dist_pool, world, _layer_parity, sharding, cases=LAYER_CASES)


# ----------------------------------------------------------------------------- a tiny MiniMax
def _parity(rank: int, world: int, sharding: str, mode_list: list[dict] | None = None) -> list[str]:
    return sharded_parity(tiny, ROUTES, world, sharding, mode_list)


def test_packed_one_process_equals_each_document_alone():
    one_process_parity(tiny)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("sharding", ["contiguous", "zigzag"])
def test_minimax_sharded_equals_each_document_alone(dist_pool, world, sharding):
    assert_modes_run(dist_pool, world, _parity, sharding)


def test_minimax_balanced(dist_pool):
    assert_modes_run(dist_pool, 2, _parity, "balanced", mode_list=RING_AND_ULYSSES)


# ----------------------------------------------------------------------------- errors, swap
def test_swap_keeps_parameters_buffers_and_state_dict():
    report = assert_swap_keeps_state(tiny(torch.float32), "model.layers.0.self_attn", "MiniMaxLightningAttention")
    assert report.routes == ROUTES


def test_lightning_left_out_of_the_swap_is_still_refused():
    assert_left_out_refused(tiny(torch.float32), ("model.layers.1.self_attn",), "model.layers.0.self_attn",
                            "MiniMaxLightningAttention")


def test_cache_and_bad_documents_are_clear_errors():
    model = tiny(torch.float32)
    swap_attention(model)
    assert_clear_call_errors(model.model.layers[0].self_attn, _call, 32, {"cache": object()})


def _bf16(rank: int, world: int) -> tuple[float, float]:
    layer = tiny(torch.float64).model.layers[0].self_attn
    return layer_bf16_errors(world, rank, layer, SeqParLightningAttention, _call, [0, 5, 29, 48], 32)


def test_bf16_no_worse_than_one_process_bf16(dist_pool):
    for ours, own in dist_pool.run(2, _bf16, timeout=300):
        assert 0 < ours <= 1.5 * own, (ours, own)


# ----------------------------------------------------------------------------- the kernel dispatch
def test_flash_linear_attention_kernel_is_used_where_importable(monkeypatch):
    # On CUDA with flash-linear-attention importable, each run of positions goes to its chunk_simple_gla
    # (lightning attention = simple GLA with g_gamma = -slope, scale 1). Here: a fake fla module on "cpu"
    # that runs the recurrence token by token in the kernel's (batch, seq, heads, dim) layout.
    import sys
    import types

    from seqpar.mixers import lightning

    calls = []

    def chunk_simple_gla(q, k, v, g_gamma, scale, output_final_state, initial_state=None, cu_seqlens=None):
        calls.append(q.shape[1])
        assert initial_state is None and cu_seqlens is None and output_final_state
        return simple_gla_by_token(q, k, v, g_gamma, scale, output_final_state)

    fla = types.ModuleType("fla")
    fla.ops = types.ModuleType("fla.ops")
    fla.ops.simple_gla = types.ModuleType("fla.ops.simple_gla")
    fla.ops.simple_gla.chunk_simple_gla = chunk_simple_gla
    monkeypatch.setitem(sys.modules, "fla", fla)
    monkeypatch.setitem(sys.modules, "fla.ops", fla.ops)
    monkeypatch.setitem(sys.modules, "fla.ops.simple_gla", fla.ops.simple_gla)
    assert lightning.lightning_kernel(torch.device("cpu"), "auto") is None  # not a kernel device
    monkeypatch.setattr(lightning, "KERNEL_DEVICES", {"cpu"})
    # opt-in (issue 28): the default ("torch") keeps the torch path with the kernel importable
    assert lightning.lightning_kernel(torch.device("cpu")) is None
    one_process_parity(tiny)
    assert not calls
    assert lightning.lightning_kernel(torch.device("cpu"), "auto") is chunk_simple_gla
    one_process_parity(tiny, {"mixer_kernels": "auto"})
    assert calls  # one call per document run
