"""ALiBi models (BLOOM, MPT, Falcon with alibi=True) through the Hugging Face swap, exactly (issue 19,
section 4).

Their attention modules compute their own scores with a per-key bias built from *local* positions,
so they never reached ``ALL_ATTENTION_FUNCTIONS`` ("found nothing to swap"); the swap now replaces
their forward (seqpar.swap.hf_alibi) with seqpar attention given ``alibi_slopes`` at global positions.
Each case: a tiny random model on every rank, an unswapped float64 copy run on the full sequence in
one process as the reference, the swapped fp32 model on this rank's shard; loss and every gradient
summed over the SP ranks within 1e-4. The slopes are the models' own (5 heads: BLOOM's and Falcon's
non-power-of-2 rule, MPT's alibi_bias_max), steep enough that ALiBi shapes the scores over 48 tokens.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hf_tiny import assert_grads_equal, documents_alone_loss, full_sequence_parity

from seqpar.config import SeqParConfig
from seqpar.sequence.batch import shard_batch
from seqpar.swap import swap_attention

transformers = pytest.importorskip("transformers")

VOCAB = 61
RTOL, ATOL = 1e-4, 1e-5


def build(kind: str, dtype: torch.dtype):
    torch.manual_seed(0)
    if kind == "bloom":
        cfg = transformers.BloomConfig(vocab_size=VOCAB, hidden_size=40, n_layer=2, n_head=5,
                                       attention_dropout=0.0, hidden_dropout=0.0)
        model = transformers.BloomForCausalLM(cfg)
    elif kind == "mpt":
        cfg = transformers.MptConfig(vocab_size=VOCAB, d_model=40, n_layers=2, n_heads=5, max_seq_len=64,
                                     expansion_ratio=2)
        model = transformers.MptForCausalLM(cfg)
    elif kind == "falcon":  # alibi with multi-query K/V (one K/V head)
        cfg = transformers.FalconConfig(vocab_size=VOCAB, hidden_size=40, num_hidden_layers=2, num_attention_heads=5,
                                        alibi=True, multi_query=True, new_decoder_architecture=False,
                                        attention_dropout=0.0, hidden_dropout=0.0, attn_implementation="sdpa")
        model = transformers.FalconForCausalLM(cfg)
    else:
        raise ValueError(kind)
    return model.to(dtype)


def _parity(rank: int, world: int, kind: str, sharding: str, seq_len: int) -> None:
    report = full_sequence_parity(build, kind, world, sharding, seq_len, VOCAB, rtol=RTOL, atol=ATOL)
    assert len(report) == 2, str(report)


CASES = [(kind, world, sharding) for kind in ("bloom", "mpt", "falcon")
         for world, sharding in ((2, "zigzag"), (4, "contiguous"))]


@pytest.mark.parametrize("kind,world,sharding", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_alibi_models_equal_one_process(dist_pool, kind, world, sharding):
    dist_pool.run(world, _parity, kind, sharding, 48, timeout=300)


def test_alibi_dropout_refused_with_the_layer():
    from seqpar.swap import SwapError

    torch.manual_seed(0)
    cfg = transformers.BloomConfig(vocab_size=VOCAB, hidden_size=40, n_layer=1, n_head=5, attention_dropout=0.1)
    with pytest.raises(SwapError, match=r"layer 'transformer.h.0.self_attention': attention dropout 0.1"):
        swap_attention(transformers.BloomForCausalLM(cfg).train())


def test_falcon_alibi_on_the_eager_path_refused_with_the_fix():
    """transformers' eager Falcon-ALiBi adds the bias twice (its sdpa path once): refused, not matched."""
    from seqpar.swap import SwapError

    torch.manual_seed(0)
    cfg = transformers.FalconConfig(vocab_size=VOCAB, hidden_size=40, num_hidden_layers=1, num_attention_heads=5,
                                    alibi=True, attn_implementation="eager")
    with pytest.raises(SwapError, match=r"adds the ALiBi bias twice.*attn_implementation='sdpa'"):
        swap_attention(transformers.FalconForCausalLM(cfg))


