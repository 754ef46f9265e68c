"""seqpar.estimate_training_memory against the measured peak of the main job (launch/train.py on CPU,
exact tensor accounting by seqpar.memory.tracker) within 10%, over SP 1/2/4, tiling on/off, activation
checkpointing on/off, FSDP2 and DeepSpeed ZeRO-2/3, a 32000-token vocabulary, seq-len up to 8192.
Plus the estimator's own rules and the model-level CLI.

The check must be able to fail on any term that matters: with a 32000-token vocabulary the logits are
~92% of the peak in several settings, where a wrong attention term would pass. So settings of a
model with a small vocabulary, 16 heads and one layer at 8192 tokens (``"attn"``) put attention's
transients at 29-44% of the peak, and each setting doubles every term of the estimate in turn
(:data:`TERMS`, each estimator patched x2): any term worth 20% of the peak or more must then take
the estimate out of the 10% band, and across the settings, every term that can reach 20% does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from launch_module import run_main, train_module

import seqpar
import seqpar.memory.training as training
from seqpar.memory.training import CATEGORIES, estimate_training_memory, longest_sequence

ROOT = Path(__file__).resolve().parents[1]
MODEL = {"hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 32000}
# attention's transients a large share of the peak: small vocabulary and MLP, many heads, one layer
ATTN_MODEL = {"hidden_size": 128, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 8,
              "num_key_value_heads": 8, "vocab_size": 256}
MODELS = {"train": MODEL, "attn": ATTN_MODEL}
TOLERANCE = 0.10
SIGNIFICANT = 0.20  # a term worth this share of the peak must move the estimate out of the band when doubled

# (engine, zero stage, SP size, seq len, tiled_loss, tiled_mlp, activation checkpointing
#  [, recompute_norm[, attention mode[, model[, DeepSpeed reduce_bucket_size]]]])
SETTINGS = [
    ("fsdp2", 0, 1, 2048, False, False, False),
    ("fsdp2", 0, 2, 2048, False, False, True),
    ("fsdp2", 0, 2, 4096, True, False, False),
    ("fsdp2", 0, 4, 8192, True, "auto", True),
    ("deepspeed", 2, 2, 2048, False, False, False),
    ("deepspeed", 2, 2, 2048, True, "auto", True),
    ("deepspeed", 3, 2, 2048, False, False, True),
    ("deepspeed", 3, 2, 2048, True, False, False),
    ("fsdp2", 0, 2, 8192, True, "auto", False, True),
    # attention transients 37%, 44%, 29% of the peak
    ("fsdp2", 0, 2, 8192, False, False, True, False, "allgather", "attn"),
    ("fsdp2", 0, 4, 8192, False, False, True, False, "allgather", "attn"),
    ("fsdp2", 0, 2, 8192, False, False, True, False, "ring", "attn"),
    # a bucket a quarter of the model's gradients: ZeRO-3 reduces during the backward (the head's, larger than it)
    ("deepspeed", 3, 2, 2048, True, False, False, False, "ring", "train", 1_000_000),
    # a bucket the head fits and the layers overflow: a bucket's worth reduced inside the last layer's backward
    ("deepspeed", 3, 2, 2048, True, False, False, False, "ring", "train", 2_100_000),
]


def _doubled(name: str) -> Any:
    """``seqpar.memory.training``'s estimator ``name`` with every figure it returns doubled."""
    fn = getattr(training, name)

    def twice(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        if isinstance(out, tuple):  # a NamedTuple of figures, or a plain pair
            return type(out)(*(2 * x for x in out)) if hasattr(out, "_fields") else tuple(2 * x for x in out)
        return 2 * out

    return twice


# (setting, term) where doubling a term of >= 20% cannot be told from the measurement, and why
LOOSE = {
    (("deepspeed", 2, 2, 2048, True, "auto", True), "zero12 reduction"):
        "the measured peak is bimodal: one more partition-sized tensor is alive in some runs (the "
        "estimator's docstring: -9.7% then), and from -9.7% a term of 21% doubled lands at +9.6%",
}

# settings whose measured peak the model is known to much better than the band: (lowest, highest) ratio - 1
TIGHT = {
    # ZeRO-3's end-of-backward reduce-scatter: the flat input and gloo's copy of it (est29: -7.8% -> -0.05%; what is
    # left, -57 KB, is the batch's int64 token ids and labels, which the model does not count). Seen failing on the
    # estimate before: 104,152,704 against 112,879,861 bytes measured, -7.7%
    ("deepspeed", 3, 2, 2048, True, False, False): (-0.005, 0.02),
    # ZeRO-3 reducing the head's gradient (larger than the 1e6-element bucket) during the backward, beside every
    # layer's activations: the gloo copy of it (est29b: -5.5% -> -0.2%). Seen failing on the estimate before:
    # 88,152,704 against 93,326,329 bytes measured, -5.5%, at the last layer's backward
    ("deepspeed", 3, 2, 2048, True, False, False, False, "ring", "train", 1_000_000): (-0.005, 0.02),
    # ZeRO-3 reducing a bucket's worth inside the last layer's backward, at o_proj's gradient: the layer's MLP has
    # freed its saved tensors by then (est30: +5.2% -> +0.7%). Seen failing on the estimate before: 97,949,440 against
    # 93,147,769 bytes measured, +5.2%
    ("deepspeed", 3, 2, 2048, True, False, False, False, "ring", "train", 2_100_000): (-0.005, 0.02),
    # FSDP2 at the last layer's backward (est37, tests/test_est37_ring_copies.py): the ring's copies of a pass's strided
    # dout, k, v, the post-attention norm's saved tensors freed, the untiled loss's logits held, only the weight
    # gradients made by then, the lse once, the MLP's product freed by down_proj's backward: ring +2.4% -> -156 B,
    # all-gather +5.9% / +5.2% -> +0.57% / +0.47%, tiled loss +2.6% -> -192 B (what is under is scalars). Seen failing
    # on the estimate before: the all-gather rows at +5.9% / +5.2%, the ring's at +2.4% and the tiled loss's at +2.6%
    ("fsdp2", 0, 2, 4096, True, False, False): (-0.001, 0.02),
    ("fsdp2", 0, 2, 8192, False, False, True, False, "allgather", "attn"): (-0.001, 0.02),
    ("fsdp2", 0, 4, 8192, False, False, True, False, "allgather", "attn"): (-0.001, 0.02),
    ("fsdp2", 0, 2, 8192, False, False, True, False, "ring", "attn"): (-0.001, 0.02),
    # ZeRO-3's gradient bucket is allocated when the engine is built (stage3's IPG buffer, contiguous_gradients) and
    # is alive at the loss's backward (est37: -3.31% -> -121 B, recorded). Seen failing on the estimate before: -3.3%
    ("deepspeed", 3, 2, 2048, False, False, True): (-0.005, 0.02),
}

# each term of the estimate, by the estimator that makes it
TERMS = {
    "attention_transients": "_attention_transient_bytes",
    "logits_loss": "_logits_loss_bytes",
    "activations": "_activation_bytes",
    "parameters+optimizer_state+gradients": "_state_bytes",
    "root gradients": "_root_grad_bytes",
    "zero12 reduction": "_zero12_reduce_bytes",
    "communication": "_communication_bytes",
    "zero3 head reduction": "_zero3_head_scatter_bytes",
}


def _train_module() -> Any:
    return train_module()


def _run_main(rank: int, world: int, argv: list[str]) -> dict[str, Any]:
    return run_main(argv)


def _config(tmp_path: Path, engine: str, stage: int, mode: str = "ring", model: dict = MODEL,
            bucket: int = 5_000_000, zero: dict | None = None) -> str:
    sp = {"size": 1, "mode": mode, "sharding": "zigzag", "swap": "auto"}
    train = {"steps": 2, "seed": 0, "lr": 0.003, "eval_samples": 0}
    if engine == "fsdp2":
        cfg = {"sequence_parallel": sp, "model": model, "train": {**train, "engine": "fsdp"},
               "fsdp": {"version": 2, "reshard_after_forward": True}}
    else:
        cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
               "optimizer": {"type": "AdamW", "params": {"lr": 0.003, "weight_decay": 0.0, "torch_adam": True}},
               "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket,
                                     "allgather_bucket_size": bucket, **(zero or {})},
               "gradient_clipping": 1.0, "steps_per_print": 10**9,
               "sequence_parallel": sp, "model": model, "train": train}
    path = tmp_path / f"{engine}{stage}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: "-".join(str(x) for x in s))
