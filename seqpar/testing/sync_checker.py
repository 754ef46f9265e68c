"""The host-sync checker: CUDA host syncs found without a GPU (issue 20 §1; the scenarios: :mod:`seqpar.testing.syncs`).

A CUDA host waits for the device at every data-dependent operation (``.item()``, ``nonzero``, a
boolean-mask index, ``torch.equal``...) and at every blocking copy between host and device
(``.cpu()``, ``.tolist()``, ``torch.tensor(data, device="cuda")``). On CPU none of these costs
anything, so a CPU test suite cannot see them; on fake CUDA tensors (:mod:`seqpar.testing.fake_world`)
they can be watched.

:class:`SyncChecker` watches every operation (a ``TorchFunctionMode`` for the Python-level calls,
``.numpy()`` and ``torch.tensor`` among them, and a ``TorchDispatchMode`` for the aten ops beneath:
``_local_scalar_dense``, ``nonzero``, ``equal``, cross-device ``_to_copy``...). Inside a **layer**
scope any of them raises :class:`HostSyncError` naming the operation and the source line. Outside
(the **batch** scope: what runs once per batch, before the first layer) they are counted and
answered (known values for tensors registered with :meth:`SyncChecker.cuda`, else ones), so the
once-per-batch syncs can be counted and shown not to grow with depth.
"""

from __future__ import annotations

import contextlib
import functools
import os
import traceback
import weakref
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    FakeTensor,
    unset_fake_temporarily,
)
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostSyncError", "SyncEvent", "SyncChecker", "cuda_build"]


def cuda_build() -> bool:
    """True on torch's CUDA build (the one that runs whole layers on fake CUDA tensors)."""
    return torch.version.cuda is not None


class HostSyncError(AssertionError):
    """A host sync (data-dependent op or blocking host<->device copy) inside a layer."""


@dataclass(frozen=True)
class SyncEvent:
    op: str
    where: str  # "path:line in function" of the innermost frame outside torch and this module
    scope: str  # "batch" or "layer:<name>"




_HERE = os.path.dirname(os.path.abspath(__file__))
# the checker's own modules (formerly one file, seqpar/testing/syncs.py): a sync is reported at the first
# frame outside them, torch and the standard library
_OWN_FILES = frozenset(os.path.join(_HERE, name) for name in (
    "sync_checker.py", "fake_world.py", "syncs.py", "sync_scenarios.py", "sync_mixers.py"))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_SKIP_DIRS = (_TORCH_DIR, os.path.dirname(contextlib.__file__))


def _caller() -> str:
    """The innermost frame that is neither torch, the standard library nor the checker's own modules."""
    for frame in reversed(traceback.extract_stack()):
        path = os.path.abspath(frame.filename)
        if path in _OWN_FILES or path.startswith(_SKIP_DIRS) or frame.filename.startswith("<"):
            continue
        short = path
        for marker in ("/seqpar/", "/integrations/", "/tests/", "/transformers/"):
            if marker in path:
                short = path[path.rindex(marker) + 1:]
                break
        return f"{short}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()}"
    return "<unknown>"


def _is_cuda(x: object) -> bool:
    return isinstance(x, Tensor) and x.device.type == "cuda"


def _device_of(value: object) -> str | None:
    if value is None:
        return None
    return torch.device(value).type if isinstance(value, (str, torch.device)) else None


def _bool_index(index: object) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, Tensor) and i.dtype == torch.bool for i in items)


# Python-level calls that sync on CUDA, by the name the TorchFunctionMode sees; the predicate says
# when (args, kwargs) make it a sync.
def _always(args: tuple, kwargs: dict) -> bool:
    return any(_is_cuda(a) for a in args) or any(_is_cuda(a) for a in kwargs.values())


def _to_host(args: tuple, kwargs: dict) -> bool:
    # x.cpu(), x.to("cpu"), x.to(torch.device("cpu")); non_blocking copies are asynchronous
    if not args or not _is_cuda(args[0]) or kwargs.get("non_blocking"):
        return False
    targets = [a for a in args[1:] if isinstance(a, (str, torch.device))] + [kwargs.get("device")]
    return any(_device_of(t) == "cpu" for t in targets)


def _from_host(args: tuple, kwargs: dict) -> bool:
    # torch.tensor(python data, device="cuda"): a blocking copy from pageable host memory
    return _device_of(kwargs.get("device")) == "cuda" and not (args and isinstance(args[0], Tensor))


def _no_output_size(args: tuple, kwargs: dict) -> bool:
    # repeat_interleave(repeats tensor) without output_size must read the repeats' sum
    repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
    tensor_repeats = isinstance(repeats, Tensor) or (len(args) == 1 and isinstance(args[0], Tensor))
    return _always(args, kwargs) and tensor_repeats and kwargs.get("output_size") is None


