"""The public entry :func:`attention` (``seqpar.attention``): resolve a call once
(:mod:`seqpar.attn.resolve`), then run the one algorithm the plan names.

One module per algorithm (``ring``, ``allgather``, ``ulysses``, ``hybrid``, ``dilated``), their shared
options and piece kernels in ``common``, the kernel planning in ``plan`` (chunks) and ``masks``
(documents, windows), the input checks in ``checks``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import guard_scalar

from seqpar.attn.alibi import with_alibi
from seqpar.attn.allgather import AllGatherAttention
from seqpar.attn.amp import autocast_inputs, autocast_off
from seqpar.attn.common import SingleRank
from seqpar.attn.foreign import ATTENTION_FOREIGN_KEYWORDS, attention_foreign_keywords
from seqpar.attn.hybrid import hybrid_attention, ulysses_attention
from seqpar.attn.ops import OP_ALGORITHMS, compiled_attention, defer_refusals
from seqpar.attn.resolve import AttentionPlan, from_bhsd, resolve_attention, to_bhsd
from seqpar.attn.ring import RingAttention
from seqpar.comm.ring import RingComm
from seqpar.sequence.sharding import shard_index

__all__ = ["attention", "run_attention"]


# other libraries' argument names (flash-attn's softmax_scale / window_size, Megatron's cp_group / cp_comm_type, ...):
# a TypeError naming seqpar's form, before any collective (seqpar.attn.foreign, docs/names.md)
FOREIGN_KEYWORDS = ATTENTION_FOREIGN_KEYWORDS


# a refusal found while dynamo traces is raised by an op when the graph runs, so that a fullgraph=True caller gets
# it as eager's exception, not dynamo's "Unsupported: Observed exception" (seqpar.attn.ops.refused_output)
@defer_refusals
@attention_foreign_keywords
def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    mode: str = "ring",
    group: dist.ProcessGroup | None = None,
    sharding: str | None = None,
    overlap: bool = True,
    check_inputs: bool = True,
    head_chunks: int | str = "auto",
    cu_seqlens: Tensor | None = None,
    window: int | None = None,
    sinks: Tensor | None = None,
    layout: str | None = None,
    chunk_size: int | None = None,
    softcap: float | None = None,
    alibi_slopes: Tensor | None = None,
    dkv_wire_dtype: str = "fp32",
) -> Tensor:
    """Exact softmax attention of this rank's queries over the whole sequence held by the SP group.

    Args:
        q: ``(batch, q_heads, seq_local, head_dim)``, this rank's shard of the queries (with
            ``layout="bshd"``: ``(batch, seq_local, q_heads, head_dim)``).
        k, v: ``(batch, kv_heads, seq_local, head_dim)`` (bshd: ``(batch, seq_local, kv_heads, head_dim)``);
            q_heads a multiple of kv_heads (GQA/MQA). V's head dim may differ from q/k's (MLA); the
            output then has V's.
        causal: causal masking over the *global* positions of the sharded sequence (a bool: anything else,
            a string, None, 1 or a tensor, is refused).
        scale: score multiplier, a finite float > 0 (default ``head_dim ** -0.5``).
        mode: ``"ring"`` (P2P ring, O(S/P) memory), ``"allgather"`` (gathered K/V, O(S) memory),
            ``"ulysses"`` (all-to-all to head shards over the whole SP group; head counts P does not divide
            are split unevenly; fewer q_heads than P is refused),
            ``"hybrid"`` (Ulysses over the manager's Ulysses groups, ring across them; see
            ``init_process_groups(ulysses_size=u)``) or ``"auto"`` (the cheapest allowed, see
            :mod:`seqpar.attn.choose`).
        group: the SP process group; ``None`` = the default manager's SP group, or a single process
            when torch.distributed is not initialised (on a world of more than one rank without a
            manager, ``None`` is an error: call ``seqpar.init_process_groups`` or pass the group).
            Not allowed with ``mode="hybrid"``, which needs the manager's two axes (the default
            manager's own SP group is accepted: it is the same as ``None``).
        sharding: how the sequence was cut (``None``: the run's declared sharding, see
            ``init_process_groups(sharding=)``, else ``"contiguous"``; an explicit value that
            contradicts the declared one raises), ``"contiguous"``, ``"zigzag"`` or ``"balanced"`` (per-batch
            layout from ``cu_seqlens``; cut with ``shard_sequence(..., cu_seqlens=)``; see seqpar.sequence.sharding).
        overlap: overlap ring transfers with block compute.
        check_inputs: all-gather a digest of the call first to check every rank passes the same
            shapes and options (turns a would-be hang into an error on every rank), and refuse an
            ambiguous layout (see ``layout``). Its cost: one small all-gather (a few int64) and one
            host read per call. A swapped model checks once per batch instead. Once a training loop
            is known good, pass ``check_inputs=False`` (or ``"check_inputs": false`` in the config)
            to drop it; verdicts are never cached per rank (a cache that differed across ranks
            could hang).
        head_chunks: run the algorithm this many times, each on ``kv_heads / head_chunks`` K/V heads
            and their query heads: the transient buffers (travelling K/V and dK/dV, gathered K/V,
            kernel outputs) shrink by that factor at the cost of more, smaller messages. Must
            divide kv_heads (Ulysses / hybrid: each Ulysses rank's share of them). ``"auto"``: on CPU the largest divisor of kv_heads that is at most
            :data:`AUTO_HEAD_CHUNKS` (4); on a GPU 1 unless the unchunked call's transients exceed a
            quarter of the device's total memory, never below one wave of the GPU per kernel call
            (:func:`seqpar.attn.checks.resolve_head_chunks`).
        cu_seqlens: packed documents: a 1-D int32/int64 tensor (any device; a tuple of ints also
            works and needs no device-to-host copy) of the boundaries of the *whole* sequence,
            ``[0, l1, l1 + l2, ..., S]`` with ``S = seq_local * P``, the same on every rank. Query i
            sees key j only inside its document. Needs batch 1.
        window: sliding window, an int >= 1: with ``causal``, query i sees key j iff
            ``0 <= i - j < window`` (transformers' ``sliding_window``); without, iff ``|i - j| < window``.
        chunk_size: chunked local attention (Llama 4's ``attention_chunk_size``), an int >= 1: each
            document (the whole sequence without ``cu_seqlens``) is cut into chunks of ``chunk_size``
            tokens counted from its start, and query i sees key j only inside its own chunk (with
            ``causal``: j <= i as well). Combines with documents and ``window``.
        softcap: logit soft-capping (Gemma 2's ``attn_logit_softcapping``), a float > 0: every score
            ``s = scale * q.k`` becomes ``softcap * tanh(s / softcap)`` before the softmax, gradients
            included. Runs seqpar's exact math kernel (it needs the scores), so it is refused on CUDA
            except in float64: torch's fused kernels have no score modifier.
        alibi_slopes: ``(q_heads,)`` ALiBi slopes ``m_h`` (BLOOM, MPT, Falcon ``alibi=True``): the score of
            key j gains ``m_h * j`` (j its *global* position), which under a causal mask is ALiBi's
            ``-m_h (i - j)`` up to a per-row constant the softmax ignores. Carried as extra q/k columns
            (:mod:`seqpar.attn.alibi`), so every mode, sharding and kernel runs it; constants, no gradient.
        sinks: ``(q_heads,)`` learned per-head sink logits (GPT-OSS): ``exp(sinks[h])`` joins every
            softmax denominator of head h; the sinks get their gradient (this rank's rows' share;
            Ulysses/hybrid: the full gradient of this rank's heads, 0 for the others; summed over
            ranks like any replicated weight). ``balanced`` is refused in ``hybrid`` (1 < u < P).
        layout: ``"bhsd"`` (default) or ``"bshd"`` (flash-attn's ``(batch, seq_local, heads, head_dim)``,
            taken as a transposed view: no copy on the way in or out). Shapes and strides cannot tell
            them apart, so with ``check_inputs`` a call whose ``q.size(1) > q.size(2)`` and no explicit
            ``layout=`` raises, naming both readings. Without ``layout=``, a call that fails as ``bhsd`` and
            fits as ``bshd`` raises naming ``layout='bshd'``: under GQA/MQA q and k agreeing on dim 1 but not
            dim 2, or ``sinks`` / ``alibi_slopes`` of dim 2's length, or ``cu_seqlens`` ending at ``P x dim 1``.
            With ``check_inputs``, q with ``size(1) == size(2)`` and K/V of the same two sizes (multi-head
            attention) raises too, naming both readings: sinks, ALiBi and ``cu_seqlens`` fit either, so
            nothing tells them apart (eager calls; under ``torch.compile`` the size comparison would add a
            guard, so it is not made there). What stays ambiguous: a ``bshd`` call with
            ``seq_local < heads``, q_heads == kv_heads and none of those is a valid ``bhsd`` call (heads and
            tokens swapped), run without an error and wrong: pass ``layout=`` whenever the tensors are ``bshd``.
        dkv_wire_dtype: what the backward's travelling dK/dV accumulators are sent in (ring, and the ring
            of ``"hybrid"``): ``"fp32"`` (default: the accumulation dtype, exact) or ``"bf16"`` (half their
            bytes, TransformerEngine's choice; each hop adds its share in fp32 and rounds once to bf16, so
            dk and dv are not exact: see BENCHMARKS.md for the error against float64). ``"bf16"`` is
            refused with ``mode="allgather"`` or ``"ulysses"`` (no accumulator travels); under ``"auto"``
            it applies where the ring or the hybrid is chosen.
    Returns:
        ``(batch, q_heads, seq_local, v_head_dim)`` (bshd: ``(batch, seq_local, q_heads, v_head_dim)``) in
        q's dtype and the same sharding. Under ``torch.autocast`` q, k and v are first cast to its dtype (float64
        excepted), as torch's SDPA casts them, and the output is in that dtype.
    Raises:
        ValueError / TypeError naming the problem and the fix, on every rank of the group. Another library's
        argument name (flash-attn's ``softmax_scale``, ``window_size``, ``dropout_p``; Megatron's ``cp_group``,
        ``cp_comm_type``; :data:`FOREIGN_KEYWORDS`) is a TypeError naming seqpar's form (docs/names.md); an
        unknown name gets Python's "unexpected keyword argument".
    """
    q, k, v = autocast_inputs(q, k, v)  # under torch.autocast: what SDPA would take (seqpar.attn.amp)
    with autocast_off(q):
        plan = resolve_attention(
            q, k, v, causal=causal, scale=scale, mode=mode, group=group, sharding=sharding, overlap=overlap,
            check_inputs=check_inputs, head_chunks=head_chunks, cu_seqlens=cu_seqlens, window=window, sinks=sinks,
            layout=layout, chunk_size=chunk_size, softcap=softcap, alibi_slopes=alibi_slopes,
            dkv_wire_dtype=dkv_wire_dtype,
        )
        return run_attention(plan, q, k, v, sinks, alibi_slopes)


def run_attention(
    plan: AttentionPlan, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None = None,
    alibi_slopes: Tensor | None = None,
) -> Tensor:
    """Run a resolved call (:func:`seqpar.attn.resolve.resolve_attention`) on q, k, v in the plan's
    layout; returns the output in that layout. No check or choice is made again here."""
    qb, kb, vb = (to_bhsd(t, plan.layout) for t in (q, k, v))
    if alibi_slopes is None:
        return from_bhsd(_run_bhsd(plan, qb, kb, vb, sinks), plan.layout)
    world = 1 if plan.group is None else dist.get_world_size(plan.group)
    rank = 0 if plan.group is None else dist.get_rank(plan.group)
    seq_local = qb.shape[2]
    positions = shard_index(seq_local * world, rank, world, plan.opts.sharding, device=qb.device,
                            cu_seqlens=plan.opts.cu_seqlens)  # (seq_local,) global positions
    q2, k2, v2 = with_alibi(qb, kb, vb, alibi_slopes, positions, plan.opts.scale, seq_local * world - 1)
    return from_bhsd(_run_bhsd(plan, q2, k2, v2, sinks), plan.layout)


def _run_bhsd(plan: AttentionPlan, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None) -> Tensor:
    opts = plan.opts
    if plan.algorithm in OP_ALGORITHMS and (torch.compiler.is_compiling() or plan.traced):
        # dynamo cannot trace the exchanges: the algorithm is one custom op in the graph (seqpar.attn.ops). A plan
        # resolved while tracing takes the op even when Python runs it (dynamo gave up the frame that runs it, no
        # fullgraph): its documents and size checks are the op's; the eager Functions refused a boundary tensor
        # (CompileOnlyRefusal) where the call is valid, and would have dropped it
        if plan.algorithm == "hybrid":
            assert plan.manager is not None
            ring = plan.manager.ring_group if plan.manager.ring_size > 1 else None
            return compiled_attention("hybrid", plan.manager.ulysses_group, opts, q, k, v, sinks,
                                      ulysses=plan.ulysses, ring_group=ring, documents=plan.documents)
        return compiled_attention(plan.algorithm, plan.group, opts, q, k, v, sinks, ulysses=plan.ulysses,
                                  documents=plan.documents)
    # a boundary tensor is resolved only while tracing, and only into an op's algorithm (one rank: "single")
    assert plan.documents is None, plan.algorithm
    if plan.algorithm == "sdpa":
        # guard_scalar: with symbolic head counts (torch.compile, dynamic=True) the comparison is a SymBool, which
        # SDPA's enable_gqa refuses (a TypeError in dynamo's fake call: a graph break, fuzz case 1637623653; bool()
        # stays symbolic under dynamo); guard_scalar makes it a bool, guarded (head counts are a model's constants)
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=opts.causal, scale=opts.scale, enable_gqa=guard_scalar(q.shape[1] != k.shape[1])
        )
    if plan.algorithm == "single":  # documents, windows or sinks on one rank: the planner, no exchange
        return RingAttention.apply(q, k, v, SingleRank(), opts, sinks)
    if plan.algorithm == "hybrid":
        assert plan.manager is not None and plan.ulysses is not None
        return hybrid_attention(q, k, v, plan.manager, plan.ulysses, sinks)
    if plan.algorithm == "ulysses":
        assert plan.ulysses is not None
        return ulysses_attention(q, k, v, plan.group, plan.ulysses, sinks)
    if plan.algorithm == "ring":
        return RingAttention.apply(q, k, v, RingComm(plan.group), opts, sinks)
    return AllGatherAttention.apply(q, k, v, plan.group, opts, sinks)
