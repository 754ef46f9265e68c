"""The (gated) delta rule over a sharded sequence: Gated DeltaNet (GDN) and Kimi Delta Attention (KDA).

Per value head, with the state ``S`` ``(d_k, d_v)`` and keys / queries L2-normalised by the kernel::

    S_t = D_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T      o_t = S_t^T q_t / sqrt(d_k)

(GDN: ``D_t = exp(g_t) I``, a per-head scalar decay; KDA: ``D_t = diag(exp(g_t))``, one decay per key
channel; the exact order of ``D_t`` and the projection follows each kernel.) Every step is affine in
``S`` and acts on the columns of ``S`` independently, so a run of positions started from ``S_0`` ends in

    S_end = T S_0 + S_local,        T = prod_t D_t (I - beta_t k_t k_t^T)   ``(d_k, d_k)`` per head,

where ``S_local`` is the run started from zero.

How ``T`` is obtained, exactly and with the kernel's own arithmetic: the kernel is run once on the
values widened by ``d_k`` zero columns, ``[v | 0]``, from the initial state ``[0 | I]``: the first
``d_v`` columns of the final state are ``S_local`` and the last ``d_k`` are ``T I = T`` (the columns
do not interact). That costs one scan of ``d_v + d_k`` columns; building ``T`` as a product of the
kernel's per-64-chunk factors instead would cost ``d_k^3`` per 64 positions (the same order for
``d_k = d_v = 128``) and a second copy of the kernel's internals.

The wide run's output is read too: its first ``d_v`` columns are the output from a zero state,
``o_zero``, and its last ``d_k`` the output of zero values from the state ``I``, ``O_I`` (row ``t``:
``q_t^T T_{1..t}`` times the kernel's scale, ``q_t`` normalised as the kernel does; ``(seq, d_k)`` per
value head). The kernel is linear in (values, initial state) jointly, so the output from a state ``h``
is ``o_zero + O_I h``: one ``(seq, d_k) x (d_k, d_v)`` product per value head instead of a second scan.

Sequence-parallel scan (:func:`delta_rule_shard`):

1. each local chunk (one contiguous, two zigzag, m balanced) is scanned from zero, cut at each
   document start; a chunk without a document start inside is scanned wide (``[v | 0]`` from
   ``[0 | I]``), giving its summary ``(T, S_local)`` and ``(o_zero, O_I)``; in a chunk with one, the
   runs after the first start are scanned from zero (the last gives ``S_local``; ``T`` is unused);
2. :func:`seqpar.mixers.state_passing.chunk_initial_states` all-gathers the summaries (one collective,
   ``(P - 1) x n x (|T| + |S|)`` values per rank, flat in S) and folds the exclusive prefix
   ``h_{g+1} = T_g h_g + S_g`` with document resets;
3. a wide chunk's output is ``o_zero + O_I h`` (autograd carries the gradient into ``h`` through the
   product, and from ``h`` into every earlier chunk's summary); the leading run of a chunk with a
   document start inside (the positions before that start) is run once, from ``h``.

Cost on a rank: one scan of ``d_v + d_k`` columns over its positions, against one scan of ``d_v`` on
one process: the kernel's intra-chunk preparation (decays, UT solve) is paid once; the wider state
recurrence and the ``O_I h`` product are the extra (see BENCHMARKS.md, ``python -m seqpar.bench.gdn``).

Memory: transformers' torch path keeps every 64-chunk's intermediates for its backward, so the wide scan
is checkpointed in pieces of :data:`RECOMPUTE` positions (all but the last piece recomputed in the
backward from the wide state it started from): one piece's intermediates are alive at a time.

The kernel is transformers' own torch path (``torch_chunk_gated_delta_rule`` of the model's module,
``chunk_kimi_delta_attention`` for KDA: differentiable, it takes ``initial_state`` and returns the
final state), or on CUDA flash-linear-attention's ``chunk_gated_delta_rule`` / ``chunk_kda`` when they
are importable (:func:`delta_rule_kernel`): the same call signature.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from seqpar.mixers.kernels import optional_kernel
from seqpar.mixers.scan_layout import ScanLayout
from seqpar.mixers.state_passing import chunk_initial_states

__all__ = ["KERNEL_DEVICES", "FLA_KERNELS", "RECOMPUTE", "delta_rule_kernel", "delta_rule_shard"]

KERNEL_DEVICES = {"cuda"}
"""Device types on which :func:`delta_rule_kernel` uses flash-linear-attention when it is importable."""

FLA_KERNELS = {"gdn": ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule"), "kda": ("fla.ops.kda", "chunk_kda")}
"""flash-linear-attention's chunked kernel for each rule: (module, function)."""

