"""shard_sequence / gather_sequence / shard_index: layouts, round trips, gradients, bad input."""

from __future__ import annotations

import pytest
import torch

import seqpar
from seqpar.sequence.sharding import chunk_ids, pad_to_multiple, shard_index

SHARDINGS = ("contiguous", "zigzag")


def expected_positions(seq: int, rank: int, world: int, sharding: str) -> list[int]:
    """Written out from the documented layout, independently of shard_index."""
    if sharding == "contiguous":
        c = seq // world
        return list(range(rank * c, (rank + 1) * c))
    c = seq // (2 * world)
    return list(range(rank * c, (rank + 1) * c)) + list(
        range((2 * world - 1 - rank) * c, (2 * world - rank) * c)
    )


def _round_trip(
    rank: int, world: int, full: torch.Tensor, dim: int, sharding: str, grad_reduction: str
) -> dict:
    x = full.clone().requires_grad_()
    shard = seqpar.shard_sequence(x, dim, group=torch.distributed.group.WORLD, sharding=sharding)
    # every rank applies the same weights to the gathered tensor: the loss is replicated
    w = torch.arange(full.numel(), dtype=full.dtype).view(full.shape).sin()
    gathered = seqpar.gather_sequence(shard, dim, group=torch.distributed.group.WORLD, sharding=sharding, grad_reduction=grad_reduction)
    (gathered * w).sum().backward()
    # the same with grad_reduction left out: the documented default is "slice"
    x_default = full.clone().requires_grad_()
    shard = seqpar.shard_sequence(x_default, dim, group=torch.distributed.group.WORLD, sharding=sharding)
    (seqpar.gather_sequence(shard, dim, group=torch.distributed.group.WORLD, sharding=sharding) * w).sum().backward()
    return {"shard": shard.detach(), "gathered": gathered.detach(), "grad": x.grad, "grad_default": x_default.grad}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shard_gather_round_trip_and_grads(dist_pool, world: int) -> None:
    for sharding in SHARDINGS:
        for dim, shape in (
            (1, (2, 12 * world, 3)),
            (2, (2, 3, 12 * world, 5)),
            (-2, (3, 12 * world, 4)),
        ):
            full = torch.randn(shape, dtype=torch.float64)
            w = torch.arange(full.numel(), dtype=full.dtype).view(full.shape).sin()
            seq = full.shape[dim]
            for grad_reduction in ("slice", "sum"):
                res = dist_pool.run(world, _round_trip, full, dim, sharding, grad_reduction)
                grads = torch.zeros_like(full)
                for rank, r in enumerate(res):
                    pos = torch.tensor(expected_positions(seq, rank, world, sharding))
                    assert shard_index(seq, rank, world, sharding).tolist() == pos.tolist()
                    torch.testing.assert_close(
                        r["shard"], full.index_select(dim, pos), rtol=0, atol=0
                    )
                    torch.testing.assert_close(r["gathered"], full, rtol=0, atol=0)
                    grads += r["grad"]
                    # Seen failing: gather_sequence's default grad_reduction "sum" instead of "slice" (every
                    # replicated loss's gradient P times too large), which no test passing it explicitly saw
                    torch.testing.assert_close(r["grad_default"], r["grad"] / (1 if grad_reduction == "slice" else world),
                                               msg=f"default grad_reduction {sharding} dim={dim}")
                # 'slice': each rank's grad is w at its own positions -> summed over ranks = w.
                # 'sum': each rank's loss is a separate term -> summed grads = P * w.
                scale = 1 if grad_reduction == "slice" else world
                torch.testing.assert_close(
                    grads, scale * w, msg=f"{sharding} dim={dim} {grad_reduction}"
                )


def _gather_error(x: torch.Tensor) -> str:
    """The ValueError ``gather_sequence(x, 1)`` raises on this rank ("" if none)."""
    try:
        seqpar.gather_sequence(x, 1, group=torch.distributed.group.WORLD)
    except ValueError as e:
        return str(e)
    return ""


def _bad_gather(rank: int, world: int) -> str:
    return _gather_error(torch.randn(2, 4 if rank == 0 else 6, 3))


def test_gather_with_unequal_shards_fails_on_every_rank(dist_pool) -> None:
    for msg in dist_pool.run(2, _bad_gather, timeout=60):
        assert "different lengths" in msg and "[4, 6]" in msg


def _bad_shard(rank: int, world: int, seq: int, sharding: str) -> str:
    try:
        seqpar.shard_sequence(torch.randn(1, seq, 2), 1, group=torch.distributed.group.WORLD, sharding=sharding)
    except ValueError as e:
        return str(e)
    return ""


def test_indivisible_length_names_the_fix(dist_pool) -> None:
    msgs = dist_pool.run(2, _bad_shard, 7, "contiguous")
    assert all("sequence length 7" in m and "pad it to a multiple of 2" in m for m in msgs), msgs
    msgs = dist_pool.run(2, _bad_shard, 6, "zigzag")
    assert all("multiple of 4" in m and "sharding='contiguous'" in m for m in msgs), msgs


