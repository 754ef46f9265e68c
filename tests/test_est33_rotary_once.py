"""The rotary cos / sin tables, counted once per step (est33), against recorded and live measurements.

Transformers' Llama computes ``cos, sin = rotary_emb(hidden, position_ids)`` once in the model's forward and passes
the pair to every decoder layer; each layer's ``apply_rotary_pos_emb`` saves views (``unsqueeze``) of the same two
storages for backward (q's and k's products: 2 references per table per layer). So one pair of ``(rows, head_dim)``
tables is alive at the step's peak whatever the number of layers, dtype, or activation checkpointing (whose
recompute inputs keep the pair from the forward on). Recorded (``TensorMemoryTracker(record_peak=True)``, the
rotary embedding's storages tagged) on this machine:

- Hugging Face Llama alone (hidden 64, 4 heads, head_dim 16, 1024 tokens): 2 rotary storages at the peak of
  forward + backward at 1, 2, 4 and 8 layers, fp32 (2 x 65,536 B) and bf16 (2 x 32,768 B), and with non-reentrant
  checkpointing at 4 layers (both dtypes); the first test below measures it live.
- DeepSpeed ZeRO-3 on gloo CPU, 2 ranks, SP 2, 8 layers (hidden 64, I 2048, 2 heads of 32, 64 tokens, a 1e6-element
  prefetch, bucket 2e6; ``tests/test_training_memory.py``'s ``follow_the_configs_settings`` setting): peak
  67,448,633 B, with 2 x 4,096 B rotary storages alive (4 layers' saved tensors still held). The same recording, its
  storages tagged by the module that made them, also shows the untiled loss's logits (32,768 B, made by the LM
  head, held by launch/loop.py across the backward) and 15 (not 16) norm outputs and copies: the layer in flight's
  MLP input (8,192 B) is freed with the MLP's saved tensors. The model had counted 4 rotary pairs (+24,576 B) and
  neither of the other two (+8,192 - 32,768 B): they cancelled to the byte.
"""

from __future__ import annotations

import weakref

import pytest
import torch

import seqpar.memory.training as training
from seqpar.memory.training import estimate_training_memory

