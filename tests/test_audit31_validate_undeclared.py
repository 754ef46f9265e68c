"""Audit 31 (session 30's `--validate-only` dynamic budget check): a config that declares no sharding.

With no ``sequence_parallel.sharding`` the launcher's dynamic step passes ``sharding=None`` and the calls resolve it
to ``seqpar.sequence.sharding.UNDECLARED_DEFAULT`` (contiguous: a pad multiple of 1), so ``--validate-only`` must
judge the budget under that default: any budget is kept. tests/test_usr30_validate.py declares the sharding in
every case.
"""

from __future__ import annotations

import json

import pytest
from launch_module import train_module

from seqpar.sequence.sharding import UNDECLARED_DEFAULT, length_multiple

pytest.importorskip("transformers")


@pytest.mark.parametrize("budget", [513, 515])
def test_validate_only_judges_an_undeclared_sharding_as_the_runtime_does(tmp_path, capsys, budget):
    """An odd budget with no declared sharding validates (the runtime's default pads each share to 1).

    Seen failing (audit 31, mutant D2: launch/plan.py's ``sp.sharding or "zigzag"``): ConfigError
    'max_tokens_per_rank = 513 is not a multiple of 2, and zigzag sharding ...' for a run that would train."""
    assert length_multiple(1, UNDECLARED_DEFAULT) == 1  # the premise: the default keeps any budget
    path = tmp_path / f"dyn_{budget}.json"
    path.write_text(json.dumps({
        "sequence_parallel": {"size": 2, "mode": "ring", "dynamic": {"max_tokens_per_rank": budget}},
        "model": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                  "num_attention_heads": 4, "num_key_value_heads": 2},
        "train": {"engine": "fsdp", "seq_len": 256, "steps": 1, "seed": 0, "packed": True, "dynamic": True},
        "fsdp": {"version": 2}}))
    assert train_module().main(["--config", str(path), "--validate-only"]) == {}
    assert f"{path}: valid" in capsys.readouterr().out
