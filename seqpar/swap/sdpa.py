"""The ``"sdpa"`` route: the one global patch of ``torch.nn.functional.scaled_dot_product_attention``.

``F.scaled_dot_product_attention`` is replaced once by a dispatcher that behaves exactly as the
original except while a swapped module's forward runs on the calling thread; then the call runs as
seqpar attention on shards. Code that imported the function itself (``from torch.nn.functional
import scaled_dot_product_attention``) bypasses the dispatcher: the swapped module's forward then
raises, rather than silently running plain local attention.

Under ``torch.compile`` dynamo traces the swapped module's hooks and the dispatcher with the forward: the
frame a hook pushes is per-call state inside the traced call (pushed, read and popped within it), so the
route compiles as one graph with seqpar's attention ops in it (``tests/test_compile_routes.py``). The
per-thread state always has its attributes (:mod:`seqpar.swap.state`), so the guards dynamo puts on them hold
on every thread (no recompile per thread). Only the error paths read the frame's name (a read would be a
guard on it).
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
import threading
from typing import TYPE_CHECKING, Any

import torch.nn.functional as F
from torch import Tensor, nn

from seqpar.swap.options import SwapError
from seqpar.swap.state import Frame, stack, suspended

if TYPE_CHECKING:
    from seqpar.swap.options import SwapOptions

__all__ = ["suspended", "install_dispatcher", "track_module", "class_calls_sdpa", "ORIGINAL_SDPA"]

logger = logging.getLogger("seqpar")

# torch's own function, captured before any patch: what the dispatcher calls outside swapped modules.
ORIGINAL_SDPA = F.scaled_dot_product_attention
_PATCH_LOCK = threading.Lock()


def _sdpa_dispatch(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """``F.scaled_dot_product_attention`` while seqpar is installed: the original outside swapped
    modules; seqpar attention on shards inside them."""
    frames = stack()
    frame = frames[-1] if frames else None
    if frame is None:
        return ORIGINAL_SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                              is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    if attn_mask is not None or dropout_p or query.dim() not in (3, 4) or key.dim() != query.dim() \
            or value.dim() != query.dim() or (query.dim() == 4 and query.shape[1] != key.shape[1] and not enable_gqa):
        _refuse(frame.name, query, key, value, attn_mask, dropout_p)
    squeeze = query.dim() == 3
    if squeeze:  # (B, S, D) -> (B, 1, S, D)
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
    frame.calls += 1
    out = frame.options.attention(query, key, value, causal=is_causal, scale=scale)
    return out.squeeze(1) if squeeze else out


def _refuse(name: str, query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None, dropout_p: float) -> None:
    """Raise the error for an SDPA call in swapped module ``name`` that seqpar attention cannot run."""
    where = f"seqpar: F.scaled_dot_product_attention in swapped module '{name}'"
    if attn_mask is not None:  # a SwapError (a ValueError): this module's attention cannot be swapped as called
        raise SwapError(
            f"{where} got an attn_mask: seqpar attention takes no mask (a local mask is wrong on a "
            "sequence shard). For causal attention pass attn_mask=None, is_causal=True; padding at "
            "the end needs no mask (see seqpar.sequence.batch.shard_batch)"
        )
    if dropout_p:
        raise ValueError(
            f"{where} got dropout_p={dropout_p}: seqpar attention has no attention dropout. Set the "
            "module's attention dropout to 0.0 (or call model.eval())"
        )
    if query.dim() not in (3, 4) or key.dim() != query.dim() or value.dim() != query.dim():
        raise ValueError(
            f"{where}: expected (batch, heads, seq, head_dim) or (batch, seq, head_dim) inputs, got "
            f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
        )
    raise ValueError(
        f"{where}: query has {query.shape[1]} heads and key {key.shape[1]} but enable_gqa=False "
        "(plain SDPA would refuse this too)"
    )


def install_dispatcher() -> None:
    """Replace ``F.scaled_dot_product_attention`` by the dispatcher (once, thread-safe)."""
    with _PATCH_LOCK:
        if F.scaled_dot_product_attention is not _sdpa_dispatch:
            if F.scaled_dot_product_attention is not ORIGINAL_SDPA:
                logger.warning(
                    "seqpar: torch.nn.functional.scaled_dot_product_attention was already replaced by "
                    "%r; seqpar's dispatcher now replaces it and calls torch's kernel outside "
                    "swapped modules", F.scaled_dot_product_attention,
                )
            F.scaled_dot_product_attention = _sdpa_dispatch  # type: ignore[assignment]


def _enter_hook(name: str, options: SwapOptions) -> Any:
    def hook(module: nn.Module, args: Any) -> None:
        stack().append(Frame(name, options))

    return hook


def _exit_hook(name: str) -> Any:
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        frames = stack()
        # Pop back to this module's frame (a failing forward may have left inner frames behind).
        while frames:
            frame = frames.pop()
            if frame is not None and frame.name == name:
                break
        else:
            return
        failing = sys.exc_info()[1] is not None  # always_call hooks also run when forward raised
        if frame.calls == 0 and not failing and not getattr(module, "_seqpar_allow_no_call", False):
            raise RuntimeError(
                f"seqpar: swapped module '{name}' ({type(module).__name__}) ran without calling "
                "torch.nn.functional.scaled_dot_product_attention, so its attention was not "
                "sequence-parallel. If it imports the function directly (from torch.nn.functional "
                "import scaled_dot_product_attention), call it as torch.nn.functional."
                "scaled_dot_product_attention; if it computes attention by hand, make it call SDPA"
            )

    return hook


def track_module(module: nn.Module, name: str, options: SwapOptions) -> None:
    """Route the SDPA calls made while ``module`` runs to seqpar attention with ``options``
    (re-swapping replaces the previous hooks)."""
    install_dispatcher()
    old = getattr(module, "_seqpar_sdpa_hooks", None)
    if old is not None:
        for handle in old:
            handle.remove()
    module._seqpar_sdpa_hooks = (
        module.register_forward_pre_hook(_enter_hook(name, options)),
        module.register_forward_hook(_exit_hook(name), always_call=True),
    )


@functools.cache
def class_calls_sdpa(cls: type) -> bool:
    """Whether the class's own source (any method) names scaled_dot_product_attention."""
    if cls.__module__.startswith("torch."):
        return False
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return False
    return "scaled_dot_product_attention" in source
