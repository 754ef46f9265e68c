"""The 3-D mesh (issue 22, step 1): ``(dp, sp, tp)`` groups, TP innermost, on 4 gloo ranks.

- For every layout of 4 ranks into dp x sp x tp, each rank's TP, SP, DP and SP-DP groups (members,
  torch's own view, a real all-reduce over each) and the manager's named mesh equal what the layout
  rule says: TP = consecutive ranks, then SP, then DP.
- A user mesh with a ``"tp"`` dim is taken as it is (its TP group is the manager's).
- Bad layouts, disagreeing ranks and head counts TP cannot split fail on every rank, naming the fix.
- The head-count rules look at the heads TP leaves each rank.
"""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from seqpar.config import ConfigError, SeqParConfig
from seqpar.runtime.groups import (
    check_layout,
    choose_ulysses_size,
    node_layout_problems,
    tp_heads_problem,
    ulysses_heads_ok,
)


def _theory(rank: int, world: int, sp: int, tp: int) -> dict[str, list[int]]:
    """The groups of ``rank`` by the layout rule, written out by coordinates (not by the cube)."""
    dp = world // (sp * tp)
    d, s, t = rank // (sp * tp), rank // tp % sp, rank % tp

    def at(d: int, s: int, t: int) -> int:
        return d * sp * tp + s * tp + t

    return {
        "tp": [at(d, s, j) for j in range(tp)],
        "sp": [at(d, j, t) for j in range(sp)],
        "dp": [at(j, s, t) for j in range(dp)],
        "sp_dp": sorted(at(i, j, t) for i in range(dp) for j in range(sp)),
        "coords": [d, s, t],
        "cube": [[[at(i, j, k) for k in range(tp)] for j in range(sp)] for i in range(dp)],
    }


def _summed(group: dist.ProcessGroup, rank: int) -> float:
    """A real collective over ``group``: the sum of its members' ``rank + 1``."""
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, group=group)
    return t.item()


def _layout(rank: int, world: int, sp: int, tp: int, from_config: bool) -> dict:
    from seqpar.runtime.groups import init_process_groups, set_default_manager

    if from_config:
        m = init_process_groups(config={"size": sp, "tp_size": tp}, heads=(8, 4))
    else:
        m = init_process_groups(sp, tp_size=tp, heads=(8, 4))
    groups = {"tp": m.tp_group, "sp": m.sp_group, "dp": m.dp_group, "sp_dp": m.sp_dp_group}
    out = {
        "members": {k: dist.get_process_group_ranks(g) for k, g in groups.items()},
        "sums": {k: _summed(g, rank) for k, g in groups.items()},
        "ranks": {"tp": m.tp_ranks, "sp": m.sp_ranks, "dp": m.dp_ranks},
        "coords": [m.dp_rank, m.sp_rank, m.tp_rank],
        "sizes": [m.dp_size, m.sp_size, m.tp_size],
        "mpu": [m.get_model_parallel_world_size(), m.get_model_parallel_rank(),
                m.get_tensor_model_parallel_src_rank(), m.get_sequence_data_parallel_world_size(),
                m.get_sequence_data_parallel_rank(), m.get_pipeline_model_parallel_world_size(),
                dist.get_process_group_ranks(m.get_pipeline_model_parallel_group())],
        "mp_is_tp": m.get_model_parallel_group() is m.tp_group and m.get_tensor_model_parallel_group() is m.tp_group,
        "mesh_names": m.mesh.mesh_dim_names,
        "mesh": m.mesh.mesh.tolist(),
        "mesh_groups": [m.mesh[n].get_group() is g for n, g in (("dp", m.dp_group), ("sp", m.sp_group),
                                                                ("tp", m.tp_group))],
    }
    m.destroy()
    set_default_manager(None)
    return out


