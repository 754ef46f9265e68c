"""Attention under ``torch.autocast`` (the HF Trainer's / accelerate's bf16 mixed precision): a Llama or Qwen3 hands
its attention float32 q and k (the rotary embedding follows the float32 hidden states; Qwen3's q/k norms return
float32) beside a bfloat16 v, which torch's SDPA casts to bfloat16 itself. seqpar refused every such call with "q, k, v
dtypes differ (float32, float32, bfloat16); cast them to one dtype", at every world size, so no swapped model could run
under autocast, and its user cannot cast inside the model. Now the entries cast as SDPA does (seqpar.attn.amp) and run
with autocast off: one process is SDPA's result bit for bit, P = 2 equals the exact attention of the bf16-rounded inputs
to bf16's rounding, gradients reach the float32 leaves, and a swapped Llama's logits match one process's under
autocast."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import seqpar

BF16 = torch.bfloat16


def _inputs(seq: int = 16) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 4, seq, 8, generator=g) for _ in range(3))
    return q, k, v.to(BF16)  # a Llama's mix under autocast


def _exact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of the bf16-rounded inputs in float64."""
    q, k, v = (t.to(BF16).double() for t in (q, k, v))
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    n = q.shape[2]
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -torch.inf)
    return torch.softmax(s, -1) @ v


def test_one_process_is_sdpa_under_autocast() -> None:
    """Seen failing with seqpar.attn.amp.autocast_inputs returning its inputs: TypeError "q, k, v dtypes differ"."""
    q, k, v = _inputs()
    with torch.autocast("cpu", dtype=BF16):
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        got = seqpar.attention(q, k, v, causal=True)
        windowed = seqpar.attention(q, k, v, causal=True, window=16)  # seqpar's own kernels, not SDPA
        dilated = seqpar.dilated_attention(q, k, v, causal=True, segment_lengths=[16], dilation_rates=[1])
    assert got.dtype == windowed.dtype == dilated.dtype == BF16 == want.dtype
    assert torch.equal(got, want)
    for out in (windowed, dilated):  # a window as long as the sequence and one dense segment: plain causal attention
        assert (out.double() - _exact(q, k, v)).abs().max() <= 2 ** -7


def _two_ranks(rank: int, world: int, mode: str) -> dict:
    seqpar.init_process_groups(sp_size=world)
    q, k, v = _inputs()
    leaves = [seqpar.shard_sequence(t, 2).detach().requires_grad_(True) for t in (q, k, v)]
    gout = torch.randn(1, 4, 16, 8, generator=torch.Generator().manual_seed(7))
    with torch.autocast("cpu", dtype=BF16):
        if mode == "dilated":
            out = seqpar.dilated_attention(*leaves, causal=True, segment_lengths=[16], dilation_rates=[1])
        else:
            out = seqpar.attention(*leaves, causal=True, mode=mode)
    out.backward(seqpar.shard_sequence(gout, 2).to(out.dtype))
    ref = [t.to(BF16).double().requires_grad_(True) for t in (q, k, v)]
    want = _exact(*ref)
    want.backward(gout.to(BF16).double())
    full = seqpar.gather_sequence(out.detach(), 2).double()
    grads = [seqpar.gather_sequence(t.grad, 2).double() for t in leaves]
    return {"dtype": out.dtype, "grad dtypes": [t.grad.dtype for t in leaves],
            "out": float((full - want.detach()).abs().max()),
            "grads": [float((g - r.grad).abs().max() / r.grad.abs().max()) for g, r in zip(grads, ref, strict=True)]}


@pytest.mark.parametrize("mode", ["ring", "ulysses", "allgather", "dilated"])
def test_two_ranks_under_autocast_equal_the_rounded_inputs_attention(dist_pool, mode: str) -> None:
    """Seen failing with autocast_inputs returning its inputs: the TypeError on both ranks, every mode."""
    for got in dist_pool.run(2, _two_ranks, mode, timeout=120):
        assert got["dtype"] == BF16 and got["grad dtypes"] == [torch.float32, torch.float32, BF16], got
        assert got["out"] <= 2 ** -7, got  # outputs of size ~1: bf16's rounding of the output, and of the merges
        assert max(got["grads"]) <= 2e-2, got  # relative to each gradient's largest entry: bf16's backward


def _swapped_vs_one(one: torch.nn.Module, config: object, vocab: int) -> tuple[float, float, bool]:
    """``one``'s logits under autocast against a swapped deep copy's (gathered), and whether its gradients are finite."""
    model = copy.deepcopy(one)
    ids = torch.randint(0, vocab, (1, 16), generator=torch.Generator().manual_seed(3))
    with torch.autocast("cpu", dtype=BF16):
        want = one(input_ids=ids).logits.float()
    seqpar.swap_attention(model, config)
    with torch.autocast("cpu", dtype=BF16):
        out = model(**seqpar.shard_batch({"input_ids": ids})).logits.float()
    out.sum().backward()
    finite = all(bool(p.grad.isfinite().all()) for p in model.parameters() if p.grad is not None)
    full = seqpar.gather_sequence(out.detach(), 1)
    return float((full - want).abs().max()), float(want.abs().max()), finite


def _llama_logits(rank: int, world: int) -> tuple[float, float, bool]:
    import transformers

    block = {"size": world}
    seqpar.init_process_groups(config=block)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    torch.manual_seed(0)
    one = transformers.LlamaForCausalLM(cfg)
    return _swapped_vs_one(one, block, 64)


@pytest.mark.parametrize("world", [1, 2])
def test_a_swapped_llama_runs_under_autocast(dist_pool, world: int) -> None:
    """Seen failing with autocast_inputs returning its inputs: the TypeError from the swapped layer on every rank."""
    for err, scale, finite in dist_pool.run(world, _llama_logits, timeout=180):
        assert finite and err <= (0.0 if world == 1 else 2 ** -7 * scale), (err, scale)


def _deepseek_logits(rank: int, world: int, mode: str, transfer: str) -> tuple[float, float, bool]:
    import transformers

    seqpar.init_process_groups(sp_size=world)
    cfg = transformers.DeepseekV3Config(
        vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=12, qk_rope_head_dim=4, qk_nope_head_dim=6, v_head_dim=6,
        max_position_embeddings=64, attn_implementation="sdpa", use_cache=False, tie_word_embeddings=False,
        moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, output_router_logits=False, experts_implementation="eager", n_group=1, topk_group=1)
    torch.manual_seed(0)
    one = transformers.DeepseekV3ForCausalLM(cfg)
    return _swapped_vs_one(one, seqpar.SeqParConfig(size=world, mode=mode, mla_transfer=transfer), 61)


@pytest.mark.parametrize("mode, transfer", [("ring", "latent"), ("allgather", "latent"), ("ring", "expanded")])
def test_an_mla_model_runs_under_autocast(dist_pool, mode: str, transfer: str) -> None:
    """DeepSeek-V3 (MLA) swapped at P = 2 under autocast. Seen failing with the dense path fixed and the latent one
    not (SwapOptions._latent_attention without the casts): the latent ring and all-gather failed inside torch's
    CPU flash kernel ("expected scalar type Float but found BFloat16"); measured 0.00195 of 0.32 in all three."""
    for err, scale, finite in dist_pool.run(2, _deepseek_logits, mode, transfer, timeout=180):
        assert finite and err <= 2 ** -6 * scale, (err, scale)
