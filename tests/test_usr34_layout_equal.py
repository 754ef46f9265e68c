"""``seqpar.attention`` without ``layout=`` on a q whose ``heads == seq_local`` and K/V of the same shape (multi-head
attention): read as ``bhsd`` and as ``bshd`` the call is equally valid, and nothing else in it (sinks, ALiBi slopes,
documents: they count the same either way) tells the two apart, so it is refused on every rank naming both
layouts; the call with either ``layout=`` gives that reading's float64 reference. Calls one reading rules out (GQA,
``heads != seq_local``) are not refused. At P = 2 over gloo (the pool's harness, its timeout turning a hang into a
failure), and on one process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import seqpar

H, D = 4, 6  # heads == seq_local == 4 at P = 2 (8 tokens) and on one process (4 tokens)
CASES = ("plain", "sinks", "alibi_slopes", "cu_seqlens", "gqa_bhsd", "check_inputs_false")


def _full(seq: int, hkv: int, layout: str) -> tuple[torch.Tensor, ...]:
    """q, k, v of the whole sequence in ``layout``, float64, fresh random values."""
    g = torch.Generator().manual_seed(3)
    shape = (lambda h: (1, h, seq, D)) if layout == "bhsd" else (lambda h: (1, seq, h, D))
    return tuple(torch.randn(*shape(h), generator=g, dtype=torch.float64) for h in (H, hkv, hkv))


def _kwargs(case: str, seq: int) -> dict:
    g = torch.Generator().manual_seed(4)
    if case == "sinks":
        return {"sinks": torch.randn(H, generator=g, dtype=torch.float64)}
    if case == "alibi_slopes":
        return {"alibi_slopes": torch.rand(H, generator=g, dtype=torch.float64)}
    if case == "cu_seqlens":
        return {"cu_seqlens": (0, 3, seq)}
    if case == "check_inputs_false":
        return {"check_inputs": False}
    return {}


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kw: dict) -> torch.Tensor:
    """One process, float64, causal, bhsd in and out, with the case's sinks / ALiBi / documents."""
    s = q.shape[2]
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = (q @ k.transpose(-1, -2)) * D ** -0.5
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    seen = j <= i
    if "cu_seqlens" in kw:
        doc = torch.bucketize(torch.arange(s), torch.tensor(kw["cu_seqlens"][1:]), right=True)
        seen &= doc[:, None] == doc[None, :]
    if "alibi_slopes" in kw:
        scores = scores - kw["alibi_slopes"][:, None, None] * (i - j)
    scores = scores.masked_fill(~seen, float("-inf"))
    if "sinks" in kw:
        sink = kw["sinks"][None, :, None, None].expand(*scores.shape[:3], 1)
        probs = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :s]
    else:
        probs = torch.softmax(scores, -1)
    return probs @ v


def _call(rank: int, world: int, case: str) -> tuple[str, str, float, float]:
    """This rank's shard of a bshd call (bhsd for ``gqa_bhsd``) without ``layout=``: what it raised, and the error of
    the calls with ``layout='bshd'`` and ``layout='bhsd'`` against their readings' float64 references."""
    seq = H * world
    layout = "bhsd" if case == "gqa_bhsd" else "bshd"
    full = _full(seq, 2 if case == "gqa_bhsd" else H, layout)
    n = seq // world
    dim = 2 if layout == "bhsd" else 1
    shards = [[t.narrow(dim, r * n, n).clone() for t in full] for r in range(world)]  # contiguous
    q, k, v = shards[rank]
    kw = {"group": dist.group.WORLD if world > 1 else None, "causal": True, **_kwargs(case, seq)}
    try:
        seqpar.attention(q, k, v, **kw)
        got = ("", "")
    except ValueError as e:
        got = (type(e).__name__, str(e))
    errs = []
    for named in ("bshd", "bhsd"):  # each reading, named: exact against its own reference
        if case == "gqa_bhsd" and named == "bshd":
            errs.append(0.0)  # as bshd the K/V shard holds 2 tokens, not 4: no valid call
            continue
        # the whole sequence as this reading sees it: the shards joined on its sequence dim, then bhsd
        seq_dim = 1 if named == "bshd" else 2
        bhsd = [torch.cat([s[i] for s in shards], seq_dim) for i in range(3)]
        bhsd = [t.transpose(1, 2) for t in bhsd] if named == "bshd" else bhsd
        want = _reference(*bhsd, kw).narrow(2, rank * n, n)
        want = want.transpose(1, 2) if named == "bshd" else want
        errs.append(float((seqpar.attention(q, k, v, layout=named, **kw) - want).abs().max()))
    return (*got, *errs)


REFUSED = ("plain", "sinks", "alibi_slopes", "cu_seqlens")


@pytest.mark.parametrize("case", CASES)
def test_heads_equal_to_seq_local_names_both_layouts_on_every_rank(dist_pool, case: str) -> None:
    results = dist_pool.run(2, _call, case, timeout=120)
    assert len(results) == 2
    for rank, (kind, message, err_bshd, err_bhsd) in enumerate(results):
        if case in REFUSED:
            assert kind == "ValueError", (case, rank, kind, message)
            assert "layout='bhsd'" in message and "layout='bshd'" in message and "4 heads" in message, message
        else:  # GQA tells the readings apart; check_inputs=False skips the check, as documented
            assert kind == "", (case, rank, message)
        # the fix the message names, either reading: its float64 reference's answer
        assert err_bshd <= 1e-12 and err_bhsd <= 1e-12, (case, rank, err_bshd, err_bhsd)
    assert results[0][1] == results[1][1]  # the same verdict on both ranks


@pytest.mark.parametrize("case", ["plain", "gqa_bhsd"])
def test_heads_equal_to_seq_local_on_one_process(case: str) -> None:
    kind, message, err_bshd, err_bhsd = _call(0, 1, case)
    assert kind == ("ValueError" if case == "plain" else ""), (case, message)
    assert err_bshd <= 1e-12 and err_bhsd <= 1e-12, (case, err_bshd, err_bhsd)


def test_a_fuzzer_draw_that_omits_layout_at_heads_equal_to_seq_local_runs_exact() -> None:
    """The attention fuzzer leaves ``layout=None`` on 30% of its bhsd draws; about 0.9% of its draws (171 of seeds
    0..19999) have ``heads == seq_local`` with K/V of q's heads there, which is now refused. Its runner passes
    ``layout='bhsd'`` for those (the shape decides, on the shard before a drawn disagreement): case 415 (P = 2,
    allgather, 4 heads, seq_local 4, two calls) is exact. Seen failing: the runner omitting layout= as drawn ->
    every rank's ValueError naming both layouts."""
    from seqpar.testing import fuzz
    from seqpar.testing.fuzz_attention_run import judge_attention, tensors_of

    draws = fuzz.draw_case(415, ("attention",))
    assert draws["omit_layout"] and draws["layout"] == "bhsd" and draws["check_inputs"], fuzz.summary(draws)
    assert draws["heads"][:2] == [4, 4] and draws["seq"] // draws["world"] == 4 and draws["world"] == 2
    with fuzz.Fuzzer(timeout=90.0, model_timeout=240.0) as f:
        tensors = tensors_of(draws)
        per_rank = f.pools.run(2, fuzz.attention_task, draws, tensors, None, timeout=90.0)
        assert all(r["ok"] for r in per_rank), per_rank
        ref = fuzz.attention_reference(draws, tensors)
        verdict, detail = judge_attention(draws, ref, per_rank)
    assert verdict == "exact", detail
