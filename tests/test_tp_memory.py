"""The whole-step memory model with tensor parallelism (``estimate_training_memory(tp_size=...,
tp_sequence_parallel=...)``), no process group: a rank's shape, what TP divides and what it does not."""

from __future__ import annotations

import re

import pytest

from seqpar.memory.training import ModelShape, estimate_training_memory, layer_saved_bytes

SETTING = {"seq_len": 32768, "engine": "deepspeed", "zero_stage": 3, "dtype": "bf16",
           "activation_checkpointing": True, "device": "cuda", "offload_optimizer": True}


def test_tp_local_shape() -> None:
    full = ModelShape.from_config({"vocab_size": 128256, "hidden_size": 8192, "intermediate_size": 28672,
                                   "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8})
    local = full.tp_local(8)
    assert (local.num_attention_heads, local.num_key_value_heads, local.intermediate_size, local.vocab_size,
            local.hidden_size, local.d) == (8, 1, 3584, 16032, 8192, 128)
    # the norms stay whole on every rank: 80 layers x 2 norms + the final norm, hidden each
    assert local.params == pytest.approx((full.params - 161 * 8192) / 8 + 161 * 8192, rel=1e-6)
    assert full.tp_local(1) is full
    with pytest.raises(ValueError, match="tp_size=16 must divide"):
        full.tp_local(16)


def test_tp_divides_state_and_activations() -> None:
    one = estimate_training_memory("llama3-70b", sp_size=1, **SETTING)
    tp2 = estimate_training_memory("llama3-70b", sp_size=1, tp_size=2, **SETTING)
    tpsp = estimate_training_memory("llama3-70b", sp_size=1, tp_size=2, tp_sequence_parallel=True, **SETTING)
    assert tp2["parameters"] == pytest.approx(one["parameters"] / 2, rel=0.01)
    assert tp2["activations"] < one["activations"]
    # plain TP gathers the logits: the loss's buffers are the whole vocabulary's, as at tp 1
    assert tp2["logits_loss"] == one["logits_loss"]
    # TP-SP splits the residual stream and makes the loss vocab-parallel
    assert tpsp["activations"] < tp2["activations"] and tpsp["logits_loss"] < tp2["logits_loss"]
    assert tpsp["parameters"] == tp2["parameters"]


def test_layer_saved_bytes_with_tp() -> None:
    shape = "llama3-70b"
    plain, tp8 = layer_saved_bytes(shape, dtype="bf16"), layer_saved_bytes(shape, dtype="bf16", tp_size=8)
    tpsp8 = layer_saved_bytes(shape, dtype="bf16", tp_size=8, tp_sequence_parallel=True)
    assert tpsp8 < tp8 < plain
    h, e = 8192, 2
    # the norms' fp32 upcast and normalised copy split 8 ways (the projection's gathered input stays whole)
    assert tp8 - tpsp8 == 2 * ((h * 4 + h * e + 4) - (h * 4 + h * e + 4) // 8)


def test_layouts_cli(capsys: pytest.CaptureFixture) -> None:
    """``python -m seqpar.bench memory --model llama3-70b --layouts tp8,sp8,tp2xsp4`` (the BENCHMARKS table):
    one row per layout, TP layouts with and without tp_sequence_parallel; TP-SP reaches further than TP alone."""
    from seqpar.bench import model_memory
    from seqpar.bench.__main__ import main

    assert model_memory.parse_layouts("tp8,sp8,tp2xsp4") == [(8, 1), (1, 8), (2, 4)]
    assert main(["memory", "--model", "llama3-70b", "--gpus", "8", "--gpu-mem", "80", "--layouts",
                 "tp8,sp8,tp2xsp4", "--no-progress"]) == 0
    out = capsys.readouterr().out
    cells = [re.split(r"\s{2,}", line.strip()) for line in out.splitlines() if line.startswith("8 ")]
    seq = {c[1]: c[2] for c in cells}  # configuration -> longest sequence, e.g. "1.11M" or "545K"
    assert set(seq) == {"TP 8", "TP 8, tp_sequence_parallel", "SP 8", "TP 2 x SP 4", "TP 2 x SP 4, tp_sequence_parallel"}

    def tokens(name: str) -> float:
        return float(seq[name][:-1]) * (2**20 if seq[name].endswith("M") else 1024)

    assert tokens("TP 8, tp_sequence_parallel") > tokens("TP 8")
    assert tokens("TP 2 x SP 4, tp_sequence_parallel") > tokens("TP 2 x SP 4")


def test_tiled_loss_under_plain_tp_is_vocab_parallel() -> None:
    """``tiled_loss`` at tp_size > 1 without TP-SP is vocab-parallel too (``tiled_lm_loss`` takes the head's
    ``Shard(0)`` slice: each chunk's logits and the fp32 dW accumulator are ``vocab / tp`` wide), so its loss buffers
    are the rank's slice's: the tiled loss's backward model over ``vocab / tp`` (at TP 2, 16K rows under a 64K
    slice: the vocabulary order, the slice's bf16 gradient + dhidden's fp32 accumulator + a block's buffers; at TP 8,
    a 16K slice: the row order, two chunks of fp32 logits, the fp32 dW accumulator and its bf16 cast, dhidden).
    Seen failing: the model's vocab-parallel rule reduced to ``tp_sequence_parallel`` alone (the tiled loss at
    plain TP counted with the whole vocabulary's accumulator: 2x it at TP 2)."""
    from seqpar.memory.tiling import loss_backward_bytes, loss_backward_order, loss_chunk_rows

    setting = {**SETTING, "tiled_loss": True}
    for tp, order in ((2, "vocab"), (8, "rows")):
        got = estimate_training_memory("llama3-8b", sp_size=2, tp_size=tp, **setting)["logits_loss"]
        v, h, e = -(-128256 // tp), 4096, 2
        rows = 32768 // 2
        chunk = loss_chunk_rows(rows, h, v)
        assert loss_backward_order(rows, h, v, e, e, chunk) == order
        assert got == loss_backward_bytes(order, rows, h, v, e, e, chunk), (tp, got)
        whole = loss_backward_bytes(order, rows, h, 128256, e, e, loss_chunk_rows(rows, h, 128256))
        assert got < whole, (tp, got, whole)


def test_tp_loss_parallel_sets_the_logits_layout() -> None:
    """``tp_loss_parallel`` (the block's key) overrides the layout ``tp_sequence_parallel`` implies: ``True`` at
    plain TP counts the vocab-split loss buffers (TP-SP's), ``False`` under TP-SP the gathered ones (plain TP's).

    Seen failing: the model's rule left at ``tp_sequence_parallel or tiled_loss`` (the key ignored): both
    overrides counted the other layout's buffers (2x off at TP 2)."""
    tp2 = estimate_training_memory("llama3-70b", sp_size=1, tp_size=2, **SETTING)
    tpsp = estimate_training_memory("llama3-70b", sp_size=1, tp_size=2, tp_sequence_parallel=True, **SETTING)
    split = estimate_training_memory("llama3-70b", sp_size=1, tp_size=2, tp_loss_parallel=True, **SETTING)
    gathered = estimate_training_memory("llama3-70b", sp_size=1, tp_size=2, tp_sequence_parallel=True,
                                        tp_loss_parallel=False, **SETTING)
    assert tpsp["logits_loss"] < tp2["logits_loss"]
    assert split["logits_loss"] == tpsp["logits_loss"]
    assert gathered["logits_loss"] == tp2["logits_loss"]
    with pytest.raises(ValueError, match="tp_loss_parallel"):
        estimate_training_memory("llama3-70b", sp_size=1, tp_size=2, tp_loss_parallel="yes", **SETTING)
