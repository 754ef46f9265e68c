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
    """Pinned host buffers; copies on one side stream, ordered against compute by events."""

    def __init__(self) -> None:
        self.stream: Any = None

    def applies(self, args: tuple[Any, ...]) -> bool:
        return any(isinstance(a, Tensor) and a.is_cuda for a in args)

    def _side(self, device: torch.device) -> Any:
        if self.stream is None:
            self.stream = torch.cuda.Stream(device=device)
        return self.stream

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
    """Per-model bookkeeping: the forward order of offloaded layer calls, for the backward prefetch."""

    def __init__(self, transfer: Transfer | None = None) -> None:
        self.transfer = transfer or CudaTransfer()
        self.calls: list[Any] = []  # ctx of each offloaded call, in forward order


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
        state.calls.append(ctx)
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
        calls = ctx.state.calls
        index = next(i for i, c in enumerate(calls) if c is ctx)
        _OffloadedCheckpoint.start_prefetch(ctx)
        if index > 0:  # the layer before runs its backward next: start its copy now
            _OffloadedCheckpoint.start_prefetch(calls[index - 1])
        del calls[index]
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


def offloading_checkpoint(checkpoint_fn: Callable[..., Any], state: OffloadState) -> Callable[..., Any]:
    """Wrap a model's checkpoint function (``checkpoint_fn(run_fn, *args)``): when the state's
    transfer applies (CUDA tensors), checkpoint with offloaded inputs; otherwise call
    ``checkpoint_fn`` unchanged."""

    def checkpoint(run_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled() or not state.transfer.applies(args):
            return checkpoint_fn(run_fn, *args, **kwargs)
        return _OffloadedCheckpoint.apply(run_fn, state, *args)

    checkpoint._seqpar_offload = True  # type: ignore[attr-defined]
    return checkpoint


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
    model._seqpar_offload_hook = model.register_forward_pre_hook(
        lambda module, _args: _wrap_layers(_decoder_layers(module), state))
    if transfer is None and not torch.cuda.is_available():
        return (f"{len(layers)} decoder layers hooked; this build has no CUDA, so their checkpointed "
                "inputs stay where they are (an exact no-op)")
    return (f"checkpointed inputs of {len(layers)} decoder layers go to pinned CPU memory "
            "(needs activation checkpointing)")
