"""The rank grid: how ``world_size`` ranks are cut into DP, SP, TP (and Ulysses / ring) axes, as integer
arithmetic on rank numbers. No process group is made here (that is :mod:`seqpar.runtime.factory`).

Axis order (outermost first)::

    cube = torch.arange(world_size).view(dp_size, sp_size, tp_size)   # (dp, sp, tp)
    grid = cube[:, :, tp_rank]                                        # (dp, sp): this rank's slice

- TP group = ``tp`` consecutive ranks (innermost: tensor parallelism exchanges activations in every
  layer, the heaviest traffic, so it gets the closest ranks). ``tp = 1`` (the default): this rank alone.
- SP group i = row i of the grid = ranks ``[i*sp, (i+1)*sp)`` when ``tp = 1``, strided by ``tp``
  otherwise: consecutive ranks next, so SP traffic (the heavy, latency-bound K/V exchange) stays
  inside a node when ranks are numbered node by node and ``sp x tp`` fits in one.
- DP group j = column j of the grid: the strided complement.
- SP-DP group = the grid (``dp x sp`` ranks, the whole world when ``tp = 1``): these ranks hold
  replicas of the same parameter shards, so gradients are reduced over it.

With ``ulysses_size = u`` (u divides sp), each SP group is itself a ``(sp/u, u)`` grid (Ulysses and
hybrid then share the ``heads / tp`` heads that TP leaves each rank)::

    sp_grid = sp_ranks.view(sp // u, u)   # (ring, ulysses)

- Ulysses group = row = ``u`` consecutive SP ranks (the inner, intra-node axis: all-to-all traffic);
- ring group = column = SP ranks ``i, i+u, i+2u, ...`` (the outer axis: point-to-point ring traffic).

This module owns the checks on those sizes (each error names the sizes that would fit), the head-count
rules that TP and Ulysses impose, the ``ulysses_size="auto"`` choice, and the node-boundary warnings.
"""

from __future__ import annotations

import math
import os

import torch

