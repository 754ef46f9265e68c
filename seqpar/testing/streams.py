"""The ring step as CUDA streams would run it, found without a GPU (issue 29 §8's ``hidden50``).

On a GPU the overlap of a transfer with compute is decided by **stream order and events**, not by the
order of the host's calls: :class:`~seqpar.comm.emulated.CudaLinks` puts each message on a link stream
(``wait_event(ready)``, a ``torch.cuda._sleep`` of ``bytes / B``, ``record(end)``) and a wait makes the
compute stream ``wait_event(end)``. This module plays ``gpu-perf``'s step (rank ``rank`` of a
``world``-rank ring over :class:`~seqpar.comm.loopback.LoopbackComm`, ``CudaLinks``, forward then
backward) on **fake CUDA tensors** (``FakeTensorMode``, torch's CUDA build: the fake-CUDA stage's venv)
and records, per stream and in host order, every kernel (each aten op that launches one; views and
allocations launch none), every sleep, event record and event / stream wait, ``record_stream`` and host
sync (:class:`StreamLog`). :func:`simulate` then plays that graph with modelled durations:

- an attention kernel takes ``4 * q.numel() * len_k`` FLOPs (x 0.5 causal, x 2.5 backward) at
  ``attention_flops``; its backward is modelled as FlashAttention-2's three kernels (the ``rowsum(dO * O)``
  prologue, the main kernel, the dq conversion), the short ones at memory speed;
- any other kernel moves the bytes of its tensors (inputs read, outputs written) at ``hbm`` bytes/s;
- every kernel costs ``launch`` seconds more; a sleep lasts its cycles at ``cycles_per_second``;
- a host <-> device copy on a link stream (``CudaLinks(emulation="copy")``, logged as ``"copy"``, not as a
  kernel: the copy engine runs it, no SM) lasts ``copy_fixed + bytes / copy_rate``.

Two models of when a side stream's kernel (a link's sleep) starts once its stream and events allow it:

- ``dispatch="ideal"``: at once. This is exactly what the host-side replay
  (:func:`~seqpar.comm.schedule.hidden_bound`) assumes, so on a graph with no dependency beyond the
  recorded post / wait order the two agree (:func:`host_schedule` builds that replay from the same log);
- ``dispatch="tail"``: only when the compute stream's kernel in flight at that moment ends (a kernel
  that starts at that very moment counts: the host ran ahead and queued it first). This is how the
  block scheduler of an NVIDIA GPU treats two streams of equal priority when the first kernel fills every
  SM: a later grid gets SMs only at the earlier grid's tail. A link stream of higher priority than the
  compute stream (``torch.cuda.Stream(priority=-1)``) gets the next SM a thread block frees instead,
  modelled as at once (the ``ideal`` start): that holds while the compute kernels retire thread blocks
  during their run, which a persistent kernel (one block per SM for the whole grid) would not.
  A link's copies wait for no SM under either model.

Both are models, not measurements; the durations are a roofline, not a profile.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import itertools
import os
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = [
    "Op", "StreamLog", "Timing", "record_streams", "simulate", "host_schedule", "ring_step_log", "hidden_report",
    "sm_waits",
]

MAIN = "main"
_ATTENTION = (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_flash_attention_forward", "_efficient_attention_forward",
)
# ops that launch no kernel on CUDA (allocations, metadata); views are found by OpOverload.is_view
_NO_KERNEL = {
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "alias", "lift_fresh",
    "_to_copy_meta", "set_", "_local_scalar_dense", "sym_size", "sym_stride", "sym_numel", "is_same_size",
    "resize_", "_unsafe_view", "clone_meta",
}


@dataclass
class Op:
    """One entry of a stream, in host order. ``kind``: ``"kernel"`` (``name``, ``flops``, ``nbytes``,
    ``attention``, ``backward``, ``causal``), ``"sleep"`` (``cycles``), ``"copy"`` (a host <-> device
    copy on a link stream: ``name`` ``HtoD`` / ``DtoH``, ``nbytes`` copied), ``"record"`` (``event``: the id
    of the event object recorded), ``"wait"`` (``event``, ``version``: the host index of the record it
    waits for, -1 for an event never recorded), ``"record_stream"`` or ``"host_sync"`` (``name``)."""

    index: int
    stream: str
    kind: str
    name: str = ""
    flops: float = 0.0
    nbytes: int = 0
    attention: bool = False
    backward: bool = False
    causal: bool = False
    cycles: int = 0
    event: int = -1
    version: int = -1
    where: str = ""


@dataclass
class StreamLog:
    """What :func:`record_streams` saw: ``ops`` in host order, each tagged with its stream's name
    (``"main"`` for the compute stream, ``"link0"``, ``"link1"``... in order of creation)."""

    ops: list[Op] = field(default_factory=list)
    streams: list[str] = field(default_factory=lambda: [MAIN])
    priority: dict[str, int] = field(default_factory=lambda: {MAIN: 0})
    """Each stream's CUDA priority (lower runs first; torch's default 0, high -1)."""

    def on(self, stream: str) -> list[Op]:
        return [op for op in self.ops if op.stream == stream]

    def kinds(self, stream: str) -> list[str]:
        """The stream's ops as short words (tests read these): ``kernel:name``, ``sleep``, ``copy``,
        ``record``, ``wait``, ``host_sync:name``."""
        return [f"{op.kind}:{op.name}" if op.kind in ("kernel", "host_sync") else op.kind for op in self.on(stream)]


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../seqpar


def _where() -> str:
    """``seqpar/path.py:line in function`` of the innermost seqpar frame outside this module."""
    for frame in reversed(traceback.extract_stack()):
        path = os.path.abspath(frame.filename)
        if path.startswith(_PACKAGE + os.sep) and os.sep + "testing" + os.sep not in path:
            return f"seqpar/{os.path.relpath(path, _PACKAGE)}:{frame.lineno} in {frame.name}"
    return "?"


class _Stream:
    def __init__(self, rec: _Recorder, name: str) -> None:
        self.rec, self.name = rec, name

    def wait_event(self, event: _Event) -> None:
        self.rec.add(self.name, "wait", event=event.id, version=event.version, where=_where())

    def wait_stream(self, other: _Stream) -> None:
        # CUDA: an event recorded on ``other`` now, waited on here
        marker = _Event(self.rec)
        marker.record(other)
        self.wait_event(marker)

    def synchronize(self) -> None:
        self.rec.add(MAIN, "host_sync", name="Stream.synchronize", where=_where())

    def query(self) -> bool:
        return True

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Stream) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)


class _Event:
    _ids = itertools.count()

    def __init__(self, rec: _Recorder, *args: Any, **kwargs: Any) -> None:
        self.rec, self.id, self.version = rec, next(_Event._ids), -1
        rec.events[self.id] = self

    def record(self, stream: _Stream | None = None) -> None:
        stream = stream if stream is not None else self.rec.current
        self.version = self.rec.add(stream.name, "record", event=self.id, where=_where()).index

    def synchronize(self) -> None:
        self.rec.add(MAIN, "host_sync", name="Event.synchronize", where=_where())

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: _Event) -> float:
        """0: durations are :func:`simulate`'s (``CudaLinks.finish`` is not called on a recorded step)."""
        return 0.0