# ------------------------------------------------------------------------- bf16 (issue 28 §1)
def _build_16_heads(kind: str) -> torch.nn.Module:
    """16 heads: BLOOM's slopes are then 2**(-h/2), not powers of two, so bf16(m_h j) differs from
    bf16(m_h) j and from m_h j (with 5 heads every slope is a power of two and all three agree)."""
    torch.manual_seed(0)
    if kind == "bloom":
        cfg = transformers.BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=16,
                                       attention_dropout=0.0, hidden_dropout=0.0)
        return transformers.BloomForCausalLM(cfg)
    cfg = transformers.MptConfig(vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=16, max_seq_len=256,
                                 expansion_ratio=2)
    return transformers.MptForCausalLM(cfg)


def _loss_and_grads(model: torch.nn.Module, batch: dict, world: int) -> tuple[torch.Tensor, dict]:
    out = model(**batch, use_cache=False)
    out.loss.backward()
    loss = out.loss.detach().double()
    grads = {n: p.grad.detach().double() for n, p in model.named_parameters() if p.grad is not None}
    if world > 1:  # an SP rank's loss is the sequence's; its gradients are its share
        for g in grads.values():
            dist.all_reduce(g)
    return loss, grads


def _error(loss: torch.Tensor, grads: dict, ref_loss: torch.Tensor, ref_grads: dict) -> float:
    """The worst of the loss's relative error and each parameter's gradient error relative to that
    parameter's largest reference gradient (floored at 1e-3 of the model's: gradients ~0 in exact
    arithmetic, like those of a zeroed q / k projection, are judged on the model's scale)."""
    top = max(float(g.abs().max()) for g in ref_grads.values())
    worst = float((loss - ref_loss).abs() / ref_loss.abs())
    assert set(grads) == set(ref_grads), set(grads) ^ set(ref_grads)
    for name, g in grads.items():
        scale = max(float(ref_grads[name].abs().max()), 1e-3 * top)
        worst = max(worst, float((g - ref_grads[name]).abs().max()) / scale)
    return worst


def _low_precision_errors(rank: int, world: int, kind: str, dtype: torch.dtype, zero_qk: bool,
                          seq_len: int) -> tuple[float, float]:
    """(one process's error, SP's error) of a ``dtype`` model against the same weights in float64.

    The float64 reference computes the low-precision model's function: BLOOM's bias rounded to
    ``dtype`` as its ``build_alibi_tensor`` rounds it (part of the model, not arithmetic noise; MPT's
    bias is fp32 in every dtype). ``zero_qk``: q and k projections zeroed, so the scores are the bias
    alone and the bias decides every attention weight."""
    import copy

    base = _build_16_heads(kind)
    if zero_qk:
        with torch.no_grad():
            for layer in base.transformer.h:
                qkv = layer.self_attention.query_key_value
                heads, d = layer.self_attention.num_heads, layer.self_attention.head_dim
                w = qkv.weight.view(heads, 3, d, -1)  # BLOOM's fused layout: per head (q, k, v)
                w[:, :2].zero_()
                qkv.bias.view(heads, 3, d)[:, :2].zero_()
    low = base.to(dtype)
    ref = copy.deepcopy(low).double()
    ids = torch.randint(0, VOCAB, (1, seq_len), generator=torch.Generator().manual_seed(11))
    batch = {"input_ids": ids, "labels": ids}
    ref_batch = batch
    if kind == "bloom":  # on the instance (nothing left behind in this pooled rank); BloomModel calls
        # build_alibi_tensor when given a mask (all ones: the same attention)
        own, calls, low_dtype = ref.transformer.build_alibi_tensor, [], dtype

        def rounded(mask, heads, dtype):  # noqa: ANN001, ANN202 - the model's bias, rounded as `low` rounds it
            calls.append(dtype)
            return own(mask, heads, low_dtype).to(dtype)

        ref.transformer.build_alibi_tensor = rounded
        ref_batch = {**batch, "attention_mask": torch.ones_like(ids)}
    ref_loss, ref_grads = _loss_and_grads(ref, ref_batch, 1)
    assert kind != "bloom" or calls == [torch.float64], calls
    one_loss, one_grads = _loss_and_grads(copy.deepcopy(low), batch, 1)
    sp = copy.deepcopy(low)
    report = swap_attention(sp, SeqParConfig(size=world, mode="ring", sharding="zigzag"), group=dist.group.WORLD)
    assert len(report) == 2, str(report)
    local = shard_batch(batch, group=dist.group.WORLD, sharding="zigzag")
    sp_loss, sp_grads = _loss_and_grads(sp, local, world)
    return _error(one_loss, one_grads, ref_loss, ref_grads), _error(sp_loss, sp_grads, ref_loss, ref_grads)


