"""NCCL's rules enforced on gloo (issue 20 §2), with :mod:`seqpar.testing.nccl_rules`.

- Every mode (ring, all-gather, Ulysses, hybrid) x documents x windows x shardings x causal runs
  under the rules and matches the float64 reference in every gradient: no group is set up by a
  point-to-point exchange (every communicator was made by a collective of all members, at creation),
  batched messages pair by order on both sides, and no receive buffer is read before its ``wait()``
  (receive buffers hold NaN until then). Send buffers: the point-to-point modes (ring, hybrid, dilated, the mixers' halo)
  run with ``sends="late"``, each send carrying its buffer as at its ``wait()`` (the buffer rule
  literally); the collectives' inputs are snapshot at the post and checked unchanged at ``wait()``. The masks include hop patterns
  that leave ranks idle, among them the example of the issue: 3 hybrid super-ranks (world 6 = 3 x 2),
  one causal document over super-ranks 0-1 and one starting exactly at super-rank 2, which has no ring
  operation in either pass; and the same on a plain ring of 3 (``check_inputs=False``, so that no
  input digest sets the SP group up first).
- The rules fail on each break: groups made without the eager set-up (the example hangs: the waiting
  ranks name the missing ones), one side of seqpar's ring batches reordered, a send buffer written
  (seqpar's ring backward with a stray write into an accumulator in flight: raised with the snapshot
  check, and wrong dK/dV with late sends) and a receive buffer read before ``wait()``; and dilated
  attention's segment exchanges run under the rules too.
"""

from __future__ import annotations

import itertools
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from test_attention import shard_rows
from test_documents import boundaries, check, make_case

import seqpar
from seqpar.attn.common import AttentionOptions, block_hops
from seqpar.comm.ring import RingComm
from seqpar.runtime import communicators, groups
from seqpar.testing.nccl_rules import NcclRuleError, nccl_rules

P2P = "batch_isend_irecv (a batched point-to-point exchange)"


_SERVERS: list[dist.TCPStore] = []


def store_port() -> int:
    """The port of a fresh store server this (the test's) process holds for the session: every rank joins it
    as a client (:func:`_store`). Not a server on rank 0: a rank whose task ends first (e.g. rank 0 leaving
    the rules' block with its own rule error) would close it under the other rank, still publishing its
    records there (seen: "Broken pipe" on rank 1, then the pool's next task hung); and no port picked free
    and bound later, by which time another socket may hold it."""
    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=90), wait_for_workers=False)
    _SERVERS.append(server)
    return server.port


def _store(port: int, rank: int, world: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, world, False, timeout=timedelta(seconds=90))


def _attend(rank: int, world: int, case: dict, manager: groups.ProcessGroupManager) -> list[torch.Tensor]:
    """Forward + backward of one test_documents case on this rank's shard, no input digest."""
    cu = None if case["cu"] is None else torch.tensor(case["cu"], dtype=torch.int32)
    q, k, v, dout = (shard_rows(case[n], rank, world, case["sharding"]).float() for n in ("q", "k", "v", "dout"))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    sinks = None if case["sinks"] is None else case["sinks"].float().requires_grad_()
    out = seqpar.attention(q, k, v, causal=case["causal"], mode=case["mode"], sharding=case["sharding"],
                           cu_seqlens=cu, window=case["window"], sinks=sinks, group=manager.sp_group,
                           check_inputs=False)
    out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad] + ([sinks.grad] if sinks is not None else [])


def _step(rank: int, world: int, case: dict, manager: groups.ProcessGroupManager, boundary: bool) -> list:
    results = _attend(rank, world, case, manager)
    if boundary:  # what ends a training step: a reduction over every rank (here the SP-DP group)
        dist.all_reduce(torch.ones(1), group=manager.sp_dp_group)
    return results


