"""Ulysses attention (mode="ulysses"): exact against a float64 single-process reference on the full
sequence, GQA/MQA with fewer K/V heads than ranks, uneven head shares (u not dividing the heads), one
packed all-to-all each way (counted at torch's entry point, with the uneven calls' split sizes), the
all-to-all communicator's round trip, and clear errors on every rank."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from test_attention import make_case, reference, shard_rows, sp_group, unshard_rows
from test_attention import run_cases as _run_cases

import seqpar

SHARDINGS = ("contiguous", "zigzag")
# (q_heads, kv_heads, head_dim) per world size: MHA, GQA, MQA / fewer K/V heads than ranks, odd head dims
HEADS = {
    2: ((4, 4, 24), (4, 2, 40), (6, 1, 24)),
    3: ((6, 6, 24), (6, 3, 40), (6, 1, 20)),
    4: ((8, 8, 24), (8, 2, 40), (4, 1, 24)),
}


def run_cases(rank: int, world: int, cases: list[tuple], dtype: torch.dtype, ulysses_size: int | None = None,
              **options: object) -> list[list[torch.Tensor]]:
    """Worker body: optionally build the (Ulysses x ring) groups, then seqpar.attention per case."""
    if ulysses_size is not None:
        seqpar.init_process_groups(sp_size=world, ulysses_size=ulysses_size)
    return _run_cases(rank, world, cases, dtype, **options)


def check_cases(per_rank: list, cases: list[tuple], world: int, tol: float = 1e-5) -> None:
    for idx, (case, mode, sharding, causal, scale) in enumerate(cases):
        got = [unshard_rows([per_rank[r][idx][j] for r in range(world)], world, sharding) for j in range(4)]
        for name, g, w in zip(("out", "dq", "dk", "dv"), got, reference(case, causal, scale)):
            torch.testing.assert_close(
                g.double(), w, rtol=tol, atol=tol,
                msg=lambda s, n=name, m=(mode, sharding, causal, tuple(case["k"].shape)): f"{n} {m}: {s}",
            )


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ulysses_exact_fp32(dist_pool, world: int) -> None:
    cases = []
    for i, (sharding, causal, heads) in enumerate(itertools.product(SHARDINGS, (False, True), HEADS[world])):
        scale = 0.3 if heads[2] == 40 else None
        cases.append((make_case(7000 + 100 * world + i, world, heads), "ulysses", sharding, causal, scale))
    check_cases(dist_pool.run(world, run_cases, cases, torch.float32, timeout=240), cases, world)


def test_ulysses_bf16_within_sdpa_rounding(dist_pool) -> None:
    """bf16 at P = 4 (GQA, zigzag, causal): norm-relative error no worse than twice SDPA's own in bf16."""
    g = torch.Generator().manual_seed(11)
    case = {n: torch.randn(2, 8 if n in ("q", "dout") else 2, 64, 32, generator=g, dtype=torch.float64)
            for n in ("q", "k", "v", "dout")}
    cases = [(case, "ulysses", "zigzag", True, None)]
    per_rank = dist_pool.run(4, run_cases, cases, torch.bfloat16, timeout=240)
    got = [unshard_rows([per_rank[r][0][j] for r in range(4)], 4, "zigzag") for j in range(4)]
    want = reference(case, True, None)
    low = reference({n: t.to(torch.bfloat16) for n, t in case.items()}, True, None)
    for name, gt, w, base in zip(("out", "dq", "dk", "dv"), got, want, low):
        err = ((gt.double() - w).norm() / w.norm()).item()
        base_err = ((base.double() - w).norm() / w.norm()).item()
        assert gt.dtype == torch.bfloat16 and err <= 2 * base_err + 1e-3, (name, err, base_err)


