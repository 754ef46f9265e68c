"""LongNet dilated attention (Ding et al., 2023, arXiv:2307.02486), exact and sequence-parallel.

Definition (the tests check it against explicit float64 masks)
----------------------------------------------------------------
A pattern ``(w, r)`` cuts the *global* sequence into segments of length ``w``; inside a segment the
positions ``o, o + r, o + 2r, ...`` (``o``: the head's offset, ``0 <= o < r``) take part, attention is
dense (causal: causal) over that sparsified subsequence, and each output row goes back to the
position it came from. Since ``r`` divides ``w`` and segments start at multiples of ``w``, the rows of
offset ``o`` are exactly the global positions ``p`` with ``p % r == o``.

Several patterns are mixed with weights proportional to their softmax denominators::

    lse_i = log sum_p exp(lse_{p,i}),    out_i = sum_p exp(lse_{p,i} - lse_i) * out_{p,i}

which is the log-sum-exp merge of :mod:`seqpar.kernels`. A row that pattern ``p`` does not select has
``lse_{p,i} = -inf`` and gets nothing from it; a row that no pattern selects gives 0 (and no gradient).
A key selected by two patterns counts once in each (the patterns' denominators add up).

Head layouts
------------
- ``"mixed"`` (the LongNet paper): every head mixes every pattern; in pattern ``(w, r)`` query head
  ``h`` uses offset ``h % r``, so together the heads cover every position.
- ``"grouped"`` (the layout of fkodom/dilated-attention-pytorch): the ``H`` query heads are split into
  ``len(patterns)`` equal groups; group ``i`` (heads ``[i*H/n, (i+1)*H/n)``) uses pattern ``i`` only,
  every head of the group with offset ``i % r_i`` -- the same heads, rows and segments as that
  library, so its checkpoints see the same pattern. Its output *scaling* is not reproduced: that
  library divides each group's output by a sum over the sequence and by the number of groups, whereas
  here each head returns the plain softmax attention of its pattern (0 on rows the pattern skips).

GQA: query head ``h`` reads kv head ``h // (q_heads // kv_heads)``; the offset follows the query head.

Algorithm
---------
For each pattern and offset the selected rows of a local shard are the strided view
``x[:, :, start::r]``; cut into segments it becomes ``(batch, heads, n_seg, w/r, head_dim)``, which is
gathered (one copy) into a compact ``(batch * n_seg, heads, w/r, head_dim)`` tensor, so *one*
:func:`~seqpar.kernels.block_forward` call handles every segment of a (pattern, offset). Its
``(out, lse)`` are merged in place into fp32 accumulators through the same strided views. No
``S x S`` mask is ever built: per head, a pattern costs ``(S/w) * (w/r)^2 = S*w/r^2`` score entries.
The backward repeats the gathers, calls :func:`~seqpar.kernels.block_backward` with the *merged*
``out``/``lse`` at the selected rows (which makes the per-pattern gradients add up exactly), and
scatter-adds dq/dk/dv (``index_add_`` over kv heads for GQA) into fp32 accumulators.

Sequence parallel (contiguous sharding, P ranks, ``seq_local = S / P``)
------------------------------------------------------------------------
- ``w`` divides ``seq_local`` (a *local* pattern): every segment lies inside one shard; no communication.
- ``seq_local`` divides ``w`` (a *spanning* pattern): a segment covers ``c = w / seq_local``
  consecutive ranks, and only those exchange anything: for each offset, the rows of K and V they hold
  at that offset (``1/r`` of their shard), through :class:`~seqpar.comm.segment.SegmentComm`
  point-to-point messages. ``mode="ring"``: the blocks travel round the ``c`` ranks one step at a time
  (the next transfer overlaps the current block's kernel; memory two blocks); under ``causal`` the ring
  becomes a chain that never carries a block to a rank before it. ``mode="allgather"``: every member
  sends its block straight to every member that needs it (memory ``c`` blocks). Backward: the K/V
  blocks are exchanged again, and each block's dK/dV contributions (fp32) go back to its owner --
  travelling with the block in ring mode (each hop's share computed first and added into the arriving
  accumulator only after its exchange's wait: :mod:`seqpar.comm.schedule`), sent directly in all-gather
  mode.
- Anything else is refused with a message naming the fix; so is zigzag sharding (see
  :func:`dilated_attention`).

Communication volume per rank and spanning pattern. Let ``B`` be the size of a member's K/V block:
``2 * batch * head_dim * sum_o kv_heads(o) * rows(o)`` elements (``kv_heads(o)``: kv heads the query
heads of offset ``o`` read; ``rows(o)``: the member's rows at offset ``o``, ``seq_local / r`` when
``r`` divides ``seq_local``). In the mixed layout without GQA, ``B = 2 * batch * kv_heads *
(seq_local / r) * head_dim``: ``1/r`` of a dense ring's K/V block. A kv head whose query heads use
``k`` distinct offsets sends ``k/r`` of its rows. Member ``i`` of ``c`` sends:

    =================  ==================  ======================================
    mode, mask         forward             backward
    =================  ==================  ======================================
    ring, full         (c-1) B             (c-1) B  +  (c-1) B in fp32 (dK/dV; bf16: half)
    ring, causal       (i+1) B, last: 0    same K/V as forward  +  i B in fp32
    allgather, full    (c-1) B             (c-1) B  +  (c-1) B in fp32
    allgather, causal  (c-1-i) B           (c-1-i) B  +  i B in fp32
    =================  ==================  ======================================

(a ring or chain forwards other members' blocks, so ``B`` there means the size of the block in
transit, which differs between members only when ``r`` does not divide ``seq_local``). Local patterns
send nothing. For comparison, dense ring attention sends ``(P-1) * 2 * batch * kv_heads * seq_local *
head_dim`` per rank in the forward.

Layouts: q ``(batch, q_heads, seq_local, head_dim)``, k/v ``(batch, kv_heads, seq_local, head_dim)``.

The code: :mod:`seqpar.attn.dilated_plan` (options, checks, the per-rank plan), :mod:`seqpar.attn.dilated_blocks`
(gathers, kernel calls, scatters), :mod:`seqpar.attn.dilated_schedule` (the passes and their exchanges),
:mod:`seqpar.attn.dilated_ops` (the custom ops of compiled calls); this module holds the autograd Function and the
public entry, and re-exports the names callers import from here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from seqpar.attn.amp import autocast_inputs, autocast_off
from seqpar.attn.checks import (
    CompileOnlyRefusal,
    check_across_ranks,
    check_causal,
    check_dkv_wire,
    check_local,
    check_options,
    check_scale,
    dkv_wire_digest,
)
from seqpar.attn.dilated_blocks import kv_index
from seqpar.attn.dilated_ops import compiled_dilated, dilated_bwd, dilated_fwd
from seqpar.attn.dilated_plan import (
    HEAD_LAYOUTS,
    DilatedOptions,
    DilatedPlan,
    OffsetPlan,
    PatternPlan,
    check_pattern,
    pattern_row,
    plan_dilated,
)
from seqpar.attn.dilated_schedule import dilated_backward, dilated_forward, output_in_layout
from seqpar.attn.foreign import DILATED_FOREIGN_KEYWORDS, foreign_keyword_refuser
from seqpar.attn.ops import defer_refusals
from seqpar.comm.segment import SegmentComm
from seqpar.runtime.groups import resolve_group

__all__ = [
    "HEAD_LAYOUTS",
    "DilatedOptions",
    "OffsetPlan",
    "PatternPlan",
    "DilatedPlan",
    "check_pattern",
    "pattern_row",
    "plan_dilated",
    "kv_index",
    "dilated_forward",
    "dilated_backward",
    "output_in_layout",
    "dilated_fwd",
    "dilated_bwd",
    "DilatedAttention",
    "dilated_attention",
]


class DilatedAttention(torch.autograd.Function):
    """Thin autograd wrapper of :func:`dilated_forward` / :func:`dilated_backward`. The backward
    repeats the forward's exchanges and sends every dK/dV share back to the block's owner (their dual)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, plan: DilatedPlan, comms: dict[int, SegmentComm]) -> Tensor:  # noqa: ANN001
        out_acc, lse = dilated_forward(q, k, v, plan, comms)
        out = output_in_layout(out_acc, q)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.comms = plan, comms
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):  # noqa: ANN001, ANN205
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = dilated_backward(dout, q, k, v, out, lse, ctx.plan, ctx.comms)
        return dq, dk, dv, None, None