def _flops(func: Any, args: tuple, kwargs: dict) -> tuple[float, bool, bool]:
    """FLOPs, causal, backward of an attention op (q ``(B, H, L, D)`` for ``_scaled_dot_product_*``,
    ``(B, L, H, D)`` for the ``_flash_`` / ``_efficient_`` entry points)."""
    bound = dict(zip((a.name for a in func._schema.arguments), args), **kwargs)
    name = func.overloadpacket.__name__
    q, k = bound.get("query"), bound.get("key")
    causal = bool(bound.get("is_causal", False) or bound.get("causal", False))
    backward = name.endswith("_backward")
    if not isinstance(q, Tensor) or not isinstance(k, Tensor):
        return 0.0, causal, backward
    len_k = k.shape[2] if name.startswith("_scaled_dot_product") else k.shape[1]
    flops = 4.0 * q.numel() * len_k * (0.5 if causal else 1.0) * (2.5 if backward else 1.0)
    return flops, causal, backward


class _Kernels(TorchDispatchMode):
    """Every aten op on CUDA tensors that launches a kernel, logged on the current stream."""

    def __init__(self, rec: _Recorder) -> None:
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if func.namespace not in ("aten", "seqpar") or getattr(func, "is_view", False) or name in _NO_KERNEL:
            return out
        tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, Tensor)]
        if not any(t.device.type == "cuda" for t in tensors):
            return out
        devices = {t.device.type for t in tensors}
        if name == "copy_" and devices == {"cpu", "cuda"} and self.rec.current.name != MAIN:
            # a host <-> device copy on a link stream: the copy engine's, no kernel (CudaLinks' copy emulation)
            dst = args[0]
            self.rec.add(self.rec.current.name, "copy", name="HtoD" if dst.device.type == "cuda" else "DtoH",
                         nbytes=dst.numel() * dst.element_size(), where=_where())
            return out
        attention = name.startswith(_ATTENTION)
        flops, causal, backward = _flops(func, args, kwargs) if attention else (0.0, False, False)
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        self.rec.add(self.rec.current.name, "kernel", name=name, flops=flops, nbytes=nbytes, attention=attention,
                     backward=backward, causal=causal, where=_where())
        return out


