"""The planner's search (:func:`seqpar.sequence.dynamic.plan_dynamic`): micro-batches being filled, the
placements that fill them, and the moves that balance them.

A :class:`Packing` is ``num_slots`` slots of a pool of positions; a :class:`Bin` is one micro-batch being
filled: an aligned block of ``size`` positions ``[index * size, (index + 1) * size)`` in one slot, its
documents (indices into the step's lengths), their tokens and their cost (the planner's units). A position's
load is the sum over its slots of each covering bin's ``cost / size`` plus the group's fixed ring cost
(``fixed[size]``). Everything here is host Python on integers and floats, deterministic: every rank runs it
on the same lengths and gets the same packing.

- :func:`search_slots`: the least slots from a lower bound up (greedy placement, then bin completion), then
  the step's per-position balance (:func:`relabel`, :func:`rebalance`);
- :func:`align_slots` and :func:`slot_sync_cost`: for an engine whose every slot waits for the pool's slowest
  rank (FSDP2, ZeRO-3), the slots' contents ordered so that heavy micro-batches share slots, and that step's
  cost (the sum over slots of the busiest rank);
- :func:`fill_slots_first` and :func:`smooth`: the same engines' balance inside each slot (each slot's
  documents chosen first to carry an even share of the step, then each slot packed on its own; then single
  document moves and swaps that lower the sum of squared per-rank loads of every slot).

Internal to the planner: the names are public only so that :mod:`seqpar.sequence.dynamic` can import them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field


@dataclass(eq=False)  # identity: two bins are never the same micro-batch
class Bin:
    """A micro-batch being filled (mutable, internal)."""

    slot: int
    size: int
    index: int
    docs: list[int] = field(default_factory=list)
    tokens: int = 0
    cost: float = 0.0
    fixed: float = 0.0  # the group's fixed ring cost, on each of its positions


def capacity(size: int, budget: int, pad: int) -> int:
    """The most tokens a micro-batch of a group of ``size`` holds: ``tokens_per_rank(t, size, pad) <= budget``
    exactly when ``t <= capacity(size, budget, pad)``."""
    return pad * size * (budget // pad)


class Packing:
    """Micro-batches over ``num_slots`` slots of a pool, with per-position loads (cost over the step, the
    groups' fixed ring cost included)."""

    def __init__(self, num_slots: int, pool: int, budget: int, pad: int) -> None:
        self.num_slots, self.pool, self.budget, self.pad = num_slots, pool, budget, pad
        self.bins: list[Bin] = []
        self.owner: list[list[Bin | None]] = [[None] * pool for _ in range(num_slots)]
        self.load = [0.0] * pool

    def open(self, slot: int, size: int, index: int, fixed: float) -> Bin:
        b = Bin(slot, size, index)
        self.bins.append(b)
        b.fixed = fixed
        for p in range(index * size, (index + 1) * size):
            self.owner[slot][p] = b
            self.load[p] += fixed
        return b

    def add(self, b: Bin, doc: int, length: int, cost: float) -> None:
        b.docs.append(doc)
        b.tokens += length
        b.cost += cost
        for p in range(b.index * b.size, (b.index + 1) * b.size):
            self.load[p] += cost / b.size

    def remove(self, b: Bin, doc: int, length: int, cost: float) -> None:
        """Take a document out of a micro-batch of any size; an emptied one frees its cells (and its fixed
        cost)."""
        b.docs.remove(doc)
        b.tokens -= length
        b.cost -= cost
        lo, hi = b.index * b.size, (b.index + 1) * b.size
        for p in range(lo, hi):
            self.load[p] -= cost / b.size
        if not b.docs:
            for p in range(lo, hi):
                self.owner[b.slot][p] = None
                self.load[p] -= b.fixed
            self.bins.remove(b)

    def block_load(self, size: int, index: int) -> float:
        """The busiest rank's load in the aligned block."""
        return self.load[index] if size == 1 else max(self.load[index * size:(index + 1) * size])

    def free_slots(self, size: int) -> list[list[int]]:
        """Per aligned block of ``size``: the slots (ascending) in which none of its positions is taken."""
        return [[s for s in range(self.num_slots) if all(o is None for o in self.owner[s][i * size:(i + 1) * size])]
                for i in range(self.pool // size)]


def place(order: list[int], lengths: Sequence[int], sizes: list[int], costs: list[float], num_slots: int,
           pool: int, budget: int, pad: int, balance: bool, fixed: dict[int, float]) -> Packing | None:
    """Place every document (in ``order``: sizes descending) into ``num_slots`` slots, or ``None`` when one
    does not fit. ``balance``: each onto the micro-batch of its size whose busiest rank is least loaded
    after it (LPT; opening a new group counts the group's fixed ring cost, ``fixed[c]``); else best fit
    (the micro-batch with the least room left, else the first free block). A document joins a larger group
    only where nothing of its own size has room (that saves a slot and adds no ring step)."""
    pk = Packing(num_slots, pool, budget, pad)
    by_size: dict[int, list[Bin]] = {}
    cur = None
    free: list[list[int]] = []
    larger: list[Bin] = []
    own: list[Bin] = []
    cap = 0
    for d in order:
        c, length, cost = sizes[d], lengths[d], costs[d]
        if c != cur:  # a new size class: only its own blocks open from here on (larger ones came first)
            cur, cap = c, capacity(c, budget, pad)
            free = pk.free_slots(c)
            own = by_size.setdefault(c, [])
            larger = sorted((b for size in by_size if size > c for b in by_size[size]),
                            key=lambda b: (b.size, b.slot, b.index))
        best, best_key, new = None, None, None
        for b in own:
            if b.tokens + length > cap:
                continue
            key = ((pk.block_load(c, b.index), 0, b.slot, b.index) if balance
                   else (cap - b.tokens - length, 0, b.slot, b.index))
            if best_key is None or key < best_key:
                best, best_key = b, key
        for i, slots in enumerate(free):
            # a new group of c must hold the document too: a spread's (or fill_slots_first's) doubled size can hold
            # less than the document's own when the padding exceeds the budget (capacity(2, 4, pad 8) = 0)
            if not slots or length > cap:
                continue
            key = ((pk.block_load(c, i) + fixed[c], 1, slots[0], i) if balance else (cap - length, 1, slots[0], i))
            if best_key is None or key < best_key:
                best, best_key, new = None, key, i
            if not balance:
                break  # best fit: a new micro-batch only where none has room, the first free block
        if new is not None:
            best = pk.open(free[new].pop(0), c, new, fixed[c])
            own.append(best)
        if best is None:  # no room at its own size: the room left in a larger group saves a slot
            for b in larger:
                room = capacity(b.size, budget, pad) - b.tokens - length
                if room < 0:
                    continue
                key = ((b.size, pk.block_load(b.size, b.index), b.slot, b.index) if balance
                       else (b.size, room, b.slot, b.index))
                if best_key is None or key < best_key:
                    best, best_key = b, key
        if best is None:
            return None
        pk.add(best, d, length, cost)
    return pk


def packings(order: list[int], lengths: Sequence[int], sizes: list[int], costs: list[float], num_slots: int,
              pool: int, budget: int, pad: int, fixed: dict[int, float]) -> Iterator[Packing | None]:
    """The packings of ``num_slots`` slots in the order they are tried (None where one fails): the greedy,
    balancing then first fit, then bin completion (rooms last, then rooms first) where the greedy misses."""
    for balance in (True, False):
        yield place(order, lengths, sizes, costs, num_slots, pool, budget, pad, balance, fixed)
    for rooms_first in (False, True):
        yield complete(order, lengths, sizes, costs, num_slots, pool, budget, pad, fixed, rooms_first)


def search_slots(lengths: Sequence[int], sizes: list[int], costs: list[float], lower: int, most: int | None,
            pool: int, budget: int, pad: int, fixed: dict[int, float]) -> tuple[Packing | None, int]:
    """The packing with the least slots from ``lower`` up (at most ``most``; ``(None, most)`` past it), each
    document on a group of ``sizes[d]`` ranks or, to save a slot, a larger one."""
    # larger groups first (they need whole aligned blocks), then the heaviest: ties by length, index
    order = sorted(range(len(lengths)), key=lambda d: (-sizes[d], -costs[d], -lengths[d], d))
    num_slots = lower
    while most is None or num_slots <= most:  # len(lengths) slots always fit: one document per slot
        packing = next((p for p in packings(order, lengths, sizes, costs, num_slots, pool, budget, pad, fixed)
                        if p is not None), None)
        if packing is not None:
            relabel(packing, fixed)
            rebalance(packing, lengths, sizes, costs, budget, 4 * pool)
            return packing, num_slots
        num_slots += 1
    return None, num_slots


def best_subset(items: Sequence[int], cap: int) -> tuple[int, list[int]]:
    """The largest total ``<= cap`` of a subset of ``items`` (subset-sum over a bitset) and the indices of one
    such subset, preferring earlier items (the caller sorts them longest first)."""
    mask = (1 << (cap + 1)) - 1
    reach = [1]
    for n in items:
        reach.append((reach[-1] | (reach[-1] << n)) & mask)
    best = reach[-1].bit_length() - 1
    chosen, t = [], best
    for i in range(len(items) - 1, -1, -1):
        if not (reach[i] >> t) & 1:  # not reachable without item i: it is in
            chosen.append(i)
            t -= items[i]
    return best, chosen


def complete(order: list[int], lengths: Sequence[int], sizes: list[int], costs: list[float], num_slots: int,
              pool: int, budget: int, pad: int, fixed: dict[int, float], rooms_first: bool) -> Packing | None:
    """A tighter packing for ``num_slots`` slots where the greedy one failed, by bin completion: size classes
    largest first; each free aligned block of the class's size (slot by slot) and the room left in the
    larger groups (smallest first; ``rooms_first``: largest first, before the free blocks, as packed rows
    do) gets in turn the subset of the class's remaining documents that fills it most (a subset sum, longest
    documents preferred). ``None`` when documents remain. Balance is left to :func:`rebalance`."""
    pk = Packing(num_slots, pool, budget, pad)
    for c in sorted(set(sizes), reverse=True):
        items = sorted((d for d in order if sizes[d] == c), key=lambda d: (-lengths[d], d))
        cells: list[tuple[int, int, Bin | None]] = [
            (s, i, None) for s in range(num_slots) for i in range(pool // c)
            if all(o is None for o in pk.owner[s][i * c:(i + 1) * c])]
        rooms: list[tuple[int, int, Bin | None]] = [
            (b.slot, b.index, b) for b in sorted(pk.bins, key=lambda b: (-b.size if rooms_first else b.size,
                                                                         b.slot, b.index))]
        cells = rooms + cells if rooms_first else cells + rooms
        for s, i, b in cells:
            if not items:
                break
            cap = capacity(c, budget, pad) if b is None else capacity(b.size, budget, pad) - b.tokens
            if cap < lengths[items[-1]]:
                continue
            _, chosen = best_subset([lengths[d] for d in items], cap)
            if not chosen:
                continue
            if b is None:
                b = pk.open(s, c, i, fixed[c])
            for k in chosen:
                pk.add(b, items[k], lengths[items[k]], costs[items[k]])
            taken = set(chosen)
            items = [d for k, d in enumerate(items) if k not in taken]
        if items:
            return None
    return pk


def relabel(pk: Packing, fixed: dict[int, float]) -> None:
    """Even the per-position loads by moving whole micro-batches between blocks of one slot: the slot's groups
    of one size trade their aligned blocks (a one-rank micro-batch may also take a position no group covers in
    that slot); slot and size groups heaviest first, each micro-batch heaviest first onto the block whose
    busiest rank is least loaded (LPT). Kept only when it lowers the busiest rank's load."""
    groups: dict[tuple[int, int], list[Bin]] = {}
    for b in pk.bins:
        groups.setdefault((b.slot, b.size), []).append(b)
    load = [0.0] * pk.pool
    placed: list[tuple[Bin, int]] = []
    for key in sorted(groups, key=lambda k: (-max(b.cost / b.size for b in groups[k]), k)):
        slot, c = key
        bins = sorted(groups[key], key=lambda b: (-b.cost, b.index))
        blocks = sorted(b.index for b in bins)
        if c == 1:
            blocks += [p for p in range(pk.pool) if pk.owner[slot][p] is None]
        for b in bins:
            i = min(blocks, key=lambda i: (max(load[i * c:(i + 1) * c]), i))
            blocks.remove(i)
            placed.append((b, i))
            for p in range(i * c, (i + 1) * c):
                load[p] += fixed[c] + b.cost / c
    if max(load, default=0.0) >= max(pk.load, default=0.0) * (1 - 1e-12):
        return
    for b, _ in placed:
        for p in range(b.index * b.size, (b.index + 1) * b.size):
            pk.owner[b.slot][p] = None
    for b, i in placed:
        b.index = i
        for p in range(i * b.size, (i + 1) * b.size):
            pk.owner[b.slot][p] = b
    pk.load = load


def rebalance(pk: Packing, lengths: Sequence[int], sizes: list[int], costs: list[float], budget: int,
               rounds: int) -> None:
    """Lower the busiest rank's load by moving or swapping one-rank documents between one-rank micro-batches
    (or into a free one-rank cell): at most ``rounds`` steps, each the best move or swap out of the busiest
    position that lowers the pair's larger load; the slot count, the budget and the groups stay."""
    for _ in range(rounds):
        p = max(range(pk.pool), key=lambda q: (pk.load[q], -q))
        mine = [b for row in pk.owner for b in (row[p],) if b is not None and b.size == 1 and b.docs]
        if not mine:
            return
        best = None  # (new larger load, kind, ...)
        top = pk.load[p]
        for q in sorted(range(pk.pool), key=lambda q: (pk.load[q], q)):
            if q == p or pk.load[q] >= top:
                break
            theirs = [b for row in pk.owner for b in (row[q],) if b is not None and b.size == 1]
            free = [s for s in range(pk.num_slots) if pk.owner[s][q] is None]
            for a in mine:
                for x in a.docs:
                    cx = costs[x]
                    if pk.load[q] + cx < top:  # move x to q: into a micro-batch with room, or a free cell
                        target = next((t for t in theirs if t.tokens + lengths[x] <= budget), None)
                        if target is not None or free:
                            key = max(top - cx, pk.load[q] + cx)
                            if best is None or key < best[0]:
                                best = (key, "move", a, x, target, q, free[0] if free else None)
                    for t in theirs:
                        for y in t.docs:
                            delta = cx - costs[y]
                            if delta <= 0 or pk.load[q] + delta >= top:
                                continue
                            if (a.tokens - lengths[x] + lengths[y] > budget
                                    or t.tokens - lengths[y] + lengths[x] > budget):
                                continue
                            key = max(top - delta, pk.load[q] + delta)
                            if best is None or key < best[0]:
                                best = (key, "swap", a, x, t, y)
        if best is None or best[0] >= top * (1 - 1e-9):
            return
        if best[1] == "move":
            _, _, a, x, target, q, slot = best
            pk.remove(a, x, lengths[x], costs[x])
            if target is None:
                target = pk.open(slot, 1, q, 0.0)
            pk.add(target, x, lengths[x], costs[x])
        else:
            _, _, a, x, t, y = best  # each keeps a document: neither cell is freed
            pk.add(a, y, lengths[y], costs[y])
            pk.add(t, x, lengths[x], costs[x])
            pk.remove(a, x, lengths[x], costs[x])
            pk.remove(t, y, lengths[y], costs[y])


def align_slots(pk: Packing, fixed: dict[int, float], passes: int = 3) -> None:
    """Order the slots' contents so that heavy micro-batches share slots, for a step whose slots wait for the
    pool's slowest rank (FSDP2 / ZeRO-3 gathers: the step takes the sum over slots of the slowest micro-batch).
    Per-rank sums, groups and bytes do not change. For every aligned block (sizes largest first), the slots in
    which the block's micro-batches lie inside it can trade those contents: the contents go heaviest first onto
    the slots whose busiest rank outside the block is heaviest (pairing two descending orders minimises the sum
    of the pairwise maxima, so no step raises the step time)."""
    num_slots, pool = pk.num_slots, pk.pool
    if num_slots < 2:
        return
    cost = [[0.0 if b is None else b.cost / b.size + fixed[b.size] for b in row] for row in pk.owner]

    def prefix_suffix(s: int) -> tuple[list[float], list[float]]:
        pre, suf = [0.0] * (pool + 1), [0.0] * (pool + 1)
        for p in range(pool):
            pre[p + 1] = max(pre[p], cost[s][p])
            suf[pool - 1 - p] = max(suf[pool - p], cost[s][pool - 1 - p])
        return pre, suf

    sizes = [c for c in (1 << k for k in range(pool.bit_length())) if c < pool and pool % c == 0]
    for _ in range(passes):
        changed = False
        for c in reversed(sizes):
            edges = [prefix_suffix(s) for s in range(num_slots)]
            for i in range(pool // c):
                lo, hi = i * c, (i + 1) * c
                inside = [s for s in range(num_slots) if all(
                    b is None or (b.index * b.size >= lo and (b.index + 1) * b.size <= hi) for b in pk.owner[s][lo:hi])]
                if len(inside) < 2:
                    continue
                inner = {s: max(cost[s][lo:hi]) for s in inside}
                outer = {s: max(edges[s][0][lo], edges[s][1][hi]) for s in inside}
                targets = sorted(inside, key=lambda s: (-outer[s], s))
                sources = sorted(inside, key=lambda s: (-inner[s], s))
                if targets == sources:
                    continue
                block = {s: (pk.owner[s][lo:hi], cost[s][lo:hi]) for s in inside}
                for t, src in zip(targets, sources):
                    owners, costs = block[src]
                    pk.owner[t][lo:hi] = owners
                    cost[t][lo:hi] = costs
                    for b in owners:
                        if b is not None:
                            b.slot = t
                for t in inside:
                    edges[t] = prefix_suffix(t)
                changed = True
        if not changed:
            return


def slot_sync_cost(pk: Packing, fixed: dict[int, float]) -> float:
    """The sum over slots of the busiest rank's cost in the slot."""
    return sum(max((b.cost / b.size + fixed[b.size] for b in row if b is not None), default=0.0) for row in pk.owner)


def _bin_load(b: Bin) -> float:
    """Each of the bin's positions' load in its slot: its share of the documents' cost and its fixed cost."""
    return b.cost / b.size + b.fixed if b.docs else 0.0


def smooth(pk: Packing, lengths: Sequence[int], sizes: Sequence[int], costs: Sequence[float],
           sweeps: int = 8, reach: int = 64) -> int:
    """Even the per-rank loads inside every slot by single-document moves and swaps between micro-batches
    (any slots, any sizes): a document goes only to a micro-batch at least as large as ``sizes[d]`` with room
    for it, and each step is the best one for the document that lowers the sum over micro-batches of ``size x
    load^2`` (``load`` the micro-batch's per-rank cost in its slot, fixed cost included). That sum falls only
    when work moves from a heavier micro-batch to a lighter one, so the slots' busiest ranks come down and their
    totals even out; a slot-sync step (:func:`slot_sync_cost`) is the sum of those busiest ranks. No slot is
    added and the budget holds. At most ``sweeps`` passes over the documents (heaviest first); stops at a pass
    that moves nothing. Each document tries the ``reach`` lightest micro-batches (as ordered at the pass's
    start) that are lighter than its own: the lightest take the most, and the search stays linear in the
    documents at 512 ranks. Returns the number of steps taken.

    The per-position loads over the step (``pk.load``) follow every step."""
    caps, c = {}, 1
    while c <= pk.pool:
        caps[c] = capacity(c, pk.budget, pk.pad)
        c *= 2
    where = {d: b for b in pk.bins for d in b.docs}
    steps = 0
    for _ in range(sweeps):
        moved = False
        order = sorted(pk.bins, key=lambda b: (_bin_load(b), b.slot, b.index * b.size))
        for x in sorted(where, key=lambda d: (-costs[d], d)):
            a, cx, nx = where[x], costs[x], lengths[x]
            la = _bin_load(a)
            # sum of size x load^2 changes by 2 dc (lb - la) + dc^2 (1/ca + 1/cb) for work dc moved from a to b:
            # never negative when lb >= la, so only lighter micro-batches are tried
            best: tuple[float, Bin, int | None] | None = None
            tried = 0
            for b in order:
                if tried >= reach:
                    break
                lb = _bin_load(b)
                if b is a or not b.docs or lb >= la or b.size < sizes[x]:
                    continue
                tried += 1
                if b.tokens + nx <= caps[b.size]:
                    gain = _moved_square(a, b, cx, la, lb, emptied=len(a.docs) == 1)
                    if gain < 0 and (best is None or gain < best[0]):
                        best = (gain, b, None)
                for y in b.docs:
                    cy = costs[y]
                    if (cy >= cx or a.size < sizes[y] or b.tokens - lengths[y] + nx > caps[b.size]
                            or a.tokens - nx + lengths[y] > caps[a.size]):
                        continue
                    gain = _moved_square(a, b, cx - cy, la, lb, emptied=False)
                    if gain < 0 and (best is None or gain < best[0]):
                        best = (gain, b, y)
            if best is None or best[0] > -1e-12 * la * la * a.size:
                continue
            _, b, y = best
            pk.add(b, x, nx, cx)
            if y is not None:  # a swap: each keeps a document, neither is emptied
                pk.remove(b, y, lengths[y], costs[y])
                pk.add(a, y, lengths[y], costs[y])
                where[y] = a
            pk.remove(a, x, nx, cx)
            where[x] = b
            steps += 1
            moved = True
        if not moved:
            break
    return steps


def _moved_square(a: Bin, b: Bin, dc: float, la: float, lb: float, *, emptied: bool) -> float:
    """The change of ``size x load^2`` over ``a`` and ``b`` when work ``dc`` moves from ``a`` to ``b``
    (``emptied``: ``a`` gave its last document away, and its fixed cost goes too)."""
    new_a = 0.0 if emptied else la - dc / a.size
    return a.size * (new_a * new_a - la * la) + b.size * ((lb + dc / b.size) ** 2 - lb * lb)


def fill_slots_first(lengths: Sequence[int], sizes: Sequence[int], costs: Sequence[float], num_slots: int,
                     pool: int, budget: int, pad: int, fixed: dict[int, float]) -> tuple[Packing, list[int]] | None:
    """A packing of ``num_slots`` slots built slot by slot, for an engine whose every slot waits for the pool's
    slowest rank: first each document whose cost on its group outweighs one slot's even per-rank share
    (``cost / c > total / (pool x num_slots)``) is spread over twice the ranks (again while it still does, up to
    the pool's largest group); then the documents, heaviest first, go to the slot with the least cost so far
    that has token room (``pool x budget``), so that every slot carries about an even share; then each slot is
    packed on its own (:func:`search_slots` with one slot). ``None`` when a slot's documents do not pack into
    it. Returns the packing and the group size each document was given."""
    largest = pool & -pool
    share = sum(costs) / (pool * num_slots)
    run = list(sizes)
    for d, c in enumerate(run):
        while c < largest and costs[d] / c > share:
            c *= 2
        run[d] = c
    slot_docs: list[list[int]] = [[] for _ in range(num_slots)]
    slot_cost, slot_tokens = [0.0] * num_slots, [0] * num_slots
    for d in sorted(range(len(lengths)), key=lambda d: (-costs[d], -lengths[d], d)):
        room = [s for s in range(num_slots) if slot_tokens[s] + lengths[d] <= pool * budget]
        if not room:
            return None
        s = min(room, key=lambda s: (slot_cost[s], s))
        slot_docs[s].append(d)
        slot_cost[s] += costs[d]
        slot_tokens[s] += lengths[d]
    pk = Packing(num_slots, pool, budget, pad)
    for s, docs in enumerate(slot_docs):
        one, _ = search_slots([lengths[d] for d in docs], [run[d] for d in docs], [costs[d] for d in docs], 1, 1,
                              pool, budget, pad, fixed)
        if one is None:
            return None
        for b in one.bins:
            nb = pk.open(s, b.size, b.index, fixed[b.size])
            for k in b.docs:
                pk.add(nb, docs[k], lengths[docs[k]], costs[docs[k]])
    return pk, run
