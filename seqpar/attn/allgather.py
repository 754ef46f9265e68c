"""All-gather attention (the Llama-3 style): gather K/V from the SP group, attend locally.

The heads are processed in ``opts.head_chunks`` chunks (GQA-consistent, see
:func:`seqpar.attn.plan.head_chunk_slices`), each an independent attention problem, run as a
software pipeline so that every collective but the first is in flight while a chunk computes:

- Forward: one all-gather of chunk c's K and V (packed into one buffer) starts while chunk c-1's
  remote blocks are computed (chunk 0's while its own block is); then chunk c attends to its own
  block and to the other ranks' blocks (causal blocks in the future skipped, as in the ring).
- Backward: the gathered K/V are not kept from the forward — holding them would cost O(S) per layer
  until backward — so each chunk is gathered again, one chunk ahead of the compute. Each chunk's
  fp32 dK/dV shares of every rank's block are written into one buffer and reduce-scattered to their
  owners (the dual of the gather) while the next chunk computes; the last chunk's scatter hides
  behind its own block, whose share is added once the scatter is done.

Volume per rank, the same for every chunk count (G collectives of 1/G of it each way): forward
(P-1) K/V blocks; backward (P-1) K/V blocks plus (P-1) fp32 dK/dV blocks. Collectives: forward one
all-gather per chunk; backward one all-gather and one reduce-scatter per chunk.

Memory: O(S) per layer, transiently, but only about two chunks' worth: at a backward kernel the
gathered K/V of chunks c and c+1 and the fp32 dK/dV shares of chunks c and c-1 (in flight), i.e.
4 P (K + K32) / G against 2 P (K + K32) unchunked (K, K32: one rank's K block in the input dtype /
fp32). So G = 2 holds as much at a kernel as G = 1 (it saves on the scatters' transients) and
G = 4 halves it. On gloo a reduce-scatter is an all-reduce of a clone of its input: a second copy
of the chunk's dK/dV buffer exists while a scatter is in flight.

Layouts: q ``(batch, q_heads, seq_local, head_dim)``, k ``(batch, kv_heads, seq_local, head_dim)``, v
``(batch, kv_heads, seq_local, v_head_dim)`` (V's head dim may differ: MLA). Per chunk, the gathered
K/V is ``(P, n)``: slot p holds rank p's K ``(batch, kv_heads / G, seq_local, head_dim)`` then its V,
packed (for equal head dims the same memory as a ``(P, 2, batch, kv_heads / G, seq_local, head_dim)``
stack), and so is the dK/dV buffer that is reduce-scattered.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from seqpar.attn.common import (
    AttentionOptions,
    BlockExpander,
    backward_pieces,
    block_calls,
    block_grads,
    forward_block,
    function_backward,
    function_forward,
    packed_views,
)
from seqpar.attn.plan import BlockCall, head_chunk_slices
from seqpar.comm.compat import all_gather_into, reduce_scatter_into
from seqpar.comm.ring import Pending
from seqpar.kernels import Partials, add_sink, lse_dtype

__all__ = ["allgather_forward", "allgather_backward", "AllGatherAttention"]


def _start_gather(k: Tensor, v: Tensor, heads: slice, group: dist.ProcessGroup, world: int) -> Pending:
    """Start gathering heads ``heads`` of this rank's K ``(B, Hkv, L, Dk)`` and V ``(B, Hkv, L, Dv)`` in
    one collective.

    The send buffer packs them one after the other (a contiguous copy: head slices of a batch > 1
    are strided; for Dk == Dv the same memory as a ``(2, B, h, L, D)`` stack). ``wait()`` returns
    ``[k_all, v_all]``, ``(P, B, h, L, Dk)`` and ``(P, B, h, L, Dv)``, views of one buffer: K and V of
    SP rank p at ``k_all[p]``, ``v_all[p]``. A :class:`Pending`, so that waiting is timed like the
    ring's transfers."""
    k_h, v_h = k[:, heads], v[:, heads]
    kv = k.new_empty(k_h.numel() + v_h.numel())
    for dst, src in zip(packed_views(kv, k_h.shape, v_h.shape), (k_h, v_h)):
        dst.copy_(src)
    out = torch.empty(world * kv.shape[0], dtype=kv.dtype, device=kv.device)
    work = all_gather_into(out, kv, group=group, async_op=True)
    return Pending(work.wait, packed_views(out.view(world, -1), k_h.shape, v_h.shape))


