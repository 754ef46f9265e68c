"""The position-mixing guard (issue 19 §1): swap_attention accounts for every module that mixes
information across sequence positions. Each is either seqpar's swapped attention or named in a SwapError
with its path and class (seqpar.swap.probe), so a hybrid / state-space / convolution model, or an unknown
mixer a future transformers adds, is refused instead of silently running on each rank's shard.

Unknown mixers are inserted into a tiny Llama (a sequence cumsum, a causal conv1d, an attention keyword
argument seqpar does not know, a token shift written in a layer's own forward); real position-wise tiny
models must pass and real hybrids be refused naming their mixer. Single-process except the 2-rank cases.
"""

from __future__ import annotations

import os
import types

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from seqpar.sequence.sharding import shard_sequence
from seqpar.swap import SwapError, swap_attention
from seqpar.testing.deepspeed_teardown import releases_deepspeed_engines

transformers = pytest.importorskip("transformers")

VOCAB = 97
BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, use_cache=False)


def tiny(name: str, **fields: object) -> nn.Module:
    """A seeded random-init ``<name>ForCausalLM`` with the tiny BASE fields and ``fields``."""
    config = getattr(transformers, f"{name}Config")(**{**BASE, **fields})
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


# Real models that are position-wise once attention is self-only: must pass (no false positive).
POSITION_WISE = {
    "Llama": {}, "Qwen2": {}, "Qwen3": {}, "Mistral": {}, "Phi": {}, "Phi3": dict(pad_token_id=0),
    "Olmo2": {}, "Starcoder2": {}, "StableLm": {}, "Granite": {}, "Cohere2": {},
    "Gemma3Text": dict(head_dim=8, sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
    "GPT2": dict(n_embd=32, n_layer=2, n_head=4, attn_pdrop=0.0),
    "OPT": dict(ffn_dim=64, word_embed_proj_dim=32),
    "Mixtral": dict(num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0),
    "Qwen3Moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
    "GptOss": dict(num_local_experts=4, num_experts_per_tok=2, head_dim=8, sliding_window=4,
                   layer_types=["sliding_attention", "full_attention"]),
    "DeepseekV3": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, kv_lora_rank=16,
                       q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                       num_key_value_heads=4, first_k_dense_replace=1, n_group=1, topk_group=1),
}

GDN = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)

# Hybrids: (fields, the mixer's path, its class) -- the first mixer the refusal must name.
HYBRIDS = {
    # Ling / Bailing hybrid's lightning-style delta attention and ZAYA's convolved attention projection: no
    # sequence-parallel form in seqpar.mixers (yet), so refused by name
    "BailingHybrid": (dict(layer_types=["linear_attention", "full_attention"], pad_token_id=0),
                      "model.layers.0.self_attn", "BailingHybridDeltaAttention"),
    "Zaya": (dict(layer_types=["hybrid", "hybrid"], pad_token_id=0, num_experts_per_tok=1),
             "model.layers.0.self_attn.qkv_proj.conv_qk_grouped", "Conv1d"),
}


