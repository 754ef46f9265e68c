"""2-D hybrid (Ulysses x ring): the manager's two axes, exactness against a float64 single-process
reference at P = 4 as 2 x 2 (and the edge cases u = 1, u = P), bytes per axis, and errors."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from test_attention import make_case
from test_ulysses import (
    UNEVEN,
    _count_all_to_all,
    check_cases,
    check_uneven,
    run_cases,
    run_uneven,
    uneven_cases,
)

import seqpar

SHARDINGS = ("contiguous", "zigzag")


# ------------------------------------------------------------------------------ groups
def _members(group) -> list[int]:  # noqa: ANN001
    bits = torch.tensor([float(1 << dist.get_rank())], dtype=torch.float64)
    dist.all_reduce(bits, group=group)
    return [r for r in range(dist.get_world_size()) if int(bits.item()) >> r & 1]


def _describe(rank: int, world: int, sp: int, u: int) -> dict:
    m = seqpar.init_process_groups(sp_size=sp, ulysses_size=u)
    return {
        "ulysses": _members(m.ulysses_group), "ring": _members(m.ring_group), "sp": _members(m.sp_group),
        "sizes": (m.ulysses_size, m.ring_size, m.ulysses_rank, m.ring_rank),
        "ranks_in": (dist.get_rank(m.ulysses_group), dist.get_rank(m.ring_group)),
    }


@pytest.mark.parametrize("world, sp, u", [(4, 4, 2), (4, 2, 2), (4, 4, 1), (4, 4, 4)])
def test_ulysses_and_ring_groups(dist_pool, world: int, sp: int, u: int) -> None:
    """Ulysses groups = u consecutive SP ranks; ring groups = the SP ranks with the same Ulysses rank."""
    for rank, d in enumerate(dist_pool.run(world, _describe, sp, u)):
        sp_first = rank // sp * sp
        i = (rank - sp_first) % u
        g = (rank - sp_first) // u
        assert d["sp"] == list(range(sp_first, sp_first + sp))
        assert d["ulysses"] == list(range(sp_first + g * u, sp_first + (g + 1) * u)), d
        assert d["ring"] == list(range(sp_first + i, sp_first + sp, u)), d
        assert d["sizes"] == (u, sp // u, i, g) and d["ranks_in"] == (i, g), d


def _bad_sizes(rank: int, world: int) -> list[str]:
    messages = []
    for kwargs in ({"sp_size": 4, "ulysses_size": 3}, {"sp_size": 4, "ulysses_size": 0},
                   {"sp_size": 4, "ulysses_size": 2 if rank else 4}):
        with pytest.raises(ValueError) as e:
            seqpar.init_process_groups(**kwargs)
        messages.append(str(e.value))
    assert seqpar.default_manager() is None
    assert _members(None) == list(range(world))  # still in step
    return messages


def test_bad_ulysses_size_is_a_clear_error_on_every_rank(dist_pool) -> None:
    per_rank = dist_pool.run(4, _bad_sizes, timeout=60)
    for msgs in per_rank:
        assert msgs[0] == per_rank[0][0]
        assert "ulysses_size 3 does not divide sequence_parallel.size 4" in msgs[0] and "1, 2, 4" in msgs[0]
        assert "positive integer" in msgs[1]
        assert "different group sizes" in msgs[2] and "rank 0: sp_size=4, ulysses_size=4" in msgs[2]


def test_config_ulysses_size() -> None:
    from seqpar.config import ConfigError, SeqParConfig

    cfg = SeqParConfig.from_dict({"sequence_parallel": {"size": 4, "mode": "hybrid", "ulysses_size": 2}})
    assert (cfg.mode, cfg.ulysses_size) == ("hybrid", 2)
    assert SeqParConfig(size=8, ulysses_size="auto", mode="auto").ulysses_size == "auto"
    for bad in (3, 0, True, "2"):
        with pytest.raises(ConfigError, match="ulysses_size"):
            SeqParConfig(size=4, ulysses_size=bad)


# ------------------------------------------------------------------------------ exactness
@pytest.mark.parametrize("u", [2, 1, 4])
def test_hybrid_exact_fp32(dist_pool, u: int) -> None:
    """P = 4 as (4/u) x u: MHA, GQA, and K/V heads fewer than u (MQA); contiguous and zigzag; causal or not."""
    heads = ((4, 4, 24), (4, 2, 40), (6, 1, 20)) if u == 2 else ((4, 2, 40),)
    cases = []
    for i, (sharding, causal, h) in enumerate(itertools.product(SHARDINGS, (False, True), heads)):
        scale = 0.3 if h[2] == 40 else None
        cases.append((make_case(9000 + 10 * u + i, 4, h), "hybrid", sharding, causal, scale))
    check_cases(dist_pool.run(4, run_cases, cases, torch.float32, ulysses_size=u, timeout=240), cases, 4)


def test_hybrid_uneven_heads_exact_fp32(dist_pool) -> None:
    """P = 4 as 2 x 2 with head counts 2 does not split evenly (odd query heads; 6 on 3 K/V heads, whose
    middle head lives on both Ulysses ranks): rank i of every Ulysses group holds the same uneven share,
    so the ring across super-ranks runs on it unchanged (once per GQA-regular piece of the share).
    Documents, sinks, both shardings, causal and not; fp32 within 1e-5 of each tensor's own scale.

    Seen failing: a shared K/V head's dK taken from one Ulysses rank only (``.add_`` -> ``.copy_`` in
    _uneven_backward: dk off by 3.6 at a scale of 3.3, 5 query / 1 K/V head); every rank unpacking rank 0's
    share (``share(plan.rank)`` -> ``share(0)`` in _uneven_forward: ranks 1 and 3 raised)."""
    cases = uneven_cases(4, "hybrid", UNEVEN[2], 13000, u=2)
    check_uneven(dist_pool.run(4, run_uneven, cases, ulysses_size=2, timeout=300), cases, 4)


def test_hybrid_moves_the_theoretical_bytes(dist_pool) -> None:
    """2 x 2, 8 query / 2 K/V heads, zigzag causal: Ulysses all-to-alls as for u = 2, plus the ring across
    the 2 super-ranks: forward 1 K/V block of the super-rank (u tokens-worth, Hkv/u heads) each for K and
    V; backward the K/V again plus their fp32 dK/dV."""
    got = dist_pool.run(4, _count_all_to_all, (8, 2), 1, 2)
    tokens, d, elem = 2 * 8, 16, 4
    qkv = 2 * (4 + 2 * 1) * tokens * d * elem
    out = 8 * tokens * d * elem
    kv_block = 1 * 2 * tokens * d * elem  # one head, u * seq_local tokens, batch 2
    for r, g in enumerate(got):
        assert g["fwd"]["a2a"] == [qkv, out] and sorted(g["bwd"]["a2a"]) == sorted([out, qkv]), (r, g)
        assert g["fwd"]["p2p"] == 2 * kv_block, (r, g)
        assert g["bwd"]["p2p"] == 2 * kv_block + 2 * kv_block, (r, g)  # fp32 inputs: dK/dV as big as K/V


def test_super_ranks_are_a_valid_sharding_over_p_over_u() -> None:
    """The claim the hybrid rests on: the sorted chunks of u consecutive ranks under a sharding over P are
    exactly super-rank g's chunks of the same sharding over P/u (super-chunks of u chunks)."""
    from seqpar.attn.ulysses import sequence_order
    from seqpar.sequence.sharding import chunk_ids

    for p, sharding in itertools.product(range(1, 9), SHARDINGS):
        for u in (d for d in range(1, p + 1) if p % d == 0):
            for g in range(p // u):
                ids = [c for r in range(g * u, (g + 1) * u) for c in chunk_ids(r, p, sharding)]
                order = sequence_order(g * u, u, p, sharding) or list(range(len(ids)))
                got = [ids[i] for i in order]
                want = [s * u + j for s in chunk_ids(g, p // u, sharding) for j in range(u)]
                assert got == want, (p, u, g, sharding, got, want)
