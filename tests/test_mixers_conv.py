"""Sequence-parallel short causal convolutions (seqpar.mixers): the halo exchange and the sharded conv
alone against a float64 per-document reference, their halo bytes against theory, and a tiny LFM2
(conv + attention layers) swapped by swap_attention at SP=2 and SP=4, every attention mode, contiguous
and zigzag, on a packed batch, against each document run alone in one process without seqpar."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from mixer_parity import (
    RING_AND_ULYSSES,
    VOCAB,
    WORLD,
    assert_modes_run,
    assert_swap_keeps_state,
    checkpointed_parity,
    one_process_parity,
    sharded_parity,
)

from seqpar.config import SeqParConfig
from seqpar.mixers import causal_conv_shard, halo_plan
from seqpar.sequence.sharding import chunk_ids, gather_sequence, shard_sequence
from seqpar.swap import SwapError, swap_attention
from seqpar.testing.traffic import counting

transformers = pytest.importorskip("transformers")



# ----------------------------------------------------------------------------- the conv alone
def reference_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, cu: list[int] | None) -> torch.Tensor:
    """transformers' causal_conv1d_fn torch path, run on each document alone: x (B, C, S)."""
    bounds = cu if cu is not None else [0, x.shape[-1]]
    k = weight.shape[-1]
    outs = [F.conv1d(x[..., a:b], weight.unsqueeze(1), bias, padding=k - 1, groups=x.shape[1])[..., :b - a]
            for a, b in zip(bounds, bounds[1:]) if b > a]  # a zero-length document adds nothing
    return torch.cat(outs, dim=-1)


def _conv_parity(rank: int, world: int, sharding: str, seq: int, k: int, cu: list[int] | None) -> None:
    g = torch.Generator().manual_seed(7)
    batch, channels = 2, 3
    x = torch.randn(batch, channels, seq, generator=g, dtype=torch.float64)
    weight = torch.randn(channels, k, generator=g, dtype=torch.float64)
    bias = torch.randn(channels, generator=g, dtype=torch.float64)
    grad_out = torch.randn(batch, channels, seq, generator=g, dtype=torch.float64)

    xr, wr, br = (t.clone().requires_grad_() for t in (x, weight, bias))
    ref = reference_conv(xr, wr, br, cu)
    (ref * grad_out).sum().backward()

    group = WORLD if dist.is_initialized() else None
    xs, ws, bs = (t.clone().requires_grad_() for t in (x, weight, bias))
    x_local = shard_sequence(xs, -1, group=group, sharding=sharding, cu_seqlens=cu)
    out_local = causal_conv_shard(x_local, ws, bs, group=group, sharding=sharding, cu_seqlens=cu)
    g_local = shard_sequence(grad_out, -1, group=group, sharding=sharding, cu_seqlens=cu)
    (out_local * g_local).sum().backward()
    out = gather_sequence(out_local.detach(), -1, group=group, sharding=sharding, cu_seqlens=cu)
    torch.testing.assert_close(out, ref.detach(), rtol=1e-12, atol=1e-12)
    for name, got, want in (("x", xs.grad, xr.grad), ("weight", ws.grad, wr.grad), ("bias", bs.grad, br.grad)):
        got = got.clone()
        if world > 1:
            dist.all_reduce(got)  # each rank holds its share of the full gradient
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=lambda m, n=name: f"grad {n}: {m}")


# (seq, k, cu_seqlens): the second document starts 1-2 positions before a chunk edge at every world /
# sharding below (the halo reaches across it and must be masked), one document crosses shard edges,
# and with k=5 at 4 ranks zigzag (chunks of 3) a halo of 4 spans two earlier chunks on two ranks.
CONV_CASES = [
    (24, 4, None),
    (24, 4, [0, 5, 13, 24]),
    (24, 5, [0, 2, 11, 12, 24]),
]


@pytest.mark.parametrize("seq,k,cu", CONV_CASES)
@pytest.mark.parametrize("sharding", ["contiguous", "zigzag"])
def test_conv_one_process(sharding, seq, k, cu):
    _conv_parity(0, 1, sharding, seq, k, cu)


@pytest.mark.parametrize("world", [2, 4])
def test_conv_sharded_equals_each_document_alone(dist_pool, world):
    for sharding in ("contiguous", "zigzag", "balanced"):
        for seq, k, cu in CONV_CASES:
            dist_pool.run(world, _conv_parity, sharding, seq, k, cu, timeout=300)