_PY_SYNCS: dict[str, Callable[[tuple, dict], bool]] = {
    "item": _always, "tolist": _always, "numpy": _always, "__bool__": _always, "__int__": _always,
    "__float__": _always, "__index__": _always, "equal": _always, "allclose": _always, "nonzero": _always,
    "argwhere": _always, "masked_select": _always, "unique": _always, "unique_consecutive": _always,
    "cpu": lambda a, k: _always(a, k) and not k.get("non_blocking"), "to": _to_host, "tensor": _from_host, "as_tensor": _from_host,
    "repeat_interleave": _no_output_size,
    "__getitem__": lambda a, k: _always(a, k) and len(a) > 1 and _bool_index(a[1]),
}

# aten ops (overload packet names) that sync on CUDA whatever their arguments.
_ATEN_SYNCS = {
    "_local_scalar_dense", "nonzero", "nonzero_static", "argwhere", "masked_select", "equal", "allclose",
    "is_nonzero", "unique", "_unique", "_unique2", "unique_dim", "unique_consecutive", "unique_dim_consecutive",
    "_assert_async",
}


class _FunctionWatch(TorchFunctionMode):
    def __init__(self, checker: SyncChecker) -> None:
        super().__init__()
        self.checker = checker

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        test = _PY_SYNCS.get(name)
        if name in ("tensor", "as_tensor") and not self.checker._depth and not _from_host(args, kwargs):
            return self.checker._host_tensor(func, args, kwargs)
        if test is None or self.checker._depth or not test(args, kwargs):
            return func(*args, **kwargs)
        return self.checker._sync(name, lambda: func(*args, **kwargs), args)


class _DispatchWatch(TorchDispatchMode):
    def __init__(self, checker: SyncChecker) -> None:
        super().__init__()
        self.checker = checker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if not self.checker._depth and _aten_sync(name, func, args, kwargs):
            return self.checker._sync(f"aten.{name}", lambda: func(*args, **kwargs), args)
        return func(*args, **kwargs)


def _aten_sync(name: str, func: Any, args: tuple, kwargs: dict) -> bool:
    if name not in ("_to_copy", "copy_") and not _always(args, kwargs):
        return False  # host tensors only: nothing to wait for
    if name in _ATEN_SYNCS:
        return True
    if name == "repeat_interleave" and func._overloadname.startswith("Tensor"):
        return kwargs.get("output_size") is None and (len(args) < 3 or args[-1] is None)
    if name in ("index", "index_put", "index_put_", "_index_put_impl_", "_unsafe_index"):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(i, Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())
    if name == "_to_copy":  # blocking copies between host and device
        src, dst = args[0].device.type, _device_of(kwargs.get("device")) or args[0].device.type
        return {src, dst} == {"cpu", "cuda"} and not kwargs.get("non_blocking", False)
    if name == "copy_":
        src, dst = args[1].device.type, args[0].device.type
        return {src, dst} == {"cpu", "cuda"} and not (len(args) > 2 and args[2]) and not kwargs.get("non_blocking")
    return False


_WAITS = [(torch.cuda, "synchronize"), (torch.cuda.Stream, "synchronize"), (torch.cuda.Event, "synchronize")]


