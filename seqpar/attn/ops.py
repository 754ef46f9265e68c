"""seqpar's point-to-point and collective attention as ``torch.library`` custom ops (issue 31 §1).

``torch.compile`` cannot trace the ring's ``isend``/``irecv`` nor an ``async_op=True`` collective: each
is a graph break, so a compiled model falls apart at every attention layer. Here the ring (also the
one-rank planner, ``"single"``), all-gather, Ulysses and hybrid attention are each a forward and a
backward custom op,
opaque to dynamo (a single node in the graph, with a fake implementation that gives the output's
shape, dtype and strides) and joined by a registered autograd formula. Inside, the unchanged eager
algorithms run (:mod:`seqpar.attn.ring`, :mod:`seqpar.attn.allgather`): exactness and the transfers
are those of eager.

A custom op takes tensors and primitives only, so:

- the process group travels by name (:mod:`seqpar.comm.group_names`; ``""`` for one process), resolved
  with torch's own registry, the one its functional collectives use;
- Ulysses and hybrid take their ring group by name too (``""``: Ulysses over the whole group), and their
  :class:`~seqpar.attn.ulysses.UlyssesPlan` as its fields; the forward returns the head-layout tensors
  the backward needs as a list of tensors (5 per head chunk: q, k, v, out, lse);
- :class:`~seqpar.attn.common.AttentionOptions` travels as its flat fields. Document boundaries given as
  ints travel as a list of ints (a constant of the graph: a new layout recompiles); given as a tensor
  (``cu_seq_lens_q`` of a packed batch, a 1-D int tensor ``(n_docs + 1,)``) they travel as the tensor
  ``documents``, read on the host inside the op at run time (:func:`seqpar.sequence.boundaries.host_boundaries`:
  once per tensor, free for :func:`seqpar.shard_batch`'s host tensors) and checked there, so a new layout
  with the same number of documents is the same graph, and one with another number is one recompile
  (dynamo then marks the size dynamic).

:func:`compiled_attention` is what :func:`seqpar.attn.dispatch.run_attention` calls while dynamo
traces (``torch.compiler.is_compiling()``); eager calls keep the autograd Functions.

Layouts: q ``(batch, q_heads, seq_local, head_dim)``, k ``(batch, kv_heads, seq_local, head_dim)``, v
``(batch, kv_heads, seq_local, v_head_dim)``; the output ``(batch, q_heads, seq_local, v_head_dim)`` in q's
dtype and memory layout (:func:`~seqpar.kernels.output_like`), lse ``(batch, q_heads, seq_local)`` fp32
(fp64 for fp64 inputs).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import guard_int

from seqpar.attn.allgather import allgather_backward, allgather_forward
from seqpar.attn.checks import check_local_length, resolve_head_chunks, ulysses_share
from seqpar.attn.common import AttentionOptions, SingleRank
from seqpar.attn.masks import check_boundary_values, document_bounds, host_boundaries
from seqpar.attn.ring import ring_attention_backward, ring_attention_forward
from seqpar.attn.ulysses import HeadSplit, UlyssesPlan, ulysses_backward, ulysses_forward
from seqpar.comm.group_names import group_by_name, group_name
from seqpar.comm.ring import RingComm
from seqpar.config import ConfigError
from seqpar.kernels import in_layout_of, lse_dtype, output_like, sink_grad

__all__ = [
    "OP_ALGORITHMS", "REFUSALS", "check_share", "check_sizes", "defer_refusals", "refusal", "refused_output",
    "compiled_attention", "comm_size",
]

OP_ALGORITHMS = ("single", "ring", "allgather", "ulysses", "hybrid")
"""The algorithms run as custom ops under ``torch.compile``."""


def _options(causal: bool, scale: float, sharding: str, overlap: bool, head_chunks: int, window: int | None,
             cu_seqlens: list[int] | None, chunk_size: int | None, softcap: float | None,
             dkv_wire_dtype: str, documents: Tensor | None = None, seq_len: int = 0) -> AttentionOptions:
    """The call's options; ``documents`` (the boundaries as a tensor, see the module) read on the host here,
    at run time, and checked against the global length ``seq_len`` (tracing could not read them)."""
    if documents is not None:
        # zero-length documents (repeats: a fixed-size cu_seqlens padded with copies of S) are dropped here, at run
        # time, so the traced graph sees one tensor shape whatever the batch's documents
        cu_seqlens = list(document_bounds(host_boundaries(documents), seq_len))
    return AttentionOptions(causal=causal, scale=scale, sharding=sharding, overlap=overlap, head_chunks=head_chunks,
                            window=window, cu_seqlens=None if cu_seqlens is None else tuple(cu_seqlens),
                            chunk_size=chunk_size, softcap=softcap, dkv_wire_dtype=dkv_wire_dtype)


def _flat(opts: AttentionOptions) -> tuple[Any, ...]:
    """The inverse of :func:`_options`: the options as the ops' trailing arguments."""
    return (opts.causal, opts.scale, opts.sharding, opts.overlap, opts.head_chunks, opts.window,
            None if opts.cu_seqlens is None else list(opts.cu_seqlens), opts.chunk_size, opts.softcap,
            opts.dkv_wire_dtype)


