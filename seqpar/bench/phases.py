"""``--profile`` for the ``attention`` suite: one forward+backward split into phases.

:func:`phase_patches` wraps the functions the attention algorithms call (block kernels, LSE merges,
communication launches and waits, collectives, the cross-rank input check, the ring's own bookkeeping, the
all-to-alls' packing and unpacking copies) with a :class:`PhaseTimer`, in wall and thread-CPU seconds, each
phase exclusive of the phases it calls; :func:`profile_step` runs one step under them, and what is left
(``other``) is Python, autograd and allocation. Split from :mod:`seqpar.bench.attention` (which re-exports
these names): the suite times cases, this module only attributes one step's time.
"""

from __future__ import annotations

import contextlib
import importlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from seqpar.bench.runner import sync
from seqpar.comm.ring import Pending, RingComm

__all__ = ["PhaseTimer", "phase_patches", "profile_step"]


class PhaseTimer:
    """Accumulates seconds per phase while wrapped functions run (see :func:`phase_patches`).

    Phases nest (a packing helper starts an all-to-all, an unpacking one waits for it): each phase
    gets its *exclusive* time, its children's subtracted, so the phases of a step add up to at most
    its total. ``seconds``: wall time; ``cpu_seconds``: this thread's CPU time, which stays
    meaningful when more ranks than cores share the machine (waits cost wall time, not CPU time)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds: dict[str, float] = {}
        self.cpu_seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._open: list[list[float]] = []  # per running phase: [children's wall, children's CPU]
        self._names: list[str] = []  # the running phases, innermost last

    def wrap(self, phase: str | Callable[[str | None], str], fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` timed as ``phase``; a callable ``phase`` names it from the innermost running phase
        (a communication wait inside the ring's code is the ring's, elsewhere the all-to-all's)."""
        def timed(*args: Any, **kwargs: Any) -> Any:
            name = phase if isinstance(phase, str) else phase(self._names[-1] if self._names else None)
            self._names.append(name)
            sync(self.device)
            t0, c0 = time.perf_counter(), time.thread_time()
            self._open.append([0.0, 0.0])
            try:
                return fn(*args, **kwargs)
            finally:
                sync(self.device)
                wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
                child_wall, child_cpu = self._open.pop()
                self._names.pop()
                if self._open:
                    self._open[-1][0] += wall
                    self._open[-1][1] += cpu
                self.seconds[name] = self.seconds.get(name, 0.0) + wall - child_wall
                self.cpu_seconds[name] = self.cpu_seconds.get(name, 0.0) + cpu - child_cpu
                self.calls[name] = self.calls.get(name, 0) + 1
        return timed


_PHASE_TARGETS = (
    # ring and all-gather run their kernels and merges through the shared piece helpers
    ("seqpar.attn.common", "block_forward", "kernel_fwd"),
    ("seqpar.attn.common", "block_backward", "kernel_bwd"),
    ("seqpar.kernels.merge", "merge_into", "merge"),
    ("seqpar.attn.allgather", "all_gather_into", "collective"),
    ("seqpar.attn.allgather", "reduce_scatter_into", "collective"),
    ("seqpar.attn.dilated", "block_forward", "kernel_fwd"),
    ("seqpar.attn.dilated", "block_backward", "kernel_bwd"),
    ("seqpar.attn.dilated", "merge_into", "merge"),
    ("seqpar.attention", "check_across_ranks", "input_check"),
    # the ring's own bookkeeping (accumulators, fp32 sums, buffer copies), outside its kernels and merges
    ("seqpar.attn.ring", "ring_forward", "ring_other"),
    ("seqpar.attn.ring", "ring_backward", "ring_other"),
    # Ulysses and the hybrid: the all-to-alls' packing and unpacking copies, their launches, and the
    # inner attention (local kernels, or for the hybrid the ring across super-ranks, as above)
    ("seqpar.attn.ulysses", "ulysses_forward", "ulysses_other"),
    ("seqpar.attn.ulysses", "ulysses_backward", "ulysses_other"),
    ("seqpar.attn.ulysses", "start_qkv", "a2a_pack"),
    ("seqpar.attn.ulysses", "start_dout", "a2a_pack"),
    ("seqpar.attn.ulysses", "start_heads_back", "a2a_pack"),
    ("seqpar.attn.ulysses", "start_all_to_all", "a2a_start"),
    ("seqpar.attn.ulysses", "seq_to_heads", "a2a_unpack"),
    ("seqpar.attn.ulysses", "place_out", "a2a_unpack"),
    ("seqpar.attn.ulysses", "place_grads", "a2a_unpack"),
    ("seqpar.attn.ulysses", "block_forward", "kernel_fwd"),
    ("seqpar.attn.ulysses", "block_backward", "kernel_bwd"),
    ("seqpar.attn.ulysses", "ring_forward", "ring_other"),
    ("seqpar.attn.ulysses", "ring_backward", "ring_other"),
)


