"""The ``attention`` and ``dilated`` kinds of the composition fuzzer (:mod:`seqpar.testing.fuzz`): their draws
(plain JSON-able dicts; every tensor is rebuilt from the case seed) and their one-line summaries.

Each draw reads its generator in a fixed order; a new axis is drawn after the old ones, so that every case seed
keeps the draws it had before (the comments below name the session that added each). The tensors, references,
rank task and judging of these kinds are in :mod:`seqpar.testing.fuzz_attention_run`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from seqpar.testing.fuzz_strides import STRIDES

__all__ = ["HEADS", "GRADS", "CU_AS", "EMPTY_DOCUMENTS_RATE", "ODD_LOCAL_RATE", "draw_documents", "draw_empty_documents",
           "with_empty_documents", "empty_documents_applied", "draw_odd_local", "odd_local_applied", "WIDE_BATCH_RATE",
           "draw_wide_batch", "wide_batch_applied", "DISAGREE_RATE", "DISAGREEMENTS", "draw_disagree", "disagreement",
           "disagreeing_inputs",
           "STRIDED_PAIRS_RATE", "draw_strided_pairs", "sp_groups", "BIG_SCALE_RATE", "draw_big_scale",
           "big_scale_applied", "DISAGREE_INPUT_RATE", "DISAGREE_INPUTS", "draw_disagree_input", "input_disagreement",
           "DISAGREE_SHAPE_RATE", "DISAGREE_SHAPES", "DILATED_DISAGREE_INPUTS", "draw_disagree_shape",
           "draw_world_mode", "OptionRates", "ATTENTION_RATES", "draw_call_options", "draw_attention",
           "draw_dilated", "attention_summary"]

# (q_heads, kv_heads, qk_head_dim, v_head_dim): MHA, GQA, MQA, an odd head dim, MLA-like V dim apart
HEADS = ((4, 2, 8, 8), (4, 1, 6, 6), (2, 2, 8, 8), (4, 4, 4, 4), (8, 2, 8, 8), (4, 2, 8, 4), (3, 1, 5, 5),
          (6, 3, 4, 4))


def draw_documents(rng: random.Random, seq: int, world: int) -> list[int]:
    """Boundaries ``[0, ..., seq]`` of random documents: length-1 ones, short ones, and (when the
    sequence allows) one longer than a shard (``seq / world`` tokens)."""
    shard = seq // world
    lens: list[int] = []
    if world > 1 and seq > shard + 1 and rng.random() < 0.7:
        lens.append(rng.randint(shard + 1, seq - 1))
    while sum(lens) < seq:
        n = 1 if rng.random() < 0.3 else rng.randint(1, max(1, seq // 3))
        lens.append(min(n, seq - sum(lens)))
    rng.shuffle(lens)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return cu


EMPTY_DOCUMENTS_RATE = 0.35
"""How often a case that draws documents gets zero-length ones too (:func:`draw_empty_documents`)."""


def draw_empty_documents(case_seed: int, calls: list[dict[str, Any]]) -> list[list[int]] | None:
    """Zero-length documents for a case's calls (``calls[i]["cu"]``: boundaries ``[0, ..., S]`` or None): per call
    the boundary indices to repeat (:func:`with_empty_documents`), ``[]`` for a call without documents; None (most
    cases) for none at all. Repeated ``cu_seqlens`` entries are what flash-attn's varlen kernels, Megatron (a
    fixed-size ``cu_seqlens`` padded with trailing copies of S) and a collator emitting an empty sample hand over;
    seqpar accepts them everywhere since session 27 (tests/test_zero_length_documents.py).

    Drawn from a generator of its own (``f"{case_seed}:empty_documents"``), never the case's: every case seed keeps
    every draw it had before (fz28), and the indices leave ``calls`` untouched (a forced ``world`` that re-derives
    the documents keeps its repeats: an index past the new boundaries repeats S)."""
    rng = random.Random(f"{case_seed}:empty_documents")
    if all(c.get("cu") is None for c in calls) or rng.random() >= EMPTY_DOCUMENTS_RATE:
        return None
    picks: list[list[int]] = []
    for c in calls:
        n = len(c["cu"]) if c.get("cu") is not None else 0
        idx = []
        for _ in range(rng.randint(1, 3) if n else 0):
            where = rng.choice(("first", "middle", "last", "last"))  # a leading one, one between, Megatron's padding
            idx.append(0 if where == "first" else rng.randint(1, n - 2) if where == "middle" and n > 2 else n - 1)
        picks.append(sorted(idx))
    return picks


def with_empty_documents(cu: list[int], picks: list[int]) -> list[int]:
    """``cu`` (boundaries ``[0, ..., S]``) with ``cu[i]`` repeated once more for each ``i`` of ``picks``: one
    zero-length document per pick (an index past the end repeats S)."""
    return sorted(cu + [cu[min(i, len(cu) - 1)] for i in picks])


def empty_documents_applied(draws: dict[str, Any]) -> dict[str, Any]:
    """``draws`` as the run sees it: each call's ``cu`` with the zero-length documents of ``draws["empty_docs"]``
    (:func:`draw_empty_documents`) put in; ``draws`` itself where there are none."""
    empty = draws.get("empty_docs")
    if not empty or "calls" not in draws:  # a forced empty_docs on a kind without calls: nothing to put in
        return draws
    calls = [{**c, "cu": with_empty_documents(c["cu"], empty[i] if i < len(empty) else [])}
             if c.get("cu") is not None else c for i, c in enumerate(draws["calls"])]
    return {**draws, "calls": calls}


ODD_LOCAL_RATE = 0.3
"""How often an ``attention`` case with contiguous sharding runs with an odd shard (:func:`draw_odd_local`)."""


def draw_odd_local(case_seed: int, draws: dict[str, Any]) -> bool | None:
    """Whether an ``attention`` case with contiguous sharding runs with one token fewer per rank
    (:func:`odd_local_applied`): ``seq_local = 2 chunk - 1``, an odd shard, which the draw (``seq = 2 P chunk``,
    made for zigzag's ``2P`` chunks) never gives; contiguous sharding takes any ``seq_local``. None where the case
    is not one.

    Drawn from a generator of its own (``f"{case_seed}:odd_local"``), never the case's: every case seed keeps
    every draw it had before (fz30), as ``empty_docs`` does (fz28)."""
    if draws.get("kind") != "attention" or draws.get("sharding") != "contiguous":
        return None
    return random.Random(f"{case_seed}:odd_local").random() < ODD_LOCAL_RATE


def odd_local_applied(draws: dict[str, Any]) -> dict[str, Any]:
    """``draws`` as the run sees it where ``draws["odd_local"]`` (:func:`draw_odd_local`): ``seq`` one token fewer
    per rank (``seq - P``), each call's documents cut at the new end (a document past it dropped, the one across it
    shortened); ``window`` and ``chunk_size`` are kept, so they may now exceed the sequence, which their docstrings
    allow (any int >= 1: a window wider than the sequence masks nothing). ``draws`` itself where not drawn, where
    the sharding is not contiguous (a forced one), or where a shard would be empty."""
    world, seq = draws.get("world"), draws.get("seq")
    if (not draws.get("odd_local") or draws.get("kind") != "attention" or draws.get("sharding") != "contiguous"
            or not isinstance(world, int) or seq % world or seq // world < 2):
        return draws
    new = seq - world
    calls = [{**c, "cu": [b for b in c["cu"] if b < new] + [new]} if c.get("cu") is not None else c
             for c in draws["calls"]]
    return {**draws, "seq": new, "calls": calls}


WIDE_BATCH_RATE = 0.25
"""How often an ``attention`` case without documents runs with a batch of 3 or 4 (:func:`draw_wide_batch`)."""


def draw_wide_batch(case_seed: int, draws: dict[str, Any]) -> int | None:
    """The batch (3 or 4) an ``attention`` case without documents runs with instead of its drawn 1 or 2
    (:func:`wide_batch_applied`), which no case had before fz31; None for most cases and where the case has
    documents (``cu_seqlens`` takes batch 1; batch 2 with documents is drawn for that refusal already).

    Drawn from a generator of its own (``f"{case_seed}:wide_batch"``), never the case's: every case seed keeps
    every draw it had before (fz31), as ``odd_local`` does (fz30)."""
    if draws.get("kind") != "attention" or any(c.get("cu") is not None for c in draws.get("calls", [])):
        return None
    rng = random.Random(f"{case_seed}:wide_batch")
    return rng.choice((3, 4)) if rng.random() < WIDE_BATCH_RATE else None


def wide_batch_applied(draws: dict[str, Any]) -> dict[str, Any]:
    """``draws`` as the run sees it where ``draws["wide_batch"]`` (:func:`draw_wide_batch`): ``batch`` that one.
    ``draws`` itself where not drawn, or where a call has documents (a forced ``calls``)."""
    wide = draws.get("wide_batch")
    if not wide or draws.get("kind") != "attention" or any(c.get("cu") is not None for c in draws.get("calls", [])):
        return draws
    return {**draws, "batch": wide}


DISAGREE_RATE = 0.1
"""How often an ``attention`` case that can (:func:`disagreement`) has its last rank pass another option."""
DISAGREEMENTS = ("causal", "scale", "window", "head_chunks")
"""The options the last rank passes otherwise than the others (:func:`disagreeing_options`)."""


def draw_disagree(case_seed: int, draws: dict[str, Any]) -> str | None:
    """One of :data:`DISAGREEMENTS` (about :data:`DISAGREE_RATE` of the cases that can take one, see
    :func:`disagreement`) or None: the option the last rank passes otherwise than the others, a user's mistake
    that ``check_inputs=True`` must refuse by name on every rank (``seqpar.attn.checks.check_across_ranks``), never
    run or hang. Drawn from a generator of its own (``f"{case_seed}:disagree"``), never the case's: every case seed
    keeps every draw it had before (fz31)."""
    if not _can_disagree(draws):
        return None
    rng = random.Random(f"{case_seed}:disagree")
    return rng.choice(DISAGREEMENTS) if rng.random() < DISAGREE_RATE else None


def _can_disagree(draws: dict[str, Any]) -> bool:
    # P >= 2 with the check on, one SP group (the pairs would leave {0, 1} agreeing, a half-refused case)
    return (draws.get("kind") == "attention" and isinstance(draws.get("world"), int) and draws["world"] >= 2
            and bool(draws.get("check_inputs")) and draws.get("group") is None)


def disagreement(draws: dict[str, Any]) -> str | None:
    """The option the run's last rank passes otherwise (``draws["disagree"]``), or None where not drawn or where
    forced draws took away what it needs (the check off, P = 1, the pairs as ``group=``)."""
    return draws.get("disagree") if _can_disagree(draws) else None


def disagreeing_options(option: str, kwargs: dict[str, Any], head_dim: int) -> dict[str, Any]:
    """``kwargs`` (the ``seqpar.attention`` options every rank passes) with ``option`` changed as the last rank of a
    disagreeing case passes it: ``causal`` flipped, ``scale`` 1.5 times the call's, ``window`` one wider (or 1 where
    none), ``head_chunks`` 1 where ``"auto"`` else ``"auto"``; each is valid on one process."""
    new = dict(kwargs)
    if option == "causal":
        new["causal"] = not kwargs["causal"]
    elif option == "scale":
        new["scale"] = 1.5 * (kwargs["scale"] if kwargs["scale"] is not None else head_dim ** -0.5)
    elif option == "window":
        new["window"] = kwargs["window"] + 1 if kwargs["window"] is not None else 1
    elif option == "head_chunks":
        new["head_chunks"] = 1 if kwargs["head_chunks"] == "auto" else "auto"
    else:
        raise ValueError(f"unknown disagreement {option!r}")
    return new


BIG_SCALE_RATE = 0.15
"""How often an ``attention`` or ``dilated`` case runs with a softmax scale above 1 (:func:`draw_big_scale`)."""


def draw_big_scale(case_seed: int, draws: dict[str, Any]) -> float | None:
    """A softmax ``scale`` in ``[1.25, 4]`` that an ``attention`` or ``dilated`` case runs with instead of its drawn
    one (None or ``0.1 .. 1``; :func:`big_scale_applied`): scores several times the default's, so each softmax row is
    nearly one-hot and its log-sum-exp far from the row's values, which no case had before fz32 (Gemma 2's
    ``query_pre_attn_scalar`` and muP's ``1 / d`` give scales off the default; a scale above 1 is the large end).
    None for most cases.

    Drawn from a generator of its own (``f"{case_seed}:big_scale"``), never the case's: every case seed keeps every
    draw it had before (fz32), as ``wide_batch`` does (fz31)."""
    if draws.get("kind") not in ("attention", "dilated"):
        return None
    rng = random.Random(f"{case_seed}:big_scale")
    return round(rng.uniform(1.25, 4.0), 3) if rng.random() < BIG_SCALE_RATE else None


def big_scale_applied(draws: dict[str, Any]) -> dict[str, Any]:
    """``draws`` as the run sees it where ``draws["big_scale"]`` (:func:`draw_big_scale`): ``scale`` that one (the
    references read ``scale`` too). ``draws`` itself where not drawn."""
    big = draws.get("big_scale")
    if not big or draws.get("kind") not in ("attention", "dilated"):
        return draws
    return {**draws, "scale": big}


DISAGREE_INPUT_RATE = 0.1
"""How often an ``attention`` case that can (:func:`input_disagreement`) has its last rank pass other inputs."""
DISAGREE_INPUTS = ("seq_local", "documents", "batch")
"""What the last rank passes otherwise than the others (:func:`disagreeing_inputs`): a shard one token shorter,
other document boundaries, another batch."""


def draw_disagree_input(case_seed: int, draws: dict[str, Any]) -> str | None:
    """One of :data:`DISAGREE_INPUTS` (about :data:`DISAGREE_INPUT_RATE` of the cases that can take one) or None:
    the input the last rank passes otherwise than the others: its shard one token shorter (a collator that padded
    one rank's rows differently), other ``cu_seqlens`` (a rank that packed its own documents), or one batch row
    more or fewer. ``check_inputs=True`` must refuse each by name on every rank
    (``seqpar.attn.checks.check_across_ranks``), never run, hang or crash in a collective. Drawn where
    :data:`DISAGREEMENTS`' option draw (``disagree``) is not, from a generator of its own
    (``f"{case_seed}:disagree_input"``), never the case's: every case seed keeps every draw it had before (fz32)."""
    if not _can_disagree(draws) or draws.get("disagree"):
        return None
    rng = random.Random(f"{case_seed}:disagree_input")
    return rng.choice(DISAGREE_INPUTS) if rng.random() < DISAGREE_INPUT_RATE else None


def input_disagreement(draws: dict[str, Any]) -> str | None:
    """The input the run's last rank passes otherwise (``draws["disagree_input"]``, or fz33's
    ``draws["disagree_shape"]``), or None where not drawn or where forced draws took away what it needs (as
    :func:`disagreement`)."""
    if draws.get("disagree_input") and _can_disagree(draws):
        return draws["disagree_input"]
    if draws.get("disagree_shape") and _can_disagree_shape(draws):
        return draws["disagree_shape"]
    return None


DISAGREE_SHAPE_RATE = 0.12
"""How often an ``attention`` or ``dilated`` case that can (:func:`draw_disagree_shape`) gets ``disagree_shape``."""
DISAGREE_SHAPES = ("heads", "head_dim", "dtype")
"""What an ``attention`` case's last rank passes otherwise in fz33's draw (:func:`disagreeing_inputs`): fewer heads,
a smaller head dim, the other float dtype."""
DILATED_DISAGREE_INPUTS = ("seq_local", "batch", "heads", "head_dim", "dtype")
"""What a ``dilated`` case's last rank passes otherwise (no documents there: ``dilated_attention`` takes none)."""


def _can_disagree_shape(draws: dict[str, Any]) -> bool:
    # as _can_disagree, the dilated kind too (its group=WORLD without a manager is one SP group as well), and only
    # where neither older disagreement is drawn: one mistake per case
    return (draws.get("kind") in ("attention", "dilated") and isinstance(draws.get("world"), int)
            and draws["world"] >= 2 and bool(draws.get("check_inputs")) and draws.get("group") in (None, "world")
            and not draws.get("disagree") and not draws.get("disagree_input"))


def draw_disagree_shape(case_seed: int, draws: dict[str, Any]) -> str | None:
    """fz33: one of :data:`DISAGREE_SHAPES` (``attention``) or :data:`DILATED_DISAGREE_INPUTS` (``dilated``), about
    :data:`DISAGREE_SHAPE_RATE` of the cases that can take one, or None: the last rank passes fewer heads (a group of
    GQA query heads and its K/V head dropped), a head dim one smaller (q and k), or its inputs in the other float dtype
    (float32 for float64 and back); a ``dilated`` case also a shard one token shorter or another batch. Every such
    case must be refused by the cross-rank check on every rank (``check_inputs=True``), never run, hang or crash in a
    collective. Drawn from a generator of its own (``f"{case_seed}:disagree_shape"``), never the case's: every case
    seed keeps every draw it had before, ``disagree`` and ``disagree_input`` included."""
    if not _can_disagree_shape(draws):
        return None
    rng = random.Random(f"{case_seed}:disagree_shape")
    options = DILATED_DISAGREE_INPUTS if draws["kind"] == "dilated" else DISAGREE_SHAPES
    return rng.choice(options) if rng.random() < DISAGREE_SHAPE_RATE else None


def disagreeing_inputs(option: str, q: Any, k: Any, v: Any, dout: Any, cu: list[int] | None, seq: int
                       ) -> tuple[Any, Any, Any, Any, list[int] | None]:
    """The last rank's ``(q, k, v, dout, cu)`` of a case disagreeing on ``option`` (:data:`DISAGREE_INPUTS`), from
    its own ``(B, H, S_local, D)`` shards and the call's boundaries ``cu`` (``[0, ..., seq]`` or None):
    ``seq_local`` drops the shard's last token; ``documents`` splits a document in two (a boundary at the first
    position from ``seq // 2`` on that is none; where every position is one, merges the first two documents):
    boundaries valid on one process, other than the other ranks'; ``batch`` drops the last row (one row: repeats
    it); fz33's :data:`DISAGREE_SHAPES`: ``heads`` drops the last K/V head and its query heads (MQA: the last query
    head; one head: doubled), ``head_dim`` drops q's and k's last feature, ``dtype`` casts the four to the other float
    dtype."""
    if option == "seq_local":
        return q[:, :, :-1], k[:, :, :-1], v[:, :, :-1], dout[:, :, :-1], cu
    if option == "documents":
        bounds = list(cu) if cu is not None else [0, seq]
        free = [p for p in (*range(seq // 2, seq), *range(1, seq // 2)) if p not in bounds]
        if free:  # one more boundary: a document split in two
            return q, k, v, dout, sorted([*bounds, free[0]])
        return q, k, v, dout, bounds[:1] + bounds[2:]  # every token its own document: two of them merged
    if option == "batch":
        if q.shape[0] > 1:
            return q[:-1], k[:-1], v[:-1], dout[:-1], cu
        return (*(x.expand(2, *x.shape[1:]).contiguous() for x in (q, k, v, dout)), cu)
    if option == "heads":  # one K/V head and its group of query heads fewer (MQA: one query head; one head: two)
        hq, hkv = q.shape[1], k.shape[1]
        if hkv > 1:
            g = hq // hkv
            return q[:, :-g], k[:, :-1], v[:, :-1], dout[:, :-g], cu
        if hq > 1:
            return q[:, :-1], k, v, dout[:, :-1], cu
        return (*(x.expand(x.shape[0], 2, *x.shape[2:]).contiguous() for x in (q, k, v, dout)), cu)
    if option == "head_dim":  # q's and k's head dim one smaller (one larger where it is 1); V's is its own
        if q.shape[-1] > 1:
            return q[..., :-1], k[..., :-1], v, dout, cu
        return q.repeat_interleave(2, -1), k.repeat_interleave(2, -1), v, dout, cu
    if option == "dtype":  # the other float dtype: float32 for float64 and back
        import torch

        other = torch.float32 if q.dtype == torch.float64 else torch.float64
        return (*(x.to(other) for x in (q, k, v, dout)), cu)
    raise ValueError(f"unknown input disagreement {option!r}")


STRIDED_PAIRS_RATE = 0.5
"""How often a case on the pairs (``group="pairs"``, P = 4) takes the non-consecutive ones (:func:`sp_groups`)."""


def draw_strided_pairs(case_seed: int, draws: dict[str, Any]) -> bool | None:
    """Whether an ``attention`` or ``dilated`` case on the pairs runs on ``{0, 2}, {1, 3}`` (``group=`` a
    non-consecutive group, made by ``dist.new_subgroups_by_enumeration``) instead of ``{0, 1}, {2, 3}``; None where
    the case is not on the pairs. Drawn from a generator of its own (``f"{case_seed}:strided_pairs"``), never the
    case's: every case seed keeps every draw it had before (fz31)."""
    if draws.get("kind") not in ("attention", "dilated") or draws.get("group") != "pairs":
        return None
    return random.Random(f"{case_seed}:strided_pairs").random() < STRIDED_PAIRS_RATE


def sp_groups(draws: dict[str, Any], world: int) -> list[range]:
    """The SP groups of a case's call, each a range of global ranks in its group order: the whole world; the pairs
    ``{0, 1}, {2, 3}``; or, where ``draws["strided_pairs"]``, ``{0, 2}, {1, 3}``."""
    if draws.get("group") != "pairs":
        return [range(world)]
    if draws.get("strided_pairs"):
        return [range(g, world, 2) for g in range(2)]
    return [range(g, g + 2) for g in range(0, world, 2)]


def draw_world_mode(rng: random.Random) -> tuple[int, str, int]:
    """``(world, mode, ulysses_size)``, the first draws of an attention case (this kind's and the compile kind's):
    1 to 4 ranks, the mode (ring twice as often), and hybrid's Ulysses size (a divisor of the world strictly
    between 1 and it four times in five where there is one; 1 for every other mode)."""
    world = rng.randint(1, 4)
    mode = rng.choice(("ring", "ring", "allgather", "ulysses", "hybrid", "auto"))
    divisors = [u for u in range(1, world + 1) if world % u == 0]
    inner = [u for u in divisors if 1 < u < world]
    ulysses_size = (rng.choice(inner) if inner and rng.random() < 0.8 else rng.choice(divisors)) if mode == "hybrid" else 1
    return world, mode, ulysses_size


@dataclass(frozen=True)
class OptionRates:
    """How often :func:`draw_call_options` moves an option off its default, per kind (the rest are shared)."""

    chunk_size: float
    """of drawing a ``chunk_size`` (else None)"""
    alibi: float
    """of ``alibi=True``"""
    softcap: float
    """of drawing a ``softcap`` (else None)"""
    check_inputs: float
    """of ``check_inputs=True`` (the default: the rest of the cases run without the cross-rank checks)"""
    float64: float
    """of ``dtype="float64"`` (else float32)"""


ATTENTION_RATES = OptionRates(chunk_size=0.2, alibi=0.2, softcap=0.2, check_inputs=0.7, float64=0.2)
"""The ``attention`` kind's :class:`OptionRates`."""


def draw_call_options(rng: random.Random, kv_heads: int, max_chunk: int, rates: OptionRates) -> dict[str, Any]:
    """The ``seqpar.attention`` options an attention case's calls share, drawn in this order (a case seed's draws
    depend on it): ``sinks``, ``chunk_size`` (1 to ``max_chunk``), ``alibi``, ``softcap``, ``scale``, ``layout``,
    ``head_chunks`` (a divisor of ``kv_heads`` or ``"auto"``), ``overlap``, ``check_inputs``, ``dtype``."""
    return {
        "sinks": rng.random() < 0.25,
        "chunk_size": rng.randint(1, max_chunk) if rng.random() < rates.chunk_size else None,
        "alibi": rng.random() < rates.alibi,
        "softcap": round(rng.uniform(0.5, 5.0), 3) if rng.random() < rates.softcap else None,
        "scale": round(rng.uniform(0.1, 1.0), 3) if rng.random() < 0.2 else None,
        "layout": "bshd" if rng.random() < 0.2 else "bhsd",
        "head_chunks": (rng.choice([h for h in range(1, kv_heads + 1) if kv_heads % h == 0])
                        if rng.random() < 0.3 else "auto"),
        "overlap": rng.random() < 0.8,
        "check_inputs": rng.random() < rates.check_inputs,
        # not bf16 / fp16: the bar is exact against float64 (fp32 to ~1e-5); low precision has its own bounds and
        # tests (tests/test_low_precision_ring.py, BENCHMARKS.md), not a per-tensor exactness verdict
        "dtype": "float64" if rng.random() < rates.float64 else "float32",
    }


def draw_attention(rng: random.Random) -> dict[str, Any]:
    world, mode, ulysses_size = draw_world_mode(rng)
    hq, hkv, d, dv = rng.choice(HEADS)
    docs = rng.random() < 0.5
    sharding = rng.choice(("contiguous", "zigzag", "balanced") if docs else ("contiguous", "zigzag", "zigzag"))
    chunk = rng.randint(1, 6)  # tokens per zigzag chunk
    seq = 2 * world * chunk
    two_calls = rng.random() < 0.25
    calls = []
    for _ in range(2 if two_calls else 1):
        calls.append({"cu": draw_documents(rng, seq, world) if docs else None})
    # cu_seqlens needs batch 1 (its docstring): batch 2 with documents is drawn rarely, to see the refusal
    batch = 2 if (not docs and rng.random() < 0.3) or rng.random() < 0.03 else 1
    draws = {
        "kind": "attention", "world": world, "mode": mode, "ulysses_size": ulysses_size,
        "declare_sharding": rng.random() < 0.5, "sharding": sharding, "heads": [hq, hkv, d, dv],
        "batch": batch, "seq": seq, "causal": rng.random() < 0.7, "calls": calls,
        "window": rng.randint(1, seq) if rng.random() < 0.3 else None,
        **draw_call_options(rng, hkv, seq, ATTENTION_RATES),
        # drawn last: a case seed's other draws are those it had before (fz24c)
        "dkv_wire_dtype": "bf16" if rng.random() < 0.15 else "fp32",
        # at P = 4 now and then the call runs on the pairs {0, 1}, {2, 3} (group=, eager), each pair the whole sequence
        "group": "pairs" if world == 4 and rng.random() < 0.2 else None,
        # drawn after them (fz25b): q, k, v as the views models pass (a bshd buffer seen bhsd, a fused qkv split)
        "strided": rng.choice(STRIDES[1:]) if rng.random() < 0.25 else None,
    }
    # drawn after them (fz26b), so a case seed's earlier draws stay: the arguments users pass that the kind never did
    _draw_grad(rng, draws)
    draws["sinks_grad"] = not (draws["sinks"] and rng.random() < 0.3)  # frozen sinks (a PEFT run's base weights)
    # documents as users pass them: an int64 tensor, an int32 one (flash-attn's and transformers' cu_seq_lens), or
    # a tuple of ints (documented: no device-to-host copy)
    draws["cu_as"] = rng.choice(CU_AS) if docs and rng.random() < 0.5 else "int64"
    # sharding=None / layout=None, the defaults a caller leaves: the declared sharding (or contiguous when none is
    # declared: where the drawn sharding is another and none is declared, the task passes it) and bhsd
    draws["omit_sharding"] = rng.random() < 0.3
    draws["omit_layout"] = rng.random() < 0.3
    # group= the manager's own SP group, as the integrations pass it (the docstring accepts it even with hybrid)
    draws["group_arg"] = "manager" if draws["group"] is None and rng.random() < 0.15 else None
    # balanced sharding without documents (one document: the whole sequence; a config's "sharding": "balanced" on
    # unpacked rows), which the sharding draw above leaves out: balanced there only balances documents
    if not docs and draws["sharding"] == "zigzag" and rng.random() < 0.25:
        draws["sharding"] = "balanced"
    # ALiBi with sinks or soft-cap is refused by design (seqpar.attn.alibi: the per-key bias is exact only up to a
    # per-row constant, which a sink logit and a soft-cap do not ignore; no model combines them): drawn
    # independently it was 8% of the kind's cases (seeds 2601-2654: 45 of ~700), so keep a fifth of them for the
    # refusal and give the rest their ALiBi-free composition
    if draws["alibi"] and (draws["sinks"] or draws["softcap"] is not None) and rng.random() < 0.8:
        draws["alibi"] = False
    # MQA's single K/V head handed over as a stride-0 view expanded to the query heads (callers that expand K/V
    # instead of passing kv_heads: repeat_kv without its copy); only one K/V head expands without a copy
    draws["expand_kv"] = hkv == 1 and draws["strided"] != "fused" and rng.random() < 0.3
    return draws


GRADS = (None, "no_grad", "inference", "frozen_kv")
"""How a case's call runs: ``None`` forward and backward, every input a leaf; ``"no_grad"`` / ``"inference"``
forward only under ``torch.no_grad()`` / ``torch.inference_mode()`` (evaluation, generation: only the outputs are
judged); ``"frozen_kv"`` k and v (and the sinks) not requiring grad, q does (only dq is judged; dk / dv must not
appear)."""
CU_AS = ("int64", "int32", "tuple")


def _draw_grad(rng: random.Random, draws: dict[str, Any]) -> None:
    """``draws["grad"]`` (:data:`GRADS`): the default now and then left for evaluation or a frozen K/V. Not
    ``"frozen_kv"`` with ``strided="fused"``: the fused q, k and v are views of one leaf, frozen together or not."""
    grad = rng.choice(GRADS[1:]) if rng.random() < 0.2 else None
    draws["grad"] = None if grad == "frozen_kv" and draws["strided"] == "fused" else grad


def draw_dilated(rng: random.Random) -> dict[str, Any]:
    world = rng.randint(1, 4)
    local = rng.choice((4, 8, 12, 16))
    seq = world * local
    fits = [w for w in range(1, seq + 1) if seq % w == 0 and (world == 1 or local % w == 0 or w % local == 0)]
    n = rng.randint(1, 3)
    segs, rates = [], []
    for _ in range(n):
        # a segment the docstring's rule fits; 5% any length, to see the refusal of one that does not fit
        w = rng.choice(fits) if rng.random() < 0.95 else rng.randint(1, seq)
        r = rng.choice([r for r in range(1, w + 1) if w % r == 0])
        segs.append(w)
        rates.append(r)
    hq, hkv, d, _ = rng.choice(HEADS)
    draws = {
        "kind": "dilated", "world": world, "seq": seq, "segment_lengths": segs, "dilation_rates": rates,
        "heads": [hq, hkv, d, d], "batch": rng.choice((1, 2)), "causal": rng.random() < 0.5,
        # not ulysses / hybrid, and zigzag rarely: dilated_attention refuses them by design (its segments are
        # contiguous position ranges exchanged point to point); zigzag is drawn now and then to see that refusal
        "mode": rng.choice(("ring", "allgather")), "head_layout": rng.choice(("mixed", "mixed", "grouped")),
        "sharding": "contiguous" if rng.random() < 0.95 else "zigzag", "check_inputs": rng.random() < 0.7,
        "dtype": "float64" if rng.random() < 0.2 else "float32",
        "dkv_wire_dtype": "bf16" if rng.random() < 0.15 else "fp32",  # drawn last, as the attention kind's
    }
    # drawn after them (fz25b), so a case seed's earlier draws stay: the axes users run that the kind never drew
    if rng.random() < 0.2:  # V's head dim apart from q/k's (MLA; the docstring allows it)
        draws["heads"][3] = rng.choice([x for x in (3, 4, 6, 8, 12) if x != d])
    draws["scale"] = round(rng.uniform(0.1, 1.0), 3) if rng.random() < 0.2 else None
    draws["strided"] = rng.choice(STRIDES[1:]) if rng.random() < 0.25 else None
    # at P = 4 now and then the call on the pairs {0, 1}, {2, 3} (group=), each pair the whole sequence
    draws["group"] = "pairs" if world == 4 and rng.random() < 0.2 else None
    if rng.random() < 0.15:  # dilated_attention's mode="auto" (it picks ring or allgather after probing the links)
        draws["mode"] = "auto"
    # drawn after them (fz26b): forward only or frozen K/V (GRADS); two calls before one backward (two layers, as
    # the attention kind draws); group= the whole world with no manager (the docstring's own advice:
    # group=torch.distributed.group.WORLD without init_process_groups)
    _draw_grad(rng, draws)
    if rng.random() < 0.25:
        draws["calls"] = [{"cu": None}, {"cu": None}]
    if draws["group"] is None and rng.random() < 0.15:
        draws["group"] = "world"
    return draws


def attention_summary(draws: dict[str, Any]) -> str:
    """One short line naming an ``attention`` or ``dilated`` case's composition (:func:`seqpar.testing.fuzz.summary`)."""
    if draws["kind"] == "dilated":
        return (f"dilated P={draws['world']} {draws['mode']} w={draws['segment_lengths']} r={draws['dilation_rates']} "
                f"{draws['head_layout']} H={'/'.join(map(str, draws['heads']))} causal={int(draws['causal'])} "
                f"{draws['dtype']}" + (" dkv=bf16" if draws.get("dkv_wire_dtype") == "bf16" else "")
                + (f" scale={draws['scale']}" if draws.get("scale") is not None else "")
                + (f" strided={draws['strided']}" if draws.get("strided") else "")
                + (f" group={draws['group']}" if draws.get("group") else "")
                + (" two-calls" if len(draws.get("calls", [])) > 1 else "")
                + (f" grad={draws['grad']}" if draws.get("grad") else ""))
    parts = [f"attention P={draws['world']}", draws["mode"] + (f"(u={draws['ulysses_size']})" if draws["mode"] == "hybrid" else ""),
             draws["sharding"], "H=" + "/".join(map(str, draws["heads"])), f"B={draws['batch']}", f"S={draws['seq']}",
             f"causal={int(draws['causal'])}"]
    if draws["calls"][0]["cu"] is not None:
        parts.append("docs=" + ",".join(str(b - a) for a, b in zip(draws["calls"][0]["cu"], draws["calls"][0]["cu"][1:])))
    parts += knob_words(draws, ("window", "chunk_size", "softcap", "scale"), ("sinks", "alibi"))
    if len(draws["calls"]) > 1:
        parts.append("two-calls")
    parts += call_words(draws, no_check=True)
    if draws.get("sinks") and not draws.get("sinks_grad", True):
        parts.append("frozen-sinks")
    if draws["calls"][0]["cu"] is not None and draws.get("cu_as", "int64") != "int64":
        parts.append(f"cu-as-{draws['cu_as']}")
    if draws.get("omit_sharding") and (draws["declare_sharding"] or draws["sharding"] == "contiguous"):
        parts.append("sharding=None")
    if draws.get("omit_layout") and draws["layout"] == "bhsd":
        parts.append("layout=None")
    if draws.get("group_arg"):
        parts.append(f"group-arg={draws['group_arg']}")
    if draws.get("expand_kv"):
        parts.append("expand-kv")
    return " ".join(parts)


def knob_words(draws: dict[str, Any], values: tuple[str, ...], flags: tuple[str, ...]) -> list[str]:
    """Summary words of an attention call's knobs (the attention kind's and the compile kind's summaries):
    ``key=value`` for each of ``values`` drawn (not None), ``key`` for each of ``flags`` set."""
    return ([f"{key}={draws[key]}" for key in values if draws.get(key) is not None]
            + [key for key in flags if draws.get(key)])


def call_words(draws: dict[str, Any], *, no_check: bool) -> list[str]:
    """Summary words of how an attention call is made (the attention kind's and the compile kind's summaries):
    the layout (not ``bhsd``), ``head_chunks`` (not ``auto``), ``no-overlap``, ``no-check`` (where ``no_check``
    and the cross-rank check is off), the dtype, the dK/dV wire dtype (not fp32), the group, the strided views and
    the grad context drawn."""
    words = [draws["layout"]] if draws["layout"] != "bhsd" else []
    if draws["head_chunks"] != "auto":
        words.append(f"head_chunks={draws['head_chunks']}")
    if not draws["overlap"]:
        words.append("no-overlap")
    if no_check and not draws["check_inputs"]:
        words.append("no-check")
    words.append(draws["dtype"])
    if draws.get("dkv_wire_dtype", "fp32") != "fp32":
        words.append(f"dkv={draws['dkv_wire_dtype']}")
    words += [f"{key}={draws[key]}" for key in ("group", "strided", "grad") if draws.get(key)]
    return words
