"""launch/train.py --packed: packed recall documents of long-tailed lengths, SP=2 losses equal SP=1.

The packed rows hold several recall samples (lengths log-uniform between the shortest valid sample
and seq_len, ending exactly at seq_len); shard_batch derives their global boundaries and the swapped
Llama separates the documents exactly, so the per-step losses of SP=2 must equal SP=1 (1e-4).
An unpacked run of the same steps is a different loss, and the packed row is checked to be what
DataCollatorWithFlattening would make of those documents.

Plain SGD, no clipping (test_train._sgd_config: the shipped config's AdamW hides a gradient's scale). Seen
failing: FSDP2's divide factor ``dp_size * sp_size`` (``integrations/fsdp.py``, every gradient halved at SP=2),
which passed on the AdamW config. Step 1's reduced gradients are compared with SP = 1's too, each on its own scale
(tolerance audit 32): seqpar's attention with dq doubled on a world > 1 only (``query + (query - query.detach())``
in ``seqpar_attention_forward``) passed the losses of every layout and fails the gradients (SP 2 zigzag:
``embed_tokens`` 2.7e-3 off where 5.8e-6 is allowed).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from launch_module import run_main, train_module
from test_train import _losses_and_grads, _sgd_config, assert_first_gradients_close

RTOL = 1e-4
# seq_len 250 is not a multiple of 4: zigzag over 2 pads the end (one more segment).
ARGV = ["--config", _sgd_config("fsdp_ring.json"), "--packed", "--seq-len", "250",
        "--steps", "3", "--no-progress", "--log-level", "WARNING"]


def _train() -> Any:
    return train_module()


def _run_main(rank: int, world: int, argv: list[str]) -> list[float]:
    return run_main(argv)["loss"]


def test_packed_rows_are_flattened_documents():
    transformers = pytest.importorskip("transformers")
    train = _train()
    task = train.RecallTask(train.TrainSettings(seq_len=250, packed=True))
    lengths = task.packed_lengths(0)
    assert sum(lengths) == 250 and len(lengths) >= 2 and min(lengths) >= task.min_len
    row = task.packed_batch(0)
    docs = [task.sample(i, n) for i, n in enumerate(lengths)]
    flat = transformers.DataCollatorWithFlattening()([{"input_ids": d[0].tolist()} for d in docs])
    assert torch.equal(row["input_ids"], flat["input_ids"])
    assert torch.equal(row["position_ids"], flat["position_ids"])
    with pytest.raises(ValueError, match="packed needs train.micro_batch_size = 1"):
        train.TrainSettings(packed=True, micro_batch_size=2)


def test_packed_sp2_and_sp4_losses_equal_sp1(dist_pool):
    ref, ref_grads = _losses_and_grads(dist_pool, 1, [*ARGV, "--sp-size", "1"])
    # every rank reports the same global loss (_losses_and_grads asserts it); step 1's reduced gradients are
    # SP = 1's, each on its own scale
    got, grads = _losses_and_grads(dist_pool, 2, [*ARGV, "--sp-size", "2", "--sharding", "zigzag"])
    assert_first_gradients_close(grads, ref_grads, "SP 2 zigzag")
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        assert abs(a - b) <= RTOL * abs(b), f"step {i}: SP=2 {a} vs SP=1 {b}"
    got4, grads4 = _losses_and_grads(dist_pool, 4, [*ARGV, "--sp-size", "4", "--sharding", "contiguous"])
    assert_first_gradients_close(grads4, ref_grads, "SP 4 contiguous")
    for i, (a, b) in enumerate(zip(got4, ref, strict=True)):
        assert abs(a - b) <= RTOL * abs(b), f"step {i}: SP=4 {a} vs SP=1 {b}"
    # balanced: chunks dealt per row from its documents (pads 250 to 256, 8 chunks per rank); the
    # first row's layout is neither contiguous nor zigzag, so this run is a third layout
    from itertools import accumulate

    from seqpar.sequence.sharding import balanced_layout

    train = _train()
    lengths = train.RecallTask(train.TrainSettings(seq_len=250, packed=True)).packed_lengths(0)
    layout = balanced_layout(256, 2, (0, *accumulate(lengths), 256))
    assert layout[0] not in ((0, 1, 2, 3, 4, 5, 6, 7), (0, 1, 2, 3, 12, 13, 14, 15)), layout
    bal, bal_grads = _losses_and_grads(dist_pool, 2, [*ARGV, "--sp-size", "2", "--sharding", "balanced"])
    assert_first_gradients_close(bal_grads, ref_grads, "SP 2 balanced")
    for i, (a, b) in enumerate(zip(bal, ref, strict=True)):
        assert abs(a - b) <= RTOL * abs(b), f"step {i}: SP=2 balanced {a} vs SP=1 {b}"
    unpacked = dist_pool.run(1, _run_main, [a for a in ARGV if a != "--packed"] + ["--sp-size", "1",
                                                                                  "--steps", "1"],
                             timeout=240)[0]
    assert abs(unpacked[0] - ref[0]) > 1e-3, "the packed run must train on different rows"
