"""Audit 33: the copy-engine link emulation (``seqpar.comm.emulated``: ``CopyEngine``, ``rate_from_two``,
``CudaLinks(emulation="copy")``) where session 32's tests did not reach: each direction's own rate, the copies
asynchronous, the calibration's refusals at their edges, the median of the timed runs without the warm-up, an
engine measured when none is given, and a link's latency in the copies' time.

The engine's arithmetic runs on CPU tensors (``pin=False``: the copies are plain ``copy_`` calls); ``CudaLinks``
needs torch's CUDA build (fake CUDA tensors and ``seqpar.testing.streams.record_streams``), as
tests/test_cuda_streams.py's copy tests do.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from seqpar.comm import emulated
from seqpar.comm.emulated import CopyEngine, CopyRate, copy_pieces, rate_from_two

needs_cuda_build = pytest.mark.skipif(
    not torch.backends.cuda.is_built(), reason="needs torch's CUDA build (fake CUDA tensors through CudaLinks)"
)


class _Copies(TorchDispatchMode):
    """Each ``aten.copy_``'s destination bytes and its ``non_blocking`` flag."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[int, bool]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if func.overloadpacket.__name__ == "copy_":
            non_blocking = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
            self.seen.append((args[0].numel() * args[0].element_size(), bool(non_blocking)))
        return func(*args, **kwargs)


def test_each_direction_is_held_at_its_own_rate_by_asynchronous_copies() -> None:
    """``issue`` sizes a direction's copies at that direction's measured rate (host -> device 10 GB/s + 1 us, device
    -> host 40 GB/s + 5 us: 10 us are 90,000 and 200,000 bytes) and queues them ``non_blocking`` (a blocking copy
    from pinned memory makes the host wait for the link: every transfer exposed).

    Seen failing (audit 33): with ``issue`` sizing every direction at ``rates["h2d"]`` (E18): d2h [90000] where
    [200000] are due; with the host -> device copy blocking (``non_blocking=True`` dropped, E17): the flag False."""
    rates = {"h2d": CopyRate(1e-6, 10e9), "d2h": CopyRate(5e-6, 40e9)}
    engine = CopyEngine(torch.device("cpu"), rates, buffer_bytes=1 << 20, pin=False)
    for direction, due in (("h2d", 90_000), ("d2h", 200_000)):
        with _Copies() as spy:
            sizes = engine.issue(direction, 10e-6)
        assert sizes == copy_pieces(10e-6, rates[direction], 1 << 20) == [due], (direction, sizes)
        assert spy.seen == [(due, True)], (direction, spy.seen)
        assert rates[direction].seconds(sum(sizes)) == pytest.approx(10e-6, abs=1 / rates[direction].rate)


def test_the_calibration_refuses_equal_times_and_a_small_copy_not_smaller() -> None:
    """A broken measurement is refused by name with the fix, at its edges too: the two copies timed alike (a divide
    by zero otherwise) and the "small" copy not smaller than the big one (a negative or zero rate otherwise).

    Seen failing (audit 33): with ``t_big < t_small`` in place of ``<=`` (E15): ZeroDivisionError; without the
    ``big <= small`` check (E16): no error, a rate of -1.0e12 bytes/s returned."""
    small, big = 1 << 16, 64 << 20
    with pytest.raises(ValueError, match="copy calibration.*--link-emulation sleep"):
        rate_from_two(small, 1e-3, big, 1e-3)
    with pytest.raises(ValueError, match="copy calibration.*--link-emulation sleep"):
        rate_from_two(big, 1e-6, small, 2e-6)
    with pytest.raises(ValueError, match="copy calibration.*--link-emulation sleep"):
        rate_from_two(small, 1e-6, small, 2e-6)


class _ScriptedEvent:
    """A CUDA event whose ``elapsed_time`` answers the next of a scripted list of milliseconds."""

    script: list[float] = []
    id, version = -1, -1  # what the recorder's stream waits read

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        pass

    def record(self, stream=None) -> None:  # noqa: ANN001
        pass

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end) -> float:  # noqa: ANN001
        return _ScriptedEvent.script.pop(0)


