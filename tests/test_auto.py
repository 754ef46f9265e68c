"""mode="auto" and ulysses_size="auto": the cost model picks the lowest modelled cost among the modes that
would not fail (head-count rule, the manager's axes, features used), the same on every rank and on every
call (activation-checkpoint recompute included), logged once; its byte counts are the counted ones."""

from __future__ import annotations

import itertools
import logging
from dataclasses import replace

import pytest
import torch
from test_attention import make_case, reference, shard_rows, unshard_rows
from test_ulysses import _count_all_to_all

import seqpar
from seqpar.attn.choose import (
    MODE_FEATURES,
    CallShape,
    Links,
    allowed_modes,
    choose_ulysses_size,
    mode_costs,
    rank_modes,
    ulysses_heads_ok,
)
from seqpar.attn.ulysses import head_split

LINKS = (Links(), Links(inter_gbps=5.0), Links(intra_gbps=20.0, inter_gbps=20.0, node_size=4), Links(flops=1e11))


def test_choice_is_the_cheapest_valid_mode() -> None:
    """Over a sweep of shapes, links and features: the first ranked mode has the lowest modelled time of
    all allowed modes, and it never breaks the head-count rule, the manager's axes or a feature."""
    seen = set()
    for (hq, hkv), p, links, feats, causal in itertools.product(
        ((4, 4), (6, 1), (28, 4), (32, 8), (64, 8), (12, 3)), (2, 4, 8, 16), LINKS,
        ((), ("dilated",), ("documents",)), (False, True),
    ):
        for u in (d for d in range(1, p + 1) if p % d == 0):
            c = CallShape(1, hq, hkv, 32768 // p, 128, 2, causal, p, u)
            ranked = rank_modes(c, links, feats)
            allowed = allowed_modes(c, feats)
            assert [m.mode for m in ranked] == sorted(allowed, key=[m.mode for m in ranked].index)
            if not ranked:
                assert "documents" in feats  # no mode supports documents yet
                continue
            best = ranked[0]
            assert best.seconds == min(m.seconds for m in mode_costs(c, links, allowed))
            assert set(feats) <= MODE_FEATURES[best.mode]
            if best.mode == "ulysses":
                head_split(hq, hkv, p, sp_size=p, mode="ulysses")  # would not raise
            if best.mode == "hybrid":
                assert 1 < u < p
                head_split(hq, hkv, u, sp_size=p, mode="hybrid")
            seen.add(best.mode)
    assert seen == {"ring", "ulysses", "hybrid", "allgather"}, seen  # the sweep exercises every choice


def test_traced_choice_is_the_eager_choice() -> None:
    """While dynamo traces, mode='auto' picks through ``_cheapest_traced`` (one pass of comparisons, each a guard),
    eagerly through :func:`rank_modes`: over the sweep above (uneven head splits included: 28/4, 12/3, 6/1 on up
    to 16 ranks), the traced pick costs what the eager one does (the same mode but on sub-picosecond ties, which
    either side may settle), and it is empty exactly where nothing is allowed.

    Seen failing: the traced pass keeping the most expensive mode (``m.seconds < best.seconds`` -> ``>``);
    no compiled test outside CI's compile stage saw it."""
    from seqpar.attn.choose import _cheapest_traced

    for (hq, hkv), p, links, feats, causal in itertools.product(
        ((4, 4), (6, 1), (28, 4), (12, 3)), (2, 4, 8, 16), LINKS, ((), ("dilated",), ("documents",)), (False, True),
    ):
        for u in (d for d in range(1, p + 1) if p % d == 0):
            c = CallShape(1, hq, hkv, 32768 // p, 128, 2, causal, p, u)
            ranked, traced = rank_modes(c, links, feats), _cheapest_traced(c, links, feats)
            assert len(traced) == min(len(ranked), 1), (c, feats)
            if ranked:
                assert abs(traced[0].seconds - ranked[0].seconds) <= 1e-12, (c, traced, ranked[0])


def test_head_count_rule_and_axes() -> None:
    c = CallShape(1, 28, 4, 4096, 128, 2, True, 8, 8)  # Qwen2-7B at P = 8: 28 heads split 8 ways unevenly
    assert allowed_modes(c) == ["ring", "allgather", "ulysses"]
    c = CallShape(1, 6, 2, 4096, 128, 2, True, 8, 8)  # 6 query heads cannot feed 8 Ulysses ranks
    assert allowed_modes(c) == ["ring", "allgather"]
    c = CallShape(1, 28, 4, 4096, 128, 2, True, 8, 4)
    assert allowed_modes(c) == ["ring", "allgather", "ulysses", "hybrid"]
    c = CallShape(1, 6, 2, 4096, 128, 2, True, 8, 4)
    assert allowed_modes(c) == ["ring", "allgather", "hybrid"]
    assert not ulysses_heads_ok(6, 2, 3) and ulysses_heads_ok(6, 1, 3) and ulysses_heads_ok(8, 2, 4)


def test_a_given_head_chunks_rules_out_the_modes_it_does_not_divide() -> None:
    """An int ``head_chunks`` the caller gives must divide the K/V heads a Ulysses / hybrid rank holds, else that
    mode refuses the call: auto does not pick it (fz24c, fuzz case 74588220). "auto" head_chunks (resolved per mode)
    rules out nothing. Seen failing without the fix: ulysses and hybrid allowed with head_chunks=4 of 4 K/V heads."""
    c = CallShape(1, 4, 4, 4096, 128, 2, True, 4, 2, head_chunks=4, head_chunks_given=True)
    assert allowed_modes(c) == ["ring", "allgather"]  # a Ulysses rank holds 1 K/V head, a hybrid rank 2
    assert allowed_modes(replace(c, head_chunks=2)) == ["ring", "allgather", "hybrid"]
    assert allowed_modes(replace(c, head_chunks_given=False)) == ["ring", "allgather", "ulysses", "hybrid"]
    # uneven Ulysses (6 query / 6 K/V heads over 4 ranks): the largest rank's union of K/V heads, 2
    c = CallShape(1, 6, 6, 4096, 128, 2, True, 4, 4, head_chunks=2, head_chunks_given=True)
    assert allowed_modes(c) == ["ring", "allgather", "ulysses"]
    assert allowed_modes(replace(c, head_chunks=3)) == ["ring", "allgather"]


def test_slow_inter_node_link_favours_the_hybrid() -> None:
    """MHA, 32 heads, P = 16 over two 8-rank nodes on a 50 GB/s link: the ring's K/V steps are exposed,
    the hybrid's ring steps carry 8x the compute and hide; with one fast node (P = 8) Ulysses or ring."""
    slow = rank_modes(CallShape(1, 32, 32, 8192, 128, 2, True, 16, 8), Links())
    assert slow[0].mode == "hybrid" and slow[0].exposed_s < 0.01 * slow[0].seconds
    ring = next(m for m in slow if m.mode == "ring")
    assert ring.exposed_s > 0.3 * ring.seconds
    fast = rank_modes(CallShape(1, 32, 32, 4096, 128, 2, True, 8, 8), Links())
    assert fast[0].mode in ("ulysses", "ring")


def test_choose_ulysses_size() -> None:
    assert choose_ulysses_size(16, node_size=8) == 8
    assert choose_ulysses_size(8, heads=(28, 4), node_size=8) == 4
    assert choose_ulysses_size(8, heads=(6, 1), node_size=8) == 2
    assert choose_ulysses_size(4, node_size=1) == 1


def theory_bytes(mode: str, world: int, heads: tuple[int, int], u: int, dkv_bytes: int) -> int:
    """Bytes one rank sends in one forward + backward of :func:`test_ulysses._count_all_to_all`'s call
    (batch 2, 8 tokens a rank, head dim 16, fp32), by hand.

    Ulysses over ``u`` ranks (``u = P``; the hybrid's inner axis): to each of the other u - 1 ranks its tokens
    of that rank's heads, forward q, k, v (hq / u query and max(hkv / u, 1) kv heads each for K and V) then
    the output (hq / u), backward dout then dq, dk, dv: the same again. Ring over ``P / u`` (super-)ranks,
    each holding u x 8 tokens of max(hkv / u, 1) kv heads: P / u - 1 hops of its K and V forward, again
    backward, plus the dK/dV at ``dkv_bytes`` a value."""
    hq, hkv = heads
    tokens, d, elem = 2 * 8, 16, 4  # batch x seq_local, head dim, fp32
    kv_per = max(hkv // u, 1)
    a2a = 2 * (u - 1) * (hq // u + 2 * kv_per + hq // u) * tokens * d * elem  # forward + backward
    hops = world // u - 1
    kv_values = 2 * kv_per * u * tokens * d  # K and V of one (super-)rank
    ring = hops * kv_values * (elem + elem + dkv_bytes) if mode in ("ring", "hybrid") else 0
    return (a2a if mode != "ring" else 0) + ring


@pytest.mark.parametrize("world, heads, u, wire", [(2, (4, 4), None, "fp32"), (4, (8, 2), 2, "fp32"),
                                                    (4, (8, 2), 2, "bf16")])
def test_modelled_bytes_are_the_counted_bytes(dist_pool, world: int, heads: tuple[int, int], u: int | None,
                                              wire: str) -> None:
    """What the model charges a rank = what torch's entry points see leave it: all-to-all buffers less
    the slot a rank keeps, plus the hybrid ring's point-to-point bytes (its dK/dV in bf16 with the bf16
    wire: the model must not charge fp32 for them); and both = the hand-written :func:`theory_bytes` (the
    ring model too, at the same shape: a dense ring of P ranks), so model and code cannot agree on a wrong
    count. Seen failing (2026-11-29): ``_ring_cost`` counting ``world`` hops instead of ``world - 1``
    (``seqpar/attn/choose.py``) fails all three cases: the hybrid ones against theory (and against the
    counted bytes, which the old test saw too), the Ulysses one on the ring's theory (the old test passed it)."""
    got = dist_pool.run(world, _count_all_to_all, heads, 1, u, wire)
    dkv_bytes = 2 if wire == "bf16" else 4
    c = CallShape(2, heads[0], heads[1], 8, 16, 4, True, world, u or 1, dkv_bytes=dkv_bytes)
    mode = "ulysses" if u is None else "hybrid"
    (cost,) = mode_costs(c, Links(), [mode])
    slots = u or world
    want = theory_bytes(mode, world, heads, slots, dkv_bytes)
    assert cost.bytes_sent == want, (mode, cost, want)
    (ring,) = mode_costs(c, Links(), ["ring"])
    assert ring.bytes_sent == theory_bytes("ring", world, heads, 1, dkv_bytes), (ring, world, heads)
    for g in got:
        counted = sum(g["fwd"]["a2a"]) + sum(g["bwd"]["a2a"])
        assert counted * (slots - 1) // slots + g["fwd"]["p2p"] + g["bwd"]["p2p"] == want, (cost, g, want)


# ------------------------------------------------------------------------------ distributed
def _auto_calls(rank: int, world: int, case: dict, links: dict | None) -> dict:
    from torch.utils.checkpoint import checkpoint

    records: list[str] = []

    class Grab(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "seqpar auto: mode=" in record.getMessage():
                records.append(record.getMessage())

    handler = Grab()
    logger = logging.getLogger("seqpar")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        cfg = seqpar.SeqParConfig(size=world, ulysses_size=2, links=links)
        manager = seqpar.init_process_groups(config=cfg)
        q, k, v, dout = (shard_rows(case[n], rank, world, "zigzag").float() for n in ("q", "k", "v", "dout"))
        q, k, v = (t.requires_grad_() for t in (q, k, v))

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return seqpar.attention(q, k, v, causal=True, sharding="zigzag", mode="auto")

        out = checkpoint(attend, q, k, v, use_reentrant=False)  # backward re-runs attend: same choice
        out.backward(dout)
        again = attend(q.detach(), k.detach(), v.detach())
        assert torch.equal(again, out.detach())
        from seqpar.attn.choose import choose_mode

        chosen = choose_mode(q, k, world=world, manager=manager, causal=True, head_chunks=2)  # as attention resolves it
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    return {"results": [out.detach(), q.grad, k.grad, v.grad], "logs": records, "mode": chosen}


@pytest.mark.parametrize("links", [{"intra_gbps": 1e4, "inter_gbps": 1e-3, "node_size": 2, "flops": 1e9}, None])
def test_auto_is_exact_identical_on_every_rank_and_logged_once(dist_pool, links: dict | None) -> None:
    """P = 4 with a 2 x 2 grid. With configured links (a hopeless inter-node link, a fast node) auto must
    take the hybrid; with the probe (broadcast from rank 0) whatever it picks is the same on every rank."""
    case = make_case(77 if links else 78, 4, (4, 2, 16))
    per_rank = dist_pool.run(4, _auto_calls, case, links, timeout=240)
    modes = {r["mode"] for r in per_rank}
    assert len(modes) == 1, modes
    if links:
        assert modes == {"hybrid"}
    for r in per_rank:
        assert len(r["logs"]) == 1 and f"mode={next(iter(modes))!r}" in r["logs"][0], r["logs"]
    got = [unshard_rows([per_rank[r]["results"][j] for r in range(4)], 4, "zigzag") for j in range(4)]
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, reference(case, True, None)):
        torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-5, msg=lambda s, n=name: f"{n}: {s}")


def _auto_with_head_chunks(rank: int, world: int, case: dict, links: dict) -> dict:
    cfg = seqpar.SeqParConfig(size=world, ulysses_size=2, links=links)
    seqpar.init_process_groups(config=cfg)
    q, k, v, dout = (shard_rows(case[n], rank, world, "zigzag").float().requires_grad_() for n in ("q", "k", "v", "dout"))
    out = seqpar.attention(q, k, v, causal=True, sharding="zigzag", mode="auto", head_chunks=4)
    out.backward(dout)
    return {"results": [out.detach(), q.grad, k.grad, v.grad]}


def test_auto_with_a_given_head_chunks_runs_a_mode_that_takes_it(dist_pool) -> None:
    """P = 4, a 2 x 2 grid, 4 K/V heads, ``head_chunks=4``, links that make the hybrid the cheapest: the hybrid's
    ranks hold 2 K/V heads, which 4 passes do not divide, so auto picks a mode that takes the call; exact against
    float64 (fz24c: the fuzzer's case 74588220, auto picked Ulysses and refused "head_chunks=2 does not divide the 1
    K/V heads", a head_chunks the user gave for their 2). Seen failing without the fix: every rank raised "head_chunks=4
    does not divide the 2 K/V heads"."""
    case = make_case(79, 4, (4, 4, 16))
    links = {"intra_gbps": 1e4, "inter_gbps": 1e-3, "node_size": 2, "flops": 1e9}
    per_rank = dist_pool.run(4, _auto_with_head_chunks, case, links, timeout=240)
    got = [unshard_rows([per_rank[r]["results"][j] for r in range(4)], 4, "zigzag") for j in range(4)]
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, reference(case, True, None)):
        torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-5, msg=lambda s, n=name: f"{n}: {s}")


def test_docs_table_is_what_the_model_picks() -> None:
    """The table of auto's choices in docs/concepts.md is regenerated here from the model: it cannot go stale."""
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "concepts.md").read_text()
    rows = [line for line in page.splitlines() if line.startswith("| ") and " / " in line and "**" in line]
    settings = [(8, 131072), (16, 131072), (32, 524288)]
    assert len(rows) == 6, rows
    for line in rows:
        name_cell, *cells = [c.strip() for c in line.strip("|").split("|")]
        hq, hkv = (int(x) for x in name_cell.rsplit("(", 1)[1].rstrip(")").split(" / "))
        for cell, (p, s) in zip(cells, settings, strict=True):
            u = choose_ulysses_size(p, heads=(hq, hkv), node_size=8)
            best = rank_modes(CallShape(1, hq, hkv, s // p, 128, 2, True, p, u), Links())[0]
            assert cell.startswith(f"**{best.mode}**"), (name_cell, p, cell, best)
