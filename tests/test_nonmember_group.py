"""A process group this rank is not in, passed to seqpar's other entry points (``seqpar.attention`` has its own test,
tests/test_usr34_migrating_user.py): ``dist.new_group([0])`` made on every rank, passed on every rank. torch gives rank
1 a size of -1 and returns at once from collectives over the group there, so before, on rank 1, ``shard_sequence``
failed on ``narrow(): length must be non-negative``, ``gather_sequence`` on torch's "Invalid process group",
``shard_batch`` on a range's step sign, and ``dilated_attention`` and ``sequence_parallel_mean`` returned this rank's
values as if reduced (silently). Now every one is refused by ``resolve_group`` naming the problem and the fix; rank 0,
a member, runs its one-rank call. P = 2 over gloo (the pool's harness: its timeout turns a hang into a failure).

Seen failing: with ``_not_a_member`` returning False, rank 1 got the five old outcomes above."""

from __future__ import annotations

import torch
import torch.distributed as dist

import seqpar


def _entry_points(rank: int, world: int) -> dict[str, str]:
    from seqpar.sequence.loss import sequence_parallel_mean
    from seqpar.sequence.sharding import gather_sequence, shard_sequence

    g = dist.new_group([0])  # every rank makes every group (torch's rule)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 8, 4, dtype=torch.float64, generator=gen)
    q, k, v = (torch.randn(1, 2, 8, 4, dtype=torch.float64, generator=gen) for _ in range(3))
    calls = {
        "shard_sequence": lambda: shard_sequence(x, dim=1, group=g),
        "gather_sequence": lambda: gather_sequence(x, dim=1, group=g),
        "shard_batch": lambda: seqpar.shard_batch({"input_ids": torch.ones(1, 8, dtype=torch.long)}, group=g),
        "dilated_attention": lambda: seqpar.dilated_attention(q, k, v, segment_lengths=[8], dilation_rates=[1],
                                                              group=g),
        "sequence_parallel_mean": lambda: sequence_parallel_mean(torch.tensor(3.0, dtype=torch.float64),
                                                                 torch.tensor(2), group=g),
    }
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = "ran"
        except ValueError as e:
            out[name] = str(e)
    return out


def test_a_rank_outside_the_group_is_refused_at_every_entry_point(dist_pool) -> None:
    member, outsider = dist_pool.run(2, _entry_points, timeout=120)
    assert set(member.values()) == {"ran"}, member  # a one-rank group: its own call
    for name, msg in outsider.items():
        assert "global rank 1" in msg and "not in" in msg and "sp_group" in msg, (name, msg)


def _compiled_attention(rank: int, world: int) -> str:
    g = dist.new_group([0])
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 8, 4, generator=gen) for _ in range(3))
    compiled = torch.compile(lambda a, b, c: seqpar.attention(a, b, c, causal=True, group=g), fullgraph=True,
                             backend="eager")
    try:
        out = compiled(q, k, v)
    except ValueError as e:
        return str(e)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # a one-rank group
    return "ran" if torch.allclose(out, want, rtol=1e-5, atol=1e-6) else "wrong"


def test_a_compiled_call_outside_the_group_is_refused(dist_pool) -> None:
    """The same refusal inside ``torch.compile(fullgraph=True)``: dynamo folds the membership lookup at trace time.
    Seen failing with the check skipped while compiling (as it was): rank 1 got dynamo's ``Unsupported`` wrapping
    ``AttributeError('group_name')`` from inside the attention, which names neither the group nor the fix."""
    member, outsider = dist_pool.run(2, _compiled_attention, timeout=240)
    assert member == "ran", member
    assert "global rank 1" in outsider and "not in" in outsider and "sp_group" in outsider, outsider