def test_estimate_within_10_percent_of_measured_peak(dist_pool, tmp_path: Path, setting: tuple) -> None:
    engine, stage, sp, seq, tiled_loss, tiled_mlp, ac, *rest = setting
    recompute_norm = bool(rest and rest[0])
    mode = rest[1] if len(rest) > 1 else "ring"
    model = MODELS[rest[2] if len(rest) > 2 else "train"]
    bucket = rest[3] if len(rest) > 3 else 5_000_000
    argv = ["--config", _config(tmp_path, engine, stage, mode, model, bucket), "--sp-size", str(sp), "--seq-len", str(seq),
            "--no-progress", "--log-level", "WARNING"]
    argv += ["--tiled-loss"] * tiled_loss + (["--tiled-mlp", str(tiled_mlp)] if tiled_mlp else [])
    argv += ["--activation-checkpointing"] * ac
    argv += ["--recompute-norm"] * recompute_norm
    out = dist_pool.run(sp, _run_main, argv, timeout=400)
    measured = max(out[0]["peak_mem_bytes"])
    assert "seqpar.memory.tracker" in out[0]["peak_mem_kind"]

    def estimate() -> dict:
        return estimate_training_memory(model, seq_len=seq, sp_size=sp, engine=engine, zero_stage=stage,
                                        activation_checkpointing=ac, tiled_loss=tiled_loss, tiled_mlp=tiled_mlp,
                                        reduce_bucket_size=bucket, recompute_norm=recompute_norm, mode=mode)

    est = estimate()
    print(f"\nestimate vs measured {setting}: {est['peak'] / 2**20:.1f} MiB vs {measured / 2**20:.1f} MiB "
          f"({est['peak'] / measured - 1:+.1%}, at {est['moment']})")  # BENCHMARKS.md's table (pytest -s)
    assert abs(est["peak"] / measured - 1) <= TOLERANCE, (setting, est, measured)
    lo, hi = TIGHT.get(tuple(setting), (-TOLERANCE, TOLERANCE))
    assert lo <= est["peak"] / measured - 1 <= hi, (setting, est, measured)
    shares = {}
    for term, name in TERMS.items():  # the validation above must see each term that matters
        with mock.patch.object(training, name, _doubled(name)):
            wrong = estimate()["peak"]
        shares[term] = wrong / est["peak"] - 1  # the term's share of the peak
        if shares[term] >= SIGNIFICANT and (tuple(setting), term) not in LOOSE:
            assert abs(wrong / measured - 1) > TOLERANCE, (
                f"{setting}: {term} is {shares[term]:.0%} of the peak, yet the estimate with it doubled "
                f"({wrong / 2**20:.1f} MiB) is still within {TOLERANCE:.0%} of the measured {measured / 2**20:.1f} MiB"
            )
    if len(rest) > 2 and rest[2] == "attn":
        assert shares["attention_transients"] >= 0.25, shares  # the point of these settings


# tests/test_training_memory.py's ZeRO-3 tiled-loss setting measured (est29, TensorMemoryTracker record_peak): the peak
# is stage3's __avg_scatter_grads at the end of backward, bytes per rank
ZERO3_TILED_MEASURED = 112_879_861


def test_zero3_end_of_backward_counts_the_flat_scatter_input_and_gloos_copy() -> None:
    """ZeRO-3 reducing its last gradient bucket (stage3's ``__avg_scatter_grads`` -> ``reduce_scatter_coalesced``),
    the storages alive at the measured peak (fp32, SP 2, 2048, tiled loss; ``ZERO3_TILED_MEASURED``): the five
    partitions (fp16/fp32 flat, fp32 master, AdamW's two moments, the gradient partition: 5 x 8,438,400), the
    5e6-element bucket (20,000,000) holding the whole gradients, the gathered whole parameters (16,876,800), the
    bucket's flat reduce-scatter input padded to the world (16,876,800) and gloo's copy of it made inside torch's
    ``reduce_scatter_tensor`` (16,876,800); the batch's int64 token tensors (57,344: the whole sample's input ids and
    labels, this rank's input ids, shift labels and positions). The estimate is that moment, within -0.02% .. +0.5%
    (what is left is 117 bytes of scalars); on a GPU (NCCL scatters in place) it has no gloo copy.

    Seen failing: the estimate before (the root's whole gradients beside the bucket instead of the flat input and
    gloo's copy): 104,152,704 bytes, -7.7%, at the last layer's backward; without gloo's copy (``2 if device ==
    "cpu" else 1`` -> ``1``): the same, the end of backward then 95,952,896 bytes (-15.0%); without the token
    tensors (est29's model): 112,822,400 bytes, -0.05%."""
    kw = {"seq_len": 2048, "sp_size": 2, "engine": "deepspeed", "zero_stage": 3, "tiled_loss": True,
          "reduce_bucket_size": 5_000_000}
    est = estimate_training_memory(MODEL, **kw)
    assert est["moment"] == "grad_reduction", est
    assert -0.0002 <= est["peak"] / ZERO3_TILED_MEASURED - 1 <= 0.005, est
    # a GPU: no gloo copy, so this moment is 16,876,800 bytes lower there and the last layer's backward the peak
    assert estimate_training_memory(MODEL, **kw, device="cuda")["peak"] < est["peak"] - 8_000_000


# the same setting with a 1e6-element bucket (est29b, record_peak): the peak is stage3's
# reduce_independent_p_g_buckets_and_remove_grads -> __avg_scatter_grads on the head's gradient, bytes per rank
ZERO3_SMALL_BUCKET_MEASURED = 93_326_329