RECOMPUTE: int | None = 1024
"""Positions per checkpointed piece of the wide scan when the kernel is transformers' torch path
(:func:`delta_rule_shard`'s ``recompute="default"``); None: no recompute. That path keeps every 64-chunk's
intermediates (decay and UT matrices, the state entering each chunk) for its backward, ``(d_v + d_k) / d_v``
times the layer's own on the wide scan; flash-linear-attention's kernels keep O(S d) and recompute their
states in their own backward, so they are not checkpointed."""


def delta_rule_kernel(rule: str, torch_path: Callable[..., Any], device: torch.device,
                      mixer_kernels: str = "torch") -> Callable[..., Any]:
    """The kernel a run of positions goes through: with ``mixer_kernels="auto"``, flash-linear-attention's
    (``FLA_KERNELS[rule]``) on a kernel device when it is importable; else ``torch_path`` (transformers'
    torch function; its hub-kernel wrapper is unwrapped so the packed-sequence check does not apply to a
    single run). See :mod:`seqpar.mixers.kernels`.

    Every kernel is called as ``kernel(q, k, v, g=, beta=, initial_state=, output_final_state=True,
    use_qk_l2norm_in_kernel=)`` on ``(batch, seq, heads, dim)`` tensors and returns ``(out, final_state)``.
    """
    kernel = optional_kernel(mixer_kernels, device, KERNEL_DEVICES, *FLA_KERNELS[rule])
    return getattr(torch_path, "__wrapped__", torch_path) if kernel is None else kernel


def _is_torch_path(kernel: Callable[..., Any]) -> bool:
    """Whether ``kernel`` is transformers' torch function (possibly bound by ``functools.partial``)."""
    while isinstance(kernel, functools.partial):
        kernel = kernel.func
    return getattr(kernel, "__module__", "").startswith("transformers.")


def _matmul(transition: Tensor, state: Tensor) -> Tensor:
    return torch.matmul(transition, state)


def _wide_run(kernel: Callable[..., Any], q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, start: Tensor,
              options: dict[str, Any]) -> tuple[Tensor, Tensor]:
    """The kernel on ``[v | 0]`` (``d_k`` zero columns appended) from ``start`` ``(batch, v_heads, d_k, d_v + d_k)``:
    ``(out (batch, seq, v_heads, d_v + d_k), final state)``. The zero columns are made here, so that a
    checkpointed call does not keep them."""
    wide = torch.cat([v, v.new_zeros(*v.shape[:-1], k.shape[-1])], dim=-1)
    return kernel(q, k, wide, g=g, beta=beta, initial_state=start, output_final_state=True, **options)


def _wide_scan(kernel: Callable[..., Any], q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
               options: dict[str, Any], recompute: int | None) -> tuple[Tensor, Tensor]:
    """One run of positions (from its first to its last: no document start inside) scanned on ``[v | 0]`` from
    ``[0 | I]``: ``(out, state)`` with ``out (batch, seq, v_heads, d_v + d_k)`` = ``[o_zero | O_I]`` and
    ``state (batch, v_heads, d_k, d_v + d_k)`` = ``[S_local | T]`` (module docstring).

    ``recompute``: None keeps every intermediate of the kernel for the backward; else the run is cut into
    pieces of ``recompute`` positions, each but the last checkpointed (its forward repeated in the backward
    from the wide state it started from), so that only one piece's intermediates are alive at a time.
    """
    batch, seq, v_heads, d_v = v.shape
    d_k = k.shape[-1]
    eye = torch.eye(d_k, dtype=torch.float32, device=v.device).expand(batch, v_heads, d_k, d_k)
    state = torch.cat([eye.new_zeros(batch, v_heads, d_k, d_v), eye], dim=-1)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, g, beta))
    if recompute is None or not grad or seq <= recompute:
        return _wide_run(kernel, q, k, v, g, beta, state, options)
    outs = []
    for a in range(0, seq, recompute):
        b = min(a + recompute, seq)
        piece = (kernel, q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], state, options)
        if b < seq:
            out, state = checkpoint(_wide_run, *piece, use_reentrant=False, preserve_rng_state=False)  # no randomness
        else:  # the last piece's backward runs first: recomputing it would not lower the peak
            out, state = _wide_run(*piece)
        outs.append(out)
    return torch.cat(outs, dim=1), state


