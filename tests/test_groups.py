"""Process-group manager tests, and self-tests of the distributed harness."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import time
import types
import weakref

import pytest
import torch
import torch.distributed as dist

# ------------------------------------------------------------------ harness self-tests


def _rank_and_sum(rank: int, world_size: int, offset: int) -> tuple[int, float]:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return rank + offset, t.item()


def _raise_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        raise KeyError("boom from rank 1")
    return rank


def _sleep(rank: int, world_size: int, seconds: float) -> None:
    time.sleep(seconds)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_harness_returns_per_rank_values(dist_pool, world_size):
    out = dist_pool.run(world_size, _rank_and_sum, 10)
    total = float(sum(range(world_size)))
    assert out == [(r + 10, total) for r in range(world_size)]


def test_harness_rank_exception_surfaces_and_pool_survives(dist_pool):
    with pytest.raises(AssertionError) as info:
        dist_pool.run(2, _raise_on_rank_1)
    message = str(info.value)
    assert "rank 1" in message and "KeyError" in message and "boom from rank 1" in message
    assert "_raise_on_rank_1" in message  # the traceback, not just the message
    assert dist_pool.run(2, _rank_and_sum, 0) == [(0, 1.0), (1, 1.0)]


def test_harness_timeout_kills_and_restarts(dist_pool):
    dist_pool.run(2, _rank_and_sum, 0)  # pool up, so start-up time is not measured below
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="did not finish within"):
        dist_pool.run(2, _sleep, 60.0, timeout=1.0)
    assert time.monotonic() - start < 10.0
    assert dist_pool.run(2, _rank_and_sum, 0) == [(0, 1.0), (1, 1.0)]


def _leave_a_manager(rank: int, world: int) -> int:
    import seqpar

    seqpar.init_process_groups(sp_size=world)  # never destroyed, as a failing test would leave it
    return len(os.listdir("/proc/self/task"))


def _threads(rank: int, world: int) -> int:
    return len(os.listdir("/proc/self/task"))


def _assert_no_threads_left(dist_pool, task, *args, times: int, expect: list | None = None, **run_kwargs) -> None:
    """Runs ``task(rank, 2, *args)`` on 2 ranks ``times`` times between two thread counts of each rank: no rank
    may end with more than 2 threads over its count before (a gloo group that outlives its task keeps ~3 for
    good). ``expect``: what every run must return, when given; ``run_kwargs`` go to ``dist_pool.run``."""
    before = dist_pool.run(2, _threads)
    for _ in range(times):
        out = dist_pool.run(2, task, *args, **run_kwargs)
        assert expect is None or out == expect, out
    after = dist_pool.run(2, _threads)
    assert all(a <= b + 2 for a, b in zip(after, before)), (before, after)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_harness_destroys_groups_a_task_left_behind(dist_pool):
    # Each gloo group holds threads and sockets; a pool rank runs hundreds of tasks in a session, so the
    # groups one task leaves must not outlive it (the next task destroys them). Each manager here is 12 threads.
    dist_pool.run(2, _threads)  # warm-up: the pool started and what earlier tasks left cleaned up, before the count
    _assert_no_threads_left(dist_pool, _leave_a_manager, times=5)


class _Cycle:
    """Refers to itself: freed only by the cycle collector, which a quiet worker may not run for a long time."""

    def __init__(self, group) -> None:
        self.group, self.me = group, self


def _leave_a_group_in_a_cycle(rank: int, world: int) -> int:
    # A test that destroys its group but whose objects (a DeviceMesh, a manager, an exception's traceback
    # frames) still refer to it in a reference cycle: gloo's threads live as long as that python object.
    group = dist.new_group(list(range(world)))
    dist.all_reduce(torch.ones(1), group=group)
    dist.destroy_process_group(group)
    _Cycle(group)
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_harness_frees_groups_a_task_left_in_a_reference_cycle(dist_pool):
    dist_pool.run(2, _threads)  # warm-up: the pool started and what earlier tasks left cleaned up, before the count
    _assert_no_threads_left(dist_pool, _leave_a_group_in_a_cycle, times=5)


_KEPT: list = []  # a module-level reference on each rank: the clean-up cannot release what it holds


def _keep_a_group(rank: int, world: int) -> tuple[int, int]:
    group = dist.new_group(list(range(world)))
    dist.all_reduce(torch.ones(1), group=group)
    _KEPT.append(group)
    return os.getpid(), len(os.listdir("/proc/self/task"))


def _make_a_deepspeed_engine(rank: int, world: int, stage: int) -> list[weakref.ref]:
    # plain deepspeed.initialize, two steps: ZeRO-1/2/3 gradient hooks (held by torch in C++) keep the engine,
    # its optimizer and its groups alive, and ZeRO-3 leaves its model in module-level state (the second step
    # runs on the recorded trace, which fills the coordinator's cache of submodules)
    import deepspeed

    os.environ.setdefault("LOCAL_RANK", str(rank))  # what a launcher sets; DeepSpeed reads it
    deepspeed.init_distributed(dist_backend="gloo")
    cfg = {"train_micro_batch_size_per_gpu": 1, "train_batch_size": world, "steps_per_print": 10**6,
           "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
           "optimizer": {"type": "SGD", "params": {"lr": 0.01}}}
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    for step in range(2):
        engine.backward(engine(torch.randn(1, 4, generator=torch.Generator().manual_seed(rank + step))).sum())
        engine.step()
    return [weakref.ref(m) for m in model.modules()]


def _release_a_deepspeed_engine(rank: int, world: int, stage: int) -> bool:
    from seqpar.testing.deepspeed_teardown import released_deepspeed_engines

    with released_deepspeed_engines():
        modules = _make_a_deepspeed_engine(rank, world, stage)
    gc.collect()
    return all(m() is None for m in modules)  # nothing holds the model: not DeepSpeed's module state, not a hook


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
@pytest.mark.parametrize("stage", [2, 3])
def test_released_deepspeed_engines_free_their_threads(dist_pool, stage):
    # The task releases its engines itself (seqpar.testing.deepspeed_teardown); the pool only destroys the
    # groups left and collects cycles. An engine kept alive keeps DeepSpeed's groups: +9-15 threads a task.
    pytest.importorskip("deepspeed")
    assert dist_pool.run(2, _release_a_deepspeed_engine, stage, timeout=300) == [True, True]  # + one-time set-up
    _assert_no_threads_left(dist_pool, _release_a_deepspeed_engine, stage, times=3, expect=[True, True], timeout=300)


def test_deepspeed_teardown_refuses_unchecked_versions(monkeypatch):
    # The teardown reaches into DeepSpeed's private state, checked on DEEPSPEED_CHECKED only: any other
    # version fails loudly, on import and on use, naming both (no process, no real engine).
    import importlib.metadata
    import importlib.util
    import types

    from seqpar.testing import deepspeed_teardown

    low, high = deepspeed_teardown.DEEPSPEED_CHECKED
    deepspeed_teardown.check_deepspeed_version(low)
    deepspeed_teardown.check_deepspeed_version(high)

    class Engine:
        destroyed = False

        def destroy(self) -> None:
            self.destroyed = True

    for version in ("0.19.7", "0.20.0", "1.0.0"):
        monkeypatch.setitem(sys.modules, "deepspeed", types.SimpleNamespace(__version__=version))
        engine = Engine()
        with pytest.raises(RuntimeError, match=rf"checked on DeepSpeed {low}\.\.{high}; this is DeepSpeed {version}"):
            deepspeed_teardown.release_deepspeed_engine(engine)
        assert not engine.destroyed  # refused before touching anything
        # the module-level check: importing the module under an unchecked installed DeepSpeed raises
        monkeypatch.setattr(importlib.metadata, "version", lambda name, v=version: v)
        spec = importlib.util.spec_from_file_location("_teardown_copy", deepspeed_teardown.__file__)
        with pytest.raises(RuntimeError, match=f"this is DeepSpeed {version}"):
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
        monkeypatch.undo()


def test_gc_freeze_refuses_unchecked_pythons(monkeypatch):
    # The pool's clean-up freezes the collector's long-lived heap, a saving measured on the CPython versions in
    # GC_FREEZE_CHECKED only: any other fails loudly, naming both, before anything is frozen or a rank started.
    from seqpar.testing import ranks

    (low, high) = ranks.GC_FREEZE_CHECKED
    ranks.check_gc_freeze_version(low)
    ranks.check_gc_freeze_version(high)
    ranks.check_gc_freeze_version()  # this interpreter: the suite runs on a checked one
    for version in ((low[0], low[1] - 1), (high[0], high[1] + 1), (high[0] + 1, 0)):
        with pytest.raises(RuntimeError, match=rf"CPython {low[0]}\.{low[1]}\.\.{high[0]}\.{high[1]}; this is CPython "
                                               rf"{version[0]}\.{version[1]}\b.*GC_FREEZE_CHECKED"):
            ranks.check_gc_freeze_version(version)
    # on use: this interpreter taken out of the range, no freeze happens and no pool starts
    frozen = []
    monkeypatch.setattr(ranks.gc, "freeze", lambda: frozen.append(True))
    monkeypatch.setattr(ranks, "GC_FREEZE_CHECKED", ((2, 0), (2, 7)))
    with pytest.raises(RuntimeError, match="this is CPython"):
        ranks.freeze_long_lived_heap()
    assert not frozen
    with pytest.raises(RuntimeError, match="this is CPython"):
        ranks.RankPool(1)
    monkeypatch.undo()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_pool_recycles_ranks_whose_threads_pass_the_limit():
    from dist_harness import DistPool

    # An idle rank has ~7 threads; each group a task keeps adds ~3 for good. The pool checks at the start
    # of each task, after its clean-up, so the task after the one that passes 16 threads is the last there.
    pool = DistPool(max_threads=16)
    try:
        runs = [pool.run(2, _keep_a_group) for _ in range(7)]
        pids = [tuple(pid for pid, _ in run) for run in runs]
        threads = [max(n for _, n in run) for run in runs]
        assert pool.recycles == 1, (pids, threads)
        cut = pids.index(pids[-1])  # the first task on the fresh ranks
        assert pids[cut - 1] != pids[cut] and len(set(pids[:cut])) == 1, pids
        # the leak is real: +3 threads a task on the old ranks; it passed 16 at the start of the last task there
        assert all(b >= a + 3 for a, b in zip(threads[: cut - 1], threads[1:cut])), threads
        assert threads[cut - 2] > 16 >= threads[cut - 3], threads
        assert threads[cut] <= threads[0] + 1, threads  # fresh ranks: one kept group again
        assert pool.run(2, _rank_and_sum, 0) == [(0, 1.0), (1, 1.0)]
    finally:
        pool.close()


# ------------------------------------------------------------------ ProcessGroupManager

# (world size, SP size) -> (SP groups, DP groups), written out from the documented grid.
GRIDS = {
    (4, 1): ([[0], [1], [2], [3]], [[0, 1, 2, 3]]),
    (4, 2): ([[0, 1], [2, 3]], [[0, 2], [1, 3]]),
    (4, 4): ([[0, 1, 2, 3]], [[0], [1], [2], [3]]),
    (3, 3): ([[0, 1, 2]], [[0], [1], [2]]),
    (3, 1): ([[0], [1], [2]], [[0, 1, 2]]),
    (8, 2): ([[0, 1], [2, 3], [4, 5], [6, 7]], [[0, 2, 4, 6], [1, 3, 5, 7]]),
    (8, 4): ([[0, 1, 2, 3], [4, 5, 6, 7]], [[0, 4], [1, 5], [2, 6], [3, 7]]),
}

MPU_METHODS = [
    "get_sequence_parallel_group",
    "get_sequence_parallel_world_size",
    "get_sequence_parallel_rank",
    "get_data_parallel_group",
    "get_data_parallel_world_size",
    "get_data_parallel_rank",
    "get_sequence_data_parallel_group",
    "get_sequence_data_parallel_world_size",
    "get_sequence_data_parallel_rank",
    "get_model_parallel_group",
    "get_model_parallel_world_size",
    "get_model_parallel_rank",
]


def _members(group) -> list[int]:
    """Global ranks in ``group``, read back by an all-reduce of one bit per rank."""
    bits = torch.tensor([float(1 << dist.get_rank())], dtype=torch.float64)
    dist.all_reduce(bits, group=group)
    total = int(bits.item())
    return [r for r in range(dist.get_world_size()) if total >> r & 1]


def _describe_groups(rank: int, world_size: int, sp_sizes: list[int]) -> list[dict]:
    from seqpar.runtime.groups import default_manager, init_process_groups, resolve_group

    out = []
    for sp in sp_sizes:
        m = init_process_groups(sp)
        assert default_manager() is m and resolve_group() is m.sp_group
        out.append(
            {
                "sizes": (m.world_size, m.rank, m.sp_size, m.dp_size, m.sp_rank, m.dp_rank),
                "sp": _members(m.sp_group),
                "dp": _members(m.dp_group),
                "sp_dp": _members(m.sp_dp_group),
                "mp": _members(m.get_model_parallel_group()),
                "sp_ranks_prop": (m.sp_ranks, m.dp_ranks),
                "group_ranks": (  # torch's own view of the groups: same ranks, same order
                    dist.get_process_group_ranks(m.sp_group),
                    dist.get_process_group_ranks(m.dp_group),
                ),
                "rank_in": (dist.get_rank(m.sp_group), dist.get_rank(m.dp_group)),
                "mpu": {name: getattr(m, name)() for name in MPU_METHODS if "group" not in name},
                "mpu_groups": [
                    getattr(m, name)() is g
                    for name, g in [
                        ("get_sequence_parallel_group", m.sp_group),
                        ("get_data_parallel_group", m.dp_group),
                        ("get_sequence_data_parallel_group", m.sp_dp_group),
                    ]
                ],
            }
        )
    return out


@pytest.mark.parametrize("world_size, sp_sizes", [(3, [3, 1]), (4, [1, 2, 4]), (8, [2, 4])])
def test_grid_groups(dist_pool, world_size: int, sp_sizes: list[int]) -> None:
    per_rank = dist_pool.run(world_size, _describe_groups, sp_sizes)
    for i, sp in enumerate(sp_sizes):
        sp_groups, dp_groups = GRIDS[(world_size, sp)]
        dp = world_size // sp
        for rank in range(world_size):
            d = per_rank[rank][i]
            my_sp = next(g for g in sp_groups if rank in g)
            my_dp = next(g for g in dp_groups if rank in g)
            sp_rank, dp_rank = my_sp.index(rank), my_dp.index(rank)
            assert d["sizes"] == (world_size, rank, sp, dp, sp_rank, dp_rank), (sp, rank, d)
            assert d["sp"] == my_sp and d["dp"] == my_dp, (sp, rank, d)
            assert d["sp_dp"] == list(range(world_size)) and d["mp"] == [rank]
            assert d["sp_ranks_prop"] == (my_sp, my_dp) == d["group_ranks"]
            assert d["rank_in"] == (sp_rank, dp_rank)
            assert d["mpu"] == {
                "get_sequence_parallel_world_size": sp,
                "get_sequence_parallel_rank": sp_rank,
                "get_data_parallel_world_size": dp,
                "get_data_parallel_rank": dp_rank,
                "get_sequence_data_parallel_world_size": world_size,
                "get_sequence_data_parallel_rank": rank,
                "get_model_parallel_world_size": 1,
                "get_model_parallel_rank": 0,
            }
            assert all(d["mpu_groups"])


def _init_bad(rank: int, world_size: int) -> list[str]:
    from seqpar.config import SeqParConfig
    from seqpar.runtime.groups import default_manager, init_process_groups

    messages = []
    for kwargs in ({"sp_size": 2}, {"config": SeqParConfig(size=2)}, {"sp_size": 0}):
        with pytest.raises(ValueError) as info:
            init_process_groups(**kwargs)
        messages.append(str(info.value))
    assert default_manager() is None  # a failed call records nothing
    # the ranks are still in step: a collective after the errors completes
    assert _members(None) == list(range(world_size))
    return messages


def test_indivisible_sp_size_is_a_clear_error_on_every_rank(dist_pool) -> None:
    for messages in dist_pool.run(3, _init_bad):
        want = (
            "world size 3 is not divisible by sequence_parallel.size 2; "
            "choose a size that divides the number of ranks (1, 3)"
        )
        assert messages[0] == messages[1] == want
        assert "positive integer" in messages[2] and "0" in messages[2]


def test_indivisible_message_lists_the_divisors() -> None:
    from seqpar.runtime.groups import check_divisible, rank_grid

    with pytest.raises(ValueError) as info:
        check_divisible(6, 4)
    assert str(info.value) == (
        "world size 6 is not divisible by sequence_parallel.size 4; "
        "choose a size that divides the number of ranks (1, 2, 3, 6)"
    )
    assert rank_grid(6, 3).tolist() == [[0, 1, 2], [3, 4, 5]]


def _resolve_rules(rank: int, world_size: int) -> None:
    from seqpar.runtime.groups import default_manager, init_process_groups, resolve_group

    assert default_manager() is None  # the harness resets it between tasks
    with pytest.raises(ValueError, match="init_process_groups"):  # no manager on 2 ranks: an error (issue 18)
        resolve_group()
    assert resolve_group(dist.group.WORLD) is dist.group.WORLD  # the whole world, on purpose
    m = init_process_groups(1)
    assert resolve_group() is m.sp_group  # the default manager's SP group
    assert resolve_group(m.dp_group) is m.dp_group  # an explicit group wins


def test_resolve_group_rules(dist_pool) -> None:
    dist_pool.run(2, _resolve_rules)


def _group_none_without_a_manager(rank: int, world_size: int) -> dict:
    """The public entries with group=None and no manager on a world > 1: each raises (never runs SP over
    the whole world silently); with group=WORLD each runs."""
    import seqpar
    from seqpar.runtime.groups import default_manager

    assert default_manager() is None  # the harness resets it between tasks
    q = torch.randn(1, 2, 4, 8)
    full = torch.arange(2 * 4 * world_size, dtype=torch.float32).view(2, 4 * world_size)  # (batch, seq)
    batch = {"input_ids": torch.arange(4 * world_size).view(1, -1)}
    calls = {
        "attention": lambda **g: seqpar.attention(q, q, q, causal=True, **g),
        "shard_sequence": lambda **g: seqpar.shard_sequence(full, 1, **g),
        "shard_batch": lambda **g: seqpar.shard_batch(batch, **g),
    }
    out: dict = {}
    for name, call in calls.items():
        with pytest.raises(ValueError) as info:
            call()
        out[name] = str(info.value)
        result = call(group=dist.group.WORLD)
        out[name + "_world"] = tuple((result["input_ids"] if name == "shard_batch" else result).shape)
    return out


def test_group_none_without_a_manager_is_an_error(dist_pool) -> None:
    """Issue 18: forgetting init_process_groups under DP x SP must not silently run SP over the world."""
    per_rank = dist_pool.run(2, _group_none_without_a_manager, timeout=60)
    for rank, out in enumerate(per_rank):
        for name in ("attention", "shard_sequence", "shard_batch"):
            assert "init_process_groups" in out[name], f"rank {rank} {name}: {out[name]}"
            assert "group=" in out[name] and "2 ranks" in out[name], f"rank {rank} {name}: {out[name]}"
        assert out["attention_world"] == (1, 2, 4, 8)
        assert out["shard_sequence_world"] == (2, 4)
        assert out["shard_batch_world"] == (1, 4)


def test_group_none_single_process_still_runs() -> None:
    """No torch.distributed at all: group=None is a single process, as before."""
    import seqpar

    if dist.is_initialized():
        pytest.skip("this test process already joined a process group")
    q = torch.randn(1, 2, 4, 8)
    out = seqpar.attention(q, q, q, causal=True)
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True))


def test_resolve_group_single_process() -> None:
    from seqpar.runtime.groups import ProcessGroupManager, resolve_group

    if dist.is_initialized():
        pytest.skip("this test process already joined a process group")
    assert resolve_group() is None  # callers treat it as world size 1
    with pytest.raises(RuntimeError, match="init_process_groups"):
        ProcessGroupManager(1)


def test_init_process_groups_without_a_launcher_makes_a_world_of_one() -> None:
    # A fresh interpreter: this test process must not join a process group itself.
    # timeout_s bounds the world group seqpar creates, and its own groups.
    code = (
        "import torch, torch.distributed as dist, seqpar\n"
        "m = seqpar.init_process_groups(config=seqpar.SeqParConfig(size=1, timeout_s=7))\n"
        "t = [g._get_backend(torch.device('cpu')).options._timeout.total_seconds()\n"
        "     for g in (dist.group.WORLD, m.sp_group, m.dp_group)]\n"
        "print(m.world_size, m.sp_size, m.dp_size, dist.get_backend(), *map(int, t))\n"
        "dist.barrier(); dist.destroy_process_group()\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "1", "1", "gloo", "7", "7", "7"]


def _timeouts(rank: int, world_size: int) -> list[int]:
    import torch

    from seqpar import SeqParConfig, init_process_groups
    from seqpar.runtime.groups import set_default_manager

    m = init_process_groups(config=SeqParConfig(size=world_size, timeout_s=9))
    set_default_manager(None)  # leave the pool's ranks as they were for later tests
    groups = (dist.group.WORLD, m.sp_group, m.dp_group, m.sp_dp_group)
    return [int(g._get_backend(torch.device("cpu")).options._timeout.total_seconds()) for g in groups]


def test_timeout_s_bounds_seqpars_groups_not_a_users_world(dist_pool) -> None:
    # The pool created the world group with a 60 s timeout: it keeps it; seqpar's groups get 9 s.
    assert dist_pool.run(2, _timeouts) == [[60, 9, 9, 9]] * 2


# ------------------------------------------------------------------ config forms (issue 18)


def _from_config_forms(rank: int, world_size: int, standalone: str, deepspeed: str) -> list:
    import torch

    from seqpar import SeqParConfig, init_process_groups
    from seqpar.runtime.groups import set_default_manager

    out = []
    for config in (SeqParConfig(size=2, timeout_s=11, sharding="zigzag"),
                   {"size": 2, "timeout_s": 12, "sharding": "zigzag"},  # the block itself
                   {"sequence_parallel": {"size": 2, "timeout_s": 13, "sharding": "zigzag"}},  # a dict holding it
                   standalone, deepspeed):  # JSON paths: standalone, DeepSpeed
        m = init_process_groups(config=config)
        timeout = int(m.sp_group._get_backend(torch.device("cpu")).options._timeout.total_seconds())
        out.append((m.sp_size, m.sharding, timeout))
        m.destroy()
    set_default_manager(None)
    return out


def test_init_process_groups_takes_what_swap_attention_takes(dist_pool, tmp_path) -> None:
    import json

    block = {"size": 2, "timeout_s": 14, "sharding": "zigzag"}
    standalone = tmp_path / "sp.json"
    standalone.write_text(json.dumps(block))
    deepspeed = tmp_path / "ds.json"
    deepspeed.write_text(json.dumps({"train_batch_size": 2, "sequence_parallel": {**block, "timeout_s": 15}}))
    want = [(2, "zigzag", t) for t in (11, 12, 13, 14, 15)]
    assert dist_pool.run(2, _from_config_forms, str(standalone), str(deepspeed)) == [want, want]


# ------------------------------------------------------------------ DeviceMesh (issue 18)


def _mesh_view(rank: int, world_size: int, shape: tuple, names: tuple, ulysses_size: int = 1) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from seqpar.runtime.groups import init_process_groups, set_default_manager

    user = init_device_mesh("cpu", shape, mesh_dim_names=names) if names else None
    m = init_process_groups(mesh=user, ulysses_size=ulysses_size) if user is not None else init_process_groups(2)
    sp_dim = next((n for n in names if n in ("sp", "cp")), None)
    wide_dp = [n for n in names if n.startswith("dp") and user[n].size() > 1]
    out = {
        "sizes": (m.sp_size, m.dp_size, m.sp_rank, m.dp_rank),
        "ranks": (m.sp_ranks, m.dp_ranks),
        "members": (_members(m.sp_group), _members(m.dp_group)),
        "torch_ranks": (dist.get_process_group_ranks(m.sp_group), dist.get_process_group_ranks(m.dp_group)),
        "rank_in": (dist.get_rank(m.sp_group), dist.get_rank(m.dp_group)),
        # the manager's mesh: named (dp, sp, tp), over the manager's own group objects (tp = 1 here)
        "mesh_names": m.mesh.mesh_dim_names,
        "mesh_grid": m.mesh.mesh.tolist(),
        "mesh_groups_are_the_managers": (m.mesh["sp"].get_group() is m.sp_group,
                                         m.mesh["dp"].get_group() is m.dp_group,
                                         m.mesh["tp"].get_group() is m.tp_group),
        # with a user mesh: the mesh's own groups, no new SP/DP communicator
        "user_sp_group": user is not None and user.get_group(sp_dim) is m.sp_group,
        "user_dp_group": len(wide_dp) == 1 and user.get_group(wide_dp[0]) is m.dp_group,
        "ulysses": _members(m.ulysses_group),
    }
    m.destroy()
    set_default_manager(None)
    return out


@pytest.mark.parametrize("shape, names, ulysses, sp_groups, dp_groups", [
    ((2, 2), ("dp", "sp"), 1, [[0, 1], [2, 3]], [[0, 2], [1, 3]]),
    ((1, 2, 2), ("dp_replicate", "dp_shard", "cp"), 1, [[0, 1], [2, 3]], [[0, 2], [1, 3]]),
    ((2, 2), ("cp", "dp"), 1, [[0, 2], [1, 3]], [[0, 1], [2, 3]]),  # SP groups of strided ranks
    ((2, 2, 1), ("dp_replicate", "dp_shard", "sp"), 1, [[0], [1], [2], [3]], [[0, 1, 2, 3]]),  # DP flattened
    ((1, 4), ("dp", "sp"), 2, [[0, 1, 2, 3]], [[0], [1], [2], [3]]),  # Ulysses pairs inside the mesh's SP
    ((2, 2), (), 1, [[0, 1], [2, 3]], [[0, 2], [1, 3]]),  # no user mesh: seqpar's grid, viewed as a mesh
])
def test_mesh_view_and_user_mesh(dist_pool, shape, names, ulysses, sp_groups, dp_groups) -> None:
    per_rank = dist_pool.run(4, _mesh_view, shape, names, ulysses)
    # the manager's (dp, sp) grid: row i is the SP group whose members are DP rank i
    grid = sorted(sp_groups, key=lambda g: next(dp.index(g[0]) for dp in dp_groups if g[0] in dp))
    for rank, d in enumerate(per_rank):
        my_sp = next(g for g in sp_groups if rank in g)
        my_dp = next(g for g in dp_groups if rank in g)
        assert d["sizes"] == (len(my_sp), len(my_dp), my_sp.index(rank), my_dp.index(rank)), (rank, d)
        assert d["ranks"] == d["members"] == d["torch_ranks"] == (my_sp, my_dp), (rank, d)
        assert d["rank_in"] == (my_sp.index(rank), my_dp.index(rank))
        assert d["mesh_names"] == ("dp", "sp", "tp") and all(d["mesh_groups_are_the_managers"])
        assert d["mesh_grid"] == [[[r] for r in row] for row in grid], (rank, d["mesh_grid"], grid)
        if names:
            assert d["user_sp_group"]
            assert d["user_dp_group"] == (names != ("dp_replicate", "dp_shard", "sp") and len(my_dp) > 1)
        u = ulysses
        assert d["ulysses"] == my_sp[my_sp.index(rank) // u * u:][:u]


def _bad_mesh(rank: int, world_size: int, shape: tuple, names: tuple | None) -> str:
    from torch.distributed.device_mesh import init_device_mesh

    from seqpar.runtime.groups import default_manager, init_process_groups

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    with pytest.raises(ValueError) as info:
        init_process_groups(mesh=mesh)
    assert default_manager() is None
    assert _members(None) == list(range(world_size))  # still in step
    return str(info.value)


@pytest.mark.parametrize("shape, names, expected", [
    ((2, 2), ("pp", "sp"), "the mesh has a 'pp' dim (pipeline parallelism is not supported"),
    ((2, 2), ("dp", "ep"), "the mesh has a 'ep' dim (expert parallelism is not supported"),
    ((2, 2), ("dp", "tp"), "needs exactly one SP dim, named 'sp' or 'cp' (got none)"),  # TP alone: no SP dim
    ((2, 2), ("dp", "foo"), "the mesh has a 'foo' dim (seqpar does not know this dim)"),
    ((2, 2), ("sp", "cp"), "needs exactly one SP dim, named 'sp' or 'cp'"),
    ((2, 2), ("dp_shard", "dp"), "needs exactly one SP dim, named 'sp' or 'cp' (got none)"),
    ((4,), None, "the mesh's dims have no names"),
])
def test_mesh_dims_seqpar_cannot_represent_are_refused_by_name(dist_pool, shape, names, expected) -> None:
    for message in dist_pool.run(4, _bad_mesh, shape, names):
        assert expected in message and "init_process_groups(mesh=...)" in message, message


# ------------------------------------------------------------------ layering of runtime (issue 18)


def test_runtime_imports_no_higher_layer() -> None:
    """runtime/ stands below attention, sequences, memory and the swap: it imports none of them,
    not even lazily inside a function (the old init_process_groups imported seqpar.attn.choose)."""
    import ast
    from pathlib import Path

    higher = ("seqpar.attn", "seqpar.attention", "seqpar.sequence", "seqpar.memory", "seqpar.swap",
              "seqpar.mixers", "seqpar.integrations")
    root = Path(__file__).resolve().parents[1] / "seqpar" / "runtime"
    bad = []
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            bad += [f"{path.name}:{node.lineno} imports {n}" for n in names
                    if any(n == h or n.startswith(h + ".") for h in higher)]
    assert bad == []


def test_divisors_has_one_home() -> None:
    import re
    from pathlib import Path

    from seqpar.runtime.groups import divisors

    assert divisors(12) == [1, 2, 3, 4, 6, 12] and divisors(1) == [1] and divisors(7) == [1, 7]
    root = Path(__file__).resolve().parents[1]
    homes = [str(p.relative_to(root)) for p in sorted((root / "seqpar").rglob("*.py")) + sorted((root / "integrations").rglob("*.py"))
             if re.search(r"^def _?divisors\(", p.read_text(), re.M)]
    assert homes == ["seqpar/runtime/grid.py"]


def _auto_ulysses(rank: int, world_size: int) -> tuple:
    import seqpar
    from seqpar.runtime.groups import set_default_manager

    m = seqpar.init_process_groups(sp_size=4, ulysses_size="auto", heads=(6, 2),
                                   config={"size": 4, "links": {"node_size": 4, "intra_gbps": 100}})
    out = (m.ulysses_size, type(m.links).__name__, m.links.node_size, m.links.intra_gbps)
    m.destroy()
    set_default_manager(None)
    return out


def test_ulysses_auto_and_links_without_attention(dist_pool) -> None:
    # heads (6, 2): u = 4 cannot share 6 query heads; u = 2 can; links come from the config as Links
    assert dist_pool.run(4, _auto_ulysses) == [(2, "Links", 4, 100)] * 4


def test_an_integration_declares_the_configs_sharding_on_a_manager_it_reuses() -> None:
    """resolve_manager (every engine adapter) passes the config's sharding through: declared on a
    manager that had none, an error on one that declares another; an undeclared config leaves it."""
    from types import SimpleNamespace

    from seqpar.config import SeqParConfig
    from seqpar.integrations.common import resolve_manager

    manager = SimpleNamespace(sp_size=2, sharding=None)
    assert resolve_manager(SeqParConfig(size=2), manager).sharding is None
    assert resolve_manager(SeqParConfig(size=2, sharding="zigzag"), manager).sharding == "zigzag"
    assert resolve_manager(SeqParConfig(size=2), manager).sharding == "zigzag"  # undeclared config: kept
    with pytest.raises(ValueError, match="the manager declares sharding 'zigzag' but the config says 'contiguous'"):
        resolve_manager(SeqParConfig(size=2, sharding="contiguous"), manager)


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_groups_get_device_id_on_nccl_only(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every group seqpar creates is made with device_id= (torch's eager connection) on NCCL, and without
    it on gloo, which takes none; the eager all-reduce follows either way. A mock new_group records the
    calls (no NCCL here)."""
    from seqpar.runtime import communicators

    made, reduced = [], []

    def new_group(ranks, **kw):  # noqa: ANN001, ANN003, ANN202
        made.append((list(ranks), kw))
        return ("group", tuple(ranks))

    monkeypatch.setattr(dist, "new_group", new_group)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(communicators, "init_communicator", lambda group: reduced.append(group))
    monkeypatch.setattr(communicators, "world_is_bound", lambda: False)
    for lists, rank in (([[0, 1], [2, 3]], 2), ([[0], [1], [2], [3]], 1)):
        made.clear()
        group = communicators.new_groups(lists, rank)
        assert made and reduced[-1] == group == ("group", tuple(lists[rank // len(lists[0])]))
        for _, kw in made:
            if backend == "nccl":
                assert kw.get("device_id") == torch.device("cuda", 3), kw
            else:
                assert "device_id" not in kw, kw
    # a group family named with its own backend follows that backend, not the world's
    made.clear()
    communicators.new_groups([[0, 1]], 0, backend="gloo")
    assert "device_id" not in made[0][1]


class _FakeNCCLOptions:
    is_high_priority_stream = False


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_high_priority_streams_reach_nccl_groups_only(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``high_priority=True`` gives an NCCL group ``pg_options`` with ``is_high_priority_stream`` (its send /
    receive kernels then get the next free SM, not the tail of an attention kernel filling the GPU: modelled
    in seqpar.testing.streams); gloo has no streams and gets no options; without the flag no group gets them.
    A mock new_group records the calls (no NCCL in this build: a stand-in ProcessGroupNCCL.Options).
    Seen failing: options built without setting is_high_priority_stream; options handed to gloo."""
    from seqpar.runtime import communicators

    made = []
    monkeypatch.setattr(dist, "new_group", lambda ranks, **kw: made.append(kw) or ("group", tuple(ranks)))
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(dist, "ProcessGroupNCCL", types.SimpleNamespace(Options=_FakeNCCLOptions), raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(communicators, "init_communicator", lambda group: None)
    monkeypatch.setattr(communicators, "world_is_bound", lambda: False)
    for high in (True, False):
        made.clear()
        communicators.new_groups([[0, 1], [2, 3]], 1, high_priority=high)
        assert len(made) == 2
        for kw in made:
            if high and backend == "nccl":
                assert kw["pg_options"].is_high_priority_stream is True, kw
            else:
                assert "pg_options" not in kw, kw


def _groups_high_priority(rank: int, world_size: int, config: dict) -> list[bool]:
    """Every ``high_priority`` flag init_process_groups handed to communicators.new_groups on this rank."""
    import seqpar
    from seqpar.runtime import communicators

    seen, real = [], communicators.new_groups

    def spy(rank_lists, rank, **kw):  # noqa: ANN001, ANN003, ANN202
        seen.append(kw.get("high_priority", False))
        return real(rank_lists, rank, **kw)

    communicators.new_groups = spy
    try:
        manager = seqpar.init_process_groups(config=config)
        seqpar.destroy_process_groups(manager)
    finally:
        communicators.new_groups = real
    return seen


def test_config_high_priority_streams_reaches_every_group(dist_pool) -> None:
    """``"high_priority_streams": true`` in the block reaches every group family seqpar creates (SP, DP,
    SP-DP, single-rank, dynamic); absent, none. Seen failing: the manager not handed the config's flag."""
    on = dist_pool.run(2, _groups_high_priority, {"size": 2, "high_priority_streams": True,
                                                 "dynamic": {"max_tokens_per_rank": 64}})
    off = dist_pool.run(2, _groups_high_priority, {"size": 2})
    for flags in on:
        assert len(flags) >= 4 and all(flags), flags
    for flags in off:
        assert flags and not any(flags), flags


def test_config_high_priority_streams_must_be_a_bool() -> None:
    from seqpar.config import ConfigError, SeqParConfig

    with pytest.raises(ConfigError, match="high_priority_streams"):
        SeqParConfig.load({"size": 2, "high_priority_streams": "yes"})


def _resolve_by_size(rank: int, world_size: int) -> list:
    from seqpar.config import SeqParConfig
    from seqpar.integrations.common import resolve_manager
    from seqpar.runtime.groups import init_process_groups, set_default_manager

    one = init_process_groups(1)  # the default manager: SP 1 (DP 2)
    two = resolve_manager(SeqParConfig(size=world_size), None)
    try:
        return [two is not one, two.sp_size, resolve_manager(SeqParConfig(size=world_size), None) is two]
    finally:
        two.destroy()
        one.destroy()
        set_default_manager(None)


def test_an_integration_builds_the_configs_sp_size_beside_a_default_of_another(dist_pool) -> None:
    """resolve_manager (every engine adapter) with no manager given reuses the default one only when its SP size is
    the config's; otherwise it builds one from the config (and later calls reuse that one).

    Seen failing: with the size check dropped (``if manager is None:`` alone) the adapter took the SP 1 default for a
    config of SP 2: ``[False, 1, True]``."""
    assert dist_pool.run(2, _resolve_by_size) == [[True, 2, True]] * 2
