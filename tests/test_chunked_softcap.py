"""Chunked local attention (``chunk_size=``, Llama 4), logit soft-capping (``softcap=``, Gemma 2) and
ALiBi (``alibi_slopes=``, BLOOM / MPT / Falcon) in every mode, against a float64 dense reference on the
full sequence (issue 19, section 4).

The reference builds the S x S visibility from the definition: same document, same chunk of that
document (chunk n of a document starting at s is ``[s + n c, s + (n + 1) c)``), causal / window as
in test_documents; soft-capped scores ``c * tanh(s / c)``. Ring and all-gather at P = 1, 2, 4
(contiguous, zigzag, balanced), Ulysses at P = 2 and 4, hybrid at P = 4 as 2 x 2; chunks shorter than
a zigzag chunk (5) and longer than a shard (31), with and without packed documents; soft-capping
alone and with chunks, documents and a window; ALiBi (``-m_h (i - j)`` on every visible score) alone
and with documents and chunks. Out, dq, dk, dv at 1e-5. Plus ALiBi in bf16 at S = 4096 against the
bf16 error of one process (SDPA with the bias as a bf16 mask).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from test_attention import shard_rows, sp_group, unshard_rows
from test_documents import make_case, visible

import seqpar
from seqpar.attn.masks import MaskSpec, plan_pieces

HEADS = ((4, 2, 12), (4, 1, 8), (4, 4, 6))


def chunk_visible(seq: int, chunk: int | None, cu: list[int] | None) -> torch.Tensor:
    """Pairs in the same chunk of the same document (all pairs when ``chunk`` is None)."""
    if chunk is None:
        return torch.ones(seq, seq, dtype=torch.bool)
    pos = torch.arange(seq)
    starts = torch.zeros(seq, dtype=torch.long)
    if cu is not None:
        doc = torch.bucketize(pos, torch.tensor(cu[1:]), right=True)
        starts = torch.tensor(cu)[doc]
        same_doc = doc[:, None] == doc[None, :]
    else:
        same_doc = torch.ones(seq, seq, dtype=torch.bool)
    idx = (pos - starts) // chunk
    return same_doc & (idx[:, None] == idx[None, :])


def reference(case: dict) -> list[torch.Tensor]:
    q, k, v = (case[n].clone().requires_grad_() for n in "qkv")
    group = q.shape[1] // k.shape[1]
    ke, ve = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = q @ ke.transpose(-1, -2) * case["scale"]
    if case["softcap"] is not None:
        scores = case["softcap"] * torch.tanh(scores / case["softcap"])
    seq = q.shape[2]
    if case.get("alibi") is not None:
        pos = torch.arange(seq, dtype=torch.float64)
        scores = scores - case["alibi"].view(1, -1, 1, 1) * (pos[:, None] - pos[None, :])
    mask = visible(seq, case["causal"], case["window"], case["cu"]) & chunk_visible(seq, case["chunk"], case["cu"])
    out = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ ve
    out.backward(case["dout"])
    return [out.detach(), q.grad, k.grad, v.grad]


def run_cases(rank: int, world: int, cases: list[dict], ulysses_size: int | None = None) -> list[list[torch.Tensor]]:
    """Worker: forward + backward of each case on this rank's shard (balanced: seqpar's own cut)."""
    if ulysses_size is not None:
        seqpar.init_process_groups(sp_size=world, ulysses_size=ulysses_size)
    results = []
    for case in cases:
        cu = None if case["cu"] is None else torch.tensor(case["cu"], dtype=torch.int32)
        balanced = case["sharding"] == "balanced"
        if balanced:
            q, k, v, dout = (seqpar.shard_sequence(case[n], 2, group=sp_group(), sharding="balanced", cu_seqlens=cu).float()
                             for n in ("q", "k", "v", "dout"))
        else:
            q, k, v, dout = (shard_rows(case[n], rank, world, case["sharding"]).float() for n in ("q", "k", "v", "dout"))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out = seqpar.attention(
            q, k, v, causal=case["causal"], mode=case["mode"], sharding=case["sharding"], cu_seqlens=cu,
            window=case["window"], chunk_size=case["chunk"], softcap=case["softcap"], alibi_slopes=case.get("alibi"),
            group=None if case["mode"] == "hybrid" else sp_group(),
        )
        out.backward(dout)
        res = [out.detach(), q.grad, k.grad, v.grad]
        if balanced:
            res = [seqpar.gather_sequence(t, 2, group=sp_group(), sharding="balanced", cu_seqlens=cu) for t in res]
        results.append(res)
    return results


def check(per_rank: list, cases: list[dict], world: int) -> None:
    for idx, case in enumerate(cases):
        if case["sharding"] == "balanced":
            got = list(per_rank[0][idx])
        else:
            got = [unshard_rows([per_rank[r][idx][j] for r in range(world)], world, case["sharding"]) for j in range(4)]
        label = {n: case.get(n) for n in ("mode", "sharding", "causal", "window", "cu", "chunk", "softcap", "alibi")}
        for name, g, w in zip(("out", "dq", "dk", "dv"), got, reference(case)):
            torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-5, msg=lambda s, n=name, lb=label: f"{n} {lb}: {s}")


# (chunk, docs variant, window, softcap): chunk < a zigzag chunk, chunk > a shard (24 tokens per
# rank), chunks inside packed documents, soft-capping alone and with every mask feature
VARIANTS = ((5, None, None, None), (31, None, None, None), (5, 0, None, None), (31, 1, None, None),
            (None, None, None, 0.9), (7, 0, 4, 1.3), ("alibi", None, None, None), ("alibi", 0, None, None))


def _cases(world: int, modes: tuple[str, ...], shardings: tuple[str, ...], seed: int) -> list[dict]:
    cases = []
    for i, (mode, sharding, causal, (chunk, docs, window, softcap)) in enumerate(
        itertools.product(modes, shardings, (True, False), VARIANTS)
    ):
        case = make_case(seed + i, world, HEADS[i % len(HEADS)], mode=mode, sharding=sharding, causal=causal,
                         window=window, docs=docs, sinks=False)
        alibi = None
        if chunk == "alibi":  # slopes as BLOOM's for 4 heads (and one not a power of 2), chunks of 9 with documents
            alibi, chunk = torch.tensor([0.25, 0.0625, 0.3, 2.0 ** -8], dtype=torch.float64), (9 if docs is not None else None)
        case.update(chunk=chunk, softcap=softcap, alibi=alibi)
        cases.append(case)
    return cases


@pytest.mark.parametrize("world", [1, 2, 4])
def test_chunks_and_softcap_exact_ring_allgather(dist_pool, world: int) -> None:
    cases = _cases(world, ("ring", "allgather"), ("contiguous", "zigzag"), 7000 + 100 * world)
    cases += [c for c in _cases(world, ("ring",), ("balanced",), 7050 + 100 * world) if c["cu"] is not None]
    check(dist_pool.run(world, run_cases, cases, timeout=300), cases, world)


@pytest.mark.parametrize("world", [2, 4])
def test_chunks_and_softcap_exact_ulysses(dist_pool, world: int) -> None:
    cases = _cases(world, ("ulysses",), ("contiguous", "zigzag"), 7500 + 100 * world)
    check(dist_pool.run(world, run_cases, cases, timeout=300), cases, world)


def test_chunks_and_softcap_exact_hybrid(dist_pool) -> None:
    cases = _cases(4, ("hybrid",), ("contiguous", "zigzag"), 7900)
    check(dist_pool.run(4, run_cases, cases, 2, timeout=300), cases, 4)


def test_chunks_are_documents_to_the_planner() -> None:
    """A chunk boundary inside a document cuts its pieces exactly like a document boundary would."""
    cu = (0, 7, 40)
    chunked = plan_pieces(MaskSpec(True, None, cu, 10), [(0, 40)], [(0, 40)])
    as_docs = plan_pieces(MaskSpec(True, None, (0, 7, 17, 27, 37, 40)), [(0, 40)], [(0, 40)])
    assert sorted(map(repr, chunked)) == sorted(map(repr, as_docs))


def test_bad_chunk_and_softcap_are_refused() -> None:
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match=r"chunk_size=0 is invalid: pass an int >= 1"):
        seqpar.attention(q, q, q, causal=True, chunk_size=0)
    with pytest.raises(ValueError, match=r"softcap=-1.0 is invalid: pass a float > 0"):
        seqpar.attention(q, q, q, causal=True, softcap=-1.0)


def test_alibi_bf16_long_no_worse_than_one_process() -> None:
    """bf16 at S = 4096 (one rank: the extra columns carry the same global positions at any P):
    seqpar's error against the float64 reference is within 1.5x that of one process (SDPA given
    ALiBi's ``-m_h (i - j)`` as a bf16 mask), plus a floor; the slopes are BLOOM's steepest."""
    seq, heads, dim = 4096, 2, 16
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, heads, seq, dim, generator=g, dtype=torch.float64) for _ in range(3))
    slopes = torch.tensor([0.5, 0.25], dtype=torch.float64)
    pos = torch.arange(seq, dtype=torch.float64)
    causal = pos[:, None] >= pos[None, :]
    ref = torch.empty_like(q)
    bias = []
    for h in range(heads):  # one head at a time: the float64 S x S scores are 128 MiB each
        b = -slopes[h] * (pos[:, None] - pos[None, :])
        s = (q[:, h] @ k[:, h].transpose(-1, -2)) * dim ** -0.5 + b
        ref[:, h] = torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1) @ v[:, h]
        bias.append(b.masked_fill(~causal, float("-inf")).to(torch.bfloat16))
        del s, b
    qb, kb, vb = (t.to(torch.bfloat16) for t in (q, k, v))
    one = torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, attn_mask=torch.stack(bias)[None])
    del bias
    got = seqpar.attention(qb, kb, vb, causal=True, alibi_slopes=slopes.float())
    err_one = float((one.double() - ref).norm() / ref.norm())
    err = float((got.double() - ref).norm() / ref.norm())
    assert err <= 1.5 * err_one + 1e-3, (err, err_one)


def test_no_host_sync_with_chunks_softcap_alibi() -> None:
    """No device-to-host read per call (a host sync on a GPU): the ALiBi columns' digit count comes
    from the host sequence length, chunks from host integers (one rank, bf16 ALiBi, fp32 the others)."""
    from test_host_sync import counting

    q = torch.randn(1, 4, 64, 8, dtype=torch.bfloat16, requires_grad=True)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    qf = torch.randn(1, 4, 64, 8, requires_grad=True)
    with counting() as counts:
        seqpar.attention(q, q, q, causal=True, alibi_slopes=slopes, check_inputs=False).float().sum().backward()
        seqpar.attention(qf, qf, qf, causal=True, chunk_size=5, softcap=2.0, check_inputs=False).sum().backward()
    assert counts.get("sync", 0) == 0, dict(counts)