def _run_under_rules(rank: int, world: int, port: int, cases: list[dict], ulysses_size: int,
                     init_timeout_s: float = 60.0, lazy: bool = False, reorder: bool = False,
                     boundary: bool = True, sends: str = "checked") -> dict:
    """Worker: groups, then every case as a training step (``boundary``: ending in a reduction over every
    rank), all under the rules. ``lazy``: groups made without the eager set-up (the break); ``reorder``:
    odd ranks post their batches in reverse order (the break); ``sends``: the rules' send model."""
    store = _store(port, rank, world)
    saved = communicators.init_communicator  # the factory calls it through the module: one patch covers all
    if lazy:
        communicators.init_communicator = lambda group: None
    results, error, first_ops = [], None, []
    manager = None
    try:
        with nccl_rules(store, init_timeout_s=init_timeout_s, sends=sends) as rules:
            manager = seqpar.init_process_groups(sp_size=world, ulysses_size=ulysses_size)
            if reorder and rank % 2:
                posting = dist.batch_isend_irecv  # the rules' own entry: they see the reversed order
                dist.batch_isend_irecv = lambda ops: posting(list(reversed(ops)))
            try:
                results = [_step(rank, world, case, manager, boundary) for case in cases]
            finally:
                if reorder and rank % 2:
                    dist.batch_isend_irecv = posting
            first_ops = list(rules.first_ops)
    except NcclRuleError as e:
        error = str(e)
    finally:
        communicators.init_communicator = saved
    if manager is not None:
        manager.destroy()  # collective: every rank, after the block (a failed rank arrives late)
    return {"results": results, "error": error, "first_ops": first_ops}


def _cases(world: int, mode: str, heads: tuple[int, int, int], seed: int, variants: list[tuple]) -> list[dict]:
    cases = []
    for i, (sharding, causal, (window, cu)) in enumerate(
        itertools.product(("contiguous", "zigzag"), (True, False), variants)
    ):
        c = make_case(seed + i, world, heads, mode=mode, sharding=sharding, causal=causal, window=window,
                      docs=None, sinks=i % 3 == 0)
        c["cu"] = cu
        cases.append(c)
    return cases


def _idle_docs(world: int, groups_of: int = 1) -> list[int]:
    """The issue's example over ``world / groups_of`` (super-)ranks of a contiguous sequence: one document
    over the first two (super-)ranks, the next starting exactly at the third."""
    seq = 24 * world
    third = seq // (world // groups_of) * 2
    return [0, third, seq]


def _variants(world: int, groups_of: int = 1) -> list[tuple]:
    """(window, cu_seqlens): the idle-rank example (first: the first case is contiguous and causal, so a
    group without the eager set-up meets its first exchange there); dense; test_documents' long and short documents;
    a window smaller than a chunk; a window over a shard with short documents."""
    seq, shard = 24 * world, 24
    return [(None, _idle_docs(world, groups_of)), (None, None), (None, boundaries(seq, world, 0)),
            (3, None), (shard + 5, boundaries(seq, world, 1))]


def _check_clean(out: list[dict]) -> None:
    for rank, o in enumerate(out):
        assert o["error"] is None, f"rank {rank}: {o['error']}"
        assert o["first_ops"] and all(what != P2P for _, what in o["first_ops"]), (
            f"rank {rank}: a communicator was set up by a point-to-point exchange: {o['first_ops']}")


def test_the_matrix_has_idle_ranks() -> None:
    """The example leaves a ring rank with no hop at all (hop plan of the ring / the hybrid's ring)."""
    opts = AttentionOptions(causal=True, scale=1.0, cu_seqlens=(0, 48, 72))
    assert block_hops(opts, 3, 24) == (1, 0, 0)  # rank 2 neither sends nor receives in either pass
    # the hybrid's ring over 3 super-ranks of 2 x 24 tokens: super-rank 2 idle
    super_opts = AttentionOptions(causal=True, scale=1.0, cu_seqlens=tuple(_idle_docs(6, 2)))
    assert block_hops(super_opts, 3, 48) == (1, 0, 0)
    assert _idle_docs(3) == [0, 48, 72] and _idle_docs(6, 2) == [0, 96, 144]


# The modes whose ring exchanges are point-to-point run with sends="late" (each send carries its buffer as
# at its wait(): the literal buffer rule); the others' asynchronous collectives are snapshot-checked.
SENDS = {"ring": "late", "hybrid": "late", "allgather": "checked", "ulysses": "checked"}


@pytest.mark.parametrize("mode, heads", [("ring", (4, 2, 8)), ("allgather", (4, 2, 8)), ("ulysses", (6, 3, 8))])
def test_modes_documents_windows_under_nccl_rules(dist_pool, mode: str, heads: tuple[int, int, int]) -> None:
    """World 3 (ring of 3 = hybrid 3 x 1): exact in every gradient, under the rules; the ring's sends
    carry their buffers as at their wait() (forward and backward)."""
    cases = _cases(3, mode, heads, 7000 + len(mode), _variants(3))
    out = dist_pool.run(3, _run_under_rules, store_port(), cases, 1, sends=SENDS[mode], timeout=300)
    _check_clean(out)
    check([o["results"] for o in out], cases, 3)


