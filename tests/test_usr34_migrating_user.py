"""A user coming from ring-flash-attn / DeepSpeed Ulysses passes a process group this rank is not a member of
(``group=dist.new_group([0])`` on every rank, say, meaning "the ranks that hold my sequence"): torch gives such a
rank a group size of -1, and the ring failed there on ``max() arg is an empty sequence``. Now that rank is refused
naming the problem and the fix; the member runs its one-rank call (its shard as the whole sequence), which is what
the group it passed says. At P = 2 over gloo (the pool's harness: its timeout turns a hang into a failure)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import seqpar


def _outside_the_group(rank: int, world: int) -> tuple[str, str, float]:
    g = dist.new_group([0])  # every rank makes every group (torch's rule)
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 6, 4, 8, generator=gen, dtype=torch.float64) for _ in range(3))  # bshd, 6 tokens
    try:
        out = seqpar.attention(q, k, v, causal=True, layout="bshd", group=g)
    except ValueError as e:
        return type(e).__name__, str(e), 0.0
    want = torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in (q, k, v)), is_causal=True).transpose(1, 2)
    return "", "", float((out - want).abs().max())


def test_a_rank_outside_the_group_it_passes_is_refused_by_name(dist_pool) -> None:
    (kind0, msg0, err0), (kind1, msg1, _) = dist_pool.run(2, _outside_the_group, timeout=120)
    assert kind0 == "" and err0 <= 1e-12, (kind0, msg0, err0)  # a one-rank group: its float64 reference
    assert kind1 == "ValueError", (kind1, msg1)
    assert "global rank 1" in msg1 and "not in" in msg1 and "sp_group" in msg1, msg1
