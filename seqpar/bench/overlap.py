"""How much of the transfers a rank hides behind its kernels, on emulated links (issue 29).

``python -m seqpar.bench overlap --world P --seq-len S --link-gbps B[,B...] [--causal yes|no]
[--mode ring|dilated|hybrid] [--device cpu|cuda] --out DIR`` plays one rank of a P-rank ring in this
process, on one thread, against loopback peers (:mod:`seqpar.comm.loopback`) whose messages take the
time of an emulated link (:mod:`seqpar.comm.emulated`: a FIFO per directed link, ``latency + bytes /
bandwidth``, a timer that costs no CPU). Per case, forward + backward, median of ``--repeats``:

- ``t_compute``: the step with free links (transfers cost nothing);
- ``t_transfer``: the transfers alone on the link model (the recorded schedule replayed with no host
  work: each message still waits for the one it depends on);
- ``t_step``: the step over the emulated link;
- ``hidden = (t_compute + t_transfer - t_step) / min(t_compute, t_transfer)``;
- ``hidden_same_run``: ``hidden`` with ``t_compute`` taken as the host time inside each emulated run
  (median over runs): only the time the host waited counts, so the kernels' run-to-run noise drops out;
- ``hidden_max``: the same figure for the recorded schedule replayed (post / wait order and host-time
  durations of the free-link run) with no noise: what this schedule allows at best; ``hidden_max_early``
  the same schedule with the dK/dV accumulator exchanges waited right after their post (the order the
  ring and dilated backward had before issue 29).

``B`` is in GB/s (1e9 bytes/s); ``auto`` picks the B at which ``t_transfer`` is half of ``t_compute``.
``--clock thread`` (default) times the host by this thread's CPU time and adds the emulated idle time
without sleeping, so other processes on a loaded machine do not stretch either; ``--clock wall`` sleeps
and uses ``time.perf_counter``. Kernels run on one thread (``torch.set_num_threads(1)``).

``--device cuda`` runs the same on one GPU in bf16: each link a side stream held by a calibrated
``torch.cuda._sleep`` (:class:`~seqpar.comm.emulated.CudaLinks`), steps timed with CUDA events, the
schedule's compute segments measured on the compute stream (``--clock`` does not apply).
``--link-emulation copy`` holds each message with pinned host <-> device copies instead (the copy engine,
no SM; :class:`~seqpar.comm.emulated.CopyEngine`, measured once per case), one link per copy direction:
the ring's; a mode with more links (dilated, several distances) is refused by name. On CPU the host-clock
links serve either value (recorded as ``host clock``).

Modes: ``ring`` (zigzag when causal, contiguous when not), ``dilated`` (one pattern spanning the whole
sequence, ``segment_lengths=(S,)``, ``dilation_rates=(1,)``: every block travels, the most transfer a
dilated pattern has), ``hybrid`` (its ring across ``P / u`` super-ranks, each with ``u`` shards and
``1/u`` of the heads; the Ulysses all-to-alls are not emulated). The played rank's peers are assumed to
post when it does (the ring's symmetry; the causal dilated chain is not symmetric, so there the figure
is that of this rank's own schedule).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from seqpar.bench.report import format_table, machine_info, write_json
from seqpar.comm.emulated import (
    CopyEngine,
    CudaLinks,
    EmulatedLinks,
    EmulatedRing,
    EmulatedSegment,
    LinkClock,
    sleep_cycles_per_second,
)
from seqpar.comm.loopback import LoopbackComm, LoopbackSegmentComm
from seqpar.comm.schedule import early_waits, hidden, hidden_bound, replay

__all__ = ["MODES", "run_case", "run", "main"]

MODES = ("ring", "dilated", "hybrid")
_DKV_CHANNELS = (1,)  # the travelling dK/dV accumulators (ring and dilated use channel 1)


def _step_fn(mode: str, world: int, rank: int, seq_len: int, causal: bool, heads: int, head_dim: int,
             ulysses: int, device: torch.device) -> Callable[[EmulatedLinks], None]:
    """Forward + backward of one rank on ``links`` (fresh communicators each step)."""
    from seqpar.attn.common import AttentionOptions
    from seqpar.attn.dilated import DilatedAttention, DilatedOptions, plan_dilated
    from seqpar.attn.ring import RingAttention

    ring_world, ring_rank, seq_local, h = world, rank, seq_len // world, heads
    if mode == "hybrid":  # the ring across super-ranks: u shards and 1/u of the heads each
        if world % ulysses or heads % ulysses or ulysses < 2 or ulysses >= world:
            raise ValueError(f"--mode hybrid: --ulysses-size {ulysses} must divide --world {world} and --heads "
                             f"{heads}, with 1 < u < P")
        ring_world, ring_rank, seq_local, h = world // ulysses, rank // ulysses, seq_len // (world // ulysses), \
            heads // ulysses
    g = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # CUDA: what the fused kernels take
    q, k, v, dout = (torch.randn(1, h, seq_local, head_dim, generator=g).to(device, dtype) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    scale = head_dim ** -0.5
    if mode == "dilated":
        opts = DilatedOptions(segment_lengths=(seq_len,), dilation_rates=(1,), causal=causal, scale=scale)
        plan = plan_dilated(opts, q_heads=h, kv_heads=h, seq_local=seq_local, rank=rank, world_size=world)

        def run(links: EmulatedLinks) -> None:
            comms = {p: EmulatedSegment(LoopbackSegmentComm(pat.index, pat.span), links)
                     for p, pat in enumerate(plan.patterns) if pat.span > 1}
            DilatedAttention.apply(q, k, v, plan, comms).backward(dout)
            q.grad = k.grad = v.grad = None
        return run
    opts = AttentionOptions(causal=causal, scale=scale, sharding="zigzag" if causal else "contiguous")

    def run(links: EmulatedLinks) -> None:  # noqa: F811 - one of two step bodies
        comm = EmulatedRing(LoopbackComm(ring_rank, ring_world, transfer=False), links)
        RingAttention.apply(q, k, v, comm, opts).backward(dout)
        q.grad = k.grad = v.grad = None
    return run


def _timed(step: Callable[[EmulatedLinks], None], bandwidth: float | None, latency: float, clock: str,
           device: torch.device | None = None, cycles: float | None = None,
           copies: CopyEngine | None = None) -> tuple[float, EmulatedLinks]:
    """One step on fresh links: its time and the links (their trace). On CUDA the links are
    :class:`~seqpar.comm.emulated.CudaLinks` (held by ``copies`` when given, else by sleeps) and the step
    is timed with CUDA events."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        extra = {} if copies is None else {"emulation": "copy", "copies": copies}
        links = CudaLinks(bandwidth, latency, device=device, cycles_per_second=cycles, **extra)
        step(links)
        end.record()
        links.finish()
        end.synchronize()
        return start.elapsed_time(end) * 1e-3, links
    links = EmulatedLinks(bandwidth, latency, LinkClock(clock))
    t0 = links.clock.now()
    links.trace.events.clear()
    step(links)
    links.finish()
    return links.clock.now() - t0, links


