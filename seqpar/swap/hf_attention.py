"""What transformers calls on the ``"hf"`` route, registered under the name ``"seqpar"``:

- an attention function (``transformers.AttentionInterface``): called by every modern HF attention
  module with ``query`` ``(batch, q_heads, seq_local, head_dim)``, ``key``/``value``
  ``(batch, kv_heads, seq_local, head_dim)`` (GQA included), it runs seqpar attention on the
  shards and returns ``(out (batch, seq_local, q_heads, head_dim), None)``;
- a mask function (``transformers.masking_utils.AttentionMaskInterface``): the mask transformers
  would build is the local ``S_local x S_local`` one, wrong on a shard. seqpar attention is causal
  (or bidirectional) over the *global* sequence by construction, so the mask function only checks
  that the model asked for nothing more (no padding, no packed-document or custom mask) and returns
  ``None``.

Sliding-window layers run exactly: the ``sliding_window`` transformers passes to each layer's
attention call (Mistral: every layer; Qwen2, Gemma 2/3, GPT-OSS: the ``"sliding_attention"`` entries
of ``layer_types``, ``None`` for full layers) becomes ``window`` (causal: the same number; bidirectional:
one more, transformers' is inclusive). GPT-OSS sinks (``s_aux``) become ``sinks=``.

A sliding-window mask reaches the attention function as a :class:`WindowMask`, so layers that leave the
window to the mask (PhiMoE) run it too.

Llama 4's ``"chunked_attention"`` layers pass ``config.attention_chunk_size`` as ``chunk_size=`` (chunks
counted from each packed document's start, as transformers' own packed mask does). Its NoPE layers'
attention temperature tuning scales each query row by a function of the row's position, which
transformers numbers from 0 on every shard: the attention function rescales the rows to their *global*
positions (of the packed row, as one process numbers them). Gemma 2's logit soft-capping (``softcap``)
becomes ``softcap=`` (seqpar's math kernel: CPU, or float64 on CUDA; refused at swap time for a model
on CUDA in another dtype, whose fused kernels have no soft-capping).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import transformers
from torch import Tensor, nn
from transformers import masking_utils

from seqpar.mixers.documents import DROPS_DOCUMENTS_ATTR, with_carried
from seqpar.sequence.batch import global_positions, sp_rank_and_size
from seqpar.sequence.boundaries import host_boundaries
from seqpar.swap import frame as call_frame
from seqpar.swap.hf_inputs import all_ones, padding_error
from seqpar.swap.hf_route import (
    ATTN_IMPLEMENTATION,
    OPTIONS_ATTR,
    layer_chunk_size,
    layer_name,
    refuse_unknown_kwargs,
)
from seqpar.swap.mla import take_latent
from seqpar.swap.options import SwapOptions, self_only_attention
from seqpar.swap.state import is_probing

__all__ = ["register", "seqpar_mask", "WindowMask", "seqpar_attention_forward"]


def register() -> None:
    """Register the ``"seqpar"`` attention and mask functions with transformers (idempotent)."""
    transformers.AttentionInterface.register(ATTN_IMPLEMENTATION, seqpar_attention_forward)
    masking_utils.AttentionMaskInterface.register(ATTN_IMPLEMENTATION, seqpar_mask)


def seqpar_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable = masking_utils.causal_mask_function,
    attention_mask: Tensor | None = None,
    local_size: int | None = None,
    allow_is_causal_skip: bool = True,
    **kwargs: Any,
) -> WindowMask | None:
    """transformers' mask factory for ``"seqpar"``: checks, then returns ``None`` (no mask).

    Raises ``ValueError`` for padding (a 2D mask with zeros) and for any pattern other than plain
    causal, bidirectional or sliding window (run by the attention function from its
    ``sliding_window``): block-wise or custom ``or``/``and`` masks. Packed documents never reach
    here as a mask: the input preparer passes an all-ones ``attention_mask`` (so transformers does
    not build its packed mask) and the boundaries as ``cu_seq_lens_q/k``.
    """
    # read once per batch (_read_batch); while torch.compile traces, the batch's mask is shard_batch's,
    # all ones (seqpar.swap.traced): no host read in the graph
    if attention_mask is not None and not torch.compiler.is_compiling() and not all_ones(attention_mask):
        raise padding_error("mask")
    plain = mask_function in (masking_utils.causal_mask_function, masking_utils.bidirectional_mask_function)
    # create_sliding_window_causal_mask passes the window as local_size; it keeps
    # allow_is_causal_skip only when nothing (packing, or/and masks, blocks) was added to it.
    sliding_only = local_size is not None and allow_is_causal_skip
    if not (plain or sliding_only):
        raise ValueError(
            "seqpar: the model asked for an attention mask other than causal/bidirectional/sliding "
            "(packed-sequence document mask, block-wise mask, or a custom and/or mask function); "
            "seqpar attention does not honour it. Pass packed documents as cu_seq_lens_q/k "
            "(seqpar.sequence.batch.shard_batch derives them) and use a model without custom masks"
        )
    # A sliding-window mask: pass the window itself on, because some attention modules (PhiMoE) do not
    # hand their sliding_window to the attention function and rely on this mask alone.
    return WindowMask(int(local_size)) if local_size is not None else None


class WindowMask:
    """What :func:`seqpar_mask` returns for a sliding-window mask: the model's window (key j visible to
    query i iff ``i - j < window``), which :func:`seqpar_attention_forward` applies globally."""

    def __init__(self, window: int) -> None:
        self.window = window

    def __repr__(self) -> str:
        return f"WindowMask({self.window})"


def seqpar_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention function for ``"seqpar"``.

    Args:
        module: the attention layer (its ``is_causal`` gives causality unless ``is_causal`` is passed).
        query: ``(batch, q_heads, seq_local, head_dim)``; key, value:
            ``(batch, kv_heads, seq_local, head_dim)``, this rank's shard.
        attention_mask: whatever the mask function returned (``None``), or a 4D mask the caller
            passed itself, accepted only when it masks nothing.

    Returns:
        ``(out (batch, seq_local, q_heads, head_dim), None)``.
    """
    if getattr(module, DROPS_DOCUMENTS_ATTR, False):
        kwargs = with_carried(kwargs)  # its layer does not pass the boundaries or group on: its carrier has them
    options: SwapOptions | None = getattr(module, OPTIONS_ATTR, None)
    if options is not None:
        options = options.for_call(kwargs)  # dynamic CP: the micro-batch's group travels with the call
    if options is None and is_probing():
        # Left out by the swap's name patterns: refused at run time on shards (below); the probe
        # judges the rest of the model around it.
        return self_only_attention(query, value).transpose(1, 2).contiguous(), None
    if options is None:
        return _left_out_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                   is_causal=is_causal, **kwargs)
    layer = layer_name(module)
    _refuse_unsupported_call(layer, module, query, key, dropout, kwargs)
    sliding_window = _sliding_window(layer, attention_mask, kwargs.get("sliding_window"))
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    if not causal and kwargs.get("cu_seq_lens_q") is None and call_frame.token_mask() is not None:
        raise _bidirectional_padding_error(layer)
    query = _global_temperature(module, query, options, kwargs.get("cu_seq_lens_q"))
    latent = take_latent(module, key, value)
    if latent is not None:  # an MLA layer whose ring moves the latent (seqpar.swap.mla)
        out = options.latent_attention(query, latent, causal=causal, scale=scaling, layer=layer,
                                       cu_seqlens=kwargs.get("cu_seq_lens_q"),
                                       window=_window(sliding_window, causal),
                                       sinks=kwargs.get("s_aux"), chunk_size=layer_chunk_size(module),
                                       softcap=kwargs.get("softcap"))
        return out.transpose(1, 2).contiguous(), None
    out = options.attention(query, key, value, causal=causal, scale=scaling, layer=layer,
                            cu_seqlens=kwargs.get("cu_seq_lens_q"),
                            window=_window(sliding_window, causal),
                            sinks=kwargs.get("s_aux"), chunk_size=layer_chunk_size(module),
                            softcap=kwargs.get("softcap"))
    return out.transpose(1, 2).contiguous(), None  # (B, H, S, D) -> (B, S, H, D)


