"""The fuzzer's model cases sum each parameter's gradient over the SP ranks
(:func:`seqpar.testing.fuzz_models.sp_summed_grads`); which parameters have a gradient may differ by rank.

Fuzzer case 1535814214 (tiny LongCat-Flash, P = 2, also pinned in tests/test_fuzz.py): every token of rank 1's
shard went to a zero-computation expert in layer 0, so that rank's expert weights had no gradient; the harness
all-reduced only the gradients each rank had, the two ranks' collectives no longer matched, and gloo aborted
rank 1 ("Received data size doesn't match expected size"). Not a seqpar error: the model under seqpar was
exact once the harness summed a missing gradient as zeros.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn


def _uneven_task(rank: int, world: int) -> dict:
    """Every rank: ``a`` used on every rank, ``b`` on rank 0 only, ``c`` on none; their SP-summed gradients."""
    import seqpar
    from seqpar.testing.fuzz_models import sp_summed_grads

    manager = seqpar.init_process_groups(config={"size": world})
    try:
        torch.manual_seed(0)
        model = nn.ModuleDict({"a": nn.Linear(3, 3), "b": nn.Linear(3, 3), "c": nn.Linear(3, 3)})
        x = torch.full((2, 3), float(rank + 1))
        y = model["a"](x)
        if rank == 0:
            y = y + model["b"](x)
        y.square().sum().backward()
        return sp_summed_grads(model, manager.sp_group)
    finally:
        manager.destroy()


@pytest.mark.timeout(120)
def test_gradient_missing_on_some_ranks_sums_as_zero(dist_pool) -> None:
    """Two ranks, ``b`` used on rank 0 only: the sum has ``b``'s rank-0 gradient (rank 1 adds zeros), ``a``
    both ranks' gradients, and ``c`` (used nowhere) no entry, on both ranks alike.

    Seen failing: with presence decided on each rank alone (the all-reduce of ``present`` removed), the ranks'
    all-reduces mismatched: once rank 1 raised in the pool task, twice both ranks hung until the task's timeout.
    """
    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.Linear(3, 3), "b": nn.Linear(3, 3), "c": nn.Linear(3, 3)})
    for rank in range(2):
        x = torch.full((2, 3), float(rank + 1))
        y = model["a"](x)
        if rank == 0:
            y = y + model["b"](x)
        y.square().sum().backward()  # accumulates: the sum over both ranks' inputs, each its own backward
    want = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert sorted(want) == ["a.bias", "a.weight", "b.bias", "b.weight"]
    for got in dist_pool.run(2, _uneven_task, timeout=30):
        assert sorted(got) == sorted(want)
        for name, g in want.items():
            torch.testing.assert_close(got[name], g, rtol=1e-6, atol=0.0)