# tests/test_training_memory.py's MODEL (the whole-step table's demo Llama)
MODEL = {"hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 32000}
WIDE = {"hidden_size": 64, "intermediate_size": 2048, "num_hidden_layers": 8, "num_attention_heads": 2,
        "num_key_value_heads": 2, "vocab_size": 256}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_layers_share_one_rotary_pair(dtype: torch.dtype, checkpointing: bool) -> None:
    """Live: the storages autograd saves for backward that are the rotary tables are the two the rotary embedding
    made, referenced twice per table per layer, and alive after the forward (at the loss) until the backward ends,
    at 1, 2 and 4 layers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    for layers in (1, 2, 4):
        torch.manual_seed(layers)
        cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=128, attn_implementation="sdpa", use_cache=False)
        model = LlamaForCausalLM(cfg).to(dtype)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.train()
        tables: list[torch.Tensor] = []
        forward = model.model.rotary_emb.forward

        def recording(*args, _forward=forward, _tables=tables, **kwargs):  # noqa: ANN002, ANN003, ANN202
            out = _forward(*args, **kwargs)
            _tables.extend(out)
            return out

        model.model.rotary_emb.forward = recording
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor, _saved: dict[int, int] = saved) -> torch.Tensor:
            ptr = t.untyped_storage().data_ptr()
            _saved[ptr] = _saved.get(ptr, 0) + 1
            return t

        ids = torch.randint(0, 128, (1, 256))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(input_ids=ids, labels=ids).loss
        assert len(tables) == 2, len(tables)  # one rotary call per step, not one per layer
        ptrs = {t.untyped_storage().data_ptr() for t in tables}
        refs = [weakref.ref(t.untyped_storage()) for t in tables]
        if not checkpointing:  # the layers' q / k products save the two tables (twice each per layer)
            assert [saved.get(p, 0) for p in ptrs] == [2 * layers] * 2, (layers, saved)
        assert all(t.untyped_storage().nbytes() == 256 * 16 * dtype.itemsize for t in tables)
        tables.clear()
        assert all(r() is not None for r in refs), layers  # alive at the loss, held by the graph
        loss.backward()
        del loss
        assert all(r() is None for r in refs), layers  # freed with the graph


def _backward_reduction(model: dict, **kw) -> float:  # noqa: ANN003
    seen: dict[str, float] = {}
    real = training._moments

    def keep(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        seen.update(real(*args, **kwargs))
        return seen

    from unittest import mock

    with mock.patch.object(training, "_moments", keep):
        estimate_training_memory(model, **kw)
    return seen["backward_reduction"]


def test_the_step_counts_one_rotary_pair() -> None:
    """The whole-step model counts the pair once: each layer past the first adds its saved tensors less the pair, and
    a checkpointed step holds the pair at the loss. Recorded figures:

    - ZeRO-3, 2 layers, 2048 tokens, tiled loss, 2.1e6-element bucket (the overflow at o_proj's gradient): measured
      93,147,769 B; est32 93,278,720 (+0.141%, the second layer's pair, 131,072 B); est33 93,147,648 (-0.0001%).
    - ZeRO-3, 8 layers (the module docstring's): measured 67,448,633 B; est32 and est33 both 67,448,448 (-185 B),
      est33 with the recorded terms (1 pair, the freed MLP input, the logits) instead of 4 pairs.

    Seen failing: the pair counted per layer (est32's model): the 2-layer case +0.141% (93,278,720 B); the pair left
    out altogether: -0.141%; the logits left out (``logits_kept`` 0): the 8-layer case -0.049%; the MLP input not
    freed: +0.012%."""
    got = _backward_reduction(MODEL, seq_len=2048, sp_size=2, engine="deepspeed", zero_stage=3, tiled_loss=True,
                              reduce_bucket_size=2_100_000)
    assert -0.00001 <= got / 93_147_769 - 1 <= 0.00001, (got, f"{got / 93_147_769 - 1:+.5%}")
    got = _backward_reduction(WIDE, seq_len=64, sp_size=2, engine="deepspeed", zero_stage=3, tiled_mlp=1,
                              stage3_prefetch_bucket_size=1_000_000, reduce_bucket_size=2_000_000)
    assert -0.00001 <= got / 67_448_633 - 1 <= 0.00001, (got, f"{got / 67_448_633 - 1:+.5%}")


def test_each_layer_past_the_first_adds_its_own_saves_without_a_pair() -> None:
    """One more layer adds its own saved tensors, without a second pair (rows 1024, head_dim 16, fp32); checkpointed,
    only its input. Split from the recorded figures' test (tst34: a break there failed the figures first, so this
    was not seen failing). Seen failing: the pair counted per layer (``own`` keeps it) -> not checkpointed,
    ``acts[2] - acts[1]`` one pair (131,072 B) over."""
    kw = dict(seq_len=2048, sp_size=2)
    pair = 2 * 1024 * 16 * 4
    for ac in (False, True):
        acts = {n: estimate_training_memory(dict(MODEL, num_hidden_layers=n), **kw, activation_checkpointing=ac)
                ["activations"] for n in (1, 2, 4)}
        # one layer alone, with its pair and without its input (as seqpar.bench.layer_memory measures it)
        per_layer = training.layer_saved_bytes(MODEL) * 1024
        step = 1024 * 64 * 4 + (0 if ac else per_layer - pair)  # its input, and unless checkpointed its own saves
        assert acts[2] - acts[1] == step and acts[4] - acts[2] == 2 * step, (ac, acts, per_layer)


def test_a_checkpointed_step_holds_the_pair_at_the_loss() -> None:
    """Checkpointed: the pair is alive at the loss beside the checkpointed inputs and the final norm's saves
    (recorded live in :func:`test_layers_share_one_rotary_pair`). Split out as the increment test (tst34). Seen
    failing: the pair left out of ``activations_at_loss`` -> 131,072 B under."""
    pair = 2 * 1024 * 16 * 4  # the rotary cos / sin: rows 1024, head_dim 16, fp32
    m = training._model_shape(MODEL)
    at_loss = training._activation_bytes(m, 4, rows=1024, sp_size=2, mode="ring", tiled_mlp=False,
                                         recompute_norm=False, activation_checkpointing=True,
                                         offload_activations=False, device="cpu").at_loss
    final_norm = training._norm_saved_bytes(64, 4, False, False) * 1024
    assert at_loss == 2 * 1024 * 64 * 4 + pair + final_norm, at_loss


def test_the_flat_input_at_q_projs_gradient_holds_the_buckets_contents() -> None:
    """ZeRO-3's bucket overflowing at attention's q_proj gradient (the whole-step table's 2-layer model, 2048 tokens,
    tiled loss, a 2,103,000-element bucket: the head's, the final norm's, the last layer's MLP, its post-attention
    norm and o_proj's, 2,101,376 elements, are in it). Recorded (est33, record_peak, rank 0): peak 92,774,745 B; the
    flat reduce-scatter input and gloo's copy are 2 x 8,405,504 B, the contents, beside the 8,412,000-byte bucket.
    The estimate counts the contents (est32 counted the full bucket there, 2 x 8,412,000): 93,717,408 -> 93,704,416 B,
    +1.016% -> +1.002%. The rest of the +1.0% was what is in flight there, modelled since est34 (the first of q, k,
    v's gradients to arrive is v_proj's, ``_Overflow.at_v_proj``; tests/test_est34_qkv_overflow.py): 92,774,624 B,
    the measured bytes within 1 KiB (121 B under: scalars).

    Seen failing: a full bucket at q_proj's (est32's rule): +1.016% (93,717,408 B), the contents 0; with est34's
    terms, a full bucket: +12,992 B."""
    m = training._model_shape(MODEL)
    overflow = training._zero3_first_overflow(m, 2_103_000)
    assert overflow.after_mlp and not overflow.at_o_proj and overflow.contents * 4 == 8_405_504, overflow
    est = estimate_training_memory(MODEL, seq_len=2048, sp_size=2, engine="deepspeed", zero_stage=3, tiled_loss=True,
                                   reduce_bucket_size=2_103_000)
    assert est["moment"] == "backward_reduction", est
    assert abs(est["peak"] - 92_774_745) <= 1024, (est["peak"], est["peak"] - 92_774_745)