def _left_out_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any,
                        **kwargs: Any) -> tuple[Tensor, None]:
    """A layer the swap config left out (name patterns): transformers' own SDPA path (``kwargs``: what it
    takes, ``dropout``, ``scaling``, ``is_causal`` included), which is only right while the sequence is not
    sharded; on shards, refused naming the layer. Shapes as :func:`seqpar_attention_forward`."""
    try:
        _, world_size = sp_rank_and_size(None)
    except ValueError:  # no manager on a world > 1: the SP group is unknown, so the world may be shards
        world_size = dist.get_world_size()  # (a refusal either way; this one names the left-out layer)
    if world_size > 1:
        raise ValueError(
            f"seqpar: attention layer {type(module).__name__} (layer_idx "
            f"{getattr(module, 'layer_idx', '?')}) was left out by sequence_parallel.swap, but "
            f"the model runs on sequence shards of {world_size} ranks, where it would see only "
            "this rank's keys. Include every attention layer in sequence_parallel.swap. If this "
            "model was never swapped, it shares its config object with a swapped one (transformers "
            "keeps the attention implementation on the config, and the swap sets it to seqpar's): "
            "build each model from its own config (copy.deepcopy(config))"
        )
    if isinstance(attention_mask, WindowMask):  # the unsharded sequence: the window as a tensor
        i = torch.arange(query.shape[2], device=query.device)[:, None]
        j = torch.arange(key.shape[2], device=query.device)[None, :]
        attention_mask = ((j <= i) & (i - j < attention_mask.window))[None, None]
    return transformers.AttentionInterface._global_mapping["sdpa"](module, query, key, value, attention_mask,
                                                                   **kwargs)


