"""ZeRO-3's whole parameter copies (``training._zero3_gathered``, est31) at the edges of DeepSpeed's own rules, counted
by hand on small shapes. The measured settings in tests/test_training_memory.py sit far from every edge (their
tensors are 64, 4,096, 16,384 or 131,072+ elements against a threshold of 1e5), so an off-by-one there moves no
measured estimate. The rules, read in the installed DeepSpeed:

- persistence (runtime/zero/parameter_offload.py:325, ``mark_persistent_parameters``): a tensor of
  ``ds_numel <= param_threshold`` elements stays whole on every rank (a tensor of exactly the threshold is persistent);
- prefetch (runtime/zero/partitioned_param_coordinator.py:457): the prefetch takes the next parameters
  ``while numel_prefetching < prefetch_bucket_sz``, so it stops once it holds the bucket's elements (a bucket filled
  exactly takes no more);
- a fetch of one tensor gathers into that tensor's own copy (runtime/zero/partition_parameters.py:911, ``if
  len(params) == 1``): no flat buffer.

The estimator's own documented order (``_zero3_gathered``'s docstring): the layers' non-persistent tensors, then the
untied LM head; a non-persistent embedding (the tied head) is fetched on its own, not in the prefetch.

It reaches the private rule through the module, as tests/test_audit31_zero3_overflow.py and
tests/test_training_memory.py reach its estimators. Note for est32 (seqpar/memory/training.py this session): a change
of ``_zero3_gathered``'s return or of ``_layer_tensors`` needs these counts redone.
"""

from __future__ import annotations

import pytest

from seqpar.memory import training
from seqpar.memory.training import ModelShape, estimate_training_memory

H, INTER, L = 64, 2048, 4  # h * INTER = 131,072 elements per MLP weight


def _shape(**kw) -> ModelShape:  # noqa: ANN003
    base = dict(vocab_size=256, hidden_size=H, intermediate_size=INTER, num_hidden_layers=L, num_attention_heads=2,
                num_key_value_heads=2)
    return ModelShape(**{**base, **kw})


def test_layer_tensors_are_the_layers_parameters() -> None:
    """Each layer's tensors add up to its parameters (``ModelShape.params_of``), under GQA and MQA and with a head
    dim apart from hidden / heads: q and o ``h x heads d``, k and v ``h x kv_heads d``, three MLP weights, two norms.

    Seen failing (audit 32): the second RMSNorm left out of ``_layer_tensors`` (G23: 64 short), k sized as q (G24:
    under GQA, 4,096 over at 8 heads of 8 and 2 K/V heads)."""
    for heads, kv, d in ((8, 2, None), (4, 1, 24), (2, 2, None)):
        m = ModelShape(vocab_size=256, hidden_size=H, intermediate_size=INTER, num_hidden_layers=2,
                       num_attention_heads=heads, num_key_value_heads=kv, head_dim=d)
        tensors = training._layer_tensors(m, "attention")
        assert sum(tensors) == m.params_of("attention"), (heads, kv, d, tensors, m.params_of("attention"))
        qd, kvd = heads * m.d, kv * m.d
        assert sorted(tensors) == sorted([H * qd, H * kvd, H * kvd, qd * H, H * INTER, H * INTER, H * INTER, H, H]), tensors


def test_a_tensor_of_exactly_the_threshold_is_persistent() -> None:
    """``stage3_param_persistence_threshold`` = h x intermediate (131,072): every tensor is persistent, nothing is gathered,
    fetched or kept (as at any larger threshold); one element lower, the MLP weights are the gathered ones, all
    fetched in the first prefetch (default 5e7) and kept for the backward (reuse 1e9).

    Seen failing (audit 32): the persistent sum with ``n < persistence`` (G1: the MLP weights neither persistent
    nor gathered, the estimate 12 x 524,288 B short of the larger threshold's), the gathered sum with
    ``n >= persistence`` (G2: counted twice)."""
    m = _shape()
    assert training._zero3_gathered(m, persistence=H * INTER) == (m.params, 0, 0, (0,) * L)
    attn = 4 * H * H + 2 * H
    assert training._zero3_gathered(m, persistence=H * INTER - 1) == (
        m.root_params + L * attn, L * 3 * H * INTER, L * 3 * H * INTER, (3 * H * INTER,) * L)
    kw = dict(seq_len=64, sp_size=2, engine="deepspeed", zero_stage=3, tiled_mlp=1, reduce_bucket_size=2_000_000)
    model = dict(vocab_size=256, hidden_size=H, intermediate_size=INTER, num_hidden_layers=L, num_attention_heads=2,
                 num_key_value_heads=2)
    at = estimate_training_memory(model, **kw, stage3_param_persistence_threshold=H * INTER)
    above = estimate_training_memory(model, **kw, stage3_param_persistence_threshold=10 * H * INTER)
    assert at == above, (at, above)


