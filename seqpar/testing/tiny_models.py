"""Tiny random-init configs of every decoder-only causal-LM type of the installed transformers.

Shared by ``tests/all_models.py`` (every model type at SP=2 against one process) and the composition
fuzzer (:mod:`seqpar.testing.fuzz`), so both build the same models. :func:`decoder_model_types` states
which model types count; :func:`tiny_config` builds a model type's tiny config (one layer of each kind
the full-size default has, every length parameter at :data:`LENGTH`, every dropout zero, MoE router
losses on); :func:`build_model` the seeded model.
"""

from __future__ import annotations

import json
import re
from typing import Any

import torch

__all__ = ["VOCAB", "LENGTH", "MAX_PARAMS", "excluded_reason", "decoder_model_types", "tiny_kwargs", "compile_kwargs",
           "tiny_config", "build_model"]

VOCAB = 96
LENGTH = 6  # every window / chunk / top-k / block length: below a zigzag chunk of all_models' SP=2 run
MAX_PARAMS = 2_000_000
# The tiny models' weight init, ~1/sqrt(hidden_size): each matmul keeps its input's scale. At the usual 0.02 a
# 32-wide model shrinks every path ~10x per matmul, so deep paths' gradients vanish below any tolerance
# (Falcon-H1's A_log gradient was 7e-10 of the model's largest: doubling it went unseen), and fp32 steps inside
# float64 models (GDN's kernel) leave small gradients with rounding errors of 2e-4 of themselves (Qwen3.5's
# A_log). Set in tiny_config only: the family tests that borrow tiny_kwargs keep their own init.
INIT_RANGE = 0.2


# --------------------------------------------------------------------------------------------------
# Which model types count
# --------------------------------------------------------------------------------------------------

# Decoders of speech / vision / audio models whose config is not composite (so the rule below cannot
# see it from the config): TrOCR is the text decoder of a VisionEncoderDecoder; MusicGen's and Moshi's
# causal LMs predict audio codebooks.
_MEDIA_DECODERS = frozenset({"trocr", "musicgen", "musicgen_melody", "moshi"})


def excluded_reason(model_type: str) -> str | None:
    """Why ``model_type`` is not a decoder-only text model (``None``: it is one).

    The rule: drop encoders (the type also has a masked-LM head: BERT, RoBERTa, ...), encoder-decoders
    (the type has a seq2seq head, or its config says ``is_encoder_decoder``), and speech / vision /
    multimodal decoders (a ``*ForConditionalGeneration`` class, a composite config with sub-configs
    such as ``text_config`` / ``vision_config`` / ``audio_config``, a speech-seq2seq or
    image-text-to-text model type, or one of :data:`_MEDIA_DECODERS`).
    """
    from transformers import CONFIG_MAPPING
    from transformers.models.auto import modeling_auto as auto

    cls_name = auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    if model_type in auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return "encoder (has a masked-LM head)"
    if model_type in auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES:
        return "encoder-decoder (has a seq2seq head)"
    if model_type in auto.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES or model_type in _MEDIA_DECODERS:
        return "speech / vision / audio decoder"
    if model_type in auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return "image-text-to-text model"
    if cls_name.endswith("ForConditionalGeneration"):
        return "conditional-generation (multimodal) class"
    config_cls = CONFIG_MAPPING[model_type]
    subs = {k for k in (getattr(config_cls, "sub_configs", None) or {})}
    if subs & {"text_config", "vision_config", "audio_config", "audio_encoder_config", "vq_config",
               "text_encoder", "audio_encoder"}:
        return f"multimodal (composite config: {sorted(subs)})"
    if getattr(config_cls, "is_encoder_decoder", False) is True:
        return "encoder-decoder (config)"
    return None


def decoder_model_types() -> list[str]:
    """Model types of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` kept by :func:`excluded_reason`, sorted."""
    from transformers.models.auto import modeling_auto as auto

    return sorted(t for t in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if excluded_reason(t) is None)


# --------------------------------------------------------------------------------------------------
# Tiny configs
# --------------------------------------------------------------------------------------------------

