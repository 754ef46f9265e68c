"""The ``"mha"`` route: ``nn.MultiheadAttention`` re-implemented on seqpar attention.

:class:`SeqParMultiheadAttention` keeps the same parameter objects and state_dict keys, so optimizers
stay valid and checkpoints load either way.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from seqpar.swap.options import SwapError, SwapOptions

__all__ = ["SeqParMultiheadAttention", "mha_problems"]


class SeqParMultiheadAttention(nn.Module):
    """``nn.MultiheadAttention`` on sequence shards, computed by seqpar attention.

    Same parameters and state_dict keys as ``nn.MultiheadAttention`` (``in_proj_weight``,
    ``in_proj_bias``, ``out_proj.weight``, ``out_proj.bias``; ``q/k/v_proj_weight`` when
    ``kdim``/``vdim`` differ from ``embed_dim``), so checkpoints load either way.

    ``forward(query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
    average_attn_weights=True, is_causal=False) -> (out, None)``, with inputs
    ``(seq_local, batch, embed)`` or ``(batch, seq_local, embed)`` (``batch_first``) and output in
    the same layout. Causal attention: ``is_causal=True``, or an ``attn_mask`` that is exactly the
    causal mask of the local length (as ``nn.Transformer.generate_square_subsequent_mask`` builds
    it); it is read as the *global* causal pattern. Other masks, ``key_padding_mask``,
    ``need_weights=True``, ``add_bias_kv``, ``add_zero_attn`` and dropout in training are refused.

    Under ``torch.compile`` the forward traces as part of the graph (seqpar attention's custom ops); a causal
    ``attn_mask`` must then come with ``is_causal=True`` (its values cannot be read while tracing; refused,
    naming the fix, otherwise).
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        bias: bool = True,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = False,
        dropout: float = 0.0,
        options: SwapOptions | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim {embed_dim} must be divisible by num_heads {num_heads}")
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.embed_dim = embed_dim
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.dropout = dropout
        self.batch_first = batch_first
        self.options = options if options is not None else SwapOptions()
        # The same registrations, in the same order, as nn.MultiheadAttention: same state_dict.
        if self._qkv_same_embed_dim:
            self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim, **kw))
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        else:
            self.q_proj_weight = nn.Parameter(torch.empty(embed_dim, embed_dim, **kw))
            self.k_proj_weight = nn.Parameter(torch.empty(embed_dim, self.kdim, **kw))
            self.v_proj_weight = nn.Parameter(torch.empty(embed_dim, self.vdim, **kw))
            self.register_parameter("in_proj_weight", None)
        if bias:
            self.in_proj_bias = nn.Parameter(torch.zeros(3 * embed_dim, **kw))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = nn.modules.linear.NonDynamicallyQuantizableLinear(
            embed_dim, embed_dim, bias=bias, **kw
        )
        self.bias_k = self.bias_v = None
        self.add_zero_attn = False
        self._reset_parameters()
        # nn.TransformerEncoderLayer has a fused inference fast path that reads self_attn's weights
        # and never calls self_attn.forward; any forward pre-hook on a submodule turns it off.
        self.register_forward_pre_hook(_no_fused_fast_path)

    def _reset_parameters(self) -> None:
        # nn.MultiheadAttention's initialisation, for modules built directly.
        if self._qkv_same_embed_dim:
            nn.init.xavier_uniform_(self.in_proj_weight)
        else:
            nn.init.xavier_uniform_(self.q_proj_weight)
            nn.init.xavier_uniform_(self.k_proj_weight)
            nn.init.xavier_uniform_(self.v_proj_weight)
        if self.in_proj_bias is not None:
            nn.init.constant_(self.in_proj_bias, 0.0)
            nn.init.constant_(self.out_proj.bias, 0.0)

    @classmethod
    def from_module(
        cls, mha: nn.MultiheadAttention, options: SwapOptions | None = None
    ) -> SeqParMultiheadAttention:
        """The equivalent of ``mha``, sharing its parameter objects (optimizers stay valid)."""
        problems = mha_problems(mha)
        if problems:
            raise SwapError(f"cannot swap {type(mha).__name__}: " + "; ".join(problems))
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        for attr in ("embed_dim", "kdim", "vdim", "_qkv_same_embed_dim", "num_heads", "head_dim",
                     "dropout", "batch_first"):
            setattr(new, attr, getattr(mha, attr))
        new.options = options if options is not None else SwapOptions()
        for pname in ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight"):
            new.register_parameter(pname, getattr(mha, pname))
        new.register_parameter("in_proj_bias", mha.in_proj_bias)
        new.out_proj = mha.out_proj
        new.bias_k = new.bias_v = None
        new.add_zero_attn = False
        new.train(mha.training)
        new.register_forward_pre_hook(_no_fused_fast_path)
        return new

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
                f"batch_first={self.batch_first}, mode={self.options.mode}, "
                f"sharding={self.options.sharding}")

    def _causal_from_mask(self, attn_mask: Tensor | None, is_causal: bool, seq_q: int, seq_k: int) -> bool:
        if attn_mask is None:
            return is_causal
        if attn_mask.dim() != 2 or tuple(attn_mask.shape) != (seq_q, seq_k):
            raise ValueError(
                f"SeqParMultiheadAttention: attn_mask of shape {tuple(attn_mask.shape)} is not "
                f"supported; only the ({seq_q}, {seq_k}) causal mask (or is_causal=True) is"
            )
        if is_causal:
            # torch's own contract: is_causal=True is the caller's promise that attn_mask is the causal
            # mask (nn.MultiheadAttention then drops the mask; nn.TransformerEncoder passes the hint to
            # every layer after checking the mask once). Reading the mask here would make every layer
            # wait for the device.
            return True
        if torch.compiler.is_compiling():
            # the verdict is a read of the mask's values, which a traced forward cannot make (a data-dependent
            # branch: a graph break, an error under fullgraph); taken on trust, another mask would be ignored
            raise ValueError(
                "SeqParMultiheadAttention under torch.compile: attn_mask given without is_causal=True, and a "
                "traced forward cannot read the mask to check it is the causal mask. Pass is_causal=True with "
                "the causal mask (torch's hint that it is causal), or attn_mask=None, is_causal=True"
            )
        if not _is_causal_mask(attn_mask):
            raise ValueError(
                "SeqParMultiheadAttention: attn_mask is not the causal mask; seqpar attention "
                "honours only causal (is_causal=True or the square subsequent mask) or no mask"
            )
        return True

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, None]:
        if need_weights:
            raise ValueError(
                "SeqParMultiheadAttention: need_weights=True is not supported (attention weights of "
                "a sharded sequence are never materialised); call with need_weights=False"
            )
        if key_padding_mask is not None:
            raise ValueError(
                "SeqParMultiheadAttention: key_padding_mask is not supported (seqpar attention takes "
                "no key mask); pad at the end under causal attention, see seqpar.sequence.batch.shard_batch"
            )
        if self.dropout and self.training:
            raise ValueError(
                f"SeqParMultiheadAttention: dropout={self.dropout} in training is not supported; "
                "build the nn.MultiheadAttention with dropout=0.0"
            )
        if query.dim() != 3:
            raise ValueError(
                f"SeqParMultiheadAttention: expected batched 3D inputs, got query {tuple(query.shape)}"
            )
        if not self.batch_first:  # (S, B, E) -> (B, S, E)
            query, key, value = (x.transpose(0, 1) for x in (query, key, value))
        batch, seq_q, _ = query.shape
        seq_k = key.shape[1]
        causal = self._causal_from_mask(attn_mask, is_causal, seq_q, seq_k)

        if self._qkv_same_embed_dim:
            w_q, w_k, w_v = self.in_proj_weight.chunk(3)
        else:
            w_q, w_k, w_v = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
        b_q = b_k = b_v = None
        if self.in_proj_bias is not None:
            b_q, b_k, b_v = self.in_proj_bias.chunk(3)
        heads, hd = self.num_heads, self.head_dim
        q = F.linear(query, w_q, b_q).view(batch, seq_q, heads, hd).transpose(1, 2)  # (B, H, Sq, hd)
        k = F.linear(key, w_k, b_k).view(batch, seq_k, heads, hd).transpose(1, 2)  # (B, H, Sk, hd)
        v = F.linear(value, w_v, b_v).view(batch, seq_k, heads, hd).transpose(1, 2)  # (B, H, Sk, hd)
        out = self.options.attention(q, k, v, causal=causal, scale=1.0 / math.sqrt(hd))
        out = out.transpose(1, 2).reshape(batch, seq_q, self.embed_dim)  # (B, Sq, E)
        out = self.out_proj(out)
        if not self.batch_first:  # (B, S, E) -> (S, B, E)
            out = out.transpose(0, 1)
        return out, None


