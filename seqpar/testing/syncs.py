"""Host syncs as CUDA would make them, found without a GPU (issue 20 §1).

A CUDA host waits for the device at every data-dependent operation (``.item()``, ``nonzero``, a
boolean-mask index, ``torch.equal``...) and at every blocking copy between host and device
(``.cpu()``, ``.tolist()``, ``torch.tensor(data, device="cuda")``). On CPU none of these costs
anything, so a CPU test suite cannot see them. This module runs seqpar as one rank of a P-rank CUDA
world inside one CPU process:

- every tensor is a **fake CUDA tensor** (``FakeTensorMode``): shapes, dtypes and devices, no data;
  a fake tensor raises on data-dependent output, which is a ready-made detector;
- the process group is torch's **fake process group** (``init_process_group("fake", ...)``): its
  collectives and point-to-point ops accept fake CUDA tensors and do nothing;
- the device is answered as an H100 or an A100 (:func:`simulated_gpu`), so the kernel choice is the
  one those GPUs make.

Only torch's CUDA build runs more than single kernels on fake CUDA tensors (the CPU build raises "not
linked with support for cuda devices" at the first indexing); the CUDA build imports and runs on a
CPU-only machine (see ``.ci/cuda_venv``). The C++ autograd engine wants a real device, so the
backward is run by calling each seqpar ``autograd.Function``'s backward directly on its saved
tensors (:func:`run_backward`); the maths lives in those functions.

:class:`SyncChecker` watches every operation (a ``TorchFunctionMode`` for the Python-level calls,
``.numpy()`` and ``torch.tensor`` among them, and a ``TorchDispatchMode`` for the aten ops beneath:
``_local_scalar_dense``, ``nonzero``, ``equal``, cross-device ``_to_copy``...). Inside a **layer**
scope any of them raises :class:`HostSyncError` naming the operation and the source line. Outside
(the **batch** scope: what runs once per batch, before the first layer) they are counted and
answered (known values for tensors registered with :meth:`SyncChecker.cuda`, else ones), so the
once-per-batch syncs can be counted and shown not to grow with depth.

:func:`run_scenario` / :data:`SCENARIOS` cover every mode and feature; ``python -m
seqpar.testing.syncs --world-sizes 2 4 8`` runs them all and prints the syncs per batch.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import time
import traceback
import types
import weakref
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    FakeTensor,
    unset_fake_temporarily,
)
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "HostSyncError", "SyncEvent", "SyncChecker", "GPUS", "simulated_gpu", "fake_rank", "run_backward",
    "Scenario", "SCENARIOS", "run_scenario", "check_world", "cuda_build",
]

# (capability, cuDNN version) of the GPUs simulated; cuDNN 9.10 as the torch 2.11 CUDA 13 wheels ship.
GPUS: dict[str, tuple[tuple[int, int], int]] = {"h100": ((9, 0), 91002), "a100": ((8, 0), 91002)}
# what get_device_properties reports for them: total memory (bytes) and SMs (H100 SXM 80 GB, A100 SXM 80 GB)
GPU_SIZES: dict[str, tuple[int, int]] = {"h100": (85_045_198_848, 132), "a100": (85_098_496_000, 108)}


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


_HERE = os.path.abspath(__file__)
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_SKIP_DIRS = (_TORCH_DIR, os.path.dirname(contextlib.__file__))


def _caller() -> str:
    """The innermost frame that is neither torch, the standard library nor this module."""
    for frame in reversed(traceback.extract_stack()):
        path = os.path.abspath(frame.filename)
        if path == _HERE or path.startswith(_SKIP_DIRS) or frame.filename.startswith("<"):
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
            setattr(owner, name, functools.partial(self._wait, f"{owner.__name__}.{name}"))
        return self

    def _wait(self, op: str, *args: Any, **kwargs: Any) -> None:
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
    def layer(self, name: str) -> Iterator[None]:
        """A scope in which any host sync is an error (a layer's forward or backward)."""
        self._scopes.append(f"layer:{name}")
        try:
            yield
        finally:
            self._scopes.pop()

    @contextlib.contextmanager
    def startup(self) -> Iterator[None]:
        """A first, warm-up step: once-per-run work (e.g. ``mode="auto"`` probing the links) is
        counted under "startup", allowed, and not steady state."""
        self._scopes.append("startup")
        try:
            yield
        finally:
            self._scopes.pop()

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


# ------------------------------------------------------------------------------ the fake world
@contextlib.contextmanager
def simulated_gpu(gpu: str = "h100") -> Iterator[None]:
    """Answer torch's device queries as one ``gpu`` (see :data:`GPUS`) at index 0.

    ``torch.cuda.is_available()`` stays False: fake tensors would otherwise initialise a real CUDA
    context for every new device."""
    from seqpar.kernels import backends

    capability, cudnn = GPUS[gpu]
    total_memory, sm_count = GPU_SIZES[gpu]
    props = types.SimpleNamespace(name=gpu.upper(), major=capability[0], minor=capability[1],
                                  total_memory=total_memory, multi_processor_count=sm_count)
    patches = {
        (torch.cuda, "current_device"): lambda: 0,
        # the fake process group stands in for NCCL: code that picks a device by backend picks CUDA
        (dist, "get_backend"): lambda group=None: "nccl",
        (torch.cuda, "get_device_capability"): lambda device=None: capability,
        (torch.cuda, "get_device_properties"): lambda device=None: props,
        (torch.backends.cudnn, "is_available"): lambda: True,
        (torch.backends.cudnn, "version"): lambda: cudnn,
    }
    saved = {key: getattr(*key) for key in patches}
    for (owner, name), value in patches.items():
        setattr(owner, name, value)
    backends._cuda_caps.cache_clear()
    try:
        yield
    finally:
        for (owner, name), value in saved.items():
            setattr(owner, name, value)
        backends._cuda_caps.cache_clear()


@contextlib.contextmanager
def fake_rank(rank: int, world_size: int) -> Iterator[None]:
    """Rank ``rank`` of a ``world_size`` world on torch's fake process group (collectives do nothing)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import seqpar

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        seqpar.destroy_process_groups()
        dist.destroy_process_group()


def _seqpar_nodes(roots: Sequence[Tensor]) -> list[Any]:
    """The seqpar ``autograd.Function`` nodes of the graph behind ``roots``, latest first."""
    seen: set[Any] = set()  # the nodes themselves: ids of freed Python wrappers would be reused
    found: list[Any] = []
    stack = [t.grad_fn for t in roots if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        cls = getattr(node, "_forward_cls", None)
        if cls is not None and cls.__module__.startswith(("seqpar.", "integrations.")):
            found.append(node)
        stack.extend(nxt for nxt, _ in node.next_functions)
    return found


def _metadata_zeros(node: Any) -> list[Tensor]:
    return [torch.zeros(tuple(m.shape), dtype=m.dtype, device=m.device) for m in node._input_metadata]


def python_grad(outputs: Tensor | Sequence[Tensor], inputs: Tensor | Sequence[Tensor],
                grad_outputs: Tensor | Sequence[Tensor | None] | None = None, retain_graph: bool | None = None,
                create_graph: bool = False, allow_unused: bool | None = None, **_: Any) -> tuple[Tensor | None, ...]:
    """``torch.autograd.grad`` for leaf ``inputs``, run in Python by calling each graph node in
    topological order: what seqpar's own backward functions need (recompute-norm and tiled-MLP
    backwards call ``autograd.grad`` on a chunk), on fake CUDA tensors, where the C++ engine needs a
    real device. Only the nodes of torch's C++ ops are supported (no custom Functions inside)."""
    outs = [outputs] if isinstance(outputs, Tensor) else list(outputs)
    ins = [inputs] if isinstance(inputs, Tensor) else list(inputs)
    if grad_outputs is None or isinstance(grad_outputs, Tensor):
        gouts = [grad_outputs] * len(outs)
    else:
        gouts = list(grad_outputs)
    deps: Counter = Counter()
    seen: set[Any] = set()
    stack = [o.grad_fn for o in outs if o.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        for nxt, _ in node.next_functions:
            if nxt is not None:
                deps[nxt] += 1
                stack.append(nxt)
    buffers: dict[Any, list[Tensor | None]] = {}
    for o, g in zip(outs, gouts):
        g = torch.ones_like(o) if g is None else g
        buf = buffers.setdefault(o.grad_fn, [None] * len(o.grad_fn._input_metadata))
        buf[o.output_nr] = g if buf[o.output_nr] is None else buf[o.output_nr] + g
    found: dict[int, Tensor] = {}
    ready = [n for n in buffers if deps[n] == 0]
    while ready:
        node = ready.pop()
        grads = buffers.pop(node, None) or []
        if hasattr(node, "variable"):  # AccumulateGrad: the gradient of a leaf
            if grads and grads[0] is not None:
                key = id(node.variable)
                found[key] = grads[0] if key not in found else found[key] + grads[0]
            continue
        if getattr(node, "_forward_cls", None) is not None:
            raise NotImplementedError(f"python_grad: custom Function {node._forward_cls.__name__} in the graph")
        zeros = _metadata_zeros(node)
        results = node(*[g if g is not None else z for g, z in zip(grads, zeros)])
        results = (results,) if isinstance(results, Tensor) else results
        for (nxt, nr), r in zip(node.next_functions, results):
            if nxt is None:
                continue
            if r is not None:
                # as the engine does: a broadcast input's gradient is summed back to its shape
                target = nxt.variable.shape if hasattr(nxt, "variable") else tuple(nxt._input_metadata[nr].shape)
                if tuple(r.shape) != tuple(target):
                    r = r.sum_to_size(target)
                buf = buffers.setdefault(nxt, [None] * max(1, len(getattr(nxt, "_input_metadata", ()))))
                buf[nr] = r if buf[nr] is None else buf[nr] + r
            deps[nxt] -= 1
            if deps[nxt] == 0:
                ready.append(nxt)
    return tuple(found.get(id(t)) for t in ins)


def run_backward(roots: Sequence[Tensor], checker: SyncChecker) -> list[str]:
    """Run the backward of every seqpar ``autograd.Function`` behind ``roots`` by calling it directly
    on its saved tensors (the C++ engine wants a real device), each in a layer scope, with fake
    incoming gradients of the outputs' shapes; ``torch.autograd.grad`` inside them runs as
    :func:`python_grad`. Returns the Functions run, in order."""
    ran = []
    engine_grad = torch.autograd.grad
    torch.autograd.grad = python_grad
    try:
        for node in _seqpar_nodes(roots):
            name = node._forward_cls.__name__
            with checker.layer(f"{name}.backward"), torch.no_grad():  # as the engine runs a backward
                node._forward_cls.backward(node, *_metadata_zeros(node))
            ran.append(name)
    finally:
        torch.autograd.grad = engine_grad
    return ran


def _layer_hooks(modules: Sequence[nn.Module], checker: SyncChecker, name: str) -> list[Any]:
    """Forward pre/post hooks that put each module's forward in a layer scope."""
    handles = []
    for i, module in enumerate(modules):
        scope: list[Any] = []

        def pre(mod: nn.Module, args: Any, scope: list = scope, i: int = i) -> None:
            cm = checker.layer(f"{name}[{i}]")
            cm.__enter__()
            scope.append(cm)

        def post(mod: nn.Module, args: Any, out: Any, scope: list = scope) -> None:
            if scope:
                scope.pop().__exit__(None, None, None)

        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post, always_call=True)]
    return handles


