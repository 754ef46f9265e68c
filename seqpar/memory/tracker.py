"""Exact peak tensor memory of a stretch of code, in every setting: ``TensorMemoryTracker``.

Why not ``torch.distributed._tools.mem_tracker.MemTracker``: it attributes memory to modules through
forward/backward hooks, and refuses a module that runs twice in one tracked window, which is what
activation checkpointing (the recompute), gradient accumulation (several micro-steps) and the tiled
MLP (one call per chunk, recomputed in backward) all do. Attribution is not needed to answer "how
many bytes of tensors were alive at the worst moment", so this tracker counts storages only:

- at entry, every tensor the garbage collector can see (parameters, gradients, optimizer state,
  engine buffers, the batch) is registered once per storage: the baseline;
- inside, a ``TorchDispatchMode`` registers the storage of every tensor an op returns (forward,
  backward, optimizer, collectives alike) and updates the peak after each op;
- a weak reference per storage subtracts its bytes when the storage is freed, and
  ``UntypedStorage.resize_`` (FSDP2 frees and refills its unsharded parameters that way, outside the
  dispatcher) is wrapped to follow size changes.

Only the thread that entered the tracker is counted: the dispatch mode is thread-local, and the ``resize_`` wrapper
(global) registers that thread's resizes only, so a tensor another thread makes or refills inside the window (a
library's worker, a communication backend's) never enters the step's figure.

A storage is counted once however many views share it. Storages allocated by C++ code without a
Python op (e.g. inside a communication backend) are not counted; neither is memory that is not a
tensor (the CPU allocator's caches, Python objects).

A communication backend's own copy is counted until the wait on its collective returns, not until the
backend drops it. The rule: a storage the tracker first sees through an op that did not make it (a view
of, or an in-place op on, a storage it never saw made) while a collective's ``Work.wait()`` runs is a
backend copy; it is counted from then until that wait returns (a synchronous ``dist.*`` call waits
inside the call, so until the call returns), or until it is freed if sooner, and subtracted once.
``Work.wait`` is wrapped while the tracker is entered to find that moment. Why: gloo's reduce-scatter
(FSDP2's and ZeRO-3's gradient reductions, all-gather attention's ``reduce_scatter_into`` on CPU)
copies its whole input into a buffer of its own, which the waiting thread then splits through the
dispatcher (that is where the tracker first sees it); gloo's worker thread drops the buffer some time
after the wait has returned, on loaded cores a layer's backward later, so counted until then the peak
depended on thread scheduling (tests/test_training_memory.py's tiled-MLP case at SP 4 measured
+540,928 B, -10.06%, in one CI run of two). The buffer is real memory while the collective runs, and
the estimate models it there; on NCCL, which reduces in place, a collective's buffers live as long as
the collective, so the tail after the wait is the only part left out. A copy is tied to the wait it
was first seen in: another collective's wait does not end it. A storage alive at entry is never a backend
copy (the copy is made by the collective, inside the tracked window): with ``count_existing=False`` the entry's
garbage-collector walk records those storages, uncounted, and one first touched inside a wait is then counted as it
would be outside one, until freed, not ended when the wait returns (it was before: a caller's buffer that existed
at entry and was first touched inside a wait was left out of every later peak). A storage alive at entry that the
garbage collector cannot see (held by C++ only, e.g. autograd's saved tensors) stays indistinguishable from a copy.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import types
import warnings
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    is_traceable_wrapper_subclass,
    is_traceable_wrapper_subclass_type,
)
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["TensorMemoryTracker", "tensor_storages"]


def tensor_storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages behind ``t`` (a wrapper subclass such as FSDP2's DTensor: its inner tensors')."""
    todo, out = [t], []
    while todo:
        x = todo.pop()
        if is_traceable_wrapper_subclass(x):
            attrs, _ = x.__tensor_flatten__()
            todo.extend(v for v in (getattr(x, a) for a in attrs) if isinstance(v, torch.Tensor))
            continue
        try:
            out.append(x.untyped_storage())
        except (RuntimeError, NotImplementedError):  # meta / sparse tensors: no plain storage
            pass
    return out


