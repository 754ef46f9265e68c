"""Length-aware dynamic CP, the planner: which ranks run which documents, in how many slots (issue 32 §1).

Pure Python on host integers (the global batch's document lengths, the same on every rank), so every
rank derives the same plan with no message. The pool is the DP x SP ranks of one TP rank set,
numbered by position ``p = dp_rank * sp_size + sp_rank`` (``manager.grid.flatten()``); a group is an
aligned block of ``c`` positions, ``(c, i)`` = positions ``[i * c, (i + 1) * c)``, ``c`` a power of two
(:func:`seqpar.runtime.grid.dynamic_group_sizes`; the process groups are made once, at
``init_process_groups``).

The plan:

- Each document gets the smallest allowed group size ``c`` (``>= min_size``) whose share, ``len / c``
  tokens per rank (padded, see :func:`tokens_per_rank`), fits ``max_tokens_per_rank``: about
  ``ceil_pow2(len / max_tokens_per_rank)``, Megatron-Core's rule. A document longer than the largest
  group can hold is refused, naming the fix.
- A **slot** is one forward + backward on every rank of the pool: the groups in use partition the pool
  and each runs one micro-batch (its documents packed and cut over its ``c`` ranks), possibly empty (an
  uncovered aligned block of ``min_size`` positions runs an empty micro-batch over its group: alone at ``min_size``
  1). Every rank therefore runs the same number of
  forwards and backwards, and an engine's per-forward collectives (ZeRO-3 / FSDP2 gathers) stay matched.
- Objective, in order: no rank over the budget (a hard constraint); the least slots; per-rank cost
  balanced (max / mean over the step, fixed costs included); the fewest bytes. A heuristic, not an exact
  solver: slot counts are tried upwards from a lower bound (:func:`slots_lower_bound`: the tokens, and the
  documents that need the whole largest group and more than half its room, one per group and slot). In
  each try:

  1. greedy: the documents, largest groups and heaviest first, go onto the group whose busiest rank is
     least loaded after it (LPT; a new group counts its ring steps), or by best fit when that leaves one
     without room. A document joins a group larger than its own only where nothing of its own size has room
     (to save a slot; it adds no ring step);
  2. where the greedy misses, bin completion (the same size classes, largest first: each free block, then
     each larger group's room, or the rooms first as packed rows do, takes the subset of the remaining
     documents that fills it most, a subset sum): tight batches, whose tokens fill the bound's room
     exactly, reach the bound this way more often;
  3. balance: the micro-batches of one slot and size trade blocks (LPT, kept only when it lowers the busiest
     rank), then one-rank documents move or swap between one-rank micro-batches while that lowers the busiest
     rank.

  It does not move a document that fits a small group onto a larger one only to save a slot (beyond the room
  left in groups that run anyway): with the CPU ranks' calibrated fixed terms a whole-pool ring costs more
  than the slot it saves. With ``spread_heavy`` (opt-in), a document that alone outweighs an even share of
  the step (``slot_sync``: of one slot) runs on a larger group when that saves a slot, or takes no more
  slots and lowers the busiest rank's cost (``slot_sync``: the sum over slots of the busiest rank), ring
  steps included; with ``slot_sync`` it then evens each slot's ranks (moves and swaps, or the slots filled
  one by one with an even share of the cost each: :mod:`seqpar.sequence.packing`).
- Slot order: the slots' contents are ordered (per aligned block) so that heavy micro-batches share slots;
  per-rank sums do not change, the step time of an engine whose slots wait for the pool's slowest rank
  (FSDP2, ZeRO-3) does.
- Bytes at the least slots: on the benchmark's worst step (seed 0: five documents over 8192 tokens, each
  needing all 4 ranks at 4096 per rank) the 9 slots leave 1-rank room for only part of the short documents,
  and the rest must ride a ring whichever group takes them; the planner puts them in the smallest group with
  room, close to the bound the slot count sets (a hand count in BENCHMARKS.md).

Cost (:class:`CostModel`): per document, attention FLOPs per visible (query, key) pair times the
pairs its mask kind leaves visible (causal or full, sliding window, chunked, closed forms that equal
the attention planner's count), plus FLOPs per token for everything linear in the length (projections,
MLP, linear mixers). A micro-batch's cost is split evenly over its group's ranks (balanced sharding
inside the group), plus three terms in the same units that are not FLOPs: ``per_document_cost`` per document
(split over the group like its FLOPs: the document's own kernel calls and merges of partial results, in every
layer, head chunk and pass; documents of one length are stacked into one call, documents of distinct lengths,
as real data has, are not), ``micro_batch_cost`` per micro-batch and rank (empty ones too), and
``ring_step_cost`` per ring step, layer and pass (``2 layers (c - 1)`` steps on a group of ``c``). All default
to 0; ``python -m seqpar.bench dynamic --calibrate`` fits them to a machine's timings (:func:`fit_cost_terms`).
Bytes: the dense ring's per-rank volume of the group (:func:`ring_bytes_per_rank`).

Running a plan: :func:`seqpar.sequence.batch.rank_micro_batches` (and ``ShardedDataLoader(...,
dynamic=...)``, per step) gives each rank its micro-batches' inputs, each carrying its group
(:mod:`seqpar.sequence.call_group`), which a swapped model's attention and loss take from the call;
``launch/train.py --dynamic`` trains so under FSDP2. MoE router losses are computed per micro-batch over
its group (Megatron's choice; an empty micro-batch counts no token); the hybrid mixers take it from their
parent layer's call (:mod:`seqpar.mixers.documents`), ALiBi layers and MLA's latent path from the call
frame. Engines: FSDP2, DeepSpeed ZeRO-1/2/3 and ``SeqParTrainer``
(:func:`seqpar.integrations.dynamic.run_dynamic_step`).

The search itself (placement, bin completion, balance moves, slot order) is :mod:`seqpar.sequence.packing`.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from seqpar.runtime.grid import dynamic_group_sizes
from seqpar.sequence.packing import (
    Packing,
    align_slots,
    capacity,
    fill_slots_first,
    search_slots,
    slot_sync_cost,
    smooth,
)
from seqpar.sequence.sharding import SHARDINGS, length_multiple

if TYPE_CHECKING:
    from seqpar.config import DynamicConfig

__all__ = [
    "CostModel",
    "MicroBatch",
    "DynamicPlan",
    "plan_dynamic",
    "plan_from_config",
    "static_plan",
    "tokens_per_rank",
    "pad_multiple_of",
    "ring_bytes_per_rank",
    "visible_pairs",
    "fit_cost_terms",
    "slots_lower_bound",
    "RING_PASSES",
]


def visible_pairs(length: int, *, causal: bool = True, window: int | None = None, chunk_size: int | None = None) -> int:
    """Visible (query, key) pairs of one document of ``length`` tokens under seqpar's mask rules
    (:mod:`seqpar.attn.masks`): with ``chunk_size`` each chunk of the document is its own document;
    causal with ``window`` w: ``0 <= i - j < w``; full with ``window``: ``|i - j| < w``."""
    if chunk_size is not None and length > chunk_size:
        full, rest = divmod(length, chunk_size)
        return full * visible_pairs(chunk_size, causal=causal, window=window) + (
            visible_pairs(rest, causal=causal, window=window) if rest else 0)
    n = length
    w = n if window is None else min(window, n)
    if causal:  # row i sees min(i + 1, w) keys
        return w * (w + 1) // 2 + (n - w) * w
    m = w - 1  # distances 1..m on both sides of the diagonal
    return n + 2 * (m * n - m * (m + 1) // 2)


@dataclass(frozen=True)
class CostModel:
    """What one document costs, per layer, forward (the backward is a constant multiple of both terms),
    and what its ring moves. Units are the caller's (FLOPs with :meth:`transformer`).

    Attributes:
        causal: the mask kind: causal (``True``) or full.
        window: sliding window (``>= 1``) or ``None``.
        chunk_size: chunked local attention (Llama 4) or ``None``.
        pair_cost: cost of one visible (query, key) pair (FLOPs: ``4 * q_heads * head_dim``).
        token_cost: cost of one token in everything linear in the length: projections, MLP (the active
            experts of an MoE), linear-attention and state-space mixers.
        kv_width: values per token a ring moves (``2 * kv_heads * head_dim`` for K and V; an MLA
            model's latent width when it sends latents).
        elem_bytes: bytes per K/V value in flight (2 for bf16).
        acc_bytes: bytes per value of the travelling dK/dV accumulators (fp32: 4).
        layers: attention layers (the bytes and the cost scale with it).
        micro_batch_cost: what every rank pays per micro-batch it runs, whatever its tokens (host work per
            call: the module calls, the loss, the autograd graph), in the same units as the document cost.
            An empty micro-batch pays it too (it runs two padding tokens through every layer).
        ring_step_cost: what one ring step costs one rank in one layer and one pass (the step's launch and
            copies, not its bytes), in the same units; a micro-batch on a group of ``c`` ranks pays it
            ``RING_PASSES * layers * (c - 1)`` times (:meth:`fixed_cost`).
        per_document_cost: what one document costs besides its FLOPs, over all layers and passes (on the CPU
            path: one attention kernel call per document piece, head chunk, layer and pass, and the merge of
            its partial result; documents of equal length share a stacked call, distinct lengths do not),
            in the same units; split over the group's ranks like the document's FLOPs
            (:meth:`planned_cost`).

    The fixed terms default to 0 (a pure FLOP model); ``python -m seqpar.bench dynamic --calibrate`` fits
    them on the machine (:func:`fit_cost_terms`; BENCHMARKS.md "Length-aware dynamic CP"), and the bench's
    :data:`seqpar.bench.dynamic.TINY_LLAMA` carries the last fit.
    """

    causal: bool = True
    window: int | None = None
    chunk_size: int | None = None
    pair_cost: float = 1.0
    token_cost: float = 0.0
    kv_width: int = 1
    elem_bytes: int = 2
    acc_bytes: int = 4
    layers: int = 1
    micro_batch_cost: float = 0.0
    ring_step_cost: float = 0.0
    per_document_cost: float = 0.0

    def __post_init__(self) -> None:
        for name in ("window", "chunk_size"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"CostModel.{name} = {v!r}: expected a positive integer or None")
        for name in ("pair_cost", "token_cost", "micro_batch_cost", "ring_step_cost", "per_document_cost"):
            if not (getattr(self, name) >= 0 and math.isfinite(getattr(self, name))):
                raise ValueError(f"CostModel.{name} = {getattr(self, name)!r}: expected a finite number >= 0")
        for name in ("kv_width", "elem_bytes", "acc_bytes", "layers"):
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"CostModel.{name} = {getattr(self, name)!r}: expected a positive integer")

    @classmethod
    def transformer(
        cls, hidden_size: int, intermediate_size: int, *, q_heads: int, kv_heads: int, head_dim: int | None = None,
        layers: int = 1, active_mlps: int = 1, mixer_token_flops: float = 0.0, causal: bool = True,
        window: int | None = None, chunk_size: int | None = None, elem_bytes: int = 2,
        micro_batch_cost: float = 0.0, ring_step_cost: float = 0.0, per_document_cost: float = 0.0,
    ) -> CostModel:
        """Forward FLOPs of a decoder layer: 2 per multiply-add of the q/k/v/o projections and a gated
        MLP (``active_mlps`` of them: an MoE's active experts), plus ``mixer_token_flops``; attention
        ``4 * q_heads * head_dim`` per visible pair (QK^T and PV)."""
        d = head_dim or hidden_size // q_heads
        proj = hidden_size * d * (2 * q_heads + 2 * kv_heads)
        mlp = 3 * hidden_size * intermediate_size * active_mlps
        return cls(causal=causal, window=window, chunk_size=chunk_size, pair_cost=4.0 * q_heads * d,
                   token_cost=2.0 * (proj + mlp) + mixer_token_flops, kv_width=2 * kv_heads * d,
                   elem_bytes=elem_bytes, layers=layers, micro_batch_cost=micro_batch_cost,
                   ring_step_cost=ring_step_cost, per_document_cost=per_document_cost)

    def pairs(self, length: int) -> int:
        """Visible pairs of one document (see :func:`visible_pairs`)."""
        return visible_pairs(length, causal=self.causal, window=self.window, chunk_size=self.chunk_size)

    def document_cost(self, length: int) -> float:
        """One document's cost over all layers: ``layers * (pair_cost * pairs + token_cost * length)``."""
        return self.layers * (self.pair_cost * self.pairs(length) + self.token_cost * length)

    def planned_cost(self, length: int) -> float:
        """What the planner charges for one document, split over its group: :meth:`document_cost` plus
        ``per_document_cost``."""
        return self.document_cost(length) + self.per_document_cost

    def ring_steps(self, size: int) -> int:
        """Ring steps one rank of a group of ``size`` runs per micro-batch: ``size - 1`` hops in each layer's
        forward and backward."""
        return RING_PASSES * self.layers * (size - 1)

    def fixed_cost(self, size: int, *, empty: bool = False) -> float:
        """The fixed cost one rank of a group of ``size`` pays for one micro-batch, besides its documents:
        ``micro_batch_cost + ring_step_cost * ring_steps(size)``; an empty micro-batch (one rank, padding)
        pays ``micro_batch_cost`` only."""
        return self.micro_batch_cost + (0.0 if empty else self.ring_step_cost * self.ring_steps(size))


RING_PASSES = 2
"""Ring passes per layer and micro-batch: the forward's ``c - 1`` hops and the backward's ``c - 1``."""


def fit_cost_terms(samples: Sequence[Sequence[float]]) -> dict[str, float]:
    """Least-squares fit of ``seconds = a * work + b * micro_batches + r * ring_steps + d * documents`` (no
    intercept).

    Args:
        samples: ``(work, micro_batches, ring_steps, documents, seconds)`` per measurement, ``work`` in the cost
            model's units (forward FLOPs), ``ring_steps`` as :meth:`CostModel.ring_steps` counts them,
            ``documents`` per rank (a micro-batch's documents over its group's size, as
            :meth:`CostModel.planned_cost` splits them). ``(work, micro_batches, ring_steps, seconds)`` (no
            document column) fits the first three terms only (``d = 0``).

    Returns:
        ``seconds_per_unit`` (``a``), and the other terms in the cost model's units: ``micro_batch_cost =
        b / a``, ``ring_step_cost = r / a``, ``per_document_cost = d / a`` (what :class:`CostModel` takes),
        with ``micro_batch_s``, ``ring_step_s`` and ``per_document_s`` in seconds and ``residual_rel`` (the
        root-mean-square residual over the mean seconds). A term the data would make negative is pinned to 0
        and the rest refitted.

    Raises:
        ValueError: fewer than 3 samples, samples of mixed or wrong length, or samples that cannot tell the
            terms apart.
    """
    rows = [tuple(float(v) for v in sample) for sample in samples]
    if len(rows) < 3 or len({len(r) for r in rows}) != 1 or len(rows[0]) not in (4, 5):
        raise ValueError(f"fit_cost_terms: needs at least 3 samples of (work, micro_batches, ring_steps, documents, "
                         f"seconds) or of (work, micro_batches, ring_steps, seconds), all alike; got {len(rows)}")
    if len(rows[0]) == 4:
        rows = [(w, m, k, 0.0, t) for w, m, k, t in rows]
        active = [0, 1, 2]
    else:
        active = [0, 1, 2, 3]
    while True:
        coef = _least_squares([[r[j] for j in active] for r in rows], [r[4] for r in rows])
        if coef is None:
            raise ValueError("fit_cost_terms: the samples do not tell work, micro-batches, ring steps and documents "
                             "apart (vary the FLOPs per micro-batch, the group size and the documents per micro-batch)")
        full = dict(zip(active, coef))
        negative = [j for j in active if j != 0 and full[j] < 0]
        if not negative:
            break
        active.remove(negative[0])
    a, b, r, d = (full.get(j, 0.0) for j in range(4))
    if not a > 0:
        raise ValueError(f"fit_cost_terms: the fitted seconds per unit of work is {a!r}: the samples' time does not "
                         "grow with their work (measure larger micro-batches)")
    pred = [a * w + b * m + r * k + d * n for w, m, k, n, _ in rows]
    mean = sum(row[4] for row in rows) / len(rows)
    rms = math.sqrt(sum((p_ - row[4]) ** 2 for p_, row in zip(pred, rows)) / len(rows))
    return {"seconds_per_unit": a, "micro_batch_s": b, "ring_step_s": r, "per_document_s": d,
            "micro_batch_cost": b / a, "ring_step_cost": r / a, "per_document_cost": d / a,
            "residual_rel": rms / mean if mean else 0.0}


def _least_squares(x: list[list[float]], y: list[float]) -> list[float] | None:
    """Solve the normal equations of ``x @ c ~ y`` (columns scaled to unit norm; Gauss-Jordan with partial
    pivoting); ``None`` when they are singular."""
    k = len(x[0])
    scale = [math.sqrt(sum(row[j] ** 2 for row in x)) or 1.0 for j in range(k)]
    xs = [[row[j] / scale[j] for j in range(k)] for row in x]
    m = [[sum(r[i] * r[j] for r in xs) for j in range(k)] + [sum(r[i] * t for r, t in zip(xs, y))] for i in range(k)]
    for col in range(k):
        piv = max(range(col, k), key=lambda i: abs(m[i][col]))
        if abs(m[piv][col]) < 1e-9:
            return None
        m[col], m[piv] = m[piv], m[col]
        for i in range(k):
            if i != col:
                f = m[i][col] / m[col][col]
                m[i] = [a - f * b for a, b in zip(m[i], m[col])]
    return [m[i][k] / m[i][i] / scale[i] for i in range(k)]


def tokens_per_rank(tokens: int, size: int, pad_multiple: int = 2) -> int:
    """Tokens each rank of a group of ``size`` ranks holds for a micro-batch of ``tokens``: the packed sequence
    padded to a multiple of ``pad_multiple * size`` and cut evenly, as
    :func:`seqpar.sequence.batch.shard_batch` cuts it, on one rank too (its whole row, padded).
    ``pad_multiple`` is what the sharding pads one rank's share to (:func:`pad_multiple_of`: 1 contiguous,
    2 zigzag, 8 ``balanced``)."""
    return -(-tokens // (pad_multiple * size)) * pad_multiple


def pad_multiple_of(sharding: str) -> int:
    """The ``pad_multiple`` of ``sharding``: what :func:`seqpar.sequence.batch.shard_batch` pads each rank's
    share of a micro-batch to (:func:`seqpar.sequence.sharding.length_multiple` of one rank: 1 contiguous,
    2 zigzag, 8 ``balanced``), so the plan counts the tokens the cut holds."""
    return length_multiple(1, sharding)


def ring_bytes_per_rank(tokens_local: int, size: int, cost: CostModel) -> int:
    """Bytes one rank of a ring of ``size`` ranks sends for a micro-batch of ``tokens_local`` tokens
    per rank, forward + backward, all layers: ``size - 1`` K/V blocks forward, the same again in the
    backward and ``size - 1`` travelling dK/dV accumulators (DESIGN.md "Ring volume"; the same formula
    as :func:`seqpar.attn.latent.ring_bytes_per_rank`, dense: no hop skipped). An all-gather moves the
    same volume. 0 on one rank."""
    return (size - 1) * tokens_local * cost.kv_width * (2 * cost.elem_bytes + cost.acc_bytes) * cost.layers


@dataclass(frozen=True)
class MicroBatch:
    """What the ranks of one group run in one slot.

    Attributes:
        slot: the slot (0-based).
        size: ranks in the group (a power of two).
        index: which aligned group: pool positions ``[index * size, (index + 1) * size)``.
        docs: indices into the planned lengths, in packing order (empty: an empty micro-batch).
        tokens: the documents' total length.
        tokens_per_rank: each rank's share, padded (:func:`tokens_per_rank`); ``<=`` the budget.
        cost_per_rank: the documents' cost (:meth:`CostModel.planned_cost`: FLOPs and the per-document term)
            over the group's ranks plus the fixed cost one rank pays for the
            micro-batch (:meth:`CostModel.fixed_cost`; an empty one pays ``micro_batch_cost``).
        bytes_per_rank: each rank's ring bytes (:func:`ring_bytes_per_rank`).
    """

    slot: int
    size: int
    index: int
    docs: tuple[int, ...]
    tokens: int
    tokens_per_rank: int
    cost_per_rank: float
    bytes_per_rank: int

    @property
    def positions(self) -> range:
        """The pool positions of the group."""
        return range(self.index * self.size, (self.index + 1) * self.size)


@dataclass(frozen=True)
class DynamicPlan:
    """A step's plan: ``slots[s]`` is slot ``s``'s micro-batches, ordered by position, covering the pool
    exactly once. Per-rank figures are indexed by pool position and summed over the step.

    Attributes:
        pool_size, max_tokens_per_rank, min_size: the planner's inputs.
        lengths: the documents' lengths, as given.
        doc_sizes: each document's group size.
        slots: the micro-batches of every slot.
        rank_cost, rank_tokens, rank_bytes: per pool position, over the step.
        slots_lower_bound: ``ceil(total tokens / (pool * budget))``: no plan has fewer slots.
    """

    pool_size: int
    max_tokens_per_rank: int
    min_size: int
    lengths: tuple[int, ...]
    doc_sizes: tuple[int, ...]
    slots: tuple[tuple[MicroBatch, ...], ...]
    rank_cost: tuple[float, ...]
    rank_tokens: tuple[int, ...]
    rank_bytes: tuple[int, ...]
    slots_lower_bound: int

    @property
    def num_slots(self) -> int:
        return len(self.slots)

    @property
    def balance(self) -> float:
        """Per-rank cost max / mean over the step (1.0: perfectly even; 1.0 for an empty step)."""
        total = sum(self.rank_cost)
        return max(self.rank_cost) * len(self.rank_cost) / total if total > 0 else 1.0

    @property
    def bytes_max(self) -> int:
        """The most bytes any rank sends over the step."""
        return max(self.rank_bytes)

    @property
    def peak_tokens_per_rank(self) -> int:
        """The most tokens any rank holds in one slot (``<= max_tokens_per_rank``)."""
        return max((mb.tokens_per_rank for slot in self.slots for mb in slot), default=0)

    @property
    def groups(self) -> tuple[tuple[int, int], ...]:
        """The ``(size, index)`` of every group the plan uses with a non-empty micro-batch, sorted."""
        return tuple(sorted({(mb.size, mb.index) for slot in self.slots for mb in slot if mb.docs}))

    def micro_batch(self, position: int, slot: int) -> MicroBatch:
        """The micro-batch pool position ``position`` runs in ``slot``."""
        for mb in self.slots[slot]:
            if position in mb.positions:
                return mb
        raise ValueError(f"position {position} is outside the pool of {self.pool_size} ranks")

    def summary(self) -> dict[str, object]:
        """The plan's figures as plain data (for JSON reports)."""
        return {
            "pool": self.pool_size, "max_tokens_per_rank": self.max_tokens_per_rank, "min_size": self.min_size,
            "documents": len(self.lengths), "slots": self.num_slots, "slots_lower_bound": self.slots_lower_bound,
            "balance_max_over_mean": self.balance, "bytes_max_per_rank": self.bytes_max,
            "peak_tokens_per_rank": self.peak_tokens_per_rank,
            "documents_per_size": {str(c): self.doc_sizes.count(c) for c in sorted(set(self.doc_sizes))},
            "rank_cost": list(self.rank_cost), "rank_tokens": list(self.rank_tokens),
            "rank_bytes": list(self.rank_bytes),
        }


def _check_args(lengths: Sequence[int], pool_size: int, max_tokens_per_rank: int, pad_multiple: int) -> None:
    for name, v in (("pool_size", pool_size), ("max_tokens_per_rank", max_tokens_per_rank),
                    ("pad_multiple", pad_multiple)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"plan_dynamic: {name} = {v!r} is invalid: expected a positive integer")
    bad = [(i, n) for i, n in enumerate(lengths) if isinstance(n, bool) or not isinstance(n, int) or n < 0]
    if bad:
        raise ValueError(f"plan_dynamic: document lengths must be integers >= 0 (0: an empty document, which "
                         f"runs nowhere); got {bad[:5]} (index, length)")


def slots_lower_bound(lengths: Sequence[int], sizes: Sequence[int], pool: int, budget: int, pad: int = 2) -> int:
    """No plan has fewer slots: the larger of the token bound, ``ceil(tokens / (pool * budget))``, and the
    big documents' forced slots: a document on the largest group ``cmax`` holding more than half of what that
    group holds (:func:`~seqpar.sequence.packing.capacity`) shares it with no other such document, and a slot has
    ``pool / cmax`` of them."""
    tokens = -(-sum(lengths) // (pool * budget))
    if not sizes:
        return max(1, tokens)
    cmax = max(sizes)
    # no two of them fit one group: more than half its capacity each, counted in tokens (a padded share over half
    # the budget is not enough: two 3-token documents on 4 ranks at pad 8 hold 8 tokens per rank each, and 8
    # together; fuzzer case 850779075 had 3 empty slots of 5 from it)
    big = sum(1 for n, c in zip(lengths, sizes) if c == cmax and 2 * n > capacity(cmax, budget, pad)
              and cmax == (pool & -pool))
    return max(1, tokens, -(-big // (pool // cmax)))


def plan_dynamic(
    lengths: Sequence[int], pool_size: int, max_tokens_per_rank: int, *, min_size: int = 1,
    cost: CostModel | None = None, pad_multiple: int = 2, spread_heavy: bool = False, slot_sync: bool = False,
) -> DynamicPlan:
    """Plan one step of length-aware dynamic CP (see the module docstring).

    Args:
        lengths: every document length of the global batch (host ints, the same on every rank).
        pool_size: the DP x SP ranks of one TP rank set.
        max_tokens_per_rank: the most tokens a rank may hold in one micro-batch.
        min_size: the smallest group a document may get (a power of two dividing the pool).
        cost: the model's cost (default: causal attention pairs only, no fixed terms). Its fixed terms
            (:meth:`CostModel.fixed_cost`) and per-document term (:meth:`CostModel.planned_cost`) are balanced
            with the documents' cost, and a new group of ``c``
            ranks is charged its ring steps, so a larger group is chosen only where it pays for them.
        pad_multiple: a group of ``c > 1`` pads its micro-batch to a multiple of ``pad_multiple * c``.
        spread_heavy: run a document whose cost on its own group exceeds an even share of the step (``cost /
            c > total / pool``) on a larger group when that takes no more slots and lowers the busiest rank's
            planned cost, ring steps included (by 1% at least; the objective's balance before bytes). Off by
            default; with a cost model whose ``ring_step_cost`` is too small (a pure FLOP model on a machine
            where a ring step has a real fixed cost) it spreads documents over rings for nothing.
        slot_sync: with ``spread_heavy``, for an engine whose every slot waits for the pool's slowest rank
            (FSDP2 and ZeRO-3 gather per forward): a document is heavy when its share outweighs an even share
            of one slot (``cost / c > total / (pool * slots)``), and a spread is kept when it lowers the sum
            over slots of the busiest rank's planned cost (the step time of such an engine) by 1% at least.
            Then each slot's balance: the plan so far, the same smoothed (:func:`~seqpar.sequence.packing.smooth`:
            single-document moves and swaps from heavier micro-batches to lighter ones, any slot) and a plan built
            slot by slot (:func:`~seqpar.sequence.packing.fill_slots_first`: each slot given an even share of the
            step's cost, then packed alone, then smoothed) compete by the objective's order, the least slots and
            then that sum. Without it the busiest rank's cost over the step decides (DDP, ZeRO-1/2: the per-rank
            balance of the objective).

    Returns:
        The :class:`DynamicPlan`; a permutation of ``lengths`` permutes the document indices in it and
        changes no per-rank figure (documents are ordered by length, cost and then index).

    Raises:
        ValueError: a length that is not an integer >= 0 (a zero-length document is dropped: it runs in no
            micro-batch); a bad pool, budget or ``min_size``; a
            document longer than the largest group (``pool``'s largest power-of-two divisor) can hold.
    """
    _check_args(lengths, pool_size, max_tokens_per_rank, pad_multiple)
    if 0 in lengths:
        # A zero-length document (an empty sample from the collator) holds no token and no target: dropped. It runs in
        # no micro-batch, so it costs no per-document term, no slot and no room; planned alone, the other documents
        # get the plan they get without it (their indices mapped back to the given ones). A document too long is
        # refused here first, by its index among the given lengths (fuzzer case 304181941: the plan of the others
        # named [0, 1, 8, 4, 12, ...]'s 12 "document 3")
        allowed = dynamic_group_sizes(pool_size, min_size)
        for i, n in enumerate(lengths):
            _group_size(i, n, allowed, max_tokens_per_rank, pad_multiple)
        kept = [i for i, n in enumerate(lengths) if n]
        plan = plan_dynamic([lengths[i] for i in kept], pool_size, max_tokens_per_rank, min_size=min_size, cost=cost,
                            pad_multiple=pad_multiple, spread_heavy=spread_heavy, slot_sync=slot_sync)
        return _with_empty_documents(plan, lengths, kept)
    cost = cost if cost is not None else CostModel()
    allowed = dynamic_group_sizes(pool_size, min_size)
    budget, pad = max_tokens_per_rank, pad_multiple
    sizes = [_group_size(i, n, allowed, budget, pad) for i, n in enumerate(lengths)]
    costs = [cost.planned_cost(n) for n in lengths]
    fixed = {c: cost.ring_step_cost * cost.ring_steps(c) for c in allowed}
    lower = slots_lower_bound(lengths, sizes, pool_size, budget, pad)
    packing, num_slots = search_slots(lengths, sizes, costs, lower, None, pool_size, budget, pad, fixed)
    # Balance before bytes (spread_heavy): a document whose share on its own group outweighs an even share of
    # the step (cost / c > total / pool) bounds the busiest rank from below however the rest is placed; spread
    # it over twice the ranks (more ring bytes and ring steps, less work on the busiest rank) while that takes
    # no more slots and lowers the busiest rank's planned cost, ring steps included, by at least 1%.
    mean = sum(costs) / pool_size
    run_sizes = list(sizes)

    def objective(pk: Packing) -> float:
        if not slot_sync:
            return max(pk.load)
        align_slots(pk, fixed)
        return slot_sync_cost(pk, fixed)

    while spread_heavy:
        share = mean / num_slots if slot_sync else mean
        heavy = {d for d, c in enumerate(run_sizes) if c < allowed[-1] and costs[d] / c > share}
        if not heavy:
            break
        wider = [2 * c if d in heavy else c for d, c in enumerate(run_sizes)]
        wide_packing, wide_slots = search_slots(lengths, wider, costs, lower, num_slots, pool_size, budget, pad, fixed)
        if wide_packing is None or (wide_slots == num_slots and objective(wide_packing) >= 0.99 * objective(packing)):
            break  # kept when it saves a slot (the objective's order), else when it lowers the busiest rank by 1%
        packing, num_slots, run_sizes = wide_packing, wide_slots, wider
    if spread_heavy and slot_sync:
        packing = _slot_balanced(packing, lengths, sizes, costs, lower, pool_size, budget, pad, fixed, objective)
        num_slots = packing.num_slots
    align_slots(packing, fixed)
    return _finish(packing, lengths, sizes, cost, pool_size, budget, min_size, lower, num_slots)


def _group_size(i: int, n: int, allowed: Sequence[int], budget: int, pad: int) -> int:
    """The smallest allowed group whose ranks hold document ``i`` (``n`` tokens) within ``budget`` each; raises
    the planner's ValueError, naming document ``i``, where none does."""
    c = next((c for c in allowed if tokens_per_rank(n, c, pad) <= budget), None)
    if c is None:
        cmax = allowed[-1]
        raise ValueError(
            f"plan_dynamic: document {i} has {n} tokens, more than the largest group of {cmax} ranks holds at "
            f"sequence_parallel.dynamic.max_tokens_per_rank = {budget} ({cmax} x {budget}, padded to a "
            f"multiple of {pad * cmax}): raise max_tokens_per_rank to at least {tokens_per_rank(n, cmax, pad)}, "
            "use a pool with a larger power-of-two group (more DP x SP ranks), or cut the document"
            + (f"; max_tokens_per_rank is not a multiple of {pad}, what the sharding pads each rank's share to: "
               f"choose a multiple of {pad}" if budget % pad else "")
        )
    return c


def _with_empty_documents(plan: DynamicPlan, lengths: Sequence[int], kept: list[int]) -> DynamicPlan:
    """``plan`` (of the documents ``kept`` of ``lengths``) as a plan of all ``lengths``: document indices mapped back,
    each zero-length document in no micro-batch with the smallest group size (it holds nothing)."""
    smallest = dynamic_group_sizes(plan.pool_size, plan.min_size)[0]
    sizes = [smallest] * len(lengths)
    for d, c in zip(kept, plan.doc_sizes):
        sizes[d] = c
    slots = tuple(tuple(dataclasses.replace(mb, docs=tuple(kept[d] for d in mb.docs)) for mb in slot)
                  for slot in plan.slots)
    return dataclasses.replace(plan, lengths=tuple(lengths), doc_sizes=tuple(sizes), slots=slots)


def plan_from_config(lengths: Sequence[int], pool_size: int, dynamic: DynamicConfig,
                     cost: CostModel | None = None, *, sharding: str = "zigzag") -> DynamicPlan:
    """:func:`plan_dynamic` with the ``sequence_parallel.dynamic`` block's settings
    (:class:`seqpar.config.DynamicConfig`): ``max_tokens_per_rank``, ``min_size``, and ``balance="slot"`` as
    ``spread_heavy=True, slot_sync=True`` (``"step"``: neither); ``pad_multiple`` is the run's ``sharding``'s
    (:func:`pad_multiple_of`: the cut's), so the plan's ``tokens_per_rank`` figures are what
    :func:`seqpar.sequence.batch.rank_micro_batches` cuts. What the loader, ``plan_step`` and the launcher plan
    with (``sharding``: the run's resolved sharding; the default, zigzag, pads as the planner always did)."""
    if sharding not in SHARDINGS:
        raise ValueError(f"plan_from_config: unknown sharding {sharding!r}; choose one of {list(SHARDINGS)}")
    slot = dynamic.balance == "slot"
    return plan_dynamic(lengths, pool_size, dynamic.max_tokens_per_rank, min_size=dynamic.min_size, cost=cost,
                        pad_multiple=pad_multiple_of(sharding), spread_heavy=slot, slot_sync=slot)


def _slot_balanced(packing: Packing, lengths: Sequence[int], sizes: list[int], costs: list[float], lower: int,
                   pool: int, budget: int, pad: int, fixed: dict[int, float],
                   objective: Callable[[Packing], float]) -> Packing:
    """For a slot-sync engine: the best of ``packing``, ``packing`` smoothed (:func:`smooth`) and a packing
    built slot by slot (:func:`fill_slots_first`, at the least slots from ``lower`` up to ``packing``'s that
    it packs, then smoothed), by the objective's order: the least slots, then the least ``objective`` (the
    sum over slots of the busiest rank's cost)."""
    candidates = [packing, copy.deepcopy(packing)]
    smooth(candidates[1], lengths, sizes, costs)
    for num_slots in range(lower, packing.num_slots + 1):
        built = fill_slots_first(lengths, sizes, costs, num_slots, pool, budget, pad, fixed)
        if built is not None:
            smooth(built[0], lengths, sizes, costs)
            candidates.append(built[0])
            break
    return min(candidates, key=lambda pk: (pk.num_slots, objective(pk)))


def _finish(pk: Packing, lengths: Sequence[int], sizes: list[int], cost: CostModel, pool: int, budget: int,
            min_size: int, lower: int, num_slots: int) -> DynamicPlan:
    """Freeze a packing: an empty micro-batch over each aligned block of ``min_size`` positions no group covers
    (one rank at ``min_size`` 1); per-rank sums, fixed costs included."""
    slots = []
    rank_cost, rank_tokens, rank_bytes = [0.0] * pool, [0] * pool, [0] * pool
    for s in range(num_slots):
        row: list[MicroBatch] = []
        seen: set[int] = set()
        for p in range(pool):
            b = pk.owner[s][p]
            if b is None:
                # every group holding documents is an aligned block of >= min_size positions, so the uncovered ones
                # form whole aligned blocks of min_size: each runs its empty micro-batch over that block's group, the
                # smallest made (a group of 1 at min_size > 1 does not exist: fuzzer case 850779075)
                if p % min_size == 0:
                    row.append(MicroBatch(s, min_size, p // min_size, (), 0, 0, cost.fixed_cost(min_size, empty=True),
                                          0))
                rank_cost[p] += cost.fixed_cost(min_size, empty=True)
                continue
            if id(b) in seen:
                continue
            seen.add(id(b))
            local = tokens_per_rank(b.tokens, b.size, pk.pad)
            docs = tuple(sorted(b.docs, key=lambda d: (-lengths[d], d)))
            mb = MicroBatch(s, b.size, b.index, docs, b.tokens, local,
                            sum(cost.planned_cost(lengths[d]) for d in docs) / b.size + cost.fixed_cost(b.size),
                            ring_bytes_per_rank(local, b.size, cost))
            row.append(mb)
            for q in mb.positions:
                rank_cost[q] += mb.cost_per_rank
                rank_tokens[q] += local
                rank_bytes[q] += mb.bytes_per_rank
        slots.append(tuple(sorted(row, key=lambda mb: mb.index * mb.size)))
    return DynamicPlan(pool, budget, min_size, tuple(lengths), tuple(sizes), tuple(slots), tuple(rank_cost),
                       tuple(rank_tokens), tuple(rank_bytes), lower)


def static_plan(
    rows: Sequence[Sequence[int]], pool_size: int, sp_size: int, *, cost: CostModel | None = None,
    pad_multiple: int = 2,
) -> DynamicPlan:
    """Static DP x SP over the same pool, for comparison: ``rows`` are packed rows (each a list of
    document lengths), dealt to the ``pool / sp_size`` SP groups in order (slot ``s``, group ``g`` runs
    row ``s * dp + g``; missing rows are empty). Each row's cost is split evenly over its SP group (the
    ideal of balanced sharding). ``max_tokens_per_rank`` of the result is the largest share held."""
    if isinstance(sp_size, bool) or not isinstance(sp_size, int) or sp_size < 1 or pool_size % sp_size:
        raise ValueError(f"static_plan: sp_size {sp_size!r} must be a positive divisor of the pool {pool_size}")
    cost = cost if cost is not None else CostModel()
    dp = pool_size // sp_size
    lengths = [n for row in rows for n in row]
    _check_args(lengths, pool_size, 1, pad_multiple)
    slots, first = [], 0
    rank_cost, rank_tokens, rank_bytes = [0.0] * pool_size, [0] * pool_size, [0] * pool_size
    starts = []
    for row in rows:
        starts.append(first)
        first += len(row)
    for s in range(max(1, -(-len(rows) // dp))):
        row_mbs = []
        for g in range(dp):
            r = s * dp + g
            if r >= len(rows):
                row_mbs += [MicroBatch(s, 1, g * sp_size + q, (), 0, 0, cost.fixed_cost(1, empty=True), 0)
                            for q in range(sp_size)]
                for q in range(sp_size):
                    rank_cost[g * sp_size + q] += cost.fixed_cost(1, empty=True)
                continue
            docs = tuple(range(starts[r], starts[r] + len(rows[r])))
            tokens = sum(rows[r])
            local = tokens_per_rank(tokens, sp_size, pad_multiple)
            mb = MicroBatch(s, sp_size, g, docs, tokens, local,
                            sum(cost.planned_cost(n) for n in rows[r]) / sp_size + cost.fixed_cost(sp_size),
                            ring_bytes_per_rank(local, sp_size, cost))
            row_mbs.append(mb)
            for q in mb.positions:
                rank_cost[q] += mb.cost_per_rank
                rank_tokens[q] += local
                rank_bytes[q] += mb.bytes_per_rank
        slots.append(tuple(row_mbs))
    peak = max((mb.tokens_per_rank for slot in slots for mb in slot), default=1)
    sizes = tuple(sp_size for _ in lengths)
    return DynamicPlan(pool_size, max(peak, 1), sp_size, tuple(lengths), sizes, tuple(slots), tuple(rank_cost),
                       tuple(rank_tokens), tuple(rank_bytes), len(slots))