# Hybrids whose mixers seqpar makes sequence-parallel (seqpar.mixers): swapped beside attention, route
# "mixer", so the probe finds nothing left (their exactness: tests/test_mixers_conv.py).
HANDLED = {
    "Lfm2": (dict(layer_types=["conv", "full_attention"]), "model.layers.0.conv"),
    "Lfm2Moe": (dict(layer_types=["conv", "full_attention"], num_experts=4, num_experts_per_tok=2,
                     moe_intermediate_size=16, num_dense_layers=1), "model.layers.0.conv"),
    "Lfm3": (dict(layer_types=["conv", "full_attention"], pad_token_id=0), "model.layers.0.conv"),
    # (tests/test_mixers_mamba.py, test_mixers_lightning.py, test_mixers_rglru.py)
    "Jamba": (dict(num_experts=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                   expert_layer_offset=1, mamba_d_state=4, mamba_dt_rank=4, mamba_expand=2), "model.layers.0.mamba"),
    "MiniMax": (dict(layer_types=["linear_attention", "full_attention"], num_local_experts=2,
                     num_experts_per_tok=1, head_dim=8, block_size=4), "model.layers.0.self_attn"),
    "RecurrentGemma": (dict(block_types=["recurrent", "attention"], lru_width=32, attention_window_size=8,
                            num_key_value_heads=1), "model.layers.0.temporal_block"),
    # Mamba2 / SSD (tests/test_mixers_ssd.py); Falcon-H1 runs its Mamba2 layer beside attention in one layer
    "Bamba": (dict(attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1,
                   mamba_chunk_size=4), "model.layers.0.mamba"),
    "FalconH1": (dict(num_hidden_layers=1, mamba_n_heads=4, mamba_d_head=16, mamba_d_ssm=64, mamba_d_state=8,
                      mamba_n_groups=1, mamba_chunk_size=4, head_dim=8), "model.layers.0.mamba"),
    "NemotronH": (dict(layers_block_type=["mamba", "attention"], head_dim=8, mamba_num_heads=4, mamba_head_dim=8,
                       ssm_state_size=8, n_groups=2, chunk_size=4), "model.layers.0.mixer"),
    "GraniteMoeHybrid": (dict(layer_types=["mamba", "attention"], mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8,
                              mamba_n_groups=2, mamba_chunk_size=4, num_local_experts=2, num_experts_per_tok=1,
                              shared_intermediate_size=32), "model.layers.0.mamba"),
    # (tests/test_mixers_gdn.py)
    "Qwen3Next": (dict(layer_types=["linear_attention", "full_attention"], num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=16, shared_expert_intermediate_size=16, head_dim=8, **GDN),
                  "model.layers.0.linear_attn"),
    "Qwen3_5Text": (dict(layer_types=["linear_attention", "full_attention"], head_dim=8, **GDN),
                    "model.layers.0.linear_attn"),
    "Qwen3_5MoeText": (dict(layer_types=["linear_attention", "full_attention"], num_experts=4, num_experts_per_tok=2,
                            moe_intermediate_size=16, shared_expert_intermediate_size=16, head_dim=8, **GDN),
                       "model.layers.0.linear_attn"),
    "OlmoHybrid": (dict(layer_types=["linear_attention", "full_attention"], pad_token_id=0, eos_token_id=2, **GDN),
                   "model.layers.0.linear_attn"),
}
ATTENTION = {"RecurrentGemma": "model.layers.1.temporal_block", "FalconH1": "model.layers.0.self_attn",
             "NemotronH": "model.layers.1.mixer"}
"""Where a HANDLED model's attention is, when not at ``model.layers.1.self_attn``."""


# ----------------------------------------------------------------------------- unknown mixers
class SequenceCumsum(nn.Module):
    """A running sum over the sequence: ``(batch, seq, hidden) -> (batch, seq, hidden)``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.cumsum(dim=1) / x.shape[1]


class CausalConv(nn.Module):
    """A depthwise causal convolution of width 3 over the sequence, as in Mamba / LFM2 short convs."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(hidden, hidden, kernel_size=3, groups=hidden, padding=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, S, H)
        seq = x.shape[1]
        return self.conv(x.transpose(1, 2))[..., :seq].transpose(1, 2)  # (B, H, S+2) -> (B, S, H)


class Then(nn.Module):
    """``then(first(x))``: puts a mixer in front of an existing block."""

    def __init__(self, first: nn.Module, then: nn.Module) -> None:
        super().__init__()
        self.first, self.then = first, then

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.then(self.first(x))


def _with_sparse_indices(attn: nn.Module) -> None:
    """Make a Llama attention pass ``indices=`` to its attention function, as DSA models do."""
    cls = type(attn)

    def forward(self: nn.Module, hidden_states: torch.Tensor, *args: object, **kwargs: object) -> object:
        seq = hidden_states.shape[1]
        topk = torch.arange(seq).view(1, seq, 1).expand(hidden_states.shape[0], seq, 2)
        return cls.forward(self, hidden_states, *args, indices=topk, **kwargs)

    attn.forward = types.MethodType(forward, attn)


def _with_token_shift(layer: nn.Module) -> None:
    """A token shift (RWKV style) written in the layer's own forward, before its submodules run."""
    cls = type(layer)

    def forward(self: nn.Module, hidden_states: torch.Tensor, *args: object, **kwargs: object) -> object:
        shifted = F.pad(hidden_states, (0, 0, 1, 0))[:, :-1]  # (B, S, H): position i gets i-1
        return cls.forward(self, hidden_states + 0.5 * shifted, *args, **kwargs)

    layer.forward = types.MethodType(forward, layer)


def llama_with(mixer: str) -> tuple[nn.Module, str, str]:
    """A tiny Llama with one unknown mixer inserted; returns it with the path and class to be named."""
    model = tiny("Llama")
    layer = model.model.layers[0]
    if mixer == "cumsum":
        layer.mlp = Then(SequenceCumsum(), layer.mlp)
        return model, "model.layers.0.mlp.first", "SequenceCumsum"
    if mixer == "conv1d":
        layer.mlp = Then(CausalConv(BASE["hidden_size"]), layer.mlp)
        # its Conv1d's output is (B, H, S + 2), not positions: the module that cuts it to S is named
        return model, "model.layers.0.mlp.first", "CausalConv"
    if mixer == "kwarg":
        _with_sparse_indices(layer.self_attn)
        return model, "model.layers.0.self_attn", "LlamaAttention"
    if mixer == "body":
        _with_token_shift(model.model.layers[1])
        return model, "model.layers.1", "LlamaDecoderLayer"
    raise ValueError(mixer)