def _start_scatter(dkv_all: Tensor, k_shape: torch.Size, v_shape: torch.Size, group: dist.ProcessGroup) -> Pending:
    """Start summing ``dkv_all`` ``(P, n)`` (slot p: rank p's dK then dV, packed) over the ranks, slot p
    to rank p, in one collective; ``wait()`` returns ``[dk, dv]``, this rank's ``k_shape`` / ``v_shape``
    sums (views of one buffer)."""
    dkv = torch.empty(dkv_all.shape[1:], dtype=dkv_all.dtype, device=dkv_all.device)
    work = reduce_scatter_into(dkv, dkv_all.view(-1), group=group, async_op=True)
    reading = [dkv_all]  # the collective reads it until done: referenced (and counted) until the wait

    def wait() -> None:
        work.wait()
        reading.clear()

    return Pending(wait, packed_views(dkv, k_shape, v_shape))


def _grads_into(
    dk_slot: Tensor, dv_slot: Tensor, dout: Tensor, q: Tensor, k_blk: Tensor, v_blk: Tensor, out: Tensor,
    lse: Tensor, calls: tuple[BlockCall, ...], opts: AttentionOptions, dq_acc: Tensor,
) -> None:
    """Add one K/V block's dq share into ``dq_acc`` and write its fp32 dK and dV shares into ``dk_slot``
    ``(B, h, L, Dk)`` and ``dv_slot`` ``(B, h, L, Dv)``, overwriting them.

    When no two kernel calls share a key row (every plan of the contiguous and zigzag shardings: one
    call over all key rows, one over the half of them this rank's queries see, or none), each call's
    outputs are copied in as they are and only the rows no call reaches are zeroed: no zero-fill and
    add of the whole slot. Otherwise the slot is zeroed and accumulated into."""
    calls = sorted(calls, key=lambda c: c.k_rows.start)
    if any(a.k_rows.stop > b.k_rows.start for a, b in zip(calls, calls[1:])):
        dk_slot.zero_()
        dv_slot.zero_()
        block_grads(dout, q, k_blk, v_blk, out, lse, calls, opts.scale, dq_acc, dk_slot, dv_slot,
                    opts.softcap)
        return
    done = 0  # zero the key rows that no query of this rank sees
    for call in calls:
        for slot in (dk_slot, dv_slot):
            slot[:, :, done:call.k_rows.start].zero_()
        done = call.k_rows.stop
    for slot in (dk_slot, dv_slot):
        slot[:, :, done:].zero_()
    for call, dq, dk, dv in backward_pieces(dout, q, k_blk, v_blk, out, lse, calls, opts.scale, opts.softcap):
        qr, kr = call.q_rows, call.k_rows
        dq_acc[:, :, qr] += dq
        dk_slot[:, :, kr] = dk
        dv_slot[:, :, kr] = dv