def check_sizes(q: Tensor, k: Tensor, *, world: int, sharding: str, head_chunks: int,
                cu_seqlens: list[int] | None) -> None:
    """The checks a traced multi-rank call leaves to its op (:func:`seqpar.attn.resolve.resolve_attention`), made
    here at the real sizes: zigzag's even local length, ``head_chunks`` dividing the K/V heads, boundaries given
    as ints ending at the global length. Raised in the op, a refusal is eager's ValueError even under
    ``torch.compile(fullgraph=True)``, on every rank alike (the sizes agree) and before any exchange."""
    check_local_length(q.shape[2], world_size=world, sharding=sharding)
    resolve_head_chunks(head_chunks, k.shape[1])
    if cu_seqlens is not None:
        check_boundary_values(tuple(cu_seqlens), q.shape[2] * world)


def check_share(plan: UlyssesPlan) -> None:
    """A Ulysses / hybrid op's check that its plan's ``head_chunks`` divides each rank's share of the K/V heads
    (an even split's; an uneven one runs one pass), left to the op by a traced call
    (:func:`seqpar.attn.resolve.resolve_attention`) as :func:`check_sizes` is, with eager's message."""
    if plan.split.even:
        resolve_head_chunks(plan.head_chunks, plan.split.kv_per_rank,
                            share=ulysses_share(plan.split.u, plan.split.kv_heads))


def _comm(algorithm: str, name: str) -> Any:
    if algorithm == "single":
        return SingleRank()
    group = group_by_name(name)
    return RingComm(group) if algorithm == "ring" else group


def comm_size(comm: Any) -> int:
    """The number of ranks of an op's communicator (:func:`_comm`'s: a ring, a group, one rank)."""
    if isinstance(comm, dist.ProcessGroup):
        return dist.get_world_size(comm)
    return comm.world_size


def _ulysses_world(group: str, ring_group: str) -> int:
    """The SP size of a Ulysses (``ring_group=""``) or hybrid op: the Ulysses group times the ring's."""
    return dist.get_world_size(group_by_name(group)) * (dist.get_world_size(group_by_name(ring_group)) if ring_group else 1)


