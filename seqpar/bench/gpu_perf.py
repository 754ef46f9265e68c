"""``python -m seqpar.bench gpu-perf --out DIR [--budget-s 240]``: the ring's speed on one GPU (issue 29 §8).

One process plays rank ``--rank`` (default 4) of a ``--world``-rank ring (default 8) with the unchanged
ring code: a loopback communicator hands the rank its own blocks back (the causal plan still follows
each source rank, so a rank in the middle of a zigzag ring meets both half-block kinds), over an
emulated link (:class:`~seqpar.comm.emulated.CudaLinks`: each directed link a side stream held by a
calibrated ``torch.cuda._sleep`` or, ``--link-emulation copy``, by host <-> device copies, FIFO, ``bytes /
bandwidth``; the host never blocks).

Setup (the defaults): Llama-3-8B's attention heads (32 query, 8 K/V heads of 128), bf16, batch 1;
causal zigzag and full (contiguous) masks; ``L`` = 8K, 32K, 16K, 4K tokens per rank; ``head_chunks`` 1
and ``"auto"``; inputs in the Hugging Face memory layout (``(batch, seq, heads, dim)`` seen transposed:
``"hf"``) and contiguous ``(batch, heads, seq, dim)``. Every time is forward + backward, the median of
``--repeats`` after a warm-up, timed with CUDA events around the step (``time.perf_counter`` on CPU).
Per case:

- ``t_sdpa_local``: one SDPA call (``enable_gqa``) on the local shard, same mask kind and layout, its
  repeats interleaved with the ring step's ``t_compute`` repeats (below); ``t_sdpa_alone`` the same call
  timed alone before the ring, as the tables up to 0dbebd6 measured it (there the same 8K block measured
  6.48-7.06 ms across four cases of one configuration, moving eta by +-4%);
- ``t_compute``: the ring step with free links (transfers cost nothing);
- ``t_step_400``: the ring step over an emulated 400 GB/s link;
- ``eta = P * t_sdpa_local / t_step_400`` (ring-flash-attn's metric includes its real transfers, so ours
  includes emulated ones) and ``eta_compute = P * t_sdpa_local / t_compute``; ``eta_alone`` with
  ``t_sdpa_alone``; ``slow_400 = t_step_400 / t_compute - 1``;
- ``t_floor``: the sum of bare SDPA calls (forward + backward, contiguous inputs) on the plan's exact
  block shapes, every hop and head chunk; ``glue = t_compute / t_floor - 1``. Measured once per set of
  block shapes (mask, ``L`` and resolved head chunks; the layout does not change them), in the first
  case that needs it, with its repeats interleaved with that case's ``t_compute`` repeats (ring step,
  then every floor call, ``--repeats`` times; each the median of as many runs), so that both drift
  alike; later cases reuse it (``t_floor_from``: the case it was measured in). Two cases of one
  configuration then differ in glue only by their ``t_compute``;
- at ``L`` = 16K (``--hidden-at``): ``t_step_50`` over a 50 GB/s link, ``t_transfer_50`` (the recorded
  schedule's transfers alone on the link model, :func:`~seqpar.comm.schedule.replay`), ``hidden_50 =
  (t_compute + t_transfer - t_step) / min(t_compute, t_transfer)`` and ``hidden_max_50``, what the
  recorded schedule allows at best (:func:`~seqpar.comm.schedule.hidden_bound`); on CUDA also
  ``link_lag_50`` (one more step with each message timed on its link stream: the seconds the messages
  took beyond ``bytes / B`` in all, ``link_lag_50_max`` the largest: waiting for an SM, or a sleep clock
  slower than calibrated; ``link_model_50`` what they should take, bytes / B summed) and, with ``--trace
  DIR``, that step's profiler trace, from which ``link_sleep_run_50`` sums the sleeps' own device time
  (:func:`sleep_kernels`: beyond ``link_model_50`` a slow sleep clock, the rest of the lag SM wait). The
  link streams run at high CUDA priority (``--link-priority normal``: torch's default, as before issue 29
  §8's fix; see :class:`~seqpar.comm.emulated.CudaLinks`). ``--link-emulation copy`` holds each message
  with pinned host <-> device copies sized to its time (:class:`~seqpar.comm.emulated.CopyEngine`,
  measured once per run: ``copy_rates`` in the JSON) instead of the sleep: the copy engine runs them, no
  SM, so a sleep's SM wait cannot arise; the trace then gives ``link_copy_run_50`` (the copies' own
  device time, :func:`sleep_kernels`) in the sleeps' place;
- ``peak``: the peak bytes of a ring step (inputs created inside) over those of one SDPA forward +
  backward on the local shard (:func:`~seqpar.bench.runner.peak_memory`: ``max_memory_allocated``
  above the allocation before), beside ``peak_theory``, the sum of the buffers the ring holds at its
  backward's peak (:func:`theory_peak`, term by term in ``peak_terms``);
- at 8K, for the first case of each mask: ``profile``, one step's kernel time split into attention
  kernels and the rest (elementwise, copies, reductions), from ``torch.profiler``.

Cases run most important first (8K and 32K at head_chunks 1 in the HF layout, then 16K's hidden, then
the rest); ``DIR/gpu_perf.json`` is rewritten after every case, and a case whose estimated time does
not fit in what is left of ``--budget-s`` is listed as skipped. ``--device cpu`` (or no GPU) runs the
same code on the CPU with the host-clock link of :class:`~seqpar.comm.emulated.EmulatedLinks`; with
``--tiny`` at toy sizes (the tests).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from seqpar.bench.report import format_table, machine_info, write_json
from seqpar.bench.runner import peak_memory, resolve_device, sync

__all__ = ["Shape", "Case", "cases", "theory_peak", "run_case", "run", "main", "build_parser", "excess_50",
           "table_markdown", "table_main", "sleep_kernels"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_ATTENTION_KERNELS = ("flash", "fmha", "attention", "attn", "cudnn", "sdpa", "mha")


@dataclass(frozen=True)
class Shape:
    """The attention shape every case shares."""

    world: int = 8
    rank: int = 4
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    batch: int = 1
    dtype: str = "bf16"


@dataclass(frozen=True)
class Case:
    """One measured configuration: ``seq_local`` tokens per rank, mask, head chunks, input layout."""

    seq_local: int
    causal: bool
    head_chunks: int | str
    layout: str  # "hf" ((batch, seq, heads, dim) seen transposed) or "contiguous"

    @property
    def label(self) -> str:
        return (f"L={self.seq_local} {'causal' if self.causal else 'full'} hc={self.head_chunks} {self.layout}")


def cases(seq_locals: Sequence[int], head_chunks: Sequence[int | str] = (1, "auto"),
          layouts: Sequence[str] = ("hf", "contiguous")) -> list[Case]:
    """Every case, most important first: the first ``head_chunks`` in the first layout for each ``L``
    (in the given order), then the other head chunks, then the other layouts."""
    out: list[Case] = []
    for layout in layouts:
        for hc in head_chunks:
            for seq in seq_locals:
                for causal in (True, False):
                    out.append(Case(seq, causal, hc, layout))
    return out


# ------------------------------------------------------------------------------------------ inputs
def _inputs(shape: Shape, case: Case, device: torch.device, seed: int = 0, *, grad: bool = True
            ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """q ``(batch, q_heads, L, head_dim)``, k, v ``(batch, kv_heads, L, head_dim)`` and dout like q, in
    the case's memory layout (``"hf"``: each a ``(batch, L, heads, dim)`` buffer seen transposed)."""
    g = torch.Generator(device=device).manual_seed(seed)
    dtype = _DTYPES[shape.dtype]

    def make(heads: int) -> Tensor:
        if case.layout == "hf":
            return torch.randn(shape.batch, case.seq_local, heads, shape.head_dim, generator=g, device=device,
                               dtype=dtype).transpose(1, 2)
        return torch.randn(shape.batch, heads, case.seq_local, shape.head_dim, generator=g, device=device,
                           dtype=dtype)

    q, k, v, dout = make(shape.q_heads), make(shape.kv_heads), make(shape.kv_heads), make(shape.q_heads)
    if grad:
        for t in (q, k, v):
            t.requires_grad_()
    return q, k, v, dout


