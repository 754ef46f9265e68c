"""A packed batch (three documents in the row, cut by ``shard_batch``) whose ``position_ids`` hold two rows: row 0
this rank's per-document positions, row 1 wrong. The refusal judges the wrong row (``hf_inputs._wrong_row`` on the
packed branch, mut33b), on every rank, through the swapped model's forward (the path a user takes).

Several rows of a packed batch reach the row check only as positions broadcast over a one-row ``input_ids``: a
packed batch of two rows is refused before it, "packed documents (cu_seq_lens_q) need batch size 1" (asserted
here too, on every rank), since the boundaries are per sequence, as for flash varlen.

Seen failing: ``_wrong_row`` returning row 0 always -> the zigzag row was not named as a ``'zigzag'`` cut (the
generic refusal, "got" showing the right row 0) and the +100 row's values were not the message's "got"."""

from __future__ import annotations

import torch
from hf_tiny import swapped_one_layer_llama

DOCS = (10, 20, 18)  # 48 tokens: each rank's half holds pieces of two documents at P = 2


def _run(rank: int, world: int) -> dict[str, str]:
    from seqpar.sequence.batch import shard_batch

    model = swapped_one_layer_llama(world)
    bounds = torch.tensor([0, 10, 30, 48], dtype=torch.int32)
    full = {"input_ids": torch.randint(0, 64, (1, sum(DOCS)), generator=torch.Generator().manual_seed(3)),
            "position_ids": torch.cat([torch.arange(n) for n in DOCS])[None],
            "cu_seq_lens_q": bounds, "cu_seq_lens_k": bounds}
    cut = shard_batch(full)  # the run's own (contiguous) cut
    zigzag = shard_batch(full, sharding="zigzag")["position_ids"]
    right = cut["position_ids"]
    assert not torch.equal(right, zigzag)
    packed = {k: v for k, v in cut.items() if k not in ("input_ids", "position_ids")}
    out = {}
    cases = {"zigzag row 1": (cut["input_ids"], torch.cat([right, zigzag])),
             "+100 row 1": (cut["input_ids"], torch.cat([right, right + 100])),
             "two packed rows": (cut["input_ids"].expand(2, -1), torch.cat([right, right]))}
    for name, (ids, positions) in cases.items():
        try:
            model(input_ids=ids, position_ids=positions, **packed)
            out[name] = "no refusal"
        except ValueError as e:
            out[name] = str(e)
    out["right"] = str(right[0].tolist())
    return out


def test_a_packed_batchs_wrong_second_row_is_the_one_judged_on_every_rank(dist_pool) -> None:
    for rank, out in enumerate(dist_pool.run(2, _run, timeout=120)):
        head = f"seqpar (LlamaForCausalLM): position_ids on SP rank {rank} of 2 are"
        # row 1 is this rank's positions of a zigzag cut: the refusal says so (row 0 matches only the own cut)
        msg = out["zigzag row 1"]
        assert msg.startswith(f"{head} this rank's positions of a 'zigzag' cut"), (rank, msg)
        assert "declare \"sharding\": \"zigzag\"" in msg, (rank, msg)
        # row 1 is no cut's: the generic packed refusal, showing row 1 as "got"
        msg = out["+100 row 1"]
        first = int(out["right"].strip("[]").split(",")[0])
        assert msg.startswith(f"{head} not the per-document positions of this rank's contiguous shard"), (rank, msg)
        assert "boundaries [0, 10, 30, 48]" in msg, (rank, msg)
        assert f"got [{first + 100}, {first + 101}, " in msg, (rank, msg)
        assert "shard_batch" in msg, (rank, msg)
        msg = out["two packed rows"]
        assert "packed documents (cu_seq_lens_q) need batch size 1, got 2" in msg, (rank, msg)