@torch.library.custom_op("seqpar::attention_fwd", mutates_args=())
def attention_fwd(
    q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, algorithm: str, group: str, causal: bool, scale: float,
    sharding: str, overlap: bool, head_chunks: int, window: int | None, cu_seqlens: list[int] | None,
    chunk_size: int | None, softcap: float | None, dkv_wire_dtype: str, documents: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` of one rank (see the module)."""
    comm = _comm(algorithm, group)
    check_sizes(q, k, world=comm_size(comm), sharding=sharding, head_chunks=head_chunks, cu_seqlens=cu_seqlens)
    opts = _options(causal, scale, sharding, overlap, head_chunks, window, cu_seqlens, chunk_size, softcap, dkv_wire_dtype,
                    documents, q.shape[2] * comm_size(comm))
    if algorithm == "allgather":
        out_acc, lse = allgather_forward(q, k, v, comm, opts, sinks)
    else:
        out_acc, lse = ring_attention_forward(q, k, v, comm, opts, sinks)
    # a custom op's outputs have the fake's layout and never alias an input: out q's, lse contiguous (a rank whose
    # queries meet only its own block gets the kernel's (batch, seq, heads)-strided lse, which inductor's stride
    # assertion refused: fuzzer case 674949561)
    lse = lse.contiguous()
    if out_acc.dtype == q.dtype and in_layout_of(out_acc, q) and out_acc.data_ptr() not in (
            q.data_ptr(), k.data_ptr(), v.data_ptr()):
        return out_acc, lse
    return output_like(q, v.shape[-1]).copy_(out_acc), lse


@attention_fwd.register_fake
def _(q, k, v, sinks, algorithm, group, causal, scale, sharding, overlap, head_chunks, window, cu_seqlens,  # noqa: ANN001, ANN202
      chunk_size, softcap, dkv_wire_dtype, documents):
    return output_like(q, v.shape[-1]), q.new_empty(q.shape[:-1], dtype=lse_dtype(q.dtype))


@torch.library.custom_op("seqpar::attention_bwd", mutates_args=())
def attention_bwd(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, algorithm: str, group: str, causal: bool,
    scale: float, sharding: str, overlap: bool, head_chunks: int, window: int | None, cu_seqlens: list[int] | None,
    chunk_size: int | None, softcap: float | None, dkv_wire_dtype: str, documents: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` in the inputs' dtypes, each laid out as its input (see the module)."""
    comm = _comm(algorithm, group)
    opts = _options(causal, scale, sharding, overlap, head_chunks, window, cu_seqlens, chunk_size, softcap, dkv_wire_dtype,
                    documents, q.shape[2] * comm_size(comm))
    if algorithm == "allgather":
        grads = allgather_backward(dout, q, k, v, out, lse, comm, opts)
    else:
        grads = ring_attention_backward(dout, q, k, v, out, lse, comm, opts)
    return tuple(g if g.stride() == x.stride() else torch.empty_like(x).copy_(g) for g, x in zip(grads, (q, k, v)))


@attention_bwd.register_fake
def _(dout, q, k, v, out, lse, algorithm, group, causal, scale, sharding, overlap, head_chunks, window,  # noqa: ANN001, ANN202
      cu_seqlens, chunk_size, softcap, dkv_wire_dtype, documents):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:  # noqa: ANN001
    q, k, v, sinks, *rest, documents = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, sinks, documents)
    ctx.mark_non_differentiable(lse)
    ctx.rest = rest  # algorithm, group name and the flat options: primitives


def _backward(ctx, dout: Tensor, dlse: Tensor | None):  # noqa: ANN001, ANN202
    # lse is an output for the backward's sake only: its gradient is never used (not differentiable)
    q, k, v, out, lse, sinks, documents = ctx.saved_tensors
    dq, dk, dv = attention_bwd(dout, q, k, v, out, lse, *ctx.rest, documents)
    dsinks = None if sinks is None else sink_grad(dout, out, lse, sinks)
    return dq, dk, dv, dsinks, *([None] * (len(ctx.rest) + 1))


attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def _ulysses_plan(opts: AttentionOptions, q_heads: int, kv_heads: int, u: int, rank: int, order: list[int] | None,
                  chunks_per_rank: int, head_chunks: int) -> UlyssesPlan:
    return UlyssesPlan(opts, HeadSplit(q_heads, kv_heads, u), rank, None if order is None else tuple(order),
                       chunks_per_rank, head_chunks)


