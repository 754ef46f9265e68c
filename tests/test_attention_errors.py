"""Bad input to seqpar.attention: a clear error on every rank, never a hang or a silent wrong answer.

Each worker catches the error it gets and returns (type name, message); the parent asserts that every
rank raised and that the message names the problem and the fix. The pool's timeout turns any hang
into a test failure instead of a stuck CI job.
"""

from __future__ import annotations

import pytest
import torch

import seqpar
from seqpar.attn.checks import check_across_ranks


def _call(rank: int, world: int, case: str) -> tuple[str, str] | None:
    torch.manual_seed(rank)
    shape_q, shape_kv = (1, 4, 8, 16), (1, 2, 8, 16)
    kwargs: dict = {"group": torch.distributed.group.WORLD}
    if case == "local_shape_differs":  # rank 1 holds a shorter shard than rank 0
        shape_q = shape_kv = (1, 4, 8 if rank == 0 else 6, 16)
    if case == "batch_differs":
        shape_q = shape_kv = (1 + rank, 4, 8, 16)
    q = torch.randn(shape_q, requires_grad=True)
    k = torch.randn(shape_kv, requires_grad=True)
    v = torch.randn(shape_kv, requires_grad=True)
    if case == "dtype_mismatch":
        k = k.detach().double()
    if case == "dtype_differs_across_ranks" and rank == 1:
        q, k, v = (t.detach().double() for t in (q, k, v))
    if case == "device_mismatch":
        v = torch.empty(shape_kv, device="meta")
    if case == "three_dims":
        q = q.detach()[0]
    if case == "heads_not_multiple":
        k, v = torch.randn(1, 3, 8, 16), torch.randn(1, 3, 8, 16)
    if case == "head_dim_mismatch":
        k, v = torch.randn(1, 2, 8, 8), torch.randn(1, 2, 8, 8)
    if case == "zigzag_odd_length":
        q, k, v = torch.randn(1, 4, 7, 16), torch.randn(1, 2, 7, 16), torch.randn(1, 2, 7, 16)
        kwargs["sharding"] = "zigzag"
    if case == "causal_differs":
        kwargs["causal"] = rank == 0
    if case == "mode_differs":
        kwargs["mode"] = "ring" if rank == 0 else "allgather"
    if case == "bad_mode":
        kwargs["mode"] = "ulysses2"
    if case == "bad_sharding":
        kwargs["sharding"] = "striped"
    if case == "head_chunks_not_dividing":
        kwargs["head_chunks"] = 3  # k/v have 2 heads
    if case == "head_chunks_bad":
        kwargs["head_chunks"] = "many"
    if case == "head_chunks_differ":
        kwargs["head_chunks"] = 1 if rank == 0 else 2
    if case == "scale_differs":  # same shapes, a different softmax on each rank
        kwargs["scale"] = 0.25 * (1 + rank)
    try:
        if case == "dilated_scale_differs":
            seqpar.dilated_attention(q, k, v, segment_lengths=[8], dilation_rates=[1], scale=0.25 * (1 + rank),
                                     group=torch.distributed.group.WORLD)
        elif case == "dilated_pattern_differs":  # each rank valid alone, the ranks disagree
            pattern = ([8], [1]) if rank == 0 else ([8 * world], [2])
            seqpar.dilated_attention(q, k, v, segment_lengths=pattern[0], dilation_rates=pattern[1],
                                     group=torch.distributed.group.WORLD)
        elif case == "extra_differs":  # what later features (documents, windows) add to the check
            check_across_ranks(q, k, v, group=torch.distributed.group.WORLD, causal=True,
                               mode="ring", sharding="contiguous", extra=[7] * (1 + rank))
        else:
            seqpar.attention(q, k, v, **kwargs)
    except (ValueError, TypeError) as e:
        return type(e).__name__, str(e)
    return None


CASES = {
    # case: words the message must contain (lower case)
    "local_shape_differs": ["different inputs", "rank 0", "rank 1", "shard"],
    "batch_differs": ["different inputs", "same batch"],
    "dtype_differs_across_ranks": ["different inputs", "float64"],
    "causal_differs": ["different inputs", "options"],
    "mode_differs": ["different inputs"],
    "dtype_mismatch": ["dtypes differ", "cast"],
    "device_mismatch": ["different devices"],
    "three_dims": ["3 dimensions", "(batch, heads, seq_local, head_dim)"],
    "heads_not_multiple": ["multiple of kv_heads"],
    "head_dim_mismatch": ["head_dim"],
    "zigzag_odd_length": ["zigzag", "even", "pad", "contiguous"],
    "bad_mode": ["mode", "ring", "allgather"],
    "bad_sharding": ["sharding", "contiguous", "zigzag"],
    "head_chunks_not_dividing": ["head_chunks=3", "2 k/v heads", "[1, 2]", "auto"],
    "head_chunks_bad": ["head_chunks='many'", "positive integer", "auto"],
    "head_chunks_differ": ["different inputs", "head_chunks=1", "head_chunks=2"],
    "dilated_pattern_differs": ["seqpar.dilated_attention: the ranks", "different inputs", "extra="],
    "extra_differs": ["different inputs", "extra=[7]", "extra=[7, 7]"],
    "scale_differs": ["seqpar.attention: the ranks", "different inputs", "scale=0.25", "scale=0.5"],
    "dilated_scale_differs": ["seqpar.dilated_attention: the ranks", "different inputs", "scale=0.25", "scale=0.5"],
}


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_gets_a_clear_error(dist_pool, world: int) -> None:
    for case, words in CASES.items():
        results = dist_pool.run(world, _call, case, timeout=60)
        for rank, res in enumerate(results):
            assert res is not None, f"{case}: rank {rank} raised nothing"
            message = res[1].lower()
            for w in words:
                assert w.lower() in message, f"{case}: rank {rank} message lacks {w!r}: {res[1]}"


def test_errors_without_a_process_group() -> None:
    for case in ("dtype_mismatch", "three_dims", "heads_not_multiple", "bad_mode", "zigzag_odd_length",
                 "head_chunks_not_dividing", "head_chunks_bad"):
        res = _call(0, 1, case)
        assert res is not None, case
