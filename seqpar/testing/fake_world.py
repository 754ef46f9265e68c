"""The fake CUDA world the host-sync checker runs in (:mod:`seqpar.testing.syncs`): one rank of a P-rank
CUDA world inside one CPU process.

- every tensor is a **fake CUDA tensor** (``FakeTensorMode``): shapes, dtypes and devices, no data;
  a fake tensor raises on data-dependent output, which is a ready-made detector;
- the process group is torch's **fake process group** (:func:`fake_rank`): its collectives and
  point-to-point ops accept fake CUDA tensors and do nothing;
- the device is answered as an H100 or an A100 (:func:`simulated_gpu`), so the kernel choice is the
  one those GPUs make; streams and events are stubs that record their calls (:func:`fake_streams`).

The C++ autograd engine wants a real device, so the backward is run by calling each seqpar
``autograd.Function``'s backward directly on its saved tensors (:func:`run_backward`), and
``torch.autograd.grad`` / ``backward`` inside them by :func:`python_grad` / :func:`python_backward`.
"""

from __future__ import annotations

import contextlib
import types
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from seqpar.testing.sync_checker import SyncChecker

__all__ = [
    "GPUS", "GPU_SIZES", "simulated_gpu", "fake_rank", "python_grad", "python_backward", "run_backward",
    "layer_hooks", "building", "fake", "fake_streams", "FakeStream", "FakeEvent",
]

# (capability, cuDNN version) of the GPUs simulated; cuDNN 9.10 as the torch 2.11 CUDA 13 wheels ship.
GPUS: dict[str, tuple[tuple[int, int], int]] = {"h100": ((9, 0), 91002), "a100": ((8, 0), 91002)}
# what get_device_properties reports for them: total memory (bytes) and SMs (H100 SXM 80 GB, A100 SXM 80 GB)
GPU_SIZES: dict[str, tuple[int, int]] = {"h100": (85_045_198_848, 132), "a100": (85_098_496_000, 108)}


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


def _graph_nodes(roots: Sequence[Tensor]) -> Iterator[Any]:
    """Every node of the autograd graph behind ``roots``, once each, depth first from the latest."""
    seen: set[Any] = set()  # the nodes themselves: ids of freed Python wrappers would be reused
    stack = [t.grad_fn for t in roots if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        yield node
        stack.extend(nxt for nxt, _ in node.next_functions)


def _seqpar_nodes(roots: Sequence[Tensor]) -> list[Any]:
    """The seqpar ``autograd.Function`` nodes of the graph behind ``roots``, latest first."""
    return [node for node in _graph_nodes(roots)
            if (cls := getattr(node, "_forward_cls", None)) is not None
            and cls.__module__.startswith(("seqpar.", "integrations."))]


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


def layer_hooks(modules: Sequence[nn.Module], checker: SyncChecker, name: str) -> list[Any]:
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



@contextlib.contextmanager
def building() -> Iterator[None]:
    """Build a model's parameters as fake bf16 CUDA tensors (``Module.to`` cannot move fake ones)."""
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            yield
    finally:
        torch.set_default_dtype(dtype)


def fake(shape: Sequence[int], dtype: torch.dtype = torch.bfloat16, grad: bool = True) -> Tensor:
    """A fake CUDA tensor of ``shape`` (no data), requiring grad when ``grad`` and floating."""
    return torch.empty(tuple(shape), dtype=dtype, device="cuda").requires_grad_(grad and dtype.is_floating_point)


class FakeStream:
    """torch.cuda.Stream / current_stream on a machine without CUDA: the ordering calls are recorded,
    a host wait is a sync (see :class:`SyncChecker`)."""

    def __init__(self, checker: SyncChecker, log: list[str], device: Any = None) -> None:
        self.checker, self.log, self.device = checker, log, device

    def wait_stream(self, other: Any) -> None:
        self.log.append("wait_stream")

    def wait_event(self, event: Any) -> None:
        self.log.append("wait_event")

    def synchronize(self) -> None:
        self.checker.wait("torch.cuda.Stream.synchronize")


class FakeEvent:
    def __init__(self, checker: SyncChecker, log: list[str]) -> None:
        self.checker, self.log = checker, log

    def record(self, stream: Any = None) -> None:
        self.log.append("record")

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        self.checker.wait("torch.cuda.Event.synchronize")


@contextlib.contextmanager
def fake_streams(checker: SyncChecker, log: list[str]) -> Iterator[None]:
    """Streams, events, pinned host buffers and CUDA RNG states for code written for a real GPU
    (seqpar.memory.offload.CudaTransfer), so that it runs on fake tensors: every call is recorded in
    ``log``; the copies themselves are the ordinary (watched) tensor ops."""
    empty = torch.empty

    def pinned_empty(*args: Any, **kwargs: Any) -> Tensor:
        if kwargs.pop("pin_memory", False):
            log.append("pin_memory")
        return empty(*args, **kwargs)

    patches = {
        (torch.cuda, "Stream"): lambda device=None, **kw: FakeStream(checker, log, device),
        (torch.cuda, "current_stream"): lambda device=None: FakeStream(checker, log, device),
        (torch.cuda, "stream"): lambda stream=None: contextlib.nullcontext(),
        (torch.cuda, "Event"): lambda *a, **kw: FakeEvent(checker, log),
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
    leaves = [node.variable for node in _graph_nodes(tensors) if hasattr(node, "variable")]
    grads = python_grad(list(tensors), leaves, list(grad_tensors) if grad_tensors is not None else None)
    for leaf, g in zip(leaves, grads):
        if g is not None:
            leaf.grad = g if leaf.grad is None else leaf.grad + g
