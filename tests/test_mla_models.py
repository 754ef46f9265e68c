"""MLA models of transformers 5.24 end to end under SP (issue 19 §3): DeepSeek-V3, DeepSeek-V2 and
MiniCPM3, whose attention has a Q/K head dim (nope + rope) different from V's.

Each tiny random-init model runs in float64 (MoE experts on transformers' eager loop: the grouped
matmul takes only fp32; router losses off, output_router_logits=False, as the MoE refusal requires),
swapped to seqpar at SP=2 and SP=4 in the ring, all-gather, Ulysses and hybrid modes, on a plain
batch and on a packed batch of documents (DataCollatorWithFlattening). The loss on every rank and the
gradients summed over the SP ranks must equal one process without seqpar: the whole sequence, or
each document alone, token-weighted.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import seqpar
from seqpar.config import SeqParConfig
from seqpar.sequence.batch import shard_batch
from seqpar.swap import swap_attention

transformers = pytest.importorskip("transformers")

VOCAB = 61
SEQ = 24
LENGTHS = (7, 1, 13, 3)  # 24 tokens: a 1-token document, one spanning shards
# float64 throughout, but transformers' causal-LM loss upcasts the logits with .float(), i.e. to fp32:
# summed in another order on the shards, loss and gradients agree to fp32 rounding (measured: loss
# ~1e-8 relative, gradients up to ~1e-6 of the model's gradient scale), the bar of fp32 exactness
RTOL, ATOL = 1e-5, 1e-5


def tiny_mla(name: str, dtype: torch.dtype = torch.float64) -> transformers.PreTrainedModel:
    """A 2-layer model of family ``name`` with seeded weights; Q/K head dim 10 (nope 6 + rope 4), V's 6."""
    mla = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=12,
               qk_rope_head_dim=4, qk_nope_head_dim=6, v_head_dim=6, max_position_embeddings=64,
               attn_implementation="sdpa", use_cache=False, tie_word_embeddings=False)
    moe = dict(moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
               first_k_dense_replace=1, output_router_logits=False, experts_implementation="eager")
    if name == "deepseek_v3":
        cfg = transformers.DeepseekV3Config(**mla, **moe, n_group=1, topk_group=1)
        cls = transformers.DeepseekV3ForCausalLM
    elif name == "deepseek_v2":
        cfg = transformers.DeepseekV2Config(**mla, **moe, n_group=1, topk_group=1)
        cls = transformers.DeepseekV2ForCausalLM
    else:
        cfg = transformers.MiniCPM3Config(**mla)
        cls = transformers.MiniCPM3ForCausalLM
    torch.manual_seed(0)
    return cls(cfg).to(dtype)


def _reference(name: str, docs: list[torch.Tensor]) -> tuple[float, dict[str, torch.Tensor]]:
    """float64 loss and gradients of one process without seqpar, each document alone, token-weighted."""
    ref = tiny_mla(name)
    total, count = 0.0, 0
    for d in docs:
        if len(d) < 2:
            continue
        total = total + ref(input_ids=d[None], labels=d[None]).loss * (len(d) - 1)
        count += len(d) - 1
    loss = total / count
    loss.backward()
    return float(loss.detach()), {n: p.grad for n, p in ref.named_parameters()}


def _tokens(packed: bool) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    if packed:
        return [torch.randint(0, VOCAB, (n,), generator=g) for n in LENGTHS]
    return [torch.randint(0, VOCAB, (SEQ,), generator=g)]


def _parity(rank: int, world: int, name: str, mode: str, sharding: str, packed: bool) -> float:
    """Worker: the swapped model on this rank's shard against the one-process reference."""
    docs = _tokens(packed)
    ref_loss, ref_grads = _reference(name, docs)
    group = dist.group.WORLD
    if mode == "hybrid":
        seqpar.init_process_groups(sp_size=world, ulysses_size=2)
        group = None
    model = tiny_mla(name)
    swap_attention(model, SeqParConfig(size=world, mode=mode, sharding=sharding,
                                       ulysses_size=2 if mode == "hybrid" else 1), group=group)
    if packed:
        batch = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)(
            [{"input_ids": d.tolist()} for d in docs])
    else:
        batch = {"input_ids": docs[0][None], "labels": docs[0][None].clone()}
    local = shard_batch(batch, group=dist.group.WORLD, sharding=sharding)
    out = model(**local)
    out.loss.backward()
    assert abs(float(out.loss.detach()) - ref_loss) <= RTOL * abs(ref_loss), (float(out.loss.detach()), ref_loss)
    worst = 0.0
    scale = max(float(g.abs().max()) for g in ref_grads.values())  # the model's gradient scale
    for pname, p in model.named_parameters():
        grad = p.grad.detach().clone()
        dist.all_reduce(grad)  # each rank holds its share of the full-sequence gradient
        want = ref_grads[pname]
        torch.testing.assert_close(grad, want, rtol=RTOL, atol=ATOL * scale,
                                   msg=lambda m, n=pname: f"{name} {mode} {sharding} packed={packed}: grad of {n}: {m}")
        worst = max(worst, float((grad - want).abs().max()) / scale)
    return worst


CASES = [  # (world, mode, sharding, packed)
    (2, "ring", "zigzag", False), (2, "ring", "contiguous", True), (2, "allgather", "zigzag", True),
    (2, "ulysses", "zigzag", True), (4, "ring", "zigzag", True), (4, "allgather", "contiguous", False),
    (4, "ulysses", "contiguous", True), (4, "hybrid", "zigzag", True),
]


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v2", "minicpm3"])
def test_mla_model_exact_under_sp(dist_pool, name: str) -> None:
    for world, mode, sharding, packed in CASES:
        if name != "deepseek_v3" and (world, mode) not in ((2, "ring"), (4, "ulysses")):
            continue  # the other families: one SP=2 and one SP=4 run each
        worst = dist_pool.run(world, _parity, name, mode, sharding, packed, timeout=300)
        assert max(worst) < 1e-5, (name, world, mode, worst)
