"""The rank pool's guard (issue 28 §2): a task that patches a module and leaves the patch behind fails, by name,
instead of changing what every later test on the same ranks runs."""

from __future__ import annotations

import functools

import pytest

from seqpar.testing.ranks import RankFailed, RankPool


def _patch_and_forget(ctx) -> None:  # noqa: ANN001
    import seqpar.sequence.sharding as sharding

    sharding.shard_index = lambda *a, **k: None


def _patch_and_restore(ctx) -> str:  # noqa: ANN001
    import seqpar.sequence.sharding as sharding

    original = sharding.shard_index
    sharding.shard_index = lambda *a, **k: None
    try:
        return "ran"
    finally:
        sharding.shard_index = original


def _original_is_back(ctx) -> bool:  # noqa: ANN001
    import seqpar.sequence.sharding as sharding

    return sharding.shard_index.__module__ == "seqpar.sequence.sharding"


def _import_and_patch(ctx) -> None:  # noqa: ANN001
    import wave  # first imported here: the guard saw no "before", and cannot put it back

    wave.open = functools.partial(wave.open, mode="rb")


@pytest.mark.timeout(120)
def test_a_task_that_leaves_a_patch_fails_by_name():
    with RankPool(1, guard_modules=("seqpar.*", "wave"), timeout=60) as pool:
        assert pool.run(_patch_and_restore) == ["ran"]
        with pytest.raises(RankFailed, match=r"left module state changed.*\n.*seqpar\.sequence\.sharding\.shard_index") as e:
            pool.run(_patch_and_forget)
        assert e.value.usable and not pool.closed
        assert pool.run(_original_is_back) == [True]  # put back: later tasks run the real function
        # a task of a guarded package, first imported by the task with the neighbours it imports from (as the
        # benchmark suites' tasks are when they run on the test session's pools): the library's own, no patch
        from seqpar.bench.attention import BenchShape
        from seqpar.bench.memory import measure_peak

        assert pool.run(measure_peak, "sdpa", 8, True, BenchShape(q_heads=1, kv_heads=1, head_dim=4), 0)[0] > 0
        assert not pool.closed
        with pytest.raises(RankFailed, match=r"wave\.open \(imported by the task\) is functools\.partial"):
            pool.run(_import_and_patch)
        assert pool.recycled and pool.closed  # that module cannot be put back: fresh ranks next time


def _import_mixtral(ctx) -> None:  # noqa: ANN001
    import transformers.models.mixtral.modeling_mixtral  # noqa: F401 - loaded before the swap's task, as in a suite


def _swap_a_moe_model(ctx) -> bool:  # noqa: ANN001
    """The first swap of a MoE model on a rank puts seqpar's router-loss dispatcher into the model's
    transformers module, for the process's life (seqpar.swap.moe)."""
    import transformers

    import seqpar.swap.moe
    from seqpar.swap import swap_attention

    cfg = transformers.MixtralConfig(vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=2, num_local_experts=2,
                                     output_router_logits=True, use_cache=False)
    swap_attention(transformers.MixtralForCausalLM(cfg))
    import transformers.models.mixtral.modeling_mixtral as mixtral

    return mixtral.load_balancing_loss_func.__module__ == seqpar.swap.moe.__name__


@pytest.mark.timeout(120)
def test_seqpar_installing_its_own_dispatcher_is_not_a_leak():
    # Seen failing without the exemption: test_mixers_mamba.py run alone (its first Jamba swap on the pool)
    # "left module state changed ... modeling_jamba.load_balancing_loss_func"; in the full suite an earlier
    # task had installed it, so the guard's verdict depended on the order of the tests.
    with RankPool(1, guard_modules=("transformers.models.mixtral.*",), timeout=90) as pool:
        pool.run(_import_mixtral)
        assert pool.run(_swap_a_moe_model) == [True]
        assert not pool.closed


_ORPHAN_SCRIPT = """
import os, signal, sys
from seqpar.testing.ranks import RankPool
pool = RankPool(2, timeout=60)
print(" ".join(str(p) for p in pool.pids), flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # no close(), no atexit: the ranks are left to notice
"""