class TensorMemoryTracker(TorchDispatchMode):
    """Live and peak bytes of tensor storages on one device type while the ``with`` block runs.

    Args:
        device: device type to count (``"cpu"`` or ``"cuda"``); storages elsewhere are ignored.
        count_existing: register the tensors alive at entry (found through the garbage collector) so
            that ``peak`` is the whole process's tensor memory; with ``False`` only what the block
            allocates is counted (``peak`` is then relative to entry).

        record_peak: keep, at each new peak, the list of storages alive then with where each was made
            (``peak_live``): what the peak consists of, not only how large it is.

    After (or during) the block: ``baseline`` (bytes alive at entry), ``current``, ``peak``, and with
    ``record_peak`` ``peak_live``: ``(label, bytes, data_ptr)`` per storage alive at the peak (two
    storages alive at once never share a nonzero ``data_ptr``: compare it with tensors still alive). A storage's label
    is the innermost :meth:`tag` open when it was made, else ``file.py:function`` of the innermost
    seqpar frame that made it (``"?"`` when none did; storages alive at entry: ``"existing"``).
    Re-entering the same tracker keeps its counts (one peak over several windows).
    """

    def __init__(self, device: str = "cpu", *, count_existing: bool = True, record_peak: bool = False) -> None:
        super().__init__()
        self.device_type = torch.device(device).type
        self.count_existing = count_existing
        self.record_peak = record_peak
        self.baseline = 0
        self.current = 0
        self.peak = 0
        self.peak_live: list[tuple[str, int, int]] = []
        self._sizes: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storage -> [bytes counted]
        self._labels: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storage -> label (record_peak)
        self._tags: list[str] = []
        self._entered = False
        self._orig_resize: Any = None
        self._orig_wait: Any = None
        # per thread: one list per Work.wait() running, of the backend copies first seen in it
        self._waits = threading.local()
        self._ended: WeakIdKeyDictionary = WeakIdKeyDictionary()  # backend copies whose wait returned
        # storages alive at entry, not counted (count_existing=False): never backend copies (module docstring)
        self._pre_entry: WeakIdKeyDictionary = WeakIdKeyDictionary()

    # ------------------------------------------------------------------ registration
    def _register(self, st: torch.UntypedStorage) -> None:
        if st.device.type != self.device_type or st in self._ended:
            return
        nbytes = st.nbytes()
        counted = self._sizes.get(st)  # a one-item list shared with the storage's finalizer
        if counted is None:
            counted = self._sizes[st] = [nbytes]
            weakref.finalize(st, self._release, weakref.ref(self), counted)
            self.current += nbytes
            if self.record_peak:
                self._labels[st] = self._tags[-1] if self._tags else _maker()
        elif counted[0] != nbytes:  # resized in place (e.g. a zero-size storage refilled)
            self.current += nbytes - counted[0]
            counted[0] = nbytes
        if self.current > self.peak and self.record_peak:
            self.peak_live = [(self._labels.get(s, "?"), n[0], s.data_ptr()) for s, n in self._sizes.items() if n[0]]
        self.peak = max(self.peak, self.current)

    def label(self, tensor: torch.Tensor, label: str) -> None:
        """Relabel the storages behind ``tensor`` (``record_peak``), e.g. a buffer handed to a send."""
        for st in tensor_storages(tensor):
            if st in self._sizes:
                self._labels[st] = label

    @contextmanager
    def tag(self, label: str) -> Iterator[None]:
        """Label the storages made inside the ``with`` block ``label`` (``record_peak``)."""
        self._tags.append(label)
        try:
            yield
        finally:
            self._tags.pop()

    @staticmethod
    def _release(tracker_ref: weakref.ref, nbytes_ref: list[int]) -> None:
        tracker = tracker_ref()
        if tracker is not None:
            tracker.current -= nbytes_ref[0]

    def track(self, *objs: Any) -> None:
        """Register tensors reachable from ``objs`` (tensors, modules, optimizers, containers)."""
        for obj in objs:
            for t in _tensors_of(obj):
                for st in tensor_storages(t):
                    self._register(st)

    def track_reachable(self, *roots: Any) -> None:
        """Register every tensor reachable from ``roots`` through object references (attributes,
        containers, closures), not through modules, classes or functions' globals: e.g. a
        training engine, whose optimizer and flat buffers hang off it. Unlike ``count_existing``
        this ignores tensors of other jobs in the same process (a test's persistent ranks)."""
        seen: set[int] = set()
        todo = list(roots)
        while todo:
            obj = todo.pop()
            if id(obj) in seen or isinstance(obj, _OPAQUE):
                continue
            seen.add(id(obj))
            if isinstance(obj, torch.Tensor):
                for t in _tensors_of(obj):
                    for st in tensor_storages(t):
                        self._register(st)
            todo.extend(gc.get_referents(obj))

    def _register_all_live(self) -> None:
        gc.collect()  # garbage in reference cycles is not memory the block can use
        for st in _live_storages():
            self._register(st)

    def _note_pre_entry(self) -> None:
        """Record, uncounted, the storages alive at entry (``count_existing=False``): none is a backend copy."""
        for st in _live_storages():
            if st.device.type == self.device_type:
                self._pre_entry[st] = True

    # ------------------------------------------------------------------ mode
    def __enter__(self) -> TensorMemoryTracker:
        if not self._entered:
            self._entered = True
            if self.count_existing:
                with self.tag("existing"):
                    self._register_all_live()
            else:
                self._note_pre_entry()
            self.baseline = self.current
            self.peak = max(self.peak, self.current)
        self._wrap_resize()
        self._wrap_wait()
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._restore_wait()
        self._restore_resize()

    def _wrap_resize(self) -> None:
        # UntypedStorage.resize_ does not go through the dispatcher: follow it here.
        # Only the entering thread's resizes, as the dispatch mode (thread-local) sees only that thread's ops: the
        # wrapper is global, and another thread's resize inside the window (a 1 MiB storage refilled by a library's
        # thread) would otherwise enter the step's peak.
        self._orig_resize = torch.UntypedStorage.resize_
        orig, tracker, owner = self._orig_resize, self, threading.get_ident()

        def resize_(st: torch.UntypedStorage, size: int) -> Any:
            out = orig(st, size)
            if threading.get_ident() == owner:
                tracker._register(st)
            return out

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]

    def _restore_resize(self) -> None:
        if self._orig_resize is not None:
            torch.UntypedStorage.resize_ = self._orig_resize  # type: ignore[method-assign]
            self._orig_resize = None

    def _wrap_wait(self) -> None:
        # A backend copy is counted until the wait on its collective returns (module docstring).
        # Work is a pybind class: its wait can be replaced on the class and is restored on exit.
        work = _work_class()
        if work is None:
            return
        self._orig_wait = work.wait
        orig, tracker = self._orig_wait, self

        def wait(w: Any, *args: Any, **kwargs: Any) -> Any:
            stack = tracker._wait_stack()
            stack.append([])
            try:
                return orig(w, *args, **kwargs)
            finally:
                tracker._end_copies(stack.pop())

        work.wait = wait

    def _restore_wait(self) -> None:
        if self._orig_wait is not None:
            _work_class().wait = self._orig_wait
            self._orig_wait = None

    def _wait_stack(self) -> list[list[weakref.ref]]:
        stack = getattr(self._waits, "stack", None)
        if stack is None:
            stack = self._waits.stack = []
        return stack

    def _end_copies(self, copies: list[weakref.ref]) -> None:
        """Subtract the backend copies first seen in a wait that has returned (each once)."""
        for ref in copies:
            st = ref()
            if st is None:
                continue  # freed before the wait returned: its finalizer subtracted it
            counted = self._sizes.get(st)
            if counted is not None and st not in self._ended:
                self.current -= counted[0]
                counted[0] = 0  # the finalizer subtracts nothing more
                self._ended[st] = True

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            return NotImplemented  # let DTensor desugar into plain ops, which come back here
        out = func(*args, **(kwargs or {}))
        stack = getattr(self._waits, "stack", None)
        inputs: set[int] | None = None
        for x in tree_flatten(out)[0]:
            if isinstance(x, torch.Tensor):
                for st in tensor_storages(x):
                    if (stack and st not in self._sizes and st.device.type == self.device_type
                            and st not in self._pre_entry):
                        if inputs is None:
                            inputs = {s._cdata for a in tree_flatten((args, kwargs))[0]
                                      if isinstance(a, torch.Tensor) for s in tensor_storages(a)}
                        if st._cdata in inputs:  # not made by this op, never seen made: a backend copy
                            stack[-1].append(weakref.ref(st))
                    self._register(st)
        return out