def _wait_phase(parent: str | None) -> str:
    """A communication wait: the ring's inside the ring code, the all-to-all's inside Ulysses' own
    code, ``comm_wait`` elsewhere (all-gather, dilated)."""
    if parent == "ring_other":
        return "ring_wait"
    return "a2a_wait" if parent in ("a2a_unpack", "ulysses_other") else "comm_wait"


@contextlib.contextmanager
def phase_patches(timer: PhaseTimer) -> Iterator[PhaseTimer]:
    """Wrap the algorithms' kernel, merge and communication entry points with ``timer``."""
    saved: list[tuple[Any, str, Any]] = []
    try:
        for mod_name, attr, phase in _PHASE_TARGETS:
            try:
                mod = importlib.import_module(mod_name)
            except Exception:  # noqa: BLE001 - a module that does not import has nothing to time
                continue
            if hasattr(mod, attr):
                saved.append((mod, attr, getattr(mod, attr)))
                setattr(mod, attr, timer.wrap(phase, getattr(mod, attr)))
        saved.append((Pending, "wait", Pending.wait))
        Pending.wait = timer.wrap(_wait_phase, Pending.wait)  # type: ignore[method-assign]
        # launching a ring exchange (gloo/NCCL P2P ops, receive buffers) is a cost per message
        saved.append((RingComm, "exchange", RingComm.exchange))
        RingComm.exchange = timer.wrap("ring_start", RingComm.exchange)  # type: ignore[method-assign]
        yield timer
    finally:
        for obj, attr, orig in reversed(saved):
            setattr(obj, attr, orig)


def profile_step(
    fwd: Callable[[Tensor, Tensor, Tensor], Tensor], inputs: tuple[Tensor, Tensor, Tensor, Tensor], device: torch.device
) -> dict[str, Any]:
    """One forward+backward under :func:`phase_patches`: wall and thread-CPU seconds per phase
    (exclusive; ``other`` is the rest of the step: Python, autograd, allocation)."""
    q, k, v, dout = inputs
    timer = PhaseTimer(device)
    with phase_patches(timer):
        sync(device)
        t0, c0 = time.perf_counter(), time.thread_time()
        out = fwd(q, k, v)
        sync(device)
        t1 = time.perf_counter()
        out.backward(dout)
        sync(device)
        t2, c2 = time.perf_counter(), time.thread_time()
    q.grad = k.grad = v.grad = None
    total, total_cpu = t2 - t0, c2 - c0
    phases, phases_cpu = dict(timer.seconds), dict(timer.cpu_seconds)
    phases["other"] = max(0.0, total - sum(phases.values()))
    phases_cpu["other"] = max(0.0, total_cpu - sum(phases_cpu.values()))
    return {"forward_s": t1 - t0, "backward_s": t2 - t1, "total_s": total, "cpu_s": total_cpu,
            "phases_s": phases, "phases_cpu_s": phases_cpu, "calls": timer.calls}
