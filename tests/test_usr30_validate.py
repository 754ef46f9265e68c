"""Session 30's new-user walk (reports/usr30.md): `--validate-only` refuses a dynamic-CP budget the sharding's cut
cannot keep, as the job itself would after its process groups start.

`sequence_parallel.dynamic.max_tokens_per_rank` must be a multiple of what the sharding pads each rank's share of a
micro-batch to (2 zigzag, 8 balanced, 1 contiguous); both are in the config, so the check needs no process group."""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist
from launch_module import train_module

from seqpar.config import ConfigError

pytest.importorskip("transformers")


def _dynamic_config(tmp_path, budget: int, sharding: str) -> str:
    path = tmp_path / f"dyn_{budget}_{sharding}.json"
    path.write_text(json.dumps({
        "sequence_parallel": {"size": 2, "mode": "ring", "sharding": sharding,
                              "dynamic": {"max_tokens_per_rank": budget}},
        "model": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                  "num_attention_heads": 4, "num_key_value_heads": 2},
        "train": {"engine": "fsdp", "seq_len": 256, "steps": 1, "seed": 0, "packed": True, "dynamic": True},
        "fsdp": {"version": 2}}))
    return str(path)


@pytest.mark.parametrize(("budget", "sharding", "multiple"), [(513, "zigzag", 2), (516, "balanced", 8)])
def test_validate_only_refuses_a_budget_the_cut_cannot_keep(tmp_path, budget, sharding, multiple):
    """Seen failing (launch/plan.py before this session): `--validate-only` printed "<config>: valid" and exited 0;
    the 2-rank job then failed at its first step with `[rank R] ValueError: dynamic CP: ... max_tokens_per_rank =
    513 is not a multiple of 2` (torchrun ... launch/train.py --config CFG --packed --dynamic)."""
    config = _dynamic_config(tmp_path, budget, sharding)
    with pytest.raises(ConfigError, match=rf"max_tokens_per_rank = {budget} is not a multiple of {multiple}, and "
                                          rf"{sharding} sharding .* choose max_tokens_per_rank a multiple of {multiple}"):
        train_module().main(["--config", config, "--validate-only"])
    assert not dist.is_initialized()


@pytest.mark.parametrize(("budget", "sharding"), [(512, "zigzag"), (512, "balanced"), (513, "contiguous")])
def test_validate_only_passes_a_budget_the_cut_keeps(tmp_path, capsys, budget, sharding):
    """The budgets the cut keeps validate as before (contiguous pads to 1: any budget)."""
    config = _dynamic_config(tmp_path, budget, sharding)
    assert train_module().main(["--config", config, "--validate-only"]) == {}
    assert f"{config}: valid" in capsys.readouterr().out