_SEQPAR_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _maker() -> str:
    """``file.py:function`` of the innermost seqpar frame on the stack outside this module."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(_SEQPAR_DIR) and path != __file__:
            return f"{os.path.basename(path)}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


def _live_storages() -> Iterator[torch.UntypedStorage]:
    """The storages of every tensor the garbage collector can see (a storage may come more than once)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance() on deprecated module proxies warns
        for obj in gc.get_objects():
            try:
                is_tensor = isinstance(obj, torch.Tensor)
            except Exception:  # noqa: BLE001 - exotic proxies may raise on isinstance
                continue
            if is_tensor:
                yield from tensor_storages(obj)


def _work_class() -> Any:
    """``torch.distributed``'s ``Work`` (``None`` in a build without distributed support)."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed.distributed_c10d import Work

    return Work


# Followed no further by track_reachable: they lead to whole modules' globals, not to a job's state.
_OPAQUE = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, str, bytes, int, float)


def _tensors_of(obj: Any) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
        # only leaves and retain_grad() tensors keep a .grad; reading it on any other tensor (a
        # job's saved activations) makes torch warn into the user's training log
        if (obj.is_leaf or obj.retains_grad) and obj.grad is not None:
            yield obj.grad
    elif isinstance(obj, torch.nn.Module):
        for p in obj.parameters():
            yield from _tensors_of(p)
        yield from obj.buffers()
    elif isinstance(obj, torch.optim.Optimizer):
        for state in obj.state.values():
            yield from _tensors_of(list(state.values()))
        for group in obj.param_groups:
            yield from _tensors_of(group["params"])
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors_of(v)
    elif isinstance(obj, (list, tuple, set)):
        for v in obj:
            yield from _tensors_of(v)
