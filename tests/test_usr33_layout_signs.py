"""``bshd`` tensors passed without ``layout=`` whose ``bhsd`` reading fails and ``bshd`` reading fits: refused on
every rank naming ``layout='bshd'`` (before: a shape mismatch or a head-count error that did not say so), and the
fix it names gives the float64 reference's answer. Calls valid as ``bhsd`` are not refused. At P = 2 over gloo
(the pool's harness, its timeout turning a hang into a failure); each rank returns what it got."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import seqpar

SEQ, HQ, HKV, D = 8, 8, 2, 6  # seq_local 4 at P = 2, fewer tokens than heads: the old ambiguity check passes it

# case -> (kv heads, extra kwargs built from (q_heads, seq) below)
CASES = ("gqa", "gqa_no_check", "mqa", "sinks", "alibi_slopes", "cu_seqlens")


def _full(hkv: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """q, k, v of the whole sequence, bshd ``(1, SEQ, heads, D)``, float64."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, SEQ, h, D, generator=g, dtype=torch.float64) for h in (HQ, hkv, hkv))


def _kwargs(case: str) -> dict:
    g = torch.Generator().manual_seed(1)
    if case == "sinks":
        return {"sinks": torch.randn(HQ, generator=g, dtype=torch.float64)}
    if case == "alibi_slopes":
        return {"alibi_slopes": torch.rand(HQ, generator=g, dtype=torch.float64)}
    if case == "cu_seqlens":
        return {"cu_seqlens": (0, 3, SEQ)}
    if case == "gqa_no_check":
        return {"check_inputs": False}
    return {}


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, case: str, kw: dict) -> torch.Tensor:
    """One process, float64, bshd in and out: causal, with the case's sinks / ALiBi / documents."""
    qb, kb, vb = (t.transpose(1, 2) for t in (q, k, v))
    rep = qb.shape[1] // kb.shape[1]
    kb, vb = kb.repeat_interleave(rep, 1), vb.repeat_interleave(rep, 1)
    scores = (qb @ kb.transpose(-1, -2)) * D ** -0.5  # (1, HQ, SEQ, SEQ)
    i, j = torch.arange(SEQ)[:, None], torch.arange(SEQ)[None, :]
    seen = j <= i
    if "cu_seqlens" in kw:
        doc = torch.bucketize(torch.arange(SEQ), torch.tensor(kw["cu_seqlens"][1:]), right=True)
        seen &= doc[:, None] == doc[None, :]
    if "alibi_slopes" in kw:
        scores = scores - kw["alibi_slopes"][:, None, None] * (i - j)
    scores = scores.masked_fill(~seen, float("-inf"))
    if "sinks" in kw:
        sink = kw["sinks"][None, :, None, None].expand(1, HQ, SEQ, 1)
        probs = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :SEQ]
    else:
        probs = torch.softmax(scores, -1)
    return (probs @ vb).transpose(1, 2)


def _call(rank: int, world: int, case: str) -> tuple[str, str, float]:
    hkv = {"gqa": HKV, "gqa_no_check": HKV, "mqa": 1}.get(case, HQ)
    full = _full(hkv)
    n = SEQ // world
    q, k, v = (t[:, rank * n:(rank + 1) * n].clone() for t in full)  # this rank's contiguous shard, bshd
    kw = {"group": dist.group.WORLD, "causal": True, **_kwargs(case)}
    try:
        seqpar.attention(q, k, v, **kw)
        got = ("", "")
    except (ValueError, TypeError) as e:
        got = (type(e).__name__, str(e))
    out = seqpar.attention(q, k, v, layout="bshd", **kw)  # the fix the message names: exact, ranks still in step
    want = _reference(*full, case, kw)[:, rank * n:(rank + 1) * n]
    return (*got, float((out - want).abs().max()))


def _valid_bhsd(rank: int, world: int) -> float:
    """bhsd calls, no layout=, that the new refusal must leave alone: GQA with heads <= seq_local, sinks and ALiBi
    of q_heads' length, documents ending at P x seq_local. Each equals the bshd call of the transposed tensors."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 4, 8, D, generator=g, dtype=torch.float64)  # 4 heads, seq_local 8
    k, v = (torch.randn(1, 2, 8, D, generator=g, dtype=torch.float64) for _ in range(2))
    kw = {"group": dist.group.WORLD, "causal": True, "sinks": torch.randn(4, generator=g, dtype=torch.float64),
          "cu_seqlens": (0, 5, 8 * world)}
    out = seqpar.attention(q, k, v, **kw)
    alibi = seqpar.attention(q, k, v, group=dist.group.WORLD, causal=True, alibi_slopes=torch.rand(4, generator=g,
                                                                                                   dtype=torch.float64))
    assert alibi.shape == q.shape
    # heads == seq_local: both readings fit the head vectors and the boundaries, so the sign check refuses nothing.
    # check_inputs=False: with it the call is refused as ambiguous first (tests/test_usr34_layout_equal.py), while
    # the sign check runs either way
    sq = torch.randn(1, 8, 8, D, generator=g, dtype=torch.float64)
    for extra in ({"sinks": torch.randn(8, generator=g, dtype=torch.float64), "cu_seqlens": (0, 3, 8 * world)},
                  {"alibi_slopes": torch.rand(8, generator=g, dtype=torch.float64)}):
        assert seqpar.attention(sq, sq, sq, group=dist.group.WORLD, causal=True, check_inputs=False,
                                **extra).shape == sq.shape
    explicit = seqpar.attention(*(t.transpose(1, 2) for t in (q, k, v)), layout="bshd", **kw).transpose(1, 2)
    return float((out - explicit).abs().max())


@pytest.mark.parametrize("case", CASES)
def test_a_bshd_call_that_fails_as_bhsd_names_layout_bshd_on_every_rank(dist_pool, case: str) -> None:
    results = dist_pool.run(2, _call, case, timeout=120)
    assert len(results) == 2
    for rank, (kind, message, err) in enumerate(results):
        assert kind == "ValueError", (case, rank, kind, message)
        assert "pass layout='bshd'" in message and "read as layout='bhsd'" in message, (case, rank, message)
        assert err <= 1e-12, (case, rank, err)  # layout='bshd', as named: the float64 reference's answer
    assert results[0][1] == results[1][1]  # the same verdict on both ranks


def test_valid_bhsd_calls_are_not_refused(dist_pool) -> None:
    for err in dist_pool.run(2, _valid_bhsd, timeout=120):
        assert err == 0.0, err