def _untouched(model: nn.Module) -> dict[str, object]:
    return {"state": {k: v.clone() for k, v in model.state_dict().items()},
            "training": [m.training for m in model.modules()],
            "impl": model.config._attn_implementation,
            "grads": [p.grad for p in model.parameters()]}


def _assert_untouched(model: nn.Module, before: dict[str, object]) -> None:
    after = _untouched(model)
    assert after["impl"] == before["impl"], "the refused swap left the attention implementation switched"
    assert after["training"] == before["training"]
    assert all(g is None for g in after["grads"])
    for key, value in before["state"].items():
        torch.testing.assert_close(after["state"][key], value, rtol=0, atol=0)
    assert not any(hasattr(m, "_seqpar_options") for m in model.modules()), "options left on a layer"


# ----------------------------------------------------------------------------- single process
@pytest.mark.parametrize("mixer", ["cumsum", "conv1d", "kwarg", "body"])
def test_unknown_mixer_in_a_llama_layer_is_refused_by_path_and_class(mixer):
    model, path, cls = llama_with(mixer)
    before = _untouched(model)
    with pytest.raises(SwapError) as e:
        swap_attention(model, {"size": 1})
    text = str(e.value)
    assert f"'{path}'" in text and cls in text, text
    if mixer == "kwarg":
        assert "indices=" in text and "DeepSeek-V3.2" in text, text
    else:
        assert "mix" in text and "issue 21" in text, text
        assert text.count("\n  - ") == 1, f"exactly the inserted mixer should be named:\n{text}"
    if mixer == "body":
        assert "before calling 'model.layers.1.input_layernorm'" in text, text
    assert "Nothing was changed" in text
    _assert_untouched(model, before)


def test_every_mixer_is_named_not_only_the_first():
    """After a mixer, the probe splices the other positions back, so a second one downstream is judged
    on clean inputs and named too; the position-wise modules between them are not."""
    model = tiny("Llama")
    model.model.layers[0].mlp = Then(SequenceCumsum(), model.model.layers[0].mlp)
    model.model.layers[1].mlp = Then(CausalConv(BASE["hidden_size"]), model.model.layers[1].mlp)
    with pytest.raises(SwapError) as e:
        swap_attention(model, {"size": 1})
    text = str(e.value)
    assert "'model.layers.0.mlp.first' (SequenceCumsum)" in text, text
    assert "'model.layers.1.mlp.first' (CausalConv)" in text, text
    assert text.count("\n  - ") == 2, text


def test_unknown_attention_kwarg_is_refused_at_run_time_too():
    """A kwarg that appears only in a later forward (not at swap time) is refused by name, not ignored."""
    model = tiny("Llama")
    swap_attention(model, {"size": 1})
    _with_sparse_indices(model.model.layers[1].self_attn)
    with pytest.raises(ValueError, match=r"layer 'model\.layers\.1\.self_attn'.*indices="):
        model(input_ids=torch.randint(0, VOCAB, (1, 8)))


@pytest.mark.parametrize("name", sorted(POSITION_WISE))
def test_position_wise_models_pass(name):
    model = tiny(name, **POSITION_WISE[name])
    report = swap_attention(model, {"size": 1})
    assert len(report) == 2, report


def test_dropout_in_training_does_not_fake_a_mixer():
    """Hidden dropout (train mode) draws the same masks in both probe runs; the RNG state is kept."""
    model = tiny("OPT", ffn_dim=64, word_embed_proj_dim=32, dropout=0.3, attention_dropout=0.0).train()
    rng = torch.get_rng_state()
    swap_attention(model, {"size": 1})
    assert torch.equal(torch.get_rng_state(), rng), "the probe changed the global RNG state"
    assert model.training


@pytest.mark.parametrize("name", sorted(HYBRIDS))
def test_hybrid_models_are_refused_naming_their_mixer(name):
    fields, path, cls = HYBRIDS[name]
    model = tiny(name, **fields)
    before = _untouched(model)
    with pytest.raises(SwapError) as e:
        swap_attention(model, {"size": 1})
    text = str(e.value)
    assert f"'{path}' ({cls})" in text, text
    _assert_untouched(model, before)