def _options(shape: Shape, case: Case, device: torch.device | None = None) -> Any:
    """The ring's options for ``case``; ``head_chunks="auto"`` resolved as ``seqpar.attention`` resolves it
    on ``device`` (on a GPU from the shapes and the device's total memory, else the CPU rule)."""
    from seqpar.attn import resolve_head_chunks
    from seqpar.attn.checks import GpuCall
    from seqpar.attn.common import AttentionOptions

    gpu = None
    if device is not None and device.type == "cuda":
        from seqpar.kernels.backends import device_caps

        e = torch.finfo(_DTYPES[shape.dtype]).bits // 8
        gpu = GpuCall(device_caps(device), shape.batch, shape.q_heads, shape.kv_heads, case.seq_local, shape.head_dim,
                      shape.head_dim, e, shape.world)
    return AttentionOptions(causal=case.causal, scale=shape.head_dim ** -0.5,
                            sharding="zigzag" if case.causal else "contiguous",
                            head_chunks=resolve_head_chunks(case.head_chunks, shape.kv_heads, gpu))


# ------------------------------------------------------------------------------------------ timing
class _Clock:
    """Times a step: CUDA events on the current stream (the host may run ahead), else perf_counter."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def time(self, step: Callable[[], None], *, warmup: int, repeats: int) -> list[float]:
        for _ in range(warmup):
            step()
        sync(self.device)
        out = []
        for _ in range(repeats):
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                step()
                end.record()
                end.synchronize()
                out.append(start.elapsed_time(end) * 1e-3)
            else:
                t0 = time.perf_counter()
                step()
                out.append(time.perf_counter() - t0)
        return out


def _links(device: torch.device, bandwidth: float | None, cycles: float | None, *, high_priority: bool = True,
           time_links: bool = False, copies: Any = None) -> Any:
    """``copies``: a :class:`~seqpar.comm.emulated.CopyEngine` for the copy emulation (None: the sleep)."""
    if device.type == "cuda":
        from seqpar.comm.emulated import CudaLinks

        extra = {} if copies is None else {"emulation": "copy", "copies": copies}
        return CudaLinks(bandwidth, device=device, cycles_per_second=cycles, high_priority=high_priority,
                         time_links=time_links, **extra)
    from seqpar.comm.emulated import EmulatedLinks, LinkClock

    return EmulatedLinks(bandwidth, clock=LinkClock("wall"))


def _ring_step(shape: Shape, case: Case, inputs: Sequence[Tensor], make_links: Callable[[], Any],
               device: torch.device | None = None) -> Callable[[], Any]:
    """One forward + backward of the played rank over fresh links (returned for their trace)."""
    from seqpar.attn.ring import RingAttention
    from seqpar.comm.emulated import EmulatedRing
    from seqpar.comm.loopback import LoopbackComm

    q, k, v, dout = inputs
    opts = _options(shape, case, device)

    def step() -> Any:
        links = make_links()
        comm = EmulatedRing(LoopbackComm(shape.rank, shape.world, transfer=False), links)
        RingAttention.apply(q, k, v, comm, opts).backward(dout)
        q.grad = k.grad = v.grad = None
        return links

    return step


def _sdpa_step(inputs: Sequence[Tensor], causal: bool, scale: float) -> Callable[[], None]:
    q, k, v, dout = inputs
    gqa = q.shape[1] != k.shape[1]

    def step() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa).backward(dout)
        q.grad = k.grad = v.grad = None

    return step


def _block_shapes(shape: Shape, case: Case, device: torch.device | None = None
                  ) -> dict[tuple[int, int, int, int, bool], int]:
    """The bare kernel calls of the played rank's plan: ``(q_heads, kv_heads, q_rows, k_rows, causal)``
    -> how many, over every hop and head chunk."""
    from seqpar.attn.common import block_calls, block_hops

    opts = _options(shape, case, device)
    hops = block_hops(opts, shape.world, case.seq_local)
    g = opts.head_chunks
    counts: dict[tuple[int, int, int, int, bool], int] = {}
    for step in range(max(hops) + 1):
        src = (shape.rank - step) % shape.world
        if step > hops[src]:
            continue
        for call in block_calls(opts, shape.world, shape.rank, src, case.seq_local):
            key = (shape.q_heads // g, shape.kv_heads // g, call.q_rows.stop - call.q_rows.start,
                   call.k_rows.stop - call.k_rows.start, call.causal or call.anti)
            counts[key] = counts.get(key, 0) + g
    return counts


def _interleaved(clock: _Clock, steps: Sequence[Callable[[], Any]], *, warmup: int, repeats: int
                 ) -> list[list[float]]:
    """Each step's ``repeats`` timings, taken round-robin (step 0, 1, ..., then again) after ``warmup``
    runs of each, so that a clock or device that drifts during the measurement moves every step alike."""
    for step in steps:
        clock.time(step, warmup=warmup, repeats=0)
    times: list[list[float]] = [[] for _ in steps]
    for _ in range(repeats):
        for step, out in zip(steps, times):
            out.extend(clock.time(step, warmup=0, repeats=1))
    return times


def _compute_and_floor(shape: Shape, case: Case, device: torch.device, clock: _Clock, free: Callable[[], Any],
                       warmup: int, repeats: int, floors: dict[Any, dict[str, Any]],
                       sdpa: Callable[[], Any]) -> dict[str, Any]:
    """``t_compute`` (the ring step ``free``), ``t_sdpa_local`` (the local SDPA step ``sdpa``) and T_floor,
    the sum of bare SDPA forward + backward calls on the plan's block shapes, their repeats interleaved
    (so that a clock or temperature drift moves eta's numerator and denominator alike). T_floor is taken
    from ``floors`` when a case with the same block shapes measured it (they do not depend on the
    layout); else measured here and stored there."""
    blocks = sorted(_block_shapes(shape, case, device).items())
    key = tuple(blocks)
    if key in floors:
        ring, local = _interleaved(clock, [free, sdpa], warmup=warmup, repeats=repeats)
        return {"t_compute": statistics.median(ring), "t_sdpa_local": statistics.median(local), **floors[key]}
    dtype = _DTYPES[shape.dtype]
    steps = []
    for (hq, hkv, nq, nk, causal), _ in blocks:
        q = torch.randn(shape.batch, hq, nq, shape.head_dim, device=device, dtype=dtype, requires_grad=True)
        k = torch.randn(shape.batch, hkv, nk, shape.head_dim, device=device, dtype=dtype, requires_grad=True)
        v = torch.randn(shape.batch, hkv, nk, shape.head_dim, device=device, dtype=dtype, requires_grad=True)
        steps.append(_sdpa_step((q, k, v, torch.randn_like(q)), causal, shape.head_dim ** -0.5))
    ring, local, *calls = _interleaved(clock, [free, sdpa, *steps], warmup=warmup, repeats=repeats)
    del steps
    rows = [{"q_heads": hq, "kv_heads": hkv, "q_rows": nq, "k_rows": nk, "causal": causal, "count": count,
             "t": statistics.median(t)} for ((hq, hkv, nq, nk, causal), count), t in zip(blocks, calls)]
    # the floor of repeat i: every call's i-th run, weighted by its count; T_floor their median
    samples = [sum(count * t[i] for (_, count), t in zip(blocks, calls)) for i in range(repeats)]
    floors[key] = {"t_floor": statistics.median(samples), "floor_calls": rows, "t_floor_from": case.label}
    return {"t_compute": statistics.median(ring), "t_sdpa_local": statistics.median(local), **floors[key]}


def _profile(step: Callable[[], Any], device: torch.device) -> dict[str, Any]:
    """One step's kernel time: attention kernels vs the rest (elementwise, copies, reductions)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    step()
    sync(device)
    with profile(activities=activities) as prof:
        step()
        sync(device)
    split = {"attention": 0.0, "other": 0.0}
    top: dict[str, float] = {}
    for evt in prof.events():
        # operators (CPU-side events: aten's and custom ops such as seqpar::lse_merge_), each with the
        # device time of the kernels it launched itself
        if evt.device_type != torch.autograd.DeviceType.CPU or "::" not in evt.name:
            continue
        us = evt.self_device_time_total if device.type == "cuda" else evt.self_cpu_time_total
        if not us:
            continue
        name = evt.name.lower().split("::", 1)[1]  # the op's name, not its namespace
        kind = "attention" if any(s in name for s in _ATTENTION_KERNELS) else "other"
        split[kind] += us * 1e-6
        if kind == "other":
            top[evt.name[:80]] = top.get(evt.name[:80], 0.0) + us * 1e-6
    total = split["attention"] + split["other"]
    return {"kernel_s": total, "attention_s": split["attention"], "other_s": split["other"],
            "other_share": split["other"] / total if total else None,
            "other_top": sorted(top.items(), key=lambda kv: -kv[1])[:8]}


# ------------------------------------------------------------------------------------------ memory
def theory_peak(shape: Shape, case: Case, device: torch.device | None = None) -> dict[str, int]:
    """Bytes the ring holds at its backward's peak (a remote hop s >= 2, after its kernels, before the
    add into the travelling accumulator), term by term; inputs created inside the measured step.

    With ``e`` the input element size, ``Q`` = elements of q, ``K`` = of one K (or V) block and ``G`` head
    chunks: the step's inputs and saved tensors (q, k, v, out, dout: ``e(3Q + 2K)``; lse fp32), with G > 1
    the full-size dq, dk, dv being filled (``e(Q + 2K)``), and per head chunk: the fp32 accumulators dq,
    dk, dv (``4(Q + 2K)/G``), two K/V pairs (the block used and the next being received: ``4eK/G``), the
    hop kernel's dq, dk, dv (``e(Q + 2K)/G``; a half-block share is added over its rows, no fp32 copy),
    the flash backward's fp32 dq workspace (``4Q/G``), and the dK/dV accumulators in flight (the one
    arriving and the one sent on: ``16K/G``)."""
    e = torch.finfo(_DTYPES[shape.dtype]).bits // 8
    Q = shape.batch * shape.q_heads * case.seq_local * shape.head_dim  # noqa: N806 - the docstring's names
    K = shape.batch * shape.kv_heads * case.seq_local * shape.head_dim  # noqa: N806
    G = _options(shape, case, device).head_chunks  # noqa: N806
    rows = shape.batch * shape.q_heads * case.seq_local
    terms = {
        "inputs_and_saved": e * (3 * Q + 2 * K) + 4 * rows,
        "full_gradients": e * (Q + 2 * K) if G > 1 else 0,
        "fp32_accumulators": 4 * (Q + 2 * K) // G,
        "kv_in_flight": 4 * e * K // G,
        "hop_kernel_grads": e * (Q + 2 * K) // G,
        "flash_dq_workspace": 4 * Q // G,
        "dkv_accumulators_travelling": 16 * K // G,
    }
    terms["total"] = sum(terms.values())
    return terms


# ------------------------------------------------------------------------------------------ one case
def _link_lags(shape: Shape, case: Case, inputs: Sequence[Tensor], device: torch.device, cycles: float | None,
               high: bool, trace: str | None, copies: Any = None) -> dict[str, Any]:
    """One more step over the 50 GB/s links with every message timed on its stream
    (``CudaLinks(time_links=True)``): how much longer the messages took than ``bytes / B`` in all
    (``link_lag_50``, seconds) and at most; with ``trace``, that step under ``torch.profiler`` written as
    a Chrome trace (``DIR/trace_<case>.json``: every stream's kernels, the link sleeps among them)."""
    from torch.profiler import ProfilerActivity, profile

    if device.type != "cuda":
        return {}
    step = _ring_step(shape, case, inputs, lambda: _links(device, 50e9, cycles, high_priority=high, time_links=True,
                                                          copies=copies), device)
    step()  # warm-up
    sync(device)
    if trace:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            links = step()
            sync(device)
        os.makedirs(trace, exist_ok=True)
        name = case.label.replace(" ", "_").replace("=", "")
        trace_path = os.path.join(trace, f"trace_{name}.json")
        prof.export_chrome_trace(trace_path)
    else:
        links, trace_path = step(), None
    links.finish()
    res = {"link_lag_50": sum(links.lags), "link_lag_50_max": max(links.lags, default=0.0),
           "link_messages_50": len(links.lags),
           # what the messages should take on the link model, in all (latency 0: bytes / B)
           "link_model_50": sum(e.nbytes for e in links.trace.events if e.kind == "post") / 50e9}
    if trace_path is not None:
        res.update(sleep_kernels(trace_path))
    return res


def sleep_kernels(trace_path: str) -> dict[str, Any]:
    """The link sleeps' own run time in a Chrome trace (``torch.cuda._sleep``'s ``spin_kernel``): how many
    and their summed device duration (``link_sleep_run_50``, seconds). Against ``link_model_50`` it splits
    ``link_lag_50`` into the sleeps running longer than modelled (a sleep clock slower under load than
    calibrated) and, the rest, the sleeps starting late (waiting for an SM). The copy emulation's pinned
    host <-> device copies (``gpu_memcpy`` events, ``HtoD`` / ``DtoH``) likewise, as
    ``link_copies_traced_50`` and ``link_copy_run_50`` (beyond the model: a copy rate slower than
    measured; the rest: copies starting late). ``{}`` when the trace cannot be read."""
    import json

    try:
        with open(trace_path) as f:
            events = json.load(f).get("traceEvents", [])
    except (OSError, ValueError):
        return {}
    runs = [e.get("dur", 0.0) for e in events
            if e.get("cat") == "kernel" and "spin_kernel" in str(e.get("name", ""))]
    res = {"link_sleeps_traced_50": len(runs), "link_sleep_run_50": sum(runs) * 1e-6}
    copies = [e.get("dur", 0.0) for e in events
              if e.get("cat") == "gpu_memcpy" and any(d in str(e.get("name", "")) for d in ("HtoD", "DtoH"))]
    if copies:
        res.update(link_copies_traced_50=len(copies), link_copy_run_50=sum(copies) * 1e-6)
    return res


def run_case(shape: Shape, case: Case, device: torch.device, *, warmup: int, repeats: int, hidden_at: int,
             profile_split: bool, cycles: float | None, high_priority: bool = True, trace: str | None = None,
             floors: dict[Any, dict[str, Any]] | None = None, copies: Any = None) -> dict[str, Any]:
    """Every figure of one case (see the module docstring). ``floors``: the T_floor figures measured so far
    in this run, by block shapes (read and extended; default: none). ``copies``: a
    :class:`~seqpar.comm.emulated.CopyEngine` to hold the links by copies (None: the sleep)."""
    from seqpar.comm.schedule import hidden, hidden_bound, replay

    def links_at(bandwidth: float | None) -> Callable[[], Any]:
        return lambda: _links(device, bandwidth, cycles, high_priority=high_priority, copies=copies)

    clock = _Clock(device)
    inputs = _inputs(shape, case, device)
    scale = shape.head_dim ** -0.5
    res: dict[str, Any] = {**asdict(case), "label": case.label,
                           "head_chunks_resolved": _options(shape, case, device).head_chunks,
                           "link_emulation": ("sleep" if copies is None else "copy") if device.type == "cuda"
                           else "host clock"}
    t0 = time.perf_counter()
    sdpa = _sdpa_step(inputs, case.causal, scale)
    # as 0dbebd6's tables measured it: alone, before the ring (kept for comparison: eta_alone)
    res["t_sdpa_alone"] = statistics.median(clock.time(sdpa, warmup=warmup, repeats=repeats))
    free = _ring_step(shape, case, inputs, links_at(None), device)
    res.update(_compute_and_floor(shape, case, device, clock, free, warmup, repeats, {} if floors is None else floors,
                                  sdpa))
    res["t_step_400"] = statistics.median(clock.time(
        _ring_step(shape, case, inputs, links_at(400e9), device), warmup=warmup, repeats=repeats))
    p = shape.world
    res["eta"] = p * res["t_sdpa_local"] / res["t_step_400"]
    res["eta_compute"] = p * res["t_sdpa_local"] / res["t_compute"]
    res["eta_alone"] = p * res["t_sdpa_alone"] / res["t_step_400"]
    res["slow_400"] = res["t_step_400"] / res["t_compute"] - 1
    res["glue"] = res["t_compute"] / res["t_floor"] - 1
    if case.seq_local == hidden_at:
        recorded = free()  # one more free-link step, for its schedule and its compute segments
        recorded.finish()
        res["t_transfer_50"] = replay(recorded.trace.events, lambda n: n / 50e9, compute=False)
        res["hidden_max_50"] = hidden_bound(recorded.trace.events, lambda n: n / 50e9)["hidden"]
        res["t_step_50"] = statistics.median(clock.time(
            _ring_step(shape, case, inputs, links_at(50e9), device), warmup=warmup, repeats=repeats))
        res["hidden_50"] = hidden(res["t_compute"], res["t_transfer_50"], res["t_step_50"])
        res.update(_link_lags(shape, case, inputs, device, cycles, high_priority, trace, copies))
    if profile_split:
        res["profile"] = _profile(free, device)
    del inputs, free

    def ring_fresh() -> None:
        _ring_step(shape, case, _inputs(shape, case, device, seed=1), links_at(None), device)()

    def sdpa_fresh() -> None:
        _sdpa_step(_inputs(shape, case, device, seed=1), case.causal, scale)()

    res["peak_ring_bytes"] = peak_memory(ring_fresh, device)
    res["peak_sdpa_bytes"] = peak_memory(sdpa_fresh, device)
    res["peak"] = res["peak_ring_bytes"] / res["peak_sdpa_bytes"]
    res["peak_terms"] = theory_peak(shape, case, device)
    res["peak_theory_bytes"] = res["peak_terms"]["total"]
    res["peak_vs_theory"] = res["peak_ring_bytes"] / res["peak_theory_bytes"]
    res["wall_s"] = time.perf_counter() - t0
    return res


# ------------------------------------------------------------------------------------------ the run
_COLUMNS = (("case", "label"), ("eta", "eta"), ("eta_c", "eta_compute"), ("slow400", "slow_400"), ("glue", "glue"),
            ("hidden50", "hidden_50"), ("max50", "hidden_max_50"), ("lag50", "link_lag_50"), ("peak", "peak"),
            ("peak/theory", "peak_vs_theory"),
            ("T_sdpa", "t_sdpa_local"), ("T_comp", "t_compute"), ("T_400", "t_step_400"), ("T_floor", "t_floor"),
            ("wall", "wall_s"))


def _estimate(done: list[dict[str, Any]], case: Case) -> float:
    """Seconds ``case`` should take: the last case of the same ``L`` (and mask), else the nearest
    measured one scaled by ``L^2`` (attention's cost); 0 when nothing is measured yet."""
    same = [r for r in done if r["seq_local"] == case.seq_local and r["causal"] == case.causal]
    if same:
        return same[-1]["wall_s"]
    if not done:
        return 0.0
    ref = done[-1]
    return ref["wall_s"] * (case.seq_local / ref["seq_local"]) ** 2


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(resolve_device(args.device))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    shape = Shape(world=args.world, rank=args.rank, q_heads=args.q_heads, kv_heads=args.kv_heads,
                  head_dim=args.head_dim, batch=args.batch, dtype=args.dtype)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        from seqpar.comm.emulated import sleep_cycles_per_second

        cycles = sleep_cycles_per_second(device)
    else:
        cycles = None
    copies = None
    if device.type == "cuda" and args.link_emulation == "copy":
        from seqpar.comm.emulated import CopyEngine

        copies = CopyEngine.measure(device)
    payload: dict[str, Any] = {
        "command": "python -m seqpar.bench gpu-perf " + " ".join(args.argv if args.argv is not None else sys.argv[2:]),
        "machine": machine_info(), "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "shape": asdict(shape), "budget_s": args.budget_s, "sleep_cycles_per_second": cycles,
        "link_priority": args.link_priority,
        # on CPU the host-clock links hold either emulation alike (no stream, no copy)
        "link_emulation": args.link_emulation if device.type == "cuda" else f"host clock ({args.link_emulation} asked)",
        "copy_rates": None if copies is None else {d: {"fixed_s": r.fixed, "bytes_per_s": r.rate}
                                                   for d, r in copies.rates.items()},
        "cases": [], "skipped": [],
    }
    start = time.perf_counter()
    profiled: set[bool] = set()
    floors: dict[Any, dict[str, Any]] = {}  # T_floor by block shapes, measured once per run
    for case in cases(args.seq_locals, args.head_chunks, args.layouts):
        left = args.budget_s - (time.perf_counter() - start)
        estimate = _estimate(payload["cases"], case)
        if estimate > left:
            payload["skipped"].append({"label": case.label, "reason": f"estimated {estimate:.1f} s > {left:.1f} s left"})
            continue
        profile_split = case.seq_local == args.profile_at and case.causal not in profiled
        try:
            row = run_case(shape, case, device, warmup=args.warmup, repeats=args.repeats, hidden_at=args.hidden_at,
                           profile_split=profile_split, cycles=cycles, high_priority=args.link_priority == "high",
                           trace=args.trace, floors=floors, copies=copies)
        except torch.OutOfMemoryError as error:
            payload["skipped"].append({"label": case.label, "reason": f"out of memory: {str(error)[:200]}"})
            torch.cuda.empty_cache()
            continue
        if profile_split:
            profiled.add(case.causal)
        row["link_emulation"] = payload["link_emulation"]
        payload["cases"].append(row)
        payload["wall_s"] = time.perf_counter() - start
        print(format_table([row], _COLUMNS), flush=True)
        if args.out:
            write_json(os.path.join(args.out, "gpu_perf.json"), payload)
    payload["wall_s"] = time.perf_counter() - start
    return payload


def _list(kind: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    def parse(text: str) -> list[Any]:
        try:
            return [kind(x.strip()) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list") from None
    return parse


def _chunks(text: str) -> int | str:
    return text if text == "auto" else int(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m seqpar.bench gpu-perf", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", metavar="DIR", help="write DIR/gpu_perf.json (after every case)")
    p.add_argument("--budget-s", type=float, default=240.0, help="stop starting cases past this (seconds)")
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="toy shapes on any device (what the tests run)")
    p.add_argument("--seq-locals", type=_list(int), default=None, help="tokens per rank (default 8192,32768,16384,4096)")
    p.add_argument("--head-chunks", type=_list(_chunks), default=[1, "auto"])
    p.add_argument("--layouts", type=_list(str), default=["hf", "contiguous"])
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--rank", type=int, default=4)
    p.add_argument("--q-heads", type=int, default=None)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--head-dim", type=int, default=None)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", default=None, choices=sorted(_DTYPES))
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=None, help="timed runs per figure (median; default 5, tiny 2)")
    p.add_argument("--hidden-at", type=int, default=None, help="L at which hidden is measured at 50 GB/s (16384)")
    p.add_argument("--profile-at", type=int, default=None, help="L of the kernel-time split (8192)")
    p.add_argument("--link-priority", default="high", choices=("high", "normal"),
                   help="CUDA priority of the emulated links' streams (normal: torch's default, before issue 29 §8's fix)")
    p.add_argument("--link-emulation", default="sleep", choices=("sleep", "copy"),
                   help="what holds an emulated link for a message's time on CUDA: a torch.cuda._sleep kernel (one "
                        "thread block on an SM) or pinned host<->device copies (the copy engine, no SM)")
    p.add_argument("--trace", metavar="DIR", default=None,
                   help="at --hidden-at, write a torch.profiler Chrome trace of one 50 GB/s step per case to DIR")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = None if argv is None else list(argv)
    tiny = args.tiny
    defaults = {"seq_locals": [64, 128] if tiny else [8192, 32768, 16384, 4096],
                "q_heads": 4 if tiny else 32, "kv_heads": 2 if tiny else 8, "head_dim": 16 if tiny else 128,
                "dtype": "fp32" if tiny else "bf16", "repeats": 2 if tiny else 5}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.hidden_at = args.hidden_at or (128 if tiny else 16384)
    args.profile_at = args.profile_at or (64 if tiny else 8192)
    if args.kv_heads < 1 or args.q_heads % args.kv_heads:
        build_parser().error(f"--q-heads {args.q_heads} must be a multiple of --kv-heads {args.kv_heads}")
    if not 0 <= args.rank < args.world:
        build_parser().error(f"--rank {args.rank} must be in [0, --world {args.world})")
    for seq in args.seq_locals:
        if seq % 2:
            build_parser().error(f"--seq-locals: {seq} must be even (zigzag halves)")
    for layout in args.layouts:
        if layout not in ("hf", "contiguous"):
            build_parser().error(f"--layouts: {layout!r}: choose hf, contiguous")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    payload = run(args)
    print(f"gpu-perf: {len(payload['cases'])} cases in {payload['wall_s']:.1f} s, {len(payload['skipped'])} skipped",
          flush=True)
    if args.out:
        path = os.path.join(args.out, "gpu_perf.json")
        write_json(path, payload)
        print(f"wrote {path}", flush=True)
    return 0


