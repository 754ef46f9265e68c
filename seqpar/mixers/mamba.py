"""Mamba (v1) selective-scan layers, sequence-parallel: Jamba's ``JambaMambaMixer``, ``MambaMixer``,
``FalconMambaMixer`` and Zamba's multi-head ``ZambaMambaMixer``.

The layer (transformers' torch path) computes, per channel ``d`` and state ``n``::

    x, z  = in_proj(h).chunk(2)                 # (batch, d_inner, seq)
    x     = act(causal_conv(x))                 # depthwise, width d_conv
    dt, B, C = x_proj(x)  (+ RMS norms: Jamba, FalconMamba)
    dt    = softplus(dt_proj(dt) + dt_bias)
    h_t   = exp(dt_t A) * h_{t-1} + dt_t B_t x_t        # (d_inner, d_state), diagonal decay
    y_t   = (C_t . h_t + D x_t) * silu(z_t)
    out   = out_proj(y)

Sequence-parallel form (:class:`SeqParMambaMixer`, same child modules and parameters):

- the convolution is :func:`seqpar.mixers.conv.causal_conv_shard` (halo exchange, documents restart);
- every local chunk is scanned from a zero state by transformers' own torch ``mamba_selective_scan``
  (with ``mixer_kernels="auto"`` on CUDA, the module's hub-kernel wrapper: ``mamba_ssm``'s
  ``selective_scan_fn`` when transformers finds it; :mod:`seqpar.mixers.kernels`), cut at each
  document start so the scan restarts there;
- chunk summaries: transition ``T = exp(sum_t dt_t A)`` ``(batch, d_inner, d_state)`` and the final state
  of the zero-state scan; :func:`seqpar.mixers.state_passing.scalar_decay_correction` gives each chunk's
  true incoming state ``h0`` (one all-gather, flat in S) and adds the correction:
- the correction, for the positions of a chunk before its first document start:
  ``y_t += (C_t . (exp(cumsum_{s<=t} dt_s A) * h0)) * silu(z_t)`` (the state is linear in h0).

What differs between the transformers classes (Zamba's heads, Jamba's and FalconMamba's norms on dt, B and C)
is each class's :class:`MambaSpec` (:data:`MAMBA_SPECS`), read by the one forward.

Packed documents reach the layer as ``cu_seq_lens_q`` of its own call (Zamba) or through
:func:`seqpar.mixers.documents.feed_documents` (Jamba's decoder layer does not pass them on).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from seqpar.mixers.family import SwappedMixer, has_mixer_parts, is_transformers_class
from seqpar.mixers.kernels import use_kernels
from seqpar.mixers.scan_layout import ScanLayout
from seqpar.mixers.state_passing import scalar_decay_correction

__all__ = ["KERNEL_DEVICES", "MAMBA_CLASSES", "MAMBA_SPECS", "MambaSpec", "SeqParMambaMixer", "is_mamba_mixer",
           "selective_scan_shard", "FAMILY"]

KERNEL_DEVICES = {"cuda"}
"""Device types on which ``mixer_kernels="auto"`` lets transformers' wrapper pick mamba_ssm's selective scan."""



@dataclass(frozen=True)
class MambaSpec:
    """What one transformers Mamba (v1) class computes its own way around the shared scan."""

    multi_head: bool = False
    """Zamba's layout: ``n_mamba_heads`` heads of ``mamba_head_dim`` channels, ``(x, z)`` interleaved per channel
    in ``in_proj``'s output, and per-head ``x_proj_weight`` / ``dt_proj_weight`` / ``dt_proj_bias`` parameters.
    False: one head of all channels, ``(x, z)`` in halves, ``x_proj`` and ``dt_proj`` layers."""
    dt_bc_norms: bool = False
    """RMS norms on dt, B and C after ``x_proj`` (``dt_layernorm``, ``b_layernorm``, ``c_layernorm``: Jamba,
    FalconMamba)."""


MAMBA_SPECS: dict[str, MambaSpec] = {
    "JambaMambaMixer": MambaSpec(dt_bc_norms=True),
    "MambaMixer": MambaSpec(),
    "FalconMambaMixer": MambaSpec(dt_bc_norms=True),
    "ZambaMambaMixer": MambaSpec(multi_head=True),
}
"""Each transformers class :class:`SeqParMambaMixer` reproduces (read in transformers 5.24), and its spec."""

MAMBA_CLASSES = frozenset(MAMBA_SPECS)
"""transformers classes whose forward :class:`SeqParMambaMixer` reproduces (read in transformers 5.24)."""


def is_mamba_mixer(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers Mamba (v1) mixer that seqpar can shard."""
    if not is_transformers_class(module, MAMBA_CLASSES):
        return False
    return has_mixer_parts(module, "conv1d", linears=("in_proj",), parameters=("A_log",))