def test_hybrid_three_super_ranks_under_nccl_rules(dist_pool) -> None:
    """World 6 = 3 super-ranks x Ulysses 2: the issue's example and the rest of the matrix, exact."""
    cases = _cases(6, "hybrid", (4, 2, 6), 7100, _variants(6, 2))
    out = dist_pool.run(6, _run_under_rules, store_port(), cases, 2, sends=SENDS["hybrid"], timeout=400)
    _check_clean(out)
    check([o["results"] for o in out], cases, 6)


def _dilated_under_rules(rank: int, world: int, port: int, cases: list[dict]) -> dict:
    """Worker: dilated attention (segment exchanges among the few ranks of a segment) under the rules."""
    from seqpar.attn.dilated import dilated_attention

    store = _store(port, rank, world)
    with nccl_rules(store, prefix="dilated", sends="late") as rules:
        manager = seqpar.init_process_groups(sp_size=world)
        results = []
        for case in cases:
            q, k, v, dout = (case[n][:, :, rank * 8:(rank + 1) * 8].float() for n in ("q", "k", "v", "dout"))
            q, k, v = (t.requires_grad_() for t in (q, k, v))
            out = dilated_attention(q, k, v, **case["kwargs"], group=manager.sp_group)
            out.backward(dout)
            results.append([out.detach(), q.grad, k.grad, v.grad])
            dist.all_reduce(torch.ones(1), group=manager.sp_dp_group)
        first_ops, messages = list(rules.first_ops), len(rules.records)
        manager.destroy()
    return {"results": results, "error": None, "first_ops": first_ops, "messages": messages}


def test_dilated_under_nccl_rules(dist_pool) -> None:
    """Dilated attention at P = 3: segments inside a shard (no exchange), over one shard and over all
    three (segment exchanges that leave the other ranks idle), ring and all-gather, exact; sends carry
    their buffers as at their wait()."""
    from test_dilated_dist import PATTERNS, _make_case, _reference

    cases = [_make_case(7500 + i, 3, (6, 2), dict(segment_lengths=ws, dilation_rates=rs, causal=causal, mode=mode,
                                                  head_layout="mixed"))
             for i, ((ws, rs), mode, causal) in enumerate(itertools.product(PATTERNS[3], ("ring", "allgather"),
                                                                            (False, True)))]
    out = dist_pool.run(3, _dilated_under_rules, store_port(), cases, timeout=300)
    _check_clean(out)
    assert all(o["messages"] > 0 for o in out)  # the segment exchanges ran under the rules
    for idx, case in enumerate(cases):
        got = [torch.cat([out[r]["results"][idx][j] for r in range(3)], dim=2) for j in range(4)]
        for name, g, w in zip(("out", "dq", "dk", "dv"), got, _reference(case)):
            torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-5,
                                       msg=lambda m, n=name, kw=case["kwargs"]: f"{n} {kw}: {m}")


def test_rules_catch_groups_set_up_lazily(dist_pool) -> None:
    """The break: groups made without the eager set-up. The issue's example then waits in the ring
    group's set-up on super-ranks 0 and 1 (ranks 0-3), which name the missing super-rank 2 member;
    super-rank 2 (ranks 4, 5) never touches its ring group (in a training step it would then wait in the
    step's closing reduction for ranks 0-3: a hang on NCCL; the matrix tests above end every case so,
    and fail the same way on this break). A dense mask does not hang (every member
    exchanges at step 0: NCCL would cope, and the model agrees), but its ring groups are then set up
    by a point-to-point exchange, which the clean runs above never allow."""
    example = _cases(6, "hybrid", (4, 2, 6), 7200, [(None, _idle_docs(6, 2))])[:1]
    assert example[0]["causal"] and example[0]["sharding"] == "contiguous"
    # no step boundary: super-rank 2 would wait in it for the others, and the pool would have to be killed
    out = dist_pool.run(6, _run_under_rules, store_port(), example, 2, 8.0, True, boundary=False, timeout=300)
    for rank, o in enumerate(out):
        if rank < 4:
            assert o["error"] and "issued no operation on it" in o["error"], (rank, o["error"])
            assert f"ranks [{4 + rank % 2}]" in o["error"], (rank, o["error"])
        else:
            assert o["error"] is None, (rank, o["error"])
    dense = _cases(6, "hybrid", (4, 2, 6), 7300, [(None, None)])[:1]
    out = dist_pool.run(6, _run_under_rules, store_port(), dense, 2, 60.0, True, timeout=300)
    for o in out:
        assert o["error"] is None and any(what == P2P for _, what in o["first_ops"]), o
    check([o["results"] for o in out], dense, 6)


