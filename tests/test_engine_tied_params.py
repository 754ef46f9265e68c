"""Parameters shared between modules under the engines (fuzzer cases of session 19, seed 2): FSDP2 over Zamba's
shared transformer block (one ``fully_shard`` over the modules that hold it, :func:`seqpar.integrations.fsdp.shard_groups`)
and tensor parallelism over tied input / output embeddings (:mod:`seqpar.integrations.tp`).

Each case is a fuzzer ``engine`` case run on the ``dist_pool`` ranks (the fuzzer's own runner, as a user wires
the engine) and judged by the fuzzer's rule: every parameter's reduced gradient, and the loss, against one
process in float64, each on its own scale (``seqpar.testing.fuzz_models.judge_model``).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch import nn

from seqpar.testing.fuzz_engines import engine_task
from seqpar.testing.fuzz_models import case_batches, judge_model, model_reference


def _engine_rank(rank, world, draws, batches, dtype_name):
    return engine_task(SimpleNamespace(rank=rank, world_size=world), draws, batches, dtype_name)


def _judge(dist_pool, draws: dict) -> None:
    batches = case_batches(draws)
    ref = model_reference(draws, batches)
    assert ref["ok"], ref["error"]
    per_rank = dist_pool.run(draws["world"], _engine_rank, draws, batches, ref["dtype"], timeout=240)
    for rank, out in enumerate(per_rank):
        assert out["ok"], (rank, out["error"])
    verdict, detail = judge_model(ref, per_rank[0])
    assert verdict == "exact", detail


_ZAMBA = {"kind": "engine", "model_type": "zamba", "engine": "fsdp2", "tp_size": 1, "world": 2, "mode": "ring",
          "ulysses_size": 1, "sharding": "zigzag", "batch": "packed", "lengths": [[5, 11], [9, 7]],
          "check_inputs": True, "case_seed": 1739095319}


@pytest.mark.timeout(600)
def test_fsdp2_zamba_shared_block_is_exact(dist_pool):
    """Zamba's hybrid layers 1 and 2 hold one transformer block's parameters (tied ``nn.Parameter`` objects in two
    ``shared_transf`` modules): FSDP2 shards them as one unit, and their gradient, the sum of both layers' uses,
    is exact; twice, with two forwards before one backward and non-reentrant checkpointing (the block's unit
    all-gathered and reduced across the two uses and the recomputation).

    Seen failing: with one ``fully_shard`` per block (``shard_groups`` returning ``[[b] for b in blocks]``, main
    before this fix) torch raises "Parameter 'model.layers.2.shared_transf.self_attn.q_proj.weight' is shared
    with a parameter already managed by another FSDP group" on every rank."""
    _judge(dist_pool, {**_ZAMBA, "checkpointing": None, "step": "one"})
    _judge(dist_pool, {**_ZAMBA, "checkpointing": "non-reentrant", "step": "two-forwards"})


class _Block(nn.Module):
    def __init__(self, shared: nn.Linear | None = None) -> None:
        super().__init__()
        self.own = nn.Linear(4, 4)
        self.proj = shared if shared is not None else nn.Linear(4, 4)


def test_shard_groups_units():
    """Which modules become one FSDP2 unit (no ranks needed): blocks tying a parameter go together, in model
    order; a block whose parameter is tied to a module outside every block is left to the enclosing unit (FSDP2
    manages a parameter in one unit only, so the root must hold both); nested blocks keep their order.

    Seen failing: without the leave-to-enclosing step (``dropped`` never filled) the block tied to ``head`` came
    back as a unit of its own; without the union (each block its own unit) ``[b1, b2]`` came back split."""
    from seqpar.integrations.fsdp import shard_groups

    b0 = _Block()
    b1 = _Block()
    b2 = _Block(shared=b1.proj)  # b1 and b2 hold one Linear (Zamba's layout: tied modules)
    b3 = _Block()
    model = nn.Module()
    model.layers = nn.ModuleList([b0, b1, b2, b3])
    model.head = nn.Linear(4, 4)
    model.head.weight = b3.own.weight  # tied outside the blocks
    blocks = list(reversed([b0, b1, b2, b3]))
    assert shard_groups(model, blocks) == [[b1, b2], [b0]]
    inner = _Block()
    outer = _Block()
    outer.inner = inner
    nested = nn.ModuleList([outer, _Block(shared=outer.proj)])
    assert shard_groups(nested, [inner, nested[1], outer]) == [[inner], [outer, nested[1]]]