# ------------------------------------------------------------------------------------------ BENCHMARKS rows
_TABLE_HEAD = ("| L | mask | hc | layout | link | eta | eta_c | slow400 | glue | hidden50 | max50 | excess50 ms | lag50 ms "
               "| peak | /theory | T_sdpa ms | T_compute ms | T_400 ms | T_floor ms | eta alone |")


def _cell(row: dict[str, Any], key: str, kind: str) -> str:
    v = row.get(key)
    if v is None:
        return "—"
    if kind == "pct":
        return f"{100 * v:+.1f}%" if key == "slow_400" else f"{100 * v:.1f}%"
    if kind == "ms":
        return f"{1e3 * v:.2f}" if key == "t_sdpa_local" else f"{1e3 * v:.1f}"
    return f"{v:.3f}" if kind == "3" else f"{v:.2f}"


def excess_50(row: dict[str, Any]) -> float | None:
    """Seconds the 50 GB/s step took beyond what its recorded schedule allows: ``t_step_50 - t_compute -
    (1 - hidden_max_50) * t_transfer_50`` (the exposed transfer time the schedule does not explain;
    BENCHMARKS' "What a GPU session should run" compares it with ``link_lag_50``). None off ``--hidden-at``."""
    if any(row.get(k) is None for k in ("t_step_50", "t_compute", "hidden_max_50", "t_transfer_50")):
        return None
    return row["t_step_50"] - row["t_compute"] - (1 - row["hidden_max_50"]) * row["t_transfer_50"]