# ---------------------------------------------------------------------------------- scenarios
@dataclass(frozen=True)
class Scenario:
    """One configuration the checker runs on every rank.

    ``kind``: ``"attention"`` (``seqpar.attention`` calls as layers), ``"dilated"``, ``"mha"`` (a swapped
    ``nn.TransformerEncoder``), ``"hf"`` (a swapped tiny Llama), ``"gather"`` (``gather_sequence``),
    ``"mixer"`` (a family of :data:`MIXERS`, named by ``extra["mixer"]``), ``"moe"`` (the router
    statistics over the SP group), ``"offload"`` (``CudaTransfer`` on stubbed streams). ``extra``:
    mode options, ``"gpus"`` (the simulated GPUs, default both), ``"batch_syncs"`` (an expected count
    that theory in the tests does not derive)."""

    name: str
    kind: str = "attention"
    mode: str = "ring"
    sharding: str = "zigzag"
    q_heads: int = 8
    kv_heads: int = 2
    documents: bool = False
    window: int | None = None
    sinks: bool = False
    head_chunks: int | str = "auto"
    ulysses: int | None = None  # hybrid: the Ulysses degree (needs P > u)
    min_world: int = 2
    extra: dict = field(default_factory=dict, hash=False, compare=False)

    def applies(self, world: int) -> bool:
        if world < self.min_world:
            return False
        if self.mode == "ulysses" and self.q_heads % world:
            return False
        if self.ulysses is not None and not 1 < self.ulysses < world:
            return False
        return True


