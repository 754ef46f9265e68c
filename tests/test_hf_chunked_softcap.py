"""Llama 4 (chunked local attention, NoPE layers with attention temperature tuning) and Gemma 2 (logit
soft-capping) through the Hugging Face swap, exactly (issue 19, section 4).

Each case builds a tiny random model on every rank, keeps an unswapped float64 copy (transformers'
eager path on the full sequence, one process) as the reference, swaps the other and feeds it this
rank's shard (seqpar.sequence.batch.shard_batch). Loss and every gradient summed over the SP ranks
must equal the reference's (fp32 vs float64, 1e-4).

Llama 4: one chunked layer (RoPE) and one NoPE full layer with temperature tuning; the chunk (5) and
``floor_scale`` (4) are shorter than a shard, so chunks cross shard edges and the temperature of a
row differs between its local and global position. Packed documents (DataCollatorWithFlattening)
are compared with one process on the same packed row, whose mask transformers builds per document
(chunks counted from each document's start) and whose temperature follows the row's position.
Gemma 2: soft-capping at 1.0 with query/key weights scaled up so the scores reach the cap.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hf_tiny import assert_grads_equal

from seqpar.config import SeqParConfig
from seqpar.sequence.batch import shard_batch
from seqpar.swap import swap_attention

transformers = pytest.importorskip("transformers")

VOCAB = 61
RTOL, ATOL = 1e-4, 1e-5
LENGTHS = (7, 1, 17, 3, 13)  # 41 tokens: end padding for every SP size here


def build(kind: str, dtype: torch.dtype):
    torch.manual_seed(0)
    if kind == "llama4":
        cfg = transformers.Llama4TextConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, intermediate_size_mlp=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=2, num_experts_per_tok=1,
            attention_chunk_size=5, floor_scale=4, attn_scale=0.5, no_rope_layers=[1, 0],
            attn_implementation="eager", experts_implementation="eager",  # grouped_mm has no float64
        )
        assert cfg.layer_types == ["chunked_attention", "full_attention"]
        model = transformers.Llama4ForCausalLM(cfg)
    elif kind == "gemma2":
        cfg = transformers.Gemma2Config(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, sliding_window=6, attn_logit_softcapping=1.0,
            final_logit_softcapping=None, attn_implementation="eager",
        )
        model = transformers.Gemma2ForCausalLM(cfg)
        with torch.no_grad():  # scores of order 1-10, so that the cap bites
            for name, p in model.named_parameters():
                if name.endswith(("q_proj.weight", "k_proj.weight")):
                    p.mul_(12.0)
    else:
        raise ValueError(kind)
    return model.to(dtype)


def _batch(packed: bool, seq_len: int) -> dict:
    g = torch.Generator().manual_seed(5)
    if not packed:
        ids = torch.randint(0, VOCAB, (1, seq_len), generator=g)
        return {"input_ids": ids, "labels": ids}
    docs = [torch.randint(0, VOCAB, (n,), generator=g) for n in LENGTHS]
    collate = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    return collate([{"input_ids": d.tolist()} for d in docs])


def _parity(rank: int, world: int, kind: str, sharding: str, packed: bool, seq_len: int, mode: str = "ring") -> None:
    batch = _batch(packed, seq_len)
    ref = build(kind, torch.float64)
    ref_inputs = {k: batch[k] for k in ("input_ids", "labels", "position_ids") if k in batch}
    ref_out = ref(**ref_inputs, use_cache=False)
    ref_out.loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}

    model = build(kind, torch.float32)
    swap_attention(model, SeqParConfig(size=world, mode=mode, sharding=sharding), group=dist.group.WORLD)
    local = shard_batch(batch, group=dist.group.WORLD, sharding=sharding)
    out = model(**local)
    out.loss.backward()
    assert abs(float(out.loss) - float(ref_out.loss)) <= 1e-4 * float(ref_out.loss), (float(out.loss), float(ref_out.loss))
    assert_grads_equal(model, ref_grads, world, kind, rtol=RTOL, atol=ATOL)


CASES = [
    ("llama4", 2, "zigzag", False, 48),
    ("llama4", 4, "contiguous", False, 48),
    ("llama4", 2, "contiguous", True, 0),
    ("llama4", 4, "zigzag", True, 0),
    # balanced: the chunks a rank holds follow the documents, so the rows' global positions (the temperature's)
    # need the boundaries. Seen failing: hf_attention's temperature scaling calling global_positions without
    # cu_seqlens (embed_tokens' gradient off; the contiguous and zigzag cases, whose layout ignores the
    # documents, passed with it).
    ("llama4", 3, "balanced", True, 0),
    ("gemma2", 2, "zigzag", False, 48),
    ("gemma2", 4, "contiguous", False, 48),
    ("gemma2", 1, "contiguous", False, 48),
]


@pytest.mark.parametrize("kind,world,sharding,packed,seq_len", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_chunked_and_softcapped_models_equal_one_process(dist_pool, kind, world, sharding, packed, seq_len):
    dist_pool.run(world, _parity, kind, sharding, packed, seq_len, timeout=300)


@pytest.mark.parametrize("mode", ["ulysses", "allgather"])
def test_llama4_packed_in_other_modes(dist_pool, mode):
    """The same Llama 4, packed, at SP=2 through Ulysses and the all-gather (the ring above)."""
    dist_pool.run(2, _parity, "llama4", "zigzag", True, 0, mode, timeout=300)