def delta_rule_shard(kernel: Callable[..., Any], q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *,
                     layout: ScanLayout | None, group: dist.ProcessGroup | None, sharding: str,
                     recompute: int | None | str = "default", **options: Any) -> Tensor:
    """The delta rule over this rank's shard, equal to the full sequence's (each document's).

    Args:
        kernel: see :func:`delta_rule_kernel`.
        q, k: ``(batch, seq_local, k_heads, d_k)``; v: ``(batch, seq_local, v_heads, d_v)`` (``v_heads`` a
            multiple of ``k_heads``: grouped heads, repeated to ``v_heads`` before the kernel).
        g: log decays, ``(batch, seq_local, v_heads)`` (GDN) or ``(batch, seq_local, v_heads, d_k)`` (KDA).
        beta: ``(batch, seq_local, v_heads)``.
        layout: :func:`seqpar.mixers.scan_layout.scan_layout` of the batch; None: every position alone
            (the position-mixing probe: no communication).
        group, sharding: the SP group and the layout the sequence was cut in.
        recompute: positions per checkpointed piece of the wide scan; None: no recompute (faster
            backward, more memory); ``"default"``: :data:`RECOMPUTE` (read at each call) for
            transformers' torch path, None for other kernels.
        options: passed to the kernel (``use_qk_l2norm_in_kernel``).
    Returns:
        ``(batch, seq_local, v_heads, d_v)`` in ``q``'s dtype.
    """
    if k.shape[2] != v.shape[2]:
        # grouped heads, each q/k head serving v_heads // k_heads consecutive value heads: repeated here, so that
        # every kernel gets equal head counts. transformers 5.17 (the floor, what the GPU machines run) repeats them
        # in its layer, and its torch kernel takes equal counts only ("The size of tensor a (2) must match the size
        # of tensor b (4)"); later releases repeat inside the kernel
        q, k = (t.repeat_interleave(v.shape[2] // k.shape[2], dim=2) for t in (q, k))
    if layout is None:  # every position its own sequence: one kernel call on (batch * seq) runs of one
        batch, seq = q.shape[:2]
        flat = [t.reshape(batch * seq, 1, *t.shape[2:]) for t in (q, k, v, g, beta)]
        out, _ = kernel(*flat[:3], g=flat[3], beta=flat[4], initial_state=None, output_final_state=True, **options)
        return out.reshape(batch, seq, *out.shape[2:])
    batch, _, v_heads, d_v = v.shape
    d_k = k.shape[-1]
    c = layout.chunk_len
    if recompute == "default":
        recompute = RECOMPUTE if _is_torch_path(kernel) else None

    def run(a: int, b: int, initial_state: Tensor | None) -> tuple[Tensor, Tensor]:
        return kernel(q[:, a:b], k[:, a:b], v[:, a:b], g=g[:, a:b], beta=beta[:, a:b], initial_state=initial_state,
                      output_final_state=True, **options)

    pieces: dict[tuple[int, int], Tensor] = {}
    wide_outs: dict[int, Tensor] = {}  # local chunk -> its wide output [o_zero | O_I]
    transitions, finals, leads = [], [], []
    for j in range(layout.chunks):
        segments = [(j * c + a, j * c + b) for a, b in layout.segments(j)]
        leads.append(segments[0])
        if layout.world == 1:  # no incoming state: every run from zero
            for a, b in segments:
                pieces[(a, b)] = run(a, b, None)[0]
            continue
        for a, b in segments[1:]:  # runs after a document start inside the chunk: final from step 1
            pieces[(a, b)], state = run(a, b, None)
        if len(segments) == 1:  # the whole chunk continues its incoming state: one wide scan, (T, S_local)
            a, b = segments[0]
            wide_outs[j], state = _wide_scan(kernel, q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b],
                                             options, recompute)
            transitions.append(state[..., d_v:])
            finals.append(state[..., :d_v])
        else:  # a document starts inside: the transition is not read (chunk_initial_states)
            transitions.append(state.new_zeros(batch, v_heads, d_k, d_k))
            finals.append(state)
    if layout.world > 1:
        compute = torch.promote_types(finals[0].dtype, torch.float32)
        init = chunk_initial_states(torch.stack(transitions).to(compute), torch.stack(finals).to(compute),
                                    apply=_matmul, group=group, sharding=sharding, seq_len=layout.seq_len,
                                    cu_seqlens=layout.cu)
        for j, (a, b) in enumerate(leads):
            if j in wide_outs:  # linear in the initial state: o = o_zero + O_I h, per batch and value head
                wide = wide_outs[j].to(compute)
                out = wide[..., :d_v] + torch.einsum("bshk,bhkv->bshv", wide[..., d_v:], init[j])
                pieces[(a, b)] = out.to(q.dtype)
            else:  # the lead of a chunk with a document start inside: its one run, from h
                pieces[(a, b)] = run(a, b, init[j])[0]
    return torch.cat([pieces[key] for key in sorted(pieces)], dim=1)
