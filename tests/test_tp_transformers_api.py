"""Tensor parallelism on a transformers without the tensor-parallel API seqpar calls is refused by name.

transformers 5.17 (seqpar's floor for sequence parallelism, what the GPU machines run) has no
``transformers.distributed.parallel_utils`` and its ``apply_tensor_parallelism`` takes no plan: every TP run there
failed on an ImportError or a TypeError inside ``integrations/tp.py`` (session 39, torch 2.11 + transformers 5.17).
Here 5.17 is played by hiding the module from ``importlib.util.find_spec``. Seen failing without the check: the
call went on to the next refusal (a ValueError about the model's missing plan)."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")

from seqpar.integrations.tp import apply_tensor_parallel  # noqa: E402


def test_tp_without_transformers_tp_api_names_the_version_and_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, *args: object) -> object:
        return None if name == "transformers.distributed.parallel_utils" else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ImportError, match=r"installed transformers .* pip install -U 'transformers>=5\.24', or run tp_size 1"):
        apply_tensor_parallel(torch.nn.Linear(2, 2), SimpleNamespace(tp_size=2))


def test_tp_size_one_needs_no_tp_api(monkeypatch: pytest.MonkeyPatch) -> None:
    """tp_size 1 changes nothing and checks nothing: sequence parallelism alone runs on transformers 5.17."""
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None)
    assert apply_tensor_parallel(torch.nn.Linear(2, 2), SimpleNamespace(tp_size=1)) == {}