def selective_scan_shard(
    scan: Callable[..., Any], u: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None,
    z: Tensor, delta_bias: Tensor | None, *, layout: ScanLayout | None, group: dist.ProcessGroup | None,
    sharding: str, **scan_options: Any,
) -> Tensor:
    """Mamba's selective scan over this rank's shard, equal to the full sequence's (each document's).

    Args:
        scan: transformers' ``mamba_selective_scan`` (called per head and per run of positions from a
            zero state with ``return_last_state=True``; ``mamba_ssm.selective_scan_fn`` takes the same).
        u, dt, z: ``(heads, batch, d, seq_local)``: the scan input, the time step before its bias and
            softplus, the gate. ``heads`` is 1 but for Zamba.
        A: ``(heads, d, d_state)`` fp32 (negative). B, C: ``(heads, batch, d_state, seq_local)``.
        D, delta_bias: ``(heads, d)`` fp32, or None.
        layout: :func:`seqpar.mixers.scan_layout.scan_layout` of the batch; None: every position
            alone (the position-mixing probe: no communication).
        group, sharding: the SP group and the layout the sequence was cut in.
        scan_options: passed to ``scan`` (``use_mambapy``, ``use_associative_scan``).
    Returns:
        ``(heads, batch, d, seq_local)``: ``(C . h + D u) * silu(z)``, in the scan's output dtype.
    """
    heads, seq_local = u.shape[0], u.shape[-1]
    if layout is None:
        segments = [[(t, t + 1) for t in range(seq_local)]]
        c = seq_local
    else:
        segments = [[(j * layout.chunk_len + a, j * layout.chunk_len + b) for a, b in layout.segments(j)]
                    for j in range(layout.chunks)]
        c = layout.chunk_len
    outs, finals = [], []
    for h in range(heads):
        pieces, last = [], []
        for chunk in segments:
            for a, b in chunk:
                out, state = scan(u[h, ..., a:b], dt[h, ..., a:b], A[h], B[h, ..., a:b], C[h, ..., a:b],
                                  D=None if D is None else D[h], z=z[h, ..., a:b],
                                  delta_bias=None if delta_bias is None else delta_bias[h], delta_softplus=True,
                                  return_last_state=True, **scan_options)
                pieces.append(out)
            last.append(state)  # the chunk's final state, scanned from zero since its last document start
        outs.append(torch.cat(pieces, dim=-1))
        finals.append(torch.stack(last))  # (n, batch, d, d_state)
    out = torch.stack(outs)  # (heads, batch, d, seq_local)
    if layout is None or layout.world == 1:
        return out
    # Chunk summaries: the transition is the per-(channel, state) decay product over the chunk.
    if delta_bias is not None:
        dt = dt + delta_bias.to(dt.dtype)[:, None, :, None]
    log_decay = A[:, None, :, None, :] * F.softplus(dt)[..., None]  # (heads, batch, d, seq_local, d_state)
    n = layout.chunks
    log_decay = log_decay.unflatten(3, (n, c))  # (heads, batch, d, n, c, d_state)
    transition = log_decay.sum(4).exp().movedim(3, 0)  # (n, heads, batch, d, d_state)
    state = torch.stack(finals, dim=1).to(transition.dtype)  # (n, heads, batch, d, d_state)

    def lead_correction(j: int, lead: int, h0: Tensor) -> Tensor:  # y_t += (C_t . (exp(cumsum dt A) h0)) silu(z_t)
        decay = log_decay[:, :, :, j, :lead].cumsum(3).exp()  # (heads, batch, d, lead, d_state)
        cj = C[..., j * c:j * c + lead].to(decay.dtype)  # (heads, batch, d_state, lead)
        y = torch.einsum("hbdtn,hbnt,hbdn->hbdt", decay, cj, h0)
        return y * F.silu(z[..., j * c:j * c + lead])

    correction = scalar_decay_correction(transition, state, layout, lead_correction, dim=-1, group=group,
                                         sharding=sharding)
    return out + correction.to(out.dtype)