# id(mask) -> (weak reference, version counter, verdict): a mask handed to every layer is read once
_MASK_VERDICTS: dict[int, tuple[weakref.ref, int, bool]] = {}
_MAX_VERDICTS = 64


def _is_causal_mask(attn_mask: Tensor) -> bool:
    """Whether a square ``attn_mask`` (bool: True = masked out; float: -inf, or the dtype's lowest
    value, above the diagonal and 0 elsewhere) is the causal mask. One host read per distinct mask
    tensor: the verdict is remembered while the tensor lives unchanged (on a GPU each read waits for
    the device; a model hands the same mask to all its layers)."""
    try:
        version = attn_mask._version
    except RuntimeError:  # an inference tensor keeps no version counter
        version = None
    hit = _MASK_VERDICTS.get(id(attn_mask))
    if version is not None and hit is not None and hit[0]() is attn_mask and hit[1] == version:
        return hit[2]
    future = torch.ones(attn_mask.shape, dtype=torch.bool, device=attn_mask.device).triu(1)
    if attn_mask.dtype == torch.bool:
        verdict = torch.equal(attn_mask, future)
    else:  # one reduction, one read (no boolean-mask indexing, which reads the mask's size first)
        lowest = torch.finfo(attn_mask.dtype).min
        verdict = bool(torch.where(future, attn_mask <= lowest, attn_mask == 0).all())
    if version is not None:
        if len(_MASK_VERDICTS) >= _MAX_VERDICTS:
            for key in [key for key, (ref, _, _) in _MASK_VERDICTS.items() if ref() is None]:
                del _MASK_VERDICTS[key]
        _MASK_VERDICTS[id(attn_mask)] = (weakref.ref(attn_mask), version, verdict)
    return verdict


def _no_fused_fast_path(module: nn.Module, args: Any) -> None:
    """Deliberately empty (see SeqParMultiheadAttention.__init__)."""


def mha_problems(mha: nn.MultiheadAttention) -> list[str]:
    """Features of ``mha`` that seqpar does not honour (empty when it can be swapped)."""
    problems = []
    if mha.bias_k is not None or mha.bias_v is not None:
        problems.append("add_bias_kv=True (a learned key every query sees) is not supported")
    if mha.add_zero_attn:
        problems.append("add_zero_attn=True is not supported")
    if mha.dropout and mha.training:
        problems.append(
            f"attention dropout {mha.dropout} in training is not supported; build it with dropout=0.0"
        )
    return problems
