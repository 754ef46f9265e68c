"""The mixer scenarios of the host-sync checker (``Scenario(kind="mixer")``, :mod:`seqpar.testing.syncs`):
each family's sequence-parallel layer, built from a tiny transformers layer on fake bf16 CUDA parameters."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from seqpar.testing.fake_world import building, fake, run_backward
from seqpar.testing.sync_checker import SyncChecker
from seqpar.testing.sync_scenarios import LAYERS, SEQ_PER_RANK, Scenario, documents

__all__ = ["MixerLayer", "MIXERS", "mixer", "mixer_layers"]

MixerLayer = Callable[[Tensor, Tensor | None, Tensor], Tensor]
"""``(hidden (1, S_local, H), cu_seqlens or None, position_ids (1, S_local)) -> hidden``: one call."""

MIXERS: dict[str, Callable[[Scenario], tuple[MixerLayer, int]]] = {}
"""Mixer family -> builder of ``(one layer's call, hidden size)`` on fake bf16 CUDA parameters, for
``Scenario(kind="mixer", extra={"mixer": name})``. Families add themselves with :func:`mixer`."""


def mixer(name: str) -> Callable[[Callable[[Scenario], tuple[MixerLayer, int]]], Callable[[Scenario], tuple[MixerLayer, int]]]:
    """Register a mixer builder under ``name`` (see :data:`MIXERS`)."""
    def register(build: Callable[[Scenario], tuple[MixerLayer, int]]) -> Callable[[Scenario], tuple[MixerLayer, int]]:
        MIXERS[name] = build
        return build
    return register


def _tiny(config_class: str, **fields: Any) -> nn.Module:
    import transformers

    cfg = getattr(transformers, config_class)(vocab_size=64, use_cache=False, pad_token_id=0, bos_token_id=1,
                                              eos_token_id=2, **fields)
    return transformers.AutoModelForCausalLM.from_config(cfg)


@mixer("conv")
def _conv_mixer(sc: Scenario) -> tuple[MixerLayer, int]:
    from seqpar.mixers.short_conv import SeqParShortConv

    model = _tiny("Lfm2Config", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, conv_L_cache=4, layer_types=["conv", "full_attention"])
    layer = SeqParShortConv(model.model.layers[0].conv, group=dist.group.WORLD, sharding=sc.sharding)
    return (lambda x, cu, pos: layer(x, cu_seq_lens_q=cu)), 32


@mixer("mamba")
def _mamba_mixer(sc: Scenario) -> tuple[MixerLayer, int]:
    from seqpar.mixers.mamba import SeqParMambaMixer

    model = _tiny("JambaConfig", hidden_size=16, intermediate_size=32, num_attention_heads=4, num_key_value_heads=4,
                  mamba_d_state=4, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4, num_hidden_layers=2,
                  attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, num_experts=1)
    layer = SeqParMambaMixer(model.model.layers[0].mamba, group=dist.group.WORLD, sharding=sc.sharding)
    return (lambda x, cu, pos: layer(x, cu_seq_lens_q=cu)), 16


@mixer("mamba2")
def _mamba2_mixer(sc: Scenario) -> tuple[MixerLayer, int]:
    from seqpar.mixers.mamba2 import SeqParMamba2Mixer

    model = _tiny("BambaConfig", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8,
                  mamba_n_groups=1, mamba_chunk_size=4)
    layer = SeqParMamba2Mixer(model.model.layers[0].mamba, group=dist.group.WORLD, sharding=sc.sharding)
    return (lambda x, cu, pos: layer(x, cu_seq_lens_q=cu)), 32


@mixer("gdn")
def _gdn_mixer(sc: Scenario) -> tuple[MixerLayer, int]:
    from seqpar.mixers.gdn import SeqParGatedDeltaNet

    model = _tiny("Qwen3_5TextConfig", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, head_dim=8,
                  layer_types=["linear_attention", "full_attention"], linear_num_key_heads=4,
                  linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)
    layer = SeqParGatedDeltaNet(model.model.layers[0].linear_attn, group=dist.group.WORLD, sharding=sc.sharding)
    return (lambda x, cu, pos: layer(x, cu_seq_lens_q=cu)), 32


@mixer("lightning")
def _lightning_mixer(sc: Scenario) -> tuple[MixerLayer, int]:
    from seqpar.mixers.lightning import SeqParLightningAttention

    model = _tiny("MiniMaxConfig", hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, head_dim=8, layer_types=["linear_attention", "full_attention"], block_size=8,
                  num_local_experts=2, num_experts_per_tok=1)
    layer = SeqParLightningAttention(model.model.layers[0].self_attn, group=dist.group.WORLD, sharding=sc.sharding)
    return (lambda x, cu, pos: layer(x, None, None, cu_seq_lens_q=cu)[0]), 32


@mixer("rglru")
def _rglru_mixer(sc: Scenario) -> tuple[MixerLayer, int]:
    from seqpar.mixers.rglru import SeqParRecurrentBlock

    model = _tiny("RecurrentGemmaConfig", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, head_dim=8, lru_width=32, conv1d_width=4,
                  attention_window_size=64, block_types=["recurrent", "attention"])
    layer = SeqParRecurrentBlock(model.model.layers[0].temporal_block, group=dist.group.WORLD, sharding=sc.sharding)
    return (lambda x, cu, pos: layer(x, pos, cu_seq_lens_q=cu)[0]), 32


@mixer("state-passing")
def _state_passing_mixer(sc: Scenario) -> tuple[MixerLayer, int]:
    """state_passing.chunk_initial_states alone, as every linear recurrence calls it: per-head scalar
    transitions and (head, d, d) states, one per local chunk."""
    from seqpar.mixers.state_passing import chunk_initial_states

    chunks = 2 if sc.sharding == "zigzag" else 1

    def call(x: Tensor, cu: Tensor | None, pos: Tensor) -> Tensor:
        seq_local, hidden = x.shape[1], x.shape[2]
        heads = hidden // 8
        transition = x[0, :chunks, :heads].float().sigmoid()  # (n, heads)
        state = x[0, :chunks].float().reshape(chunks, heads, 8)[..., None] * x[0, :chunks, :8].float()[:, None, None]
        init = chunk_initial_states(transition, state, apply=lambda t, h: t[:, None, None] * h, group=dist.group.WORLD,
                                    sharding=sc.sharding, seq_len=seq_local * dist.get_world_size(), cu_seqlens=cu)
        return x + init.sum().to(x.dtype)

    return call, 32


def mixer_layers(sc: Scenario, world: int, checker: SyncChecker) -> list[str]:
    import seqpar

    seq = SEQ_PER_RANK * world
    with checker.paused(), building():
        call, hidden = MIXERS[sc.extra["mixer"]](sc)
        pos = fake((1, SEQ_PER_RANK), torch.long)
    cu = checker.cuda(documents(seq), torch.int32) if sc.documents else None
    if cu is not None:  # the batch's one host copy of the boundaries (shard_batch / the batch check)
        seqpar.sequence.boundaries.host_boundaries(cu)
    x = fake((1, SEQ_PER_RANK, hidden))
    for i in range(LAYERS):
        with checker.layer(f"{sc.extra['mixer']}[{i}]"):
            x = call(x, cu, pos)
    return run_backward([x], checker)