@pytest.mark.parametrize("name", sorted(HANDLED))
def test_handled_mixers_are_swapped_not_refused(name):
    if not hasattr(transformers, f"{name}Config"):
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    fields, path = HANDLED[name]
    report = swap_attention(tiny(name, **fields), {"size": 1})
    attention = ATTENTION.get(name, "model.layers.1.self_attn")
    assert report.routes == {path: "mixer", attention: "hf"}, report


DSA = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, kv_lora_rank=16, q_lora_rank=16,
           qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, num_key_value_heads=4, first_k_dense_replace=1,
           n_group=1, topk_group=1, index_topk=4, index_head_dim=16, index_n_heads=2)


@pytest.mark.parametrize("name", ["DeepseekV32", "GlmMoeDsa"])
def test_sparse_attention_models_refused_not_crashing(name):
    """DSA models crashed inside the model under seqpar (their indexer reads the mask seqpar does not
    build, then passes indices=): refused at swap time naming the layer, the model left as it was."""
    if not hasattr(transformers, f"{name}Config"):
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    model = tiny(name, **DSA)
    before = _untouched(model)
    with pytest.raises(SwapError) as e:
        swap_attention(model, {"size": 1})
    assert f"'model.layers.0.self_attn' ({name}Attention)" in str(e.value), e.value
    _assert_untouched(model, before)


def test_parameters_on_meta_are_probed_at_the_first_forward():
    """Not materialised at swap time (meta here, ZeRO-3 partitions alike): the same probe runs at the
    first forward, and every forward after it refuses."""
    config = transformers.LlamaConfig(**BASE)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    model.model.layers[0].mlp = Then(SequenceCumsum(), model.model.layers[0].mlp)
    swap_attention(model, {"size": 1})  # nothing to probe with yet
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    ids = torch.randint(0, VOCAB, (1, 8))
    for _ in range(2):
        with pytest.raises(SwapError, match=r"'model\.layers\.0\.mlp\.first' \(SequenceCumsum\)"):
            model(input_ids=ids)


class NanoBlock(nn.Module):
    """An SDPA attention block (the "sdpa" route) followed by an optional mixer."""

    def __init__(self, mixer: nn.Module | None) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.mixer = mixer if mixer is not None else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, S, 16)
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 8).permute(2, 0, 3, 1, 4)  # 3 x (B, 2, S, 8)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.mixer(x + out.transpose(1, 2).reshape(x.shape))


class NanoModel(nn.Module):
    def __init__(self, mixer: nn.Module | None) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.block = NanoBlock(mixer)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.block(self.embed(idx))


def test_sdpa_route_probed_at_the_first_forward():
    torch.manual_seed(0)
    clean = NanoModel(None)
    swap_attention(clean, {"size": 1})
    ids = torch.randint(0, VOCAB, (2, 20))
    assert clean(ids).shape == (2, 20, 16)  # no false positive
    torch.manual_seed(0)
    mixed = NanoModel(CausalConv(16))
    swap_attention(mixed, {"size": 1})
    with pytest.raises(SwapError, match=r"'block\.mixer' \(CausalConv\)"):
        mixed(ids)


# ----------------------------------------------------------------------------- two ranks
def _refused_on_every_rank(rank: int, world_size: int, mixer: str) -> str:
    group = dist.group.WORLD
    model, path, cls = llama_with(mixer)
    try:
        swap_attention(model, {"size": world_size, "sharding": "zigzag"}, group=group)
    except SwapError as e:
        assert f"'{path}'" in str(e) and cls in str(e), str(e)
        return str(e)
    raise AssertionError(f"rank {rank}: {mixer} mixer not refused")