# ---------------------------------------------------------------------------------- public entry
# a refusal found while dynamo traces is raised by an op when the graph runs (seqpar.attn.ops.refused_output)
@defer_refusals
@foreign_keyword_refuser(
    "seqpar.dilated_attention", DILATED_FOREIGN_KEYWORDS,
    positional_hint=" (dilated-attention-pytorch's 4th is is_causal: pass causal=)",
)
def dilated_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    causal: bool = False,
    scale: float | None = None,
    mode: str = "ring",
    group: dist.ProcessGroup | None = None,
    sharding: str = "contiguous",
    head_layout: str = "mixed",
    check_inputs: bool = True,
    dkv_wire_dtype: str = "fp32",
) -> Tensor:
    """LongNet dilated attention of this rank's queries over the sequence held by the SP group.

    Args:
        q: ``(batch, q_heads, seq_local, head_dim)``, this rank's contiguous shard of the queries.
        k, v: ``(batch, kv_heads, seq_local, head_dim)``; q_heads a multiple of kv_heads (GQA/MQA);
            v's head dim may differ (MLA), the output then has v's.
        segment_lengths: segment length ``w`` of each pattern, in global positions; each divides the
            global length ``seq_local * P`` and, for ``P > 1``, divides or is a multiple of ``seq_local``.
        dilation_rates: dilation rate ``r`` of each pattern; ``r`` divides its ``w``.
        causal: causal within each sparsified segment (a bool).
        scale: score multiplier, a finite float > 0 (default ``head_dim ** -0.5``).
        mode: how segments spanning several ranks exchange their selected K/V rows: ``"ring"`` or
            ``"allgather"`` (see the module docstring for volumes).
        group: the SP process group; ``None`` = the default manager's SP group, or a single
            process when torch.distributed is not initialised (or has one rank); without a manager on a
            world > 1 it is an error: call ``seqpar.init_process_groups(...)`` first, or pass
            ``group=torch.distributed.group.WORLD`` to use the whole world on purpose.
        sharding: must be ``"contiguous"`` (LongNet segments are contiguous position ranges).
        head_layout: ``"mixed"`` (LongNet: head h uses offset h mod r in every pattern) or
            ``"grouped"`` (heads split evenly among the patterns; dilated-attention-pytorch's layout).
        check_inputs: all-gather a few integers first so that ranks passing different shapes all raise.
        dkv_wire_dtype: what the backward's dK/dV messages travel in, in both modes: ``"fp32"`` (default,
            exact) or ``"bf16"`` (half their bytes; each receiver adds them in fp32, not exact), as in
            :func:`seqpar.attention`.
    Returns:
        ``(batch, q_heads, seq_local, head_dim)`` in q's dtype and the same sharding.
    Raises:
        ValueError / TypeError naming the problem and the fix.

    Under ``torch.autocast`` q, k and v are first cast to its dtype (float64 excepted), as torch's SDPA casts them
    (:mod:`seqpar.attn.amp`).
    """
    q, k, v = autocast_inputs(q, k, v)
    with autocast_off(q):
        return _dilated_attention(q, k, v, segment_lengths=segment_lengths, dilation_rates=dilation_rates,
                                  causal=causal, scale=scale, mode=mode, group=group, sharding=sharding,
                                  head_layout=head_layout, check_inputs=check_inputs, dkv_wire_dtype=dkv_wire_dtype)