SEQ_PER_RANK = 16
HEAD_DIM = 64
LAYERS = 2


def _documents(seq: int) -> tuple[int, ...]:
    """Uneven packed documents over ``seq`` tokens: cuts at 3/16, 1/2 and 9/16 of the sequence."""
    return (0, 3 * seq // 16, seq // 2, 9 * seq // 16, seq)


SCENARIOS: list[Scenario] = [
    Scenario("ring-dense-contiguous", sharding="contiguous"),
    Scenario("ring-dense-zigzag"),
    Scenario("ring-head-chunks-1", head_chunks=1),
    Scenario("ring-documents", documents=True),
    Scenario("ring-documents-balanced", documents=True, sharding="balanced"),
    Scenario("ring-window", window=5),
    Scenario("ring-window-documents-sinks", window=5, documents=True, sinks=True),
    Scenario("ring-no-overlap", extra={"overlap": False}),
    Scenario("allgather-dense", mode="allgather"),
    Scenario("allgather-documents-window-sinks", mode="allgather", documents=True, window=5, sinks=True),
    Scenario("ulysses-mha", mode="ulysses", kv_heads=8),
    Scenario("ulysses-gqa", mode="ulysses"),  # kv_heads 2 < u at P = 4, 8
    Scenario("ulysses-mqa", mode="ulysses", kv_heads=1),
    Scenario("ulysses-documents-window-sinks", mode="ulysses", documents=True, window=5, sinks=True),
    Scenario("ulysses-balanced-documents", mode="ulysses", documents=True, sharding="balanced"),
    Scenario("hybrid-u2", mode="hybrid", ulysses=2, min_world=4),
    Scenario("hybrid-u2-mqa-documents-window-sinks", mode="hybrid", ulysses=2, kv_heads=1, documents=True,
             window=5, sinks=True, min_world=4),
    Scenario("hybrid-u4", mode="hybrid", ulysses=4, min_world=8),
    Scenario("auto", mode="auto", extra={"warmup": True}),  # the first call probes the links, once per run
    Scenario("dilated-ring", kind="dilated", sharding="contiguous"),
    Scenario("dilated-allgather", kind="dilated", mode="allgather", sharding="contiguous"),
    Scenario("gather-sequence-balanced", kind="gather", sharding="balanced", documents=True),
    Scenario("mha-route", kind="mha", q_heads=4, kv_heads=4),
    Scenario("mha-route-mask-only", kind="mha", q_heads=4, kv_heads=4, extra={"hint": False}),
    Scenario("hf-route", kind="hf", q_heads=4, kv_heads=2),
    Scenario("hf-route-documents", kind="hf", q_heads=4, kv_heads=2, documents=True),
    Scenario("hf-route-tiling-recompute-norm", kind="hf", q_heads=4, kv_heads=2,
             extra={"tiling": True, "recompute_norm": True}),
]

SCENARIOS.append(Scenario("moe-router-statistics", kind="moe", extra={"gpus": ("h100",)}))
SCENARIOS.append(Scenario("offload", kind="offload", extra={"gpus": ("h100",)}))

# Mixers (kind "mixer"): each family's sequence-parallel layer, built from a tiny transformers layer, called
# LAYERS times on one batch; extra["mixer"] names its builder in MIXERS (below). Every family runs dense
# (contiguous) and with packed documents (zigzag: two chunks per rank, documents crossing them). A new
# family: a builder decorated with @mixer("name") and its name in MIXER_FAMILIES.
MIXER_FAMILIES = ("conv", "mamba", "mamba2", "gdn", "lightning", "rglru", "state-passing")
# No kernel choice depends on the GPU here: simulated as an H100 only.
SCENARIOS += [
    Scenario(f"mixer-{family}-{sharding}{'-documents' if docs else ''}", kind="mixer", sharding=sharding,
             documents=docs, extra={"mixer": family, "gpus": ("h100",)})
    for family in MIXER_FAMILIES for sharding, docs in (("contiguous", False), ("zigzag", True))
]


def _fake(shape: Sequence[int], dtype: torch.dtype = torch.bfloat16, grad: bool = True) -> Tensor:
    return torch.empty(tuple(shape), dtype=dtype, device="cuda").requires_grad_(grad and dtype.is_floating_point)


def _attention_layers(sc: Scenario, world: int, checker: SyncChecker, manager: Any) -> list[str]:
    import seqpar

    seq = SEQ_PER_RANK * world
    cu = checker.cuda(_documents(seq), torch.int32) if sc.documents else None
    if cu is not None:  # the batch's one host copy of the boundaries (shard_batch / the batch check)
        seqpar.sequence.boundaries.host_boundaries(cu)
    q = _fake((1, sc.q_heads, SEQ_PER_RANK, HEAD_DIM))
    k = _fake((1, sc.kv_heads, SEQ_PER_RANK, HEAD_DIM))
    v = _fake((1, sc.kv_heads, SEQ_PER_RANK, HEAD_DIM))
    sinks = _fake((sc.q_heads,), torch.float32) if sc.sinks else None
    group = None if manager is not None else dist.group.WORLD
    outs = []
    x = q
    for i in range(LAYERS):
        with checker.layer(f"attention[{i}]"):
            x = seqpar.attention(
                x, k, v, causal=True, mode=sc.mode, group=group, sharding=sc.sharding, check_inputs=False,
                head_chunks=sc.head_chunks, cu_seqlens=cu, window=sc.window, sinks=sinks,
                **{k: v for k, v in sc.extra.items() if k != "warmup"},
            )
        outs.append(x)
    return run_backward([x], checker)


def _dilated_layers(sc: Scenario, world: int, checker: SyncChecker) -> list[str]:
    from seqpar.attn.dilated import dilated_attention

    q = _fake((1, sc.q_heads, SEQ_PER_RANK, HEAD_DIM))
    k = _fake((1, sc.kv_heads, SEQ_PER_RANK, HEAD_DIM))
    # one local pattern (segments inside a shard) and one spanning every rank
    seg, rates = (SEQ_PER_RANK // 2, SEQ_PER_RANK * world), (2, 4)
    x = q
    for i in range(LAYERS):
        with checker.layer(f"dilated[{i}]"):
            x = dilated_attention(x, k, k, segment_lengths=seg, dilation_rates=rates, causal=True,
                                  mode=sc.mode, group=dist.group.WORLD, check_inputs=False)
    return run_backward([x], checker)


def _gather_layers(sc: Scenario, world: int, checker: SyncChecker) -> list[str]:
    from seqpar.sequence.sharding import gather_sequence

    cu = checker.cuda(_documents(SEQ_PER_RANK * world), torch.int32)
    x = _fake((1, SEQ_PER_RANK, 32))
    with checker.layer("gather_sequence[0]"):
        # the first gather of a batch may copy the boundaries to the host once (counted, not an error)
        checker._scopes.append("batch")
        try:
            y = gather_sequence(x, 1, group=dist.group.WORLD, sharding="balanced", cu_seqlens=cu,
                                check_inputs=False)
        finally:
            checker._scopes.pop()
    outs = [y]
    for i in range(1, LAYERS + 1):
        with checker.layer(f"gather_sequence[{i}]"):
            outs.append(gather_sequence(x * i, 1, group=dist.group.WORLD, sharding="balanced", cu_seqlens=cu,
                                        check_inputs=False))
    return run_backward(outs, checker)


@contextlib.contextmanager
def _building() -> Iterator[None]:
    """Build a model's parameters as fake bf16 CUDA tensors (``Module.to`` cannot move fake ones)."""
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            yield
    finally:
        torch.set_default_dtype(dtype)


def _mha_layers(sc: Scenario, world: int, checker: SyncChecker) -> list[str]:
    from seqpar.swap import swap_attention

    with checker.paused(), _building():
        layer = nn.TransformerEncoderLayer(32, sc.q_heads, 64, dropout=0.0, batch_first=True)
        model = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        swap_attention(model, {"size": world, "sharding": sc.sharding, "mode": sc.mode}, group=dist.group.WORLD)
        x = _fake((1, SEQ_PER_RANK, 32))
        # made once per batch by the caller, handed to every layer (nn.Transformer's own helper)
        mask = nn.Transformer.generate_square_subsequent_mask(SEQ_PER_RANK, device="cuda", dtype=torch.bool)
    handles = _layer_hooks(list(model.layers), checker, "encoder_layer")
    # with the hint (nn.Transformer's usual call), or without: then nn.TransformerEncoder reads the
    # mask once per batch (torch.equal, its own sync) and hands its verdict to every layer
    out = model(x, mask=mask, is_causal=True if sc.extra.get("hint", True) else None)
    for h in handles:
        h.remove()
    return run_backward([out], checker)


def _hf_layers(sc: Scenario, world: int, checker: SyncChecker) -> list[str]:
    import transformers

    from seqpar.sequence.batch import shard_batch
    from seqpar.swap import swap_attention

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                                   num_attention_heads=sc.q_heads, num_key_value_heads=sc.kv_heads,
                                   max_position_embeddings=4096)
    config: dict[str, Any] = {"size": world, "sharding": sc.sharding, "mode": sc.mode}
    if sc.extra.get("tiling"):
        config.update(tiled_loss=True, tiled_mlp=2)
    if sc.extra.get("recompute_norm"):
        config["recompute_norm"] = True
    seq = SEQ_PER_RANK * world
    with checker.paused():
        with _building():
            model = transformers.LlamaForCausalLM(cfg)
        swap_attention(model, config, group=dist.group.WORLD)
        batch: dict[str, Tensor] = {"input_ids": checker.cuda([[1] * seq], torch.long)}
        if sc.documents:  # as transformers.DataCollatorWithFlattening packs them
            bounds = _documents(seq)
            batch["position_ids"] = checker.cuda([[i for a, b in zip(bounds, bounds[1:]) for i in range(b - a)]],
                                                 torch.long)
            batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = checker.cuda(bounds, torch.int32)
        batch["labels"] = checker.cuda([[1] * seq], torch.long)
    shard = shard_batch(batch, group=dist.group.WORLD, sharding=sc.sharding)  # batch scope
    handles = _layer_hooks(list(model.model.layers), checker, "decoder_layer")
    out = model(**shard)
    for h in handles:
        h.remove()
    return run_backward([out.loss if out.loss is not None else out.logits], checker)


# ------------------------------------------------------------------------------------ mixers
MixerLayer = Callable[[Tensor, Tensor | None, Tensor], Tensor]
"""``(hidden (1, S_local, H), cu_seqlens or None, position_ids (1, S_local)) -> hidden``: one call."""

MIXERS: dict[str, Callable[[Scenario], tuple[MixerLayer, int]]] = {}
"""Mixer family -> builder of ``(one layer's call, hidden size)`` on fake bf16 CUDA parameters, for
``Scenario(kind="mixer", extra={"mixer": name})``. Families add themselves with :func:`mixer`."""


def mixer(name: str) -> Callable[[Callable[[Scenario], tuple[MixerLayer, int]]], Callable[[Scenario], tuple[MixerLayer, int]]]:
    """Register a mixer builder under ``name`` (see :data:`MIXERS`)."""
    def register(build: Callable[[Scenario], tuple[MixerLayer, int]]) -> Callable[[Scenario], tuple[MixerLayer, int]]:
        MIXERS[name] = build
        return build
    return register


def _tiny(config_class: str, **fields: Any) -> nn.Module:
    import transformers

    cfg = getattr(transformers, config_class)(vocab_size=64, use_cache=False, pad_token_id=0, bos_token_id=1,
                                              eos_token_id=2, **fields)
    return transformers.AutoModelForCausalLM.from_config(cfg)


@mixer("conv")
def _conv_mixer(sc: Scenario) -> tuple[MixerLayer, int]:
    from seqpar.mixers.short_conv import SeqParShortConv

    model = _tiny("Lfm2Config", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, conv_L_cache=4, layer_types=["conv", "full_attention"])
    layer = SeqParShortConv(model.model.layers[0].conv, group=dist.group.WORLD, sharding=sc.sharding)
    return (lambda x, cu, pos: layer(x, cu_seq_lens_q=cu)), 32


@mixer("mamba")
def _mamba_mixer(sc: Scenario) -> tuple[MixerLayer, int]:
    from seqpar.mixers.mamba import SeqParMambaMixer

    model = _tiny("JambaConfig", hidden_size=16, intermediate_size=32, num_attention_heads=4, num_key_value_heads=4,
                  mamba_d_state=4, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4, num_hidden_layers=2,
                  attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, num_experts=1)
    layer = SeqParMambaMixer(model.model.layers[0].mamba, group=dist.group.WORLD, sharding=sc.sharding)
    return (lambda x, cu, pos: layer(x, cu_seq_lens_q=cu)), 16


@mixer("mamba2")
def _mamba2_mixer(sc: Scenario) -> tuple[MixerLayer, int]:
    from seqpar.mixers.mamba2 import SeqParMamba2Mixer

    model = _tiny("BambaConfig", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8,
                  mamba_n_groups=1, mamba_chunk_size=4)
    layer = SeqParMamba2Mixer(model.model.layers[0].mamba, group=dist.group.WORLD, sharding=sc.sharding)
    return (lambda x, cu, pos: layer(x, cu_seq_lens_q=cu)), 32


@mixer("gdn")
def _gdn_mixer(sc: Scenario) -> tuple[MixerLayer, int]:
    from seqpar.mixers.gdn import SeqParGatedDeltaNet

    model = _tiny("Qwen3_5TextConfig", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, head_dim=8,
                  layer_types=["linear_attention", "full_attention"], linear_num_key_heads=4,
                  linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)
    layer = SeqParGatedDeltaNet(model.model.layers[0].linear_attn, group=dist.group.WORLD, sharding=sc.sharding)
    return (lambda x, cu, pos: layer(x, cu_seq_lens_q=cu)), 32


@mixer("lightning")
def _lightning_mixer(sc: Scenario) -> tuple[MixerLayer, int]:
    from seqpar.mixers.lightning import SeqParLightningAttention

    model = _tiny("MiniMaxConfig", hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, head_dim=8, layer_types=["linear_attention", "full_attention"], block_size=8,
                  num_local_experts=2, num_experts_per_tok=1)
    layer = SeqParLightningAttention(model.model.layers[0].self_attn, group=dist.group.WORLD, sharding=sc.sharding)
    return (lambda x, cu, pos: layer(x, None, None, cu_seq_lens_q=cu)[0]), 32


@mixer("rglru")
def _rglru_mixer(sc: Scenario) -> tuple[MixerLayer, int]:
    from seqpar.mixers.rglru import SeqParRecurrentBlock

    model = _tiny("RecurrentGemmaConfig", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, head_dim=8, lru_width=32, conv1d_width=4,
                  attention_window_size=64, block_types=["recurrent", "attention"])
    layer = SeqParRecurrentBlock(model.model.layers[0].temporal_block, group=dist.group.WORLD, sharding=sc.sharding)
    return (lambda x, cu, pos: layer(x, pos, cu_seq_lens_q=cu)[0]), 32


@mixer("state-passing")
def _state_passing_mixer(sc: Scenario) -> tuple[MixerLayer, int]:
    """state_passing.chunk_initial_states alone, as every linear recurrence calls it: per-head scalar
    transitions and (head, d, d) states, one per local chunk."""
    from seqpar.mixers.state_passing import chunk_initial_states

    chunks = 2 if sc.sharding == "zigzag" else 1

    def call(x: Tensor, cu: Tensor | None, pos: Tensor) -> Tensor:
        seq_local, hidden = x.shape[1], x.shape[2]
        heads = hidden // 8
        transition = x[0, :chunks, :heads].float().sigmoid()  # (n, heads)
        state = x[0, :chunks].float().reshape(chunks, heads, 8)[..., None] * x[0, :chunks, :8].float()[:, None, None]
        init = chunk_initial_states(transition, state, apply=lambda t, h: t[:, None, None] * h, group=dist.group.WORLD,
                                    sharding=sc.sharding, seq_len=seq_local * dist.get_world_size(), cu_seqlens=cu)
        return x + init.sum().to(x.dtype)

    return call, 32


def _mixer_layers(sc: Scenario, world: int, checker: SyncChecker) -> list[str]:
    import seqpar

    seq = SEQ_PER_RANK * world
    with checker.paused(), _building():
        call, hidden = MIXERS[sc.extra["mixer"]](sc)
        pos = _fake((1, SEQ_PER_RANK), torch.long)
    cu = checker.cuda(_documents(seq), torch.int32) if sc.documents else None
    if cu is not None:  # the batch's one host copy of the boundaries (shard_batch / the batch check)
        seqpar.sequence.boundaries.host_boundaries(cu)
    x = _fake((1, SEQ_PER_RANK, hidden))
    for i in range(LAYERS):
        with checker.layer(f"{sc.extra['mixer']}[{i}]"):
            x = call(x, cu, pos)
    return run_backward([x], checker)


def _moe_layers(sc: Scenario, world: int, checker: SyncChecker) -> list[str]:
    """The MoE statistics the swap computes over the SP group (seqpar.swap.moe's dispatchers call
    these): the load-balancing loss from LAYERS routers' logits with a padding token mask, Bamba's
    z-loss, and the expert counts of aux-loss-free balancing; each a layer (no sync)."""
    from seqpar.sequence.router import (
        load_balancing_loss,
        sequence_parallel_expert_counts,
        sequence_parallel_z_loss,
    )

    experts, top_k = 8, 2
    logits = tuple(_fake((SEQ_PER_RANK, experts), torch.float32) for _ in range(LAYERS))
    mask = _fake((1, SEQ_PER_RANK), torch.long)
    lm_logits = _fake((1, SEQ_PER_RANK, 64), torch.float32)
    with checker.layer("load_balancing_loss"):
        aux = load_balancing_loss(logits, experts, top_k, mask, group=dist.group.WORLD)
    with checker.layer("z_loss"):
        z = sequence_parallel_z_loss(lm_logits, group=dist.group.WORLD, mask=mask)
    with checker.layer("expert_counts"):
        top = logits[0].topk(top_k, dim=-1).indices
        sequence_parallel_expert_counts(top, experts, group=dist.group.WORLD, mask=mask.reshape(-1))
    return run_backward([aux + z], checker)


class _FakeStream:
    """torch.cuda.Stream / current_stream on a machine without CUDA: the ordering calls are recorded,
    a host wait is a sync (see :class:`SyncChecker`)."""

    def __init__(self, checker: SyncChecker, log: list[str], device: Any = None) -> None:
        self.checker, self.log, self.device = checker, log, device

    def wait_stream(self, other: Any) -> None:
        self.log.append("wait_stream")

    def wait_event(self, event: Any) -> None:
        self.log.append("wait_event")

    def synchronize(self) -> None:
        self.checker._wait("torch.cuda.Stream.synchronize")


class _FakeEvent:
    def __init__(self, checker: SyncChecker, log: list[str]) -> None:
        self.checker, self.log = checker, log

    def record(self, stream: Any = None) -> None:
        self.log.append("record")

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        self.checker._wait("torch.cuda.Event.synchronize")


@contextlib.contextmanager
def _fake_streams(checker: SyncChecker, log: list[str]) -> Iterator[None]:
    """Streams, events, pinned host buffers and CUDA RNG states for code written for a real GPU
    (seqpar.memory.offload.CudaTransfer), so that it runs on fake tensors: every call is recorded in
    ``log``; the copies themselves are the ordinary (watched) tensor ops."""
    empty = torch.empty

    def pinned_empty(*args: Any, **kwargs: Any) -> Tensor:
        if kwargs.pop("pin_memory", False):
            log.append("pin_memory")
        return empty(*args, **kwargs)

    patches = {
        (torch.cuda, "Stream"): lambda device=None, **kw: _FakeStream(checker, log, device),
        (torch.cuda, "current_stream"): lambda device=None: _FakeStream(checker, log, device),
        (torch.cuda, "stream"): lambda stream=None: contextlib.nullcontext(),
        (torch.cuda, "Event"): lambda *a, **kw: _FakeEvent(checker, log),
        (torch.cuda, "get_rng_state"): lambda device="cuda": torch.zeros(16, dtype=torch.uint8, device="cpu"),
        (torch.cuda, "set_rng_state"): lambda state, device="cuda": None,
        (torch, "empty"): pinned_empty,
        (Tensor, "record_stream"): lambda self, stream: log.append("record_stream"),
    }
    saved = {key: getattr(*key) for key in patches}
    for (owner, name), value in patches.items():
        setattr(owner, name, value)
    try:
        yield
    finally:
        for (owner, name), value in saved.items():
            setattr(owner, name, value)


def python_backward(tensors: Sequence[Tensor], grad_tensors: Sequence[Tensor | None] | None = None,
                    **_: Any) -> None:
    """``torch.autograd.backward`` run as :func:`python_grad` (fake CUDA tensors): every leaf reached
    (``requires_grad``, no ``grad_fn``) gets its gradient added to ``.grad``."""
    leaves: list[Tensor] = []
    seen: set[Any] = set()
    stack = [t.grad_fn for t in tensors if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "variable"):
            leaves.append(node.variable)
        stack.extend(nxt for nxt, _ in node.next_functions)
    grads = python_grad(list(tensors), leaves, list(grad_tensors) if grad_tensors is not None else None)
    for leaf, g in zip(leaves, grads):
        if g is not None:
            leaf.grad = g if leaf.grad is None else leaf.grad + g


def _offload_layers(sc: Scenario, world: int, checker: SyncChecker) -> list[str]:
    """seqpar.memory.offload: LAYERS checkpointed MLP blocks whose inputs go to pinned host memory on a
    side stream in the forward and come back (prefetched one layer ahead) in the backward, through
    CudaTransfer's own code on stubbed streams and events (:func:`_fake_streams`)."""
    from seqpar.memory.offload import OffloadState, offloading_checkpoint

    log: list[str] = []
    with checker.paused(), _building():
        blocks = [nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in range(LAYERS)]
    state = OffloadState()
    checkpoint = offloading_checkpoint(lambda run_fn, *args: run_fn(*args), state)
    x = _fake((1, SEQ_PER_RANK, 32))
    engine_backward = torch.autograd.backward
    with _fake_streams(checker, log):
        for i, block in enumerate(blocks):
            with checker.layer(f"offload[{i}]"):
                x = checkpoint(block, x)
        torch.autograd.backward = python_backward
        try:
            ran = run_backward([x], checker)
        finally:
            torch.autograd.backward = engine_backward
    expected = {"pin_memory": LAYERS, "record_stream": 2 * LAYERS}
    missing = {k: n for k, n in expected.items() if log.count(k) != n}
    if missing or not all(b[0].weight.grad is not None for b in blocks):
        raise AssertionError(f"offload scenario: CudaTransfer's paths did not all run ({log})")
    return ran


def run_scenario(sc: Scenario, world: int, rank: int, gpu: str = "h100") -> dict[str, Any]:
    """Run ``sc`` as rank ``rank`` of ``world`` on fake CUDA tensors and the fake process group.

    Returns ``{"batch_syncs": {op: n}, "backward": [Function names], "where": [...]}``; raises
    :class:`HostSyncError` at the first sync inside a layer."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import seqpar

    with fake_rank(rank, world):
        manager = None
        if sc.mode == "hybrid":  # start-up on real host tensors (its agreement check reads them)
            manager = seqpar.init_process_groups(sp_size=world, ulysses_size=sc.ulysses)
        with simulated_gpu(gpu), FakeTensorMode(allow_non_fake_inputs=True), SyncChecker() as checker:
            if sc.kind == "attention":
                if sc.extra.get("warmup"):
                    with checker.startup():
                        _attention_layers(sc, world, checker, manager)
                ran = _attention_layers(sc, world, checker, manager)
            elif sc.kind == "dilated":
                ran = _dilated_layers(sc, world, checker)
            elif sc.kind == "gather":
                ran = _gather_layers(sc, world, checker)
            elif sc.kind == "mha":
                ran = _mha_layers(sc, world, checker)
            elif sc.kind == "hf":
                ran = _hf_layers(sc, world, checker)
            elif sc.kind == "offload":
                ran = _offload_layers(sc, world, checker)
            elif sc.kind == "moe":
                ran = _moe_layers(sc, world, checker)
            elif sc.kind == "mixer":
                ran = _mixer_layers(sc, world, checker)
            else:
                raise ValueError(f"unknown scenario kind {sc.kind!r}")
    if not ran:
        raise AssertionError(f"{sc.name}: no seqpar backward ran (the checker would see nothing)")
    return {"batch_syncs": dict(checker.counts("batch")), "startup_syncs": dict(checker.counts("startup")),
            "backward": ran,
            "where": sorted({f"{e.op} at {e.where}" for e in checker.events})}


def check_world(world: int, scenarios: Sequence[Scenario] = SCENARIOS, gpus: Sequence[str] = ("h100", "a100"),
                ranks: Sequence[int] | None = None) -> dict[str, Any]:
    """Every scenario that applies to ``world``, on every rank and simulated GPU. Returns per
    scenario the most batch syncs any rank made and where; raises at the first layer sync."""
    report: dict[str, Any] = {}
    for sc in scenarios:
        if not sc.applies(world):
            continue
        worst: dict[str, Any] = {"batch_syncs": 0, "ops": {}, "where": []}
        for gpu in sc.extra.get("gpus", gpus):
            for rank in (range(world) if ranks is None else ranks):
                try:
                    res = run_scenario(sc, world, rank, gpu)
                except HostSyncError as e:
                    raise HostSyncError(f"{sc.name} (P={world}, rank {rank}, {gpu}): {e}") from None
                n = sum(res["batch_syncs"].values())
                if n >= worst["batch_syncs"]:
                    worst = {"batch_syncs": n, "ops": res["batch_syncs"], "where": res["where"],
                             "backward": res["backward"]}
        report[sc.name] = worst
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m seqpar.testing.syncs", description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--only", nargs="*", default=None, help="scenario names (default: all)")
    parser.add_argument("--json", default=None, help="write the report here")
    args = parser.parse_args(argv)
    if not cuda_build():
        print("seqpar.testing.syncs needs torch's CUDA build (see .ci/cuda_venv)", file=sys.stderr)
        return 2
    chosen = [s for s in SCENARIOS if args.only is None or s.name in args.only]
    full: dict[str, Any] = {}
    for world in args.world_sizes:
        start = time.perf_counter()
        try:
            report = check_world(world, chosen)
        except HostSyncError as e:
            print(f"FAIL P={world}: {e}", file=sys.stderr)
            return 1
        full[str(world)] = report
        print(f"P={world}: {len(report)} scenarios x {world} ranks x {{h100, a100}}: 0 syncs per layer "
              f"({time.perf_counter() - start:.1f} s)")
        for name, r in report.items():
            print(f"  {name:40s} batch syncs {r['batch_syncs']} {r['ops'] or ''}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(full, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
