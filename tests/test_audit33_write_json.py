"""Audit 33: ``seqpar.bench.report.write_json`` (made atomic in session 32) given a bare file name, as ``--out
gpu_perf.json`` run from the output directory gives it: the directory to create is the current one (``os.path
.dirname("x.json")`` is ``""``, which ``os.makedirs`` refuses), and the file is written whole, no ``.part`` left."""

from __future__ import annotations

import json

from seqpar.bench.report import write_json


def test_a_bare_file_name_is_written_in_the_current_directory(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """Seen failing (audit 33): with ``os.path.dirname(path)`` in place of the absolute path's (W2):
    FileNotFoundError from ``os.makedirs('')``."""
    monkeypatch.chdir(tmp_path)
    write_json("out.json", {"cases": [1, 2], "link_emulation": "copy"})
    assert json.loads((tmp_path / "out.json").read_text()) == {"cases": [1, 2], "link_emulation": "copy"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]
