"""``python -m seqpar.bench gpu-perf`` (issue 29 §8): its CPU path at toy sizes, and its plan against theory."""

from __future__ import annotations

import json
import math

import pytest

from seqpar.bench import gpu_perf
from seqpar.bench.__main__ import main as bench_main

FIELDS = ("t_sdpa_local", "t_compute", "t_step_400", "eta", "eta_compute", "slow_400", "t_floor", "glue",
          "peak", "peak_ring_bytes", "peak_sdpa_bytes", "peak_theory_bytes")


def test_cli_cpu_tiny_writes_every_figure(tmp_path):
    out = tmp_path / "gp"
    rc = bench_main(["gpu-perf", "--tiny", "--device", "cpu", "--seq-locals", "64", "--head-chunks", "1,auto",
                     "--layouts", "hf", "--hidden-at", "64", "--profile-at", "64", "--repeats", "1", "--out", str(out)])
    assert rc == 0
    payload = json.loads((out / "gpu_perf.json").read_text())
    assert payload["shape"]["world"] == 8 and payload["shape"]["rank"] == 4
    rows = payload["cases"]
    assert [(r["seq_local"], r["causal"], r["head_chunks"], r["layout"]) for r in rows] == [
        (64, True, 1, "hf"), (64, False, 1, "hf"), (64, True, "auto", "hf"), (64, False, "auto", "hf")]
    for r in rows:
        for f in FIELDS:
            assert math.isfinite(r[f]) and (r[f] > 0 or f in ("glue", "slow_400")), (r["label"], f, r[f])
        assert r["eta"] == pytest.approx(8 * r["t_sdpa_local"] / r["t_step_400"])
        assert r["eta_compute"] == pytest.approx(8 * r["t_sdpa_local"] / r["t_compute"])
        assert r["glue"] == pytest.approx(r["t_compute"] / r["t_floor"] - 1)
        assert r["peak"] == pytest.approx(r["peak_ring_bytes"] / r["peak_sdpa_bytes"])
        # the transfers alone at 50 GB/s: the rank's bytes on the link model, never 0
        assert r["t_transfer_50"] > 0 and math.isfinite(r["hidden_50"])
        # what the recorded schedule allows: a share of the transfers, never more than all of them
        assert 0 < r["hidden_max_50"] <= 1 + 1e-9
    assert rows[0]["head_chunks_resolved"] == 1 and rows[2]["head_chunks_resolved"] > 1
    # the kernel-time split, once per mask at --profile-at
    assert [("profile" in r) for r in rows] == [True, True, False, False]
    split = rows[0]["profile"]
    assert split["attention_s"] > 0 and split["kernel_s"] == pytest.approx(split["attention_s"] + split["other_s"])


def test_budget_skips_what_does_not_fit(tmp_path):
    out = tmp_path / "gp"
    bench_main(["gpu-perf", "--tiny", "--device", "cpu", "--seq-locals", "64", "--head-chunks", "1",
                "--layouts", "hf,contiguous", "--repeats", "1", "--budget-s", "0.001", "--out", str(out)])
    payload = json.loads((out / "gpu_perf.json").read_text())
    # the first case runs (nothing to estimate from), every later one is estimated past the budget
    assert len(payload["cases"]) == 1
    assert [s["label"] for s in payload["skipped"]] == [
        "L=64 full hc=1 hf", "L=64 causal hc=1 contiguous", "L=64 full hc=1 contiguous"]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("head_chunks", [1, 2])
