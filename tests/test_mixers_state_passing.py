"""seqpar.mixers.state_passing: each chunk's initial state from one all-gather of chunk summaries, against a
float64 token-by-token recurrence on the full sequence (restarting at every document), for a per-head
scalar decay (Mamba2 / lightning) and a per-head matrix transition (GDN / KDA), every sharding, 1, 2 and 4
ranks, with gradients of every input and the all-gather's bytes against theory."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from seqpar.mixers.state_passing import chunk_initial_states, chunk_resets, summary_bytes
from seqpar.sequence.sharding import chunk_ids, num_chunks
from seqpar.testing.traffic import counting

WORLD = dist.group.WORLD

# (seq, cu_seqlens): no documents; documents starting exactly at chunk starts and strictly inside chunks
# (at 2 and 4 ranks, contiguous and zigzag: chunks of 24, 12, 6 positions), one crossing several chunks.
CASES = [(48, None), (48, [0, 12, 13, 30, 48]), (48, [0, 5, 24, 47, 48])]


def _recurrence(decay: torch.Tensor, x: torch.Tensor, cu: list[int] | None, matrix: bool) -> torch.Tensor:
    """h_t = A_t h_{t-1} + x_t on the full sequence, h = 0 at every document start; returns every h_{t-1}
    (the state entering position t): ``(S, heads, d)`` (vector state) / ``(S, heads, d, e)``."""
    starts = set(cu[:-1]) if cu is not None else {0}
    h = torch.zeros_like(x[0])
    entering = []
    for t in range(x.shape[0]):
        if t in starts:
            h = torch.zeros_like(h)
        entering.append(h)
        h = (decay[t] @ h if matrix else decay[t][..., None] * h) + x[t]
    return torch.stack(entering)


def _local_summaries(decay: torch.Tensor, x: torch.Tensor, positions: list[int], cu: list[int] | None,
                     matrix: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk's (transition, final state from zero), scanned token by token over ``positions``."""
    starts = set(cu[:-1]) if cu is not None else {0}
    eye = torch.eye(decay.shape[-1], dtype=decay.dtype).expand_as(decay[0]) if matrix else torch.ones_like(decay[0])
    trans, h = eye, torch.zeros_like(x[0])
    for i, t in enumerate(positions):
        if t in starts and i > 0:
            h = torch.zeros_like(h)
        a = decay[t]
        trans = a @ trans if matrix else a * trans
        h = (a @ h if matrix else a[..., None] * h) + x[t]
    return trans, h


def _parity(rank: int, world: int, sharding: str, seq: int, cu: list[int] | None, matrix: bool) -> int:
    g = torch.Generator().manual_seed(3)
    heads, d, e = 2, 3, 2
    if matrix:
        decay = 0.4 * torch.randn(seq, heads, d, d, generator=g, dtype=torch.float64)
        x = torch.randn(seq, heads, d, e, generator=g, dtype=torch.float64)
    else:
        decay = torch.rand(seq, heads, generator=g, dtype=torch.float64)  # a per-head scalar decay
        x = torch.randn(seq, heads, d, generator=g, dtype=torch.float64)
    weights = torch.randn(seq, *x.shape[1:], generator=g, dtype=torch.float64)

    dr, xr = decay.clone().requires_grad_(), x.clone().requires_grad_()
    entering = _recurrence(dr, xr, cu, matrix)
    total = len(chunk_ids(0, world, sharding, seq_len=seq, cu_seqlens=cu)) * world
    c = seq // total
    chunk_starts = entering[::c]  # (total, ...): the state entering each global chunk
    if chunk_starts.requires_grad:  # not when every chunk starts a document
        (chunk_starts * weights[:total]).sum().backward()

    group = WORLD if world > 1 else None
    ds, xs = decay.clone().requires_grad_(), x.clone().requires_grad_()
    mine = chunk_ids(rank, world, sharding, seq_len=seq, cu_seqlens=cu)
    summaries = [_local_summaries(ds, xs, list(range(gid * c, (gid + 1) * c)), cu, matrix) for gid in mine]
    trans = torch.stack([t for t, _ in summaries])
    state = torch.stack([s for _, s in summaries])
    apply = (lambda t, h: t @ h) if matrix else (lambda t, h: t[..., None] * h)
    with counting(world) as traffic:
        init = chunk_initial_states(trans, state, apply=apply, group=group, sharding=sharding, seq_len=seq,
                                    cu_seqlens=cu)
    torch.testing.assert_close(init.detach(), torch.stack([chunk_starts[gid] for gid in mine]).detach(),
                               rtol=1e-12, atol=1e-12)
    if init.requires_grad:
        (init * torch.stack([weights[gid] for gid in mine])).sum().backward()
    for name, got, want in (("decay", ds.grad, dr.grad), ("x", xs.grad, xr.grad)):
        if want is None and got is None:  # the reference is global: the same on every rank
            continue
        want = torch.zeros_like(got) if want is None else want
        got = torch.zeros_like(want) if got is None else got.clone()
        if world > 1:
            dist.all_reduce(got)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=lambda m, n=name: f"grad {n}: {m}")
    if world > 1:  # one all-gather of every chunk's (transition, state) and nothing else: flat in S
        assert traffic.collectives == 1 and traffic.p2p_bytes == 0, traffic
        assert traffic.collective_bytes == summary_bytes(trans, state, world) == \
            (world - 1) * len(mine) * (trans[0].numel() + state[0].numel()) * 8, traffic
    return len(mine)


def test_chunk_resets() -> None:
    assert chunk_resets(4, 48, None) == ((True, False), (False, False), (False, False), (False, False))
    assert chunk_resets(4, 48, (0, 12, 13, 30, 48)) == ((True, False), (True, True), (False, True), (False, False))


@pytest.mark.parametrize("matrix", [False, True])
@pytest.mark.parametrize("seq,cu", CASES)
@pytest.mark.parametrize("sharding", ["contiguous", "zigzag"])
def test_one_process(sharding, seq, cu, matrix):
    assert _parity(0, 1, sharding, seq, cu, matrix) == (1 if sharding == "contiguous" else 2)


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_prefix_equals_the_full_recurrence(dist_pool, world):
    for sharding in ("contiguous", "zigzag", "balanced"):
        for seq, cu in CASES:
            for matrix in (False, True):
                got = dist_pool.run(world, _parity, sharding, seq, cu, matrix, timeout=300)
                assert got == [num_chunks(world, sharding, seq_len=seq) // world] * world


def test_summary_count_mismatch_is_refused():
    with pytest.raises(ValueError, match="one of each per local chunk"):
        chunk_initial_states(torch.zeros(2, 3), torch.zeros(1, 3), apply=lambda t, h: t * h, group=None,
                             sharding="zigzag", seq_len=8)
