"""MLA layers of transformers under the ring: send the latent, not the expanded K/V (:mod:`seqpar.attn.latent`).

transformers 5.x MLA attention modules (DeepSeek-V2/V3, Kimi, GLM-4.5 lite, MiniCPM3, ...) build K/V
with ``key, value = self.expand_kv(kv_nope, k_rot)`` from the normalised latent ``kv_nope`` ``(batch, 1,
seq, kv_lora_rank)`` and the rotated rope key ``k_rot`` ``(batch, 1, seq, qk_rope_head_dim)``, and pass
them straight to the attention function. The swap wraps ``expand_kv`` of each such module (one instance
attribute): when the layer's call will run the ring or the all-gather (``mode="ring"`` or
``"allgather"``, more than one SP rank, the dense pattern), the wrapper keeps the latent on the module and returns zero-cost stand-ins of K/V's shapes
(broadcast views, no storage); seqpar's attention function takes the latent back
(:func:`take_latent`, matching the stand-in by identity) and runs
:class:`~seqpar.attn.latent.LatentRingAttention` (or ``LatentAllGatherAttention``). Otherwise ``expand_kv`` runs as the model wrote it.

The wrapper checks once per layer (host sync once), on a fixed seeded input, that the layer's own
``expand_kv`` equals the latent expansion seqpar does (:class:`~seqpar.attn.latent.MLAExpander`); a
layer whose expansion differs (a future transformers release) keeps the expanded path, with a log line,
and so does one with a bias on ``kv_b_proj`` or GQA (:func:`mla_dims`). The verdict depends on the
weights only, which every SP rank holds alike, so every rank takes the same path.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from seqpar.attn.latent import MLADims, MLAExpander
from seqpar.runtime.groups import resolve_group
from seqpar.swap.state import is_probing

__all__ = ["mla_dims", "install_latent_transfer", "take_latent", "LatentCall"]

logger = logging.getLogger(__name__)

_LATENT_ATTR = "_seqpar_latent"  # the stashed latent of the call in flight
_ORIGINAL_ATTR = "_seqpar_expand_kv"  # the module's own expand_kv
_VERDICT_ATTR = "_seqpar_latent_ok"  # None: not probed yet


class LatentCall:
    """One layer call's latent: ``c`` ``(batch, 1, seq_local, kv_lora_rank)``, ``r`` ``(batch, 1,
    seq_local, d_rope)``, ``kv_b_proj``'s ``weight``, the head dims and the stand-ins handed to the model."""

    def __init__(self, c: Tensor, r: Tensor, weight: Tensor, dims: MLADims, key: Tensor, value: Tensor,
                 expand: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]) -> None:
        self.c, self.r, self.weight, self.dims = c, r, weight, dims
        self.key, self.value, self.expand = key, value, expand


def mla_dims(module: nn.Module) -> MLADims | None:
    """The head dims of a transformers MLA attention module, or None if it is not one seqpar can move
    latents for (no ``expand_kv``/``kv_b_proj``, a bias on ``kv_b_proj``, GQA, or other shapes)."""
    proj = getattr(module, "kv_b_proj", None)
    if not callable(getattr(module, "expand_kv", None)) or not isinstance(proj, nn.Linear) or proj.bias is not None:
        return None
    try:
        dims = MLADims(
            heads=int(module.num_heads), qk_nope_head_dim=int(module.qk_nope_head_dim),
            qk_rope_head_dim=int(module.qk_rope_head_dim), v_head_dim=int(module.v_head_dim),
            kv_lora_rank=int(module.kv_lora_rank),
        )
    except (AttributeError, TypeError, ValueError):
        return None
    if proj.weight.shape != (dims.heads * (dims.qk_nope_head_dim + dims.v_head_dim), dims.kv_lora_rank):
        return None
    return dims


def _matches(module: nn.Module, original: Callable, dims: MLADims) -> bool:
    """The layer's own ``expand_kv`` equals :class:`MLAExpander` on a fixed seeded 3-token input (in
    the weight's dtype and device; a different expansion differs by O(1), rounding by far less)."""
    weight = module.kv_b_proj.weight
    g = torch.Generator().manual_seed(0)
    c = torch.randn(1, 1, 3, dims.kv_lora_rank, generator=g).to(weight.device, weight.dtype)
    r = torch.randn(1, 1, 3, dims.qk_rope_head_dim, generator=g).to(weight.device, weight.dtype)
    try:
        with torch.no_grad():
            want = original(c, r)
            got = MLAExpander(weight, dims).expand(c, r)
            return all(a.shape == b.shape and bool(torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2))
                       for a, b in zip(want, got, strict=True))
    except Exception as error:  # noqa: BLE001 - any failure means: not the expansion seqpar knows
        logger.info("seqpar: %s.expand_kv could not be probed (%s): expanded K/V", type(module).__name__, error)
        return False


def _ring_will_run(options: Any) -> bool:
    """The layer's call will be the ring or the all-gather over more than one rank (the latent paths)."""
    if options.mode not in ("ring", "allgather") or options.pattern.type != "dense":
        return False
    group = resolve_group(options.group)
    return group is not None and dist.get_world_size(group) > 1


def install_latent_transfer(module: nn.Module, options: Any) -> bool:
    """Wrap ``module.expand_kv`` for latent transfer (``options``: the layer's SwapOptions); False
    when the module is no MLA layer seqpar knows (nothing installed)."""
    dims = mla_dims(module)
    if dims is None:
        return False
    original = module.__dict__.get(_ORIGINAL_ATTR) or module.expand_kv
    setattr(module, _ORIGINAL_ATTR, original)
    setattr(module, _VERDICT_ATTR, None)

    def expand_kv(kv_nope: Tensor, k_rot: Tensor) -> tuple[Tensor, Tensor]:
        if is_probing() or not _ring_will_run(options):  # the position-mixing probe attends self-only
            return original(kv_nope, k_rot)
        if getattr(module, _VERDICT_ATTR) is None:
            ok = _matches(module, original, dims)
            setattr(module, _VERDICT_ATTR, ok)
            if not ok:
                logger.info("seqpar: %s.expand_kv differs from the latent expansion: expanded K/V",
                            type(module).__name__)
        if not getattr(module, _VERDICT_ATTR) or kv_nope.shape[1] != 1 or k_rot.shape[1] != 1:
            return original(kv_nope, k_rot)
        b, _, n, _ = kv_nope.shape
        # stand-ins of K/V's shapes and dtype: broadcast views of one element, never read
        zero = kv_nope.new_zeros(())
        key = zero.expand(b, dims.heads, n, dims.qk_nope_head_dim + dims.qk_rope_head_dim)
        value = zero.expand(b, dims.heads, n, dims.v_head_dim)
        setattr(module, _LATENT_ATTR, LatentCall(kv_nope, k_rot, module.kv_b_proj.weight, dims, key, value, original))
        return key, value

    module.expand_kv = expand_kv
    return True


def take_latent(module: nn.Module, key: Tensor, value: Tensor) -> LatentCall | None:
    """The latent stashed by this layer's ``expand_kv`` for the call whose K/V stand-ins are ``key``,
    ``value`` (None: the layer passed real K/V). Raises if a stash does not belong to this call."""
    call: LatentCall | None = module.__dict__.pop(_LATENT_ATTR, None)
    if call is None:
        return None
    if call.key is not key or call.value is not value:
        raise RuntimeError(
            f"seqpar: {type(module).__name__} stashed an MLA latent, but its attention call received other "
            "K/V tensors than the stand-ins expand_kv returned; set sequence_parallel.mla_transfer to "
            '"expanded" for this model'
        )
    return call