def _plan_args(plan: UlyssesPlan) -> tuple[Any, ...]:
    """The inverse of :func:`_ulysses_plan` (the plan's own options travel as the flat options)."""
    return (plan.split.q_heads, plan.split.kv_heads, plan.split.u, plan.rank,
            None if plan.order is None else list(plan.order), plan.chunks_per_rank, plan.head_chunks)


def _ring(name: str) -> RingComm | None:
    return RingComm(group_by_name(name)) if name else None


@torch.library.custom_op("seqpar::ulysses_fwd", mutates_args=())
def ulysses_fwd(
    q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, group: str, ring_group: str, q_heads: int, kv_heads: int,
    u: int, rank: int, order: list[int] | None, chunks_per_rank: int, head_chunks: int, causal: bool, scale: float,
    sharding: str, overlap: bool, inner_head_chunks: int, window: int | None, cu_seqlens: list[int] | None,
    chunk_size: int | None, softcap: float | None, dkv_wire_dtype: str, documents: Tensor | None,
) -> tuple[Tensor, list[Tensor]]:
    """Ulysses (``ring_group=""``) or hybrid forward: ``out`` like q and, per head chunk, the head-layout
    ``q, k, v, out, lse`` the backward reads (contiguous)."""
    check_sizes(q, k, world=_ulysses_world(group, ring_group), sharding=sharding, head_chunks=inner_head_chunks,
                cu_seqlens=cu_seqlens)
    opts = _options(causal, scale, sharding, overlap, inner_head_chunks, window, cu_seqlens, chunk_size, softcap,
                    dkv_wire_dtype, documents, q.shape[2] * _ulysses_world(group, ring_group))
    plan = _ulysses_plan(opts, q_heads, kv_heads, u, rank, order, chunks_per_rank, head_chunks)
    check_share(plan)
    out, saved = ulysses_forward(q, k, v, group_by_name(group), _ring(ring_group), plan, sinks)
    return out, [t.contiguous() for chunk in saved for t in chunk]


@ulysses_fwd.register_fake
def _(q, k, v, sinks, group, ring_group, q_heads, kv_heads, u, rank, order, chunks_per_rank, head_chunks,  # noqa: ANN001, ANN202
      causal, scale, sharding, overlap, inner_head_chunks, window, cu_seqlens, chunk_size, softcap, dkv_wire_dtype,
      documents):
    # Traced with symbolic sizes (dynamic=True) the head counts arrive as SymInts, and an uneven split's shares
    # (runtime.grid.ulysses_shares: divmod, which SymInt has no overload for) would raise here on every rank.
    # Head counts are a model's constants: guard_int specialises them (a guard that never fails for one model).
    q_heads, kv_heads, u = (guard_int(n) for n in (q_heads, kv_heads, u))
    qc, kc = HeadSplit(q_heads, kv_heads, u).counts(rank, head_chunks)  # uneven: this rank's share, one pass
    b, n, d, dv = q.shape[0], u * q.shape[2], q.shape[3], v.shape[3]
    saved = []
    for _ in range(head_chunks):
        saved += [q.new_empty((b, qc, n, d)), k.new_empty((b, kc, n, d)), v.new_empty((b, kc, n, dv)),
                  q.new_empty((b, qc, n, dv)), q.new_empty((b, qc, n), dtype=lse_dtype(q.dtype))]
    return output_like(q, dv), saved