LOW_CASES = [("bloom", torch.bfloat16, True), ("bloom", torch.bfloat16, False), ("bloom", torch.float16, True),
             ("mpt", torch.bfloat16, False)]


@pytest.mark.parametrize("kind,dtype,zero_qk", LOW_CASES,
                         ids=[f"{k}-{str(d)[6:]}{'-bias-only' if z else ''}" for k, d, z in LOW_CASES])
def test_alibi_models_low_precision_sp2(dist_pool, kind, dtype, zero_qk):
    """BLOOM and MPT in bf16 (BLOOM also fp16) at SP = 2: error against float64 at most twice one
    process's own, plus a small floor. Main applied the exact product ``bf16(m_h) * j`` where BLOOM
    applies ``bf16(m_h * j)``."""
    errors = dist_pool.run(2, _low_precision_errors, kind, dtype, zero_qk, 256, timeout=300)
    one, sp = errors[0]
    print(f"{kind} {dtype} zero_qk={zero_qk}: one process {one:.3g}, SP=2 {sp:.3g}")
    assert sp <= 2 * one + 1e-3, (one, sp)


def _packed_parity(rank: int, world: int, kind: str, sharding: str, lengths: list[int]) -> None:
    """A packed row (``DataCollatorWithFlattening``) against each document run alone in one process,
    token-weighted (per-document semantics), loss and every gradient."""
    g = torch.Generator().manual_seed(7)
    docs = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]
    ref = build(kind, torch.float64)
    ref_loss = documents_alone_loss(ref, docs)
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}

    batch = dict(transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)(
        [{"input_ids": d} for d in docs]))
    model = build(kind, torch.float64)
    swap_attention(model, SeqParConfig(size=world, mode="ring", sharding=sharding), group=dist.group.WORLD)
    out = model(**shard_batch(batch, group=dist.group.WORLD, sharding=sharding))
    out.loss.backward()
    # float64 models, but transformers' loss upcasts the logits to fp32 only: both sides round there
    got, want = float(out.loss.detach()), float(ref_loss.detach())
    assert abs(got - want) <= 1e-6 * want, (kind, got, want)
    assert_grads_equal(model, ref_grads, world, f"{kind} packed", rtol=RTOL, atol=ATOL)


PACKED_CASES = [(kind, world, sharding) for kind in ("bloom", "mpt", "falcon")
                for world, sharding in ((1, "contiguous"), (2, "zigzag"))]


@pytest.mark.parametrize("kind,world,sharding", PACKED_CASES, ids=["-".join(map(str, c)) for c in PACKED_CASES])
def test_alibi_models_packed_documents(dist_pool, kind, world, sharding):
    """Packed documents attend each to itself (the fuzzer's case 1286627009: tiny BLOOM, packed [4, 12],
    P = 1, loss 7.2e-3 off). None of the three models passes ``cu_seq_lens_q`` from the model to its blocks,
    so the swapped attention attended across the documents, as one process does on the packed row."""
    dist_pool.run(world, _packed_parity, kind, sharding, [4, 1, 13, 6], timeout=300)