# ------------------------------------------------------------------------ one all-to-all each way
def _count_all_to_all(rank: int, world: int, heads: tuple[int, int], head_chunks: int, ulysses_size: int | None,
                      dkv_wire_dtype: str = "fp32") -> dict:
    """Count the collectives and bytes of one forward and one backward, at torch's entry points."""
    if ulysses_size is not None:
        seqpar.init_process_groups(sp_size=world, ulysses_size=ulysses_size)
    calls = {"a2a": [], "p2p": 0, "other": 0, "splits": []}
    originals = {n: getattr(dist, n) for n in ("all_to_all_single", "batch_isend_irecv", "all_gather_into_tensor",
                                               "all_gather", "all_reduce", "all_to_all")}

    def a2a(out, inp, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        calls["a2a"].append(inp.numel() * inp.element_size())
        sizes = (kwargs.get("output_split_sizes"), kwargs.get("input_split_sizes"))  # (None, None): even
        calls["splits"].append(None if sizes == (None, None) else
                               tuple([n * inp.element_size() for n in x] for x in sizes))
        return originals["all_to_all_single"](out, inp, *args, **kwargs)

    def p2p(ops):  # noqa: ANN001, ANN202
        calls["p2p"] += sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
        return originals["batch_isend_irecv"](ops)

    def other(name):  # noqa: ANN001, ANN202
        def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            calls["other"] += 1
            return originals[name](*args, **kwargs)
        return call

    hq, hkv = heads
    torch.manual_seed(rank)
    q = torch.randn(2, hq, 8, 16, requires_grad=True)
    k = torch.randn(2, hkv, 8, 16, requires_grad=True)
    v = torch.randn(2, hkv, 8, 16, requires_grad=True)
    dist.all_to_all_single, dist.batch_isend_irecv = a2a, p2p
    for name in ("all_gather_into_tensor", "all_gather", "all_reduce", "all_to_all"):
        setattr(dist, name, other(name))
    try:
        mode = "ulysses" if ulysses_size is None else "hybrid"
        out = seqpar.attention(q, k, v, causal=True, sharding="zigzag", mode=mode, head_chunks=head_chunks,
                               check_inputs=False, group=sp_group(), dkv_wire_dtype=dkv_wire_dtype, layout="bhsd")
        fwd = dict(a2a=list(calls["a2a"]), p2p=calls["p2p"], other=calls["other"], splits=list(calls["splits"]))
        calls["a2a"].clear()
        calls["splits"].clear()
        calls["p2p"] = 0
        out.backward(torch.randn_like(out))
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return {"fwd": fwd, "bwd": dict(calls)}


@pytest.mark.parametrize("world, heads", [(2, (4, 4)), (4, (8, 2)), (4, (4, 1))])
def test_one_packed_all_to_all_each_way(dist_pool, world: int, heads: tuple[int, int]) -> None:
    """Per head chunk: forward = one all-to-all of q, k, v packed + one of the output; backward = one of
    dout + one of dq, dk, dv packed. Bytes = the theory: only the K/V heads each rank's query heads need
    (one replica per rank when kv_heads < P), never K/V expanded to the query heads; no other collective."""
    hq, hkv = heads
    elem, tokens, d = 4, 2 * 8, 16  # fp32, batch x seq_local, head_dim
    kv_per = max(hkv // world, 1)
    qkv_bytes = world * (hq // world + 2 * kv_per) * tokens * d * elem
    out_bytes = hq * tokens * d * elem
    for chunks in sorted({1, kv_per}):
        for r, got in enumerate(dist_pool.run(world, _count_all_to_all, heads, chunks, None)):
            fwd, bwd = got["fwd"], got["bwd"]
            assert fwd["p2p"] == bwd["p2p"] == fwd["other"] == bwd["other"] == 0, (r, got)
            assert len(fwd["a2a"]) == len(bwd["a2a"]) == 2 * chunks, (r, chunks, got)
            assert sum(fwd["a2a"]) == sum(bwd["a2a"]) == qkv_bytes + out_bytes, (r, chunks, got)
            assert sorted(fwd["a2a"]) == sorted(bwd["a2a"]) == sorted([qkv_bytes // chunks, out_bytes // chunks] * chunks)
            # the even path is today's: equal slots, no split sizes (seen failing with the even split routed
            # through _uneven_forward / _uneven_backward)
            assert fwd["splits"] == bwd["splits"] == [None] * 2 * chunks, (r, got)


# (world, q_heads, kv_heads) -> each rank's (query heads, K/V heads), written out by hand: DeepSpeed's split
UNEVEN_SHARES = {
    (4, 14, 2): [(4, 1), (4, 2), (3, 1), (3, 1)],  # q 0-3 | 4-7 (K/V heads 0 and 1) | 8-10 | 11-13
    (3, 7, 1): [(3, 1), (2, 1), (2, 1)],
    (4, 6, 3): [(2, 1), (2, 1), (1, 1), (1, 1)],
}


@pytest.mark.parametrize("world, hq, hkv", list(UNEVEN_SHARES))
def test_uneven_all_to_all_bytes(dist_pool, world: int, hq: int, hkv: int) -> None:
    """Uneven heads: still one packed all-to-all each way per direction (q/k/v, out; dout, dq/dk/dv), with
    per-peer split sizes. Rank r sends peer j j's share of its tokens (q_j query + 2 kv_j K/V heads; dout:
    q_j heads) and receives u equal slots of its own share; the output and dq/dk/dv come back the other
    way. Against the shares written out by hand (:data:`UNEVEN_SHARES`), in bytes.

    Seen failing: the last rank's share off by one in ulysses_shares (``base + (j < extra)`` ->
    ``base + (j < extra) - (j == u - 1)``: rank 0's sizes differ from the hand-written ones), the K/V union
    lacking the second head (``kv_last - kv_first + 1`` -> ``1``: every rank raised, the sizes no longer
    pairing)."""
    shares = UNEVEN_SHARES[(world, hq, hkv)]
    unit = 2 * 8 * 16 * 4  # batch x seq_local x head_dim x fp32: one head of one rank's tokens
    chunks = 2 if hkv == 2 else 1  # 2 passes asked at 14/2 (valid there): an uneven split runs one
    for r, got in enumerate(dist_pool.run(world, _count_all_to_all, (hq, hkv), chunks, None)):
        fwd, bwd = got["fwd"], got["bwd"]
        assert fwd["p2p"] == bwd["p2p"] == fwd["other"] == bwd["other"] == 0, (r, got)
        qr, kr = shares[r]
        qkv_send = [(q + 2 * k) * unit for q, k in shares]
        q_send = [q * unit for q, _ in shares]
        mine_qkv, mine_q = [(qr + 2 * kr) * unit] * world, [qr * unit] * world
        # (output split sizes, input split sizes) of each call, in order
        assert fwd["splits"] == [(mine_qkv, qkv_send), (q_send, mine_q)], (r, fwd)
        assert bwd["splits"] == [(mine_q, q_send), (qkv_send, mine_qkv)], (r, bwd)
        assert fwd["a2a"] == [sum(qkv_send), world * qr * unit] and bwd["a2a"] == [hq * unit, world * (qr + 2 * kr) * unit]


# ------------------------------------------------------------------------ the communicator
def _round_trip(rank: int, world: int) -> list[torch.Tensor]:
    from seqpar.comm.alltoall import all_to_all

    g = torch.Generator().manual_seed(3)
    full = torch.randn(2, 6 * world, 5 * world, 3, generator=g, dtype=torch.float64)  # (B, H, S, D)
    x = full[:, :, 5 * rank:5 * (rank + 1)].clone().requires_grad_()  # this rank's sequence shard
    heads = all_to_all(x, scatter_dim=1, gather_dim=2, group=dist.group.WORLD)  # (B, H/P, S, D)
    assert torch.equal(heads, full[:, 6 * rank:6 * (rank + 1)]), "head shard of the full sequence"
    back = all_to_all(heads, scatter_dim=2, gather_dim=1, group=dist.group.WORLD)
    assert torch.equal(back, x), "sequence -> heads -> sequence is the identity"
    w = torch.randn(heads.shape, generator=torch.Generator().manual_seed(10 + rank), dtype=torch.float64)
    (heads * w).sum().backward()
    return [x.grad, w]


@pytest.mark.parametrize("world", [2, 3])
def test_all_to_all_round_trip_and_dual_backward(dist_pool, world: int) -> None:
    per_rank = dist_pool.run(world, _round_trip)
    w_full = torch.cat([per_rank[r][1] for r in range(world)], dim=1)  # (B, H, S, D): d loss / d heads
    for r in range(world):
        torch.testing.assert_close(per_rank[r][0], w_full[:, :, 5 * r:5 * (r + 1)], rtol=0, atol=0)


# ------------------------------------------------------------------------ errors, never a hang
def _bad_calls(rank: int, world: int) -> list[str]:
    messages = []
    kv = torch.randn(1, 4, 4, 8)
    with pytest.raises(ValueError) as e:  # 2 query heads over 3 ranks (4 over 3 runs now: 2, 1, 1)
        seqpar.attention(torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), mode="ulysses",
                         layout="bhsd", group=dist.group.WORLD)
    messages.append(str(e.value))
    with pytest.raises(ValueError) as e:  # shapes differ across ranks
        seqpar.attention(torch.randn(1, 6, 4 + rank, 8), torch.randn(1, 6, 4 + rank, 8), torch.randn(1, 6, 4 + rank, 8),
                         mode="ulysses", layout="bhsd",
                         group=dist.group.WORLD)
    messages.append(str(e.value))
    with pytest.raises(ValueError) as e:  # hybrid needs the manager's axes
        seqpar.attention(torch.randn(1, 6, 4, 8), kv, kv, mode="hybrid", group=dist.group.WORLD, layout="bhsd")
    messages.append(str(e.value))
    with pytest.raises(ValueError) as e:  # ... and a manager
        seqpar.attention(torch.randn(1, 6, 4, 8), torch.randn(1, 6, 4, 8), torch.randn(1, 6, 4, 8), mode="hybrid", layout="bhsd")
    messages.append(str(e.value))
    # still in step: good calls complete, K/V heads neither a multiple nor a divisor of 3 included (uneven)
    for hkv in (3, 2):
        out = seqpar.attention(torch.randn(1, 6, 4, 8), torch.randn(1, hkv, 4, 8), torch.randn(1, hkv, 4, 8),
                               mode="ulysses", layout="bhsd", group=dist.group.WORLD)
        assert out.shape == (1, 6, 4, 8)
    return messages


def test_bad_input_is_a_clear_error_on_every_rank(dist_pool) -> None:
    per_rank = dist_pool.run(3, _bad_calls, timeout=60)
    heads, shapes, explicit, manager = per_rank[0]
    assert all(m == per_rank[0] for m in per_rank)
    assert "2 query heads are fewer than the 3 Ulysses ranks" in heads and "hybrid" in heads
    assert "ulysses_size" in heads and "[1]" in heads and "'ring'" in heads
    assert "different inputs" in shapes and "rank 2" in shapes
    assert "hybrid" in explicit and "group=" in explicit
    assert "init_process_groups" in manager and "ulysses_size" in manager


def _bad_uneven_sizes(rank: int, world: int) -> list[str]:
    """Worker body: start_all_to_all_uneven with sizes that do not fit the group or the buffer; then a good
    exchange, so the ranks are still in step."""
    from seqpar.comm.alltoall import start_all_to_all_uneven

    messages = []
    send = torch.arange(3.0 + rank)  # rank r sends 1 element to rank 0, 2 + r to rank 1
    sizes = [1, 2 + rank]
    recv = [1, 1] if rank == 0 else [2, 3]
    for bad in ((send, sizes, recv[:1]), (send, sizes[:1], recv), (send[:-1], sizes, recv)):
        with pytest.raises(ValueError) as e:
            start_all_to_all_uneven(*bad, dist.group.WORLD)
        messages.append(str(e.value))
    (got,) = start_all_to_all_uneven(send, sizes, recv, dist.group.WORLD).wait()
    assert got.tolist() == ([0.0, 0.0] if rank == 0 else [1.0, 2.0, 1.0, 2.0, 3.0]), got
    return messages


def _assert_cancelling_dk_column_exact(dist_pool, world: int, q, k, v, dout) -> None:  # noqa: ANN001
    """Ulysses in bf16 on ``world`` ranks over ``q, k, v, dout`` built so that the last column of the one K/V head's
    dK is a sum of partials that cancel (keys 0 there): that column against float64 at its own scale."""
    case = {n: t.to(torch.bfloat16).double() for n, t in (("q", q), ("k", k), ("v", v), ("dout", dout))}
    per_rank = dist_pool.run(world, run_cases, [(case, "ulysses", "contiguous", True, None)], torch.bfloat16,
                             timeout=240)
    dk = unshard_rows([per_rank[r][0][2] for r in range(world)], world, "contiguous").double()
    want = reference(case, True, None)[2]
    col, want_col = dk[..., -1], want[..., -1]
    assert want_col.abs().max() < 2.0 ** -6 * want[..., :-1].abs().max()  # the construction holds
    torch.testing.assert_close(col, want_col, rtol=0, atol=2.0 ** -5 * want_col.abs().max().item())


def _cancelling_mqa_inputs(seed: int, seq: int, q_heads: int, *, minus: int, zero: tuple[int, ...] = (),
                           d: int = 8) -> tuple[torch.Tensor, ...]:
    """Fresh MQA inputs ``q, k, v, dout`` ((1, q_heads, seq, d), K/V one head) whose K/V head's dK has a last
    column (``e``) of partials that cancel: the keys are 0 there (no score depends on it), query head 0 is +1
    and head ``minus`` -1 (a copy of head 0 otherwise, with equal dout), the ``zero`` heads 0 and the others
    2**-10, so their small terms are all that is left of dk[..., e]."""
    g = torch.Generator().manual_seed(seed)
    q, dout = torch.randn(1, q_heads, seq, d, generator=g), torch.randn(1, q_heads, seq, d, generator=g)
    k, v = torch.randn(1, 1, seq, d, generator=g), torch.randn(1, 1, seq, d, generator=g)
    q[:, minus], dout[:, minus] = q[:, 0], dout[:, 0]
    q[..., -1] = 2.0 ** -10
    q[:, 0, :, -1], q[:, minus, :, -1] = 1.0, -1.0
    for head in zero:
        q[:, head, :, -1] = 0.0
    k[..., -1] = 0.0
    return q, k, v, dout


def test_uneven_all_to_all_refuses_sizes_that_do_not_fit(dist_pool) -> None:
    """start_all_to_all_uneven: a receive or send size list not one per rank, and a send buffer that is not the
    sum of its sizes, are a ValueError naming it on every rank (before any collective: the ranks stay in step,
    a good exchange follows), never gloo's size mismatch or a hang.

    Seen failing: the receive sizes' length unchecked (``or len(recv_sizes) != world`` dropped: torch's own
    error, unnamed), the buffer's size unchecked (``or send.numel() != sum(send_sizes)`` dropped)."""
    per_rank = dist_pool.run(2, _bad_uneven_sizes, timeout=60)
    for messages in per_rank:
        recv_len, send_len, numel = messages
        assert "1 receive sizes for a group of 2 ranks" in recv_len, recv_len
        assert "1 send / 2 receive sizes for a group of 2 ranks" in send_len, send_len
        assert "is not 1-D of the" in numel, numel


def test_bf16_replicated_kv_grads_are_summed_in_fp32(dist_pool) -> None:
    """MQA at P = 4 in bf16: the K/V head is replicated on the 4 ranks, and its dK is the sum of their
    shares, which must add up in fp32 and be rounded once. Along the last head dim (``e``), the keys are 0
    (no score depends on it), query heads 0 and 2 are +1 and -1 (equal otherwise, with equal dout), heads 1
    and 3 are 2**-10: heads 0 and 2 add exactly opposite terms to dk[..., e], and the small terms of heads
    1 and 3 are all that is left, which a bf16 sum loses in the first large term's rounding.
    dk[..., e] against float64 at its own scale (2**10 below the other columns').

    Seen failing: the replicas' dK summed in the input dtype (``dk = torch.zeros(k_shape, dtype=dout.dtype,
    ...)`` in ulysses_backward), which test_ulysses_bf16_within_sdpa_rounding let through (2 replicas per
    K/V head there: a bf16 sum of two rounds once, as fp32's does)."""
    _assert_cancelling_dk_column_exact(dist_pool, 4, *_cancelling_mqa_inputs(31, 16, 4, minus=2))


# ------------------------------------------------------------------------ uneven head shares
# (q_heads, kv_heads, head_dim) per Ulysses degree u where u does not split the heads evenly: MHA, MQA, GQA
# with a K/V head shared by two ranks (6/3, 14/7, 14/2, 6/2), odd head dims; q_heads 3, 5, 6, 7, 14.
UNEVEN = {
    2: ((3, 3, 8), (5, 1, 9), (6, 3, 8), (7, 7, 5), (3, 1, 8)),
    3: ((5, 5, 8), (7, 1, 9), (14, 7, 8), (14, 2, 8), (6, 2, 8), (7, 7, 5)),
    4: ((14, 2, 8), (14, 7, 9), (5, 5, 8), (6, 3, 8), (7, 1, 8), (6, 2, 5), (14, 14, 8)),
}


def uneven_reference(case: dict, causal: bool, cu_seqlens: tuple[int, ...] | None,
                     sinks: torch.Tensor | None) -> list[torch.Tensor]:
    """Float64 attention on the whole sequence by explicit scores (GQA by repeating K/V in the reference
    only), causal and/or inside documents, with an optional per-query-head sink logit in the softmax's
    denominator: ``[out, dq, dk, dv]`` (+ ``dsinks``)."""
    q, k, v = (case[n].clone().requires_grad_() for n in "qkv")
    group = q.shape[1] // k.shape[1]
    s = q.shape[2]
    scores = q @ k.repeat_interleave(group, 1).transpose(-1, -2) * q.shape[-1] ** -0.5
    keep = torch.ones(s, s, dtype=torch.bool)
    if causal:
        keep = keep.tril()
    if cu_seqlens is not None:
        doc = torch.bucketize(torch.arange(s), torch.tensor(cu_seqlens[1:-1]), right=True)
        keep = keep & (doc[:, None] == doc[None, :])
    scores = scores.masked_fill(~keep, float("-inf"))
    leaves = [q, k, v]
    if sinks is not None:
        sink = sinks.double().clone().requires_grad_()
        leaves.append(sink)
        scores = torch.cat([scores, sink.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)], dim=-1)
    p = scores.softmax(-1)[..., :s]
    out = p @ v.repeat_interleave(group, 1)
    out.backward(case["dout"])
    return [out.detach(), *(t.grad for t in leaves)]


def run_uneven(rank: int, world: int, cases: list[tuple], ulysses_size: int | None = None) -> list[list[torch.Tensor]]:
    """Worker body: each ``(case, mode, sharding, causal, cu_seqlens, sinks, head_chunks)`` in fp32 through
    seqpar.attention on this rank's shard: ``[out, dq, dk, dv]`` (+ ``dsinks``)."""
    if ulysses_size is not None:
        seqpar.init_process_groups(sp_size=world, ulysses_size=ulysses_size)
    results = []
    for case, mode, sharding, causal, cu, sinks, chunks in cases:
        q, k, v, dout = (shard_rows(case[n], rank, world, sharding).float() for n in ("q", "k", "v", "dout"))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        extra = {} if sinks is None else {"sinks": sinks.float().requires_grad_()}
        out = seqpar.attention(q, k, v, causal=causal, mode=mode, sharding=sharding, group=sp_group(), layout="bhsd",
                               cu_seqlens=cu, head_chunks=chunks, **extra)
        out.backward(dout)
        results.append([out.detach(), q.grad, k.grad, v.grad] + ([extra["sinks"].grad] if sinks is not None else []))
    return results


def check_uneven(per_rank: list, cases: list[tuple], world: int, tol: float = 1e-5) -> None:
    """Gathered out, dq, dk, dv (and the sinks' gradient, summed over ranks like any replicated weight)
    against :func:`uneven_reference`, each within ``tol`` of its own largest value."""
    for idx, (case, mode, sharding, causal, cu, sinks, chunks) in enumerate(cases):
        got = [unshard_rows([per_rank[r][idx][j] for r in range(world)], world, sharding) for j in range(4)]
        if sinks is not None:
            got.append(sum(per_rank[r][idx][4] for r in range(world)))
        label = (mode, sharding, causal, tuple(case["q"].shape), tuple(case["k"].shape), cu is not None, chunks)
        for name, g, w in zip(("out", "dq", "dk", "dv", "dsinks"), got, uneven_reference(case, causal, cu, sinks)):
            err = (g.double() - w).abs().max().item()
            assert err <= tol * w.abs().max().item(), (name, label, err, w.abs().max().item())


def uneven_cases(world: int, mode: str, heads: tuple, seed: int, u: int | None = None) -> list[tuple]:
    """One case per head count, cycling sharding and causality; every third with documents, one with sinks,
    and 2 head chunks asked wherever valid (an uneven split runs one pass). ``u``: the Ulysses degree."""
    from seqpar.attn.ulysses import HeadSplit

    u = world if u is None else u
    cases = []
    for i, h in enumerate(heads):
        sharding, causal = SHARDINGS[i % 2], i % 4 < 2 or i % 3 == 0
        docs = i % 3 == 1  # documents are packed into one row: batch 1
        case = make_case(seed + i, world, h, batch=1 if docs else 1 + i % 2)
        seq = case["q"].shape[2]
        cu = (0, 5, seq // 2 + 1, seq) if docs else None
        g = torch.Generator().manual_seed(seed + 50 + i)
        sinks = torch.randn(h[0], generator=g, dtype=torch.float64) if i == 2 else None
        # 2 passes asked where 2 divides the K/V heads and the largest share's (else the entry refuses it)
        chunks = 2 if h[1] % 2 == 0 and HeadSplit(h[0], h[1], u).kv_per_rank % 2 == 0 else "auto"
        cases.append((case, mode, sharding, causal, cu, sinks, chunks))
    return cases


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ulysses_uneven_heads_exact_fp32(dist_pool, world: int) -> None:
    """u = 2, 3, 4 with head counts u does not split evenly (:data:`UNEVEN`): rank j attends a contiguous
    range of query heads (the first ranks one more) and the K/V heads those read, a shared K/V head's dK/dV
    summed over its ranks. Exact (fp32, 1e-5 of each tensor's own scale) against float64 on the gathered
    sequence: causal and not, zigzag and contiguous, documents, sinks, odd head dims, batch 1 and 2.

    Seen failing: the last rank's share off by one (``- (j == u - 1)`` on its count in ulysses_shares: a
    rank raised in the all-to-all's sizes); the K/V union cut to one head (``kv_last - kv_first + 1`` ->
    ``1``: a rank raised); a shared K/V head's dK taken from one rank only (``.add_`` -> ``.copy_`` in
    _uneven_backward: dk off by 3.4 at a scale of 4.0, 5 query / 1 K/V head on 2 ranks); the GQA pieces
    merged into one kernel call (segments returning one piece: the kernels raised on 6/3); the sinks of rank
    0's heads used on every rank (``sinks[qf:qf + qn]`` -> ``sinks[:qn]``: out off by 0.076 at 6/3)."""
    cases = uneven_cases(world, "ulysses", UNEVEN[world], 12000 + 100 * world)
    check_uneven(dist_pool.run(world, run_uneven, cases, timeout=300), cases, world)


def test_uneven_head_rule() -> None:
    """What stays refused (fewer query heads than ranks; no GQA grouping) and the shares themselves:
    DeepSpeed's split (14 heads on 4 ranks: 4, 4, 3, 3) and the K/V heads each share reads, by hand.

    Seen failing: the last share off by one and the K/V union cut to one head (as in
    test_uneven_all_to_all_bytes); it also caught a hand value of mine (6/2 on 4 ranks: rank 1's query heads
    2 and 3 read K/V heads 0 and 1)."""
    from seqpar.attn.ulysses import HeadSplit, head_split
    from seqpar.runtime.grid import ulysses_heads_accepted, ulysses_heads_ok, ulysses_shares

    assert ulysses_shares(14, 2, 4) == [(0, 4, 0, 1), (4, 4, 0, 2), (8, 3, 1, 1), (11, 3, 1, 1)]
    assert ulysses_shares(6, 3, 4) == [(0, 2, 0, 1), (2, 2, 1, 1), (4, 1, 2, 1), (5, 1, 2, 1)]
    assert ulysses_shares(7, 1, 3) == [(0, 3, 0, 1), (3, 2, 0, 1), (5, 2, 0, 1)]
    assert ulysses_shares(6, 2, 4) == [(0, 2, 0, 1), (2, 2, 0, 2), (4, 1, 1, 1), (5, 1, 1, 1)]  # q 2 | q 3
    assert ulysses_shares(8, 2, 4) == [(0, 2, 0, 1), (2, 2, 0, 1), (4, 2, 1, 1), (6, 2, 1, 1)]  # even: replicated
    # GQA-regular pieces: 14/2 on rank 1 reads K/V head 0 with 3 query heads and head 1 with 1
    assert HeadSplit(14, 2, 4).segments(1) == [(0, 3, 0, 1), (3, 1, 1, 1)]
    assert HeadSplit(14, 14, 4).segments(0) == [(0, 4, 0, 4)]  # MHA: one piece
    assert HeadSplit(12, 4, 5).segments(3) == [(0, 1, 0, 1), (1, 1, 1, 1)]  # q 8, 9: end of kv 2, start of kv 3
    assert HeadSplit(14, 7, 3).segments(0) == [(0, 4, 0, 2), (4, 1, 2, 1)]  # two full groups together, then q 4
    assert ulysses_heads_accepted(14, 2, 4) and not ulysses_heads_ok(14, 2, 4)  # accepted, not even
    assert ulysses_heads_ok(8, 2, 4) and not ulysses_heads_accepted(3, 1, 4)
    assert not ulysses_heads_accepted(6, 4, 2)  # 6 query heads on 4 K/V heads: no grouping
    with pytest.raises(ValueError, match=r"3 query heads are fewer than the 4 Ulysses ranks.*ulysses_size.*\[1, 2\]"):
        head_split(3, 1, 4, sp_size=4, mode="ulysses")


def test_auto_costs_the_slowest_uneven_share() -> None:
    """mode='auto' prices uneven Ulysses at its slowest rank: 28 query / 4 K/V heads on 8 ranks (shares of 4
    or 3 query heads; the largest K/V union is 2 heads, e.g. rank 1's query heads 4-7 read K/V heads 0 and 1)
    cost what an even split with 4 query and 2 K/V heads per rank costs (32 / 16 heads), in one head pass.

    Seen failing: the uneven branch of mode_costs removed (priced as an even 28/4 split: fewer bytes, a
    quarter less compute than its slowest rank does)."""
    from seqpar.attn.choose import CallShape, Links, allowed_modes, mode_costs

    uneven = CallShape(1, 28, 4, 4096, 128, 2, True, 8, 8, head_chunks=1)
    even = CallShape(1, 32, 16, 4096, 128, 2, True, 8, 8, head_chunks=1)
    assert "ulysses" in allowed_modes(uneven)
    (u_cost,), (e_cost,) = mode_costs(uneven, Links(), ["ulysses"]), mode_costs(even, Links(), ["ulysses"])
    assert u_cost.bytes_sent == e_cost.bytes_sent == 7 * 2 * 4096 * 256 * 2 * (4 + 2)
    assert u_cost.seconds == pytest.approx(e_cost.seconds, rel=1e-12)


def test_auto_costs_an_uneven_split_as_one_head_pass() -> None:
    """An uneven split runs one head pass whatever ``head_chunks`` asks (HeadSplit: 1 when uneven), so mode='auto'
    prices it so: 36 query / 18 K/V heads on 8 ranks (shares of 5 or 4 query heads; 18 // 8 = 2 K/V heads would
    let an even split take 2 passes) costs the same at head_chunks 2 as at 1, while an even 32/16 split's
    2 passes cost more latency than its 1. Public contract of the head rules under tensor parallelism too:
    ``ulysses_heads_accepted(q, kv, u, tp)`` judges the heads each TP rank holds (4 query heads over TP 2 leave
    2 a rank, fewer than 4 Ulysses ranks), and the problem names those per-rank counts.

    Seen failing: the uneven branch keeping the even split's pass count (``chunks, shape = 1, ...`` ->
    ``chunks, shape = chunks, ...`` in mode_costs: 2 passes' latency priced); the per-rank division dropped
    from ulysses_heads_problem (``q_heads, kv_heads = q_heads // tp, kv_heads // tp`` removed: 4/2 at TP 2
    accepted on 4 Ulysses ranks)."""
    from seqpar.attn.choose import CallShape, Links, mode_costs
    from seqpar.runtime.grid import ulysses_heads_accepted, ulysses_heads_problem

    def cost(hq: int, hkv: int, chunks: int) -> float:
        (m,) = mode_costs(CallShape(1, hq, hkv, 4096, 128, 2, True, 8, 8, head_chunks=chunks), Links(), ["ulysses"])
        return m.seconds

    assert cost(36, 18, 2) == cost(36, 18, 1)
    assert cost(32, 16, 2) != cost(32, 16, 1)  # the pass count is priced: the check above can see it
    assert ulysses_heads_accepted(8, 2, 4, tp=2) and not ulysses_heads_accepted(4, 2, 4, tp=2)
    assert "2 query heads are fewer than the 4 Ulysses ranks" in ulysses_heads_problem(4, 2, 4, tp=2)


def test_uneven_ulysses_under_nccl_rules(dist_pool) -> None:
    """Uneven heads (5 query / 5 K/V and 7 / 7 over 3 ranks) through the documents x windows x shardings x
    causal matrix of tests/test_nccl_rules.py, under NCCL's rules enforced on gloo (collective inputs
    unchanged until wait(), receive buffers NaN until wait(), every group set up eagerly): exact in every
    gradient. The uneven all_to_all_single with split sizes is one more collective those rules wrap.

    Seen failing: start_all_to_all_uneven's Pending finishing without ``work.wait()`` (the rules name the
    80 works never waited)."""
    from test_documents import check as check_documents
    from test_nccl_rules import SENDS, _cases, _check_clean, _run_under_rules, _variants, store_port

    cases = _cases(3, "ulysses", (5, 5, 8), 7300, _variants(3)[::2]) + _cases(3, "ulysses", (7, 7, 6), 7400, _variants(3)[1::2])
    out = dist_pool.run(3, _run_under_rules, store_port(), cases, 1, sends=SENDS["ulysses"], timeout=300)
    _check_clean(out)
    check_documents([o["results"] for o in out], cases, 3)


def test_bf16_uneven_shared_kv_grads_are_summed_in_fp32(dist_pool) -> None:
    """MQA with uneven shares in bf16: 5 query heads over 1 K/V head on 3 ranks (shares 2, 2, 1), the K/V head
    read by every rank, so its dK is the sum of 3 ranks' bf16 partials, which must add up in fp32 and be rounded
    once. Along the last head dim (``e``) the keys are 0 (no score depends on it); rank 0's query head 0 is +1
    there and rank 2's head 4 is -1 (equal otherwise, with equal dout), rank 0's head 1 is 0, rank 1's heads 2
    and 3 are 2**-10: ranks 0 and 2 send exactly opposite partials for dk[..., e] and rank 1's small one is all
    that is left, which a bf16 sum in rank order loses in rank 0's rounding. dk[..., e] against float64 at its
    own scale (2**10 below the other columns').

    Seen failing: the shared head's dK/dV accumulated in the input dtype (``dk = torch.zeros(k_shape,
    dtype=dout.dtype, ...)`` in _uneven_backward), which every fp32 uneven test and the 2-rank bf16 sums (two
    partials round once either way) let through."""
    _assert_cancelling_dk_column_exact(dist_pool, 3, *_cancelling_mqa_inputs(37, 24, 5, minus=4, zero=(1,)))