@torch.library.custom_op("seqpar::ulysses_bwd", mutates_args=())
def ulysses_bwd(
    dout: Tensor, saved: list[Tensor], k: Tensor, v: Tensor, sinks: Tensor | None, group: str, ring_group: str,
    q_heads: int, kv_heads: int, u: int, rank: int, order: list[int] | None, chunks_per_rank: int, head_chunks: int,
    causal: bool, scale: float, sharding: str, overlap: bool, inner_head_chunks: int, window: int | None,
    cu_seqlens: list[int] | None, chunk_size: int | None, softcap: float | None, dkv_wire_dtype: str,
    documents: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """dq, dk, dv (sequence layout, input dtypes) and the sinks' gradient (``(q_heads,)``; empty without
    sinks). ``k``, ``v``: the forward's inputs, for their shapes only."""
    opts = _options(causal, scale, sharding, overlap, inner_head_chunks, window, cu_seqlens, chunk_size, softcap,
                    dkv_wire_dtype, documents, k.shape[2] * _ulysses_world(group, ring_group))
    plan = _ulysses_plan(opts, q_heads, kv_heads, u, rank, order, chunks_per_rank, head_chunks)
    chunks = [saved[i:i + 5] for i in range(0, len(saved), 5)]
    dq, dk, dv, dsinks = ulysses_backward(dout, chunks, k.shape, group_by_name(group), _ring(ring_group), plan, sinks,
                                          v_head_dim=v.shape[-1])
    dq = dq if dq.stride() == output_like(dout, k.shape[3]).stride() else output_like(dout, k.shape[3]).copy_(dq)
    return dq, dk.contiguous(), dv.contiguous(), dsinks if dsinks is not None else dout.new_empty((0,))


@ulysses_bwd.register_fake
def _(dout, saved, k, v, sinks, group, ring_group, q_heads, kv_heads, u, rank, order, chunks_per_rank,  # noqa: ANN001, ANN202
      head_chunks, causal, scale, sharding, overlap, inner_head_chunks, window, cu_seqlens, chunk_size, softcap, dkv_wire_dtype,
      documents):
    dsinks = torch.empty_like(sinks) if sinks is not None else dout.new_empty((0,))
    return (output_like(dout, k.shape[3]), k.new_empty(k.shape), v.new_empty(v.shape), dsinks)


def _ulysses_setup(ctx, inputs, output) -> None:  # noqa: ANN001
    q, k, v, sinks, *rest, documents = inputs
    out, saved = output
    ctx.save_for_backward(k, v, sinks, documents, *saved)
    ctx.rest = rest


def _ulysses_backward(ctx, dout: Tensor, dsaved: list[Tensor] | None):  # noqa: ANN001, ANN202
    k, v, sinks, documents, *saved = ctx.saved_tensors
    dq, dk, dv, dsinks = ulysses_bwd(dout, saved, k, v, sinks, *ctx.rest, documents)
    return dq, dk, dv, (dsinks if sinks is not None else None), *([None] * (len(ctx.rest) + 1))


ulysses_fwd.register_autograd(_ulysses_backward, setup_context=_ulysses_setup)


REFUSALS = {"ValueError": ValueError, "TypeError": TypeError, "ConfigError": ConfigError}
"""The exception types :func:`refused_output` defers to :func:`refusal` (by name: an op takes primitives), each
raised as itself: a ConfigError stays one (``except seqpar.ConfigError`` catches it compiled as in eager). Not
:class:`~seqpar.attn.checks.CompileOnlyRefusal`, nor any other subclass: see :func:`refused_output`."""


@torch.library.custom_op("seqpar::refusal", mutates_args=())
def refusal(q: Tensor, v: Tensor, kind: str, message: str) -> Tensor:
    """Raise ``REFUSALS[kind](message)``: a refusal found while dynamo traced a call, raised when the graph runs."""
    raise REFUSALS[kind](message)


@refusal.register_fake
def _(q, v, kind, message):  # noqa: ANN001, ANN202
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


def _no_gradient(ctx, grad: Tensor) -> tuple[None, None, None, None]:  # noqa: ANN001
    return None, None, None, None  # never reached: the forward raises


refusal.register_autograd(_no_gradient)


def refused_output(q: object, v: object, error: Exception) -> Tensor | None:
    """While dynamo traces a call that ``error`` refuses: a stand-in for the call's output, ``q``'s shape with ``v``'s
    head dim (in ``q``'s layout, as the call's own), made by :func:`refusal`, which raises ``error`` (its type and
    text) when the compiled graph runs. None otherwise (the caller re-raises).

    Why: under ``torch.compile(fullgraph=True)`` an exception raised while dynamo traces reaches the caller as
    dynamo's ``Unsupported: Observed exception``, the message only in its debug context; one caught in the traced
    code and raised by an op reaches it as eager's exception. So the option refusals (a bad mode, layout or
    sharding name, ``dkv_wire_dtype``, ``softcap``, ALiBi's slopes or ALiBi with softcap/sinks, balanced sharding
    with a tensor ``cu_seqlens``) raise as eager's under fullgraph. Deferred: the exact types of :data:`REFUSALS`
    (a ConfigError too). Not deferred: a :class:`~seqpar.attn.checks.CompileOnlyRefusal` (eager runs that call:
    without fullgraph dynamo falls back to it) and any other subclass. A message must not format a symbolic size
    (dynamo cannot build it: "BUILD_STRING type error"): seqpar's format them through
    :func:`seqpar.attn.checks.shown`."""
    if not (torch.compiler.is_compiling() and isinstance(q, Tensor) and isinstance(v, Tensor)
            and q.dim() > 0 and v.dim() > 0):
        return None
    # by identity over the table, not type(error).__name__: dynamo before torch 2.13 cannot hash that name
    kind = next((name for name, cls in REFUSALS.items() if type(error) is cls), None)
    if kind is None:
        return None
    # one str argument (every seqpar refusal): read it, as str() of a subclass (ConfigError) is C code dynamo
    # cannot trace before torch 2.13
    one = error.args[0] if len(error.args) == 1 else None
    return refusal(q, v, kind, one if isinstance(one, str) else str(error))


def defer_refusals(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """An attention entry ``fn(q, k, v, ...) -> output`` whose ValueError / TypeError found while dynamo traces it
    is raised when the graph runs, by :func:`refused_output` (eager: raised as it is). Used on
    :func:`seqpar.attention` and :func:`seqpar.attn.dilated.dilated_attention`."""

    @functools.wraps(fn)
    def entry(q: Tensor, k: Tensor, v: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        try:
            return fn(q, k, v, *args, **kwargs)
        except (ValueError, TypeError) as e:
            out = refused_output(q, v, e)
            if out is None:
                raise
            return out

    return entry


def compiled_attention(algorithm: str, group: dist.ProcessGroup | None, opts: AttentionOptions, q: Tensor, k: Tensor,
                       v: Tensor, sinks: Tensor | None, *, ulysses: UlyssesPlan | None = None,
                       ring_group: dist.ProcessGroup | None = None, documents: Tensor | None = None) -> Tensor:
    """One resolved call of ``algorithm`` (one of :data:`OP_ALGORITHMS`) as a custom op; q, k, v ``bhsd``.
    Ulysses and hybrid: ``group`` the Ulysses group, ``ulysses`` the call's plan, ``ring_group`` the ring
    across super-ranks (hybrid; None for Ulysses). ``documents``: the global document boundaries as a 1-D
    int tensor (then ``opts.cu_seqlens`` is None), read inside the op (see the module). Returns the output
    ``(batch, q_heads, seq_local, v_head_dim)`` in q's dtype."""
    if algorithm not in OP_ALGORITHMS:
        raise ValueError(f"compiled_attention: algorithm {algorithm!r} is not one of {OP_ALGORITHMS}")
    if algorithm in ("ulysses", "hybrid"):
        if ulysses is None:
            raise ValueError(f"compiled_attention: {algorithm!r} needs its UlyssesPlan (ulysses=)")
        out, _ = ulysses_fwd(q, k, v, sinks, group_name(group), group_name(ring_group), *_plan_args(ulysses),
                             *_flat(ulysses.attn), documents)
        return out
    out, _ = attention_fwd(q, k, v, sinks, algorithm, group_name(group), *_flat(opts), documents)
    return out