def _refuse_unsupported_call(layer: str, module: nn.Module, query: Tensor, key: Tensor, dropout: float,
                             kwargs: dict[str, Any]) -> None:
    """Refuse, naming ``layer``, what a swapped layer's call cannot be given: an unknown keyword, attention
    weights, a position bias, dropout, and keys of another length than the queries ``(batch, heads, seq_local,
    head_dim)`` (a KV cache, cross-attention)."""
    refuse_unknown_kwargs(kwargs, layer, module)
    if kwargs.get("output_attentions"):
        raise ValueError(f"seqpar (layer '{layer}'): output_attentions=True is not supported")
    if kwargs.get("position_bias") is not None:
        raise ValueError(f"seqpar (layer '{layer}'): a position bias (position_bias=...) is not supported")
    if dropout:
        raise ValueError(
            f"seqpar (layer '{layer}'): attention dropout {dropout} in training is not supported; "
            "set the config's attention dropout to 0.0"
        )
    seq_local = query.shape[2]
    if key.shape[2] != seq_local:
        raise ValueError(
            f"seqpar (layer '{layer}'): {seq_local} queries but {key.shape[2]} keys; a KV cache or "
            "cross-attention is not supported on a sharded sequence"
        )


def _sliding_window(layer: str, attention_mask: Any, sliding_window: int | None) -> int | None:
    """The call's window: the layer's ``sliding_window``, or the :class:`WindowMask`'s (the two must agree).
    Any other mask is refused, naming ``layer``, unless it is a tensor that masks nothing (read eagerly: while
    torch.compile traces its values cannot be read, so it is refused too)."""
    if isinstance(attention_mask, WindowMask):
        if sliding_window is not None and sliding_window != attention_mask.window:
            raise ValueError(
                f"seqpar (layer '{layer}'): the layer passed sliding_window={sliding_window} but its mask "
                f"is a window of {attention_mask.window}; the model is inconsistent"
            )
        return attention_mask.window
    if attention_mask is not None:
        # while torch.compile traces, a mask's values cannot be read: a caller's own mask is refused
        if (not isinstance(attention_mask, Tensor) or torch.compiler.is_compiling()
                or not _masks_nothing(attention_mask)):
            raise ValueError(
                f"seqpar (layer '{layer}'): got a custom attention mask ({type(attention_mask).__name__}"
                f"{tuple(attention_mask.shape) if isinstance(attention_mask, Tensor) else ''}); seqpar "
                "attention honours only causal or bidirectional attention with no mask"
            )
    return sliding_window


