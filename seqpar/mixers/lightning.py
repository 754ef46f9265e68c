"""MiniMax's lightning attention (``MiniMaxLightningAttention``), sequence-parallel.

The layer (transformers' torch path) computes, per head with a fixed decay rate ``s`` (``slope_rate``)::

    q, k, v = split(act(qkv_proj(h)))                     # (batch, heads, seq, head_dim)
    S_t = exp(-s) S_{t-1} + k_t^T v_t                     # (head_dim, head_dim) per head
    o_t = q_t S_t
    out = out_proj(sigmoid(output_gate(h)) * norm(o))

in blocks of ``block_size``: within a block ``o = ((Q K^T) * decay mask) V + (Q * exp(-s (i+1))) S_in``,
then ``S_out = exp(-s n) S_in + (K * exp(-s (n-1-j)))^T V``. transformers has no function of it that
takes an initial state (its cache path is token by token), so :func:`lightning_scan` is that block loop
(with the layer's own decay buffers), started from zero. On CUDA with flash-linear-attention importable,
its ``chunk_simple_gla`` runs the scan instead (:func:`lightning_kernel`).

Sequence-parallel form (:class:`SeqParLightningAttention`, same children and buffers): each local chunk
is scanned from zero, cut at each document start; the chunk summaries are the transition
``exp(-s c)`` ``(heads, 1, 1)`` and the final state ``(batch, heads, d, d)``;
:func:`seqpar.mixers.state_passing.scalar_decay_correction` gives each chunk's incoming state ``h0`` (one
all-gather, flat in S); the positions of a chunk before its first document start get
``o_t += (q_t * exp(-s (t+1))) h0`` (the state is linear in h0), before the norm and the gate.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from seqpar.mixers.family import SwappedMixer, is_transformers_class
from seqpar.mixers.kernels import optional_kernel
from seqpar.mixers.scan_layout import ScanLayout
from seqpar.mixers.state_passing import scalar_decay_correction

__all__ = ["LIGHTNING_CLASSES", "KERNEL_DEVICES", "SeqParLightningAttention", "is_lightning_attention",
           "lightning_kernel", "lightning_scan", "lightning_shard", "FAMILY"]

KERNEL_DEVICES = {"cuda"}
"""Device types on which :func:`lightning_kernel` uses flash-linear-attention when it is importable."""

LIGHTNING_CLASSES = frozenset({"MiniMaxLightningAttention"})
"""transformers classes whose forward :class:`SeqParLightningAttention` reproduces (read in transformers 5.24)."""


def is_lightning_attention(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers lightning attention layer that seqpar can shard."""
    return (is_transformers_class(module, LIGHTNING_CLASSES)
            and isinstance(getattr(module, "qkv_proj", None), nn.Linear)
            and isinstance(getattr(module, "slope_rate", None), Tensor))


def lightning_scan(q: Tensor, k: Tensor, v: Tensor, slope: Tensor, query_decay: Tensor, key_decay: Tensor,
                   diagonal_decay: Tensor) -> tuple[Tensor, Tensor]:
    """Lightning attention of one run of positions from a zero state, in blocks (the layer's own loop).

    Args:
        q, k, v: ``(batch, heads, length, head_dim)``.
        slope: ``(heads, 1, 1)`` decay rates. query_decay, key_decay ``(heads, block, 1)`` and
            diagonal_decay ``(1, heads, block, block)``: the layer's buffers (``block`` = its block size).
    Returns:
        ``(batch, heads, length, head_dim)`` outputs and the final state ``(batch, heads, head_dim, head_dim)``.
    """
    batch, heads, length, d = q.shape
    block = query_decay.shape[1]
    state = torch.zeros(batch, heads, d, v.shape[-1], dtype=v.dtype, device=v.device)
    outs = []
    for start in range(0, length, block):
        end = min(start + block, length)
        n = end - start
        qb, kb, vb = q[:, :, start:end], k[:, :, start:end], v[:, :, start:end]
        intra = torch.matmul(torch.matmul(qb, kb.transpose(-1, -2)) * diagonal_decay[:, :, :n, :n], vb)
        inter = torch.matmul(qb * query_decay[:, :n], state)
        outs.append(inter + intra)
        state = state * torch.exp(-slope * n) + torch.matmul((kb * key_decay[:, -n:]).transpose(-1, -2), vb)
    return torch.cat(outs, dim=-2), state


def lightning_kernel(device: torch.device, mixer_kernels: str = "torch") -> Callable[..., tuple[Tensor, Tensor]] | None:
    """With ``mixer_kernels="auto"``, flash-linear-attention's ``chunk_simple_gla`` on a kernel device when
    it is importable; else None (the torch path, :func:`lightning_scan`; see :mod:`seqpar.mixers.kernels`). Lightning attention is simple GLA with the constant per-head
    log decay ``g_gamma = -s`` and ``scale = 1``; the kernel takes ``(batch, seq, heads, head_dim)``."""
    return optional_kernel(mixer_kernels, device, KERNEL_DEVICES, "fla.ops.simple_gla", "chunk_simple_gla")