def _dilated_attention(
    q: Tensor, k: Tensor, v: Tensor, *, segment_lengths: Sequence[int], dilation_rates: Sequence[int], causal: bool,
    scale: float | None, mode: str, group: dist.ProcessGroup | None, sharding: str, head_layout: str,
    check_inputs: bool, dkv_wire_dtype: str,
) -> Tensor:
    check_options(mode, sharding)
    if sharding != "contiguous":
        raise ValueError(
            "dilated attention needs sharding='contiguous': its segments are contiguous ranges of "
            "positions, and with contiguous shards local segments need no communication and every rank "
            "already does the same work, which is what zigzag buys dense causal attention. Shard the "
            "sequence with seqpar.shard_sequence(x, dim, sharding='contiguous')"
        )
    if mode in ("ulysses", "hybrid"):
        raise ValueError(
            f"dilated attention runs with mode='ring' or 'allgather' (or 'auto', which picks one of them), "
            f"not mode={mode!r}: its segments exchange selected rows between the ranks of a segment"
        )
    group = resolve_group(group)
    world = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    if check_inputs and world > 1 and torch.compiler.is_compiling():
        # As seqpar.attention's (resolve.py): not deferred, so without fullgraph dynamo gives this frame up and runs
        # the call eagerly, check included (exact); under fullgraph=True the collective broke the graph as dynamo's
        # Unsupported "skipped function", without a word of the option or the fix
        raise CompileOnlyRefusal(
            f"seqpar.dilated_attention under torch.compile with check_inputs=True on {world} ranks: the cross-rank "
            "check is a collective whose verdict is read on the host, which cannot be part of a graph "
            "(fullgraph=True refuses it; without fullgraph the call runs eagerly). Pass check_inputs=False inside "
            "compiled code, and check the inputs once eagerly"
        )
    if check_inputs and world > 1:
        # The pattern decides which K/V rows travel: ranks that disagree on it would pair up
        # mismatched collectives, so it is part of what every rank must agree on.
        check_across_ranks(q, k, v, group=group, causal=causal, mode=mode, sharding=sharding, scale=scale,
                           extra=[*pattern_row(segment_lengths, dilation_rates, head_layout),
                                  dkv_wire_digest(dkv_wire_dtype)], entry="seqpar.dilated_attention")
    # every mode of the dilated pattern sends dK/dV point to point and sums it in fp32 at the receiver
    check_dkv_wire(dkv_wire_dtype)
    causal = check_causal(causal, "seqpar.dilated_attention")  # after the cross-rank check, as the others
    if mode == "auto" and world == 1:
        # one rank exchanges nothing (every mode runs the same local pattern), and its group has no link to probe:
        # the probe measured 0 GB/s and the cost model divided by it (fuzz case 766629414: ZeroDivisionError)
        mode = "ring"
    if mode == "auto":
        from seqpar.attn.choose import choose_mode

        mode = choose_mode(q, k, world=world, manager=None, causal=causal, group=group, features={"dilated"},
                           dkv_wire_dtype=dkv_wire_dtype)
    check_local(q, k, v, world_size=world, sharding=sharding)
    scale = check_scale(scale, q.shape[-1], "seqpar.dilated_attention")
    if torch.compiler.is_compiling():
        # Traced, only the shape-free checks run here. A refusal raised while dynamo traces reaches a
        # fullgraph=True caller as dynamo's "Unsupported: Observed exception", not as this ValueError; the
        # custom op checks the pattern against the real sizes when it runs (dilated_ops), where the
        # ValueError propagates as in eager, and no guard on the symbolic length is made here.
        check_pattern(segment_lengths, dilation_rates, head_layout=head_layout)
    else:
        check_pattern(segment_lengths, dilation_rates, head_layout=head_layout, q_heads=q.shape[1],
                      seq_local=q.shape[2], world_size=world)
    opts = DilatedOptions(
        segment_lengths=tuple(segment_lengths), dilation_rates=tuple(dilation_rates), causal=causal,
        scale=scale, mode=mode, head_layout=head_layout,
        dkv_wire_dtype=dkv_wire_dtype,
    )
    if torch.compiler.is_compiling():
        # dynamo cannot trace the segments' point-to-point exchanges: the call is one custom op in the graph,
        # which plans from the real sizes when it runs. Not planned here: the plan branches on seq_local
        # (local or spanning, rows per offset), and traced with a symbolic length each branch was a guard
        return compiled_dilated(q, k, v, opts, group)
    plan = plan_dilated(opts, q_heads=q.shape[1], kv_heads=k.shape[1], seq_local=q.shape[2],
                        rank=rank, world_size=world)
    comms = {p: SegmentComm(group, pat.first, pat.span) for p, pat in enumerate(plan.patterns) if pat.span > 1}
    return DilatedAttention.apply(q, k, v, plan, comms)
