"""A batch cut with another sharding than the swapped model runs: ``shard_batch(batch, sharding="zigzag")`` in a
run that declares no sharding (the swapped model then runs 'contiguous'), as a user carrying a DeepSpeed JSON
block without ``"sharding"`` writes it. Refused on every rank, naming the cut and the fix (declare it)."""

from __future__ import annotations

import pytest
import torch
import transformers

import seqpar


def _model() -> transformers.LlamaForCausalLM:
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).double()


def _batch(packed: bool) -> dict[str, torch.Tensor]:
    """(1, 48) tokens; packed: three documents as transformers' DataCollatorWithFlattening makes them."""
    ids = torch.randint(0, 64, (1, 48), generator=torch.Generator().manual_seed(3))
    if not packed:
        return {"input_ids": ids, "labels": ids}
    features = [{"input_ids": ids[0, lo:hi].tolist()} for lo, hi in ((0, 13), (13, 33), (33, 48))]
    return transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)(features)


def _run(rank: int, world: int, cut: str, declared: str | None, packed: bool = False) -> str | float:
    block = {"size": world} | ({"sharding": declared} if declared else {})
    seqpar.init_process_groups(config=block)
    model = _model()
    seqpar.swap_attention(model, block)
    try:
        return float(model(**seqpar.shard_batch(_batch(packed), sharding=cut)).loss)
    except ValueError as e:
        return str(e)


@pytest.mark.parametrize("packed", [False, True], ids=["one_document", "packed"])
@pytest.mark.parametrize("cut", ["zigzag", "balanced"])
def test_a_batch_cut_the_run_did_not_declare_is_named_with_the_fix(dist_pool, cut: str, packed: bool) -> None:
    """Seen failing: the refusal said the position_ids "are not the global positions of this rank's contiguous
    shard ...: pass the global positions of the shard, or none (seqpar fills them in).
    seqpar.sequence.batch.shard_batch makes them right", while shard_batch had made them, for its cut; the
    fix it needed (declaring the sharding) was not named; packed: "are not the per-document positions of this
    rank's contiguous shard of the packed sequence ... Cut packed batches with seqpar.sequence.batch.shard_batch".
    The declared run equals one process (one document; packed runs are pinned elsewhere)."""
    for rank, message in enumerate(dist_pool.run(2, _run, cut, None, packed, timeout=120)):
        assert isinstance(message, str), message
        assert f"position_ids on SP rank {rank} of 2 are this rank's positions of a '{cut}' cut" in message, message
        assert f'declare "sharding": "{cut}" in the sequence_parallel block' in message, message
    if packed:
        return
    losses = dist_pool.run(2, _run, cut, cut, timeout=120)
    ids = torch.randint(0, 64, (1, 48), generator=torch.Generator().manual_seed(3))
    ref = float(_model()(input_ids=ids, labels=ids).loss)
    for loss in losses:
        assert abs(loss - ref) <= 1e-6 * abs(ref), (loss, ref)