def _global_temperature(module: nn.Module, query: Tensor, options: SwapOptions, cu_seqlens: Any) -> Tensor:
    """Llama 4's attention temperature tuning, at the rows' global positions.

    Its NoPE layers scale query row t by ``log1p(floor((t + 1) / floor_scale)) * attn_scale + 1`` with
    ``t`` numbered from 0 on the tensor it sees (``torch.arange``, not ``position_ids``): on a shard that
    is the local row. Each row is rescaled here by ``scale(global t) / scale(local t)`` (the scales in
    fp32 as transformers computes them, their ratio in float64): ``query`` ``(batch, q_heads,
    seq_local, head_dim)``, and its gradient flows through the same factor.
    """
    if not getattr(module, "attn_temperature_tuning", False) or getattr(module, "use_rope", True):
        return query
    if is_probing():  # self-only attention returns the values: the queries' scale cannot matter
        return query
    rank, world_size = sp_rank_and_size(options.group)
    if world_size == 1:
        return query
    if cu_seqlens is not None and torch.compiler.is_compiling():  # the rows' positions need the values
        raise ValueError(
            "seqpar: Llama 4's attention temperature tuning with packed documents under torch.compile is not "
            "supported (each row's global position depends on the boundaries' values, which a traced forward "
            "cannot read); run packed batches of this model eagerly"
        )
    seq_local = query.shape[2]
    glob = global_positions(seq_local * world_size, rank, world_size, options.sharding, device=query.device,
                            cu_seqlens=host_boundaries(cu_seqlens))

    def temperature(pos: Tensor) -> Tensor:
        return torch.log1p(torch.floor((pos.float() + 1.0) / module.floor_scale)) * module.attn_scale + 1.0

    local = torch.arange(seq_local, device=query.device)
    factor = temperature(glob).double() / temperature(local).double()  # (seq_local,)
    return query * factor.to(query.dtype).view(1, 1, seq_local, 1)


def _bidirectional_padding_error(layer: str) -> ValueError:
    """Bidirectional attention on a batch with padding (the running call carries
    :data:`~seqpar.sequence.batch.TOKEN_MASK_KEY`, which ``shard_batch`` adds on every rank exactly when it
    padded the end or accepted a right-padded ``attention_mask``): seqpar attention takes no key mask, so the
    pads would be keys every real token sees. ``shard_batch``'s padding is only right under causal attention;
    it cannot see the model, so the attention refuses (fuzzer case 1054415801: tiny BertGenerationDecoder, whose
    config is not ``is_decoder``, P = 4 on 30 tokens padded to 32, loss 8e-4 off). Packed rows are not refused:
    the end padding is a document of its own there."""
    return ValueError(
        f"seqpar (layer '{layer}'): bidirectional (non-causal) attention on a batch with padding (shard_batch padded "
        "the sequence to a multiple of the SP size, or the batch's attention_mask is right-padded): seqpar attention "
        "takes no key mask, so every real token would attend to the pads. Use sequences whose length divides into "
        "the SP size's chunks (2 x SP for zigzag) with no padding, pack the documents (DataCollatorWithFlattening: "
        "the padding becomes a document of its own), or run the model causal if it is meant to be a decoder "
        "(BertGenerationDecoder: config.is_decoder=True)"
    )


def _window(sliding_window: int | None, causal: bool) -> int | None:
    """transformers' ``sliding_window`` as seqpar's ``window``.

    Causal: key j is visible to query i iff ``0 <= i - j < sliding_window``, which is seqpar's
    window exactly. Bidirectional: transformers keeps ``|i - j| <= sliding_window`` (inclusive),
    seqpar's ``|i - j| < window``, so one more.
    """
    if sliding_window is None:
        return None
    return int(sliding_window) if causal else int(sliding_window) + 1


def _masks_nothing(mask: Tensor) -> bool:
    if mask.dtype == torch.bool:
        return bool(mask.all())
    return bool((mask == 0).all())