class SeqParMambaMixer(SwappedMixer):
    """A sequence-parallel drop-in for a transformers Mamba (v1) mixer (:data:`MAMBA_CLASSES`); see
    :class:`seqpar.mixers.family.SwappedMixer` for the arguments. The class's :class:`MambaSpec` is :attr:`spec`."""

    COPIED = ("layer_idx", "ssm_state_size", "time_step_rank", "n_mamba_heads", "mamba_head_dim")
    SPECS = MAMBA_SPECS
    spec: MambaSpec

    def take_over(self, original: nn.Module) -> None:
        self.use_mambapy = bool(getattr(original, "use_mambapy", False))
        self.use_associative_scan = bool(getattr(original, "use_associative_scan", False))

    def forward(self, hidden_states: Tensor, cache: Any = None, attention_mask: Tensor | None = None,
                **kwargs: Any) -> Tensor:
        """hidden_states ``(batch, seq_local, hidden)`` -> ``(batch, seq_local, hidden)``."""
        self.refuse_cache(cache, kwargs.get("cache_params"))
        tf = sys.modules[self.transformers_module]
        dtype = hidden_states.dtype
        batch, seq_local, _ = hidden_states.shape
        hidden_states, cu, layout = self.open_call(hidden_states, attention_mask, kwargs)
        projected = self.in_proj(hidden_states).transpose(1, 2)  # (batch, 2 * d_inner, seq_local)
        multi_head = self.spec.multi_head
        if multi_head:  # (x, z) interleaved per channel, heads of mamba_head_dim channels
            x, gate = projected.view(batch, -1, 2, seq_local).chunk(2, dim=2)
            x = x.squeeze(2).contiguous()
            gate = gate.reshape(batch, self.n_mamba_heads, self.mamba_head_dim, seq_local).transpose(0, 1)
        else:
            x, gate = projected.chunk(2, dim=1)
            gate = gate[None]
        conv = self.conv_shard(self.conv1d, x, cu)
        x = self.act(conv).to(x.dtype)
        x = tf.apply_mask_to_padding_states(x.transpose(1, 2), attention_mask)  # (batch, seq_local, d_inner)
        if multi_head:
            x = x.transpose(1, 2).reshape(batch, self.n_mamba_heads, self.mamba_head_dim, seq_local).transpose(0, 1)
            params = (self.x_proj_weight[:, None] @ x).transpose(-1, -2)  # (heads, batch, seq_local, R + 2N)
            time_step, B, C = torch.split(params, [self.time_step_rank, self.ssm_state_size, self.ssm_state_size],
                                          dim=-1)
            time_step = self.dt_proj_weight[:, None] @ time_step.transpose(-1, -2)  # (heads, batch, hd, seq)
            bias = self.dt_proj_bias.float() if self.dt_proj_bias is not None else None
            A = -torch.exp(self.A_log.float())  # (heads, hd, N)
            D = self.D.float()
        else:
            time_step, B, C = torch.split(self.x_proj(x), [self.time_step_rank, self.ssm_state_size,
                                                           self.ssm_state_size], dim=-1)
            if self.spec.dt_bc_norms:
                time_step, B, C = self.dt_layernorm(time_step), self.b_layernorm(B), self.c_layernorm(C)
            time_step = (self.dt_proj.weight @ time_step.transpose(1, 2))[None]
            bias = None if self.dt_proj.bias is None else self.dt_proj.bias.float()[None]
            A = -torch.exp(self.A_log.float())[None]
            D = self.D.float()[None]
            x = x.transpose(1, 2)[None]
        B, C = B.transpose(-1, -2), C.transpose(-1, -2)  # (.., batch, d_state, seq_local)
        if not multi_head:
            B, C = B[None], C[None]
        # "auto": transformers' hub-kernel wrapper (mamba_ssm's selective_scan_fn where it finds it);
        # "torch": the torch function beneath it (seqpar.mixers.kernels)
        scan = tf.mamba_selective_scan
        if not use_kernels(self.mixer_kernels, x.device, KERNEL_DEVICES):
            scan = inspect.unwrap(scan)
        out = selective_scan_shard(scan, x, time_step, A, B, C, D, gate, bias, layout=layout, group=self.group,
                                   sharding=self.sharding, use_mambapy=self.use_mambapy,
                                   use_associative_scan=self.use_associative_scan)
        out = out.transpose(0, 1).reshape(batch, -1, seq_local)  # heads back into channels
        return self.out_proj(out.transpose(1, 2).to(dtype))


FAMILY = SeqParMambaMixer.family("mamba", is_mamba_mixer)
"""The Mamba (v1) family's entry in :data:`seqpar.mixers.registry.FAMILIES`."""


def find_mamba_mixers(model: nn.Module) -> Sequence[tuple[str, nn.Module]]:
    """``(qualified name, module)`` of every Mamba (v1) mixer in ``model`` (swapped ones included)."""
    return [(name, m) for name, m in model.named_modules() if FAMILY.matches(m)]
