"""The compiled form of :func:`seqpar.attn.dilated.dilated_attention`: the custom ops ``seqpar::dilated_fwd`` and
``seqpar::dilated_bwd``, which check the pattern against the real sizes and plan from them when they run: a traced
call guards nothing on the local length (``tests/test_compile_dilated_dynamic.py``), and a refusal of the sizes is
eager's ValueError even under ``fullgraph=True`` (``tests/test_compile_refusals.py``)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from seqpar.attn.dilated_plan import DilatedOptions, DilatedPlan, check_pattern, plan_dilated
from seqpar.attn.dilated_schedule import dilated_backward, dilated_forward, output_in_layout
from seqpar.comm.group_names import group_by_name, group_name
from seqpar.comm.segment import SegmentComm
from seqpar.kernels import lse_dtype, output_like

__all__ = ["dilated_fwd", "dilated_bwd", "compiled_dilated"]


# Spanning segments exchange K/V rows point to point, which dynamo cannot trace: while it traces,
# dilated_attention runs the call as one forward and one backward torch.library op (seqpar::dilated_fwd /
# seqpar::dilated_bwd), opaque to dynamo and joined by a registered autograd formula, as seqpar.attn.ops does
# for the dense algorithms. Inside, the eager plan and algorithm run unchanged, so results and transfers are
# eager's. The group travels by name, DilatedOptions as its flat fields. Layouts as in seqpar.attn.dilated; the op's
# output is laid out as q, lse (batch, q_heads, seq_local) in fp32 (fp64 for fp64 inputs).
def _plan(q: Tensor, k: Tensor, group: str, segment_lengths: list[int], dilation_rates: list[int], causal: bool,
          scale: float, mode: str, head_layout: str, dkv_wire_dtype: str) -> tuple[DilatedPlan, dict[int, SegmentComm]]:
    pg = group_by_name(group)
    opts = DilatedOptions(segment_lengths=tuple(segment_lengths), dilation_rates=tuple(dilation_rates), causal=causal,
                          scale=scale, mode=mode, head_layout=head_layout, dkv_wire_dtype=dkv_wire_dtype)
    rank, world = (0, 1) if pg is None else (dist.get_rank(pg), dist.get_world_size(pg))
    # the shape-dependent checks, which the traced call left to the op: the sizes are real here, so the
    # refusal is eager's ValueError, raised on every rank alike before any exchange (the traced one
    # would reach a fullgraph=True caller as dynamo's Unsupported)
    check_pattern(segment_lengths, dilation_rates, head_layout=head_layout, q_heads=q.shape[1],
                  seq_local=q.shape[2], world_size=world)
    plan = plan_dilated(opts, q_heads=q.shape[1], kv_heads=k.shape[1], seq_local=q.shape[2], rank=rank, world_size=world)
    return plan, {p: SegmentComm(pg, pat.first, pat.span) for p, pat in enumerate(plan.patterns) if pat.span > 1}


@torch.library.custom_op("seqpar::dilated_fwd", mutates_args=())
def dilated_fwd(
    q: Tensor, k: Tensor, v: Tensor, group: str, segment_lengths: list[int], dilation_rates: list[int], causal: bool,
    scale: float, mode: str, head_layout: str, dkv_wire_dtype: str,
) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` of one rank (see the module)."""
    plan, comms = _plan(q, k, group, segment_lengths, dilation_rates, causal, scale, mode, head_layout, dkv_wire_dtype)
    out_acc, lse = dilated_forward(q, k, v, plan, comms)
    lse = lse.contiguous()  # the fake's layout (see seqpar.attn.ops)
    # a custom op's outputs have the fake's layout (q's) and never alias an input: the accumulator is a fresh buffer
    return output_in_layout(out_acc, q), lse


@dilated_fwd.register_fake
def _(q, k, v, group, segment_lengths, dilation_rates, causal, scale, mode, head_layout, dkv_wire_dtype):  # noqa: ANN001, ANN202
    return output_like(q, v.shape[-1]), q.new_empty(q.shape[:-1], dtype=lse_dtype(q.dtype))


@torch.library.custom_op("seqpar::dilated_bwd", mutates_args=())
def dilated_bwd(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, group: str, segment_lengths: list[int],
    dilation_rates: list[int], causal: bool, scale: float, mode: str, head_layout: str, dkv_wire_dtype: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` in the inputs' dtypes, each laid out as its input."""
    plan, comms = _plan(q, k, group, segment_lengths, dilation_rates, causal, scale, mode, head_layout, dkv_wire_dtype)
    grads = dilated_backward(dout, q, k, v, out, lse, plan, comms)
    return tuple(torch.empty_like(x).copy_(g) if g.stride() != x.stride() or g.data_ptr() == x.data_ptr() else g
                 for g, x in zip(grads, (q, k, v)))


@dilated_bwd.register_fake
def _(dout, q, k, v, out, lse, group, segment_lengths, dilation_rates, causal, scale, mode, head_layout,  # noqa: ANN001, ANN202
      dkv_wire_dtype):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:  # noqa: ANN001
    q, k, v, *rest = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.mark_non_differentiable(lse)
    ctx.rest = rest  # the group's name and the flat options: primitives


def _backward(ctx, dout: Tensor, dlse: Tensor | None):  # noqa: ANN001, ANN202
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = dilated_bwd(dout, q, k, v, out, lse, *ctx.rest)
    return dq, dk, dv, *([None] * len(ctx.rest))


dilated_fwd.register_autograd(_backward, setup_context=_setup_context)


def compiled_dilated(q: Tensor, k: Tensor, v: Tensor, opts: DilatedOptions, group: dist.ProcessGroup | None) -> Tensor:
    """One checked dilated call (``opts`` resolved, the mode chosen) as the custom ops; q, k, v ``bhsd``.
    Returns ``(batch, q_heads, seq_local, v_head_dim)`` in q's dtype."""
    out, _ = dilated_fwd(q, k, v, group_name(group), list(opts.segment_lengths), list(opts.dilation_rates),
                         opts.causal, opts.scale, opts.mode, opts.head_layout, opts.dkv_wire_dtype)
    return out