def allgather_forward(
    q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup, opts: AttentionOptions, sinks: Tensor | None = None,
    expander: BlockExpander | None = None,
) -> tuple[Tensor, Tensor]:
    """Returns the ``out`` accumulator ``(batch, q_heads, seq_local, v_head_dim)`` and ``lse``
    ``(batch, q_heads, seq_local)``, both fp32 (fp64 for fp64 inputs); ``sinks``: optional
    ``(q_heads,)`` sink logits, one more term of every row's softmax. ``expander``: ``k``, ``v`` are
    a compressed form of the blocks (MLA's latent, one "head") that is gathered instead of K/V and
    expanded before each block's kernels (then ``opts.head_chunks`` must be 1)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    acc_dtype = lse_dtype(q.dtype)
    v_dim = v.shape[-1] if expander is None else expander.v_head_dim
    out = torch.empty((*q.shape[:-1], v_dim), dtype=acc_dtype, device=q.device)
    lse = torch.empty(q.shape[:-1], dtype=acc_dtype, device=q.device)
    heads = head_chunk_slices(q.shape[1], k.shape[1], opts.head_chunks)

    def attend(src: int, qs: slice, k_blk: Tensor, v_blk: Tensor, acc: Partials) -> None:
        calls = block_calls(opts, world, rank, src, q.shape[2])
        if expander is not None:
            k_blk, v_blk = expander.expand(k_blk, v_blk)
        forward_block(q[:, qs], k_blk, v_blk, calls, opts.scale, acc, opts.softcap)

    pending: Pending | None = _start_gather(k, v, heads[0][1], group, world)
    for c, (qs, ks) in enumerate(heads):
        acc = Partials(out[:, qs], lse[:, qs])  # this chunk's heads (views)
        attend(rank, qs, k[:, ks], v[:, ks], acc)  # needs no communication: hides the gather in flight
        k_all, v_all = pending.wait()
        # the next chunk's gather hides behind this chunk's remote blocks; dropping the waited
        # Pending leaves k_all / v_all as the only references, so they are freed with the del below
        pending = _start_gather(k, v, heads[c + 1][1], group, world) if c + 1 < len(heads) else None
        for src in range(world):
            if src != rank:
                attend(src, qs, k_all[src], v_all[src], acc)
        del k_all, v_all  # before the next chunk's buffer arrives: two chunks live at most
        acc.finish()
    if sinks is not None:
        add_sink(out, lse, sinks)
    return out, lse


def allgather_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    group: dist.ProcessGroup, opts: AttentionOptions, expander: BlockExpander | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv in the input dtypes; dq is accumulated in fp32 (fp64), and the dK/dV shares are
    summed across ranks in that dtype. ``out`` is the forward output (input dtype), ``lse`` its fp32
    log-sum-exp.

    Per chunk c of G, into one fp32 ``(P, n)`` buffer of dK|dV shares (slot p: rank p's block, dK
    ``(B, h, L, Dk)`` then dV ``(B, h, L, Dv)`` packed): the own block's share first (no communication: it hides the gather in flight), then wait
    for c's K/V, start gathering c+1's, the remote blocks' shares; then wait for chunk c-1's scatter
    (it ran while c computed) and start c's. The last chunk computes its own block after starting
    its scatter instead, to hide it (own slot zeroed, share added after the wait); with G = 1 this
    leaves the backward's one gather exposed, as before chunking."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    acc = lse_dtype(q.dtype)
    heads = head_chunk_slices(q.shape[1], k.shape[1], opts.head_chunks)
    dout = dout.contiguous()
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk: Tensor | None = None  # in the input dtype, filled chunk by chunk
    dv: Tensor | None = None

    def grads_into(dkv_slot: Tensor, src: int, qs: slice, ks: slice, k_blk: Tensor, v_blk: Tensor) -> None:
        dk_slot, dv_slot = packed_views(dkv_slot, k[:, ks].shape, v[:, ks].shape)
        calls = block_calls(opts, world, rank, src, q.shape[2])
        if expander is None:
            _grads_into(dk_slot, dv_slot, dout[:, qs], q[:, qs], k_blk, v_blk, out[:, qs], lse[:, qs],
                        calls, opts, dq[:, qs])
            return
        # expanded shares first (fp32), then reduced to the compressed block's into the slot
        k_e, v_e = expander.expand(k_blk, v_blk)
        dk_e = torch.empty(k_e.shape, dtype=acc, device=k_e.device)
        dv_e = torch.empty(v_e.shape, dtype=acc, device=v_e.device)
        _grads_into(dk_e, dv_e, dout[:, qs], q[:, qs], k_e, v_e, out[:, qs], lse[:, qs], calls, opts, dq[:, qs])
        del k_e, v_e
        dc, dr = expander.reduce(k_blk, v_blk, dk_e, dv_e)
        dk_slot.copy_(dc)
        dv_slot.copy_(dr)

    def finish(dk_c: Tensor, dv_c: Tensor, ks: slice) -> None:
        """A chunk's reduced dK ``(B, h, L, Dk)`` and dV ``(B, h, L, Dv)`` into its heads of dk, dv (cast here)."""
        nonlocal dk, dv
        if dk is None:  # allocated late: with one chunk, once the gathered buffers are gone
            dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
            dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
        dk[:, ks] = dk_c
        dv[:, ks] = dv_c

    gather: Pending | None = _start_gather(k, v, heads[0][1], group, world)
    scatter: tuple[Pending, slice] | None = None  # the previous chunk's, in flight
    for c, (qs, ks) in enumerate(heads):
        last = c + 1 == len(heads)
        k_c, v_c = k[:, ks], v[:, ks]
        dkv_all = torch.empty((world, k_c.numel() + v_c.numel()), dtype=acc, device=k.device)  # (P, n)
        if not last:  # own block first: no communication, hides the gather in flight
            grads_into(dkv_all[rank], rank, qs, ks, k_c, v_c)
        k_all, v_all = gather.wait()
        # the next chunk's K/V arrive while this chunk computes (None: free k_all, v_all on del)
        gather = None if last else _start_gather(k, v, heads[c + 1][1], group, world)
        for src in range(world):
            if src != rank:
                grads_into(dkv_all[src], src, qs, ks, k_all[src], v_all[src])
        del k_all, v_all
        if last:
            dkv_all[rank].zero_()  # the own share is added after the scatter
        if scatter is not None:  # chunk c-1's, reduced while this chunk computed
            finish(*scatter[0].wait(), scatter[1])
        scatter = (_start_scatter(dkv_all, k_c.shape, v_c.shape, group), ks)
        del dkv_all  # the scatter holds it until waited

    # the last chunk's own block, while its scatter is in flight
    qs, ks = heads[-1]
    k_c, v_c = k[:, ks], v[:, ks]
    dkv_own = torch.empty(k_c.numel() + v_c.numel(), dtype=acc, device=k.device)  # dK | dV packed
    grads_into(dkv_own, rank, qs, ks, k_c, v_c)
    dk_in, dv_in = scatter[0].wait()
    del scatter  # frees the last chunk's dK/dV of all ranks
    dk_own, dv_own = packed_views(dkv_own, k_c.shape, v_c.shape)
    dk_in += dk_own
    dv_in += dv_own
    del dkv_own, dk_own, dv_own
    finish(dk_in, dv_in, ks)
    del dk_in, dv_in
    return dq.to(q.dtype), dk, dv


class AllGatherAttention(torch.autograd.Function):
    """Exact attention by all-gathered K/V, head chunk by head chunk; backward re-gathers and
    reduce-scatters dK/dV (the dual of the forward's all-gather). ``sinks`` ``(q_heads,)`` (or None)
    gets this rank's share of its gradient (its rows' terms), like any replicated weight."""

    @staticmethod
    def forward(  # noqa: ANN001
        ctx, q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup, opts: AttentionOptions,
        sinks: Tensor | None = None,
    ) -> Tensor:
        return function_forward(ctx, allgather_forward, q, k, v, group, opts, sinks)

    @staticmethod
    def backward(ctx, dout: Tensor):  # noqa: ANN001, ANN205
        return function_backward(ctx, allgather_backward, dout)
