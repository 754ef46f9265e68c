"""Ulysses attention: an all-to-all turns sequence shards into head shards, attention runs on the whole
sequence for ``1/u`` of the heads, and a second all-to-all turns the output back into sequence shards.

Rank j of a Ulysses group of ``u`` ranks receives, from every member, that member's tokens of

- query heads ``[j * Hq/u, (j+1) * Hq/u)`` (when ``u`` divides ``Hq``), and
- the K/V heads those query heads read, and no others: ``Hkv/u`` of them when ``u`` divides ``Hkv``;
  when ``Hkv < u`` (GQA/MQA with few K/V heads) the single K/V head ``j * Hkv // u``, so each K/V head
  is replicated on ``u / Hkv`` ranks — the minimum — and never expanded to the query head count.

Uneven heads (``u`` does not divide ``Hq``, or ``Hkv`` is neither a multiple nor a divisor of ``u``; as
DeepSpeed's ``DistributedAttention`` >= 0.15 accepts): rank j attends a contiguous range of query heads,
the sizes differing by at most one and the first ``Hq % u`` ranks taking the larger share (14 heads on 4
ranks: 4, 4, 3, 3), and the K/V heads those read (their union; a K/V head may then live on two ranks, and
its dK/dV is summed over them in fp32). K/V is never expanded. The four all-to-alls carry per-peer sizes
(``all_to_all_single`` with split sizes, :func:`seqpar.comm.alltoall.start_all_to_all_uneven`): what goes
to peer j is sized by j's share, what comes from every peer by this rank's. A rank's heads run as
GQA-regular pieces (:meth:`HeadSplit.segments`: a K/V head only partly read here is its own piece), and
in one head pass (``head_chunks`` is taken as 1: the shares differ, so equal passes would not line up).
Bytes: rank r's q/k/v buffer is ``sum_j L (q_j + 2 kv_j) d`` and its output buffer ``u L q_r d`` (its own
slot included; the backward the same again, reversed); no rank receives more than
``(u - 1) L (ceil(Hq/u) + 2 kv_max) d`` per direction, ``kv_max`` the largest K/V union: for MHA at 14
heads on 4 ranks what 16 heads cost. The even path is unchanged (equal slots, no
split sizes, pipelined head chunks). Refused by name: fewer query heads than ranks (a rank would attend
none) and query heads that are no multiple of the K/V heads.

One all-to-all carries q, k and v together (packed into one buffer ``(u, batch, hq + 2 hkv, seq_local,
head_dim)``), and one carries dq, dk and dv back in the backward (dK/dV of a replicated K/V head are
summed over its replicas on arrival, in fp32). The output and the incoming gradient take one all-to-all
each. DeepSpeed's Ulysses issues one all-to-all per tensor.

Sequence order: after the all-to-all a rank holds its group's shards in rank order; they are put into
ascending global chunk order (for zigzag, the ``u`` first halves then the ``u`` second halves reversed),
so causal masking over the local concatenation is the global one. In a hybrid (:mod:`.hybrid`), the
``P/u`` Ulysses groups of consecutive ranks are "super-ranks" whose sorted chunks are again a valid
contiguous / zigzag sharding over ``P/u`` (super-rank g holds super-chunks g and 2P/u-1-g of u chunks
each), so the ring code runs across them unchanged.

Overlap: the heads are processed in ``head_chunks`` chunks (of each rank's share), pipelined: chunk
c+1's q/k/v all-to-all is in flight while chunk c computes, and chunk c's output all-to-all while
chunk c+1 computes. The backward does the same with dout and the packed dq/dk/dv.

Volume per rank (``L = S/P`` tokens, ``h_kv`` = K/V heads received per rank, ``max(Hkv/u, 1)``): forward
``(u-1)/u * L * (Hq + 2 u h_kv) * d`` for q/k/v plus ``(u-1)/u * L * Hq * d`` for the output; the backward
the same again (dout, then dq/dk/dv).

Documents, windows and sinks (``opts.cu_seqlens``, ``opts.window``, ``sinks``): after the all-to-all a
Ulysses rank holds the whole sequence in ascending global order for its heads, so the inner attention is
the ring code on a single rank (:class:`~seqpar.attn.common.SingleRank`) whose one "chunk" is the
whole sequence: the mask planner maps its rows to global positions, no mask tensor, no exchange. Any
sharding works, ``balanced`` included (its chunks, sorted, are again the whole sequence). In a hybrid
the super-ranks run the masked ring across them (contiguous / zigzag over ``P/u``; not ``balanced``,
whose super-rank chunks are no ``P/u``-rank layout). Sinks are per query head: each rank adds the
sinks of its own head slice, and returns the full gradient of those heads (it holds all their rows,
or in a hybrid all its super-rank's rows) and 0 for the others, so the usual sum over ranks of a
replicated weight's gradient is the exact one.

Layouts: q ``(batch, q_heads, seq_local, head_dim)``, k/v ``(batch, kv_heads, seq_local, head_dim)``;
head layout ``(batch, heads / u, u * seq_local, head_dim)`` in sorted sequence order.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import Tensor

from seqpar.attn.common import AttentionOptions, SingleRank, packed_views, rank_chunks
from seqpar.attn.ring import ring_backward, ring_forward
from seqpar.comm.alltoall import start_all_to_all, start_all_to_all_uneven
from seqpar.comm.ring import Pending, RingExchange
from seqpar.kernels import block_backward, block_forward, lse_dtype, output_like, sink_grad
from seqpar.runtime.grid import (
    divisors,
    ulysses_heads_ok,
    ulysses_heads_problem,
    ulysses_shares,
    ulysses_split_even,
)
from seqpar.sequence.sharding import chunk_ids

__all__ = ["HeadSplit", "head_split", "sequence_order", "UlyssesPlan", "UlyssesAttention"]


@dataclass(frozen=True)
class HeadSplit:
    """Which heads each rank of a Ulysses group of ``u`` ranks attends: an even split
    (:func:`~seqpar.runtime.grid.ulysses_split_even`) or uneven contiguous shares (:meth:`share`)."""

    q_heads: int
    kv_heads: int
    u: int

    @property
    def even(self) -> bool:
        return ulysses_split_even(self.q_heads, self.kv_heads, self.u)

    @property
    def q_per_rank(self) -> int:
        """Query heads per rank: ``Hq/u`` (even); uneven: the largest share, ``ceil(Hq/u)``."""
        return -(-self.q_heads // self.u)

    @property
    def kv_per_rank(self) -> int:
        """K/V heads per rank: ``Hkv/u``, or 1 when ``Hkv < u`` (replicated ``u/Hkv`` times); uneven: the
        largest rank's union of K/V heads."""
        if self.even:
            return max(self.kv_heads // self.u, 1)
        return max(share[3] for share in ulysses_shares(self.q_heads, self.kv_heads, self.u))

    @property
    def replicated(self) -> bool:
        return self.kv_heads < self.u

    def share(self, rank: int) -> tuple[int, int, int, int]:
        """``(q_first, q_count, kv_first, kv_count)`` of rank ``rank``
        (:func:`~seqpar.runtime.grid.ulysses_shares`)."""
        return ulysses_shares(self.q_heads, self.kv_heads, self.u)[rank]

    def counts(self, rank: int, chunks: int) -> tuple[int, int]:
        """Query and K/V heads rank ``rank`` attends per head chunk (``chunks`` is 1 when uneven)."""
        if self.even:
            return self.q_per_rank // chunks, self.kv_per_rank // chunks
        return self.share(rank)[1], self.share(rank)[3]

    def kv_index(self, rank: int, chunk: int, chunks: int) -> list[int]:
        """Global K/V heads rank ``rank`` receives for head chunk ``chunk`` of ``chunks`` (even split)."""
        kc = self.kv_per_rank // chunks
        first = rank * self.kv_heads // self.u + chunk * kc
        return list(range(first, first + kc))

    def segments(self, rank: int) -> list[tuple[int, int, int, int]]:
        """Uneven split: rank ``rank``'s local heads as GQA-regular pieces ``(q_first, q_count, kv_first,
        kv_count)`` (local indices) in order, covering its query and K/V heads once each. Within a piece,
        local query head i reads local K/V head ``i // (q_count / kv_count)``, the kernels' GQA rule;
        a K/V head only partly read here (it is shared with a neighbour rank) is a piece of its own, the
        K/V heads read by all ``Hq/Hkv`` of their query heads are one piece together."""
        q_first, q_count, kv_first, kv_count = self.share(rank)
        group = self.q_heads // self.kv_heads
        pieces: list[tuple[int, int, int, int]] = []
        for t in range(kv_count):
            lo = max(q_first, (kv_first + t) * group) - q_first
            hi = min(q_first + q_count, (kv_first + t + 1) * group) - q_first
            if pieces and hi - lo == group and pieces[-1][1] == group * pieces[-1][3]:
                a, n, b, m = pieces[-1]
                pieces[-1] = (a, n + group, b, m + 1)  # full groups run together
            else:
                pieces.append((lo, hi - lo, t, 1))
        return pieces


def head_split(q_heads: int, kv_heads: int, u: int, *, sp_size: int, mode: str, tp: int = 1) -> HeadSplit:
    """Validate that ``u`` ranks can share the heads (the rules are
    :func:`seqpar.runtime.grid.ulysses_heads_ok` / ``ulysses_heads_problem``, the cost model's too); raise
    ``ValueError`` naming the fix otherwise. Uneven shares are accepted (:class:`HeadSplit`). ``q_heads`` /
    ``kv_heads`` are the heads this rank holds: under tensor parallelism (``tp`` > 1, only named in the
    error) the model's heads / ``tp``."""
    if ulysses_heads_ok(q_heads, kv_heads, u):  # even: the common case, one check
        return HeadSplit(q_heads, kv_heads, u)
    problem = ulysses_heads_problem(q_heads, kv_heads, u)
    if problem is None:
        return HeadSplit(q_heads, kv_heads, u)
    fits = [d for d in divisors(sp_size) if ulysses_heads_problem(q_heads, kv_heads, d) is None and d < u]
    tp_note = (f" These are the heads tensor parallelism leaves this rank (the model's heads / tp_size {tp}); "
               "a smaller tp_size leaves each rank more." if tp > 1 else "")
    raise ValueError(
        f"mode={mode!r}: {q_heads} query / {kv_heads} K/V heads cannot be split over {u} Ulysses ranks: {problem}. "
        f"Use mode='hybrid' with a smaller ulysses_size (init_process_groups(sp_size={sp_size}, ulysses_size=u) "
        f"with u in {fits}), or mode='ring' / 'allgather'." + tp_note
    )


def sequence_order(
    first: int, u: int, world: int, sharding: str, *, seq_len: int | None = None,
    cu_seqlens: tuple[int, ...] | None = None,
) -> list[int] | None:
    """The local order that puts the chunks of SP ranks ``first .. first+u-1`` (concatenated in rank order,
    each holding ``chunk_ids(rank, world, sharding)``) into ascending global order; ``None`` if they
    already are. Entry m is the rank-order slot of the m-th smallest chunk. ``seq_len`` and
    ``cu_seqlens``: for ``sharding="balanced"``, whose layout depends on them."""
    ids = [c for r in range(first, first + u) for c in chunk_ids(r, world, sharding, seq_len=seq_len,
                                                                  cu_seqlens=cu_seqlens)]
    order = sorted(range(len(ids)), key=ids.__getitem__)
    return None if order == list(range(len(ids))) else order


@dataclass(frozen=True)
class UlyssesPlan:
    """Static description of one Ulysses (or hybrid) call; the same on every rank of a Ulysses group.

    ``order``: :func:`sequence_order` (``None`` = identity); ``chunks_per_rank``:
    sequence chunks each rank holds (1 contiguous, 2 zigzag); ``head_chunks``: pipelined head passes,
    dividing ``split.kv_per_rank``; always 1 for an uneven split (its ranks' shares differ, so equal
    passes would not line up across ranks: the whole share runs in one pass, whatever was asked)."""

    attn: AttentionOptions
    split: HeadSplit
    rank: int  # in the Ulysses group
    order: tuple[int, ...] | None
    chunks_per_rank: int
    head_chunks: int

    @classmethod
    def make(
        cls, attn: AttentionOptions, split: HeadSplit, *, rank: int, first: int, sp_size: int, head_chunks: int,
        seq_local: int,
    ) -> UlyssesPlan:
        seq_len = seq_local * sp_size if attn.sharding == "balanced" else None
        order = sequence_order(first, split.u, sp_size, attn.sharding, seq_len=seq_len, cu_seqlens=attn.cu_seqlens)
        return cls(
            attn, split, rank, None if order is None else tuple(order),
            len(rank_chunks(attn, sp_size, 0, seq_local)), head_chunks if split.even else 1,
        )

    def q_slice(self, rank: int, chunk: int) -> slice:
        if not self.split.even:
            first, count = self.split.share(rank)[:2]
            return slice(first, first + count)
        qc = self.split.q_per_rank // self.head_chunks
        first = rank * self.split.q_per_rank + chunk * qc
        return slice(first, first + qc)


# ------------------------------------------------------------------------------ layout changes
def _sorted_runs(plan: UlyssesPlan) -> list[tuple[int, int, int]]:
    """``(m, rank, chunk)`` for every m: the m-th smallest chunk is chunk ``chunk`` of rank-order slot ``rank``."""
    c = plan.chunks_per_rank
    return [(m, slot // c, slot % c) for m, slot in enumerate(plan.order)]  # type: ignore[arg-type]


def seq_to_heads(x: Tensor, plan: UlyssesPlan) -> Tensor:
    """Received slots ``(u, B, h, L, D)`` (slot i = rank i's tokens) -> ``(B, h, u * L, D)`` in ascending
    global order (one copy: a permute, or one slice copy per chunk for a reordered sharding)."""
    u, b, h, n, d = x.shape
    if plan.order is None:
        return x.permute(1, 2, 0, 3, 4).reshape(b, h, u * n, d)
    clen = n // plan.chunks_per_rank
    out = x.new_empty((b, h, u * n, d))
    for m, r, c in _sorted_runs(plan):  # plain strided copies: cheaper than an index gather
        out.narrow(2, m * clen, clen).copy_(x[r].narrow(2, c * clen, clen))
    return out


def _heads_to_slots(x: Tensor, out: Tensor, plan: UlyssesPlan) -> None:
    """``x`` ``(B, h, u * L, D)`` in ascending order -> ``out`` ``(u, B, h, L, D)`` (slot j = rank j's
    tokens), written in place (one copy)."""
    u, b, h, n, d = out.shape
    if plan.order is None:
        out.copy_(x.reshape(b, h, u, n, d).permute(2, 0, 1, 3, 4))
        return
    clen = n // plan.chunks_per_rank
    for m, r, c in _sorted_runs(plan):
        out[r].narrow(2, c * clen, clen).copy_(x.narrow(2, m * clen, clen))


def _qkv_views(buf: Tensor, plan: UlyssesPlan, n: int, dk: int, dv: int) -> list[Tensor]:
    """The q, k, v parts ``(u, B, qc, n, dk)``, ``(u, B, kc, n, dk)``, ``(u, B, kc, n, dv)`` of a packed
    ``(u, B, m)`` all-to-all buffer (for dk == dv the same memory as ``(u, B, qc + 2 kc, n, d)``)."""
    hc = plan.head_chunks
    qc, kc = plan.split.q_per_rank // hc, plan.split.kv_per_rank // hc
    return packed_views(buf, (qc, n, dk), (kc, n, dk), (kc, n, dv))


def start_qkv(q: Tensor, k: Tensor, v: Tensor, chunk: int, plan: UlyssesPlan, group: dist.ProcessGroup) -> Pending:
    """Pack chunk ``chunk`` of every rank's q/k/v heads into one ``(u, B, m)`` buffer (per slot and batch
    row: qc query heads, kc K heads, kc V heads, each ``(heads, L, head_dim)``; V's head dim may differ)
    and start its all-to-all."""
    u, hc = plan.split.u, plan.head_chunks
    qc, kc = plan.split.q_per_rank // hc, plan.split.kv_per_rank // hc
    b, _, n, d = q.shape
    dv = v.shape[-1]
    send = q.new_empty((u, b, (qc + kc) * n * d + kc * n * dv))
    send_q, send_k, send_v = _qkv_views(send, plan, n, d, dv)
    for j in range(u):
        send_q[j] = q[:, plan.q_slice(j, chunk)]
    if plan.split.replicated:  # rank j reads K/V head j * Hkv // u (repeats included): one copy per slot
        # (narrow, not an index tensor: building one from host ints is a blocking host-to-device copy)
        for j in range(u):
            first = plan.split.kv_index(j, chunk, hc)[0]
            send_k[j] = k.narrow(1, first, kc)
            send_v[j] = v.narrow(1, first, kc)
    else:  # rank j reads heads [j * Hkv/u, (j+1) * Hkv/u): a strided view, copied once into the buffer
        heads = slice(chunk * kc, (chunk + 1) * kc)
        send_k.copy_(k.view(b, u, plan.split.kv_per_rank, n, d)[:, :, heads].transpose(0, 1))
        send_v.copy_(v.view(b, u, plan.split.kv_per_rank, n, dv)[:, :, heads].transpose(0, 1))
    return start_all_to_all(send, group)


def start_heads_back(tensors: list[Tensor], plan: UlyssesPlan, group: dist.ProcessGroup) -> Pending:
    """Pack head-layout tensors ``(B, h_i, u * L, D_i)`` (one dtype; head dims may differ) into one
    ``(u, B, m)`` buffer (per slot and batch row: each tensor's ``(h_i, L, D_i)``, in order) and start
    the all-to-all that returns each rank its tokens."""
    return start_all_to_all(_pack_heads_back(tensors, plan), group)


def _pack_heads_back(tensors: list[Tensor], plan: UlyssesPlan) -> Tensor:
    """The ``(u, B, m)`` send buffer of :func:`start_heads_back` (slot j: rank j's tokens)."""
    b, _, n_all, _ = tensors[0].shape
    u, n = plan.split.u, n_all // plan.split.u
    send = tensors[0].new_empty((u, b, sum(t.shape[1] * n * t.shape[3] for t in tensors)))
    for t, slots in zip(tensors, packed_views(send, *((t.shape[1], n, t.shape[3]) for t in tensors))):
        _heads_to_slots(t, slots, plan)
    return send


# ------------------------------------------------------------------------------ uneven head shares
# Rank j attends query heads [q_first_j, +q_count_j) and K/V heads [kv_first_j, +kv_count_j)
# (HeadSplit.share). What a rank sends to peer j is sized by j's share, what it receives from every peer by
# its own: the q/k/v and dout all-to-alls send uneven slots and receive equal ones, the output and
# dq/dk/dv all-to-alls send equal slots and receive uneven ones (all_to_all_single with split sizes).
# One head pass (head_chunks = 1). Bytes per rank: sent = sum over peers of their shares, received =
# (u - 1) x its own share; the slowest rank holds ceil(Hq/u) query heads.
def _uneven_sizes(plan: UlyssesPlan, b: int, n: int, dims: tuple[int, ...], kv_dims: tuple[int, ...]) -> list[int]:
    """Elements per peer j of a buffer holding, per batch row, j's query heads at each of ``dims`` and
    its K/V heads at each of ``kv_dims`` (``n`` tokens each)."""
    sizes = []
    for j in range(plan.split.u):
        _, qn, _, kn = plan.split.share(j)
        sizes.append(b * n * (qn * sum(dims) + kn * sum(kv_dims)))
    return sizes


def _uneven_blocks(buf: Tensor, sizes: list[int], b: int) -> list[Tensor]:
    """Views ``(B, m_j)`` of the consecutive per-peer blocks of a flat buffer."""
    out, at = [], 0
    for size in sizes:
        out.append(buf.narrow(0, at, size).view(b, size // b))
        at += size
    return out


def _uneven_qkv(q: Tensor, k: Tensor, v: Tensor, plan: UlyssesPlan, group: dist.ProcessGroup) -> Pending:
    """Send peer j its query heads and the K/V heads they read, packed per batch row as
    :func:`start_qkv` packs them; receive ``u`` equal slots of this rank's share."""
    b, _, n, d = q.shape
    dv = v.shape[-1]
    send_sizes = _uneven_sizes(plan, b, n, (d,), (d, dv))
    send = q.new_empty(sum(send_sizes))
    for j, block in enumerate(_uneven_blocks(send, send_sizes, b)):
        qf, qn, kf, kn = plan.split.share(j)
        sq, sk, sv = packed_views(block, (qn, n, d), (kn, n, d), (kn, n, dv))
        sq.copy_(q.narrow(1, qf, qn))
        sk.copy_(k.narrow(1, kf, kn))
        sv.copy_(v.narrow(1, kf, kn))
    mine = send_sizes[plan.rank]
    return start_all_to_all_uneven(send, send_sizes, [mine] * plan.split.u, group)


def _uneven_pieces(
    fn, plan: UlyssesPlan, q_h: Tensor, k_h: Tensor, v_h: Tensor, *rest: Tensor  # noqa: ANN001
) -> list[tuple[Tensor, ...]]:
    """``fn`` on each GQA-regular piece of this rank's heads (:meth:`HeadSplit.segments`); ``rest``:
    tensors with query heads (dout, out, lse)."""
    results = []
    for a, qn, kf, kn in plan.split.segments(plan.rank):
        results.append(fn(q_h.narrow(1, a, qn), k_h.narrow(1, kf, kn), v_h.narrow(1, kf, kn),
                          *(t.narrow(1, a, qn) for t in rest), a, qn))
    return results


def _cat_heads(parts: list[Tensor]) -> Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def _uneven_forward(
    q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup, ring: RingExchange | None, plan: UlyssesPlan,
    sinks: Tensor | None,
) -> tuple[Tensor, list[tuple[Tensor, ...]]]:
    """:func:`ulysses_forward` for an uneven split (one head pass)."""
    b, _, n, d = q.shape
    dv = v.shape[-1]
    qf, qn, _, kn = plan.split.share(plan.rank)
    (recv,) = _uneven_qkv(q, k.contiguous(), v.contiguous(), plan, group).wait()
    recv_q, recv_k, recv_v = packed_views(recv.view(plan.split.u, b, -1), (qn, n, d), (kn, n, d), (kn, n, dv))
    q_h, k_h, v_h = seq_to_heads(recv_q, plan), seq_to_heads(recv_k, plan), seq_to_heads(recv_v, plan)
    del recv, recv_q, recv_k, recv_v
    my_sinks = None if sinks is None else sinks[qf:qf + qn]

    def piece(qp: Tensor, kp: Tensor, vp: Tensor, a: int, m: int) -> tuple[Tensor, Tensor]:
        return _inner_forward(qp, kp, vp, ring, plan.attn, None if my_sinks is None else my_sinks[a:a + m])

    outs, lses = zip(*_uneven_pieces(piece, plan, q_h, k_h, v_h))
    out_h, lse_h = _cat_heads(list(outs)), _cat_heads(list(lses))
    send = _pack_heads_back([out_h], plan).view(-1)  # u equal slots of this rank's heads
    recv_sizes = _uneven_sizes(plan, b, n, (dv,), ())
    (back,) = start_all_to_all_uneven(send, [send.numel() // plan.split.u] * plan.split.u, recv_sizes, group).wait()
    out = output_like(q, dv)
    for j, block in enumerate(_uneven_blocks(back, recv_sizes, b)):
        first, count = plan.split.share(j)[:2]
        out[:, first:first + count] = block.view(b, count, n, dv)
    return out, [(q_h, k_h, v_h, out_h, lse_h)]


def _uneven_backward(
    dout: Tensor, saved: list[tuple[Tensor, ...]], k_shape: torch.Size, v_shape: torch.Size,
    group: dist.ProcessGroup, ring: RingExchange | None, plan: UlyssesPlan, sinks: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """:func:`ulysses_backward` for an uneven split: dout's all-to-all (uneven sends), the inner backward per
    GQA-regular piece, the packed dq/dk/dv all-to-all (uneven receives). A K/V head shared by two ranks gets
    both ranks' dK/dV, summed in fp32 (every K/V head's gradient accumulates into zeroed fp32 ``dk``, ``dv``)."""
    b, _, n, dvd = dout.shape
    d = k_shape[3]
    u = plan.split.u
    qf, qn, _, kn = plan.split.share(plan.rank)
    send_sizes = _uneven_sizes(plan, b, n, (dvd,), ())
    dout = dout.contiguous()
    send = dout.new_empty(sum(send_sizes))
    for j, block in enumerate(_uneven_blocks(send, send_sizes, b)):
        first, count = plan.split.share(j)[:2]
        block.view(b, count, n, dvd).copy_(dout.narrow(1, first, count))
    (recv,) = start_all_to_all_uneven(send, send_sizes, [send_sizes[plan.rank]] * u, group).wait()
    dout_h = seq_to_heads(recv.view(u, b, qn, n, dvd), plan)
    del recv, send
    ((q_h, k_h, v_h, out_h, lse_h),) = saved
    dsinks = None
    if sinks is not None:
        dsinks = torch.zeros_like(sinks)
        dsinks[qf:qf + qn] = sink_grad(dout_h, out_h, lse_h, sinks[qf:qf + qn])

    def piece(qp: Tensor, kp: Tensor, vp: Tensor, dp: Tensor, op: Tensor, lp: Tensor, a: int, m: int) -> tuple:
        return _inner_backward(dp, qp, kp, vp, op, lp, ring, plan.attn)

    dqs, dks, dvs = zip(*_uneven_pieces(piece, plan, q_h, k_h, v_h, dout_h, out_h, lse_h))
    del dout_h
    dq_h = _cat_heads(list(dqs))
    send = _pack_heads_back([dq_h, _cat_heads(list(dks)).to(dq_h.dtype), _cat_heads(list(dvs)).to(dq_h.dtype)],
                            plan).view(-1)
    del dqs, dks, dvs, dq_h
    recv_sizes = _uneven_sizes(plan, b, n, (d,), (d, v_shape[3]))
    (back,) = start_all_to_all_uneven(send, [send.numel() // u] * u, recv_sizes, group).wait()
    dq = output_like(dout, d)
    dk = torch.zeros(k_shape, dtype=lse_dtype(dout.dtype), device=dout.device)
    dv = torch.zeros(v_shape, dtype=lse_dtype(dout.dtype), device=dout.device)
    for j, block in enumerate(_uneven_blocks(back, recv_sizes, b)):
        first, count, kf, kc = plan.split.share(j)
        gq, gk, gv = packed_views(block, (count, n, d), (kc, n, d), (kc, n, v_shape[3]))
        dq[:, first:first + count] = gq
        dk.narrow(1, kf, kc).add_(gk)
        dv.narrow(1, kf, kc).add_(gv)
    return dq, dk.to(dout.dtype), dv.to(dout.dtype), dsinks


# ------------------------------------------------------------------------------ inner attention
def _inner_ring(ring: RingExchange | None, opts: AttentionOptions) -> tuple[RingExchange, AttentionOptions]:
    """The ring the inner attention runs: across super-ranks, or (Ulysses) one rank whose single chunk
    is the whole sorted sequence, which the mask planner reads as global positions ``[0, S)``."""
    if ring is not None:
        return ring, opts
    return SingleRank(), replace(opts, sharding="contiguous")


def _inner_forward(
    q: Tensor, k: Tensor, v: Tensor, ring: RingExchange | None, opts: AttentionOptions, sinks: Tensor | None
) -> tuple[Tensor, Tensor]:
    """Attention over the (super-)rank's sorted sequence: local kernels, or the (masked) ring code
    across super-ranks or on the one rank. ``sinks``: this rank's heads' sink logits, or None."""
    if ring is None and opts.mask.dense and sinks is None:
        return block_forward(q, k, v, scale=opts.scale, causal=opts.causal, softcap=opts.softcap)
    comm, inner = _inner_ring(ring, opts)
    out_acc, lse = ring_forward(q, k, v, comm, inner, sinks)
    return out_acc.to(q.dtype), lse


def _inner_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, ring: RingExchange | None,
    opts: AttentionOptions,
) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv of the inner attention; ``lse`` includes the sinks, which is all their effect on these."""
    if ring is None and opts.mask.dense:
        return block_backward(dout, q, k, v, out, lse, scale=opts.scale, causal=opts.causal, softcap=opts.softcap)
    comm, inner = _inner_ring(ring, opts)
    return ring_backward(dout, q, k, v, out, lse, comm, inner)


# ------------------------------------------------------------------------------ forward / backward
def _chunk_sinks(sinks: Tensor | None, plan: UlyssesPlan, chunk: int) -> Tensor | None:
    """Sink logits of the query heads this rank attends in head chunk ``chunk``."""
    return None if sinks is None else sinks[plan.q_slice(plan.rank, chunk)]


def ulysses_forward(
    q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup, ring: RingExchange | None, plan: UlyssesPlan,
    sinks: Tensor | None = None,
) -> tuple[Tensor, list[tuple[Tensor, ...]]]:
    """Returns ``out`` ``(B, Hq, L, Dv)`` in q's dtype and, per head chunk, the head-layout tensors the
    backward needs: ``(q, k, v, out, lse)`` of that chunk. ``sinks``: ``(q_heads,)`` or None. An uneven
    split (:class:`HeadSplit`) runs one pass with uneven all-to-alls (:func:`_uneven_forward`)."""
    if not plan.split.even:
        return _uneven_forward(q, k, v, group, ring, plan, sinks)
    hc = plan.head_chunks
    n, d, dv = q.shape[2], q.shape[3], v.shape[3]
    out = output_like(q, dv)
    saved: list[tuple[Tensor, ...]] = []
    k, v = k.contiguous(), v.contiguous()
    pending_in: Pending | None = start_qkv(q, k, v, 0, plan, group)
    pending_out: tuple[int, Pending] | None = None
    for c in range(hc):
        (recv,) = pending_in.wait()
        pending_in = start_qkv(q, k, v, c + 1, plan, group) if c + 1 < hc else None
        recv_q, recv_k, recv_v = _qkv_views(recv, plan, n, d, dv)
        q_h = seq_to_heads(recv_q, plan)  # (B, qc, u * L, D)
        k_h = seq_to_heads(recv_k, plan)  # (B, kc, u * L, D)
        v_h = seq_to_heads(recv_v, plan)  # (B, kc, u * L, Dv)
        del recv, recv_q, recv_k, recv_v
        out_h, lse_h = _inner_forward(q_h, k_h, v_h, ring, plan.attn, _chunk_sinks(sinks, plan, c))
        saved.append((q_h, k_h, v_h, out_h, lse_h))
        started = (c, start_heads_back([out_h], plan, group))
        if pending_out is not None:  # the previous chunk's output came back while this one computed
            place_out(out, *pending_out, plan)
        pending_out = started
    place_out(out, *pending_out, plan)
    return out, saved


def place_out(out: Tensor, chunk: int, pending: Pending, plan: UlyssesPlan) -> None:
    (recv,) = pending.wait()  # (u, B, qc * L * Dv): slot j = heads of rank j's chunk
    qc = plan.split.q_per_rank // plan.head_chunks
    (recv_out,) = packed_views(recv, (qc, *out.shape[2:]))  # (u, B, qc, L, Dv)
    for j in range(plan.split.u):
        out[:, plan.q_slice(j, chunk)] = recv_out[j]


def start_dout(dout: Tensor, chunk: int, plan: UlyssesPlan, group: dist.ProcessGroup) -> Pending:
    """Pack head chunk ``chunk`` of every rank's share of ``dout`` ``(B, Hq, L, D)`` into ``(u, B, qc, L, D)``
    and start its all-to-all (the backward's mirror of the output's return trip)."""
    u, qc = plan.split.u, plan.split.q_per_rank // plan.head_chunks
    send = dout.new_empty((u, dout.shape[0], qc, *dout.shape[2:]))
    for j in range(u):
        send[j] = dout[:, plan.q_slice(j, chunk)]
    return start_all_to_all(send, group)


def place_grads(dq: Tensor, dk: Tensor, dv: Tensor, chunk: int, pending: Pending, plan: UlyssesPlan) -> None:
    """Wait for head chunk ``chunk``'s packed dq/dk/dv ``(u, B, m)`` (slot j: the gradients of this rank's
    tokens for rank j's heads, laid out as :func:`start_qkv` packs q/k/v) and write them into the
    sequence-layout gradients. Each K/V head comes from one rank, and is copied, unless it is
    replicated: then its replicas are summed (added into zeroed fp32 ``dk``, ``dv``)."""
    (recv,) = pending.wait()
    u, hc = plan.split.u, plan.head_chunks
    kc = plan.split.kv_per_rank // hc
    recv_q, recv_k, recv_v = _qkv_views(recv, plan, dq.shape[2], dq.shape[3], dv.shape[3])
    for j in range(u):
        dq[:, plan.q_slice(j, chunk)] = recv_q[j]
    if not plan.split.replicated:
        for j in range(u):
            heads = plan.split.kv_index(j, chunk, hc)
            dk.narrow(1, heads[0], kc).copy_(recv_k[j])
            dv.narrow(1, heads[0], kc).copy_(recv_v[j])
        return
    # replicas of a K/V head add up (in fp32); narrow, not an index tensor built from host ints
    for j in range(u):
        first = plan.split.kv_index(j, chunk, hc)[0]
        dk.narrow(1, first, kc).add_(recv_k[j])
        dv.narrow(1, first, kc).add_(recv_v[j])


def ulysses_backward(
    dout: Tensor, saved: list[tuple[Tensor, ...]], k_shape: torch.Size, group: dist.ProcessGroup,
    ring: RingExchange | None, plan: UlyssesPlan, sinks: Tensor | None = None, *, v_head_dim: int | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """dq, dk, dv in sequence layout and the input dtype, and the sinks' gradient ``(q_heads,)`` (this
    rank's heads' full gradient, 0 for the other heads; None without sinks). Per head chunk: one
    all-to-all of dout to the head layout, the inner backward, one all-to-all of dq, dk, dv packed together.
    ``dout`` ``(B, Hq, L, Dv)``; ``k_shape`` ``(B, Hkv, L, D)``; ``v_head_dim``: Dv (default D)."""
    hc = plan.head_chunks
    v_shape = k_shape if v_head_dim is None else torch.Size((*k_shape[:3], v_head_dim))
    if not plan.split.even:
        return _uneven_backward(dout, saved, k_shape, v_shape, group, ring, plan, sinks)
    dq = output_like(dout, k_shape[3])
    # a replicated K/V head's gradient is the sum over its replicas: accumulate in fp32 from zeros;
    # otherwise every head is copied in once (place_grads)
    if plan.split.replicated:
        dk = torch.zeros(k_shape, dtype=lse_dtype(dout.dtype), device=dout.device)
        dv = torch.zeros(v_shape, dtype=lse_dtype(dout.dtype), device=dout.device)
    else:
        dk = torch.empty(k_shape, dtype=dout.dtype, device=dout.device)
        dv = torch.empty(v_shape, dtype=dout.dtype, device=dout.device)
    dsinks = None if sinks is None else torch.zeros_like(sinks)
    dout = dout.contiguous()

    pending_in: Pending | None = start_dout(dout, 0, plan, group)
    pending_back: tuple[int, Pending] | None = None
    for c in range(hc):
        (recv,) = pending_in.wait()
        pending_in = start_dout(dout, c + 1, plan, group) if c + 1 < hc else None
        dout_h = seq_to_heads(recv, plan)
        del recv
        q_h, k_h, v_h, out_h, lse_h = saved[c]
        if dsinks is not None:
            dsinks[plan.q_slice(plan.rank, c)] = sink_grad(dout_h, out_h, lse_h, _chunk_sinks(sinks, plan, c))
        dq_h, dk_h, dv_h = _inner_backward(dout_h, q_h, k_h, v_h, out_h, lse_h, ring, plan.attn)
        del dout_h
        started = (c, start_heads_back([dq_h, dk_h.to(dq_h.dtype), dv_h.to(dq_h.dtype)], plan, group))
        del dq_h, dk_h, dv_h
        if pending_back is not None:
            place_grads(dq, dk, dv, *pending_back, plan)
        pending_back = started
    place_grads(dq, dk, dv, *pending_back, plan)
    return dq, dk.to(dout.dtype), dv.to(dout.dtype), dsinks


class UlyssesAttention(torch.autograd.Function):
    """Ulysses (``ring=None``) or hybrid attention; a thin wrapper of :func:`ulysses_forward` /
    :func:`ulysses_backward`. The backward mirrors the forward: the same all-to-alls in the other
    direction, the inner (local or ring) backward in between. ``sinks`` ``(q_heads,)`` (or None) gets
    this rank's share of its gradient, like any replicated weight."""

    @staticmethod
    def forward(  # noqa: ANN205
        ctx, q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup, ring: RingExchange | None,  # noqa: ANN001
        plan: UlyssesPlan, sinks: Tensor | None = None,
    ):
        out, saved = ulysses_forward(q, k, v, group, ring, plan, sinks)
        ctx.save_for_backward(sinks, *(t for chunk in saved for t in chunk))
        ctx.group, ctx.ring, ctx.plan, ctx.k_shape, ctx.v_head_dim = group, ring, plan, k.shape, v.shape[-1]
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):  # noqa: ANN001, ANN205
        sinks, *flat = ctx.saved_tensors
        saved = [flat[i:i + 5] for i in range(0, len(flat), 5)]
        dq, dk, dv, dsinks = ulysses_backward(
            dout, saved, ctx.k_shape, ctx.group, ctx.ring, ctx.plan, sinks, v_head_dim=ctx.v_head_dim
        )
        return dq, dk, dv, None, None, None, dsinks