@pytest.mark.parametrize("sp, tp, from_config", [
    (2, 2, False),  # TP2 x SP2
    (1, 2, True),  # DP2 x TP2, from a config block
    (1, 4, False),  # TP over every rank
    (2, 1, False),  # no TP: seqpar's (dp, sp) grid as before
])
def test_groups_match_the_layout_rule(dist_pool, sp: int, tp: int, from_config: bool) -> None:
    world = 4
    per_rank = dist_pool.run(world, _layout, sp, tp, from_config, timeout=240)
    for rank, got in enumerate(per_rank):
        want = _theory(rank, world, sp, tp)
        assert got["members"] == {k: want[k] for k in ("tp", "sp", "dp", "sp_dp")}, (rank, got["members"])
        assert got["ranks"] == {k: want[k] for k in ("tp", "sp", "dp")}, (rank, got["ranks"])
        assert got["sums"] == {k: float(sum(r + 1 for r in want[k])) for k in got["sums"]}, (rank, got["sums"])
        assert got["coords"] == want["coords"] and got["sizes"] == [world // (sp * tp), sp, tp]
        d, s, t = want["coords"]
        assert got["mpu"] == [tp, t, want["tp"][0], world // tp, want["sp_dp"].index(rank), 1, [rank]], got["mpu"]
        assert got["mp_is_tp"]
        assert got["mesh_names"] == ("dp", "sp", "tp") and all(got["mesh_groups"]), got
        assert got["mesh"] == want["cube"], (rank, got["mesh"])


def _user_mesh(rank: int, world: int, shape: tuple, names: tuple) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from seqpar.runtime.groups import init_process_groups, set_default_manager

    user = init_device_mesh("cpu", shape, mesh_dim_names=names)
    m = init_process_groups(mesh=user)
    out = {
        "tp_is_users": m.tp_group is user.get_group("tp"),
        "sp_is_users": m.sp_group is user.get_group(next(n for n in names if n in ("sp", "cp"))),
        "members": [dist.get_process_group_ranks(g) for g in (m.tp_group, m.sp_group, m.dp_group)],
        "sizes": [m.dp_size, m.sp_size, m.tp_size],
        "sum": _summed(m.tp_group, rank),
    }
    m.destroy()
    set_default_manager(None)
    return out


@pytest.mark.parametrize("shape, names, tp_groups, sp_groups, dp_groups", [
    ((2, 2), ("sp", "tp"), [[0, 1], [2, 3]], [[0, 2], [1, 3]], [[r] for r in range(4)]),
    ((2, 1, 2), ("dp", "sp", "tp"), [[0, 1], [2, 3]], [[r] for r in range(4)], [[0, 2], [1, 3]]),
    ((2, 2), ("tp", "cp"), [[0, 2], [1, 3]], [[0, 1], [2, 3]], [[r] for r in range(4)]),  # TP outer: as given
])
def test_user_mesh_with_a_tp_dim(dist_pool, shape, names, tp_groups, sp_groups, dp_groups) -> None:
    for rank, got in enumerate(dist_pool.run(4, _user_mesh, shape, names, timeout=240)):
        mine = [next(g for g in groups if rank in g) for groups in (tp_groups, sp_groups, dp_groups)]
        assert got["tp_is_users"] and got["sp_is_users"], got
        assert got["members"] == mine, (rank, got["members"], mine)
        assert got["sizes"] == [len(mine[2]), len(mine[1]), len(mine[0])]
        assert got["sum"] == float(sum(r + 1 for r in mine[0]))


def _refused(rank: int, world: int, kwargs: dict, per_rank_tp: bool) -> str:
    from torch.distributed.device_mesh import init_device_mesh

    from seqpar.runtime.groups import default_manager, init_process_groups

    kwargs = dict(kwargs)
    if per_rank_tp:
        kwargs["tp_size"] = 1 if rank == 3 else 2
    if "mesh" in kwargs:
        shape, names = kwargs["mesh"]
        kwargs["mesh"] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    with pytest.raises(ValueError) as info:
        init_process_groups(**kwargs)
    assert default_manager() is None
    t = torch.ones(1)
    dist.all_reduce(t)  # still in step: every rank raised
    assert t.item() == world
    return str(info.value)


@pytest.mark.parametrize("kwargs, per_rank_tp, expected", [
    ({"sp_size": 2, "tp_size": 4}, False, ["tp_size 4", "choose tp_size in [1, 2]"]),
    ({"sp_size": 1, "tp_size": 3}, False, ["tp_size 3", "choose tp_size in [1, 2, 4]"]),
    ({"sp_size": 2, "tp_size": 0}, False, ["tp_size must be a positive integer"]),
    ({"sp_size": 2}, True, ["rank 3: sp_size=2", "tp_size=1", "same sp_size, ulysses_size, tp_size"]),
    ({"sp_size": 2, "tp_size": 2, "heads": (8, 1)}, False,
     ["tp_size 2 does not divide the model's heads (8 query, 1 K/V)", "choose tp_size in [1]"]),
    ({"sp_size": 1, "tp_size": 4, "heads": (12, 6)}, False, ["choose tp_size in [1, 2, 3, 6]"]),
    ({"mesh": ((2, 2), ("sp", "tp")), "tp_size": 4}, False, ["tp_size 4 disagrees with the mesh's TP size 2"]),
    ({"mesh": ((2, 2), ("sp", "tp")), "config": {"tp_size": 1, "size": 2}, "tp_size": 1}, False,
     ["tp_size 1 disagrees with the mesh's TP size 2"]),
])
def test_bad_layouts_fail_on_every_rank_naming_the_fix(dist_pool, kwargs, per_rank_tp, expected) -> None:
    for message in dist_pool.run(4, _refused, kwargs, per_rank_tp, timeout=240):
        for part in expected:
            assert part in message, (part, message)


def test_check_layout_and_config() -> None:
    check_layout(8, 2, 2)  # dp 2
    check_layout(4, 4, 1)
    with pytest.raises(ValueError, match=r"world size 8 is not dp x sequence_parallel.size 2 x tp_size 3"):
        check_layout(8, 2, 3)
    with pytest.raises(ValueError, match="sequence_parallel.size"):
        check_layout(8, 3, 1)
    assert SeqParConfig.from_dict({"tp_size": 2}).tp_size == 2
    assert SeqParConfig().tp_size == 1
    for bad in (0, -1, True, 1.5, "2", None):
        with pytest.raises(ConfigError, match="sequence_parallel.tp_size"):
            SeqParConfig.from_dict({"tp_size": bad})
    # DeepSpeed's AutoTP degree must be ours
    assert SeqParConfig.from_deepspeed_config(
        {"tensor_parallel": {"autotp_size": 2}, "sequence_parallel": {"tp_size": 2}}).tp_size == 2
    for ds in ({"tensor_parallel": {"autotp_size": 2}, "sequence_parallel": {"size": 2}},
               {"tensor_parallel": {"autotp_size": 2}}):
        with pytest.raises(ConfigError, match=r"tp_size = 1 is invalid: .*autotp_size is 2"):
            SeqParConfig.from_deepspeed_config(ds)
        if "sequence_parallel" in ds:
            with pytest.raises(ConfigError, match="autotp_size"):
                SeqParConfig.load(ds)


def test_head_rules_see_the_heads_tp_leaves_each_rank() -> None:
    # 12 query / 6 K/V heads: without TP two Ulysses ranks split them; at TP2 each rank holds 6 / 3,
    # and 3 K/V heads are neither a multiple nor a divisor of 2
    assert ulysses_heads_ok(12, 6, 2) and not ulysses_heads_ok(12, 6, 2, tp=2)
    assert choose_ulysses_size(4, heads=(12, 6), node_size=8) == 2
    assert choose_ulysses_size(4, heads=(12, 6), node_size=8, tp=2) == 1
    # K/V heads < tp x u: 4 K/V heads at TP2 leave 2 per rank; u = 4 shares them (4 is a multiple of 2)
    assert ulysses_heads_ok(8, 4, 4, tp=2) and ulysses_heads_ok(8, 4, 2, tp=2)
    assert not ulysses_heads_ok(8, 4, 8, tp=2)  # 4 query heads per rank over 8 Ulysses ranks
    assert not ulysses_heads_ok(8, 4, 1, tp=8)  # TP cannot cut 4 K/V heads 8 ways
    # a Ulysses group of u spans u x tp consecutive ranks: it must fit in the node
    assert choose_ulysses_size(4, heads=(8, 8), node_size=4) == 4
    assert choose_ulysses_size(4, heads=(8, 8), node_size=4, tp=2) == 2
    assert tp_heads_problem(8, 4, 2) is None and tp_heads_problem(8, 4, 1) is None
    problem = tp_heads_problem(8, 4, 8)
    assert "tp_size 8 does not divide the model's heads (8 query, 4 K/V)" in problem
    assert "choose tp_size in [1, 2, 4]" in problem
    with pytest.raises(ValueError, match="choose tp_size in"):
        choose_ulysses_size(2, heads=(8, 4), tp=8)
    # the call-time rule names TP when the rank's heads came from it (3 heads over 2 ranks run unevenly now;
    # 1 query head over 2 ranks stays refused)
    from seqpar.attn.ulysses import head_split

    with pytest.raises(ValueError, match=r"heads / tp_size 2"):
        head_split(1, 1, 2, sp_size=2, mode="ulysses", tp=2)


def test_node_layout_counts_tp() -> None:
    assert node_layout_problems(16, 2, 1, 8, tp_size=4) == []  # TP4 x SP2 fills a node of 8
    # SP 2 x TP 4 spans 8 consecutive ranks: on nodes of 4 that is two whole nodes (fine); TP 4 fits
    assert node_layout_problems(16, 2, 1, 4, tp_size=4) == []
    problems = node_layout_problems(24, 1, 1, 6, tp_size=4)
    assert any("tp_size 4 does not divide the 6 ranks per node" in p for p in problems), problems
    # Ulysses 2 x TP 4 = 8 consecutive ranks do not fit in a node of 4
    problems = node_layout_problems(16, 2, 2, 4, tp_size=4)
    assert any("ulysses_size" in p for p in problems), problems


def test_launcher_tp_size_flag(monkeypatch, tmp_path) -> None:
    """``launch/train.py --tp-size``: validated with the rest; above 1 FSDP1 is refused naming what is
    missing, and DeepSpeed runs it as AutoTP (tests/test_deepspeed_tp.py)."""
    from test_config_fuzz import CONFIGS, _train_module

    train = _train_module()
    fsdp = next(c for c in CONFIGS if "deepspeed" not in c)
    assert train.validate(["--config", fsdp, "--tp-size", "1"]).sp.tp_size == 1
    assert train.validate(["--config", fsdp, "--tp-size", "2"]).sp.tp_size == 2  # FSDP2 applies TP
    plan = train.validate(["--config", fsdp, "--engine", "deepspeed", "--tp-size", "2"])  # DeepSpeed AutoTP
    assert (plan.engine, plan.engine_config["sequence_parallel"]["tp_size"]) == ("deepspeed", 2)
    fsdp1 = tmp_path / "fsdp1.json"
    fsdp1.write_text(json.dumps({**json.loads(open(fsdp).read()), "fsdp": {"version": 1}}))
    with pytest.raises(ConfigError, match=r"tp_size = 2 needs FSDP2 .*fsdp.version = 2 \(got 1\)"):
        train.validate(["--config", str(fsdp1), "--tp-size", "2"])
    for bad in ("0", "-2"):
        with pytest.raises(ConfigError, match="sequence_parallel.tp_size"):
            train.validate(["--config", fsdp, "--tp-size", bad])
    with pytest.raises(ConfigError, match="tp_size 3 does not divide the model's heads"):
        train.validate(["--config", fsdp, "--tp-size", "3"])
    # under a launcher the world must be dp x sp x tp
    monkeypatch.setenv("WORLD_SIZE", "6")
    with pytest.raises(ValueError, match="world size 6 is not divisible by sequence_parallel.size 4"):
        train.validate(["--config", fsdp, "--sp-size", "4"])


def _eight(rank: int, world: int) -> list[dict]:
    from seqpar.runtime.groups import init_process_groups, set_default_manager

    out = []
    for sp, tp, u in ((2, 2, 1), (4, 2, 2)):  # DP2 x SP2 x TP2; SP4 (hybrid 2 x 2) x TP2
        m = init_process_groups(sp, tp_size=tp, ulysses_size=u, heads=(8, 4), timeout=timedelta(seconds=47 + u))
        groups = {"tp": m.tp_group, "sp": m.sp_group, "dp": m.dp_group, "ulysses": m.ulysses_group,
                  "ring": m.ring_group}
        out.append({"members": {k: dist.get_process_group_ranks(g) for k, g in groups.items()},
                    "sums": {k: _summed(g, rank) for k, g in groups.items()},
                    "mesh": m.mesh.mesh.tolist(),
                    # DTensor and DCP place a shard by its mesh coordinate, FSDP2 and the collectives by the
                    # group rank: the two must agree on every dim of both meshes
                    "coords": [list(m.mesh.get_coordinate()), [dist.get_rank(g) for g in (m.dp_group, m.sp_group, m.tp_group)],
                               list(m.dp_sp_tp_mesh.get_coordinate()), [dist.get_rank(m.sp_dp_group), dist.get_rank(m.tp_group)]],
                    "liveness_timeout": m.liveness.timeout_s})
        m.destroy()
        set_default_manager(None)
    return out


def test_eight_ranks_dp_sp_tp_and_hybrid_inside_tp(dist_pool) -> None:
    """DP2 x SP2 x TP2, and the hybrid's Ulysses / ring groups of SP4 x TP2: each runs over the ranks of
    one TP rank's SP group (Ulysses = u consecutive SP ranks, ring = SP ranks u apart). Every rank's coordinate in
    ``manager.mesh`` and ``manager.dp_sp_tp_mesh`` is its rank in the dim's group, and the rank's heartbeat names
    the groups' timeout.

    Seen failing: ``dp_sp_tp_mesh`` built from the cube with DP and SP swapped (``cube.permute(1, 0, 2)`` before the
    reshape; the groups and test_tp_train's DP2 x SP2 x TP2 training were unchanged, but DCP would have written each
    FSDP2 shard at another rank's offset): rank 2's "dp_sp" coordinate 2, its group rank 1; ``init_process_groups``
    starting the heartbeat without the timeout: ``liveness_timeout`` None."""
    per_rank = dist_pool.run(8, _eight, timeout=300)
    for rank, (three_d, hybrid) in enumerate(per_rank):
        for record, u in ((three_d, 1), (hybrid, 2)):
            mesh_coords, group_ranks, flat_coords, flat_ranks = record["coords"]
            assert mesh_coords == group_ranks and flat_coords == flat_ranks, (rank, record["coords"])
            assert record["liveness_timeout"] == 47 + u, (rank, record["liveness_timeout"])
        want = _theory(rank, 8, 2, 2)
        assert three_d["mesh"] == want["cube"]
        assert {k: three_d["members"][k] for k in ("tp", "sp", "dp")} == {k: want[k] for k in ("tp", "sp", "dp")}
        want = _theory(rank, 8, 4, 2)
        sp = want["sp"]
        i = sp.index(rank)
        assert hybrid["members"]["sp"] == sp and hybrid["members"]["tp"] == want["tp"]
        assert hybrid["members"]["ulysses"] == sp[i // 2 * 2:][:2], (rank, hybrid["members"])
        assert hybrid["members"]["ring"] == sp[i % 2::2], (rank, hybrid["members"])
        for record in (three_d, hybrid):
            assert record["sums"] == {k: float(sum(r + 1 for r in g)) for k, g in record["members"].items()}