def _conv_bf16(rank: int, world: int) -> tuple[float, float]:
    g = torch.Generator().manual_seed(11)
    seq, k, cu = 48, 4, [0, 5, 29, 48]
    x = torch.randn(2, 16, seq, generator=g, dtype=torch.float64)
    weight = torch.randn(16, k, generator=g, dtype=torch.float64)
    bias = torch.randn(16, generator=g, dtype=torch.float64)
    exact = reference_conv(x, weight, bias, cu)
    own = reference_conv(*(t.bfloat16() for t in (x, weight, bias)), cu).double()  # transformers' own bf16
    x_local = shard_sequence(x.bfloat16(), -1, group=WORLD, sharding="zigzag")
    out_local = causal_conv_shard(x_local, weight.bfloat16(), bias.bfloat16(), group=WORLD, sharding="zigzag",
                                  cu_seqlens=cu)
    assert out_local.dtype == torch.bfloat16
    out = gather_sequence(out_local, -1, group=WORLD, sharding="zigzag").double()
    return float((out - exact).abs().max()), float((own - exact).abs().max())


def test_conv_bf16_no_worse_than_one_process_bf16(dist_pool):
    for ours, own in dist_pool.run(2, _conv_bf16):
        assert ours <= 1.01 * own, (ours, own)


def test_halo_plan_spans_chunks_and_skips_document_starts():
    # 4 ranks zigzag, S=24: chunks of 3; rank r holds chunks r and 7-r. k=5: halo of 4 > chunk.
    plan = halo_plan(4, "zigzag", 24, None, 4)
    to_chunk5 = [p for p in plan.pieces if (p.dst_rank, p.dst_chunk) == (2, 1)]  # chunk 5 = positions 15..17
    # positions 11..14: position 11 from chunk 3 (rank 3, local 0), 12..14 from chunk 4 (rank 3, local 1)
    assert [(p.src_rank, p.src_offset, p.dst_offset, p.length) for p in to_chunk5] == [(3, 2, 0, 1), (3, 3, 1, 3)]
    # a chunk starting a document gets nothing; one starting 1 position into it gets 1 position
    plan = halo_plan(2, "contiguous", 24, (0, 12, 24), 3)
    assert plan.pieces == ()
    plan = halo_plan(2, "contiguous", 24, (0, 11, 24), 3)
    assert [(p.src_rank, p.src_offset, p.dst_rank, p.dst_offset, p.length) for p in plan.pieces] == [(0, 11, 1, 2, 1)]


def _halo_bytes(rank: int, world: int, sharding: str) -> tuple[int, int, int, int]:
    batch, channels, seq, k = 2, 5, 32, 4
    x = torch.randn(batch, channels, seq // world, dtype=torch.float32, requires_grad=True)
    weight = torch.randn(channels, k, requires_grad=True)
    with counting(world) as traffic:
        out = causal_conv_shard(x, weight, None, group=WORLD, sharding=sharding)
        forward = traffic.p2p_bytes
        out.sum().backward()
    # Theory: (k-1) x channels x batch x 4 bytes for each of my chunks whose successor lives elsewhere.
    mine = chunk_ids(rank, world, sharding)
    total = len(mine) * world
    owner = {g: r for r in range(world) for g in chunk_ids(r, world, sharding)}
    sends = sum(1 for g in mine if g + 1 < total and owner[g + 1] != rank)
    receives = sum(1 for g in mine if g > 0 and owner[g - 1] != rank)
    halo = (k - 1) * channels * batch * 4
    return forward, traffic.p2p_bytes - forward, sends * halo, receives * halo


@pytest.mark.parametrize("world,sharding", [(2, "contiguous"), (4, "zigzag")])
def test_halo_bytes_per_rank_per_layer(dist_pool, world, sharding):
    counted = dist_pool.run(world, _halo_bytes, sharding)
    for forward, backward, sends, receives in counted:
        assert forward == sends
        assert backward == receives  # the dual: each received halo's gradient goes home
    assert sum(r[0] for r in counted) == sum(r[1] for r in counted) > 0


# ----------------------------------------------------------------------------- a tiny LFM2
# The LFM2 family: (extra config fields). LFM2-MoE's layer 2 (a conv layer) has experts.
FAMILIES = {
    "Lfm2": {},
    "Lfm2Moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, num_dense_layers=2),
    "Lfm3": {},
}


def tiny_lfm2(dtype: torch.dtype, family: str = "Lfm2") -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = getattr(transformers, f"{family}Config")(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, conv_L_cache=4, layer_types=["conv", "full_attention", "conv"], use_cache=False,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, **FAMILIES[family])
    # grouped_mm (the MoE default) has no float64
    model = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation="eager").to(dtype)
    with torch.no_grad():  # random (not zero) conv biases, so their gradients are checked too
        for layer in model.model.layers:
            if hasattr(layer, "conv") and layer.conv.conv.bias is not None:
                layer.conv.conv.bias.normal_()
    return model


