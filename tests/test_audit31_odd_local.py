"""Audit 31 (session 30's fuzzer draw ``odd_local``): the odd shard is never an empty one.

:func:`seqpar.testing.fuzz_attention.odd_local_applied` takes one token per rank off a contiguous case's sequence;
a drawn case has ``seq = 2 P chunk`` (two tokens a rank at least), so only a forced ``seq`` reaches a one-token
shard, which must be left as it is (a shard of 0 tokens is no odd shard). tests/test_fuzz.py runs drawn cases only.
"""

from __future__ import annotations

from seqpar.testing.fuzz_attention import odd_local_applied


def _draws(world: int, seq: int, cu: list[int] | None) -> dict:
    return {"kind": "attention", "sharding": "contiguous", "odd_local": True, "world": world, "seq": seq,
            "calls": [{"cu": cu}]}


def test_a_one_token_shard_is_left_as_it_is() -> None:
    """``seq == world`` (one token a rank): the draws come back unchanged, not cut to ``seq`` 0.

    Seen failing (audit 31, mutant O6: ``seq // world < 1``): at one rank, ``seq`` 1 cut to 0, documents ``[0, 0]``."""
    for world in (1, 2, 4):
        draws = _draws(world, world, [0, world])
        assert odd_local_applied(draws) is draws


def test_two_tokens_a_rank_become_one() -> None:
    """The smallest shard that is cut: two tokens a rank become one, the documents cut at the new end."""
    got = odd_local_applied(_draws(2, 4, [0, 1, 3, 4]))
    assert got["seq"] == 2 and got["calls"] == [{"cu": [0, 1, 2]}], got