def _scan(q: Tensor, k: Tensor, v: Tensor, slope: Tensor, query_decay: Tensor, key_decay: Tensor,
          diagonal_decay: Tensor, mixer_kernels: str) -> tuple[Tensor, Tensor]:
    """One run of positions from a zero state, by the kernel where there is one (see :func:`lightning_kernel`)."""
    kernel = lightning_kernel(q.device, mixer_kernels)
    if kernel is None:
        return lightning_scan(q, k, v, slope, query_decay, key_decay, diagonal_decay)
    out, state = kernel(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), g_gamma=-slope.reshape(-1),
                        scale=1.0, output_final_state=True)
    return out.transpose(1, 2), state


def lightning_shard(q: Tensor, k: Tensor, v: Tensor, slope: Tensor, query_decay: Tensor, key_decay: Tensor,
                    diagonal_decay: Tensor, *, layout: ScanLayout | None, group: dist.ProcessGroup | None,
                    sharding: str, mixer_kernels: str = "torch") -> Tensor:
    """Lightning attention over this rank's shard, equal to the full sequence's (each document's).

    Args:
        q, k, v: ``(batch, heads, seq_local, head_dim)``; the decays as in :func:`lightning_scan`.
        layout: :func:`seqpar.mixers.scan_layout.scan_layout` of the batch; None: every position alone
            (the position-mixing probe: ``o_t = (q_t . k_t) v_t``, no communication).
        group, sharding: the SP group and the layout the sequence was cut in.
        mixer_kernels: ``"torch"`` or ``"auto"`` (flash-linear-attention where :func:`lightning_kernel` finds it).
    Returns:
        ``(batch, heads, seq_local, head_dim)``, before the layer's norm and gate.
    """
    if layout is None:
        return (q * k).sum(-1, keepdim=True) * v
    c = layout.chunk_len
    pieces, finals = [], []
    for j in range(layout.chunks):
        for a, b in layout.segments(j):
            out, state = _scan(q[:, :, j * c + a:j * c + b], k[:, :, j * c + a:j * c + b],
                               v[:, :, j * c + a:j * c + b], slope, query_decay, key_decay, diagonal_decay,
                               mixer_kernels)
            pieces.append(out)
        finals.append(state)  # from zero since the chunk's last document start
    out = torch.cat(pieces, dim=-2)
    if layout.world == 1:
        return out
    n = layout.chunks
    compute = torch.promote_types(state.dtype, torch.float32)  # summaries and the prefix fold in fp32 at least
    transition = torch.exp(-slope.to(compute) * c).expand(n, *slope.shape)  # (n, heads, 1, 1)

    def lead_correction(j: int, lead: int, h0: Tensor) -> Tensor:  # o_t += (q_t exp(-s (t + 1))) h0
        steps = torch.arange(1, lead + 1, device=q.device, dtype=compute)
        decay = torch.exp(-slope.to(compute) * steps[:, None])  # (heads, lead, 1)
        return torch.matmul(q[:, :, j * c:j * c + lead].to(compute) * decay, h0)

    correction = scalar_decay_correction(transition, torch.stack(finals).to(compute), layout, lead_correction,
                                         dim=-2, group=group, sharding=sharding)
    return out + correction.to(out.dtype)


class SeqParLightningAttention(SwappedMixer):
    """A sequence-parallel drop-in for MiniMax's lightning attention layer; see
    :class:`seqpar.mixers.family.SwappedMixer` for the arguments."""

    COPIED = ("layer_idx", "head_dim", "num_attention_heads", "block_size", "layer_type")

    def forward(self, hidden_states: Tensor, position_embeddings: Any = None, attention_mask: Tensor | None = None,
                cache: Any = None, **kwargs: Any) -> tuple[Tensor, None]:
        """hidden_states ``(batch, seq_local, hidden)`` -> ``((batch, seq_local, hidden), None)``."""
        self.refuse_cache(cache, kwargs.get("past_key_values"))
        batch, seq_local, _ = hidden_states.shape
        layout = self.layout(seq_local, self.cu_seqlens(kwargs))
        qkv = self.act_fn(self.qkv_proj(hidden_states))
        attention_mask = self.padding_mask(attention_mask, hidden_states)
        if attention_mask is not None and attention_mask.dim() == 2:  # transformers' apply_mask_to_padding_states
            qkv = (qkv * attention_mask[:, :, None]).to(qkv.dtype)
        qkv = qkv.reshape(batch, seq_local, self.num_attention_heads, 3 * self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in torch.split(qkv, self.head_dim, dim=3))
        out = lightning_shard(q, k, v, self.slope_rate, self.query_decay, self.key_decay, self.diagonal_decay,
                              layout=layout, group=self.group, sharding=self.sharding,
                              mixer_kernels=self.mixer_kernels)
        out = out.transpose(1, 2).reshape(batch, seq_local, self.num_attention_heads * self.head_dim)
        out = F.sigmoid(self.output_gate(hidden_states)) * self.norm(out)
        return self.out_proj(out), None

    def extra_repr(self) -> str:
        return f"{self.original_class}, block_size={self.block_size}, sharding={self.sharding!r}"


FAMILY = SeqParLightningAttention.family("lightning", is_lightning_attention)
"""Lightning attention's entry in :data:`seqpar.mixers.registry.FAMILIES`."""
