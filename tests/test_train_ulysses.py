"""Parity of the main job in the new modes: launch/train.py with Ulysses at SP=2 and the 2 x 2 hybrid at
SP=4 gives the SP=1 losses over 5 steps, under DeepSpeed ZeRO-2 and FSDP2 (see test_train.py for how)."""

from __future__ import annotations

import pytest
from test_train import _REFS, SHORT, _close, _config, _losses

TIMEOUT = 600  # 4 ranks of a 2-layer Llama on a shared 2-core machine


def _reference(dist_pool, config: str) -> list[float]:  # noqa: ANN001
    """SP=1 on one rank (shared with test_train.py's cache when both run in one session)."""
    key = (config, ())
    if key not in _REFS:
        _REFS[key] = _losses(dist_pool, 1, ["--config", _config(config), "--sp-size", "1", *SHORT], timeout=TIMEOUT)
    return _REFS[key]


@pytest.mark.timeout(2 * TIMEOUT)  # the SP=1 reference and the run, each up to TIMEOUT on a loaded machine
@pytest.mark.parametrize(
    "config,world,extra",
    [
        ("deepspeed_ring.json", 2, ["--sp-size", "2", "--mode", "ulysses"]),
        ("fsdp_ring.json", 2, ["--sp-size", "2", "--mode", "ulysses"]),
        ("deepspeed_ring.json", 4, ["--sp-size", "4", "--mode", "hybrid", "--ulysses-size", "2"]),
        ("fsdp_ring.json", 4, ["--sp-size", "4", "--mode", "hybrid", "--ulysses-size", "2"]),
    ],
)
def test_new_modes_match_sp1(dist_pool, config: str, world: int, extra: list[str]) -> None:
    ref = _reference(dist_pool, config)  # SP = 1 on one rank; both runs here are pure SP (DP = 1)
    got = _losses(dist_pool, world, ["--config", _config(config), *extra, *SHORT], timeout=TIMEOUT)
    _close(got, ref)
    assert ref[-1] < ref[0], "the loss should move in 5 steps"