ROUTES = {"model.layers.1.self_attn": "hf", "model.layers.0.conv": "mixer", "model.layers.2.conv": "mixer"}


def _lfm2_parity(rank: int, world: int, sharding: str, family: str = "Lfm2", modes: list[dict] | None = None) -> list[str]:
    # the hybrid's halo uses the manager's SP group (mixer_parity.sharded_parity)
    return sharded_parity(functools.partial(tiny_lfm2, family=family), ROUTES, world, sharding, modes)


def test_lfm2_packed_one_process_equals_each_document_alone():
    # transformers' own torch path convolves across the documents of a packed batch; the swapped one does not.
    one_process_parity(tiny_lfm2)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("sharding", ["contiguous", "zigzag"])
def test_lfm2_sharded_equals_each_document_alone(dist_pool, world, sharding):
    assert_modes_run(dist_pool, world, _lfm2_parity, sharding)


@pytest.mark.parametrize("world,family,sharding", [(2, "Lfm2", "balanced"), (4, "Lfm2", "balanced"),
                                                   (2, "Lfm2Moe", "zigzag"), (2, "Lfm3", "zigzag")])
def test_lfm2_family_and_balanced(dist_pool, world, family, sharding):
    if not hasattr(transformers, f"{family}Config"):
        pytest.skip(f"transformers {transformers.__version__} has no {family}")
    assert_modes_run(dist_pool, world, _lfm2_parity, sharding, family, mode_list=RING_AND_ULYSSES)


def test_zero_length_documents_are_accepted_by_the_mixers_check():
    """A mixer called directly (not through a swapped model, whose batch read drops repeats first) with repeated
    ``cu_seqlens`` entries (zero-length documents, as flash-attn varlen and Megatron's fixed-size padding pass
    them) equals each document alone in float64, output and every gradient; a decreasing entry is still refused.
    Seen failing: with scan_layout.shard_boundaries' strict check restored (``b <= a``): 'must be strictly
    increasing' for [0, 4, 4, 10, 10]."""
    _conv_parity(0, 1, "contiguous", 10, 4, [0, 4, 4, 10, 10])
    _conv_parity(0, 1, "contiguous", 10, 4, [0, 0, 3, 3, 10])
    with pytest.raises(ValueError, match=r"cu_seqlens \[0, 4, 3, 10\] must not decrease"):
        causal_conv_shard(torch.randn(1, 3, 10), torch.randn(3, 4), cu_seqlens=[0, 4, 3, 10])


def test_bad_shards_are_a_clear_error():
    weight = torch.randn(3, 4)
    with pytest.raises(ValueError, match="cu_seqlens .* must not decrease, running from 0 to the global length 10"):
        causal_conv_shard(torch.randn(1, 3, 10), weight, cu_seqlens=[0, 4, 9])
    with pytest.raises(ValueError, match="cannot be cut into 2 equal chunks .*sharding='zigzag': pad it"):
        causal_conv_shard(torch.randn(1, 3, 7), weight, sharding="zigzag")


def _lfm2_checkpointed(rank: int, world: int) -> None:
    checkpointed_parity(tiny_lfm2, world)  # the recompute repeats the halo exchange, on every rank alike


def test_lfm2_with_activation_checkpointing(dist_pool):
    dist_pool.run(2, _lfm2_checkpointed, timeout=300)


def test_swap_keeps_parameters_and_state_dict():
    report = assert_swap_keeps_state(tiny_lfm2(torch.float32), "model.layers.0.conv", "Lfm2ShortConv")
    assert report.routes["model.layers.0.conv"] == "mixer" and report.swapped[-1].cls == "Lfm2ShortConv"


def test_conv_left_out_of_the_swap_is_still_refused():
    # swap limited to the attention modules: the conv layers stay transformers' own, and the
    # position-mixing probe refuses them by name; nothing is changed.
    model = tiny_lfm2(torch.float32)
    with pytest.raises(SwapError, match=r"model\.layers\.0\.conv.*Lfm2ShortConv"):
        swap_attention(model, SeqParConfig(swap=("*self_attn",)))
    assert type(model.model.layers[0].conv).__name__ == "Lfm2ShortConv"


def test_cache_is_refused():
    model = tiny_lfm2(torch.float32)
    swap_attention(model)
    with pytest.raises(ValueError, match="cache"):
        model.model.layers[0].conv(torch.randn(1, 5, 32), cache=object())
