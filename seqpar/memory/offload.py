"""Checkpointed layer inputs in pinned CPU memory, prefetched in backward: ``offload_activations``.

With activation checkpointing, what a decoder stack keeps between forward and backward is each
layer's input, ``(batch, seq_local, hidden)`` per layer (Llama-3-8B, 128K local tokens, 32 layers:
~34 GB in bf16). :func:`apply_offload` makes every checkpointed decoder layer of a Hugging Face
model keep that input in pinned host memory instead:

- forward: the input is copied to a pinned CPU buffer on a side stream (overlapping the layer's
  compute), the layer runs under ``no_grad``, and only the host copy is kept;
- backward: when layer ``i``'s backward starts, the copy of layer ``i-1``'s input back to the GPU is
  started on the side stream, so it is ready when needed; layer ``i``'s own input (prefetched one
  layer earlier) is waited for, the layer is recomputed with grad (RNG state restored, as
  ``torch.utils.checkpoint`` does) and back-propagated.

On a CPU-only build (or with CPU tensors) pinning is unavailable and offloading would save nothing:
the layer then runs through the model's own checkpoint function unchanged, i.e. offloading is an
exact no-op. Without activation checkpointing there are no checkpointed inputs and nothing changes.

The copies go through a :class:`Transfer` (CUDA streams and events in :class:`CudaTransfer`), so the
recompute and prefetch order can be tested on CPU with a transfer that only clones.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["apply_offload", "offloading_checkpoint", "OffloadState", "Transfer", "CudaTransfer"]


class Transfer:
    """How an offloaded tensor leaves the device and comes back. ``applies`` decides per call."""

    def applies(self, args: tuple[Any, ...]) -> bool:
        raise NotImplementedError

    def to_host(self, t: Tensor) -> Any:
        """Start moving ``t`` off the device; returns a handle."""
        raise NotImplementedError

    def prefetch(self, handle: Any) -> Any:
        """Start moving a handle's tensor back; returns a handle for :meth:`fetch`."""
        raise NotImplementedError

    def fetch(self, handle: Any) -> Tensor:
        """The device tensor of a prefetched handle, safe to use on the current stream."""
        raise NotImplementedError


