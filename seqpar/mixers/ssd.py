"""Mamba2's state-space dual (SSD) scan over a sharded sequence, equal to the full sequence's.

Per head ``h`` (``heads`` of ``head_dim`` channels; B and C shared by the heads of a group), with the
time step ``dt_t = clamp(softplus(dt_raw_t + dt_bias), dt_limit)`` and a scalar ``A_h < 0``::

    state_t = exp(dt_t A_h) * state_{t-1} + dt_t x_t B_t^T          # (head_dim, d_state)
    y_t     = state_t C_t + D_h x_t

The recurrence is linear in its incoming state with a per-head scalar decay, so after a run of
positions started from ``h0``: ``state = exp(sum_t dt_t A) * h0 + state_local`` and
``y_t = y_local_t + exp(cumsum_{s<=t} dt_s A) * (h0 C_t)``. :func:`ssd_shard`:

1. scans each local chunk (:mod:`seqpar.mixers.scan_layout`) from a zero state, restarting at every
   document start inside it, with transformers' own torch ``mamba2_chunk_scan`` (the installed model's
   module: it takes ``return_final_states``), or on CUDA with mamba_ssm importable its
   ``mamba_chunk_scan_combined`` (one call per chunk, documents kept apart by ``seq_idx``,
   :func:`ssd_kernel`);
2. exchanges the chunk summaries ``(exp(sum dt A) (batch, heads), final state (batch, heads, head_dim,
   d_state))`` in one all-gather (flat in S) and adds ``exp(cumsum dt A) * (h0 C_t)`` to the positions of
   each chunk before its first document start (:func:`seqpar.mixers.state_passing.scalar_decay_correction`).

The gated norm and the output projection that follow the scan are position-wise: the layer module
(:mod:`seqpar.mixers.mamba2`) runs them on the shard as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from seqpar.mixers.kernels import optional_kernel
from seqpar.mixers.scan_layout import ScanLayout
from seqpar.mixers.state_passing import scalar_decay_correction

__all__ = ["KERNEL_DEVICES", "ssd_kernel", "ssd_time_steps", "ssd_shard"]

KERNEL_DEVICES = {"cuda"}
"""Device types on which :func:`ssd_kernel` uses mamba_ssm when it is importable."""


def ssd_kernel(device: torch.device, mixer_kernels: str = "torch") -> Callable[..., Any] | None:
    """With ``mixer_kernels="auto"``, mamba_ssm's ``mamba_chunk_scan_combined`` on a kernel device when it
    is importable; else None (the torch path; see :mod:`seqpar.mixers.kernels`). It takes transformers' argument order ``(x, dt, A, B, C, chunk_size, D=, dt_bias=,
    seq_idx=, dt_softplus=, dt_limit=, return_final_states=)``; with ``seq_idx`` the returned final state
    is that of the last document, scanned from its start."""
    return optional_kernel(mixer_kernels, device, KERNEL_DEVICES, "mamba_ssm.ops.triton.ssd_combined",
                           "mamba_chunk_scan_combined")


def ssd_time_steps(dt: Tensor, A: Tensor, dt_bias: Tensor | None, dt_limit: tuple[float, float]) -> Tensor:
    """``dt_t A`` ``(batch, seq, heads)`` fp32: the log decay of each position, rounded as transformers'
    ``mamba2_chunk_scan`` rounds it (bias added and softplus taken in ``dt``'s dtype, the product in fp32).

    Args:
        dt: ``(batch, seq, heads)`` before bias and softplus. A: ``(heads,)`` negative.
        dt_bias: ``(heads,)`` or None. dt_limit: ``(min, max)`` clamp of the time step.
    """
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    dt = torch.clamp(F.softplus(dt), min=dt_limit[0], max=dt_limit[1])
    return A.float() * dt.float()


def _zero_state_runs(scan: Callable[..., Any], x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                     D: Tensor | None, dt_bias: Tensor | None, chunk_size: int, dt_limit: tuple[float, float],
                     segments: list[tuple[int, int]], mixer_kernels: str = "torch") -> tuple[Tensor, Tensor]:
    """One local chunk scanned from zero, restarting at each segment start: ``(batch, c, heads, head_dim)``
    outputs and the final state ``(batch, heads, head_dim, d_state)`` of its last segment."""
    options = dict(D=D, dt_bias=dt_bias, dt_softplus=True, dt_limit=dt_limit, return_final_states=True)
    kernel = ssd_kernel(x.device, mixer_kernels)
    if kernel is not None:
        # one call for the whole chunk: seq_idx keeps its documents apart (the kernel's state passing resets
        # where it changes), and the final state is the last document's
        if len(segments) > 1:
            seq_idx = torch.cat([torch.full((b - a,), i, dtype=torch.int32, device=x.device)
                                 for i, (a, b) in enumerate(segments)])
            options["seq_idx"] = seq_idx[None].expand(x.shape[0], -1).contiguous()
        return kernel(x, dt, A, B, C, chunk_size, **options)
    pieces = []
    for a, b in segments:
        out, state = scan(x[:, a:b], dt[:, a:b], A, B[:, a:b], C[:, a:b], chunk_size, **options)
        pieces.append(out)
    return (pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)), state


def ssd_shard(
    scan: Callable[..., Any], x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None,
    dt_bias: Tensor | None, *, chunk_size: int, dt_limit: tuple[float, float] = (0.0, float("inf")),
    layout: ScanLayout | None, group: dist.ProcessGroup | None, sharding: str, mixer_kernels: str = "torch",
) -> Tensor:
    """The SSD scan over this rank's shard, equal to the full sequence's (each document's).

    Args:
        scan: transformers' torch ``mamba2_chunk_scan`` (``(x, dt, A, B, C, chunk_size, D=, dt_bias=,
            dt_softplus=, dt_limit=, return_final_states=)``), used where :func:`ssd_kernel` gives none.
        x: ``(batch, seq_local, heads, head_dim)``. dt: ``(batch, seq_local, heads)`` before bias and softplus.
        A: ``(heads,)`` fp32, negative. B, C: ``(batch, seq_local, groups, d_state)`` (heads // groups
            heads per group). D, dt_bias: ``(heads,)`` or None.
        chunk_size: the scan's internal block length (any value gives the same result).
        dt_limit: ``(min, max)`` clamp of the time step after softplus.
        layout: :func:`seqpar.mixers.scan_layout.scan_layout` of the batch; None: every position alone
            (the position-mixing probe: no communication).
        group, sharding: the SP group and the layout the sequence was cut in.
        mixer_kernels: ``"torch"`` or ``"auto"`` (mamba_ssm where :func:`ssd_kernel` finds it).
    Returns:
        ``(batch, seq_local, heads, head_dim)``: ``y`` (with the ``D`` skip), in the scan's output dtype.
    """
    batch, seq_local, heads, head_dim = x.shape
    if layout is None:  # every position its own sequence: positions become batch entries, one call
        flat = lambda t: t.reshape(batch * seq_local, 1, *t.shape[2:])  # noqa: E731
        out, _ = _zero_state_runs(scan, flat(x), flat(dt), A, flat(B), flat(C), D, dt_bias, chunk_size, dt_limit,
                                  [(0, 1)], mixer_kernels)
        return out.reshape(batch, seq_local, heads, head_dim)
    n, c = layout.chunks, layout.chunk_len
    outs, finals = [], []
    for j in range(n):
        sl = slice(j * c, (j + 1) * c)
        out, state = _zero_state_runs(scan, x[:, sl], dt[:, sl], A, B[:, sl], C[:, sl], D, dt_bias, chunk_size,
                                      dt_limit, layout.segments(j), mixer_kernels)
        outs.append(out)
        finals.append(state)
    out = outs[0] if n == 1 else torch.cat(outs, dim=1)
    if layout.world == 1:
        return out
    log_decay = ssd_time_steps(dt, A, dt_bias, dt_limit).view(batch, n, c, heads)
    transition = log_decay.sum(2).exp().movedim(1, 0)[..., None, None]  # (n, batch, heads, 1, 1)
    state = torch.stack(finals).float()  # (n, batch, heads, head_dim, d_state)
    per_group = heads // B.shape[2]

    def lead_correction(j: int, lead: int, h0: Tensor) -> Tensor:  # y_t += exp(cumsum dt A) (h0 C_t)
        decay = log_decay[:, j, :lead].cumsum(1).exp()  # (batch, lead, heads)
        cj = C[:, j * c:j * c + lead].float().repeat_interleave(per_group, dim=2)  # (batch, lead, heads, d_state)
        return torch.einsum("bthn,bhpn->bthp", cj, h0) * decay[..., None]

    correction = scalar_decay_correction(transition, state, layout, lead_correction, dim=-3, group=group,
                                         sharding=sharding)
    return out + correction.to(out.dtype)
