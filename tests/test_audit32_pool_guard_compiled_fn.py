"""The rank pool's module guard leaves out dynamo's ``__compiled_fn_*`` globals as well as its resume functions
(``seqpar.testing.ranks._DYNAMO_GLOBALS``): dynamo installs a compiled frame's graph function as a global of the
module the frame belongs to, through ``OutputGraph.install_global_unsafe`` -> ``CleanupHook.create`` (installed
torch: torch/_dynamo/output_graph.py:3434, utils.py:2469), and ``torch._dynamo.reset()`` deletes it. Audit 31 left
open whether a reset ever deletes one from a seqpar module (its test made a resume function only): it does, for any
seqpar function compiled as the top frame.
"""

from __future__ import annotations

import pytest

from seqpar.testing.ranks import RankPool


def _compile_a_seqpar_function(ctx) -> tuple[int, bool]:  # noqa: ANN001
    """``seqpar.sequence.sharding.pad_to_multiple`` compiled whole (its own frame: the graph function goes into
    that module's globals). Returns (the padded length, whether a ``__compiled_fn_*`` global is there)."""
    import torch

    from seqpar.sequence import sharding

    torch._dynamo.reset()
    out = torch.compile(sharding.pad_to_multiple, backend="eager", fullgraph=True)(torch.randn(5), 0, 4)
    return out.shape[0], any(k.startswith("__compiled_fn_") for k in vars(sharding))


def _reset_dynamo(ctx) -> bool:  # noqa: ANN001
    """Reset dynamo; whether a ``__compiled_fn_*`` global is left in the module (the premise: none)."""
    import torch

    from seqpar.sequence import sharding

    torch._dynamo.reset()
    return any(k.startswith("__compiled_fn_") for k in vars(sharding))


@pytest.mark.timeout(300)
def test_a_reset_deleting_a_compiled_function_global_is_no_patch() -> None:
    """One rank, the guard on seqpar: a task compiles a seqpar function (a ``__compiled_fn_*`` global appears in its
    module), the next resets dynamo (the global is deleted); neither is a patch left behind, the pool stays open.

    Seen failing (audit 32): ``_DYNAMO_GLOBALS`` cut to ``__resume_at_`` (P2, audit 31's open survivor): the guard
    names "seqpar.sequence.sharding.__compiled_fn_..." and closes the pool."""
    with RankPool(1, guard_modules=("seqpar.*",), timeout=120) as pool:
        assert pool.run(_compile_a_seqpar_function) == [(8, True)]
        assert pool.run(_reset_dynamo) == [False]
        assert not pool.closed