# Sizes set wherever the default config has the field (attribute_map names count).
_SIZES: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "rotary_dim": 4,
    "max_position_embeddings": 256,
    "use_cache": False,
    # MoE router losses on, as anyone training an MoE sets them, and weighted enough to show in the gradients
    "output_router_logits": True, "router_aux_loss_coef": 0.1, "z_loss_coefficient": 0.1,
    # MoE
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_topk": 2, "num_experts_per_token": 2,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "shared_intermediate_size": 32,
    "shared_experts_intermediate_size": 32, "moe_shared_expert_intermediate_size": 32,
    "expert_ffn_hidden_size": 32, "dense_intermediate_size": 64, "intermediate_size_mlp": 64,
    "prefix_dense_intermediate_size": 64,
    "n_shared_experts": 1, "num_shared_experts": 1, "n_group": 1, "topk_group": 1,
    "first_k_dense_replace": 1, "num_dense_layers": 1, "decoder_sparse_step": 1, "mlp_only_layers": [0],
    "num_nextn_predict_layers": 0,
    # MLA: Q/K head dim (nope + rope) differs from V's, as in DeepSeek-V3
    "kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 4, "qk_nope_head_dim": 8, "v_head_dim": 8,
    # state-space / linear-attention mixers
    "state_size": 8, "ssm_state_size": 8, "mamba_d_state": 8, "mamba_n_heads": 8, "mamba_d_head": 8, "mamba_d_ssm": 64,
    "mamba_n_groups": 1, "n_groups": 1, "mamba_expand": 2, "mamba_d_conv": 4, "conv_kernel": 4,
    "chunk_size": 8, "mamba_chunk_size": 8, "time_step_rank": 4, "mamba_dt_rank": 4,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
    # lengths below the shard length
    "sliding_window": LENGTH, "attention_chunk_size": LENGTH, "index_topk": LENGTH, "block_size": LENGTH,
    "attention_window_size": LENGTH, "window_size": LENGTH, "sliding_window_size": LENGTH,
    "floor_scale": LENGTH, "local_attention_window_len": LENGTH,
}

_ZERO_NAME = re.compile(r"dropout|pdrop|jitter|layerdrop|_noise$")

# Per-layer pattern fields: the tiny model keeps one layer of each distinct combination.
_PATTERN_LISTS = ("layer_types", "mlp_layer_types", "layers_block_type", "block_types",
                  "no_rope_layers", "hybrid_override_pattern", "attention_layers")