class SyncChecker:
    """Watch a block of code for CUDA host syncs; see the module docstring.

    Use as a context manager inside ``FakeTensorMode`` (its modes must sit above the fake mode, so
    that they see the operations before the fake tensors raise)::

        with FakeTensorMode(), SyncChecker() as checker:
            ...                         # batch scope: syncs counted
            with checker.layer("attn"):
                ...                     # any sync raises HostSyncError(op, source line)
    """

    def __init__(self) -> None:
        self.events: list[SyncEvent] = []
        self._scopes: list[str] = ["batch"]
        self._depth = 0  # inside a sync being answered: its own inner ops are not counted again
        self._known: dict[int, tuple[weakref.ref, list]] = {}
        self._modes: list[Any] = []

    def __enter__(self) -> SyncChecker:
        self._modes = [_FunctionWatch(self), _DispatchWatch(self)]
        for mode in self._modes:
            mode.__enter__()
        # FakeTensor.tolist is plain Python (an .item() per element, on new tensors): watch it as one
        # call, so that the values of a known tensor can be answered
        self._tolist = FakeTensor.tolist
        checker = self

        def tolist(x: Tensor) -> Any:
            if checker._depth:
                return checker._values(x, lambda: checker._tolist(x))
            if x.device.type != "cuda":  # no sync: a host tensor's values, when known
                return checker._values(x, lambda: checker._tolist(x))
            return checker._sync("tolist", lambda: checker._tolist(x), (x,))

        FakeTensor.tolist = tolist
        # waits for the device that no aten op shows
        self._saved = [(owner, name, getattr(owner, name)) for owner, name in _WAITS]
        for owner, name in _WAITS:
            setattr(owner, name, functools.partial(self.wait, f"{owner.__name__}.{name}"))
        return self

    def wait(self, op: str, *args: Any, **kwargs: Any) -> None:
        """A host wait for the device named ``op`` (``torch.cuda.synchronize``, a stream's or an event's
        ``synchronize``): a sync, as :meth:`_sync` judges it in the current scope."""
        if not self._depth:
            self._sync(op, lambda: None, ())

    def __exit__(self, *exc: object) -> None:
        for owner, name, value in self._saved:
            setattr(owner, name, value)
        FakeTensor.tolist = self._tolist
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        self._modes = []

    @contextlib.contextmanager
    def _scope(self, scope: str) -> Iterator[None]:
        """``scope`` innermost for the ``with`` block (the one :meth:`_sync` judges a sync in)."""
        self._scopes.append(scope)
        try:
            yield
        finally:
            self._scopes.pop()

    @contextlib.contextmanager
    def layer(self, name: str) -> Iterator[None]:
        """A scope in which any host sync is an error (a layer's forward or backward)."""
        with self._scope(f"layer:{name}"):
            yield

    @contextlib.contextmanager
    def batch_scope(self) -> Iterator[None]:
        """A batch scope inside a layer: once-per-batch work a layer does at its first call (counted,
        not an error)."""
        with self._scope("batch"):
            yield

    @contextlib.contextmanager
    def startup(self) -> Iterator[None]:
        """A first, warm-up step: once-per-run work (e.g. ``mode="auto"`` probing the links) is
        counted under "startup", allowed, and not steady state."""
        with self._scope("startup"):
            yield

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Not watched: building the test's own model and data (no part of a training step)."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1

    def cuda(self, values: Sequence, dtype: torch.dtype) -> Tensor:
        """A fake CUDA tensor whose values the checker knows: a batch-scope ``tolist`` of it returns
        them (e.g. the document boundaries every rank holds). ``values``: (nested) Python numbers."""
        with unset_fake_temporarily():
            real = torch.tensor(values, dtype=dtype)
        self._depth += 1
        try:
            fake = torch.empty(real.shape, dtype=dtype, device="cuda")
        finally:
            self._depth -= 1
        self._known[id(fake)] = (weakref.ref(fake), real.tolist())
        return fake

    def _host_tensor(self, func: Callable, args: tuple, kwargs: dict) -> Tensor:
        """``torch.tensor(data)`` on the host: made fake like any tensor here, but its values are known."""
        out = func(*args, **kwargs)
        if isinstance(out, FakeTensor) and args and not isinstance(args[0], Tensor):
            with unset_fake_temporarily():
                self._known[id(out)] = (weakref.ref(out), func(*args, **kwargs).tolist())
        return out

    def _values(self, x: Tensor, run: Callable[[], Any]) -> Any:
        hit = self._known.get(id(x))
        if hit is not None and hit[0]() is x:
            return hit[1]
        try:
            return run()
        except DataDependentOutputException:  # a fake host tensor of unknown values
            return _ones(tuple(x.shape), x.dtype)

    def counts(self, scope: str = "batch") -> Counter:
        """Syncs per operation seen in ``scope`` ("batch", or a layer prefix)."""
        return Counter(e.op for e in self.events if e.scope.startswith(scope))

    # -------------------------------------------------------------------------------- internals
    def _sync(self, op: str, run: Callable[[], Any], args: tuple) -> Any:
        scope = "startup" if "startup" in self._scopes else self._scopes[-1]
        event = SyncEvent(op, _caller(), scope)
        self.events.append(event)
        if scope.startswith("layer:"):
            raise HostSyncError(
                f"host sync in {scope[len('layer:'):]}: {op} at {event.where} -- on CUDA this blocks "
                f"the host until the device catches up (a data-dependent result or a blocking copy between "
                f"host and device). Layers must make none: compute it on the host once per batch, or keep it "
                f"on the device."
            )
        self._depth += 1
        try:
            return self._answer(op, run, args)
        finally:
            self._depth -= 1

    def _answer(self, op: str, run: Callable[[], Any], args: tuple) -> Any:
        """A once-per-batch sync's result: fake tensors have no data, so known values, else ones."""
        x = args[0] if args and isinstance(args[0], Tensor) else None
        if x is None or not isinstance(x, FakeTensor):
            return run()
        hit = self._known.get(id(x))
        values = hit[1] if hit is not None and hit[0]() is x else None
        if op in ("tolist", "aten._to_copy", "cpu", "to"):
            if op != "tolist":
                return run()
            return values if values is not None else _ones(tuple(x.shape), x.dtype)
        if op in ("item", "__int__", "__index__", "__float__", "aten._local_scalar_dense"):
            return values if values is not None and not isinstance(values, list) else _ones((), x.dtype)
        if op in ("__bool__", "equal", "allclose", "aten.equal", "aten.allclose", "aten.is_nonzero"):
            return True
        return run()


def _ones(shape: tuple[int, ...], dtype: torch.dtype) -> Any:
    """Nested lists of ones (``tolist`` of a tensor of ``shape``): the answer for a fake tensor whose
    values are unknown (every rank then holds the same digest; a measured rate is finite)."""
    if not shape:
        return True if dtype == torch.bool else 1.0 if dtype.is_floating_point else 1
    return [_ones(shape[1:], dtype) for _ in range(shape[0])]

