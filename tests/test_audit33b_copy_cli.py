"""The two command lines that ask for the copy-engine link pass it on (mut33b: G7, G9 got through; both paths
need CUDA to run, so here the CUDA-only calls are replaced by recorders that stop the run once they have seen
what the command line built).

- ``overlap.run_case(device="cuda", link_emulation="copy")`` measures the copy engine (G7: ``copies = None``
  ran the sleep emulation for a run that asked for copies); ``"sleep"`` measures none.
- ``python -m seqpar.testing.streams --link-emulation copy --copy-gbps G`` models copies at G * 1e9 bytes/s
  (G9: G * 1e6, a thousand times slower)."""

from __future__ import annotations

import pytest
import torch

import seqpar.bench.overlap as overlap
import seqpar.testing.streams as streams


class _Seen(Exception):
    pass


@pytest.mark.parametrize("emulation, measured", [("copy", True), ("sleep", False)])
def test_overlap_measures_the_copy_engine_only_when_asked(monkeypatch, emulation: str, measured: bool) -> None:
    calls: list = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(overlap, "sleep_cycles_per_second", lambda dev: 1e9)
    monkeypatch.setattr(overlap.CopyEngine, "measure", staticmethod(lambda dev: calls.append(dev) or "engine"))

    def stop(*args, **kwargs):  # the case's step: reached once the links' engine is chosen
        raise _Seen

    monkeypatch.setattr(overlap, "_step_fn", stop)
    with pytest.raises(_Seen):
        overlap.run_case("ring", 2, 64, True, [50.0], device="cuda", link_emulation=emulation)
    assert calls == ([torch.device("cuda", 0)] if measured else []), calls


def test_streams_cli_copy_rate_is_in_gigabytes_per_second(monkeypatch) -> None:
    seen: dict = {}

    def record(**kwargs):
        seen.update(kwargs)
        raise _Seen

    monkeypatch.setattr(streams, "ring_step_log", record)
    with pytest.raises(_Seen):
        streams.main(["--link-emulation", "copy", "--copy-gbps", "37.5"])
    assert seen["emulation"] == "copy", seen
    assert seen["copy_rate"].rate == pytest.approx(37.5e9, rel=1e-12), seen["copy_rate"]
    assert seen["copy_rate"].fixed == pytest.approx(10e-6), seen["copy_rate"]


@pytest.mark.parametrize("emulation, measured", [("copy", True), ("sleep", False)])
def test_gpu_perf_measures_the_copy_engine_only_when_asked(monkeypatch, emulation: str, measured: bool) -> None:
    """``gpu-perf --device cuda --link-emulation copy`` measures the copy engine, ``sleep`` does not (G1, which
    mut33 left surviving: ``== "sleep"`` measured copies for the sleep run and ran the copy run on sleeps)."""
    import seqpar.bench.gpu_perf as gpu_perf
    import seqpar.comm.emulated as emulated

    calls: list = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda dev: None)
    monkeypatch.setattr(emulated, "sleep_cycles_per_second", lambda dev: 1e9)
    monkeypatch.setattr(emulated.CopyEngine, "measure", staticmethod(lambda dev: calls.append(dev) or "engine"))

    def stop():  # the payload's first field past the engine's choice
        raise _Seen

    monkeypatch.setattr(gpu_perf, "machine_info", stop)
    with pytest.raises(_Seen):
        gpu_perf.main(["--tiny", "--device", "cuda", "--link-emulation", emulation])
    assert calls == ([torch.device("cuda", 0)] if measured else []), calls