# Model-specific fields (after the generic ones).
_OVERRIDES: dict[str, dict[str, Any]] = {
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1,
              "num_hidden_layers": 2},
    "bamba": {"attn_layer_indices": [1], "num_hidden_layers": 2},
    "ernie4_5_moe": {"moe_layer_start_index": 1, "moe_layer_end_index": 1, "moe_layer_interval": 1,
                     "num_hidden_layers": 2},
    "xlnet": {"d_head": 8},
    "mamba2": {"num_heads": 8, "head_dim": 8},
    "zaya": {"num_experts_per_tok": 1},
    "cpmant": {"dim_head": 8, "dim_ff": 64, "position_bias_num_buckets": 32, "position_bias_max_distance": 64},
    "gemma3n_text": {"num_kv_shared_layers": 2, "hidden_size_per_layer_input": 8,
                     "vocab_size_per_layer_input": VOCAB, "laurel_rank": 4},
    "gemma4_text": {"hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": VOCAB, "per_layer_config": {}},
    "dots3_note_text": {"index_head_dim": 8, "index_n_heads": 2, "per_layer_config": {}, "head_dim": 12},
    "cohere_compass_text": {"rope_parameters": {k: {"rope_type": "default", "rope_theta": 10000.0}
                                                for k in ("full_attention", "sliding_attention")}},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    # Defaults with one kind where the released models mix two:
    "lfm2": {"layer_types": ["conv", "full_attention"], "full_attn_idxs": [1]},
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},
    "recurrent_gemma": {"block_types": ["recurrent", "attention"]},
    "llama4_text": {"moe_layers": [1]},
    "qwen4_exp_text": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 8, "indexer_budget": LENGTH,
                       "indexer_compress_ratio": 2, "hc_lowrank": 8, "ple_embed_dim": 32, "heads_per_ngram": 2,
                       "ngram_vocab_size_base": VOCAB, "make_ngram_vocab_size_divisible_by": 8,
                       "split_ngram_parts": 4},
    "dory": {"layer_types": ["sliding_attention", "full_attention", "sliding_attention"], "num_hidden_layers": 3,
             "n_input_layers": 1, "n_recurrent_layers": 1, "n_output_layers": 1},
    # byte-level: the patcher, local encoder / decoder and global transformer are sub-configs
    "blt": {"vocab_size": 260, "local_attention_window_len": LENGTH, "encoder_hash_byte_group_size": [3, 4],
            "encoder_hash_byte_group_vocab": 64, "max_position_embeddings": 256,
            "patcher_config": {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4,
                               "num_key_value_heads": 4, "head_dim": 8, "intermediate_size": 64,
                               "sliding_window": LENGTH, "max_position_embeddings": 256},
            "encoder_config": {"hidden_size": 32, "hidden_size_global": 64, "num_hidden_layers": 1,
                               "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 64,
                               "sliding_window": LENGTH, "max_position_embeddings": 256},
            "decoder_config": {"hidden_size": 32, "hidden_size_global": 64, "num_hidden_layers": 1,
                               "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 8,
                               "intermediate_size": 64, "sliding_window": LENGTH, "max_position_embeddings": 256},
            "global_config": {"hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
                              "num_key_value_heads": 4, "head_dim": 16, "intermediate_size": 64,
                              "max_position_embeddings": 256}},
    # a shared transformer block is tied across its hybrid layers: two of them
    "zamba": {"layers_block_type": ["linear_attention", "hybrid", "hybrid"], "num_hidden_layers": 3},
    "kimi_linear": {"linear_head_dim": 8, "linear_num_heads": 4, "qk_head_dim": 12, "head_dim": 4},
    "longcat_flash": {"qk_head_dim": 12, "head_dim": 4, "num_layers": 2},
    "inkling2_text": {"swa_num_attention_heads": 4, "swa_num_key_value_heads": 2, "swa_head_dim": 8, "d_rel": 4,
                      "unpadded_vocab_size": VOCAB},
    "inkling2_loop_text": {"swa_num_attention_heads": 4, "swa_num_key_value_heads": 2, "swa_head_dim": 8,
                           "d_rel": 4, "unpadded_vocab_size": VOCAB},
    "dbrx": {"d_model": 32, "n_heads": 4, "n_layers": 2, "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0}, "ffn_config": {"ffn_hidden_size": 64, "moe_num_experts": 4,
                                                              "moe_top_k": 2, "hidden_size": 32}},
}


def _default_config(model_type: str) -> Any:
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING[model_type]()


def _pattern_indices(fields: dict[str, list | str]) -> list[int]:
    """First index of each distinct combination of the per-layer pattern fields."""
    seen: dict[tuple, int] = {}
    n = len(next(iter(fields.values())))
    for i in range(n):
        key = tuple(json.dumps(v[i], sort_keys=True, default=str) for v in fields.values())
        seen.setdefault(key, i)
    return sorted(seen.values())