class _Recorder:
    def __init__(self) -> None:
        self.log = StreamLog()
        self.main = _Stream(self, MAIN)
        self.current = self.main
        self.events: dict[int, _Event] = {}

    def add(self, stream: str, kind: str, **fields: Any) -> Op:
        op = Op(len(self.log.ops), stream, kind, **fields)
        self.log.ops.append(op)
        return op

    def new_stream(self, device: Any = None, priority: int = 0, **kwargs: Any) -> _Stream:
        name = f"link{len(self.log.streams) - 1}"
        self.log.streams.append(name)
        self.log.priority[name] = priority
        return _Stream(self, name)

    @contextlib.contextmanager
    def use(self, stream: _Stream) -> Iterator[None]:
        saved, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = saved


@contextlib.contextmanager
def record_streams() -> Iterator[_Recorder]:
    """Inside ``FakeTensorMode`` (entered before): stand-ins for ``torch.cuda.Stream``, ``current_stream``,
    ``stream``, ``Event``, ``_sleep``, ``synchronize`` and ``Tensor.record_stream`` that log into the
    yielded recorder's ``log``, and a dispatch mode that logs the kernels."""
    rec = _Recorder()
    patches = {
        (torch.cuda, "Stream"): rec.new_stream,
        (torch.cuda, "current_stream"): lambda device=None: rec.current,
        (torch.cuda, "stream"): lambda stream=None: rec.use(stream) if stream is not None else contextlib.nullcontext(),
        (torch.cuda, "Event"): lambda *a, **kw: _Event(rec, *a, **kw),
        (torch.cuda, "_sleep"): lambda cycles: rec.add(rec.current.name, "sleep", cycles=int(cycles), where=_where()),
        (torch.cuda, "synchronize"): lambda device=None: rec.add(MAIN, "host_sync", name="synchronize", where=_where()),
        (Tensor, "record_stream"): lambda self, stream: rec.add(stream.name, "record_stream", where=_where()),
    }
    saved = {key: getattr(*key) for key in patches}
    for (owner, name), value in patches.items():
        setattr(owner, name, value)
    mode = _Kernels(rec)
    try:
        with mode:
            yield rec
    finally:
        for (owner, name), value in saved.items():
            setattr(owner, name, value)


# ------------------------------------------------------------------------------------------ timing
@dataclass(frozen=True)
class Timing:
    """Modelled durations (an H200 in bf16 by default; see the module docstring). ``attention_flops``:
    FLOP/s of the attention kernels; ``hbm``: bytes/s of every other kernel; ``launch``: seconds added to
    each kernel; ``cycles_per_second``: the sleep's clock (what ``CudaLinks`` was given); ``copy_rate``,
    ``copy_fixed``: a link copy's bytes/s and seconds per copy; ``backward_kernels``: model an attention
    backward as FlashAttention-2's three kernels (else one)."""

    attention_flops: float = 450e12
    hbm: float = 3.0e12
    launch: float = 3e-6
    cycles_per_second: float = 1e9
    backward_kernels: bool = True
    copy_rate: float = 50e9
    copy_fixed: float = 0.0

    def pieces(self, op: Op) -> list[float]:
        """The kernel(s) one logged op runs, in seconds."""
        if op.kind == "sleep":
            return [op.cycles / self.cycles_per_second]
        if op.kind == "copy":
            return [self.copy_fixed + op.nbytes / self.copy_rate]
        if not op.attention:
            return [self.launch + op.nbytes / self.hbm]
        main = self.launch + op.flops / self.attention_flops
        if not (op.backward and self.backward_kernels):
            return [main]
        # prologue rowsum(dO * O) reads about a third of the op's tensors; the dq conversion a sixth
        return [self.launch + op.nbytes / 3 / self.hbm, main, self.launch + op.nbytes / 6 / self.hbm]


