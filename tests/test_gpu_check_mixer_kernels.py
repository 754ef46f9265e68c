"""gpu-check's ``mixer-kernels`` stage (issue 28 §1) on CPU: its skip logic, and its comparison run with
the kernels faked (modules running the torch path, "cpu" made a kernel device) so that the stage's own
code (tiny models, dispatch under "torch" and "auto", call counts, tolerances) is exercised without a GPU."""

from __future__ import annotations

import inspect
import sys
import types

import pytest
import torch
from mixer_parity import simple_gla_by_token

import seqpar.bench.gpu_check as gc
from seqpar.mixers import delta_rule, lightning, ssd

transformers = pytest.importorskip("transformers")


def test_mixer_kernels_stage_skips_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = gc.stage_mixer_kernels()
    assert result["passed"] is None and "no CUDA device" in result["skipped"]
    assert "mixer-kernels" in {s.name for s in gc.STAGES}


def test_mixer_kernels_stage_skips_when_nothing_imports(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gc, "_on_kernel_device", lambda: True)
    for module, _ in gc.MIXER_KERNEL_PATHS.values():  # None in sys.modules: the import raises ImportError
        monkeypatch.setitem(sys.modules, module.split(".")[0], None)
    result = gc.stage_mixer_kernels()
    assert result["passed"] is None, result
    assert "no mixer kernel imports here" in result["skipped"]
    for family in gc.MIXER_KERNEL_PATHS:
        assert f"{family}: " in result["skipped"]


def _fake_kernels(monkeypatch: pytest.MonkeyPatch, skew: float) -> None:
    """The three Triton paths as modules that run the torch path (times ``skew``), on "cpu"."""
    import transformers.models.bamba.modeling_bamba as bamba
    import transformers.models.qwen3_next.modeling_qwen3_next as qwen3_next

    gdn_torch = inspect.unwrap(qwen3_next.torch_chunk_gated_delta_rule)
    ssd_torch = inspect.unwrap(bamba.mamba2_chunk_scan)

    def gdn(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        out, state = gdn_torch(*args, **kwargs)
        return out * skew, state

    def ssd_kernel(*args, seq_idx=None, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        assert seq_idx is None  # one document
        out, state = ssd_torch(*args, **kwargs)
        return out * skew, state

    fakes = {"gdn": gdn, "lightning": simple_gla_by_token, "mamba2": ssd_kernel}
    for family, (module, name) in gc.MIXER_KERNEL_PATHS.items():
        parts = module.split(".")
        for i in range(1, len(parts) + 1):
            if ".".join(parts[:i]) not in sys.modules or i == len(parts):
                monkeypatch.setitem(sys.modules, ".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
        setattr(sys.modules[module], name, fakes[family])
    for mod in (delta_rule, lightning, ssd):
        monkeypatch.setattr(mod, "KERNEL_DEVICES", {"cpu"})
    monkeypatch.setattr(gc, "_DEVICE", "cpu")
    monkeypatch.setattr(gc, "_on_kernel_device", lambda: True)


@pytest.mark.parametrize("skew", [1.0, 1.01])
def test_mixer_kernels_stage_compares_auto_with_torch(monkeypatch: pytest.MonkeyPatch, skew: float) -> None:
    """Kernels equal to the torch path pass (each called under "auto" only); a kernel 1% off fails."""
    _fake_kernels(monkeypatch, skew)
    result = gc.stage_mixer_kernels(seq_len=64)
    assert set(result["results"]) == set(gc.MIXER_KERNEL_PATHS), result
    for family, r in result["results"].items():
        assert r["calls_torch"] == 0 and r["calls_auto"] > 0, (family, r)
        if skew == 1.0 or family == "lightning":  # the lightning fake is exact: never skewed
            assert r["passed"] and r["worst_rel_error"] <= 1e-5, (family, r)
        else:
            assert not r["passed"] and r["worst_rel_error"] > gc.MIXER_KERNEL_RTOL, (family, r)
    assert result["passed"] is (skew == 1.0)