class RankZeroCumsum(SequenceCumsum):
    """Mixes on rank 0 only: the probe refuses on one rank, and the other must still say why."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) if dist.get_rank() == 0 else x


def _first_forward_refused_on_every_rank(rank: int, world_size: int, mixer: str) -> str:
    group = dist.group.WORLD
    torch.manual_seed(0)
    model = NanoModel(SequenceCumsum() if mixer == "cumsum" else RankZeroCumsum())
    swap_attention(model, {"size": world_size, "sharding": "zigzag"}, group=group)
    ids = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(3))
    local = shard_sequence(ids, 1, group=group, sharding="zigzag")
    try:
        model(local)
    except SwapError as e:
        assert f"'block.mixer' ({type(model.block.mixer).__name__})" in str(e), str(e)
        if mixer == "rank0" and rank == 1:
            assert "SP rank(s) [0] refused this batch" in str(e), str(e)
        return str(e)
    raise AssertionError(f"rank {rank}: the first forward ran")


def test_refused_on_every_rank(dist_pool):
    texts = dist_pool.run(2, _refused_on_every_rank, "conv1d")
    assert len(texts) == 2 and texts[0] == texts[1], texts
    for mixer in ("cumsum", "rank0"):
        texts = dist_pool.run(2, _first_forward_refused_on_every_rank, mixer)
        assert len(texts) == 2, texts


def test_alibi_models_are_probed_with_their_own_seqpar_forward():
    """BLOOM's attention computes its own scores (no attention interface): the probe gives it seqpar's
    ALiBi forward for the probe, so a mixer elsewhere in a BLOOM is still found (the probe once skipped
    these models, as transformers cannot route their attention)."""
    config = transformers.BloomConfig(vocab_size=64, hidden_size=32, n_layer=2, n_head=4)
    torch.manual_seed(0)
    plain = transformers.BloomForCausalLM(config)
    swap_attention(plain, {"size": 1})  # position-wise apart from attention: passes
    torch.manual_seed(0)
    model = transformers.BloomForCausalLM(config)
    model.transformer.h[1].mlp.dense_4h_to_h = Then(SequenceCumsum(), model.transformer.h[1].mlp.dense_4h_to_h)
    with pytest.raises(SwapError) as e:
        swap_attention(model, {"size": 1})
    assert "'transformer.h.1.mlp.dense_4h_to_h.first'" in str(e.value) and "SequenceCumsum" in str(e.value), e.value


@releases_deepspeed_engines
def _zero3_partitioned_refused_at_first_forward(rank: int, world_size: int) -> str:
    deepspeed = pytest.importorskip("deepspeed")
    os.environ.setdefault("LOCAL_RANK", str(rank))  # what a launcher sets; DeepSpeed reads it
    deepspeed.init_distributed(dist_backend="gloo")
    group = dist.group.WORLD
    cfg = {"train_micro_batch_size_per_gpu": 1, "train_batch_size": world_size, "steps_per_print": 10**6,
           "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True,
           "optimizer": {"type": "SGD", "params": {"lr": 0.01}}}
    model, path, cls = llama_with("cumsum")
    deepspeed.zero.Init(module=model, config_dict_or_path=cfg)  # partitioned: nothing to probe with yet
    assert all(p.numel() == 0 for p in model.parameters())
    swap_attention(model, {"size": world_size}, group=group)
    engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    ids = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(5))
    try:
        engine(input_ids=shard_sequence(ids, 1, group=group, sharding="contiguous"))
    except SwapError as e:  # the probe ran inside the engine's forward, gathering the parameters
        assert f"'{path}' ({cls})" in str(e), str(e)
        return str(e)
    raise AssertionError(f"rank {rank}: the first forward ran")


def test_zero3_partitioned_parameters_probed_at_the_first_forward(dist_pool):
    pytest.importorskip("deepspeed")
    texts = dist_pool.run(2, _zero3_partitioned_refused_at_first_forward, timeout=300)
    assert len(texts) == 2 and texts[0] == texts[1], texts


@pytest.mark.parametrize("name", ["rwkv", "xlstm", "gpt_neo"])
def test_models_with_nothing_to_swap_name_their_mixers(name):
    """A transformers model with no attention seqpar can route and no mixer it handles (RWKV, xLSTM: no
    attention; GPT-Neo: it computes its own scores) is refused naming each mixing module, not only
    "found nothing to swap". (A model of handled mixers alone, Mamba, is swapped: test_mixers_mamba.)"""
    if name == "rwkv":
        model = transformers.RwkvForCausalLM(transformers.RwkvConfig(
            vocab_size=64, hidden_size=32, num_hidden_layers=2, attention_hidden_size=32, intermediate_size=64))
        path, cls = "rwkv.blocks.1.attention", "RwkvSelfAttention"
    elif name == "xlstm":
        model = transformers.xLSTMForCausalLM(transformers.xLSTMConfig(
            vocab_size=64, hidden_size=32, num_hidden_layers=2, num_heads=2))
        path, cls = "backbone.blocks.1.mlstm_layer.mlstm_backend", "xLSTMBackend"
    else:
        model = transformers.GPTNeoForCausalLM(transformers.GPTNeoConfig(
            vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]],
            window_size=4, bos_token_id=0, eos_token_id=0))
        path, cls = "transformer.h.1.attn.attention", "GPTNeoSelfAttention"
    with pytest.raises(SwapError) as e:
        swap_attention(model, {"size": 1})
    text = str(e.value)
    assert "found nothing to swap" in text and f"'{path}' ({cls})" in text, text
