"""bench/phases.py's attribution (audit 34): each phase's wall time is exclusive of the phases it calls, as its CPU
time is (test_bench checks the CPU sums only), and a communication wait inside Ulysses' own code is the all-to-all's
(``a2a_wait``), never the all-gather / dilated ``comm_wait``.

Seen failing (mut34): P1 (wall time inclusive: ``+ wall`` without ``- child_wall``) -> the nested phases' wall
seconds add up to more than the outer call's; P3 (``_wait_phase`` naming only ``a2a_unpack``'s waits the
all-to-all's) -> ``comm_wait`` among Ulysses' phases.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from seqpar.bench.phases import PhaseTimer


def test_nested_phases_wall_seconds_are_exclusive() -> None:
    timer = PhaseTimer(torch.device("cpu"))
    inner = timer.wrap("inner", lambda: time.sleep(0.02))

    def body() -> None:
        time.sleep(0.02)
        inner()
        inner()

    outer = timer.wrap("outer", body)
    t0 = time.perf_counter()
    outer()
    total = time.perf_counter() - t0
    assert timer.calls == {"outer": 1, "inner": 2}
    # exclusive: the outer phase's own seconds and its children's add up to at most the call's (inclusive wall
    # time counts the children twice: about 1.7 x the call here)
    assert timer.seconds["outer"] + timer.seconds["inner"] <= total, (timer.seconds, total)


def test_ulysses_waits_are_the_all_to_alls(tmp_path: Path, dist_pool, capsys) -> None:  # noqa: ANN001
    from seqpar.bench.__main__ import main

    out = tmp_path / "attention"
    assert main(["attention", "--tiny", "--no-progress", "--out", str(out), "--worlds", "4", "--seq-lens", "128",
                 "--causal", "yes", "--methods", "seqpar_ulysses,hybrid", "--q-heads", "4", "--kv-heads", "2",
                 "--profile", "--no-memory"], pools=dist_pool.pools) == 0
    rows = {r["method"]: r for r in json.loads((out / "attention.json").read_text())["results"]}
    for method in ("seqpar_ulysses", "hybrid"):
        for prof in rows[method]["profile_per_rank"]:
            called = {p for p, n in prof["calls"].items() if n > 0}
            assert "a2a_wait" in called and "comm_wait" not in called, (method, prof["calls"])
            # exclusive wall times: the phases (with "other") add up to the step's wall time
            assert sum(prof["phases_s"].values()) <= prof["total_s"] + 1e-9, (method, prof)
