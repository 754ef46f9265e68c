"""How a sequence is cut across the ranks of an SP group, and the differentiable cut/gather.

Layouts (P = SP size):
- ``contiguous``: the sequence is cut into P chunks; rank r holds chunk r.
- ``zigzag``: the sequence is cut into 2P chunks; rank r holds chunks r and 2P-1-r, in that order.
  Under causal masking every rank then does the same amount of attention work.
- ``balanced``: the sequence is cut into m*P chunks (m = 8, 4 or 2: the most that divide it) and each
  rank holds m of them, in ascending order, chosen per batch from the document boundaries
  ``cu_seqlens`` so that every rank has about the same causal attention work (visible pairs):
  zigzag's balance breaks with packed documents. The layout depends on the sequence length and
  ``cu_seqlens`` (host integers, the same on every rank), so ``shard_sequence``/``gather_sequence``
  and ``seqpar.attention`` must be given the same ``cu_seqlens`` (none: one document).
  ``seqpar.sequence.batch.shard_batch`` cuts packed batches this way and hands the boundaries to the model
  (``cu_seq_lens_q``), so ``"sharding": "balanced"`` works from the config.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import guard_scalar

from seqpar.comm.agree import rows_across_ranks
from seqpar.comm.collectives import all_gather
from seqpar.runtime.groups import ProcessGroupManager, default_manager, resolve_group
from seqpar.runtime.verified import batch_verified
from seqpar.sequence.boundaries import drop_empty_documents, host_boundaries

__all__ = [
    "resolve_sharding",
    "num_chunks",
    "chunk_ids",
    "shard_index",
    "shard_sequence",
    "gather_sequence",
    "pad_to_multiple",
    "length_multiple",
    "padded_length",
    "balanced_layout",
]

BALANCED = "balanced"
SHARDINGS = ("contiguous", "zigzag", BALANCED)
UNDECLARED_DEFAULT = "contiguous"  # what a call without sharding= gets when the run declared none


def resolve_sharding(sharding: str | None, *, manager: ProcessGroupManager | None = None, where: str = "sharding") -> str:
    """The sharding a call uses: one source for the whole run.

    A sharding declared for the run (``init_process_groups(sharding=)`` or the config's ``sharding``,
    kept on the manager) binds: a call without ``sharding=`` gets it, and a call whose explicit
    ``sharding=`` contradicts it raises. While none is declared, the call's own argument wins and
    ``None`` means ``"contiguous"``.

    Args:
        sharding: the call's ``sharding=`` argument (``None``: not given).
        manager: whose declaration binds (default: the default manager, if any).
        where: the function's name, for the error message.
    Raises:
        ValueError: an unknown sharding, or one that contradicts the declared one (on every rank
            alike: the declaration and the argument are the same on every rank of a correct program).
    """
    manager = manager if manager is not None else default_manager()
    declared = manager.sharding if manager is not None else None
    if sharding is not None and sharding not in SHARDINGS:
        raise ValueError(f"{where}: unknown sharding {sharding!r}; choose one of {list(SHARDINGS)}")
    if declared is None:
        return sharding if sharding is not None else UNDECLARED_DEFAULT
    if sharding is not None and sharding != declared:
        raise ValueError(
            f"{where}: sharding={sharding!r} contradicts the run's declared sharding {declared!r} (from the config "
            f"or init_process_groups(sharding=)); drop the argument to use {declared!r}, or declare {sharding!r} "
            "for the run: one sharding must cut the batch, run attention and gather the output"
        )
    return declared


def num_chunks(world_size: int, sharding: str, *, seq_len: int | None = None) -> int:
    """How many equal chunks the full sequence is cut into (``balanced`` needs ``seq_len``)."""
    if sharding == BALANCED:
        return _balanced_per_rank(_need_len(seq_len), world_size) * world_size
    if sharding == "contiguous":
        return world_size
    if sharding == "zigzag":
        return 2 * world_size
    raise ValueError(f"sharding={sharding!r} is invalid: choose 'contiguous' or 'zigzag'")


def length_multiple(world_size: int, sharding: str) -> int:
    """What :func:`seqpar.sequence.batch.shard_batch` pads a sequence to a multiple of before the cut: ``P``
    (contiguous), ``2P`` (zigzag) or ``8P`` (balanced: its finest layout, 8 chunks per rank, whatever
    the documents)."""
    return 8 * world_size if sharding == BALANCED else num_chunks(world_size, sharding)


def padded_length(seq_len: int, world_size: int, sharding: str) -> int:
    """``seq_len`` rounded up to :func:`length_multiple`."""
    multiple = length_multiple(world_size, sharding)
    return -(-seq_len // multiple) * multiple


def chunk_ids(
    rank: int, world_size: int, sharding: str, *, seq_len: int | None = None,
    cu_seqlens: Tensor | Sequence[int] | None = None,
) -> list[int]:
    """The global chunk indices rank ``rank`` holds, in local (ascending) order (``balanced`` needs
    the global ``seq_len`` and the batch's ``cu_seqlens``)."""
    if sharding == BALANCED:
        # guard_scalar: the layout is decided on this length's exact value (a symbolic one, dynamic=True, would
        # reach sorted() as non-constant keys: a graph break); integer documents pin the length anyway
        return list(balanced_layout(guard_scalar(_need_len(seq_len)), world_size, host_boundaries(cu_seqlens))[rank])
    if sharding == "contiguous":
        return [rank]
    if sharding == "zigzag":
        return [rank, 2 * world_size - 1 - rank]
    raise ValueError(f"sharding={sharding!r} is invalid: choose 'contiguous' or 'zigzag'")


def _need_len(seq_len: int | None) -> int:
    if seq_len is None:
        raise ValueError("sharding='balanced' depends on the sequence length: pass seq_len=")
    return seq_len


def _balanced_per_rank(seq_len: int, world_size: int) -> int:
    for m in (8, 4, 2):  # more chunks balance finer (8: max/mean <= 1.02 on long-tailed mixes)
        if seq_len % (m * world_size) == 0:
            return m
    raise ValueError(
        f"sequence length {seq_len} cannot be cut for {world_size} ranks with sharding='balanced' (at least "
        f"2 * {world_size} equal chunks): pad it to a multiple of {2 * world_size}, best {8 * world_size} "
        f"(seqpar.sequence.sharding.pad_to_multiple)"
    )


def _causal_chunk_work(cu: tuple[int, ...], seq_len: int, n: int) -> list[int]:
    """Visible (query, key) pairs of each of ``n`` equal query chunks under causal document masks:
    row i of a document starting at ds sees i - ds + 1 keys."""
    # The document of each chunk's first row by a pointer that only moves forward (chunks ascend), not
    # bisect: under torch.compile dynamo traces this (a Ulysses call's balanced order, seqpar.attn.ulysses),
    # and bisect, a C builtin, is a graph break where one graph is promised (fuzzer case 1490451036)
    length, work, first_doc = seq_len // n, [], 0
    for c in range(n):
        a, b = c * length, (c + 1) * length
        while cu[first_doc + 1] <= a:
            first_doc += 1
        d, i, total = first_doc, a, 0
        while i < b:
            ds, de = cu[d], cu[d + 1]
            e = min(b, de)
            rows, first = e - i, i - ds + 1
            total += rows * first + rows * (rows - 1) // 2
            i, d = e, d + 1
        work.append(total)
    return work


@functools.lru_cache(maxsize=256)
def balanced_layout(seq_len: int, world_size: int, cu_seqlens: tuple[int, ...] | None) -> tuple[tuple[int, ...], ...]:
    """Chunks of each rank under ``balanced``: the m*P chunks by decreasing causal work, each to the
    rank with the least work so far that still has room (m chunks each; ties to the lower rank and
    chunk, so every rank computes the same layout). Returns one ascending tuple per rank."""
    m = _balanced_per_rank(seq_len, world_size)
    cu = cu_seqlens if cu_seqlens is not None else (0, seq_len)
    if cu[0] != 0 or cu[-1] != seq_len or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(
            f"cu_seqlens must be the boundaries [0, ..., {seq_len}] of the whole sequence, never decreasing"
        )
    # a zero-length document (a repeated entry) holds no chunk's row: the layout is that of the boundaries without
    # it, so shard_sequence, seqpar.attention and gather_sequence agree whichever of the two a caller passes
    cu = drop_empty_documents(cu)
    work = _causal_chunk_work(cu, seq_len, m * world_size)
    load, held = [0] * world_size, [[] for _ in range(world_size)]
    # plain loops, no key= to min / sorted: dynamo traces this too (see _causal_chunk_work) and has no min(key=)
    for _, c in sorted([(-w, c) for c, w in enumerate(work)]):
        r = -1
        for j in range(world_size):
            if len(held[j]) < m and (r < 0 or load[j] < load[r]):
                r = j  # the least loaded rank with room, ties to the lower rank
        load[r] += work[c]
        held[r].append(c)
    return tuple(tuple(sorted(h)) for h in held)


def _check_length(seq_len: int, world_size: int, sharding: str) -> int:
    if sharding == BALANCED:
        return seq_len // num_chunks(world_size, sharding, seq_len=seq_len)
    n = num_chunks(world_size, sharding)
    if seq_len % n:
        fix = f"pad it to a multiple of {n} (seqpar.sequence.sharding.pad_to_multiple(x, dim, {n}, value))"
        if sharding == "zigzag" and seq_len % world_size == 0:
            fix += " or use sharding='contiguous'"
        raise ValueError(
            f"sequence length {seq_len} cannot be cut for {world_size} ranks with sharding='{sharding}' "
            f"({n} equal chunks needed): {fix}"
        )
    return seq_len // n


def shard_index(
    seq_len: int,
    rank: int,
    world_size: int,
    sharding: str = "contiguous",
    *,
    device: torch.device | str | None = None,
    cu_seqlens: Tensor | Sequence[int] | None = None,
) -> Tensor:
    """Global positions (LongTensor ``(seq_len / P,)``) that ``rank`` holds, in local order."""
    c = _check_length(seq_len, world_size, sharding)
    return torch.cat(
        [
            torch.arange(i * c, (i + 1) * c, device=device)
            for i in chunk_ids(rank, world_size, sharding, seq_len=seq_len, cu_seqlens=cu_seqlens)
        ]
    )


def _world_and_rank(group: dist.ProcessGroup | None) -> tuple[dist.ProcessGroup | None, int, int]:
    group = resolve_group(group)
    if group is None:
        return None, 1, 0
    return group, dist.get_world_size(group), dist.get_rank(group)


def shard_sequence(
    x: Tensor, dim: int, *, group: dist.ProcessGroup | None = None, sharding: str | None = None,
    cu_seqlens: Tensor | Sequence[int] | None = None,
) -> Tensor:
    """This rank's part of a full tensor (the same full tensor on every rank).

    Args:
        x: any tensor whose ``dim`` is the sequence, e.g. ``(batch, seq, hidden)`` with ``dim=1``.
        dim: the sequence dimension (negative allowed).
        group: the SP group (default: the default manager's SP group; without one on a world > 1: an
            error, see :func:`seqpar.runtime.groups.resolve_group`).
        sharding: ``"contiguous"``, ``"zigzag"`` or ``"balanced"``; default: the run's declared sharding,
            else ``"contiguous"`` (:func:`resolve_sharding`).
        cu_seqlens: with ``"balanced"``, the global document boundaries the layout balances (the
            same ones seqpar.attention gets); ignored otherwise.
    Returns:
        ``x`` with ``dim`` cut to ``seq / P``. Differentiable: the gradient of the full input is this
        rank's gradient scattered into zeros (sum it over the SP group to get the full gradient).
    Raises:
        ValueError: the length does not divide into P chunks (2P for zigzag); the message says how to pad;
            ``sharding`` contradicts the run's declared sharding.
    """
    sharding = resolve_sharding(sharding, where="shard_sequence")
    group, world, rank = _world_and_rank(group)
    c = _check_length(x.shape[dim], world, sharding)
    ids = chunk_ids(rank, world, sharding, seq_len=x.shape[dim], cu_seqlens=cu_seqlens)
    parts = [x.narrow(dim, i * c, c) for i in ids]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


_DTYPES = sorted({str(d) for d in vars(torch).values() if isinstance(d, torch.dtype)})


def _dtype_code(dtype: torch.dtype) -> int:
    """``dtype`` as an int every rank derives alike (its index among torch's dtypes by name)."""
    name = str(dtype)
    return _DTYPES.index(name) if name in _DTYPES else -1


def _check_same_shape(x: Tensor, dim: int, group: dist.ProcessGroup) -> None:
    """Raise on every rank unless all ranks pass shards of one shape and dtype.

    One tiny all-gather (seqpar.comm.agree); without it, unequal shards would hang the all-gather
    or return garbage. The dtype itself, not only its size: the all-gather moves bytes, so a float32
    shard beside an int32 one (or bfloat16 beside float16) came back as the other's bits reinterpreted.
    """
    row = [x.shape[dim], x.element_size(), _dtype_code(x.dtype), x.dim(), *x.shape]
    rows = rows_across_ranks(row, group)
    if rows is None:
        return
    seq_locals = [r[0] for r in rows]
    if len(set(seq_locals)) != 1:
        raise ValueError(
            f"gather_sequence: the ranks hold shards of different lengths along dim {dim} "
            f"({seq_locals}); every rank must pass its shard of the same sequence "
            f"(cut with shard_sequence)"
        )
    shapes = [tuple(r[4:]) for r in rows]
    dtypes = [_DTYPES[r[2]] if 0 <= r[2] < len(_DTYPES) else "?" for r in rows]
    raise ValueError(
        f"gather_sequence: the ranks' shards differ outside dim {dim} (shapes {shapes}, dtypes {dtypes}); every "
        "rank must pass a shard of the same shape and dtype (cast them to one dtype first)"
    )


def gather_sequence(
    x: Tensor,
    dim: int,
    *,
    group: dist.ProcessGroup | None = None,
    sharding: str | None = None,
    grad_reduction: str = "slice",
    check_inputs: bool = True,
    cu_seqlens: Tensor | Sequence[int] | None = None,
) -> Tensor:
    """The inverse of :func:`shard_sequence`: every rank gets the full tensor, in global order.

    Args:
        x: this rank's shard, ``dim`` of length ``seq / P`` (the same shape on every rank).
        dim: the sequence dimension (negative allowed).
        group: the SP group (default: the default manager's SP group; without one on a world > 1: an
            error, see :func:`seqpar.runtime.groups.resolve_group`).
        sharding: ``"contiguous"``, ``"zigzag"`` or ``"balanced"``, as the shard was cut; default: the
            run's declared sharding, else ``"contiguous"`` (:func:`resolve_sharding`).
        grad_reduction: ``"slice"`` (default) — the backward keeps this rank's part of the incoming
            gradient: right when every rank computes the same loss on the gathered tensor (the
            usual case: the ranks' gradients are copies, not terms). ``"sum"`` — the backward
            reduce-scatters (the dual of the all-gather): right when each rank's loss is a separate
            term of the total.
        check_inputs: first check across ranks that every shard has the same shape (one tiny
            collective and a host sync); skipped inside a swapped model's verified forward, where
            the batch check already covered it (seqpar.runtime.verified).
        cu_seqlens: with ``"balanced"``, the boundaries the shard was cut with.
    Returns:
        The full tensor, ``dim`` of length ``seq``.
    Raises:
        ValueError: on every rank, if the ranks' shards differ in length or shape, or ``sharding``
            contradicts the run's declared sharding.
    """
    sharding = resolve_sharding(sharding, where="gather_sequence")
    group, world, _ = _world_and_rank(group)
    balanced = sharding == BALANCED
    layout = {"seq_len": x.shape[dim] * world, "cu_seqlens": host_boundaries(cu_seqlens)} if balanced else {}
    per_rank = 1 if balanced else len(chunk_ids(0, world, sharding))  # also validates `sharding`
    if world == 1:
        return all_gather(x, dim, group=group, grad_reduction=grad_reduction)  # identity, checked
    dim = dim % x.dim()
    if check_inputs and not batch_verified():
        _check_same_shape(x, dim, group)
    if balanced:  # after the shape check: equal shapes give every rank the same layout (or error)
        per_rank = len(chunk_ids(0, world, sharding, **layout))
    if x.shape[dim] % per_rank:
        raise ValueError(
            f"gather_sequence: a zigzag shard holds two equal chunks, so its length must be even, "
            f"got {x.shape[dim]}"
        )
    full_rank_order = all_gather(x, dim, group=group, grad_reduction=grad_reduction)
    if sharding == "contiguous":
        return full_rank_order
    # rank order holds chunks [0, 2P-1, 1, 2P-2, ...]; put each global chunk back in its place
    c = x.shape[dim] // per_rank
    position = {
        i: r * per_rank + j
        for r in range(world)
        for j, i in enumerate(chunk_ids(r, world, sharding, **layout))
    }
    chunks = [full_rank_order.narrow(dim, position[i] * c, c) for i in range(world * per_rank)]
    return torch.cat(chunks, dim=dim)


def pad_to_multiple(x: Tensor, dim: int, multiple: int, value: float = 0) -> Tensor:
    """Pad ``dim`` at its end with ``value`` up to the next multiple of ``multiple``.

    E.g. before sharding: ``pad_to_multiple(input_ids, 1, 2 * P, pad_id)`` for zigzag (pad labels
    with the loss's ignore index so the padding does not count).

    Returns:
        ``x`` itself if already a multiple, else a padded copy.
    """
    if isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1:
        raise ValueError(f"pad_to_multiple: multiple must be a positive integer, got {multiple!r}")
    extra = (-x.shape[dim]) % multiple
    if extra == 0:
        return x
    dim = dim % x.dim()
    pad = [0, 0] * (x.dim() - 1 - dim) + [0, extra]  # F.pad lists the last dim first
    return F.pad(x, pad, value=value)