def test_zero3_head_gradient_larger_than_the_bucket_is_reduced_beside_the_activations() -> None:
    """ZeRO-3 with a bucket smaller than the LM head's gradient (1e6 elements, a quarter of the model's): DeepSpeed
    leaves that gradient out of the bucket, and the final norm's gradient, the next to arrive, overflows the bucket
    and reduce-scatters it during the backward. Alive at the measured peak (``ZERO3_SMALL_BUCKET_MEASURED``): the five
    partitions (5 x 8,438,400), the gathered embedding and head (2 x 8,192,000), the head's whole gradient
    (8,192,000; evenly split, so scattered in place), gloo's copy of it inside torch's ``reduce_scatter_tensor``
    (8,192,000), the 1e6-element bucket (4,000,000) and every layer's activations. The estimate is that moment,
    within -0.5% .. +2%; on a GPU (NCCL, no copy) the moment adds nothing, and a bucket the whole model fits has no
    such moment. A bucket the head fits but the layers overflow (2.1e6) reduces a bucket's worth inside the last
    layer's backward, at o_proj's gradient (the bucket holds the head's, the final norm's and the layer's MLP's:
    2,097,280 elements): 93,147,769 bytes measured (est30's record_peak: the flat input and gloo's copy, 2 x 8,389,120,
    beside the bucket; the layer's MLP's saved gate, up, act(gate) and product freed), estimated -0.05 .. +1%.

    Seen failing: the estimate before (no such moment): 88,152,704 bytes, -5.5%, at the last layer's backward; with
    a 2.1e6-element bucket 92,552,704 bytes, -0.64%; with every layer's activations counted at the 2.1e6 bucket's
    reduction (est29b's model): 97,949,440 bytes, +5.2%."""
    kw = {"seq_len": 2048, "sp_size": 2, "engine": "deepspeed", "zero_stage": 3, "tiled_loss": True,
          "reduce_bucket_size": 1_000_000}
    est = estimate_training_memory(MODEL, **kw)
    assert est["moment"] == "backward_reduction", est
    assert -0.005 <= est["peak"] / ZERO3_SMALL_BUCKET_MEASURED - 1 <= 0.02, est
    assert estimate_training_memory(MODEL, **kw, device="cuda")["moment"] != "backward_reduction"
    # a bucket the head fits and the layers overflow (2.1e6): a bucket's worth reduced inside the last layer's
    # backward after its MLP's, measured 93,147,769 bytes (the flat input and gloo's copy, 2 x 8,389,120, beside the
    # bucket; the MLP's saved tensors freed)
    over = estimate_training_memory(MODEL, **{**kw, "reduce_bucket_size": 2_100_000})["peak"] / 93_147_769 - 1
    assert -0.0005 <= over <= 0.01, over  # est33: -121 B of scalars once the rotary pair is counted once
    fits = estimate_training_memory(MODEL, **{**kw, "reduce_bucket_size": 5_000_000})  # the whole model fits
    assert fits["moment"] != "backward_reduction", fits


def test_estimator_categories_and_rules() -> None:
    est = seqpar.estimate_training_memory("llama3-8b", seq_len=131072, sp_size=8, dp_size=1, engine="deepspeed",
                                          zero_stage=3, dtype="bf16", activation_checkpointing=True,
                                          tiled_loss=False, tiled_mlp=False, offload_activations=False, mode="ring")
    assert set(CATEGORIES) <= set(est) and est["peak"] > 0
    tiled = estimate_training_memory("llama3-8b", seq_len=131072, sp_size=8, engine="deepspeed", zero_stage=3,
                                     dtype="bf16", activation_checkpointing=True, tiled_loss=True)
    # the arithmetic: 16K local tokens x 128256 vocab bf16 logits alone are ~4 GB; with their
    # fp32 softmax and gradients several times that; tiled, a chunk plus the fp32 dW accumulator
    logits_alone = 16384 * 128256 * 2
    assert est["logits_loss"] >= 3 * logits_alone and tiled["logits_loss"] < logits_alone
    off = estimate_training_memory("llama3-8b", seq_len=131072, sp_size=8, engine="deepspeed", zero_stage=3,
                                   dtype="bf16", activation_checkpointing=True, offload_activations=True,
                                   device="cuda")
    assert off["activations"] < est["activations"]
    cpu_off = estimate_training_memory("llama3-8b", seq_len=131072, sp_size=8, engine="deepspeed", zero_stage=3,
                                       dtype="bf16", activation_checkpointing=True, offload_activations=True)
    assert cpu_off["activations"] == est["activations"]  # no pinned memory on CPU: offload saves nothing
    with pytest.raises(ValueError, match="engine"):
        estimate_training_memory(MODEL, seq_len=1024, sp_size=1, engine="ddp")
    with pytest.raises(ValueError, match="multiple of sp_size"):
        estimate_training_memory(MODEL, seq_len=1000, sp_size=3)
    seq, breakdown = longest_sequence("llama3-8b", 80 * 2**30, sp_size=8, engine="deepspeed", zero_stage=3,
                                      dtype="bf16", activation_checkpointing=True, tiled_loss=True,
                                      tiled_mlp="auto", offload_activations=True, device="cuda")
    assert seq > 0 and breakdown["peak"] <= 80 * 2**30
    longer = estimate_training_memory("llama3-8b", seq_len=seq + 8 * 1024, sp_size=8, engine="deepspeed",
                                      zero_stage=3, dtype="bf16", activation_checkpointing=True, tiled_loss=True,
                                      tiled_mlp="auto", offload_activations=True, device="cuda")
    assert longer["peak"] > 80 * 2**30