@pytest.mark.parametrize("tied", [False, True])
def test_the_prefetch_stops_at_a_filled_bucket_and_leaves_the_embedding(tied: bool) -> None:
    """The forward's first coalesced fetch: with a prefetch of exactly two MLP weights it holds those two (a filled
    bucket takes no more); with a prefetch of one element it holds one tensor, gathered into its own copy (no flat
    buffer: 0). With a non-persistent vocabulary (4,096 x 64 = 262,144 elements) the untied LM head is prefetched
    after the layers and the embedding (the tied head) never is.

    Seen failing (audit 32): ``sum(fetched) > prefetch`` (G5: three weights at a two-weight bucket), a single
    tensor counted as a flat buffer (G6: 131,072 for 0), the embedding put in the prefetch order (G7: 262,144 more
    fetched, either way)."""
    m = _shape(vocab_size=4096, tie_word_embeddings=tied)
    head = 0 if tied else 4096 * H
    assert training._zero3_gathered(m, prefetch=2 * H * INTER)[2] == 2 * H * INTER
    assert training._zero3_gathered(m, prefetch=1)[2] == 0
    assert training._zero3_gathered(m)[2] == L * 3 * H * INTER + head


def test_the_reuse_distance_counts_the_roots_gathered_tensors() -> None:
    """Whether the forward's copies are kept for the backward compares the model's non-persistent elements, the
    root's among them, with ``stage3_max_reuse_distance`` (the docstring's rule): at a reuse distance of exactly the
    layers' 1,572,864 non-persistent elements, a non-persistent root (4,096 x 64 embedding and untied head, 524,288
    elements) puts the model over it, so only a layer and its prefetch are kept (2 x 393,216), none per layer;
    at the model's whole non-persistent count, every layer's copies are kept. The prefetch is set small (1,000
    elements) so that est32's second route to keeping every copy (the model within 13 prefetches) is closed and
    the reuse distance alone decides.

    Seen failing (audit 32): the root left out of the comparison (G3: every layer's copies kept, 1,572,864)."""
    m = _shape(vocab_size=4096)
    layers = L * 3 * H * INTER
    assert training._zero3_gathered(m, reuse=layers, prefetch=1000)[1:4:2] == (2 * 3 * H * INTER, ())
    assert training._zero3_gathered(m, reuse=layers + 2 * 4096 * H, prefetch=1000)[1:4:2] == (layers, (3 * H * INTER,) * L)


def test_an_offloaded_optimizer_takes_the_fp32_partition_off_the_device() -> None:
    """ZeRO-3 with ``offload_optimizer``: the fp32 master partition (4 bytes x ceil(params / world)) and AdamW's
    state live on the host, so the device's parameters are the same less that partition and its optimizer state is
    0 (the rule ZeRO-3's branch of ``_state_bytes`` states; est31 rewrote that branch).

    Seen failing (audit 32): the fp32 partition left in the parameters under offload (G10: 3,343,488 B over, the
    same parameters either way)."""
    import math

    model = dict(vocab_size=256, hidden_size=H, intermediate_size=INTER, num_hidden_layers=L, num_attention_heads=2,
                 num_key_value_heads=2)
    kw = dict(seq_len=64, sp_size=2, engine="deepspeed", zero_stage=3, tiled_mlp=1)
    on = estimate_training_memory(model, **kw, offload_optimizer=True)
    off = estimate_training_memory(model, **kw)
    part = math.ceil(ModelShape.from_config(model).params / 2)
    assert off["parameters"] - on["parameters"] == 4 * part, (off, on, part)
    assert on["optimizer_state"] == 0 and off["optimizer_state"] == 2 * 4 * part, (off, on)


@pytest.mark.parametrize("key", ["stage3_param_persistence_threshold", "stage3_prefetch_bucket_size",
                                 "stage3_max_reuse_distance"])
@pytest.mark.parametrize("value", [True, -1, "1e5"])
def test_a_setting_that_is_not_a_number_of_elements_is_refused_by_name(key: str, value: object) -> None:
    """A ZeRO-3 setting given as a bool (``True`` is an int to Python: 1 element), a negative number or a string is
    refused by name, never taken as a number of elements.

    Seen failing (audit 32): the bool check dropped (G21: ``True`` taken as 1 element, an estimate returned)."""
    model = dict(vocab_size=256, hidden_size=H, intermediate_size=INTER, num_hidden_layers=L, num_attention_heads=2,
                 num_key_value_heads=2)
    with pytest.raises(ValueError, match=f"{key}=.*expected a number of elements >= 0"):
        estimate_training_memory(model, seq_len=64, sp_size=2, engine="deepspeed", zero_stage=3, **{key: value})