@needs_cuda_build
def test_the_calibration_takes_the_median_run_without_the_warm_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """``CopyEngine.measure`` with each timed run's time scripted (ms, in the order they are read): per direction
    and size three runs after an untimed warm-up (the first copy: cold pages); each direction's rate is
    ``rate_from_two`` of its own two medians, and no time is read beyond the three runs (the warm-up's is not).

    Seen failing (audit 33): with the warm-up timed among the runs (``if i:`` -> ``if True:``, E11): 16 times read
    where 12 runs are timed (IndexError: pop from empty list); with the slowest run in place of the median (E19)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from seqpar.testing.streams import record_streams
    from seqpar.testing.syncs import simulated_gpu

    small, big = 1 << 10, 1 << 20
    runs = {  # direction -> size -> the three timed runs in ms; the medians differ per direction
        "h2d": {small: (0.0113, 0.0109, 0.0111), big: (0.0300, 0.0290, 0.0310)},
        "d2h": {small: (0.0130, 0.0120, 0.0125), big: (0.0420, 0.0400, 0.0410)},
    }
    script = [t for d in ("h2d", "d2h") for n in (small, big) for t in runs[d][n]]
    with simulated_gpu("h100"), FakeTensorMode(allow_non_fake_inputs=True), record_streams():
        with monkeypatch.context() as mp:  # undone before record_streams restores its own Event
            mp.setattr(_ScriptedEvent, "script", list(script))
            mp.setattr(torch.cuda, "Event", _ScriptedEvent)
            engine = emulated.CopyEngine.measure(torch.device("cuda", 0), buffer_bytes=big, small=small)
            assert _ScriptedEvent.script == [], _ScriptedEvent.script
    for d in ("h2d", "d2h"):
        t_small, t_big = (sorted(runs[d][n])[1] * 1e-3 for n in (small, big))
        assert engine.rates[d] == rate_from_two(small, t_small, big, t_big), (d, engine.rates[d])


@needs_cuda_build
def test_copy_links_measure_an_engine_when_none_is_given_and_hold_the_latency(monkeypatch: pytest.MonkeyPatch) -> None:
    """``CudaLinks(emulation="copy")`` without ``copies`` measures one (gpu-perf and overlap pass theirs; a user of
    the class may not), free links measure none, and a message's copies last ``latency + bytes / bandwidth``: at
    1 GB/s and 20 us latency a 4096-byte message is held by 24,096 bytes at a 1 GB/s copy rate with no fixed cost.

    Seen failing (audit 33): with ``self.copies = copies`` (no engine measured, E9): AttributeError ('NoneType' has
    no 'issue') at the first post; with the copies sized by ``nbytes / bandwidth`` (the latency left out, E8):
    [4096] where [24096] are due."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from seqpar.comm.emulated import CudaLinks
    from seqpar.testing.streams import record_streams
    from seqpar.testing.syncs import simulated_gpu

    dev = torch.device("cuda", 0)
    made = []
    with simulated_gpu("h100"), FakeTensorMode(allow_non_fake_inputs=True), record_streams() as rec:
        engine = CopyEngine(dev, {"h2d": CopyRate(0.0, 1e9), "d2h": CopyRate(0.0, 1e9)}, buffer_bytes=1 << 20)
        monkeypatch.setattr(emulated.CopyEngine, "measure", classmethod(lambda cls, device, **kw: made.append(device)
                                                                          or engine))
        free = CudaLinks(None, device=dev, emulation="copy")
        assert made == [] and free.copies is None
        links = CudaLinks(1e9, 20e-6, device=dev, emulation="copy")
        assert made == [dev] and links.copies is engine
        links.post([(("send", 1), 4096), (("recv", 1), 4096)], None, 0)
    copies = [o for o in rec.log.ops if o.kind == "copy"]
    assert sorted((o.name, o.nbytes) for o in copies) == [("DtoH", 24_096), ("HtoD", 24_096)], copies


def test_every_piece_is_at_least_one_byte() -> None:
    """``copy_pieces``' promise (each copy at least one byte): at 1 byte/s, 1 s a copy and a 1-byte buffer, 3 s need
    two copies (one alone would carry 2 bytes), which leave 1 byte for two pieces: refused by name, never a
    zero-byte piece (a copy of nothing is no copy: its fixed second would be missing from the link's time).

    Seen failing (audit 33): with the refusal at ``total < 1`` in place of ``total < k`` (E2): [1, 0] returned."""
    with pytest.raises(ValueError, match=r"less than 2 copies of at least one byte.*--link-emulation sleep"):
        copy_pieces(3.0, CopyRate(1.0, 1.0), 1)
    assert copy_pieces(2.0, CopyRate(1.0, 1.0), 1) == [1]  # one copy of one byte: 2 s