class CudaTransfer(Transfer):
    """Pinned host buffers; copies on one side stream per device, ordered against compute by events.

    One stream per device, not one for the transfer: a model spread over several GPUs (``device_map="auto"``,
    a pipeline stage per device) offloads each layer's input from its own device, and a copy must be issued on a
    stream of the device that holds the tensor (a stream of another device leaves the copy on that tensor's compute
    stream, unordered by the recorded event, and ``record_stream`` with another device's stream is refused)."""

    def __init__(self) -> None:
        self.streams: dict[torch.device, Any] = {}

    def __deepcopy__(self, memo: dict[int, Any]) -> CudaTransfer:
        # a copied model (copy.deepcopy) gets a transfer of its own; its stream is made on its first copy, on the
        # copy's device (a CUDA stream cannot be copied)
        return CudaTransfer()

    def applies(self, args: tuple[Any, ...]) -> bool:
        return any(isinstance(a, Tensor) and a.is_cuda for a in args)

    def _side(self, device: torch.device) -> Any:
        """The side stream of ``device`` (a CUDA device with its index), made on its first copy."""
        device = torch.device(device)
        if device.index is None:  # "cuda" is the current device: key it by index so that both spellings share one
            device = torch.device("cuda", torch.cuda.current_device())
        if device not in self.streams:
            self.streams[device] = torch.cuda.Stream(device=device)
        return self.streams[device]

    def to_host(self, t: Tensor) -> Any:
        stream = self._side(t.device)
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        stream.wait_stream(torch.cuda.current_stream(t.device))  # t is written by the compute stream
        with torch.cuda.stream(stream):
            host.copy_(t, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        t.record_stream(stream)  # t's memory may be reused only after the copy has read it
        return host, done, t.device

    def prefetch(self, handle: Any) -> Any:
        host, offloaded, device = handle
        stream = self._side(device)
        stream.wait_event(offloaded)
        with torch.cuda.stream(stream):
            dev = host.to(device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        return dev, done

    def fetch(self, handle: Any) -> Tensor:
        dev, done = handle
        current = torch.cuda.current_stream(dev.device)
        current.wait_event(done)
        dev.record_stream(current)
        return dev


class OffloadState:
    """Per-model bookkeeping: the forward order of offloaded layer calls, for the backward prefetch.

    It travels with its model: the model's hook and its layers' checkpoint functions hold it as objects
    (not closures), so ``copy.deepcopy(model)`` gives the copy a state of its own (no calls, a copy of the
    transfer) and the copy's calls never join the original's prefetch order."""

    def __init__(self, transfer: Transfer | None = None) -> None:
        self.transfer = transfer or CudaTransfer()
        # each offloaded call's ctx, in forward order, held weakly: a forward whose graph is dropped without a
        # backward (an evaluation under grad, an exception) frees its host copies instead of keeping them here
        self.calls: list[weakref.ref] = []

    def __deepcopy__(self, memo: dict[int, Any]) -> OffloadState:
        # a copy's calls are its own (none yet); the original's pending calls stay the original's
        return OffloadState(copy.deepcopy(self.transfer, memo))

    def record(self, ctx: Any) -> None:
        self.calls = [c for c in self.calls if c() is not None]
        self.calls.append(weakref.ref(ctx))

    def pending(self) -> list[Any]:
        """The ctx of each offloaded call not yet back-propagated, in forward order."""
        return [ctx for ctx in (c() for c in self.calls) if ctx is not None]


def _rng_state(args: tuple[Any, ...]) -> tuple[Any, list[torch.device], list[Tensor]]:
    devices = sorted({a.device for a in args if isinstance(a, Tensor) and a.is_cuda}, key=str)
    return torch.get_rng_state(), devices, [torch.cuda.get_rng_state(d) for d in devices]


class _OffloadedCheckpoint(torch.autograd.Function):
    """``run_fn(*args)`` recomputed in backward from offloaded copies of its tensor arguments."""

    @staticmethod
    def forward(ctx, run_fn: Callable[..., Any], state: OffloadState, *args: Any) -> Any:  # type: ignore[override]
        ctx.run_fn, ctx.state = run_fn, state
        ctx.rng = _rng_state(args)
        ctx.needs_grad = [isinstance(a, Tensor) and a.requires_grad for a in args]
        ctx.offloaded = [("off", state.transfer.to_host(a)) if isinstance(a, Tensor) else ("keep", a) for a in args]
        ctx.prefetched = None
        state.record(ctx)
        with torch.no_grad():
            return run_fn(*args)

    @staticmethod
    def start_prefetch(ctx: Any) -> None:
        if ctx.prefetched is None:
            transfer = ctx.state.transfer
            ctx.prefetched = [(kind, transfer.prefetch(v) if kind == "off" else v) for kind, v in ctx.offloaded]
            ctx.offloaded = None  # the host copies are released once back on the device

    @staticmethod
    def backward(ctx, *grads: Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        calls = ctx.state.pending()
        index = next(i for i, c in enumerate(calls) if c is ctx)
        _OffloadedCheckpoint.start_prefetch(ctx)
        if index > 0:  # the layer before runs its backward next: start its copy now
            _OffloadedCheckpoint.start_prefetch(calls[index - 1])
        ctx.state.calls = [weakref.ref(c) for i, c in enumerate(calls) if i != index]
        inputs = []
        for (kind, value), needs_grad in zip(ctx.prefetched, ctx.needs_grad):
            if kind == "off":
                value = ctx.state.transfer.fetch(value).detach().requires_grad_(needs_grad)
            inputs.append(value)
        ctx.prefetched = None
        cpu_rng, devices, cuda_rng = ctx.rng
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(cpu_rng)
            for d, s in zip(devices, cuda_rng):
                torch.cuda.set_rng_state(s, d)
            with torch.enable_grad():
                outputs = ctx.run_fn(*inputs)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads) if isinstance(o, Tensor) and o.requires_grad and g is not None]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, *(x.grad if isinstance(x, Tensor) and x.requires_grad else None for x in inputs))


