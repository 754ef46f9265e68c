"""gpu-perf's figures that session 31 added, on stand-ins (one process, no device): ``t_compute`` and
``t_sdpa_local`` from the interleaved repeats (both paths of ``_compute_and_floor``: the floor measured here, or taken
from a case with the same block shapes), and the table's last column, ``eta alone``. A swap of the two medians or of
the last column is a silently wrong BENCHMARKS row: eta's numerator and denominator trade places, or eta is printed
twice. Note for gpu32 (seqpar/bench this session): these call ``gpu_perf._compute_and_floor`` with ``_interleaved``
and ``_block_shapes`` stood in, and ``gpu_perf.table_markdown``.
"""

from __future__ import annotations

import types

import pytest

from seqpar.bench import gpu_perf


@pytest.mark.parametrize("cached", [False, True])
def test_the_ring_and_the_local_sdpa_medians_are_not_swapped(cached: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ring step's repeats (1.0, 1.2, 1.1 s) give ``t_compute``, the local SDPA call's (0.2, 0.3, 0.25 s)
    ``t_sdpa_local``, whether the floor is measured (no block shapes: 0) or taken from ``floors``.

    Seen failing (audit 32): ``local, ring = _interleaved(...)`` in the floors-taken path (B2) and in the measured
    path (B1): t_compute 0.25 s, t_sdpa_local 1.1 s."""
    def free() -> None:
        pass

    def sdpa() -> None:
        pass

    timings = {free: [1.0, 1.2, 1.1], sdpa: [0.2, 0.3, 0.25]}
    monkeypatch.setattr(gpu_perf, "_interleaved", lambda clock, steps, **kw: [timings[s] for s in steps])
    monkeypatch.setattr(gpu_perf, "_block_shapes", lambda shape, case, device=None: {})
    floors = {(): {"t_floor": 0.5}} if cached else {}
    shape = types.SimpleNamespace(dtype="fp32")
    case = types.SimpleNamespace(label="L=64 causal hc=1 hf")
    res = gpu_perf._compute_and_floor(shape, case, None, None, free, 0, 3, floors, sdpa)
    assert (res["t_compute"], res["t_sdpa_local"]) == (1.1, 0.25), res


def test_the_last_column_is_eta_from_the_sdpa_timed_alone() -> None:
    """A row with eta 0.900 and eta_alone 0.800: the table's last cell is 0.800, the cell under ``eta`` 0.900
    (found by the header, so a column added before it does not move the check).

    Seen failing (audit 32): the last cell printed from ``eta`` (B9: 0.900 twice)."""
    row = {"seq_local": 8192, "causal": True, "head_chunks": 1, "layout": "hf", "eta": 0.9, "eta_alone": 0.8}
    lines = gpu_perf.table_markdown({"cases": [row]}).splitlines()
    header = next(r for r in lines if r.startswith("| L |")).strip("| ").split(" | ")
    cells = next(r for r in lines if r.startswith("| 8K")).strip("| ").split(" | ")
    assert header[-1] == "eta alone", header
    assert cells[header.index("eta")] == "0.900" and cells[-1] == "0.800", cells