__all__ = [
    "divisors",
    "check_divisible",
    "check_ulysses_size",
    "tp_heads_problem",
    "ulysses_heads_ok",
    "ulysses_split_even",
    "ulysses_heads_accepted",
    "ulysses_heads_problem",
    "ulysses_shares",
    "choose_ulysses_size",
    "rank_grid",
    "check_layout",
    "rank_cube",
    "node_layout_problems",
    "dynamic_group_sizes",
]


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n``, ascending (the sizes an axis of ``n`` ranks can be cut into)."""
    return [d for d in range(1, n + 1) if n % d == 0]


def check_divisible(world_size: int, sp_size: int) -> None:
    """Raise ``ValueError`` unless ``sp_size`` is a positive divisor of ``world_size``."""
    if isinstance(sp_size, bool) or not isinstance(sp_size, int) or sp_size < 1:
        raise ValueError(
            f"sequence_parallel.size must be a positive integer, got {sp_size!r}; choose a size "
            f"that divides the number of ranks {tuple(divisors(world_size))}"
        )
    if world_size % sp_size:
        raise ValueError(
            f"world size {world_size} is not divisible by sequence_parallel.size {sp_size}; "
            f"choose a size that divides the number of ranks ({', '.join(map(str, divisors(world_size)))})"
        )


def check_ulysses_size(sp_size: int, ulysses_size: int) -> None:
    """Raise ``ValueError`` unless ``ulysses_size`` is a positive divisor of ``sp_size``."""
    fix = f"choose a ulysses_size that divides sequence_parallel.size {sp_size} ({', '.join(map(str, divisors(sp_size)))})"
    if isinstance(ulysses_size, bool) or not isinstance(ulysses_size, int) or ulysses_size < 1:
        raise ValueError(f"ulysses_size must be a positive integer or 'auto', got {ulysses_size!r}; {fix}")
    if sp_size % ulysses_size:
        raise ValueError(f"ulysses_size {ulysses_size} does not divide sequence_parallel.size {sp_size}; {fix}")


def tp_heads_problem(q_heads: int, kv_heads: int, tp: int) -> str | None:
    """Why ``tp`` tensor-parallel ranks cannot share the model's heads (``None``: they can). Each TP
    rank holds ``q_heads / tp`` query and ``kv_heads / tp`` K/V heads (the column-parallel q/k/v
    projections are cut on head boundaries), so ``tp`` must divide both counts."""
    if tp == 1 or (q_heads % tp == 0 and kv_heads % tp == 0):
        return None
    fits = divisors(math.gcd(q_heads, kv_heads))
    return (
        f"sequence_parallel.tp_size {tp} does not divide the model's heads ({q_heads} query, {kv_heads} K/V): "
        f"each TP rank holds heads / tp_size of each; choose tp_size in {fits} (a common divisor), and put "
        "the remaining ranks on the SP axis (sequence_parallel.size)"
    )


def ulysses_split_even(q_heads: int, kv_heads: int, u: int) -> bool:
    """Whether ``u`` Ulysses ranks share these heads evenly (the all-to-alls' equal-slot path, see
    seqpar.attn.ulysses): ``u`` divides the query heads, and the K/V head count is a multiple or a divisor
    of ``u`` (``Hkv/u`` K/V heads per rank, or one replicated K/V head each). Heads as each rank holds them
    (under TP: the model's / tp)."""
    return q_heads % u == 0 and (kv_heads % u == 0 or u % kv_heads == 0)


def ulysses_heads_problem(q_heads: int, kv_heads: int, u: int, tp: int = 1) -> str | None:
    """Why ``u`` Ulysses ranks cannot share the heads (``None``: they can, evenly or not). Uneven shares
    (:func:`ulysses_shares`) are accepted: what stays refused is a ``tp`` that does not divide the heads,
    fewer query heads than Ulysses ranks (a rank would attend no head), and query heads that are no
    multiple of the K/V heads (no GQA grouping to follow)."""
    if problem := tp_heads_problem(q_heads, kv_heads, tp):
        return problem
    q_heads, kv_heads = q_heads // tp, kv_heads // tp
    if q_heads < u:
        return f"{q_heads} query heads are fewer than the {u} Ulysses ranks (a rank would attend no head)"
    if kv_heads < 1 or q_heads % kv_heads:
        return f"{q_heads} query heads are not a multiple of the {kv_heads} K/V heads (no GQA grouping)"
    return None


def ulysses_heads_ok(q_heads: int, kv_heads: int, u: int, tp: int = 1) -> bool:
    """Whether ``u`` Ulysses ranks split the heads evenly, without expanding K/V
    (:func:`ulysses_split_even`, the split ``ulysses_size="auto"`` chooses). With ``tp`` > 1 the heads are
    those TP leaves each rank (``q_heads / tp``, ``kv_heads / tp``; ``tp`` must divide both,
    :func:`tp_heads_problem`), so e.g. K/V heads < ``tp x u`` needs ``u`` to be a multiple of
    ``kv_heads / tp``. Uneven splits are accepted too: :func:`ulysses_heads_accepted` is what the
    attention and ``mode="auto"`` accept."""
    if tp_heads_problem(q_heads, kv_heads, tp):
        return False
    return ulysses_split_even(q_heads // tp, kv_heads // tp, u)


def ulysses_heads_accepted(q_heads: int, kv_heads: int, u: int, tp: int = 1) -> bool:
    """Whether a Ulysses / hybrid call with ``u`` Ulysses ranks runs, evenly or in uneven contiguous shares
    (:func:`ulysses_shares`); :func:`ulysses_heads_problem` says why not."""
    return ulysses_heads_problem(q_heads, kv_heads, u, tp) is None


def ulysses_shares(q_heads: int, kv_heads: int, u: int) -> list[tuple[int, int, int, int]]:
    """Per Ulysses rank j: ``(q_first, q_count, kv_first, kv_count)``, its contiguous range of query heads
    (DeepSpeed's uneven split: sizes differing by at most one, the first ``q_heads % u`` ranks taking the
    larger share) and the K/V heads those query heads read (query head i reads K/V head
    ``i // (q_heads / kv_heads)``) and no others. A K/V head may fall in two ranks' ranges. For an even
    split (:func:`ulysses_split_even`) these are ``Hq/u`` query heads and ``max(Hkv/u, 1)`` K/V heads."""
    base, extra = divmod(q_heads, u)
    group = q_heads // kv_heads
    shares = []
    for j in range(u):
        first, count = j * base + min(j, extra), base + (j < extra)
        kv_first, kv_last = first // group, (first + count - 1) // group
        shares.append((first, count, kv_first, kv_last - kv_first + 1))
    return shares


def choose_ulysses_size(
    sp_size: int, *, heads: tuple[int, int] | None = None, node_size: int | None = None, tp: int = 1
) -> int:
    """``ulysses_size="auto"`` at init: the largest divisor of ``sp_size`` that fits in a node (Ulysses
    all-to-all on the fast intra-node links, the ring across nodes hides the slow ones) and, when the
    model's ``heads = (q_heads, kv_heads)`` are known, splits them evenly (:func:`ulysses_heads_ok`, on
    the heads ``tp`` leaves each rank; a Ulysses group of ``u`` spans ``u x tp`` consecutive ranks, which
    must fit in the node). Uneven shares are accepted by the attention (:func:`ulysses_heads_ok`) but
    never chosen here: the slowest rank holds ``ceil(Hq/u)`` heads, and ``u = 1`` always splits evenly.

    ``node_size`` defaults to ``LOCAL_WORLD_SIZE`` from the launcher, else ``sp_size x tp`` (one node).
    Integer arithmetic on the group layout only, so it lives with the groups (no attention import).

    Raises:
        ValueError: ``tp`` does not divide the head counts (:func:`tp_heads_problem`, naming the fix).
    """
    if heads is not None and (problem := tp_heads_problem(heads[0], heads[1], tp)):
        raise ValueError(problem)
    if node_size is None:
        node_size = int(os.environ.get("LOCAL_WORLD_SIZE", sp_size * tp))
    fits = [u for u in divisors(sp_size)
            if u * tp <= max(node_size, tp) and (heads is None or ulysses_heads_ok(heads[0], heads[1], u, tp))]
    return max(fits)


def rank_grid(world_size: int, sp_size: int) -> torch.Tensor:
    """The rank grid ``(dp_size, sp_size)``: row i is SP group i, column j is DP group j."""
    check_divisible(world_size, sp_size)
    return torch.arange(world_size).view(world_size // sp_size, sp_size)  # (dp, sp)


def check_layout(world_size: int, sp_size: int, tp_size: int = 1) -> None:
    """Raise ``ValueError`` unless the world is ``dp x sp_size x tp_size`` for a whole ``dp``."""
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"sequence_parallel.tp_size must be a positive integer, got {tp_size!r}; "
                         f"choose one that divides the number of ranks {tuple(divisors(world_size))}")
    check_divisible(world_size, sp_size)
    if world_size % (sp_size * tp_size):
        fits = [t for t in divisors(world_size) if (world_size // t) % sp_size == 0]
        raise ValueError(
            f"world size {world_size} is not dp x sequence_parallel.size {sp_size} x tp_size {tp_size} for any "
            f"whole dp: choose tp_size in {fits} for this SP size, or change the SP size or the number of ranks"
        )


def rank_cube(world_size: int, sp_size: int, tp_size: int = 1) -> torch.Tensor:
    """The rank cube ``(dp_size, sp_size, tp_size)``: TP innermost (consecutive ranks), then SP, then DP."""
    check_layout(world_size, sp_size, tp_size)
    return torch.arange(world_size).view(world_size // (sp_size * tp_size), sp_size, tp_size)  # (dp, sp, tp)


def node_layout_problems(world_size: int, sp_size: int, ulysses_size: int, node_size: int | None,
                         tp_size: int = 1) -> list[str]:
    """Why the TP / SP / Ulysses groups of this layout would cross node boundaries (empty: they do not).

    Ranks are assumed numbered node by node (torchrun, the DeepSpeed launcher and SLURM do so), so
    the groups of consecutive ranks stay inside a node when their size divides the node size, or
    span whole nodes when it is a multiple of it. TP is innermost: a TP group must fit in a node, and
    an SP (Ulysses) group spans ``sp x tp`` (``u x tp``) consecutive ranks, judged as such.
    """
    if not node_size or node_size < 1 or node_size >= world_size:
        return []
    problems = []
    if tp_size > 1 and node_size % tp_size:
        problems.append(
            f"sequence_parallel.tp_size {tp_size} does not divide the {node_size} ranks per node: TP groups (the "
            f"per-layer activation exchange) cross nodes; choose a tp_size dividing {node_size}"
        )
    sp_size, ulysses_size = sp_size * tp_size, ulysses_size * tp_size  # the spans of consecutive ranks
    if sp_size % node_size and node_size % sp_size:
        problems.append(
            f"sequence_parallel.size {sp_size} neither divides nor is a multiple of the {node_size} ranks per "
            f"node: some SP groups straddle two nodes, so their ring exchange runs over the slow inter-node "
            f"link; choose a size dividing {node_size} or a multiple of it"
        )
    if ulysses_size > node_size or node_size % ulysses_size:
        problems.append(
            f"sequence_parallel.ulysses_size {ulysses_size} does not fit in a node of {node_size} ranks: its "
            f"all-to-all crosses nodes; choose a divisor of {node_size} (the ring axis goes across nodes)"
        )
    return problems


def dynamic_group_sizes(pool_size: int, min_size: int = 1) -> list[int]:
    """The group sizes length-aware dynamic CP may choose on a pool of ``pool_size`` ranks (the DP x SP
    ranks of one TP rank set), ascending: the powers of two from ``min_size`` up to the largest that
    divides ``pool_size``. Group ``(c, i)`` of the pool is its positions ``[i * c, (i + 1) * c)``
    (aligned), so the groups of every size nest and any mix of them can partition the pool.

    Raises:
        ValueError: ``min_size`` is not a positive power of two, or does not divide ``pool_size``.
    """
    if isinstance(pool_size, bool) or not isinstance(pool_size, int) or pool_size < 1:
        raise ValueError(f"dynamic CP: the pool must be a positive number of ranks, got {pool_size!r}")
    if isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 1 or min_size & (min_size - 1):
        raise ValueError(
            f"sequence_parallel.dynamic.min_size = {min_size!r} is invalid: expected a positive power of two "
            "(1, 2, 4, ...), the smallest group a document may get"
        )
    largest = pool_size & -pool_size  # the largest power of two dividing the pool
    if min_size > largest:
        raise ValueError(
            f"sequence_parallel.dynamic.min_size = {min_size} does not divide the pool of {pool_size} ranks "
            f"(DP x SP of one TP rank set): choose a power of two <= {largest}"
        )
    return [1 << k for k in range(min_size.bit_length() - 1, largest.bit_length())]
