"""Activation offload on a model spread over two GPUs (``device_map="auto"``, a pipeline stage per device): each
tensor's copies are issued on a side stream of the device that holds it, and ordered against that device's compute
stream. ``CudaTransfer`` kept one side stream, made for the first device it saw, for every device: a layer on the
second GPU then copied outside that stream (``torch.cuda.stream(s)`` sets the current stream of ``s``'s device only),
so the event recorded on it ordered nothing, and ``record_stream`` received another device's stream.

CPU only: ``torch.cuda``'s stream, event and pinning calls are replaced by recorders (as the fake-CUDA stage's
offload scenario does), and each "GPU tensor" is a CPU tensor that reports a CUDA device, so ``CudaTransfer``'s own
code runs and every stream it touches is checked against the device of the tensor it serves."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from seqpar.memory.offload import CudaTransfer


class _OnDevice(torch.Tensor):
    """A CPU tensor that reports ``device`` (a CUDA device): what CudaTransfer reads of a GPU tensor."""

    _where: torch.device

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return self._where

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


def _on(device: str, t: torch.Tensor) -> _OnDevice:
    out = torch.Tensor._make_subclass(_OnDevice, t)
    out._where = torch.device(device)
    return out


class _Stream:
    def __init__(self, log: list[tuple[Any, ...]], device: torch.device, name: str) -> None:
        self.log, self.device, self.name = log, torch.device(device), name

    def wait_stream(self, other: _Stream) -> None:
        self.log.append(("wait_stream", self, other))

    def wait_event(self, event: _Event) -> None:
        self.log.append(("wait_event", self, event))


class _Event:
    def __init__(self, log: list[tuple[Any, ...]]) -> None:
        self.log, self.stream = log, None

    def record(self, stream: _Stream) -> None:
        self.stream = stream
        self.log.append(("record", stream, self))


@contextlib.contextmanager
def _recording_cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[list[tuple[Any, ...]], list[_Stream | None]]]:
    """Recorders for the calls CudaTransfer makes; yields (log, the entered stream stack)."""
    log: list[tuple[Any, ...]] = []
    entered: list[_Stream | None] = [None]
    compute = {}
    empty = torch.empty

    def current_stream(device: Any = None) -> _Stream:
        device = torch.device(device)
        return compute.setdefault(device, _Stream(log, device, f"compute {device}"))

    @contextlib.contextmanager
    def stream(s: _Stream) -> Iterator[None]:
        entered.append(s)
        try:
            yield
        finally:
            entered.pop()

    def pinned_empty(*args: Any, **kwargs: Any) -> torch.Tensor:
        kwargs.pop("pin_memory", None)
        return empty(*args, **kwargs)

    def copy_(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        log.append(("copy", entered[-1], src.device))  # the stream this copy was issued on, and its source
        with torch.no_grad():
            self.set_(src.as_subclass(torch.Tensor).clone())
        return self

    def to(self: torch.Tensor, device: Any, non_blocking: bool = False) -> torch.Tensor:
        log.append(("copy", entered[-1], torch.device(device)))
        return _on(str(device), self.clone())

    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None, **kw: _Stream(log, device, f"side {device}"))
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **kw: _Event(log))
    monkeypatch.setattr(torch, "empty", pinned_empty)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: log.append(("record_stream", s, self.device)))
    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    monkeypatch.setattr(torch.Tensor, "to", to)
    yield log, entered


def test_each_device_copies_on_its_own_side_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(3)
    values = {d: torch.randn(2, 5, 4, generator=gen) for d in ("cuda:0", "cuda:1")}
    transfer = CudaTransfer()
    with _recording_cuda(monkeypatch) as (log, _):
        # forward: layer 0 on cuda:0, layer 1 on cuda:1; backward in reverse order
        handles = {d: transfer.to_host(_on(d, v)) for d, v in values.items()}
        back = {d: transfer.fetch(transfer.prefetch(handles[d])) for d in reversed(list(values))}

    for d, v in values.items():  # the values came back, to the device they left
        assert back[d].device == torch.device(d)
        torch.testing.assert_close(back[d].as_subclass(torch.Tensor), v, rtol=0, atol=0)

    copies = [e for e in log if e[0] == "copy"]
    assert len(copies) == 4, log
    for _, on, device in copies:  # every copy is issued on a side stream of the tensor's own device
        assert on is not None and on.name.startswith("side") and on.device == device, (on and on.name, device)
    sides = {on for _, on, _ in copies}
    assert {s.device for s in sides} == {torch.device("cuda:0"), torch.device("cuda:1")} and len(sides) == 2
    for kind, s, device in (e for e in log if e[0] == "record_stream"):  # memory handed to a stream of its device
        assert s.device == device, (s.name, device)
    for kind, s, other in (e for e in log if e[0] == "wait_stream"):  # the side stream waits for its device's compute
        assert s.device == other.device and other.name.startswith("compute"), (s.name, other.name)
    for kind, s, event in (e for e in log if e[0] == "wait_event"):  # events cross no device
        assert s.device == event.stream.device, (s.name, event.stream.name)


def test_one_device_keeps_one_side_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every layer on one GPU: one side stream for all copies (a stream per call would serialise nothing)."""
    transfer = CudaTransfer()
    gen = torch.Generator().manual_seed(4)
    with _recording_cuda(monkeypatch) as (log, _):
        handles = [transfer.to_host(_on("cuda:0", torch.randn(3, 4, generator=gen))) for _ in range(3)]
        for h in reversed(handles):
            transfer.fetch(transfer.prefetch(h))
    assert len({on for kind, on, *_ in log if kind == "copy"}) == 1