def simulate(log: StreamLog, timing: Timing, dispatch: str = "ideal") -> dict[str, Any]:
    """Play ``log``'s streams with ``timing``; ``dispatch`` ``"ideal"`` or ``"tail"`` (module docstring).

    Returns ``t_step`` (the last op's end), ``t_compute`` (the compute stream's kernel time), per op
    index its ``start`` / ``end``, per record its time (``times``) and, under ``"tail"``, how long the
    sleeps waited for an SM (``sm_wait_s`` in all; ``sm_waits``: per sleep, with the compute kernel it
    waited behind)."""
    if dispatch not in ("ideal", "tail"):
        raise ValueError(f"simulate: dispatch must be 'ideal' or 'tail', not {dispatch!r}")
    queues = {s: log.on(s) for s in log.streams}
    pos = dict.fromkeys(queues, 0)
    free = dict.fromkeys(queues, 0.0)
    done: dict[int, float] = {}  # record index -> time
    start: dict[int, float] = {}
    end: dict[int, float] = {}
    main_kernels: list[tuple[float, float, Op]] = []  # (start, end, op) of each compute-stream kernel piece
    sm_wait: list[dict[str, Any]] = []

    def ready_at(op: Op, stream: str) -> float | None:
        if op.kind == "wait" and op.version >= 0:
            return None if op.version not in done else max(free[stream], done[op.version])
        return free[stream]

    while True:
        # the next op to run: the earliest ready one; ties go to the compute stream (queued first)
        best = None
        for s, q in queues.items():
            if pos[s] < len(q):
                t = ready_at(q[pos[s]], s)
                if t is not None and (best is None or (t, s != MAIN) < (best[0], best[1] != MAIN)):
                    best = (t, s)
        if best is None:
            if any(pos[s] < len(q) for s, q in queues.items()):
                stuck = [q[pos[s]] for s, q in queues.items() if pos[s] < len(q)]
                raise RuntimeError(f"simulate: the streams deadlock at {stuck}")
            break
        t, s = best
        op = queues[s][pos[s]]
        pos[s] += 1
        if op.kind in ("kernel", "sleep", "copy"):
            begin = t
            if op.kind == "sleep" and s != MAIN and dispatch == "tail" and log.priority.get(s, 0) >= log.priority[MAIN]:
                inflight = [(e, k) for b, e, k in main_kernels if b <= t < e]
                if inflight:
                    begin = inflight[-1][0]
                sm_wait.append({"sleep": op.index, "where": op.where, "wait": begin - t,
                                "behind": inflight[-1][1].name if inflight else None,
                                "behind_where": inflight[-1][1].where if inflight else None})
            now = begin
            for piece in timing.pieces(op):
                if s == MAIN:
                    main_kernels.append((now, now + piece, op))
                now += piece
            start[op.index], end[op.index] = begin, now
            free[s] = now
        else:
            start[op.index] = end[op.index] = t
            free[s] = t
            if op.kind == "record":
                done[op.index] = t
    return {
        "t_step": max(free.values()),
        "t_compute": sum(e - b for b, e, _ in main_kernels),
        "start": start, "end": end, "times": done,
        "sm_wait_s": sum(w["wait"] for w in sm_wait), "sm_waits": sm_wait,
    }


def host_schedule(log: StreamLog, timing: Timing) -> list[Any]:
    """The host-side schedule of ``log`` as :func:`~seqpar.comm.schedule.hidden_bound` replays it
    (what ``gpu-perf``'s ``hidden_max_50`` is): the compute stream's kernels as ``compute`` events in
    host order, each link sleep a ``post`` on its link (``nbytes`` = its cycles: replay with
    ``lambda c: c / timing.cycles_per_second``; a link copy posts its modelled seconds in those cycles),
    and each compute-stream wait on a link's event the ``wait`` of the sleeps recorded before it."""
    from seqpar.comm.schedule import Event

    events: list[Any] = []
    last_sleep: dict[str, int] = {}  # link stream -> index of its last sleep
    recorded_after: dict[int, int] = {}  # record index on a link -> the sleep it follows
    for op in log.ops:
        if op.stream == MAIN and op.kind == "kernel":
            events.append(Event("compute", seconds=sum(timing.pieces(op))))
        elif op.kind in ("sleep", "copy") and op.stream != MAIN:
            last_sleep[op.stream] = op.index
            cycles = op.cycles if op.kind == "sleep" else sum(timing.pieces(op)) * timing.cycles_per_second
            events.append(Event("post", xid=op.index, nbytes=cycles, link=(op.stream,)))
        elif op.kind == "record" and op.stream != MAIN and op.stream in last_sleep:
            recorded_after[op.index] = last_sleep[op.stream]
        elif op.kind == "wait" and op.stream == MAIN and op.version in recorded_after:
            events.append(Event("wait", xid=recorded_after[op.version]))
    return events