@pytest.mark.timeout(120)
def test_ranks_leave_when_the_process_that_started_them_is_killed() -> None:
    """A process that starts a rank pool and is killed (SIGKILL: a test runner's timeout, an OOM kill) cannot
    stop its ranks; they notice within ``OWNER_POLL_S`` that it is gone and exit, instead of waiting on their
    task queues for ever (daemonic processes are only reaped by an owner that exits normally).
    Seen failing: ``_next_task`` waiting with a plain ``tasks.get()`` (the orphaned ranks and their fork server
    kept the child's output pipes open: ``subprocess.run`` timed out after 90 s, and they were still running)."""
    import os
    import subprocess
    import sys
    import time

    from seqpar.testing.ranks import OWNER_POLL_S, owner_alive

    proc = subprocess.run([sys.executable, "-c", _ORPHAN_SCRIPT], capture_output=True, text=True, timeout=90)
    assert proc.returncode == -9, (proc.returncode, proc.stderr[-2000:])
    pids = [int(p) for p in proc.stdout.split()]
    assert len(pids) == 2 and all(p > 0 for p in pids), proc.stdout
    deadline = time.monotonic() + max(30.0, 10 * OWNER_POLL_S)
    while time.monotonic() < deadline and any(owner_alive(p) for p in pids):
        time.sleep(0.2)
    alive = [p for p in pids if owner_alive(p)]
    for p in alive:  # don't leak them from the test either
        os.kill(p, 9)
    assert not alive, f"ranks {alive} outlived their pool's owner"


def _compile_with_a_break_in_seqpar(ctx) -> tuple[int, ...]:  # noqa: ANN001
    """Compiled: seqpar's host copy of a boundary tensor, a graph break inside ``seqpar.sequence.boundaries``, where
    dynamo installs the frame's resume function as a module global (``__resume_at_...``)."""
    import torch

    from seqpar.sequence.boundaries import host_boundaries

    torch._dynamo.reset()
    return torch.compile(lambda t: host_boundaries(t * 1), backend="eager")(torch.tensor([0, 3, 8]))


def _reset_dynamo(ctx) -> str:  # noqa: ANN001
    import torch

    torch._dynamo.reset()  # deletes the resume functions an earlier task's compile installed
    return "reset"


@pytest.mark.timeout(120)
def test_dynamo_generated_module_globals_are_no_patch():
    """dynamo's own module globals (a graph break's ``__resume_at_*`` function, installed in the module of the frame
    it resumes, and deleted by ``torch._dynamo.reset()``) change by design: a task whose reset deletes those of an
    earlier task's compile is no patch left behind.

    Seen failing: without the guard's dynamo exclusion (seqpar/testing/ranks.py ``_module_state``): "the task left
    module state changed on rank 0 ... seqpar.sequence.boundaries.__resume_at_... is deleted" (CI's compile stage,
    session 30: tests/test_compile_traced_plans.py's reset after another test's compile on the same rank)."""
    with RankPool(1, guard_modules=("seqpar.*",), timeout=60) as pool:
        assert pool.run(_compile_with_a_break_in_seqpar) == [(0, 3, 8)]
        assert pool.run(_reset_dynamo) == ["reset"]
        assert not pool.closed


def _mark_or_read(rank: int, world: int, mark: bool) -> tuple[int, bool]:
    import os
    import sys

    if mark:
        sys.seqpar_pool_mark = True  # data left on the rank's interpreter: what the guard does not see
    return os.getpid(), getattr(sys, "seqpar_pool_mark", False)


@pytest.mark.timeout(120)
def test_a_fresh_run_starts_new_ranks(dist_pool) -> None:
    """``dist_pool.run(..., fresh=True)`` runs on newly started interpreters (a measurement that must not see earlier
    tasks' leftovers). Seen failing with ``PoolSet.restart`` a no-op: the same pids and the mark still set."""
    first = dist_pool.run(2, _mark_or_read, True)
    kept = dist_pool.run(2, _mark_or_read, False)
    fresh = dist_pool.run(2, _mark_or_read, False, fresh=True)
    assert kept == first and all(marked for _, marked in kept)
    assert not {pid for pid, _ in fresh} & {pid for pid, _ in first}, (first, fresh)
    assert not any(marked for _, marked in fresh), fresh