def run_case(mode: str, world: int, seq_len: int, causal: bool, gbps: Sequence[float | str], *, rank: int | None = None,
             heads: int = 8, head_dim: int = 64, ulysses: int = 2, repeats: int = 5, latency_us: float = 0.0,
             clock: str = "thread", device: str = "cpu", link_emulation: str = "sleep") -> list[dict[str, Any]]:
    """Rows (one per link bandwidth) of one (mode, P, S, causal); see the module docstring for the fields."""
    if link_emulation not in ("sleep", "copy"):
        raise ValueError(f"--link-emulation must be sleep or copy, not {link_emulation!r}")
    dev = torch.device(device)
    cycles = copies = None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda: torch.cuda.is_available() is False; run with --device cpu")
        dev = torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)
        cycles = sleep_cycles_per_second(dev)
        copies = CopyEngine.measure(dev) if link_emulation == "copy" else None
    if mode not in MODES:
        raise ValueError(f"--mode must be one of {MODES}, not {mode!r}")
    if seq_len % (2 * world):
        raise ValueError(f"--seq-len {seq_len} must be a multiple of 2 * --world ({2 * world}) (zigzag halves)")
    rank = world // 2 if rank is None else rank
    latency = latency_us * 1e-6
    step = _step_fn(mode, world, rank, seq_len, causal, heads, head_dim, ulysses, dev)
    timed = functools.partial(_timed, clock=clock, device=dev, cycles=cycles, copies=copies)
    timed(step, None, latency)  # warm-up
    first = timed(step, None, latency)  # a free-link run to size the links ('auto')

    def per_byte(bandwidth: float) -> Callable[[int], float]:
        return lambda n: latency + n / bandwidth

    # B at which the transfers alone take half the compute (replay: t_transfer ~ bytes / B)
    t_at_1 = replay(first[1].trace.events, per_byte(1e9), compute=False)
    auto = t_at_1 / (0.5 * first[0]) if latency == 0 else None
    if "auto" in gbps and auto is None:
        raise ValueError("--link-gbps auto needs --latency-us 0")
    values = [auto if b == "auto" else float(b) for b in gbps]
    # free-link and emulated runs interleaved, so that a machine whose load drifts affects both alike
    free = [first]
    steps: list[list[float]] = [[] for _ in values]
    busy: list[list[float]] = [[] for _ in values]  # host time inside each emulated run
    for r in range(repeats):
        if r:
            free.append(timed(step, None, latency))
        for i, b_val in enumerate(values):
            t, links = timed(step, b_val * 1e9, latency)
            steps[i].append(t)
            busy[i].append(links.trace.compute_seconds())
    t_compute = statistics.median(t for t, _ in free)
    ordered = sorted(free, key=lambda f: f[0])
    events = ordered[len(ordered) // 2][1].trace.events  # the median free-link run's schedule and host times
    rows = []
    for b, b_val, runs, busy_runs in zip(gbps, values, steps, busy):
        bandwidth = b_val * 1e9
        t_step = statistics.median(runs)
        t_transfer = replay(events, per_byte(bandwidth), compute=False)
        # the same figure with T_compute taken from the emulated run itself (its host time): the time
        # the host sat waiting is then all that counts, and run-to-run noise of the kernels drops out
        same_run = statistics.median(hidden(c, t_transfer, t) for c, t in zip(busy_runs, runs))
        bound = hidden_bound(events, per_byte(bandwidth))
        early = hidden_bound(early_waits(events, _DKV_CHANNELS), per_byte(bandwidth))
        rows.append({
            "mode": mode, "world": world, "rank": rank, "seq_len": seq_len, "causal": causal, "heads": heads,
            "head_dim": head_dim, "ulysses_size": ulysses if mode == "hybrid" else None,
            "link_gbps": b_val, "link_auto": b == "auto", "latency_us": latency_us, "clock": clock,
            "link_emulation": link_emulation if dev.type == "cuda" else "host clock",
            "t_compute": t_compute, "t_transfer": t_transfer, "t_step": t_step,
            "hidden": hidden(t_compute, t_transfer, t_step), "hidden_same_run": same_run,
            "hidden_max": bound["hidden"], "hidden_max_early": early["hidden"],
            "transfer_over_compute": t_transfer / t_compute,
            "t_compute_runs": [t for t, _ in free], "t_step_runs": runs, "t_busy_runs": busy_runs,
            "repeats": repeats,
        })
    # which B made t_transfer about half of t_compute (the operating point)
    best = min(rows, key=lambda r: abs(r["transfer_over_compute"] - 0.5))
    for r in rows:
        r["half_compute"] = r is best
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)  # one thread: the thread clock sees all the host work
    cases = []
    for mode in args.mode:
        for causal in args.causal:
            cases += run_case(mode, args.world, args.seq_len, causal, args.link_gbps, rank=args.rank,
                              heads=args.heads, head_dim=args.head_dim, ulysses=args.ulysses_size,
                              repeats=args.repeats, latency_us=args.latency_us, clock=args.clock, device=args.device,
                              link_emulation=args.link_emulation)
            print(format_table(cases[-len(args.link_gbps):], _COLUMNS), flush=True)
    return {"command": "python -m seqpar.bench overlap " + " ".join(sys.argv[1:] if args.argv is None else args.argv),
            "machine": machine_info(), "cases": cases}


