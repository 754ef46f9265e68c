"""``python -m seqpar.bench gpu-perf`` (issue 29 §8): its CPU path at toy sizes, and its plan against theory."""

from __future__ import annotations

import json
import math

import pytest

from seqpar.bench import gpu_perf, report
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
    with pytest.raises(SystemExit):
        bench_main(["gpu-perf", "--tiny", "--link-emulation", "dma"])


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
    their own T_floor (4 interleaved measurements, not 2; their t_floor differed from the hf rows'). T_sdpa is
    interleaved too (at 0dbebd6 the same 8K call timed alone came out 6.48-7.06 ms in four cases).
    Seen failing: with T_sdpa timed alone before the ring (calls [1 + n, 1 + n], no eta_alone)."""
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
    # per mask, one interleaved measurement of the ring step, the local SDPA step and each distinct floor
    # call; the other layout's cases interleave the ring step and the local SDPA step only
    assert calls == [2 + len(gpu_perf._block_shapes(shape, gpu_perf.Case(64, c, 1, "hf"))) for c in (True, False)
                     ] + [2, 2]
    for r in rows:  # eta from the interleaved T_sdpa; the one timed alone beside it
        assert r["eta"] == pytest.approx(8 * r["t_sdpa_local"] / r["t_step_400"])
        assert r["eta_alone"] == pytest.approx(8 * r["t_sdpa_alone"] / r["t_step_400"])
    for hf, contiguous in ((rows[0], rows[2]), (rows[1], rows[3])):
        assert hf["t_floor_from"] == hf["label"] and contiguous["t_floor_from"] == hf["label"]
        assert contiguous["t_floor"] == hf["t_floor"] and contiguous["floor_calls"] == hf["floor_calls"]
        for r in (hf, contiguous):
            assert r["glue"] == pytest.approx(r["t_compute"] / r["t_floor"] - 1)


# the 0dbebd6 H200 rows as BENCHMARKS.md printed them ("After issue 29 §3, §4, §6, §7"); the fixture holds
# their figures as gpu_perf.json fields (the run's own JSON was not kept), the two new columns are empty
_RECORDED_0DBEBD6 = [
    "| 8K | causal | 1 (1) | hf | 0.927 | 0.946 | +2.0% | 12.9% | — | — | 1.36 | 0.94 | 3.63 | 30.7 | 31.3 | 27.2 |",
    "| 8K | full | 1 (1) | hf | 0.874 | 0.883 | +1.0% | 12.7% | — | — | 1.50 | 1.04 | 6.48 | 58.7 | 59.3 | 52.1 |",
    "| 16K | causal | 1 (1) | hf | 0.897 | 0.933 | +4.1% | 9.3% | 0.757 | 0.929 | 1.36 | 0.94 | 13.49 | 115.6 | 120.3 | 105.8 |",
    "| 16K | full | auto (1) | hf | 0.984 | 0.984 | -0.0% | 1.9% | 0.809 | 0.929 | 1.50 | 1.04 | 28.31 | 230.1 | 230.0 | 225.8 |",
    "| 4K | full | auto (1) | contiguous | 0.754 | 0.836 | +10.8% | 16.4% | — | — | 1.66 | 1.15 | 1.77 | 17.0 | 18.8 | 14.6 |",
]


def test_table_prints_the_recorded_benchmarks_rows(capsys):
    """``gpu-perf-table DIR`` turns a gpu_perf.json into BENCHMARKS.md's rows: the fixture of the 0dbebd6
    figures prints the rows BENCHMARKS recorded, with the two new columns (excess50, lag50) beside them.
    Seen failing: with glue printed as "+12.9%" (slow400's sign format) and with T_sdpa at one decimal."""
    fixture = __import__("pathlib").Path(__file__).parent / "data" / "gpu_perf_0dbebd6.json"
    assert bench_main(["gpu-perf-table", str(fixture)]) == 0
    text = capsys.readouterr().out
    rows = [line for line in text.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == 30
    # BENCHMARKS' columns are ours without link (cell 5), excess50 and lag50 (cells 12 and 13) and eta
    # alone (the last); 0dbebd6's links were the sleep
    assert {r.strip("| ").split(" | ")[4] for r in rows} == {"sleep"}
    old = ["| " + " | ".join(c for i, c in enumerate(r.strip("| ").split(" | ")[:-1]) if i not in (4, 11, 12)) + " |"
           for r in rows]
    for want in _RECORDED_0DBEBD6:
        assert want in old, want
    assert "commit 0dbebd6" in text and "Skipped: L=32768 full hc=auto contiguous" in text


def test_table_excess_is_what_the_schedule_does_not_explain():
    """excess50 = T_step_50 - T_compute - (1 - max50) T_transfer_50: at the 0dbebd6 16K causal HF figures
    (T_compute 115.6 ms, hidden 0.757, max 0.929, T_transfer 37.58 ms by the link model) about 6.5 ms."""
    t_c, t_t = 0.1156, 0.03758
    row = {"t_compute": t_c, "t_transfer_50": t_t, "hidden_max_50": 0.929,
           "t_step_50": t_c + t_t - 0.757 * t_t}  # hidden's definition solved for T_step
    assert gpu_perf.excess_50(row) == pytest.approx((0.929 - 0.757) * t_t)
    assert gpu_perf.excess_50({"t_compute": t_c}) is None
    line = [r for r in gpu_perf.table_markdown({"cases": [{**row, "seq_local": 16384, "causal": True,
                                                           "head_chunks": 1, "layout": "hf", "hidden_50": 0.757}]}
                                               ).splitlines() if r.startswith("| 16K")][0]
    assert line.split(" | ")[11] == "6.5"


def test_table_names_an_unreadable_run_and_prints_the_rest(tmp_path, capsys):
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / "gpu_perf.json").write_text('{"cases": [')  # a run stopped mid-write (old writer)
    fixture = __import__("pathlib").Path(__file__).parent / "data" / "gpu_perf_0dbebd6.json"
    assert bench_main(["gpu-perf-table", str(tmp_path / "cut"), str(tmp_path / "none"), str(fixture)]) == 1
    text = capsys.readouterr().out
    assert "cannot read " + str(tmp_path / "cut" / "gpu_perf.json") in text
    assert "cannot read " + str(tmp_path / "none" / "gpu_perf.json") in text
    assert "| 8K | causal | 1 (1) | hf | sleep | 0.927 |" in text


def test_partial_json_is_replaced_whole(tmp_path, monkeypatch):
    """Every bench JSON (``report.write_json``, gpu-perf's after each case) is written to a temporary name
    and renamed, so a run stopped by a time limit mid-write leaves the last whole file (the device tool
    brings back what is under $OUT as it is).
    Seen failing: with write_json's ``open`` straight onto the path (a killed write left it truncated)."""
    out = tmp_path / "gp"
    dumps = []
    real = report.json.dump

    def cut_second(obj, f, **kw):
        dumps.append(1)
        if len(dumps) == 2:  # the second case's write is stopped halfway
            f.write('{"cases": [')
            raise KeyboardInterrupt
        real(obj, f, **kw)

    monkeypatch.setattr(report.json, "dump", cut_second)
    with pytest.raises(KeyboardInterrupt):
        bench_main(["gpu-perf", "--tiny", "--device", "cpu", "--seq-locals", "64", "--head-chunks", "1",
                    "--layouts", "hf", "--hidden-at", "64", "--profile-at", "0", "--repeats", "1", "--out", str(out)])
    payload = json.loads((out / "gpu_perf.json").read_text())
    assert [r["label"] for r in payload["cases"]] == ["L=64 causal hc=1 hf"]


def test_link_lag_split_from_the_trace(tmp_path):
    """lag50 split by the step's Chrome trace: the sleeps' own run time (``spin_kernel``, device
    durations) against the link model says how much of the lag is a slow sleep clock, the rest is the
    sleeps starting late (waiting for an SM). Figures made up: 14 messages, 37.6 ms modelled, lag 6.4 ms,
    the sleeps ran 38.6 ms: 1.0 ms clock, 5.4 ms SM wait.
    Seen failing: with the kernel durations read as seconds (the trace's are microseconds)."""
    runs = [38.6e3 / 14] * 14
    events = [{"ph": "X", "cat": "kernel", "name": "at::cuda::(anonymous namespace)::spin_kernel(long)",
               "ts": 10.0 * i, "dur": d} for i, d in enumerate(runs)]
    events += [{"ph": "X", "cat": "kernel", "name": "cudnn_attention_fwd", "ts": 0.0, "dur": 5e3},
               {"ph": "X", "cat": "cpu_op", "name": "spin_kernel_host_side", "ts": 0.0, "dur": 7.0}]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    got = gpu_perf.sleep_kernels(str(path))
    assert got["link_sleeps_traced_50"] == 14 and got["link_sleep_run_50"] == pytest.approx(38.6e-3)
    assert gpu_perf.sleep_kernels(str(tmp_path / "none.json")) == {}
    row = {"seq_local": 16384, "causal": True, "head_chunks": 1, "layout": "hf", "label": "L=16384 causal hc=1 hf",
           "link_lag_50": 6.4e-3, "link_lag_50_max": 0.9e-3, "link_messages_50": 14, "link_model_50": 37.6e-3, **got}
    text = gpu_perf.table_markdown({"cases": [row]})
    assert "ran +1.00 ms against the model (sleep clock), so they started 5.40 ms late (SM wait)" in text


def test_table_shows_the_link_emulation_and_the_copies_split(tmp_path):
    """A copy-emulation run (``--link-emulation copy``): every row names its links (``copy``), the header
    the measured copy rates, and lag50 is split by the trace's memcpy events (``gpu_memcpy``, HtoD / DtoH)
    as the sleeps' is by their kernels: 14 copies that ran 38.1 ms on 37.6 ms modelled with lag 0.8 ms:
    +0.50 ms copy rate, 0.30 ms late. A CPU run names the host clock and the emulation it was asked for.
    Seen failing: with the link cell left out of the row (the cell read "0.957", the row's eta) and with
    the memcpy events not counted (no copies' line)."""
    events = [{"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)" if i % 2 else
               "Memcpy DtoH (Device -> Pinned)", "ts": 10.0 * i, "dur": 38.1e3 / 14} for i in range(14)]
    events += [{"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)", "ts": 0.0, "dur": 9e3}]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    got = gpu_perf.sleep_kernels(str(path))
    assert got["link_sleeps_traced_50"] == 0 and got["link_copies_traced_50"] == 14
    assert got["link_copy_run_50"] == pytest.approx(38.1e-3)
    row = {"seq_local": 16384, "causal": True, "head_chunks": 1, "layout": "hf", "label": "L=16384 causal hc=1 hf",
           "link_emulation": "copy", "eta": 0.957, "link_lag_50": 0.8e-3, "link_lag_50_max": 0.1e-3,
           "link_messages_50": 14, "link_model_50": 37.6e-3, **got}
    rates = {"h2d": {"fixed_s": 8e-6, "bytes_per_s": 52e9}, "d2h": {"fixed_s": 9e-6, "bytes_per_s": 51e9}}
    text = gpu_perf.table_markdown({"cases": [row], "link_emulation": "copy", "copy_rates": rates,
                                    "link_priority": "high"})
    line = [r for r in text.splitlines() if r.startswith("| 16K")][0]
    assert line.split(" | ")[4:6] == ["copy", "0.957"]
    assert "link emulation copy (copies: d2h 51.0 GB/s + 9.0 us, h2d 52.0 GB/s + 8.0 us)" in text
    assert "the traced copies (14) ran +0.50 ms against the model (copy rate), so they started 0.30 ms late" in text
    out = tmp_path / "cpu"
    assert bench_main(["gpu-perf", "--tiny", "--device", "cpu", "--seq-locals", "64", "--head-chunks", "1",
                       "--layouts", "hf", "--hidden-at", "0", "--profile-at", "0", "--repeats", "1",
                       "--link-emulation", "copy", "--out", str(out)]) == 0
    payload = json.loads((out / "gpu_perf.json").read_text())
    assert payload["link_emulation"] == "host clock (copy asked)" and payload["copy_rates"] is None
    assert {r["link_emulation"] for r in payload["cases"]} == {"host clock (copy asked)"}


def test_issue29_perf_call_fits_its_limits_with_the_copy_pair(tmp_path):
    """``gpu_issue29.sh perf`` (the GPU call) with ``timeout`` stubbed to log its limit and command: the
    limits add up to at most 270 s (the device budget: machine start, the call, a rerun), and one step
    runs the 16K pair (both masks, hc 1, hf) on copy-engine links at high priority into ``$OUT/copy``,
    which the table reads. Seen failing: with the copy step's limit at 60 s (300 s in all)."""
    import os
    import pathlib
    import subprocess

    root = pathlib.Path(__file__).resolve().parents[1]
    stub = tmp_path / "bin"
    stub.mkdir()
    log = tmp_path / "limits.txt"
    (stub / "timeout").write_text(f'#!/bin/sh\necho "$@" >> {log}\n')
    (stub / "timeout").chmod(0o755)
    (stub / "python3").write_text(f'#!/bin/sh\necho "python3 $@" >> {log}.untimed\n')
    (stub / "python3").chmod(0o755)
    env = {**os.environ, "PATH": f"{stub}:{os.environ['PATH']}", "OUT": str(tmp_path / "out")}
    subprocess.run(["bash", str(root / "bench/scripts/gpu_issue29.sh"), "perf"], cwd=root, env=env, check=True,
                   capture_output=True, timeout=60)
    calls = log.read_text().splitlines()
    assert sum(int(c.split()[0]) for c in calls) <= 270, calls
    copy = [c for c in calls if "--link-emulation copy" in c]
    assert len(copy) == 1, calls
    flags = copy[0].split()
    assert flags[flags.index("--seq-locals") + 1] == "16384" and flags[flags.index("--head-chunks") + 1] == "1"
    assert flags[flags.index("--layouts") + 1] == "hf" and flags[flags.index("--link-priority") + 1] == "high"
    assert flags[flags.index("--out") + 1] == str(tmp_path / "out" / "copy")
    table = [c for c in pathlib.Path(f"{log}.untimed").read_text().splitlines() if "gpu-perf-table" in c]
    assert table and str(tmp_path / "out" / "copy") in table[0]