def test_state_and_offload_terms_written_out() -> None:
    """Terms the measured settings above cannot see, written out from the engines' rules: every measured setting
    runs at DP 1 (world = SP), offload counts only on CUDA, no model ties its head. The engine's partition is over the DP x SP ranks; AdamW keeps two fp32 moments on it; a tied head adds no
    second vocab x hidden matrix; offloaded checkpointed inputs leave two layers' inputs on the device (the
    one in use and its prefetched predecessor) instead of every layer's.
    Seen failing: the partition taken over SP alone (DP ignored: 2x the state at DP 2), one AdamW moment,
    offload keeping one layer's input, the head counted twice with tied embeddings, and FSDP2's reduced layer
    shards counted whole (not divided by the world) at the end of backward."""
    from seqpar.memory.training import ModelShape

    model = {**MODEL, "num_hidden_layers": 6}
    params = ModelShape.from_config(model).params
    base = {"seq_len": 4096, "sp_size": 2, "engine": "fsdp2", "dtype": "fp32"}
    for dp in (1, 2, 4):
        est = estimate_training_memory(model, dp_size=dp, **base)
        part = -(-params // (2 * dp))
        assert est["optimizer_state"] == 2 * part * 4, (dp, est["optimizer_state"], part)
    ckpt = {**base, "activation_checkpointing": True, "offload_activations": True}
    on_gpu = estimate_training_memory(model, device="cuda", **ckpt)["activations"]
    on_cpu = estimate_training_memory(model, device="cpu", **ckpt)["activations"]  # offload is a no-op on CPU
    rows, h, e = 4096 // 2, model["hidden_size"], 4
    assert on_cpu - on_gpu == (6 - 2) * rows * h * e, (on_cpu - on_gpu) / (rows * h * e)
    tied = ModelShape.from_config({**model, "tie_word_embeddings": True})
    assert params - tied.params == model["vocab_size"] * h
    # FSDP2's end of backward on a large model at short sequences (the peak there): the fp32 shard and the
    # gathered root and two layers, two moments, the root's gradients being reduce-scattered (the flat fp32
    # input and the output shard) beside the head's whole gradient, every layer's reduced fp32 shard, and the
    # batch's int64 token tensors (the whole sample's input ids and labels, this rank's three cuts)
    shape = ModelShape.from_config(training.MODEL_SHAPES["llama3-8b"])
    world = 8
    part = -(-shape.params // world)
    est = estimate_training_memory("llama3-8b", seq_len=1024, sp_size=2, dp_size=4, engine="fsdp2", dtype="fp32",
                                   activation_checkpointing=True, tiled_loss=True, tiled_mlp="auto")
    want = (part * 4 + (shape.root_params + 2 * shape.layer_params) * 4 + 2 * part * 4
            + shape.root_params * 4 * (1 + 1 / world) + shape.vocab_size * shape.hidden_size * 4
            + shape.num_hidden_layers * shape.layer_params * 4 / world + 8 * (2 * 1024 + 3 * 512))
    assert (est["moment"], est["peak"]) == ("grad_reduction", int(want)), (est["peak"] / want)


def test_model_memory_cli(capsys: pytest.CaptureFixture) -> None:
    from seqpar.bench.__main__ import main

    assert main(["memory", "--model", "llama3-8b", "--gpus", "8", "--gpu-mem", "80", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "llama3-8b" in out and "MODELLED" in out and "tiled MLP" in out and "ALST" in out


def test_tiled_mlp_of_one_chunk_is_the_untiled_mlp(capsys: pytest.CaptureFixture) -> None:
    """``tiled_mlp="auto"`` at fewer local rows than the hidden size makes one chunk, and seqpar's tiled MLP then calls
    the MLP as it is (seqpar.memory.tiling: ``chunks == 1`` runs ``original(x)``): the whole-step estimate is the
    untiled one, every figure; with more chunks (Llama-3-8B on 8 GPUs from 128K tokens) tiling never needs more (at
    64K, 2 chunks, its fp32 weight-gradient accumulator costs more than ZeRO-3's untiled MLP backward holds).
    The memory CLI at 24 GB per GPU: the tiled-MLP row fits what the tiled-loss row fits, and every row with offload
    at least the AC-only row's 8K.

    Seen failing: the estimate before session 27, which counted the tiled MLP's fp32 weight-gradient accumulator at
    one chunk (``mlp_rows >= rows`` not taken as untiled in ``_activation_bytes``): 23.37 GiB tiled against 22.49
    GiB untiled at 8K, and the CLI's tiled-MLP rows fitted nothing ("-")."""
    from seqpar.bench.__main__ import main

    kw = {"sp_size": 8, "dp_size": 1, "engine": "deepspeed", "zero_stage": 3, "dtype": "bf16",
          "activation_checkpointing": True, "mode": "ring", "device": "cuda", "tiled_loss": True}
    for seq in (8192, 16384, 32768):  # 1K to 4K rows a rank: one chunk of 4096
        assert (estimate_training_memory("llama3-8b", seq_len=seq, tiled_mlp="auto", **kw)
                == estimate_training_memory("llama3-8b", seq_len=seq, tiled_mlp=False, **kw)), seq
    for seq in (131072, 524288):
        tiled = estimate_training_memory("llama3-8b", seq_len=seq, tiled_mlp="auto", **kw)["peak"]
        assert tiled <= estimate_training_memory("llama3-8b", seq_len=seq, tiled_mlp=False, **kw)["peak"], seq
    # at 8K rows a rank (2 chunks) ZeRO-3's untiled MLP holds one weight gradient beside its intermediates' (each is
    # copied into the bucket as it is made; est31 measured it), less than the tiled MLP's fp32 accumulator of all
    # three (3 h I x 4 bytes): tiling costs at most that accumulator more there
    tiled, untiled = (estimate_training_memory("llama3-8b", seq_len=65536, tiled_mlp=t, **kw)["peak"]
                      for t in ("auto", False))
    assert 0 < tiled - untiled < 3 * 4096 * 14336 * 4, (tiled, untiled)
    assert main(["memory", "--model", "llama3-8b", "--gpus", "8", "--gpu-mem", "24", "--no-progress"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("8 ")]
    assert len(rows) == 7, rows
    # the tiled-MLP row fits what the row without it fits: at 1K rows a rank the MLP is one chunk. (Both fit nothing
    # since est27c: at 8K the tiled loss's term, 2.94 GiB with the head's bf16 gradient cast from its fp32
    # accumulator, is above the untiled loss's 1.71 GiB; tests/test_memory_tiled_loss_bf16.py measures it.)
    assert rows[2][10:90].split()[-2] == rows[1][10:90].split()[-2], rows
    # (the offload rows fit 24K and 32K since est28b, 16K and 24K before: the untiled MLP's moment holds
    # down_proj's weight gradient beside its intermediates' gradients, not the layer's whole gradients)
    assert all(any(f"{k}K" in line[:90] for k in (8, 16, 24, 32)) for line in rows[:1] + rows[3:]), rows


def test_model_memory_cli_takes_the_data_mask(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """``memory --model ... --window W --sinks`` hands the data's mask to every row's whole-step estimate (the ring's
    plan under it, seqpar.memory.masked) and leaves out the Ulysses row, whose estimate refuses masks (that the
    whole-step estimate follows the mask is test_memory_masks'). Seen failing: with ``kw.update(cfg.masks)`` removed from model_memory.run (the rows were estimated unmasked)."""
    from seqpar.bench import model_memory
    from seqpar.bench.__main__ import main

    seen = []

    def recording(model, budget, **kw):  # the search itself is the library's; the test only sees what it is asked
        seen.append(kw)
        return 0, {}

    monkeypatch.setattr(model_memory, "longest_sequence", recording)
    assert main(["memory", "--model", "llama3-8b", "--gpus", "8", "--window", "512", "--sinks", "--sharding",
                 "contiguous", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "window 512, sinks True, sharding contiguous" in out and "Ulysses" not in out and "head_chunks 8" in out
    assert len(seen) == len(model_memory.CONFIGURATIONS) - 1
    assert all((k["window"], k["sinks"], k["sharding"], k.get("chunk_size")) == (512, True, "contiguous", None)
               for k in seen)
    seen.clear()
    assert main(["memory", "--model", "llama3-70b", "--layouts", "tp2xsp4", "--chunk-size", "2048",
                 "--no-progress"]) == 0
    assert seen and all(k["chunk_size"] == 2048 and "window" not in k for k in seen)
    with pytest.raises(SystemExit, match="--chunk-size 0"):
        main(["memory", "--model", "llama3-8b", "--chunk-size", "0", "--no-progress"])



@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_layer_activations_equal_the_measured_saved_tensors(dtype: str) -> None:
    # what one recomputed decoder layer saves (the estimator's activations less the checkpointed
    # inputs and the gradient coming down), against seqpar.bench.layer_memory's measurement, with the
    # Hugging Face RMSNorms and with recompute_norm, MLP tiled and not
    import torch

    from seqpar.bench.layer_memory import saved_units

    shape = {"vocab_size": 64, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 1,
             "num_attention_heads": 8, "num_key_value_heads": 2}
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    tokens = 256
    unit = tokens * 256 * torch.empty((), dtype=torch_dtype).element_size()
    for recompute_norm in (False, True):
        for tiled_mlp in (False, 4):
            measured = saved_units(torch_dtype, tokens, recompute_norm=recompute_norm, tiled_mlp=tiled_mlp)["total"]
            est = estimate_training_memory(shape, seq_len=tokens, sp_size=1, dtype=dtype, activation_checkpointing=True,
                                           tiled_mlp=tiled_mlp, recompute_norm=recompute_norm)
            modelled = est["activations"] / unit - 2  # less the checkpointed input and the incoming gradient
            assert abs(modelled - measured) <= 0.02 * measured, (dtype, recompute_norm, tiled_mlp, modelled, measured)
    lean = estimate_training_memory("llama3-8b", seq_len=2**22, sp_size=8, dtype="bf16", engine="deepspeed",
                                    activation_checkpointing=True, tiled_loss=True, tiled_mlp="auto",
                                    offload_activations=True, device="cuda", recompute_norm=True)
    hf = estimate_training_memory("llama3-8b", seq_len=2**22, sp_size=8, dtype="bf16", engine="deepspeed",
                                  activation_checkpointing=True, tiled_loss=True, tiled_mlp="auto",
                                  offload_activations=True, device="cuda")
    # 512K local tokens x 4096 x bf16 = 4 GiB a unit: the lean norms save 5 of them in the recomputed layer
    assert hf["activations"] - lean["activations"] == pytest.approx(5 * 2**30 * 4, rel=0.01)


def _saved_units_sp(rank: int, world: int, mode: str) -> float:
    import torch

    from seqpar.bench.layer_memory import saved_units

    return saved_units(torch.bfloat16, 128, mode=mode, tiled_mlp=2, head_chunks=2)["total"]


@pytest.mark.timeout(300)
def test_ring_output_shares_o_proj_storage_at_sp2(dist_pool) -> None:
    # the ring returns its output in q's (batch, seq, heads, dim) memory layout, so o_proj saves the
    # storage attention saves, not a contiguous copy: one hidden unit less per layer than allgather,
    # which copies (as the estimator's out_copy says)
    ring = dist_pool.run(2, _saved_units_sp, "ring", timeout=200)[0]
    allgather = dist_pool.run(2, _saved_units_sp, "allgather", timeout=200)[0]
    assert allgather - ring == pytest.approx(1.0, abs=0.01), (ring, allgather)


# --------------------------------------------------------------------------- hybrid models (issue 21)
# A dense Jamba (one Mamba layer, one attention layer) whose Mamba layer is most of the peak: the torch
# path's selective scan keeps (d_inner, d_state) fp32 tensors per token, the mixer's term the check must see.
HYBRID_MODEL = {"architecture": "jamba", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "attn_layer_period": 2, "attn_layer_offset": 1,
                "num_experts": 1, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_dt_rank": 4}
HYBRID_SETTING = ("fsdp2", 0, 2, 1024)  # engine, stage, SP size, seq len (ring, zigzag, no checkpointing)
# each mixer term of the estimate, by the MixerShape method that makes it
MIXER_TERMS = {"mixer activations": "saved_bytes", "mixer exchange (halo, chunk summaries)": "state_bytes"}


def _doubled_method(name: str) -> Any:
    from seqpar.memory.mixers import MixerShape

    fn = getattr(MixerShape, name)
    return lambda self, *args, **kwargs: 2 * fn(self, *args, **kwargs)


@pytest.mark.timeout(600)
def test_hybrid_estimate_within_10_percent_of_measured_peak(dist_pool, tmp_path: Path) -> None:
    from seqpar.memory.mixers import MixerShape

    engine, stage, sp, seq = HYBRID_SETTING
    argv = ["--config", _config(tmp_path, engine, stage, model=HYBRID_MODEL), "--sp-size", str(sp),
            "--seq-len", str(seq), "--no-progress", "--log-level", "WARNING"]
    out = dist_pool.run(sp, _run_main, argv, timeout=500)
    measured = max(out[0]["peak_mem_bytes"])
    model = {**HYBRID_MODEL, "vocab_size": _train_module().RecallTask(
        _train_module().TrainSettings()).vocab_size}

    def estimate() -> dict:
        return estimate_training_memory(model, seq_len=seq, sp_size=sp, engine=engine, zero_stage=stage)

    est = estimate()
    print(f"\nhybrid estimate vs measured {HYBRID_SETTING}: {est['peak'] / 2**20:.2f} MiB vs "
          f"{measured / 2**20:.2f} MiB ({est['peak'] / measured - 1:+.1%}, at {est['moment']})")
    assert abs(est["peak"] / measured - 1) <= TOLERANCE, (est, measured)
    shares = {}
    for term, name in [*TERMS.items(), *MIXER_TERMS.items()]:
        target = MixerShape if term in MIXER_TERMS else training
        with mock.patch.object(target, name, _doubled_method(name) if term in MIXER_TERMS else _doubled(name)):
            wrong = estimate()["peak"]
        shares[term] = wrong / est["peak"] - 1
        if shares[term] >= SIGNIFICANT:
            assert abs(wrong / measured - 1) > TOLERANCE, (term, shares[term], wrong, measured)
    assert shares["mixer activations"] >= 0.5, shares  # the point of this setting: the mixer dominates


# the mixer module of each family inside its decoder layer, by attribute name
_MIXER_ATTRS = {"mamba": ("mamba",), "short_conv": ("conv",), "lightning": ("self_attn",),
                "rglru": ("temporal_block",), "ssd": ("mamba", "mixer"), "gdn": ("linear_attn",)}


@pytest.mark.parametrize("model_type", ["jamba", "lfm2", "minimax", "recurrent_gemma", "falcon_h1", "bamba",
                                        "nemotron_h", "granitemoehybrid", "zamba2", "qwen3_next", "qwen3_5_text"])
def test_mixer_shape_from_the_config_alone(model_type: str) -> None:
    # the mixer's parameters and the layer kinds read from the config equal the built model's
    from all_models import tiny_kwargs
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    from seqpar.memory.mixers import mixer_shape

    config = CONFIG_MAPPING[model_type](**tiny_kwargs(model_type))
    mixer, kinds = mixer_shape(config)
    model = AutoModelForCausalLM.from_config(config)
    for i, (kind, layer) in enumerate(zip(kinds, model.model.layers, strict=True)):
        module = next((m for name, m in layer.named_modules()  # Zamba2's hybrid layer: mamba_decoder.mamba
                       if name.rsplit(".", 1)[-1] in _MIXER_ATTRS[mixer.family]), None)
        if kind in ("mixer", "both"):
            assert sum(p.numel() for p in module.parameters()) == mixer.params(config.hidden_size), (i, kind)
    assert "mixer" in kinds or "both" in kinds
    est = estimate_training_memory(config, seq_len=4096, sp_size=2)
    llama = estimate_training_memory({**{k: getattr(config, k) for k in ("vocab_size", "hidden_size",
                                      "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                      "num_key_value_heads")}}, seq_len=4096, sp_size=2)
    assert est["peak"] > 0 and est["activations"] != llama["activations"]


def test_mixer_exchange_grows_with_the_sp_size() -> None:
    """A mixer layer's sequence-parallel exchange: the conv halo does not depend on P, the all-gathered chunk
    summaries (each rank's transition and state per chunk, fp32, and as much again for the reduce-scatter buffer
    of their backward) are P ranks' worth, so two more ranks add exactly two ranks' summaries. The measured
    hybrid setting runs at SP 2 only, where this term hides inside the 10% band.
    Seen failing: the summaries counted for one rank whatever P (passed every other test)."""
    from seqpar.memory.mixers import mixer_shape

    mixer, _ = mixer_shape(HYBRID_MODEL)
    d, n = mixer.d_inner, mixer.d_state
    assert mixer.state_bytes(1, 2, 1, chunks=2) == 0  # one rank: nothing exchanged
    # Mamba: transition and state (d_inner x d_state each) per chunk (2: zigzag), fp32, gathered + its gradient
    two_ranks = 2 * (2 * (d * n + d * n) * 4) * 2
    assert mixer.state_bytes(1, 2, 4, chunks=2) - mixer.state_bytes(1, 2, 2, chunks=2) == two_ranks


# the MLP weights a large share of the step (wide MLP, tiny hidden size and vocabulary, one layer): their
# gradient counted twice moves the estimate by about 12% of the peak
MLP_MODEL = {"hidden_size": 32, "intermediate_size": 2048, "num_hidden_layers": 2, "num_attention_heads": 2,
             "num_key_value_heads": 2, "vocab_size": 256}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("sp,seq,chunks", [(2, 128, 1), (2, 128, 2), (2, 192, 3), (4, 256, 2), (4, 256, 4)])
def test_tiled_mlp_weight_gradient_is_counted_once(dist_pool, tmp_path: Path, sp: int, seq: int, chunks: int) -> None:
    """The tiled MLP's backward holds the MLP weights' gradient as its accumulator and one chunk's gradient, and
    no other gradient of the layer is made yet (the peak's storages, recorded: ``tiling.py:backward`` beside the
    unsharded weights, no whole gradient): the estimate adds no whole gradient of the layer beside the tiled
    MLP's transient. FSDP2, fp32, 2 layers, the MLP weights about 95% of the parameters.

    One chunk is the untiled MLP: at its peak only down_proj's weight gradient (h I) is alive beside the three
    intermediate gradients (recorded: 3 unsharded weights, 1 gradient of h I, 3 of I rows), not the layer's whole
    gradients.

    Seen failing: the estimate before (``p_layer * e`` added to the tiled MLP's moment, 3 h I e counted twice):
    SP 4 at 2 chunks +14.6% and at 4 chunks +13.7% (SP 2: +9.1% at 2 chunks, +5.4% at 3, inside the band).
    Seen failing: the untiled MLP's moment with the layer's whole gradients (``p_layer * e``): 1 chunk +10.1%.

    A flake, fixed in the tracker (flk30, flk30b): SP 4 x 4 measured 5,978,360 B (-10.06%) on rank 2 in one CI run
    of two. gloo's reduce-scatter copies a layer's whole flat gradient input (803,072 B here) into a buffer of its
    own, seen because gloo splits it through the dispatcher; gloo's worker thread drops it after the caller's wait,
    on loaded cores sometimes ops later. Deferring that one free by 30 tracked allocations gave exactly 5,978,360;
    by 100 or more, 6,240,504 (-13.8%); by 10 or fewer, the usual 5,437,432. The tracker now counts such a backend
    copy until the wait on its collective returns (seqpar.memory.tracker's docstring): 5,437,432 at every deferral
    (30 and 300 checked)."""
    argv = ["--config", _config(tmp_path, "fsdp2", 0, model=MLP_MODEL), "--sp-size", str(sp), "--seq-len", str(seq),
            "--no-progress", "--log-level", "WARNING", "--tiled-mlp", str(chunks)]
    out = dist_pool.run(sp, _run_main, argv, timeout=400)
    measured = max(out[0]["peak_mem_bytes"])
    est = estimate_training_memory(MLP_MODEL, seq_len=seq, sp_size=sp, engine="fsdp2", tiled_mlp=chunks)
    print(f"\ntiled MLP x{chunks} at SP {sp}, {seq}: estimate {est['peak']:,} vs measured {measured:,} "
          f"({est['peak'] / measured - 1:+.1%}, at {est['moment']})")
    assert abs(est["peak"] / measured - 1) <= TOLERANCE, (est, measured)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_untiled_mlp_moment_counts_down_projs_gradient(dist_pool, tmp_path: Path) -> None:  # noqa: ANN001
    """The untiled MLP's backward moment (``layer_backward``: the three intermediate gradients beside the MLP weights'
    gradients made so far, down_proj's ``h I e`` here, 32 rows a rank >= h) at FSDP2, fp32, SP 2, 64 tokens, the MLP
    model at hidden 32: the estimate is within 0 .. +5% of the measured peak (7,221,888 B on each rank; estimate
    7,455,040, +3.23%, est30b; 7,225,920, +0.06%, est37: down_proj's backward frees the product it saved, 32 x I
    here, before the intermediates' gradients peak), never under. The whole-step band (10%) lets the term go: here it
    is 3.3% of the peak. Since est37 the attention branch (its transients below what the MLP freed: the layer's
    gradients made so far, 4,224 B above the MLP's) is the estimate's moment here, so W2 below no longer moves it;
    tests/test_est37_ring_copies.py's tiled-loss row catches W2 (-65,728 B).

    Seen failing: the untiled MLP's ``mlp_grads = 0`` (mut29 / mut30's W2, down_proj's gradient not counted):
    7,209,536 B, -0.17%. (Not caught: mut30's W1, ``mlp_grads = h I e`` whatever the rows: it differs only when a
    rank's rows are below h, and the launcher's recall task needs 58 tokens, so h >= 64 there, where the estimate is
    +3.9% (64 tokens) / +4.6% (96) over and W1 lowers it by 1.5% / 1.9%: still over, so no band that passes the code
    catches it.)

    On fresh ranks (``fresh=True``): in one full-suite run (session 38) the ranks, reused by 2,800 earlier tests,
    measured 7,238,528 B (+16,640 B, -0.17% against this floor of 0) where fresh ranks and this file alone measure
    7,221,888 B every time; what the earlier jobs left that the job's tracker reaches was not found."""
    model = dict(MLP_MODEL, num_hidden_layers=2)
    argv = ["--config", _config(tmp_path, "fsdp2", 0, model=model), "--sp-size", "2", "--seq-len", "64",
            "--no-progress", "--log-level", "WARNING", "--tiled-mlp", "1"]
    out = dist_pool.run(2, _run_main, argv, timeout=400, fresh=True)
    measured = max(out[0]["peak_mem_bytes"])
    est = estimate_training_memory(model, seq_len=64, sp_size=2, engine="fsdp2", tiled_mlp=1)
    assert est["moment"] == "layer_backward", est
    assert 0 <= est["peak"] / measured - 1 <= 0.05, (est["peak"], measured, f"{est['peak'] / measured - 1:+.2%}")


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("hidden,inter,seq", [(64, 2048, 64), (64, 4096, 128)])
def test_one_layer_fsdp2_counts_no_prefetched_layer(dist_pool, tmp_path: Path, hidden: int, inter: int,
                                                    seq: int) -> None:  # noqa: ANN001
    """FSDP2 with a one-layer model gathers the root and that layer only: there is no next layer to prefetch, so the
    estimate counts none (fp32, SP 2, untiled MLP, the MLP model at one layer; within 0 .. +10% of the measured peak:
    est30b measured 7,312,476 B at hidden 64 / I 2048 / 64 tokens, +2.2% with the fix, and 16,096,604 B at I 4096 /
    128 tokens, +5.7%). Since est37 the peak is modelled as it is recorded, FSDP2 unsharding the layer as its backward
    starts (the all-gather's flat output, 1,638,912 B at I 2048, beside the layer's copies and every saved tensor):
    7,312,256 and 16,096,384 B, the measured bytes less 220 B of scalars (AdamW's step counters among them), which the
    floor of -512 B allows; the MLP moment, below it since est37 (the product freed), was 49,628 B under.

    Seen failing: the estimate counting a prefetched second layer whatever the depth (``gathered = (p_root + 2 *
    p_layer) * e``): +24.6% and +25.7%."""
    model = dict(MLP_MODEL, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=1)
    argv = ["--config", _config(tmp_path, "fsdp2", 0, model=model), "--sp-size", "2", "--seq-len", str(seq),
            "--no-progress", "--log-level", "WARNING", "--tiled-mlp", "1"]
    out = dist_pool.run(2, _run_main, argv, timeout=600)
    # The two ranks' steps are alike; in about 1 run in 6 one rank measures more by whole MLP activations (the
    # (seq / 2, I) fp32 tensors gate, up, act and their product, 4 B each element: +524,288 / +786,432 / +1,048,576 B
    # at I 2048, +3,145,728 at I 4096; session 34, 21 runs), never on both ranks at once. Not identified (flk34,
    # rec34); a release that depends on when that rank's process runs a garbage collection would fit. The other
    # rank's peak, always the recorded 7,312,476 B at I 2048, is the step's own and is judged below; the gap is
    # asserted to be whole activations, at most the MLP's four.
    low, high = sorted(out[0]["peak_mem_bytes"])
    unit = seq // 2 * inter * 4
    assert (high - low) % unit == 0 and (high - low) // unit <= 4, (low, high, unit)
    measured = low
    est = estimate_training_memory(model, seq_len=seq, sp_size=2, engine="fsdp2", tiled_mlp=1)
    print(f"\none layer, hidden {hidden}, I {inter}, {seq} tokens: estimate {est['peak']:,} vs measured {measured:,} "
          f"({est['peak'] / measured - 1:+.2%}, at {est['moment']})")
    assert est["peak"] - measured >= -512, (est["peak"], measured, est["peak"] - measured)
    assert est["peak"] / measured - 1 <= TOLERANCE, (est["peak"], measured, f"{est['peak'] / measured - 1:+.2%}")


# DeepSpeed ZeRO-3 on models whose layers ZeRO-3 gathers (MLP weights above its 1e5-element persistence threshold),
# fp32, SP 2, 64 tokens, untiled MLP: (intermediate size, layers, reduce_bucket_size) -> bytes per rank measured
# (est31, TensorMemoryTracker record_peak, both ranks equal) and the moment of the peak
ZERO3_GATHERED_MEASURED = {
    (4096, 1, 1_000_000): (20_028_729, "layer_backward"),
    (4096, 1, 5_000_000): (36_028_729, "layer_backward"),
    (2048, 4, 2_000_000): (41_181_861, "forward_gather"),
    (2048, 8, 2_000_000): (74_951_365, "forward_gather"),  # rank 0: 74,942,117
}


def test_zero3_gathered_copies_follow_persistence_and_prefetch() -> None:
    """ZeRO-3's whole parameter copies (``_zero3_gathered``), against the measured peaks of
    ``ZERO3_GATHERED_MEASURED`` (hidden 64, the MLP model's 2 heads and 256-token vocabulary):

    - one layer, I 4096: the peak is the layer's MLP backward. Alive: the five partitions (5 x 1,671,552), the bucket,
      the root and the attention weights and norms (persistent: 1e5 elements or fewer, whole from the start), the
      three MLP weights gathered (3 x 1,048,576), gate's, up's and act(gate)'s saved outputs (the product freed by
      down_proj's backward), the three intermediate gradients and down_proj's weight gradient only (each gradient is
      copied into the bucket as it is made). The end of backward's reduction has released the MLP weights.
    - four and eight layers, I 2048: the peak is the traced step's forward, at the last layer's post-attention norm:
      the prefetch at the embedding's fetch gathered every MLP weight in one coalesced all-gather (12 / 24 x 524,288),
      whose flat buffer (6,291,456 / 12,582,912 B) is alive beside the copies until the last of them is used.

    The estimate is each moment within 0 .. +0.5% (what is left is small scalars).

    Seen failing: the estimate before (a layer and its prefetch whatever the persistence, the MLP weights' gradients
    made so far and the product counted, no forward moment): one layer +27.8% / +15.5% (at the end of backward's
    reduction, counting two layers' whole copies there), eight layers **-13.2%** (65,082,496 B: two layers' copies
    and no forward moment; four layers +0.78%, at the end of backward's reduction by chance); without the product's
    release at the MLP backward (``mlp_product`` 0): +2.78% / +1.55%; without the forward's moment (``forward_fetch``
    0): four layers -6.5%."""
    for (inter, layers, bucket), (measured, moment) in ZERO3_GATHERED_MEASURED.items():
        model = dict(MLP_MODEL, hidden_size=64, intermediate_size=inter, num_hidden_layers=layers)
        est = estimate_training_memory(model, seq_len=64, sp_size=2, engine="deepspeed", zero_stage=3, tiled_mlp=1,
                                       reduce_bucket_size=bucket)
        assert est["moment"] == moment, (inter, layers, bucket, est)
        assert 0 <= est["peak"] / measured - 1 <= 0.005, (inter, layers, bucket, est["peak"], measured,
                                                          f"{est['peak'] / measured - 1:+.2%}")


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("inter,layers,bucket", list(ZERO3_GATHERED_MEASURED))
def test_zero3_gathered_copies_measured(dist_pool, tmp_path: Path, inter: int, layers: int,
                                        bucket: int) -> None:  # noqa: ANN001
    """The settings of :data:`ZERO3_GATHERED_MEASURED` run (DeepSpeed ZeRO-3 on gloo CPU, 2 ranks): the estimate is
    the measured peak's moment, within 0 .. +1% of it (est31: +0.16%, +0.09%, +0.12%, +0.10%).

    Seen failing: the estimate before (a layer and its prefetch whatever the persistence; no forward moment): +27.8%
    at one layer and 1e6 elements (the end of backward's reduction counting two layers' whole copies), -13.2% at
    eight layers."""
    model = dict(MLP_MODEL, hidden_size=64, intermediate_size=inter, num_hidden_layers=layers)
    argv = ["--config", _config(tmp_path, "deepspeed", 3, model=model, bucket=bucket), "--sp-size", "2",
            "--seq-len", "64", "--no-progress", "--log-level", "WARNING", "--tiled-mlp", "1"]
    out = dist_pool.run(2, _run_main, argv, timeout=600)
    measured = max(out[0]["peak_mem_bytes"])
    est = estimate_training_memory(model, seq_len=64, sp_size=2, engine="deepspeed", zero_stage=3, tiled_mlp=1,
                                   reduce_bucket_size=bucket)
    print(f"\nZeRO-3 I {inter}, {layers} layer(s), bucket {bucket:,}: estimate {est['peak']:,} vs measured "
          f"{measured:,} ({est['peak'] / measured - 1:+.2%}, at {est['moment']})")
    assert est["moment"] == ZERO3_GATHERED_MEASURED[inter, layers, bucket][1], est
    assert 0 <= est["peak"] / measured - 1 <= 0.01, (est["peak"], measured, f"{est['peak'] / measured - 1:+.2%}")


# DeepSpeed ZeRO-3 under a zero_optimization block's non-default stage3_param_persistence_threshold or
# stage3_prefetch_bucket_size, fp32, SP 2, 64 tokens, hidden 64, untiled MLP, reduce_bucket_size 2e6: (intermediate
# size, layers, the block's ZeRO-3 keys) -> bytes per rank measured (est31b / est31c, TensorMemoryTracker
# record_peak, both ranks equal) and the moment of the peak
ZERO3_SETTINGS_MEASURED = {
    (2048, 4, (("stage3_param_persistence_threshold", 200_000),)): (44_813_109, "grad_reduction"),
    # a small prefetch (HF Trainer's "auto" sets 0.9 hidden^2): the bucket overflows at the 5th-last layer's
    # gate_proj gradient, above the forward's peak (66,553,509 B, one of three 4,194,304-byte prefetch buffers alive)
    (2048, 8, (("stage3_prefetch_bucket_size", 1_000_000),)): (67_448_633, "backward_reduction"),
    # past the reuse distance (1e6 elements, below the layers' non-persistent 1.57M / 3.15M): the fetches before the
    # first layer's MLP is released gather every layer's, so no copy is released before its backward (est32): the
    # default reuse distance's peaks to the byte
    (2048, 4, (("stage3_max_reuse_distance", 1_000_000),)): (41_181_861, "forward_gather"),
    (2048, 8, (("stage3_prefetch_bucket_size", 1_000_000), ("stage3_max_reuse_distance", 1_000_000))):
        (67_448_633, "backward_reduction"),
}


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("inter,layers,zero", list(ZERO3_SETTINGS_MEASURED))
def test_zero3_gathered_copies_follow_the_configs_settings(dist_pool, tmp_path: Path, inter: int, layers: int,
                                                            zero: tuple) -> None:  # noqa: ANN001
    """A DeepSpeed config that sets ZeRO-3's keys (DeepSpeed ZeRO-3 on gloo CPU, 2 ranks); the estimate given the same
    ``zero_optimization`` key is the measured peak's moment, within -0.5 .. +1% of it.

    - The persistence threshold raised above the MLP weights (131,072 elements): every tensor stays whole on every
      rank, nothing is gathered, and the peak is the end of backward's reduction: est31b -0.07% (32,949 B under, not
      traced; the whole-step table's ZeRO-3 rows, whose tensors are all persistent too, have the band -0.5 .. +2%).
    - A 1e6-element prefetch bucket at 8 layers: the peak is the bucket reduced inside the 5th-last layer's MLP
      backward, with only the 4 layers still to run holding their gathered MLP weights: est31c +0.97% (the scatter
      term counted a full bucket: its unfilled room, 2 x 329,984 B); est32 -0.0003% (the bucket's contents, the
      three in-flight gradients: tests/test_est32_zero3_overflow.py).

    Seen failing: DeepSpeed's defaults hard-wired (the keywords not passed to ``_zero3_gathered``, as before est31b):
    the estimate takes the MLP weights as gathered and prefetched, 41,230,592 B at ``forward_gather``, -8.0%.
    Seen failing: the backward's reduction counting the finished layers' released copies and the layer in flight's
    freed MLP intermediates (before est31c): the prefetch case +11.07% (74,915,968 B; est31b's run).
    Seen failing: "a layer and its prefetch" past the reuse distance (before est32): -6.54% and -3.70% (-4.66% with
    est32's overflow terms)."""
    model = dict(MLP_MODEL, hidden_size=64, intermediate_size=inter, num_hidden_layers=layers)
    argv = ["--config", _config(tmp_path, "deepspeed", 3, model=model, bucket=2_000_000, zero=dict(zero)),
            "--sp-size", "2", "--seq-len", "64", "--no-progress", "--log-level", "WARNING", "--tiled-mlp", "1"]
    out = dist_pool.run(2, _run_main, argv, timeout=600)
    measured = max(out[0]["peak_mem_bytes"])
    est = estimate_training_memory(model, seq_len=64, sp_size=2, engine="deepspeed", zero_stage=3, tiled_mlp=1,
                                   reduce_bucket_size=2_000_000, **dict(zero))
    print(f"\nZeRO-3 I {inter}, {layers} layers, {dict(zero)}: estimate {est['peak']:,} vs measured {measured:,} "
          f"({est['peak'] / measured - 1:+.2%}, at {est['moment']})")
    assert est["moment"] == ZERO3_SETTINGS_MEASURED[inter, layers, zero][1], est
    assert -0.005 <= est["peak"] / measured - 1 <= 0.01, (est["peak"], measured, f"{est['peak'] / measured - 1:+.2%}")


def test_zero3_settings_are_the_estimates_keywords() -> None:
    """The ``zero_optimization`` keys move the ZeRO-3 estimate as DeepSpeed's settings move its whole copies (the
    measured figures of :data:`ZERO3_SETTINGS_MEASURED` and :data:`ZERO3_GATHERED_MEASURED`), their defaults are
    DeepSpeed's, and a bad value is refused by name.

    Seen failing: DeepSpeed's defaults hard-wired (the keywords not passed to ``_zero3_gathered``): the persistence
    setting's estimate is 41,230,592 B at ``forward_gather``, not 44,780,160 at ``grad_reduction``.
    Seen failing (the 1e6-element prefetch setting, est31c): the backward's reduction as before est31c, +11.07%
    (74,915,968 B); without the finished layers' released gathered copies (4 x 3 x 524,288 B), +10.29% (74,391,680);
    without the layer in flight's MLP intermediates freed (4 x 262,144 B), +2.52% (69,148,800). (Without the arriving
    gate_proj gradient, 524,288 B, it is +0.19%: inside the band, not seen.) Seen failing: the up_proj overflow's
    intermediates not freed and gate's gradient not counted (the rule at gate's only): +2.14% (67,948,800 B)."""
    model = dict(MLP_MODEL, hidden_size=64, intermediate_size=2048, num_hidden_layers=4)
    kw = dict(seq_len=64, sp_size=2, engine="deepspeed", zero_stage=3, tiled_mlp=1, reduce_bucket_size=2_000_000)
    for (inter, layers, zero), (measured, moment) in ZERO3_SETTINGS_MEASURED.items():
        est = estimate_training_memory(dict(model, intermediate_size=inter, num_hidden_layers=layers), **kw,
                                       **dict(zero))
        assert est["moment"] == moment, (zero, est)
        assert -0.005 <= est["peak"] / measured - 1 <= 0.01, (zero, est["peak"], measured)
    # the 8-layer 1e6-element prefetch setting with a 1.9e6-element bucket: the overflow at the 5th-last layer's
    # up_proj gradient (recorded, est31c: 66,524,345 B both ranks; up's and gate's weight gradients alive, the MLP's
    # intermediates freed). est31c +1.35% (the scatter term's unfilled room, 2 x 454,272 B); est32 the bucket's
    # contents: -0.0003% (185 B of scalars)
    up = estimate_training_memory(dict(model, num_hidden_layers=8), **dict(kw, reduce_bucket_size=1_900_000),
                                  stage3_prefetch_bucket_size=1_000_000)
    assert up["moment"] == "backward_reduction" and -0.0001 <= up["peak"] / 66_524_345 - 1 <= 0.0001, up
    default = estimate_training_memory(model, **kw)
    assert default == estimate_training_memory(model, **kw, stage3_param_persistence_threshold=100_000,
                                               stage3_prefetch_bucket_size=50_000_000,
                                               stage3_max_reuse_distance=1_000_000_000)
    assert default["moment"] == ZERO3_GATHERED_MEASURED[2048, 4, 2_000_000][1]
    # a reuse distance below the layers' non-persistent elements: at the default prefetch the first prefetch drains
    # the trace and every copy is kept (measured, est32: ZERO3_SETTINGS_MEASURED)
    assert estimate_training_memory(model, **kw, stage3_max_reuse_distance=0) == default
    for key in ("stage3_param_persistence_threshold", "stage3_prefetch_bucket_size", "stage3_max_reuse_distance"):
        with pytest.raises(ValueError, match=f"{key}=-1: expected a number of elements >= 0"):
            estimate_training_memory(model, **kw, **{key: -1})