def test_single_process_and_padding() -> None:
    x = torch.randn(2, 6, 3)
    assert seqpar.shard_sequence(x, 1) is x or torch.equal(seqpar.shard_sequence(x, 1), x)
    assert torch.equal(seqpar.gather_sequence(x, 1), x)
    padded = pad_to_multiple(x, 1, 4, value=-1.0)
    assert (
        padded.shape == (2, 8, 3) and torch.equal(padded[:, :6], x) and (padded[:, 6:] == -1).all()
    )
    assert chunk_ids(1, 3, "zigzag") == [1, 4]
    with pytest.raises(ValueError, match="striped"):
        chunk_ids(0, 2, "striped")


# ------------------------------------------------------------------ collectives


def _collectives(rank: int, world: int, xs: torch.Tensor, ws: torch.Tensor, dim: int, compiled: bool = False) -> dict:
    from seqpar.comm import all_gather, reduce_scatter

    if compiled:  # traced, the ops are torch's functional collectives; fullgraph: any graph break is an error
        torch._dynamo.reset()
        all_gather, reduce_scatter = (torch.compile(f, fullgraph=True, backend="aot_eager")
                                      for f in (all_gather, reduce_scatter))
    out, d = {}, dim % xs[rank].dim()
    # reduce_scatter: rank r feeds xs[r] (.., world * n, ..) and weighs its block with ws[r]
    x = xs[rank].clone().requires_grad_()
    y = reduce_scatter(x, dim, group=torch.distributed.group.WORLD)
    (y * ws[rank].narrow(dim, 0, y.shape[dim])).sum().backward()
    out["rs"], out["rs_grad"] = y.detach(), x.grad
    # all_gather of this rank's block, both backward rules
    for rule in ("slice", "sum"):
        part = xs[rank].narrow(d, 0, xs.shape[d + 1] // world).clone().requires_grad_()
        full = all_gather(part, dim, group=torch.distributed.group.WORLD, grad_reduction=rule)
        (full * ws[rank]).sum().backward()
        out[f"ag_{rule}"], out[f"ag_{rule}_grad"] = full.detach(), part.grad
    return out


@pytest.mark.parametrize(("world", "compiled"), [(2, False), (3, False), (3, True)])
def test_collectives_and_their_dual_backwards(dist_pool, world: int, compiled: bool) -> None:
    """Eager, and compiled (``torch.compile(fullgraph=True)``: the functional collectives dynamo traces).
    Seen failing, compiled only: the traced "slice" rule without this rank's block spliced back in (no
    gradient reaches ``x``). Compiled on one dim only (each dim and rule is a compile)."""
    for dim in (-1,) if compiled else (1, -1):
        xs = torch.randn(world, 2, 3 * world, 4 * world, dtype=torch.float64)  # one input per rank
        ws = torch.randn_like(xs)
        d = dim % 3  # dim inside one rank's (2, 3w, 4w) tensor
        n = xs.shape[d + 1] // world
        res = dist_pool.run(world, _collectives, xs, ws, dim, compiled)
        total = xs.sum(0)
        blocks = [xs[r].narrow(d, 0, n) for r in range(world)]
        gathered = torch.cat(blocks, dim=d)
        for rank, r in enumerate(res):
            torch.testing.assert_close(r["rs"], total.narrow(d, rank * n, n))
            # backward of reduce-scatter = all-gather of every rank's upstream grad
            upstream = torch.cat([ws[q].narrow(d, 0, n) for q in range(world)], dim=d)
            torch.testing.assert_close(r["rs_grad"], upstream)
            for rule in ("slice", "sum"):
                torch.testing.assert_close(r[f"ag_{rule}"], gathered, rtol=0, atol=0)
            # slice: my block of my own upstream grad; sum: my block summed over every rank's
            torch.testing.assert_close(r["ag_slice_grad"], ws[rank].narrow(d, rank * n, n))
            torch.testing.assert_close(r["ag_sum_grad"], ws.sum(0).narrow(d, rank * n, n))


def _collectives_single(rank: int, world: int) -> bool:
    from seqpar.comm import all_gather, reduce_scatter

    x = torch.randn(2, 3)
    return all_gather(x, 0) is x and reduce_scatter(x, 1) is x


def test_collectives_are_identity_for_one_rank(dist_pool) -> None:
    assert dist_pool.run(1, _collectives_single) == [True]
    from seqpar.comm import all_gather

    with pytest.raises(ValueError, match="grad_reduction"):
        all_gather(torch.randn(2), 0, grad_reduction="mean")


# ------------------------------------------------------------------ groups and bad shapes


def _per_sp_group(rank: int, world: int, fulls: torch.Tensor, sharding: str) -> torch.Tensor:
    m = seqpar.init_process_groups(2)
    full = fulls[m.dp_rank]  # each SP group works on its own sequence
    shard = seqpar.shard_sequence(full, 1, sharding=sharding)  # default: the manager's SP group
    explicit = seqpar.shard_sequence(full, 1, group=m.sp_group, sharding=sharding)
    assert torch.equal(shard, explicit)
    return seqpar.gather_sequence(shard, 1, group=m.sp_group, sharding=sharding)


def test_each_sp_group_shards_and_gathers_its_own_sequence(dist_pool) -> None:
    fulls = torch.randn(2, 3, 8, 5)  # (dp, batch, seq, hidden)
    for sharding in SHARDINGS:
        res = dist_pool.run(4, _per_sp_group, fulls, sharding)
        for rank, gathered in enumerate(res):
            torch.testing.assert_close(gathered, fulls[rank // 2], rtol=0, atol=0)


def _bad_shape(rank: int, world: int) -> str:
    return _gather_error(torch.randn(2, 4, 3 if rank == 0 else 5))  # same length, different hidden size


def test_gather_with_unequal_shapes_fails_on_every_rank(dist_pool) -> None:
    for msg in dist_pool.run(2, _bad_shape, timeout=60):
        assert "differ outside dim 1" in msg and "[(2, 4, 3), (2, 4, 5)]" in msg, msg


# ------------------------------------------------------------------ one source for the sharding (issue 18)


def _declared_sharding(rank: int, world: int) -> dict:
    from torch.utils.data import DataLoader

    from seqpar.runtime.groups import init_process_groups, set_default_manager
    from seqpar.sequence.batch import ShardedDataLoader, shard_batch
    from seqpar.sequence.loss import sequence_parallel_causal_lm_loss
    from seqpar.sequence.sharding import gather_sequence, shard_sequence

    full = torch.arange(2 * 8, dtype=torch.float64).view(2, 8)  # (batch, seq)
    batch = {"input_ids": torch.arange(8).view(1, 8), "labels": torch.arange(8).view(1, 8)}
    out: dict = {}

    # undeclared: each call's argument wins, none means contiguous (as before)
    m = init_process_groups(world)
    out["undeclared"] = m.sharding
    out["undeclared_default"] = shard_sequence(full, 1).tolist()
    out["undeclared_zigzag"] = shard_sequence(full, 1, sharding="zigzag").tolist()
    out["undeclared_batch"] = shard_batch(batch)["input_ids"].tolist()
    m.destroy()

    # declared by the argument: binds every default; a contradicting argument raises
    m = init_process_groups(world, sharding="zigzag")
    out["declared"] = m.sharding
    out["declared_default"] = shard_sequence(full, 1).tolist()
    out["declared_round_trip"] = gather_sequence(shard_sequence(full, 1), 1).equal(full)
    out["declared_batch"] = shard_batch(batch)["input_ids"].tolist()
    out["declared_loader"] = ShardedDataLoader(DataLoader([batch["input_ids"][0]] * 2, batch_size=1)).sharding
    errors = []
    for call in (lambda: shard_sequence(full, 1, sharding="contiguous"),
                 lambda: shard_batch(batch, sharding="contiguous"),
                 lambda: gather_sequence(full[:, :4], 1, sharding="contiguous"),
                 lambda: ShardedDataLoader(DataLoader([0], batch_size=1), sharding="contiguous"),
                 lambda: sequence_parallel_causal_lm_loss(torch.zeros(1, 4, 3), torch.zeros(1, 4, dtype=torch.long),
                                                          sharding="contiguous")):
        with pytest.raises(ValueError) as info:
            call()
        errors.append(str(info.value))
    out["errors"] = errors
    m.destroy()

    # declared by the config (a dict, as swap_attention takes it); an argument that contradicts it raises
    m = init_process_groups(config={"size": world, "sharding": "zigzag"})
    out["from_config"] = m.sharding
    m.destroy()
    with pytest.raises(ValueError) as info:
        init_process_groups(config={"size": world, "sharding": "zigzag"}, sharding="contiguous")
    out["conflict"] = str(info.value)
    set_default_manager(None)
    return out


def test_a_declared_sharding_binds_and_undeclared_behaves_as_before(dist_pool) -> None:
    for rank, out in enumerate(dist_pool.run(2, _declared_sharding)):
        contiguous = [list(range(8 * b + 4 * rank, 8 * b + 4 * rank + 4)) for b in range(2)]
        zigzag_ids = [[0, 1, 6, 7], [2, 3, 4, 5]][rank]
        zigzag = [[8 * b + i for i in zigzag_ids] for b in range(2)]
        assert out["undeclared"] is None
        assert out["undeclared_default"] == contiguous and out["undeclared_zigzag"] == zigzag
        assert out["undeclared_batch"] == [contiguous[0]]
        assert out["declared"] == "zigzag" and out["declared_default"] == zigzag and out["declared_round_trip"]
        assert out["declared_batch"] == [zigzag[0]] and out["declared_loader"] == "zigzag"
        assert len(out["errors"]) == 5
        for where, message in zip(("shard_sequence", "shard_batch", "gather_sequence", "ShardedDataLoader",
                                   "sequence_parallel_causal_lm_loss"), out["errors"]):
            assert message.startswith(f"{where}: sharding='contiguous' contradicts the run's declared sharding "
                                      "'zigzag'"), message
        assert out["from_config"] == "zigzag"
        assert "contradicts the config's sequence_parallel.sharding 'zigzag'" in out["conflict"]
