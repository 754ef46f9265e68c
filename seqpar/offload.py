"""Checkpointed layer inputs in pinned CPU memory, prefetched in backward: ``offload_activations``.

With activation checkpointing, what a decoder stack keeps between forward and backward is each
layer's input, ``(batch, seq_local, hidden)`` per layer (Llama-3-8B, 128K local tokens, 32 layers:
~34 GB in bf16). :func:`apply_offload` makes every checkpointed decoder layer of a Hugging Face
model keep that input in pinned host memory instead:

- forward: the input is copied to a pinned CPU buffer on a side stream (overlapping the layer's
  compute), the layer runs under ``no_grad``, and only the CPU copy is kept;
- backward: when layer ``i``'s backward starts, the copy of layer ``i-1``'s input back to the GPU is
  started on the side stream, so it is ready when needed; layer ``i``'s own input (prefetched one
  layer earlier) is waited for, the layer is recomputed with grad (RNG state restored, as
  ``torch.utils.checkpoint`` does) and back-propagated.

On a CPU-only build (or with CPU tensors) pinning is unavailable and offloading would save nothing:
the layer then runs through the model's own checkpoint function unchanged, i.e. offloading is an
exact no-op. Without activation checkpointing there are no checkpointed inputs and nothing changes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["apply_offload", "offloading_checkpoint", "OffloadState"]


class OffloadState:
    """Per-model bookkeeping: the forward order of offloaded layer calls, for the backward prefetch."""

    def __init__(self) -> None:
        self.calls: list[Any] = []  # ctx of each offloaded call, in forward order
        self.stream: Any = None

    def side_stream(self, device: torch.device) -> Any:
        if self.stream is None:
            self.stream = torch.cuda.Stream(device=device)
        return self.stream


def _to_host(t: Tensor, stream: Any) -> tuple[Tensor, Any]:
    """Start a copy of CUDA ``t`` into pinned host memory on ``stream``; returns (host, event)."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    stream.wait_stream(torch.cuda.current_stream(t.device))
    with torch.cuda.stream(stream):
        host.copy_(t, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
    t.record_stream(stream)  # the GPU tensor may be freed only after the copy has read it
    return host, event


def _to_device(host: Tensor, device: torch.device, stream: Any) -> tuple[Tensor, Any]:
    with torch.cuda.stream(stream):
        dev = host.to(device, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
    return dev, event


class _OffloadedCheckpoint(torch.autograd.Function):
    """``run_fn(*args)`` recomputed in backward from host copies of its tensor arguments."""

    @staticmethod
    def forward(ctx, run_fn: Callable[..., Any], state: OffloadState, *args: Any) -> Any:  # type: ignore[override]
        device = next(a.device for a in args if isinstance(a, Tensor) and a.is_cuda)
        stream = state.side_stream(device)
        ctx.run_fn, ctx.state, ctx.device = run_fn, state, device
        ctx.cpu_rng, ctx.cuda_rng = torch.get_rng_state(), torch.cuda.get_rng_state(device)
        ctx.host = [(_to_host(a, stream) if isinstance(a, Tensor) and a.is_cuda else (a, None)) for a in args]
        ctx.needs_grad = [isinstance(a, Tensor) and a.requires_grad for a in args]
        ctx.prefetched = None
        state.calls.append(ctx)
        with torch.no_grad():
            return run_fn(*args)

    @staticmethod
    def prefetch(ctx: Any) -> None:
        if ctx.prefetched is None:
            stream = ctx.state.side_stream(ctx.device)
            out = []
            for value, event in ctx.host:
                if event is None:
                    out.append((value, None))
                    continue
                stream.wait_event(event)  # the offload copy must have landed
                out.append(_to_device(value, ctx.device, stream))
            ctx.prefetched = out

    @staticmethod
    def backward(ctx, *grads: Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        calls = ctx.state.calls
        index = next(i for i, c in enumerate(calls) if c is ctx)
        _OffloadedCheckpoint.prefetch(ctx)
        if index > 0:  # the layer before runs its backward next: start its copy now
            _OffloadedCheckpoint.prefetch(calls[index - 1])
        del calls[index]
        current = torch.cuda.current_stream(ctx.device)
        inputs = []
        for (value, event), needs_grad in zip(ctx.prefetched, ctx.needs_grad):
            if event is not None:
                current.wait_event(event)
                value.record_stream(current)
            if isinstance(value, Tensor):
                value = value.detach().requires_grad_(needs_grad)
            inputs.append(value)
        ctx.prefetched = ctx.host = None
        with torch.random.fork_rng(devices=[ctx.device]):
            torch.set_rng_state(ctx.cpu_rng)
            torch.cuda.set_rng_state(ctx.cuda_rng, ctx.device)
            with torch.enable_grad():
                outputs = ctx.run_fn(*inputs)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads) if isinstance(o, Tensor) and o.requires_grad and g is not None]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, *(x.grad if isinstance(x, Tensor) and x.requires_grad else None for x in inputs))


def offloading_checkpoint(checkpoint_fn: Callable[..., Any], state: OffloadState) -> Callable[..., Any]:
    """Wrap a model's checkpoint function (``checkpoint_fn(run_fn, *args)``): with CUDA tensor
    arguments, checkpoint with host-offloaded inputs; otherwise call ``checkpoint_fn`` unchanged."""

    def checkpoint(run_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if not any(isinstance(a, Tensor) and a.is_cuda for a in args) or not torch.is_grad_enabled():
            return checkpoint_fn(run_fn, *args, **kwargs)
        return _OffloadedCheckpoint.apply(run_fn, state, *args)

    checkpoint._seqpar_offload = True  # type: ignore[attr-defined]
    return checkpoint


def _install_hook(state: OffloadState) -> Callable[[nn.Module, Any], None]:
    def hook(layer: nn.Module, args: Any) -> None:
        # activation checkpointing may be enabled after the swap: wrap its function on first use
        fn = getattr(layer, "_gradient_checkpointing_func", None)
        if fn is not None and not getattr(fn, "_seqpar_offload", False):
            layer._gradient_checkpointing_func = offloading_checkpoint(fn, state)

    return hook


def apply_offload(model: nn.Module) -> str:
    """Offload the checkpointed inputs of the model's checkpointable decoder layers; returns a line
    saying what happens (on a CPU-only build: nothing, exactly)."""
    state = OffloadState()
    layers = [m for m in model.modules() if hasattr(m, "gradient_checkpointing") and hasattr(type(m), "forward")
              and type(m).__name__.endswith("DecoderLayer")]
    for layer in layers:
        if getattr(layer, "_seqpar_offload_hook", None) is None:
            layer._seqpar_offload_hook = layer.register_forward_pre_hook(_install_hook(state))
    if not torch.cuda.is_available():
        return (f"{len(layers)} decoder layers hooked; this build has no CUDA, so their checkpointed "
                "inputs stay where they are (an exact no-op)")
    return (f"checkpointed inputs of {len(layers)} decoder layers go to pinned CPU memory "
            "(needs activation checkpointing)")