def test_floor_calls_cover_the_ranks_share_of_the_mask(causal, head_chunks):
    """T_floor's calls are the plan's: their visible query-key pairs, summed, equal the played rank's
    rows' pairs in the global mask (zigzag: chunks r and 2P-1-r of the causal mask; contiguous: all)."""
    shape = gpu_perf.Shape(world=8, rank=4, q_heads=4, kv_heads=2, head_dim=16)
    L = 64  # noqa: N806
    case = gpu_perf.Case(L, causal, head_chunks, "hf")
    calls = gpu_perf._block_shapes(shape, case)
    pairs = sum(count * hq * (nq * (nq + 1) // 2 if c else nq * nk) for (hq, _, nq, nk, c), count in calls.items())
    if causal:
        half, p, r = L // 2, shape.world, shape.rank
        rows = [c * half + i for c in (r, 2 * p - 1 - r) for i in range(half)]
        expected = sum(i + 1 for i in rows) * shape.q_heads
    else:
        expected = L * L * shape.world * shape.q_heads
    assert pairs == expected


def test_theory_terms_add_up():
    shape = gpu_perf.Shape()
    terms = gpu_perf.theory_peak(shape, gpu_perf.Case(8192, True, 1, "hf"))
    assert terms["total"] == sum(v for k, v in terms.items() if k != "total")
    # q, k, v, out, dout in bf16 at L = 8K: 2 bytes x (3 x 32 + 2 x 8) heads x 8192 x 128
    assert terms["inputs_and_saved"] == 2 * (3 * 32 + 2 * 8) * 8192 * 128 + 4 * 32 * 8192


def test_bad_flags_are_named():
    with pytest.raises(SystemExit):
        bench_main(["gpu-perf", "--tiny", "--q-heads", "3", "--kv-heads", "2"])
    with pytest.raises(SystemExit):
        bench_main(["gpu-perf", "--tiny", "--rank", "8"])


def test_interleaved_times_each_step_round_robin():
    """T_floor's calls and the ring step are timed in turns (a drift moves them alike), each as many times.
    Seen failing: with the loop nesting swapped (every repeat of one step, then the next step's) the
    order below is [a, b, a, a, a, b, b, b] (the warm-up, then every run of a, then of b)."""
    order: list[str] = []

    class Clock:
        def time(self, step, *, warmup, repeats):  # noqa: ANN001, ANN202
            for _ in range(warmup):
                step()
            out = []
            for _ in range(repeats):
                step()
                out.append(float(len(order)))
            return out

    a, b = (lambda: order.append("a")), (lambda: order.append("b"))
    times = gpu_perf._interleaved(Clock(), [a, b], warmup=1, repeats=3)
    assert order == ["a", "b"] + ["a", "b"] * 3
    assert times == [[3.0, 5.0, 7.0], [4.0, 6.0, 8.0]]


def test_floor_measured_once_per_block_shapes_and_shared_across_layouts(tmp_path, monkeypatch):
    """T_floor is measured in the first case with given block shapes, interleaved with its ring step, and
    reused by the same mask and L in the other layout, so the two layouts' glue read one T_floor.
    Seen failing: with ``floors`` not kept across cases (run_case's default), the contiguous rows measured
    their own T_floor (4 interleaved measurements, not 2; their t_floor differed from the hf rows')."""
    calls: list[int] = []
    real = gpu_perf._interleaved

    def counting(clock, steps, *, warmup, repeats):  # noqa: ANN001, ANN202
        calls.append(len(steps))
        return real(clock, steps, warmup=warmup, repeats=repeats)

    monkeypatch.setattr(gpu_perf, "_interleaved", counting)
    out = tmp_path / "gp"
    bench_main(["gpu-perf", "--tiny", "--device", "cpu", "--seq-locals", "64", "--head-chunks", "1",
                "--layouts", "hf,contiguous", "--hidden-at", "128", "--profile-at", "128", "--repeats", "3",
                "--out", str(out)])
    rows = json.loads((out / "gpu_perf.json").read_text())["cases"]
    assert [(r["causal"], r["layout"]) for r in rows] == [
        (True, "hf"), (False, "hf"), (True, "contiguous"), (False, "contiguous")]
    shape = gpu_perf.Shape(world=8, rank=4, q_heads=4, kv_heads=2, head_dim=16)
    # one interleaved measurement per mask: the ring step and each distinct floor call
    assert calls == [1 + len(gpu_perf._block_shapes(shape, gpu_perf.Case(64, c, 1, "hf"))) for c in (True, False)]
    for hf, contiguous in ((rows[0], rows[2]), (rows[1], rows[3])):
        assert hf["t_floor_from"] == hf["label"] and contiguous["t_floor_from"] == hf["label"]
        assert contiguous["t_floor"] == hf["t_floor"] and contiguous["floor_calls"] == hf["floor_calls"]
        for r in (hf, contiguous):
            assert r["glue"] == pytest.approx(r["t_compute"] / r["t_floor"] - 1)