# ------------------------------------------------------------------------------------------ the ring step
def ring_step_log(*, world: int = 8, rank: int = 4, seq_local: int = 16384, causal: bool = True,
                  layout: str = "hf", q_heads: int = 32, kv_heads: int = 8, head_dim: int = 128,
                  bandwidth: float | None = 50e9, dtype: torch.dtype = torch.bfloat16,
                  cudnn_version: int = 91900, cycles_per_second: float = 1e9, high_priority: bool = True,
                  emulation: str = "sleep", copy_rate: Any = None, copy_buffer_bytes: int = 64 << 20) -> StreamLog:
    """``gpu-perf``'s step (rank ``rank`` of ``world``, Llama-3-8B heads, bf16, causal zigzag or full
    contiguous sharding, inputs in ``layout`` ``"hf"`` or ``"contiguous"``, head_chunks 1) over
    ``CudaLinks(bandwidth)`` on fake CUDA tensors, as an H200 runs it (sm90, cuDNN ``cudnn_version``:
    cuDNN attention first from 9.15 on, as torch does). ``high_priority``: ``CudaLinks``' link streams'
    priority (False: torch's default, as before issue 29 §8's fix). ``emulation``: ``CudaLinks``' link
    emulation, ``"copy"`` with a :class:`~seqpar.comm.emulated.CopyRate` ``copy_rate`` for both directions
    (default: 1 byte a cycle, so a copy's bytes are the sleep's cycles) and staging buffers of
    ``copy_buffer_bytes``. Needs torch's CUDA build."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import seqpar.kernels.backends as backends
    from seqpar.attn.common import AttentionOptions
    from seqpar.attn.ring import ring_attention_backward, ring_attention_forward
    from seqpar.comm.emulated import CudaLinks, EmulatedRing
    from seqpar.comm.loopback import LoopbackComm
    from seqpar.testing.syncs import SyncChecker, simulated_gpu

    known = {f.name for f in dataclasses.fields(backends.DeviceCaps)}  # (older trees have fewer fields)
    caps = backends.DeviceCaps((9, 0), **{k: v for k, v in (("cudnn_version", cudnn_version), ("cuda_major", 13),
                                                             ("total_memory", 150_000_000_000), ("sm_count", 132))
                                          if k in known})
    saved_caps = backends.device_caps
    backends.device_caps = lambda device: caps
    try:
        with simulated_gpu("h100"), FakeTensorMode(allow_non_fake_inputs=True), SyncChecker() as checker, \
                record_streams() as rec:
            def make(heads: int) -> Tensor:
                if layout == "hf":
                    return torch.empty(1, seq_local, heads, head_dim, device="cuda", dtype=dtype).transpose(1, 2)
                return torch.empty(1, heads, seq_local, head_dim, device="cuda", dtype=dtype)

            with checker.paused():
                q, k, v, dout = make(q_heads), make(kv_heads), make(kv_heads), make(q_heads)
                engine = None
                if emulation != "sleep":  # (older trees have the sleep only)
                    from seqpar.comm.emulated import CopyEngine, CopyRate

                    rate = copy_rate or CopyRate(0.0, cycles_per_second)
                    engine = CopyEngine(torch.device("cuda", 0), {"h2d": rate, "d2h": rate},
                                        buffer_bytes=copy_buffer_bytes)
            rec.log.ops.clear()  # the inputs' creation is no part of the step
            opts = AttentionOptions(causal=causal, scale=head_dim ** -0.5,
                                    sharding="zigzag" if causal else "contiguous", head_chunks=1)
            params = inspect.signature(CudaLinks).parameters
            extra: dict[str, Any] = {"high_priority": high_priority} if "high_priority" in params else {}
            if engine is not None:
                extra.update(emulation=emulation, copies=engine)
            links = CudaLinks(bandwidth, device=torch.device("cuda", 0), cycles_per_second=cycles_per_second, **extra)
            comm = EmulatedRing(LoopbackComm(rank, world, transfer=False), links)
            with checker.layer("ring_forward"):
                out, lse = ring_attention_forward(q, k, v, comm, opts)
            with checker.layer("ring_backward"):
                ring_attention_backward(dout, q, k, v, out, lse, comm, opts)
    finally:
        backends.device_caps = saved_caps
    return rec.log


def hidden_report(log: StreamLog, timing: Timing) -> dict[str, Any]:
    """``hidden`` as ``gpu-perf`` computes it, from ``log`` (a step over emulated links) under ``timing``:
    ``t_compute`` (the compute stream alone: transfers free), ``t_transfer`` (the schedule's transfers
    alone), ``host_bound`` (the host-side replay of the recorded post / wait order: ``hidden_max_50``)
    and, per dispatch model, ``t_step`` and ``hidden``, with the sleeps' total wait for an SM."""
    from seqpar.comm.schedule import hidden, hidden_bound, replay

    events = host_schedule(log, timing)

    def per_cycle(c: int) -> float:
        return c / timing.cycles_per_second

    bound = hidden_bound(events, per_cycle)
    t_c, t_t = bound["t_compute"], replay(events, per_cycle, compute=False)
    report: dict[str, Any] = {"t_compute": t_c, "t_transfer": t_t, "host_bound": bound["hidden"],
                              "host_t_step": bound["t_step"]}
    for model in ("ideal", "tail"):
        sim = simulate(log, timing, model)
        report[model] = {"t_step": sim["t_step"], "hidden": hidden(t_c, t_t, sim["t_step"]),
                         "sm_wait_s": sim["sm_wait_s"]}
    return report