_COLUMNS = (("mode", "mode"), ("P", "world"), ("S", "seq_len"), ("causal", "causal"), ("GB/s", "link_gbps"),
            ("T_compute", "t_compute"), ("T_transfer", "t_transfer"), ("T_step", "t_step"), ("hidden", "hidden"),
            ("same run", "hidden_same_run"), ("max", "hidden_max"), ("max(early)", "hidden_max_early"), ("~0.5", "half_compute"))


def _gbps(text: str) -> list[float | str]:
    out: list[float | str] = []
    for x in text.split(","):
        x = x.strip()
        if x == "auto":
            out.append(x)
            continue
        try:
            out.append(float(x))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: give link bandwidths in GB/s, e.g. 2,4,8 or auto") from None
        if out[-1] <= 0:
            raise argparse.ArgumentTypeError(f"{text!r}: a link bandwidth must be > 0 GB/s")
    return out


def _yes_no(text: str) -> list[bool]:
    table = {"yes": [True], "no": [False], "both": [True, False]}
    if text not in table:
        raise argparse.ArgumentTypeError(f"--causal takes yes, no or both, not {text!r}")
    return table[text]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m seqpar.bench overlap", description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=4, help="P, the ring's ranks (one is played)")
    p.add_argument("--seq-len", type=int, default=16384, help="S, the global sequence length")
    p.add_argument("--link-gbps", type=_gbps, default=["auto"],
                   help="link bandwidths in GB/s (1e9 bytes/s), comma-separated; 'auto': T_transfer = T_compute / 2")
    p.add_argument("--causal", type=_yes_no, default=[True, False], help="yes, no or both (default both)")
    p.add_argument("--mode", type=lambda s: s.split(","), default=["ring"], help="ring, dilated, hybrid (comma list)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--rank", type=int, default=None, help="the rank played (default P // 2)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--ulysses-size", type=int, default=2, help="u of --mode hybrid")
    p.add_argument("--repeats", type=int, default=5, help="runs per figure (the median is reported)")
    p.add_argument("--latency-us", type=float, default=0.0, help="per-message link latency")
    p.add_argument("--clock", default="thread", choices=("thread", "wall"))
    p.add_argument("--link-emulation", default="sleep", choices=("sleep", "copy"),
                   help="--device cuda: hold a link by a torch.cuda._sleep kernel or by host<->device copies (no SM)")
    p.add_argument("--out", metavar="DIR", help="write DIR/overlap.json")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = None if argv is None else list(argv)
    for m in args.mode:
        if m not in MODES:
            build_parser().error(f"--mode {m!r}: choose from {', '.join(MODES)}")
    payload = run(args)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        write_json(os.path.join(args.out, "overlap.json"), payload)
    return 0