class _OffloadingCheckpointFn:
    """A layer's checkpoint function routed through offload. An object, not a closure: ``copy.deepcopy`` of
    the layer copies it, and its state with it (a closure would be shared with the copy)."""

    _seqpar_offload = True

    def __init__(self, checkpoint_fn: Callable[..., Any], state: OffloadState) -> None:
        self.checkpoint_fn, self.state = checkpoint_fn, state

    def __call__(self, run_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled() or not self.state.transfer.applies(args):
            return self.checkpoint_fn(run_fn, *args, **kwargs)
        return _OffloadedCheckpoint.apply(run_fn, self.state, *args)


def offloading_checkpoint(checkpoint_fn: Callable[..., Any], state: OffloadState) -> Callable[..., Any]:
    """Wrap a model's checkpoint function (``checkpoint_fn(run_fn, *args)``): when the state's
    transfer applies (CUDA tensors), checkpoint with offloaded inputs; otherwise call
    ``checkpoint_fn`` unchanged. The result carries the state as ``.state``."""
    return _OffloadingCheckpointFn(checkpoint_fn, state)


class _RewrapHook:
    """The model's forward pre-hook: wraps the hooked module's layers (looked up each call) with its state.
    An object for the same reason as :class:`_OffloadingCheckpointFn`: a deep copy's hook holds the copy's
    state, the one its layers' checkpoint functions were copied with."""

    def __init__(self, state: OffloadState) -> None:
        self.state = state

    def __call__(self, module: nn.Module, _args: Any) -> None:
        _wrap_layers(_decoder_layers(module), self.state)


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if hasattr(m, "gradient_checkpointing")
            and type(m).__name__.endswith("DecoderLayer")]


def _wrap_layers(layers: list[nn.Module], state: OffloadState) -> None:
    """Route each layer's checkpoint function (when activation checkpointing has set one, and it is
    not routed already) through :func:`offloading_checkpoint`."""
    for layer in layers:
        fn = getattr(layer, "_gradient_checkpointing_func", None)
        if fn is not None and not getattr(fn, "_seqpar_offload", False):
            layer._gradient_checkpointing_func = offloading_checkpoint(fn, state)


def apply_offload(model: nn.Module, transfer: Transfer | None = None) -> str:
    """Offload the checkpointed inputs of the model's checkpointable decoder layers (Hugging Face
    ``GradientCheckpointingLayer``s); returns a line saying what happens (CPU-only: nothing, exactly).

    The layers' checkpoint functions are wrapped now, and again by a forward pre-hook on ``model``
    whenever activation checkpointing was enabled (or re-enabled) after this call. The hook sits on
    the model, not on the layers: transformers 5.17 calls a layer's checkpoint function from the
    layer's ``__call__``, before the layer's own hooks run, so a hook on the layer would come one
    call too late (5.2x checkpoints ``forward`` instead, inside the hooks)."""
    state = OffloadState(transfer)
    layers = _decoder_layers(model)
    _wrap_layers(layers, state)
    old = getattr(model, "_seqpar_offload_hook", None)
    if old is not None:
        old.remove()
    # the layers are looked up from the hooked module each time, so a deep copy of the model wraps its own
    model._seqpar_offload_hook = model.register_forward_pre_hook(_RewrapHook(state))
    if transfer is None and not torch.cuda.is_available():
        return (f"{len(layers)} decoder layers hooked; this build has no CUDA, so their checkpointed "
                "inputs stay where they are (an exact no-op)")
    return (f"checkpointed inputs of {len(layers)} decoder layers go to pinned CPU memory "
            "(needs activation checkpointing)")
