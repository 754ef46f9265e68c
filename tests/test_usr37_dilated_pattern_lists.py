"""``seqpar.dilated_attention``'s ``segment_lengths`` / ``dilation_rates`` given as something other than a list: a
generator (``(w for w in ws)``) was read once by the pattern check and then frozen empty, so one process returned an
all-zero output without an error (no pattern selects any row); a bare int (torchscale's single ``segment_length``)
failed on ``len()`` deep inside, and where only some ranks passed it they raised before the cross-rank all-gather the
others waited in. Now a TypeError on every rank names the list form; tuples and ranges still run exactly."""

from __future__ import annotations

import pytest
import torch

import seqpar


def _qkv(seq: int = 8) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1)
    return tuple(torch.randn(1, 4, seq, 4, generator=g, dtype=torch.float64) for _ in range(3))


@pytest.mark.parametrize("lengths, rates, hint", [
    (8, 1, "segment_lengths=[8] for one pattern"),
    ((w for w in [4, 8]), iter([1, 2]), "list(...) of a generator"),
    ("8", "1", "pass a list of positive integers"),
    (torch.tensor([8]), torch.tensor([1]), "t.tolist()"),
    ([4, 8], 2, "dilation_rates=[2] for one pattern"),
], ids=["int", "generator", "str", "tensor", "rates int"])
def test_a_pattern_that_is_no_list_is_refused(lengths: object, rates: object, hint: str) -> None:
    """Seen failing with dilated_plan._is_list always true: the generator ran and returned zeros, the int failed on
    "'int' object is not iterable", the string on "every entry must be a positive integer" (no list form named)."""
    q, k, v = _qkv()
    with pytest.raises(TypeError) as e:
        seqpar.dilated_attention(q, k, v, segment_lengths=lengths, dilation_rates=rates, causal=True)
    assert "is invalid: pass a list of positive integers" in str(e.value) and hint in str(e.value), str(e.value)


def test_tuples_and_ranges_run_as_the_list() -> None:
    q, k, v = _qkv()
    want = seqpar.dilated_attention(q, k, v, segment_lengths=[4, 8], dilation_rates=[1, 2], causal=True)
    assert want.abs().max() > 0.1  # not the all-zero output of an empty pattern
    for ws, rs in (((4, 8), (1, 2)), (range(4, 9, 4), range(1, 3))):
        got = seqpar.dilated_attention(q, k, v, segment_lengths=ws, dilation_rates=rs, causal=True)
        assert torch.equal(got, want)


def _one_rank_passes_an_int(rank: int, world: int) -> tuple[str, str]:
    seqpar.init_process_groups(sp_size=world)
    q, k, v = (seqpar.shard_sequence(t, 2) for t in _qkv(16))
    try:
        seqpar.dilated_attention(q, k, v, segment_lengths=[16] if rank == 0 else 16, dilation_rates=[2], causal=True)
    except (TypeError, ValueError) as e:
        return type(e).__name__, str(e)
    return "", ""


def test_ranks_passing_a_list_and_an_int_are_refused_alike(dist_pool) -> None:
    """Seen failing with pattern_row's old len(): rank 1 raised before the all-gather and rank 0 waited in it until
    the group's timeout (60 s here: RuntimeError, not the refusal)."""
    for kind, msg in dist_pool.run(2, _one_rank_passes_an_int, timeout=150):
        assert kind == "ValueError" and "seqpar.dilated_attention: the ranks" in msg and "different inputs" in msg, msg