def test_rules_catch_a_reordered_batch(dist_pool) -> None:
    """The break: odd ranks post their ring batches in reverse order. gloo pairs by tag, so the results
    are still right; NCCL pairs by order, and the rules say so on every rank."""
    cases = _cases(2, "ring", (2, 1, 8), 7400, [(None, None)])[:1]
    out = dist_pool.run(2, _run_under_rules, store_port(), cases, 1, reorder=True, timeout=120)
    for o in out:
        assert o["error"] and "pairs messages by order" in o["error"], o["error"]


def _ring_backward_writes_early(rank: int, world: int, port: int, case: dict, sends: str = "checked") -> dict:
    """Worker: the ring with a stray write into every dK/dV accumulator right after it is posted (the
    break the backward's buffer reuse must never make); returns the rules' verdict on this rank and,
    when they raised nothing, its results."""
    import seqpar.attn.ring as ring_module

    store = _store(port, rank, world)
    exchange = ring_module._exchange

    def early_write(comm, tensors, out, channel, **kw):  # noqa: ANN001, ANN003, ANN202
        pending = exchange(comm, tensors, out, channel, **kw)
        if channel == 1 and kw.get("send", True):  # the travelling accumulators (ring._DKV), still in flight
            tensors[0].add_(0.5)
        return pending

    manager, error, results = None, None, []
    ring_module._exchange = early_write
    try:
        with nccl_rules(store, prefix="early-write", sends=sends):
            manager = seqpar.init_process_groups(sp_size=world)
            results = _attend(rank, world, case, manager)
    except NcclRuleError as e:
        error = str(e)
    finally:
        ring_module._exchange = exchange
    if manager is not None:
        manager.destroy()
    return {"error": error, "results": results}


def test_rules_catch_a_ring_backward_write_before_wait(dist_pool) -> None:
    """The backward reuses a sent accumulator only after its wait(); the break writes into it while in
    flight, and every rank that forwards an accumulator is stopped, naming the send."""
    case = _cases(3, "ring", (2, 1, 8), 7600, [(None, None)])[0]
    out = dist_pool.run(3, _ring_backward_writes_early, store_port(), case, timeout=120)
    for rank, o in enumerate(out):
        error = o["error"]
        assert error and "written between the post and its wait()" in error and "tag 16" in error, (rank, error)


def test_late_sends_make_a_write_before_wait_wrong(dist_pool) -> None:
    """The buffer rule literally (sends="late": a send carries its buffer as at its wait()): the same
    stray write into the accumulators in flight raises nothing, but the peers receive the written values
    and dK/dV no longer match the reference; without the write the same run matches (the matrix above)."""
    case = _cases(3, "ring", (2, 1, 8), 7600, [(None, None)])[0]
    out = dist_pool.run(3, _ring_backward_writes_early, store_port(), case, "late", timeout=120)
    assert all(o["error"] is None for o in out), [o["error"] for o in out]
    with pytest.raises(AssertionError, match=r"^d[kv] "):  # out and dq are right: only dK/dV travelled wrong
        check([[o["results"]] for o in out], [case], 3)


def _buffer_misuse(rank: int, world: int, port: int, misuse: str, sends: str = "checked") -> dict:
    """One ring exchange under the rules, with a send buffer written (``"write"``) or a receive buffer
    read (``"read"``) before ``wait()``, or neither (``"none"``)."""
    store = _store(port, rank, world)
    try:
        with nccl_rules(store, prefix=f"misuse-{misuse}", sends=sends) as rules:
            comm = RingComm(dist.group.WORLD)
            dist.barrier()  # the world's set-up (the pool's group exists already)
            mine = torch.full((3, 4), float(rank))
            pending = comm.exchange([mine])
            early = None
            if misuse == "write":
                mine.add_(10.0)  # e.g. accumulating into a buffer still on its way
            if misuse == "read":
                early = pending._received[0].clone()  # the receive buffer before wait()
            (got,) = pending.wait()
            assert rules.works and all(w.waited for w in rules.works)
    except NcclRuleError as e:
        # the rule error left this exchange's other work unwaited: finish it, and meet the peer, so that no
        # transfer of this task is still in flight when the pool's next task uses the same group (seen: the
        # next task's barrier hung in about half the runs)
        for work in rules.works:
            if not work.waited:
                work._work.wait()
        dist.barrier()
        return {"error": str(e)}
    dist.barrier()
    return {"error": None, "got": got, "early": early}


