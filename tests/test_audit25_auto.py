"""Audit 25: ``mode="auto"`` with a caller's int ``head_chunks`` allows a Ulysses / hybrid mode exactly when the
ranks of that mode can run it, i.e. when :func:`seqpar.attn.checks.resolve_head_chunks` (what the mode itself calls,
on :attr:`seqpar.attn.ulysses.HeadSplit.kv_per_rank`) takes it. No process group."""

from __future__ import annotations

import itertools

from seqpar.attn.checks import resolve_head_chunks
from seqpar.attn.choose import CallShape, allowed_modes
from seqpar.attn.ulysses import head_split
from seqpar.runtime.grid import ulysses_heads_accepted


def _runs(q_heads: int, kv_heads: int, u: int, sp_size: int, mode: str, head_chunks: int) -> bool:
    """Whether a ``mode`` call with ``u`` Ulysses ranks takes ``head_chunks``: the heads split and the chunks divide
    the K/V heads a rank holds (a replicated K/V head counts once: ``Hkv < u`` holds 1)."""
    if not ulysses_heads_accepted(q_heads, kv_heads, u):
        return False
    split = head_split(q_heads, kv_heads, u, sp_size=sp_size, mode=mode)
    try:
        resolve_head_chunks(head_chunks, split.kv_per_rank)
    except ValueError:
        return False
    return True


def test_a_given_head_chunks_is_allowed_where_the_mode_takes_it() -> None:
    """Every (query heads, K/V heads) of 1..12 with GQA's divisibility, P = 4 (Ulysses 4, hybrid u = 2) and P = 6
    (hybrid u = 2 and 3), head_chunks 1..4: "ulysses" / "hybrid" are allowed iff the mode's own ``head_split`` and
    ``resolve_head_chunks`` take the call; "auto" head_chunks (``head_chunks_given`` False) rules nothing out.
    MQA and few K/V heads (``Hkv < u``: each rank holds one, replicated) included, uneven splits included.
    Seen failing: ``chunks_fit``'s ``max(kv_heads // u, 1)`` without the ``max`` (MQA 8 / 1 at P = 4 with
    head_chunks=2: Ulysses allowed, where its ranks' one K/V head refuses 2 passes)."""
    checked = 0
    for q_heads, kv_heads in itertools.product(range(1, 13), range(1, 13)):
        if q_heads % kv_heads:
            continue
        for sp, u, head_chunks in itertools.product((4, 6), (2, 3, 4), (1, 2, 3, 4)):
            if sp % u or u == sp and u != 4:
                continue
            c = CallShape(1, q_heads, kv_heads, 1024, 64, 4, True, sp, u, head_chunks=head_chunks,
                          head_chunks_given=True)
            modes = allowed_modes(c)
            want_ulysses = _runs(q_heads, kv_heads, sp, sp, "ulysses", head_chunks)
            assert ("ulysses" in modes) == want_ulysses, (q_heads, kv_heads, sp, head_chunks, modes)
            if 1 < u < sp:
                want_hybrid = _runs(q_heads, kv_heads, u, sp, "hybrid", head_chunks)
                assert ("hybrid" in modes) == want_hybrid, (q_heads, kv_heads, sp, u, head_chunks, modes)
            auto = allowed_modes(CallShape(1, q_heads, kv_heads, 1024, 64, 4, True, sp, u, head_chunks=head_chunks))
            assert ("ulysses" in auto) == ulysses_heads_accepted(q_heads, kv_heads, sp), (q_heads, kv_heads, sp)
            checked += 1
    assert checked > 200, checked
