"""The launcher's command (``launch/train.py``'s ``cli``) turns only seqpar's own refusals into one
``train.py: error:`` line and exit 2 (audit 30). A ValueError raised inside seqpar's code by something other than a
``raise`` statement (a builtin failing there: a bug, not a check) keeps its traceback, as one from torch does
(tests/test_usr29_user_errors.py::test_a_bug_keeps_its_traceback)."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
from launch_module import train_module

from seqpar.memory.mixers import mixer_shape

CONFIG = str(Path(__file__).resolve().parents[1] / "configs" / "fsdp_ring.json")


def _builtin_fails_inside_seqpar() -> None:
    """``int("24x")`` on seqpar.memory.mixers' ``h = int(config.hidden_size)`` line: a ValueError whose last frame
    is seqpar's file, at a line that is not a ``raise``."""
    mixer_shape(types.SimpleNamespace(model_type="jamba", hidden_size="24x"))


def test_a_builtins_error_inside_seqpar_keeps_its_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seen failing (audit 30's L1): `config_error_message` without its check that the line is a `raise`: the bug
    became `train.py: error: ValueError: invalid literal for int() ...` and exit 2."""
    train = train_module()
    with pytest.raises(ValueError, match="invalid literal") as info:
        _builtin_fails_inside_seqpar()
    assert "seqpar" in info.traceback[-1].path.parts and info.traceback[-1].path.name == "mixers.py"
    assert train.config_error_message(info.value) is None

    monkeypatch.setattr(train, "build_plan", lambda args: _builtin_fails_inside_seqpar())
    with pytest.raises(ValueError, match="invalid literal"):
        train.cli(["--config", CONFIG])
