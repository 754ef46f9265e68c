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
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (1, seq_len), generator=g)
    ref = build(kind, torch.float64)
    ref_out = ref(input_ids=ids, labels=ids, use_cache=False)
    ref_out.loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}

    model = build(kind, torch.float32)
    report = swap_attention(model, SeqParConfig(size=world, mode="ring", sharding=sharding), group=dist.group.WORLD)
    assert len(report) == 2, str(report)
    local = shard_batch({"input_ids": ids, "labels": ids}, group=dist.group.WORLD, sharding=sharding)
    out = model(**local)
    out.loss.backward()
    assert abs(float(out.loss) - float(ref_out.loss)) <= 1e-4 * float(ref_out.loss), (float(out.loss), float(ref_out.loss))
    for name, p in model.named_parameters():
        if p.grad is None:
            assert name not in ref_grads, f"{name} got no gradient"
            continue
        grad = p.grad.detach().clone().double()
        if world > 1:
            dist.all_reduce(grad)
        torch.testing.assert_close(grad, ref_grads[name], rtol=RTOL, atol=ATOL,
                                   msg=lambda m, name=name: f"{kind} grad of {name}: {m}")


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
