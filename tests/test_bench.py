"""The benchmark CLI cannot rot: every suite runs end to end on toy shapes through
``python -m seqpar.bench <suite> --tiny``, and its JSON must carry the figures and its plots must exist.

The suites run in this process, through the CLI's own ``main(argv)``, those on rank pools on the test
session's pools (``dist_pool.pools``, started once for the whole suite) instead of a fresh interpreter
starting its own: the same parsing, presets, suite, report, JSON and plots, without paying for an
interpreter and its pools per suite (the train suite's runs are ``torchrun`` jobs whatever runs it).
``test_overlap_command`` runs ``python -m seqpar.bench`` as a subprocess: the entry point's own smoke test.

The memory estimator is checked against exact tensor accounting (MemTracker) inside those runs:
MHA fp32 in the attention suite, GQA bf16 in the memory suite, within 15%.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from seqpar.memory.attention import estimate_attention_memory, max_seq_len

ROOT = Path(__file__).resolve().parents[1]
EST_TOL = 0.15


def _bench(tmp_path: Path, suite: str, *flags: str, capsys: Any, pools: Any = None) -> tuple[dict[str, Any], str]:
    """``python -m seqpar.bench <suite> --tiny --no-progress --out DIR *flags`` in this process, on ``pools`` (the
    session's) when given; returns the JSON and the printed report."""
    from seqpar.bench.__main__ import main

    out = tmp_path / suite
    capsys.readouterr()
    assert main([suite, "--tiny", "--no-progress", "--out", str(out), *flags], pools=pools) == 0
    stdout = capsys.readouterr().out
    payload = json.loads((out / f"{suite}.json").read_text())
    assert payload["suite"] == suite
    assert payload["machine"]["torch"] == torch.__version__ and payload["machine"]["cpu_cores"]
    assert payload["plots"], "every suite writes at least one plot"
    for plot in payload["plots"]:
        assert (out / plot).stat().st_size > 1000, plot
    return payload, stdout


def test_attention_suite(tmp_path: Path, dist_pool, capsys) -> None:  # noqa: ANN001
    payload, stdout = _bench(tmp_path, "attention", "--simulate", "256:4", pools=dist_pool.pools, capsys=capsys)
    rows = {(r["method"], r["P"], r["S"], r["causal"]): r for r in payload["results"]}
    for causal in (False, True):
        assert rows[("sdpa", 1, 256, causal)]["time_s"] > 0
        for mode in ("ring", "allgather"):
            r = rows[(mode, 2, 256, causal)]
            assert r["time_s"] > 0 and r["ideal_s"] > 0 and r["ratio_to_ideal"] > 0, r
            assert len(r["peak_bytes_per_rank"]) == 2
            assert abs(r["estimate_error"]) <= EST_TOL, r
        dilated = rows.get(("dilated", 2, 256, causal))
        skipped = [s for s in payload["skipped"] if s["method"] == "dilated"]
        assert dilated is not None or skipped, "dilated is measured or listed with its reason"
    assert abs(rows[("sdpa", 1, 256, False)]["estimate_error"]) <= EST_TOL
    assert "P=2 S=256 full: ring" in stdout and "x ideal" in stdout
    (sim_full, sim_causal) = payload["simulated"]
    for sim in (sim_full, sim_causal):
        assert sim["P"] == 4 and sim["compute_s"] > 0 and sim["overlap_s"] > 0 and sim["peak_bytes"] > 0
        # per step the rank sends 2 (P-1) K/V blocks forward and backward plus (P-1) fp32 dK/dV pairs
        block = 2 * 1 * 2 * 64 * 16 * 4  # K+V, batch 1, 2 kv heads, 64 local rows, head_dim 16, fp32
        assert sim["bytes_sent"] == 3 * 3 * block


def test_attention_profile_ulysses_and_hybrid(tmp_path: Path, dist_pool, capsys) -> None:  # noqa: ANN001
    # --profile splits Ulysses and the 2 x 2 hybrid into their phases (exclusive, CPU seconds); GQA with
    # 2 K/V heads over 4 Ulysses ranks (replicated) and causal zigzag for the hybrid's ring
    payload, stdout = _bench(tmp_path, "attention", "--worlds", "4", "--seq-lens", "128", "--causal", "yes",
                             "--methods", "seqpar_ulysses,hybrid", "--q-heads", "4", "--kv-heads", "2",
                             "--profile", "--no-memory", pools=dist_pool.pools, capsys=capsys)
    rows = {r["method"]: r for r in payload["results"]}
    expected = {"seqpar_ulysses": {"a2a_pack", "a2a_start", "a2a_unpack", "a2a_wait", "kernel_fwd", "kernel_bwd"},
                "hybrid": {"a2a_pack", "a2a_start", "a2a_unpack", "a2a_wait", "kernel_fwd", "kernel_bwd",
                           "ring_start", "ring_wait", "ring_other", "merge"}}
    for method, phases in expected.items():
        assert len(rows[method]["profile_per_rank"]) == 4
        for prof in rows[method]["profile_per_rank"]:
            assert phases <= {p for p, n in prof["calls"].items() if n > 0}, (method, prof["calls"])
            assert set(prof["phases_cpu_s"]) == set(prof["phases_s"]) == set(prof["calls"]) | {"other"}
            assert all(t >= -1e-3 for t in prof["phases_cpu_s"].values()), prof
            # exclusive phases: they add up to the step's CPU time, nothing counted twice
            assert sum(prof["phases_cpu_s"].values()) == pytest.approx(prof["cpu_s"], abs=2e-3), prof
    assert "hybrid P=4 causal S=128" in stdout and "a2a_pack" in stdout


def test_peers_suite_lists_every_peer(tmp_path: Path, dist_pool, capsys) -> None:  # noqa: ANN001
    payload, stdout = _bench(tmp_path, "peers", "--seq-lens", "128", pools=dist_pool.pools, capsys=capsys)
    by_method: dict[str, list[dict[str, Any]]] = {}
    for r in payload["results"]:
        by_method.setdefault(r["method"], []).append(r)
    for ok in ("sdpa", "ring", "allgather", "ulysses"):
        assert all(r["status"] == "ok" and r["time_s"] > 0 for r in by_method[ok]), by_method[ok]
    for r in by_method["ring"]:
        assert r["vs_ulysses"] > 0 and r["ratio_to_ideal"] > 0
    # CUDA-only peers on this CPU run: present, with the reason
    for peer in ("context_parallel", "ring_flash_attn"):
        rows = by_method[peer]
        assert rows and all(r["status"] == "skipped" and r["reason"] for r in rows), rows
    assert "deepspeed ulysses" in stdout and "not run:" in stdout


def test_memory_suite_estimator_within_15_percent(tmp_path: Path, dist_pool, capsys) -> None:  # noqa: ANN001
    # GQA and bf16 here; the attention suite covers MHA fp32
    payload, stdout = _bench(tmp_path, "memory", "--q-heads", "4", "--kv-heads", "1", "--dtype", "bfloat16",
                             "--seq-lens", "256,512", pools=dist_pool.pools, capsys=capsys)
    assert {(r["method"], r["P"]) for r in payload["results"]} == {
        ("sdpa", 1), ("ring", 2), ("allgather", 2), ("seqpar_ulysses", 2)}
    for r in payload["results"]:
        assert abs(r["estimate_error"]) <= EST_TOL, r
    for e in payload["largest"]:  # the estimator's S measures within its tolerance of the budget
        assert e["largest_S"] > 0 and e["measured_vs_budget"] <= 1 + EST_TOL, e
    assert "largest S within" in stdout


def test_memory_suite_estimator_on_uneven_ulysses_heads(tmp_path: Path, dist_pool, capsys) -> None:  # noqa: ANN001
    """Ulysses with head counts P does not divide (3 query heads over 2 ranks: shares 2 and 1, the K/V head
    on both): measured, and the estimator within its tolerance of the largest rank's peak.

    Seen failing: the estimator sized by the even share (``qs = ks = 1`` in ``_ulysses_peak``: 17% under, and
    the largest S it allows a budget does not fit); before uneven heads ran, the suite skipped
    ``seqpar_ulysses`` here."""
    payload, _ = _bench(tmp_path, "memory", "--q-heads", "3", "--kv-heads", "1", "--seq-lens", "256,512",
                        pools=dist_pool.pools, capsys=capsys)
    rows = [r for r in payload["results"] if r["method"] == "seqpar_ulysses"]
    assert {r["P"] for r in rows} == {2}, payload["results"]
    for r in rows:
        assert abs(r["estimate_error"]) <= EST_TOL, r
    for e in payload["largest"]:
        if e["method"] == "seqpar_ulysses":
            assert e["largest_S"] > 0 and e["measured_vs_budget"] <= 1 + EST_TOL, e


@pytest.mark.parametrize("heads,head_chunks", [(7, "auto"), (8, 1)], ids=["uneven_7_7", "even_8_8_hc1"])
def test_memory_estimator_hybrid_2x2_tight(dist_pool, heads: int, head_chunks) -> None:  # noqa: ANN001
    """The hybrid (u = 2, a ring of 2 super-ranks) at P = 4, fp32, head_dim 16, S = 256, non-causal: the estimator
    within -2% .. +10% of the measured peak of the largest rank (MemTracker), with uneven heads (7 / 7: shares
    4 + 3, one head pass) and even ones at ``head_chunks=1`` (8 / 8). Measured (2-core VM under load): 632832
    and 722944 bytes; the estimate was +30% and +18% when the inner ring's transients were added to the larger
    of the all-to-all moments (and, uneven, to dq/dk/dv made only after the inner backward); +6.1% and +9.3% in
    session 24, +0.3% since the hybrid takes the ring's own transients on one head chunk (session 25,
    tests/test_memory_hybrid.py).
    Seen failing: the old sum (``base + saved + grads + max(at_kernel, at_place) + inner``: +30%, +18%); the inner
    ring's transients left out of the kernel moment (``at_kernel + 0 * inner``: the even case -8.8%, under)."""
    from seqpar.bench.attention import BenchShape
    from seqpar.bench.memory import measure_peak

    shape = BenchShape(batch=1, q_heads=heads, kv_heads=heads, head_dim=16, dtype="float32", head_chunks=head_chunks)
    peak = max(dist_pool.pools.run(4, measure_peak, "hybrid", 256, False, shape, 0))
    est = estimate_attention_memory(256, world_size=4, mode="hybrid", batch=1, q_heads=heads, kv_heads=heads,
                                    head_dim=16, causal=False, head_chunks=head_chunks, ulysses_size=2)
    assert -0.02 <= est / peak - 1 <= 0.10, (heads, head_chunks, peak, est, est / peak - 1)


@pytest.mark.parametrize("world,heads,head_chunks", [(4, 8, 1), (2, 8, 1), (4, 8, "auto"), (4, 7, "auto")],
                         ids=["P4_8_8_hc1", "P2_8_8_hc1", "P4_8_8_auto", "P4_7_7_uneven"])
def test_memory_estimator_ulysses_tight(dist_pool, world: int, heads: int, head_chunks) -> None:  # noqa: ANN001
    """Plain Ulysses (u = P), fp32, head_dim 16, S = 256, non-causal: the estimator within -2% .. +10% of the
    largest rank's measured peak (MemTracker), even heads in one head pass at P = 4 and 2, even heads in
    "auto" chunks, and uneven 7 / 7 (shares 2 2 2 1, one pass). An estimate users size jobs by must not be under.
    Measured (2-core VM under load), bytes, estimate before -> after: P4_8_8_hc1 690176, 659456 (-4.5%) ->
    692224 (+0.3%); P2_8_8_hc1 1380352, 1318912 (-4.5%) -> 1384448 (+0.3%); P4_8_8_auto 641024, 626688 (-2.2%)
    -> 643072 (+0.3%); P4_7_7_uneven 575488, 626432 (+8.9%, unchanged; 577280, +0.3%, since
    est28b sizes an uneven split per rank). The even path's peak is the start of
    the grads' return all-to-all (``start_heads_back``): the kernel's dq/dk/dv, their packed send buffer and
    the receive buffer, three chunk-grads at once.
    Seen failing: the send moment left out (``max(at_kernel, at_place, at_send)`` -> ``max(at_kernel,
    at_place)`` in ``_ulysses_peak``, the estimate before): P4_8_8_hc1, P2_8_8_hc1 and P4_8_8_auto failed."""
    from seqpar.bench.attention import BenchShape
    from seqpar.bench.memory import measure_peak

    shape = BenchShape(batch=1, q_heads=heads, kv_heads=heads, head_dim=16, dtype="float32", head_chunks=head_chunks)
    peak = max(dist_pool.pools.run(world, measure_peak, "seqpar_ulysses", 256, False, shape, 0))
    est = estimate_attention_memory(256, world_size=world, mode="ulysses", batch=1, q_heads=heads, kv_heads=heads,
                                    head_dim=16, causal=False, head_chunks=head_chunks)
    assert -0.02 <= est / peak - 1 <= 0.10, (world, heads, head_chunks, peak, est, est / peak - 1)


def test_comm_suite_matches_theory(tmp_path: Path, dist_pool, capsys) -> None:  # noqa: ANN001
    """The comm suite's measured bytes against its theory (``seqpar.bench.comm.theory``), and that theory
    against a count by hand at the tiny preset (P = 2, S = 256, batch 1, 2 q / 2 K/V heads, head_dim 16,
    fp32): one rank's K (or V) block is B = 128 x 2 x 16 x 4 = 16384 bytes, and q is as big. Ring and
    all-gather: forward K and V once (2 B), backward again plus the fp32 dK/dV (2 B + 2 B). Ulysses
    (u = P = 2): half of q, k, v and the output leave each rank ((2 + 2) B / 2), backward the same;
    seqpar's packs q, k, v (4 heads of 128 x 16 fp32, half sent) and the output: the same 2 B.

    Seen failing: with the bench's theory counting the ring's dK/dV over P hops (``2 * world * elems_kv * a``),
    the theory's check by hand fails (98304 against 65536); before, the measured bytes met that function only."""
    payload, _ = _bench(tmp_path, "comm", "--causal", "no", pools=dist_pool.pools, capsys=capsys)
    rows = {r["mode"]: r for r in payload["results"] if r["status"] == "ok" and r["S"] == 256}
    block = 128 * 2 * 16 * 4
    by_hand = {"ring": (2 * block, 4 * block), "allgather": (2 * block, 4 * block),
               "ulysses": (2 * block, 2 * block), "seqpar_ulysses": (2 * block, 2 * block)}
    for mode in ("ring", "allgather", "ulysses", "seqpar_ulysses"):
        r = rows[mode]
        assert (r["P"], r["theory_fwd"], r["theory_bwd"]) == (2, *by_hand[mode]), r
        # seqpar adds one tiny all-gather of shapes for its cross-rank input check
        assert r["theory_fwd"] <= r["fwd_bytes"] <= r["theory_fwd"] + 1024, r
        assert r["bwd_bytes"] == r["theory_bwd"], r
    assert rows["dilated"]["fwd_bytes"] > 0
    assert all(e["seconds"] > 0 for e in payload["exchange"])


def test_comm_suite_uneven_ulysses_heads(tmp_path: Path, dist_pool, capsys) -> None:  # noqa: ANN001
    """Uneven Ulysses heads in the comm suite: 3 query / 3 K/V heads, Ulysses over P = 2 and the 2 x 2 hybrid at
    P = 4 (shares 2 + 1 heads), fp32, head_dim 16, S = 256, non-causal. Bytes by hand, in heads H of one rank's
    rows (H = L x 16 x 4, L = S / P), from the share table (rank 0: 2 query + 2 K/V heads, rank 1: 1 + 1):

    - Ulysses, forward: q/k/v of the other rank's heads, then its own heads' output rows for the other rank:
      rank 0 (1 + 2) + 2 = 5 H, rank 1 (2 + 4) + 1 = 7 H; backward: the other's dout, its own dq/dk/dv:
      rank 0 1 + 6 = 7 H, rank 1 2 + 3 = 5 H.
    - hybrid (a ring of 2 super-ranks after each pair's all-to-all): add its K and V heads over 2 L rows once
      forward (rank 0: 2 x 2 x 2 = 8 H, rank 1: 4 H) and K, V and the fp32 dK/dV once backward (16 H, 8 H):
      rank 0 13 H / 23 H, rank 1 11 H / 13 H.

    The row's figures are the largest rank's, and the report says so. Seen failing: the traffic counter's
    ``all_to_all_single`` charged (P-1)/P of the input whatever its split sizes (rank 0's forward 6.5 H, not 5);
    the theory with the even formula (``h = max(kv_heads // u, 1)`` = 1 K/V head per rank: 5 H forward, not 7: by
    arithmetic, not run);
    before, the suite skipped both modes ("do not split over 2 Ulysses ranks")."""
    payload, stdout = _bench(tmp_path, "comm", "--causal", "no", "--q-heads", "3", "--kv-heads", "3",
                             "--worlds", "2,4", "--seq-lens", "256", pools=dist_pool.pools, capsys=capsys)
    rows = {(r["mode"], r["P"]): r for r in payload["results"]}
    by_hand = {("seqpar_ulysses", 2): [(5, 7), (7, 5)], ("hybrid", 4): [(13, 23), (11, 13), (13, 23), (11, 13)]}
    for (mode, world), per_rank in by_hand.items():
        r, head = rows[mode, world], (256 // world) * 16 * 4
        assert r["status"] == "ok" and r["uneven_shares"] == [[2, 2], [1, 1]], r
        assert (r["theory_fwd"], r["theory_bwd"]) == (max(f for f, _ in per_rank) * head,
                                                     max(b for _, b in per_rank) * head), r
        for (fwd, bwd), got in zip(per_rank, r["per_rank"], strict=True):
            # seqpar adds one tiny all-gather of shapes for its cross-rank input check
            assert fwd * head <= got["fwd"] <= fwd * head + 1024 and got["bwd"] == bwd * head, (mode, world, r["per_rank"])
        assert f"{mode} P={world}: uneven Ulysses heads" in stdout and "the largest rank's" in stdout
    # fewer query heads than Ulysses ranks stays refused, by name
    assert rows["seqpar_ulysses", 4]["status"] == "skipped" and "fewer than the 4" in rows["seqpar_ulysses", 4]["reason"]


def test_peers_suite_runs_uneven_ulysses_heads(tmp_path: Path, dist_pool, capsys) -> None:  # noqa: ANN001
    """The peers suite with 3 query / 3 K/V heads at P = 2: seqpar's Ulysses runs in uneven shares (2 + 1) and
    the report names them and says the row is the slowest / largest rank's; DeepSpeed's Ulysses (even only) is
    skipped with its reason. Seen failing: before, seqpar_ulysses was skipped ("must be a multiple of P=2")."""
    payload, stdout = _bench(tmp_path, "peers", "--seq-lens", "128", "--q-heads", "3", "--kv-heads", "3",
                             "--causal", "no", pools=dist_pool.pools, capsys=capsys)
    rows = {r["method"]: r for r in payload["results"] if r["P"] == 2}
    r = rows["seqpar_ulysses"]
    assert r["status"] == "ok" and r["time_s"] > 0 and r["uneven_shares"] == [[2, 2], [1, 1]], r
    assert "seqpar ulysses P=2: uneven Ulysses heads" in stdout and "the largest share's" in stdout
    assert rows["ulysses"]["status"] == "skipped" and "multiples of P=2" in rows["ulysses"]["reason"]


def test_train_suite(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    payload, stdout = _bench(tmp_path, "train", capsys=capsys)
    rows = payload["results"]
    assert [r["sp_size"] for r in rows] == [1, 2]
    for r in rows:
        assert r["status"] == "ok", r
        assert r["tokens_per_s"] > 0 and max(r["peak_mem_bytes"]) > 0 and len(r["loss"]) == 2
    assert "tokens/s" in stdout


def test_estimator_api() -> None:
    kw = {"batch": 1, "q_heads": 8, "kv_heads": 8, "head_dim": 64, "dtype": torch.float32}
    single = estimate_attention_memory(8192, world_size=1, mode="single", **kw)
    ring4 = estimate_attention_memory(8192, world_size=4, mode="ring", **kw)
    block = 8192 * 8 * 64 * 4  # one (S, heads, head_dim) fp32 tensor
    assert single == pytest.approx(9 * block, rel=0.01)
    ring4_one = estimate_attention_memory(8192, world_size=4, mode="ring", head_chunks=1, **kw)
    # causal zigzag: 18.5 blocks of S/4, non-causal 19, as measured at S = 512 (the ring's plan replayed since
    # session 27: the closed form said 19 for both, and 20 until session 25)
    assert ring4_one == pytest.approx(18.5 * block / 4, rel=0.01)
    full4_one = estimate_attention_memory(8192, world_size=4, mode="ring", head_chunks=1, causal=False, **kw)
    assert full4_one == pytest.approx(19 * block / 4, rel=0.01)
    # 4 head chunks ("auto" for 8 K/V heads): q, k, v, out, dout and the full-size gradients (8 blocks)
    # + one chunk's K/V buffers (4), travelling dK/dV (4), kernel outputs (3: dq, dk, dv); fp32 passes
    # accumulate into the gradients' own heads (no chunk accumulators: they were 3 more until issue 29); causal
    # zigzag's half blocks make less: 10.64 blocks in all (the closed form's 8 + 11 / 4 until session 27)
    assert ring4 == pytest.approx(10.64 * block / 4, rel=0.01)
    assert ring4 <= 0.35 * single
    with pytest.raises(ValueError, match="head_chunks=3"):
        estimate_attention_memory(8192, world_size=4, mode="ring", head_chunks=3, **kw)
    assert estimate_attention_memory(8192, world_size=4, mode="allgather", **kw) > ring4
    assert estimate_attention_memory(8192, world_size=1, mode="ring", **kw) == single  # one rank runs plain SDPA
    s = max_seq_len(64 * 2**20, world_size=2, mode="ring", **kw)
    assert estimate_attention_memory(s, world_size=2, mode="ring", **kw) <= 64 * 2**20
    assert estimate_attention_memory(s + 4, world_size=2, mode="ring", **kw) > 64 * 2**20
    with pytest.raises(ValueError, match="mode="):
        estimate_attention_memory(1024, world_size=2, mode="tree", **kw)
    with pytest.raises(ValueError, match="chunks"):
        estimate_attention_memory(1026, world_size=2, mode="ring", **kw)


def test_overlap_command(tmp_path: Path) -> None:
    """``python -m seqpar.bench overlap`` at tiny sizes: the JSON's fields, the structural ``hidden_max``
    in [0, 1.05] for every mode, and above that of the old schedule (dK/dV waited right after its
    post) where the ring moves dK/dV on every hop. Each field breaks this test when missing; timed
    figures are only checked to be numbers (speed lives in BENCHMARKS.md)."""
    out = tmp_path / "overlap"
    cmd = [sys.executable, "-m", "seqpar.bench", "overlap", "--world", "4", "--seq-len", "1024", "--heads", "2",
           "--head-dim", "32", "--link-gbps", "auto,1000", "--causal", "both", "--mode", "ring,dilated,hybrid",
           "--repeats", "3", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    payload = json.loads((out / "overlap.json").read_text())
    assert payload["machine"]["torch"] == torch.__version__
    cases = payload["cases"]
    assert {(c["mode"], c["causal"]) for c in cases} == {(m, c) for m in ("ring", "dilated", "hybrid")
                                                         for c in (True, False)}
    for c in cases:
        for key in ("t_compute", "t_transfer", "t_step", "hidden", "hidden_max", "hidden_max_early", "link_gbps",
                    "half_compute", "transfer_over_compute", "link_emulation"):
            assert key in c, (key, c)
        assert c["link_emulation"] == "host clock", c  # the CPU's links: neither sleep nor copy
        assert c["t_compute"] > 0 and c["t_transfer"] > 0 and c["t_step"] > 0, c
        assert 0 <= c["hidden_max"] <= 1.05, c
        if c["link_auto"]:
            # 'auto' is sized so that the replayed transfers take half the first free-link run's compute; the
            # ratio to the median of all runs moves with the machine's load (first/median ran 0.5-2 under a
            # loaded 2-core machine), so the sizing is checked against the first run, not the median
            assert c["t_transfer"] == pytest.approx(0.5 * c["t_compute_runs"][0], rel=1e-6), c
            # measured at ~10 ms steps on a 2-core machine, where 5% of noise in T_step is 10% of hidden
            # (-0.16 and 1.2 were both seen on an idle machine): a timed figure is not asserted here, only
            # that it is a number; the S = 16384 runs in BENCHMARKS are the measurement
            assert math.isfinite(c["hidden"]) and math.isfinite(c["hidden_same_run"]), c
            # waiting later never delays the replay, so the schedule's bound is never below the early one's
            assert c["hidden_max"] >= c["hidden_max_early"] - 1e-9, c
            # where every rank moves dK/dV accumulators on every hop, waiting late is worth a margin
            # (0.07-0.15 seen): the ring, causal or not, and the non-causal dilated chain. Hybrid's ring
            # has P/u = 2 super-ranks (no dK/dV hop to move); the causal dilated chain is asymmetric and
            # rank 2 moves few accumulators (gaps 0.004-0.014 seen)
            if c["mode"] == "ring" or (c["mode"] == "dilated" and not c["causal"]):
                assert c["hidden_max"] > c["hidden_max_early"] + 0.03, c
    # one row per mode and mask is marked as the one nearest half the compute (which one is timed)
    for mode, causal in {(c["mode"], c["causal"]) for c in cases}:
        rows = [c for c in cases if (c["mode"], c["causal"]) == (mode, causal)]
        assert sum(c["half_compute"] for c in rows) == 1, rows
    assert "T_transfer" in proc.stdout and "max(early)" in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_overlap_cuda_is_a_clear_error_without_it() -> None:
    from seqpar.bench.overlap import run_case

    with pytest.raises(ValueError, match="--device cpu"):
        run_case("ring", 4, 64, True, ["auto"], device="cuda")


def test_overlap_names_an_unknown_link_emulation() -> None:
    """Seen failing: with run_case's emulation check removed (the CPU run went on with 'dma')."""
    from seqpar.bench.overlap import run_case

    with pytest.raises(ValueError, match="--link-emulation must be sleep or copy, not 'dma'"):
        run_case("ring", 4, 64, True, ["auto"], link_emulation="dma")


def test_emulated_links_share_a_link_fifo() -> None:
    """Two messages posted together on one link end at 2 x bytes / B (FIFO), on two links at 1 x; a wait
    passes no CPU time on the thread clock; the replay of the trace gives the same step time. (With
    the FIFO made per message instead of per link, the first assertion fails: seen failing, 10 ms where 20 are due.)"""
    from seqpar.comm.emulated import EmulatedLinks, EmulatedRing, LinkClock
    from seqpar.comm.loopback import LoopbackComm
    from seqpar.comm.schedule import replay

    # 10 ms a message, so the Python the calls themselves run (on the thread clock too: 0.67 ms once under CI's load,
    # past a 0.2 ms tolerance at 1 ms a message) stays far inside the 10 ms a per-message FIFO would be off by
    x = torch.zeros(2500)  # 10,000 bytes
    for shift, expect in ((1, 2.0), (2, 1.0)):
        links = EmulatedLinks(1e6, 0.0, LinkClock("thread"))  # 10 ms per 10,000 bytes
        comm = EmulatedRing(LoopbackComm(0, 4, transfer=False), links)
        t0 = links.clock.now()
        a = comm.exchange([x], channel=0)
        b = comm.exchange([x], channel=1, shift=shift)
        a.wait()
        b.wait()
        links.finish()
        took = links.clock.now() - t0
        assert expect * 1e-2 <= took < expect * 1e-2 + 3e-3, (shift, took)
        assert abs(replay(links.trace.events, lambda n: n / 1e6) - took) < 1e-3


def _allgather_peaks(rank: int, world: int, cases: list[tuple[bool, int | str]]) -> list[int]:
    """This rank's measured forward+backward peak of ``mode="allgather"`` for each ``(causal, head_chunks)``."""
    from seqpar.bench.attention import BenchShape
    from seqpar.bench.memory import measure_peak
    from seqpar.testing.ranks import RankContext

    ctx = RankContext(rank, world, torch.device("cpu"))
    return [measure_peak(ctx, "allgather", 32 * world, causal, BenchShape(q_heads=8, kv_heads=8, head_dim=8,
                                                                           head_chunks=chunks), 0)
            for causal, chunks in cases]


def test_allgather_estimate_against_the_measured_peak(dist_pool) -> None:
    """The all-gather's estimate against its measured peak at P = 4 (fp32, full and causal, one and four head
    chunks), far tighter than the memory suite's 15%: equal, or at most 1% over (causal, four chunks). The gathered
    K/V and their fp32 dK/dV grow with P, so a term counted once instead of P times shows.
    Seen failing: the gathered K/V counted as one rank's (``2 K / G`` instead of ``2 P K / G``), which the memory
    suite (P = 2, GQA, within 15%) let through."""
    world = 4
    cases = [(False, 1), (True, 1), (False, "auto"), (True, "auto")]
    per_rank = dist_pool.run(world, _allgather_peaks, cases, timeout=240)
    for i, (causal, chunks) in enumerate(cases):
        measured = max(peaks[i] for peaks in per_rank)
        estimate = estimate_attention_memory(32 * world, world_size=world, mode="allgather", batch=1, q_heads=8,
                                             kv_heads=8, head_dim=8, causal=causal, head_chunks=chunks)
        assert 0 <= estimate - measured <= 0.01 * measured, (causal, chunks, measured, estimate)


@pytest.mark.parametrize("world,kv_heads,head_chunks,causal",
                         [(4, 2, "auto", False), (4, 2, "auto", True), (4, 1, 1, False), (4, 2, 1, True),
                          (2, 2, 2, False)],
                         ids=["P4_8_2_auto", "P4_8_2_auto_causal", "P4_8_1_hc1", "P4_8_2_hc1_causal", "P2_8_2_hc2"])
def test_memory_estimator_ring_gqa_tight(dist_pool, world: int, kv_heads: int, head_chunks, causal: bool) -> None:  # noqa: ANN001
    """The ring with GQA (8 query heads), fp32, head_dim 16, S = 256: the estimator within -1% .. +1% of the
    largest rank's measured peak (MemTracker). With few K/V heads the backward is small and the peak is the
    forward's merge of a remote block, where the CPU merge upcasts the accumulator and the block to fp64 in
    pieces of at least 4096 elements (a small chunk whole: 2 x 32 KiB here). Measured (2-core VM under load),
    bytes, estimate before -> after: P4_8_2_auto 241920, 223232 (-7.7%) -> 241920 (+0.0%); P4_8_2_auto_causal
    241920, 227328 (-6.0%) -> 241920; P4_8_1_hc1 242176, 223232 (-7.8%) -> 242176; P4_8_2_hc1_causal 272384,
    288768 (+6.0%, unchanged: the backward's peak); P2_8_2_hc2 401920, 397312 (-1.1%) -> 401920.
    Seen failing: the merge's fp64 pieces and fp64 lse temporaries left out (``_forward_merge_bytes`` as before,
    ``... + Q32 + Q + 5 * lse``): P4_8_2_auto, P4_8_2_auto_causal and P4_8_1_hc1 failed. Since session 27 the ring's
    plan is replayed on plain masks too: every case exact to the byte, held to -1% .. +1%; the closed form
    (``_mask_options`` returning None for a plain ring call) fails P4_8_2_hc1_causal there (+3.0%)."""
    from seqpar.bench.attention import BenchShape
    from seqpar.bench.memory import measure_peak

    shape = BenchShape(batch=1, q_heads=8, kv_heads=kv_heads, head_dim=16, dtype="float32", head_chunks=head_chunks)
    peak = max(dist_pool.pools.run(world, measure_peak, "ring", 256, causal, shape, 0))
    est = estimate_attention_memory(256, world_size=world, mode="ring", batch=1, q_heads=8, kv_heads=kv_heads,
                                    head_dim=16, causal=causal, head_chunks=head_chunks)
    assert -0.01 <= est / peak - 1 <= 0.01, (world, kv_heads, head_chunks, causal, peak, est, est / peak - 1)