def tiny_kwargs(model_type: str) -> dict[str, Any]:
    """The config keyword arguments of ``model_type``'s tiny model (see the module docstring)."""
    default = _default_config(model_type)
    fields = default.to_dict()

    def has(name: str) -> bool:
        return name in fields or name in getattr(default, "attribute_map", {})

    kw: dict[str, Any] = {k: v for k, v in _SIZES.items() if has(k)}
    for name, value in fields.items():
        if _ZERO_NAME.search(name) and isinstance(value, (int, float)) and not isinstance(value, bool):
            kw[name] = 0.0 if isinstance(value, float) else 0
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if has(name) and fields.get(name) is not None:
            kw[name] = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}[name]
    n_layers = fields.get("num_hidden_layers", getattr(default, "num_hidden_layers", 2))
    # Every per-layer list (``layer_types``, ``mlp_layer_types``, ``layers_block_type``, a per-layer
    # ``intermediate_size``, ...) of the default's length: keep one layer of each distinct combination.
    # Lists of layer indices (``moe_layers``, ``full_attn_idxs``) are not patterns: they are set per model.
    patterns = {k: v for k, v in fields.items()
                if isinstance(v, (list, str)) and n_layers and len(v) == n_layers
                and (k in _PATTERN_LISTS or k.endswith("_types") or k in _SIZES or "pattern" in k)}
    if patterns:
        keep = _pattern_indices(patterns)
        if len(keep) == 1:  # one kind: two layers of it
            keep = keep * 2
        for k, v in patterns.items():
            kept = [v[i] for i in keep]
            if k in _SIZES:  # a per-layer size: tiny, same kinds
                kept = [_SIZES[k] for _ in kept]
            kw[k] = "".join(kept) if isinstance(v, str) else kept
        kw["num_hidden_layers"] = len(keep)
    else:
        kw["num_hidden_layers"] = 2
    if "kv_lora_rank" in kw:
        kw["num_key_value_heads"] = kw.get("num_attention_heads", 4)  # MLA: one K/V head per query head
        kw.pop("head_dim", None)
    kw.update(_OVERRIDES.get(model_type, {}))
    return kw


def tiny_config(model_type: str) -> Any:
    """``model_type``'s tiny config (float32 weights; the caller converts)."""
    from transformers import CONFIG_MAPPING

    kw = tiny_kwargs(model_type)
    default = _default_config(model_type)
    if "initializer_range" in default.to_dict() or "initializer_range" in getattr(default, "attribute_map", {}):
        kw.setdefault("initializer_range", INIT_RANGE)
    return CONFIG_MAPPING[model_type](experts_implementation="eager", **kw)


def build_model(model_type: str, dtype: torch.dtype) -> Any:
    """The tiny causal LM of ``model_type`` with seeded random weights (the same on every rank), in train
    mode (every dropout is zero)."""
    import transformers
    from transformers.models.auto import modeling_auto as auto

    cls = getattr(transformers, auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    config = tiny_config(model_type)
    with torch.device("meta"):  # a field the tiny config missed must not build a full-size model
        size = sum(p.numel() for p in cls(config).parameters())
    if size > MAX_PARAMS:
        raise ValueError(f"the tiny config still has {size} parameters (> {MAX_PARAMS}): a size field is missed")
    torch.manual_seed(0)
    model = cls(config).to(dtype)
    model.train()
    return model


# --------------------------------------------------------------------------------------------------
# Compile configs: the fewest layers that keep each kind a model mixes
# --------------------------------------------------------------------------------------------------

# Per model type, the fields that cut :func:`tiny_kwargs` to the fewest layers that keep every layer kind
# the model is tested for: a compile's cost is a trace of each layer's forward and backward. One layer where
# every layer is alike (an MoE model's one layer sparse, GPT-OSS's one sliding-window layer with its sinks,
# Falcon-H1's layer runs Mamba2 and attention side by side); hybrids keep their mixer and attention layers.
_COMPILE_OVERRIDES: dict[str, dict[str, Any]] = {
    "qwen3": {"num_hidden_layers": 1, "layer_types": ["full_attention"]},
    "mixtral": {"num_hidden_layers": 1},
    "qwen3_moe": {"num_hidden_layers": 1, "mlp_only_layers": []},
    "gpt_oss": {"num_hidden_layers": 1, "layer_types": ["sliding_attention"]},
    "falcon_h1": {"num_hidden_layers": 1},
    "minicpm3": {"num_hidden_layers": 1},
}


def compile_kwargs(model_type: str) -> dict[str, Any]:
    """:func:`tiny_kwargs` cut to the fewest layers of :data:`_COMPILE_OVERRIDES` (others: unchanged)."""
    return {**tiny_kwargs(model_type), **_COMPILE_OVERRIDES.get(model_type, {})}
