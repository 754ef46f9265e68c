"""Packed documents through the Hugging Face swap (issue 10).

A packed batch as ``transformers.DataCollatorWithFlattening`` makes it (input_ids (1, N), labels -100
at each document start, position_ids restarting at 0, optionally cu_seq_lens_q/k) is cut with
seqpar.sequence.batch.shard_batch and fed to the swapped model on each rank. The loss and the gradients
(summed over the SP ranks) must equal a float64 single-process run of each document ALONE, with the
token-weighted mean over every predicted token, to 1e-4. Lengths include a 1-token document, one
shorter than a shard chunk, one spanning every shard, and a total that needs end padding.
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
LENGTHS = (7, 1, 23, 3, 11)  # 45 tokens: padded at the end for SP=2 (and 4 for zigzag)
RTOL, ATOL = 1e-4, 1e-5


def tiny_llama(dtype: torch.dtype) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(cfg).to(dtype)


def documents(seed: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in LENGTHS]


def packed_batch(docs: list[torch.Tensor], flash_kwargs: bool) -> dict:
    collate = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)
    return collate([{"input_ids": d.tolist()} for d in docs])


def per_document_reference(make_model, docs: list[torch.Tensor]) -> tuple[float, dict[str, torch.Tensor]]:
    """float64 loss and gradients of the documents run one at a time, token-weighted."""
    ref = make_model(torch.float64)
    total, count = 0.0, 0
    for d in docs:
        if len(d) < 2:
            continue  # nothing to predict
        out = ref(input_ids=d[None], labels=d[None])
        total = total + out.loss * (len(d) - 1)
        count += len(d) - 1
    loss = total / count
    loss.backward()
    return float(loss.detach()), {n: p.grad for n, p in ref.named_parameters()}


def check_against_reference(model, loss: torch.Tensor, ref_loss: float, ref_grads: dict, world: int) -> None:
    assert abs(float(loss) - ref_loss) <= 1e-4 * abs(ref_loss), (float(loss), ref_loss)
    for name, p in model.named_parameters():
        grad = p.grad.detach().clone().double()
        if world > 1:
            dist.all_reduce(grad)  # each rank holds its share of the full-sequence gradient
        torch.testing.assert_close(grad, ref_grads[name], rtol=RTOL, atol=ATOL,
                                   msg=lambda m, name=name: f"grad of {name}: {m}")


def _packed_parity(rank: int, world: int, sharding: str, flash_kwargs: bool) -> None:
    docs = documents()
    ref_loss, ref_grads = per_document_reference(tiny_llama, docs)
    model = tiny_llama(torch.float32)
    swap_attention(model, SeqParConfig(size=world, mode="ring", sharding=sharding), group=torch.distributed.group.WORLD)
    local = shard_batch(packed_batch(docs, flash_kwargs), group=torch.distributed.group.WORLD, sharding=sharding)
    assert local["cu_seq_lens_q"].tolist()[:-1] == [0, 7, 8, 31, 34, 45][: len(local["cu_seq_lens_q"]) - 1]
    out = model(**local)
    out.loss.backward()
    check_against_reference(model, out.loss, ref_loss, ref_grads, world)


@pytest.mark.parametrize("flash_kwargs", [False, True], ids=["position_ids", "cu_seq_lens"])
def test_packed_one_rank_equals_each_document_alone(flash_kwargs):
    # No shard_batch: the swapped model itself reads the boundaries (position_ids restarts or the
    # cu_seq_lens keys). transformers' own sdpa path would mix the documents with use_cache=True.
    docs = documents()
    ref_loss, ref_grads = per_document_reference(tiny_llama, docs)
    model = tiny_llama(torch.float32)
    swap_attention(model)
    out = model(**packed_batch(docs, flash_kwargs))
    out.loss.backward()
    check_against_reference(model, out.loss, ref_loss, ref_grads, 1)


@pytest.mark.parametrize("sharding,flash_kwargs", [("contiguous", False), ("zigzag", True)])
def test_packed_two_ranks_equal_each_document_alone(dist_pool, sharding, flash_kwargs):
    dist_pool.run(2, _packed_parity, sharding, flash_kwargs)


def test_shard_batch_boundaries_and_padding_segment():
    docs = documents()
    for flash_kwargs in (False, True):
        out = shard_batch(packed_batch(docs, flash_kwargs))  # one rank: no padding
        assert out["cu_seq_lens_q"].tolist() == [0, 7, 8, 31, 34, 45]
        assert out["max_length_q"] == 23
    # cu_seq_lens win over position_ids: the positions here say one document.
    batch = {"input_ids": torch.arange(6)[None], "position_ids": torch.arange(6)[None],
             "cu_seq_lens_q": torch.tensor([0, 2, 6], dtype=torch.int32),
             "cu_seq_lens_k": torch.tensor([0, 2, 6], dtype=torch.int32)}
    assert shard_batch(batch)["cu_seq_lens_q"].tolist() == [0, 2, 6]


def _padding_segment(rank: int, world: int) -> tuple[list[int], list[int]]:
    batch = {"input_ids": torch.arange(5)[None], "position_ids": torch.tensor([[0, 1, 2, 0, 1]])}
    out = shard_batch(batch, group=torch.distributed.group.WORLD, sharding="zigzag")  # 5 tokens -> padded to 8 for zigzag over 2
    return out["cu_seq_lens_q"].tolist(), out["position_ids"][0].tolist()


def test_end_padding_is_one_more_document(dist_pool):
    (cu0, pos0), (cu1, pos1) = dist_pool.run(2, _padding_segment)
    assert cu0 == cu1 == [0, 3, 5, 8]
    # zigzag over 2: rank 0 holds chunks 0 and 3 (global 0,1 and 6,7), rank 1 chunks 1, 2.
    assert pos0 == [0, 1, 1, 2] and pos1 == [2, 0, 1, 0]


def test_packed_bad_input_is_refused():
    model = tiny_llama(torch.float32)
    swap_attention(model)
    ids = torch.randint(0, VOCAB, (2, 8))
    with pytest.raises(ValueError, match="packed sequences.*batch size 1"):
        model(input_ids=ids, position_ids=torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]] * 2))
    bad = torch.tensor([0, 5, 3, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="start at 0, never decrease .* and end at the sequence length 8"):
        model(input_ids=ids[:1], cu_seq_lens_q=bad, cu_seq_lens_k=bad)
    with pytest.raises(ValueError, match="start at 0, never decrease"):
        shard_batch({"input_ids": ids[:1], "cu_seq_lens_q": torch.tensor([0, 4, 9])})