def test_rules_catch_buffers_used_before_wait(dist_pool) -> None:
    port = store_port()
    clean = dist_pool.run(2, _buffer_misuse, port, "none", timeout=60)
    for rank, o in enumerate(clean):
        assert o["error"] is None and torch.equal(o["got"], torch.full((3, 4), float(1 - rank)))
    written = dist_pool.run(2, _buffer_misuse, store_port(), "write", timeout=60)
    for o in written:
        assert o["error"] and "written between the post and its wait()" in o["error"], o
    read = dist_pool.run(2, _buffer_misuse, store_port(), "read", timeout=60)
    for rank, o in enumerate(read):  # a read before wait() sees poison, never the message
        assert o["error"] is None and torch.isnan(o["early"]).all() and torch.equal(o["got"], torch.full((3, 4), float(1 - rank)))


def test_late_sends_carry_the_buffer_at_wait(dist_pool) -> None:
    """sends="late": a send carries its buffer as at its wait(), so a write after the post reaches the
    peer (and is not flagged); an untouched buffer arrives as it was; receive buffers stay poisoned until
    wait()."""
    clean = dist_pool.run(2, _buffer_misuse, store_port(), "none", "late", timeout=60)
    for rank, o in enumerate(clean):
        assert o["error"] is None and torch.equal(o["got"], torch.full((3, 4), float(1 - rank)))
    written = dist_pool.run(2, _buffer_misuse, store_port(), "write", "late", timeout=60)
    for rank, o in enumerate(written):
        assert o["error"] is None and torch.equal(o["got"], torch.full((3, 4), float(1 - rank) + 10.0)), o
    read = dist_pool.run(2, _buffer_misuse, store_port(), "read", "late", timeout=60)
    for rank, o in enumerate(read):
        assert torch.isnan(o["early"]).all() and torch.equal(o["got"], torch.full((3, 4), float(1 - rank)))


def _halo_under_late_sends(rank: int, world: int, port: int, cases: list[dict]) -> dict:
    """Worker: the mixers' halo exchange (a short causal convolution, forward and backward) with every
    send carrying its buffer as at its wait()."""
    from seqpar.mixers.conv import causal_conv_shard
    from seqpar.sequence.sharding import shard_index

    store = _store(port, rank, world)
    results = []
    with nccl_rules(store, prefix="halo-late", sends="late") as rules:
        manager = seqpar.init_process_groups(sp_size=world)
        for case in cases:
            idx = shard_index(case["x"].shape[-1], rank, world, case["sharding"], cu_seqlens=case["cu"])
            x = case["x"][..., idx].clone().requires_grad_()
            weight = case["weight"].clone().requires_grad_()
            out = causal_conv_shard(x, weight, None, group=manager.sp_group, sharding=case["sharding"],
                                    cu_seqlens=case["cu"])
            out.backward(case["dout"][..., idx])
            results.append([out.detach(), x.grad, weight.grad])
        messages = len(rules.records)
        manager.destroy()
    return {"results": results, "messages": messages}


def test_halo_exchange_matches_with_late_sends(dist_pool) -> None:
    """The hybrid mixers' halo exchange (point to point, forward and backward: halo gradients sent home)
    under sends="late", dense and with documents crossing shards, contiguous and zigzag: exact."""
    from test_mixers_conv import reference_conv

    from seqpar.sequence.sharding import shard_index

    world, seq = 3, 36
    g = torch.Generator().manual_seed(7700)
    cases = []
    for sharding, cu in (("contiguous", None), ("zigzag", None), ("contiguous", [0, 5, 14, 30, 36]),
                         ("zigzag", [0, 2, 19, 36])):
        x, dout = torch.randn(2, 4, seq, generator=g, dtype=torch.float64), torch.randn(2, 4, seq, generator=g,
                                                                                        dtype=torch.float64)
        cases.append({"x": x, "dout": dout, "weight": torch.randn(4, 4, generator=g, dtype=torch.float64),
                      "sharding": sharding, "cu": cu})
    out = dist_pool.run(world, _halo_under_late_sends, store_port(), cases, timeout=180)
    assert all(o["messages"] > 0 for o in out)
    for i, case in enumerate(cases):
        x, w = case["x"].clone().requires_grad_(), case["weight"].clone().requires_grad_()
        ref = reference_conv(x, w, None, case["cu"])
        ref.backward(case["dout"])
        for rank in range(world):
            idx = shard_index(seq, rank, world, case["sharding"], cu_seqlens=case["cu"])
            got_out, got_dx, _ = out[rank]["results"][i]
            torch.testing.assert_close(got_out, ref.detach()[..., idx], rtol=1e-9, atol=1e-9)
            torch.testing.assert_close(got_dx, x.grad[..., idx], rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(sum(o["results"][i][2] for o in out), w.grad, rtol=1e-9, atol=1e-9)