def sm_waits(log: StreamLog, timing: Timing) -> list[dict[str, Any]]:
    """Under ``dispatch="tail"``, each link sleep's wait for an SM, summed by the compute kernel it
    waited behind (op and source line), largest first."""
    total: dict[tuple, list] = {}
    for w in simulate(log, timing, "tail")["sm_waits"]:
        entry = total.setdefault((w["behind"], w["behind_where"]), [0, 0.0])
        entry[0] += 1
        entry[1] += w["wait"]
    return [{"behind": k[0], "behind_where": k[1], "sleeps": n, "wait_s": t}
            for k, (n, t) in sorted(total.items(), key=lambda kv: -kv[1][1])]


def _table(rows: Sequence[dict[str, Any]], keys: Sequence[str]) -> str:
    return "\n".join(" | ".join(str(r.get(k)) for k in keys) for r in rows)


def main(argv: Sequence[str] | None = None) -> int:  # pragma: no cover - a report for a person
    """``python -m seqpar.testing.streams [--seq-local L] [--layout hf|contiguous] [--causal yes|no]``:
    the simulated hidden at 50 GB/s for gpu-perf's step, both dispatch models."""
    import argparse
    import json

    p = argparse.ArgumentParser(prog="python -m seqpar.testing.streams", description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-local", type=int, default=16384)
    p.add_argument("--layout", default="hf", choices=("hf", "contiguous"))
    p.add_argument("--causal", default="yes", choices=("yes", "no"))
    p.add_argument("--gbps", type=float, default=50.0)
    p.add_argument("--attention-tflops", type=float, default=450.0)
    p.add_argument("--delays", action="store_true", help="list the sleeps' modelled SM waits by the kernel in flight")
    p.add_argument("--link-priority", default="high", choices=("high", "normal"))
    p.add_argument("--link-emulation", default="sleep", choices=("sleep", "copy"),
                   help="copy: the links held by copies at --copy-gbps, 10 us a copy")
    p.add_argument("--copy-gbps", type=float, default=52.0)
    args = p.parse_args(argv)
    copy_rate = None
    if args.link_emulation == "copy":
        from seqpar.comm.emulated import CopyRate

        copy_rate = CopyRate(10e-6, args.copy_gbps * 1e9)
    log = ring_step_log(seq_local=args.seq_local, layout=args.layout, causal=args.causal == "yes",
                        bandwidth=args.gbps * 1e9, high_priority=args.link_priority == "high",
                        emulation=args.link_emulation, copy_rate=copy_rate)
    timing = Timing(attention_flops=args.attention_tflops * 1e12,
                    **({} if copy_rate is None else {"copy_rate": copy_rate.rate, "copy_fixed": copy_rate.fixed}))
    report = hidden_report(log, timing)
    print(json.dumps(report, indent=1))
    if args.delays:
        print(_table(sm_waits(log, timing), ("behind", "behind_where", "sleeps", "wait_s")))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())