def _rates(payload: dict[str, Any]) -> str:
    rates = payload.get("copy_rates")
    if not rates:
        return ""
    return " (copies: " + ", ".join(f"{d} {r['bytes_per_s'] / 1e9:.1f} GB/s + {r['fixed_s'] * 1e6:.1f} us"
                                    for d, r in sorted(rates.items())) + ")"


def table_markdown(payload: dict[str, Any]) -> str:
    """One ``gpu_perf.json`` as BENCHMARKS.md's rows (the "The ring on one GPU" columns, plus ``excess50``
    and ``lag50`` at ``--hidden-at`` and, last, ``eta alone``: eta from T_sdpa timed alone), with its command, device, commit, skipped cases and kernel-time
    splits. Figures are printed as recorded (nothing is recomputed but ``excess50``)."""
    machine = payload.get("machine", {})
    lines = [f"`{payload.get('command', '?')}`: {payload.get('device', '?')}, torch {machine.get('torch', '?')}, "
             f"commit {str(machine.get('seqpar_commit') or '?')[:7]}, {machine.get('date_utc', '?')} UTC, "
             f"link priority {payload.get('link_priority', '?')}, link emulation "
             f"{payload.get('link_emulation', 'sleep')}{_rates(payload)}; {len(payload.get('cases', []))} cases"
             + (f" in {payload['wall_s']:.0f} s" if payload.get("wall_s") is not None else ""), "",
             _TABLE_HEAD, "|" + "---|" * (_TABLE_HEAD.count("|") - 1)]
    for r in payload.get("cases", []):
        seq = r["seq_local"]
        length = f"{seq // 1024}K" if seq % 1024 == 0 else str(seq)
        hc = f"{r['head_chunks']} ({r.get('head_chunks_resolved', '?')})"
        ex = excess_50(r)
        link = r.get("link_emulation") or payload.get("link_emulation") or "sleep"  # (0dbebd6's runs: the sleep)
        cells = [length, "causal" if r["causal"] else "full", hc, r["layout"], link,
                 _cell(r, "eta", "3"), _cell(r, "eta_compute", "3"), _cell(r, "slow_400", "pct"),
                 _cell(r, "glue", "pct"), _cell(r, "hidden_50", "3"), _cell(r, "hidden_max_50", "3"),
                 "—" if ex is None else f"{1e3 * ex:.1f}", _cell(r, "link_lag_50", "ms"),
                 _cell(r, "peak", "2"), _cell(r, "peak_vs_theory", "2"), _cell(r, "t_sdpa_local", "ms"),
                 _cell(r, "t_compute", "ms"), _cell(r, "t_step_400", "ms"), _cell(r, "t_floor", "ms"),
                 _cell(r, "eta_alone", "3")]
        lines.append("| " + " | ".join(cells) + " |")
    for r in payload.get("cases", []):
        if r.get("link_lag_50") is None:
            continue
        line = (f"Links at 50 GB/s, {r['label']}: the {r.get('link_messages_50', '?')} messages took "
                f"{1e3 * r['link_lag_50']:.2f} ms beyond bytes / B in all (largest {1e3 * r['link_lag_50_max']:.2f} ms)")
        if r.get("link_model_50"):
            line += f" on {1e3 * r['link_model_50']:.1f} ms modelled"
        if r.get("link_sleep_run_50") is not None and r.get("link_model_50") is not None:
            slow = r["link_sleep_run_50"] - r["link_model_50"]
            line += (f"; the traced sleeps ({r['link_sleeps_traced_50']}) ran {1e3 * slow:+.2f} ms against the model "
                     f"(sleep clock), so they started {1e3 * (r['link_lag_50'] - slow):.2f} ms late (SM wait)")
        if r.get("link_copy_run_50") is not None and r.get("link_model_50") is not None:
            slow = r["link_copy_run_50"] - r["link_model_50"]
            line += (f"; the traced copies ({r['link_copies_traced_50']}) ran {1e3 * slow:+.2f} ms against the model "
                     f"(copy rate), so they started {1e3 * (r['link_lag_50'] - slow):.2f} ms late (copy queue)")
        lines += ["", line]
    for r in payload.get("cases", []):
        split = r.get("profile")
        if split and split.get("kernel_s"):
            top = ", ".join(f"`{name}` {1e3 * t:.1f} ms" for name, t in split.get("other_top", [])[:5])
            lines += ["", f"One step's kernel time, {r['label']}: {1e3 * split['kernel_s']:.1f} ms, attention kernels "
                          f"{1e3 * split['attention_s']:.1f} ms, the rest {1e3 * split['other_s']:.1f} ms "
                          f"({100 * split['other_share']:.0f}%)" + (f": {top}" if top else "")]
    if payload.get("skipped"):
        lines += ["", "Skipped: " + "; ".join(f"{s['label']} ({s['reason']})" for s in payload["skipped"])]
    return "\n".join(lines)


def table_main(argv: Sequence[str] | None = None) -> int:
    """``python -m seqpar.bench gpu-perf-table DIR [DIR ...]``: print each ``DIR/gpu_perf.json`` (or a JSON
    file named directly) as BENCHMARKS.md's markdown rows; a missing or unreadable file is named, and the
    others still print (exit 1 then)."""
    import json

    p = argparse.ArgumentParser(prog="python -m seqpar.bench gpu-perf-table", description=table_main.__doc__)
    p.add_argument("dirs", nargs="+", metavar="DIR", help="a gpu-perf --out DIR, or its gpu_perf.json")
    args = p.parse_args(argv)
    rc = 0
    for i, d in enumerate(args.dirs):
        path = d if d.endswith(".json") else os.path.join(d, "gpu_perf.json")
        if i:
            print()
        print(f"### {path}\n")
        try:
            with open(path) as f:
                payload = json.load(f)
        except (OSError, ValueError) as error:
            print(f"gpu-perf-table: cannot read {path}: {error}")
            rc = 1
            continue
        print(table_markdown(payload))
    return rc
