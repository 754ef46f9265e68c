"""The composition fuzzer (issue 28 §3): random compositions of seqpar's options, each checked against one
process in float64.

``python -m seqpar.testing.fuzz --cases N --seed S [--json OUT]`` draws ``N`` cases. Case ``i`` gets its
own *case seed* (``case_seeds(S, N)[i]``); every draw and every tensor of the case comes from that seed
alone, so ``--case-seed X`` re-runs exactly one case. Each case is one of:

- ``attention``: a direct :func:`seqpar.attention` call (or two calls before one backward) on P in 1..4
  ranks: mode (ring, allgather, ulysses, hybrid with a drawn Ulysses degree, auto), sharding
  (contiguous, zigzag, balanced), GQA / MQA / MHA and V's head dim apart from q/k's, batch 1 or 2,
  causal or not, packed documents (random lengths, length-1 documents, one longer than a shard),
  window, sinks, chunked attention, ALiBi, soft-cap, layout bshd, head_chunks, overlap,
  ``check_inputs`` on and off, fp32 or float64, ``dkv_wire_dtype`` ``"bf16"`` now and then (dk and dv judged at
  the wire's bound, ``4 (P - 1) 2**-9`` of their scale; out and dq exact; refused by name in the modes that move
  no dK/dV), at P = 4 now and then the call on the pairs ``{0, 1}, {2, 3}`` (``group=``, each pair the whole
  sequence; half of them the non-consecutive ``{0, 2}, {1, 3}``, ``strided_pairs``); q, k and v now and then as the views models pass (:mod:`seqpar.testing.fuzz_strides`: a ``bshd``
  buffer seen ``bhsd`` or the reverse, three narrow views of one fused qkv buffer); forward only under
  ``no_grad`` / ``inference_mode`` or a frozen K/V (:data:`GRADS`), frozen sinks, documents as an int32 tensor or a
  tuple (:data:`CU_AS`), ``sharding=None`` / ``layout=None``, ``group=`` the manager's SP group, balanced sharding
  without documents, MQA's one K/V head expanded (stride 0) to the query heads, contiguous shards of an odd length
  (``odd_local``: one token fewer per rank, a window or chunk now and then wider than the sequence), a batch of 3
  or 4 where the case has no documents (``wide_batch``), a ``scale`` in 1.25-4 (``big_scale``), and at P >= 2 with
  ``check_inputs`` the last rank passing another ``causal``, ``scale``, ``window`` or ``head_chunks`` (``disagree``)
  or other inputs: its shard one token shorter, other ``cu_seqlens``, another batch (``disagree_input``), fewer
  heads, a smaller head dim, the other dtype (``disagree_shape``, fz33), each refused by name on every rank, or the
  case is WRONG; a hang is a crash by the timeout;
- ``dilated``: a direct :func:`seqpar.dilated_attention` call (patterns, head layouts, ring / allgather,
  P in 1..4, a shape the patterns do not fit now and then, ``dkv_wire_dtype`` as above, V's head dim apart,
  ``scale`` (``big_scale`` too), strided views as above, at P = 4 the pairs as ``group=``, ``mode="auto"``, :data:`GRADS`, two calls
  before one backward, ``group=torch.distributed.group.WORLD`` without a manager, and at P >= 2 with ``check_inputs``
  the last rank passing a shorter shard, another batch, fewer heads, a smaller head dim or the other dtype
  (``disagree_shape``, fz33: refused by name on every rank, or the case is WRONG));
- ``model``: a tiny model of any type of :func:`seqpar.testing.tiny_models.decoder_model_types` under
  ``swap_attention`` on P in 1..4 (:mod:`seqpar.testing.fuzz_models`; ``config_knobs``: the ``sequence_parallel``
  keys ``high_priority_streams``, ``timeout_s``, ``apex``, ``mixer_kernels="auto"`` now and then; ``dkv_wire``:
  ``dkv_wire_dtype: "bf16"``, judged against the same run with the wire at fp32);
- ``engine``: a ``model`` case trained through an engine: DeepSpeed ZeRO-1/2/3, FSDP2, or TP 2 x SP P/2
  (:mod:`seqpar.testing.fuzz_engines`), every reduced gradient against one process; ``dkv_wire`` (fz33, as in the
  ``dynamic`` and ``trainer`` kinds): ``dkv_wire_dtype: "bf16"`` in the config, judged against the same float64
  reference at the wire's bound (:func:`~seqpar.testing.fuzz_models.judge_model_wire`), not exactly;
- ``dynamic``: one step of length-aware dynamic CP on a tiny model, random document-length mixes over a DP x SP
  pool of 1..4 ranks, the plan's invariants and every reduced gradient checked (:mod:`seqpar.testing.fuzz_dynamic`);
- ``compile``: ``torch.compile`` over a direct call or a tiny swapped model, called several times with changing
  inputs (:mod:`seqpar.testing.fuzz_compile`; drawn only when ``--kinds`` names it: its traces are slow).
- ``trainer``: Hugging Face's ``Trainer`` or TRL's ``SFTTrainer`` with seqpar (DeepSpeed ZeRO or FSDP2, DP x SP
  over 1..4 ranks, the trainers' knobs) against the same trainer without seqpar on one process
  (:mod:`seqpar.testing.fuzz_trainers`).

Verdicts (one per case):

- ``exact``: every output and gradient within tolerance of the single-process float64 reference
  (:func:`close`: per tensor, ``max|g - g_ref| <= tol * max|g_ref| + floor``);
- ``refused``: every rank raised a *refusal*: a ``ValueError``, ``TypeError`` or ``NotImplementedError``
  (seqpar's ``ConfigError``, ``SwapError``, ``TilingError``, ``NormError`` are ``ValueError``\\ s) raised
  from a frame inside the ``seqpar`` package (not ``seqpar.testing``), of the same type on every rank.
  An error of torch or transformers, one raised on some ranks only, or one of another type is a crash;
- ``WRONG``: ran on every rank, but some tensor is off beyond tolerance (silently wrong);
- ``breaks`` (``compile`` only): exact, but dynamo broke the graph where the docs promise one graph;
- ``skipped``: the case cannot be judged, e.g. a ``--set`` key that conflicts with another forced key
  (:func:`force`: what depends on a forced key is re-derived; a conflict is never judged);
- ``crash``: anything else, a hang past the case's timeout included. After a crash the rank pool of that world
  size is restarted before the next case: a rank that failed may have left its process group broken (a
  gloo pair closed by a timed-out collective), and a later case on it would fail for that alone.

Cases run on a persistent rank pool (:class:`seqpar.testing.ranks.PoolSet`): start-up is paid once per
world size. Exit status: 1 when any case is WRONG, crash or breaks.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import os
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from seqpar.testing.fuzz_attention import (
    CU_AS,
    GRADS,
    attention_summary,
    big_scale_applied,
    disagreement,
    draw_attention,
    draw_big_scale,
    draw_dilated,
    draw_disagree,
    draw_disagree_input,
    draw_disagree_shape,
    draw_documents,
    draw_empty_documents,
    draw_odd_local,
    draw_strided_pairs,
    draw_wide_batch,
    empty_documents_applied,
    input_disagreement,
    odd_local_applied,
    wide_batch_applied,
)
from seqpar.testing.fuzz_attention_run import (
    attention_reference,
    attention_task,
    dilated_reference,
    positions,
)
from seqpar.testing.fuzz_attention_run import judge_attention as _judge_attention
from seqpar.testing.fuzz_attention_run import tensors_of as _tensors
from seqpar.testing.verdicts import classify_errors, close, error_record

__all__ = [
    "VERDICTS",
    "case_seeds",
    "draw_case",
    "force",
    "run_case",
    "run_cases",
    "close",
    "classify_errors",
    "error_record",
    "summary",
    "without_fz33_draws",
    "Fuzzer",
    "main",
    # the attention and dilated kinds' (seqpar.testing.fuzz_attention, fuzz_attention_run), named here as before
    "GRADS",
    "CU_AS",
    "positions",
    "attention_reference",
    "dilated_reference",
    "attention_task",
]

VERDICTS = ("exact", "refused", "WRONG", "crash", "skipped", "breaks")
KINDS = ("attention", "dilated", "model", "engine", "dynamic", "trainer", "compile")
DEFAULT_KINDS = KINDS[:-1]  # without --kinds: not compile (a trace per case, 10-60 s on CPU)


def case_seeds(seed: int, n: int) -> list[int]:
    """The case seeds of a run: ``n`` integers drawn from ``seed`` (case ``i`` is the same whatever ``n``)."""
    rng = random.Random(seed)
    return [rng.randrange(2 ** 31) for _ in range(n)]


# --------------------------------------------------------------------------------------------------
# Draws (plain JSON-able dicts; every tensor is rebuilt from the case seed): the attention and dilated kinds' in
# seqpar.testing.fuzz_attention, the others' in their modules; forcing --set keys on any kind here
# --------------------------------------------------------------------------------------------------

def _fit_seq(seq: int, unit: int) -> int:
    """The multiple of ``unit`` nearest ``seq`` (at least ``unit``): a sequence re-derived for a forced world."""
    return unit * max(1, round(seq / unit))


def _rederive_calls(calls: list[dict[str, Any]], rng: random.Random, world_of: Any, unit_of: Any) -> None:
    """Re-derive, in place, what a forced world makes stale in per-call draws (``sp``, ``seq``, ``cu``, ``window``)
    of the compile kind's direct calls: ``world_of(call)`` is the call's new SP size, ``unit_of(sp)`` the multiple
    its sequence must be."""
    for c in calls:
        sp = world_of(c)
        seq = c["seq"] if c["seq"] % unit_of(sp) == 0 else _fit_seq(c["seq"], unit_of(sp))
        if c.get("cu") is not None and seq != c["seq"]:
            c["cu"] = draw_documents(rng, seq, sp)
        if c.get("window") is not None and c["window"] > seq:
            c["window"] = rng.randint(1, seq)
        c["sp"], c["seq"] = sp, seq


def _shard_unit(draws: dict[str, Any], world: int) -> int:
    """The multiple of ``world`` an ``attention`` case's sequence must be for :func:`positions` to cover it: ``P``
    contiguous shards, ``2P`` zigzag / balanced chunks (the draw makes it ``2 P chunk``)."""
    return world if draws.get("sharding") == "contiguous" else 2 * world


def force(draws: dict[str, Any], overrides: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """``draws`` with the ``--set`` keys ``overrides`` forced, and what depends on a forced key re-derived; or the
    conflict that makes the case unjudgeable (then it is ``skipped``, never judged).

    A draw's keys depend on each other: the ``attention`` kind's sequence is ``2 P chunk`` tokens (:func:`positions`
    cuts it into ``2P`` equal zigzag chunks or ``P`` contiguous shards), its documents end at that sequence, its
    window and chunk size are at most it, a hybrid Ulysses degree divides ``P``. Forcing ``world`` alone used to leave
    the sequence of the drawn world: ``--set world=3`` on a sequence of 16 tokens judged only the 12 the harness
    sharded, against a reference over 16 -- a WRONG that was the harness's, not seqpar's (case 222708024). So a
    forced key's dependents that are not forced themselves are re-derived here (from a generator of the case seed,
    the same every run; the keys that do not depend on it keep their draws, so ``--set world=1`` still narrows the
    case down), and a forced key that contradicts another forced key is a conflict: ``"forced key seq=10
    conflicts with world=3 ..."``. Re-derived: ``attention`` (``ulysses_size``, ``seq``, documents, ``window``,
    ``chunk_size``, ``head_chunks``), ``dilated`` (``seq``, its segments), ``compile`` (its calls' ``sp``, ``seq``,
    documents, window; ``ulysses_size``), ``model`` and ``dynamic`` (``ulysses_size``; ``sp``), ``trainer``
    (:func:`~seqpar.testing.fuzz_trainers.force_trainer`: the DP x SP split, the rows, the DP-1 draws) and ``engine``
    (:func:`~seqpar.testing.fuzz_engines.force_engine`: ``dp`` and the replicas' batches)."""
    if not overrides:
        return draws, None
    out = {**copy.deepcopy(draws), **copy.deepcopy(overrides)}  # tuples stay tuples (a JSON round trip would not)
    rng = random.Random(f"{draws['case_seed']}:forced")
    kind, world = out["kind"], out.get("world")
    free = [k for k in out if k not in overrides]  # the keys a forced key may re-derive

    def conflict(key: str, why: str) -> str:
        forced = ", ".join(f"{k}={json.dumps(v)}" for k, v in overrides.items() if k in (key, "world", "seq", "sharding"))
        return f"skipped: forced key {forced} conflicts with {why}"

    if not isinstance(world, int) or world < 1:
        return out, conflict("world", f"world={world!r} (a positive int)")
    divisors = [u for u in range(1, world + 1) if world % u == 0]
    if (kind in ("attention", "compile", "model", "dynamic") and "ulysses_size" in free and out.get("mode") == "hybrid"
            and world % out.get("ulysses_size", 1)):
        if kind in ("attention", "compile") and out.get("sub", "attention") == "attention":
            inner = [u for u in divisors if 1 < u < world]
            out["ulysses_size"] = rng.choice(inner or divisors)
        else:  # the model and compile-model draws' rule
            out["ulysses_size"] = 2 if world == 4 else world
    if kind == "dynamic" and "sp" in free and world % out["sp"]:
        out["sp"] = max(d for d in divisors if d <= out["sp"])
    if kind in ("trainer", "engine"):  # the DP x SP split and what depends on it (its rows, replicas, DP-1 draws)
        from seqpar.testing.fuzz_engines import force_engine
        from seqpar.testing.fuzz_trainers import force_trainer

        problem = (force_trainer if kind == "trainer" else force_engine)(out, free, rng)
        if problem:
            return out, f"skipped: forced key {', '.join(f'{k}={json.dumps(v)}' for k, v in overrides.items())} " \
                        f"conflicts with {problem}"
    if kind == "compile" and "sub" not in free and out["sub"] != draws["sub"]:
        # each sub draws keys of its own (attention: calls; dilated: segments; model: a model), none re-derived
        return out, conflict("sub", f"the case's draw: sub={draws['sub']!r}, whose keys another sub cannot run "
                             f"(pick a case seed that draws sub={out['sub']!r}: `--kinds compile` and read its summary)")
    if kind == "attention":
        if out.get("group") == "pairs" and world != 4:
            if "group" not in free:
                return out, conflict("group", f"world={world}: the pairs {{0, 1}}, {{2, 3}} need world=4")
            out["group"] = None
        if "heads" not in free and "head_chunks" in free and out["head_chunks"] != "auto" and out["heads"][1] % out["head_chunks"]:
            out["head_chunks"] = "auto"
        unit = _shard_unit(out, world)
        if out["seq"] % unit:
            if "seq" not in free:
                return out, conflict("seq", f"world={world} sharding={out['sharding']}: the harness shards the sequence "
                                     f"into {unit} equal parts (seq a multiple of {unit})")
            out["seq"] = _fit_seq(out["seq"], 2 * world)
        seq = out["seq"]
        for i, c in enumerate(out["calls"]):
            cu = c["cu"]
            if cu is not None and (cu[0] != 0 or cu[-1] != seq or any(b < a for a, b in zip(cu, cu[1:]))):
                if "calls" not in free:
                    return out, conflict("calls", f"seq={seq}: call {i}'s documents {cu} must run from 0 to {seq}")
                c["cu"] = draw_documents(rng, seq, world)
        for key in ("window", "chunk_size"):
            if out.get(key) is not None and out[key] > seq and key in free:
                out[key] = rng.randint(1, seq)
    elif kind == "dilated":
        if out.get("group") == "pairs" and world != 4:
            if "group" not in free:
                return out, conflict("group", f"world={world}: the pairs {{0, 1}}, {{2, 3}} need world=4")
            out["group"] = None
        if out["seq"] % world:
            if "seq" not in free:
                return out, conflict("seq", f"world={world}: the harness shards the sequence into {world} equal "
                                     f"contiguous parts (seq a multiple of {world})")
            out["seq"] = world * max(1, out["seq"] // draws["world"])
        seq, local = out["seq"], out["seq"] // world
        fits = [w for w in range(1, seq + 1) if seq % w == 0 and (world == 1 or local % w == 0 or w % local == 0)]
        if "segment_lengths" in free and "dilation_rates" in free:
            for i, w in enumerate(out["segment_lengths"]):
                old_local = draws["seq"] // draws["world"]
                fitted = draws["seq"] % w == 0 and (draws["world"] == 1 or old_local % w == 0 or w % old_local == 0)
                if fitted and w not in fits:  # a drawn fit made stale (the draw's deliberate misfits stay)
                    w = rng.choice(fits)
                    out["segment_lengths"][i] = w
                    out["dilation_rates"][i] = rng.choice([r for r in range(1, w + 1) if w % r == 0])
    elif kind == "compile" and out.get("sub") == "attention" and "calls" in free:
        # a call on the pairs {0, 1}, {2, 3} (sp 2) only where the world is 4
        _rederive_calls(out["calls"], rng, lambda c: 2 if c["sp"] == 2 and world == 4 and draws["world"] == 4 else world,
                        lambda sp: 2 * sp)
        min_seq = min(c["seq"] for c in out["calls"])
        if out.get("chunk_size") is not None and out["chunk_size"] > min_seq and "chunk_size" in free:
            out["chunk_size"] = rng.randint(1, min_seq)
    elif kind == "compile" and out.get("sub") == "dilated" and world != draws["world"]:
        # its calls' sp and seq, and the segments fitted to them, are the drawn world's (re-derived for
        # sub="attention" only): run at another world the harness would shard for the wrong one (fz26b)
        return out, conflict("world", f"world={world}: a compiled dilated case's calls and segments are drawn for "
                             f"world={draws['world']}")
    elif kind == "compile" and out.get("sub") == "attention":
        bad = [i for i, c in enumerate(out["calls"]) if world % c["sp"] or c["seq"] % (2 * c["sp"])]
        if bad:
            return out, conflict("calls", f"world={world}: call {bad[0]}'s SP size must divide the world and its "
                                 "sequence be a multiple of 2 sp")
    return out, None


def draw_case(case_seed: int, kinds: tuple[str, ...] = ("attention", "dilated"), engine: str | None = None) -> dict[str, Any]:
    """The composition of case ``case_seed`` (a JSON-able dict; ``kind`` says which runner takes it); ``engine``:
    an ``engine`` case is drawn as that engine (``--set engine=...``, see ``fuzz_engines.draw_engine``)."""
    rng = random.Random(case_seed)
    weights = {"attention": 6, "dilated": 1, "model": 3, "engine": 2, "dynamic": 2, "trainer": 1, "compile": 3}
    kind = rng.choices(kinds, weights=[weights[k] for k in kinds])[0]
    if kind == "attention":
        draws = draw_attention(rng)
    elif kind == "dilated":
        draws = draw_dilated(rng)
    elif kind == "model":
        from seqpar.testing.fuzz_models import draw_model

        draws = draw_model(rng, memory=True)  # the memory features: the model kind only (fuzz_models)
    elif kind == "dynamic":
        from seqpar.testing.fuzz_dynamic import draw_dynamic

        draws = draw_dynamic(rng)
    elif kind == "compile":
        from seqpar.testing.fuzz_compile import draw_compile

        draws = draw_compile(rng, draw_documents)  # handed over: fuzz_compile does not import this module
    elif kind == "trainer":
        from seqpar.testing.fuzz_trainers import draw_trainer

        draws = draw_trainer(rng)
    else:
        from seqpar.testing.fuzz_engines import draw_engine

        draws = draw_engine(rng, engine)
    draws["case_seed"] = case_seed
    if kind == "compile":  # its calls on the pairs {0, 2}, {1, 3} (fz32): its own generator, the old draws stay
        from seqpar.testing.fuzz_compile import draw_compile_strided_pairs

        draws["strided_pairs"] = draw_compile_strided_pairs(case_seed, draws)
    if kind in ("attention", "dilated"):  # the pairs {0, 2}, {1, 3} (fz31): its own generator, the old draws stay
        draws["strided_pairs"] = draw_strided_pairs(case_seed, draws)
        draws["big_scale"] = draw_big_scale(case_seed, draws)  # a scale above 1 (fz32): its own generator too
    if kind == "attention" or (kind == "compile" and draws["sub"] == "attention"):  # the kinds that draw cu_seqlens
        draws["empty_docs"] = draw_empty_documents(case_seed, draws["calls"])  # its own generator: fz28
        if kind == "attention":  # an odd shard under contiguous sharding (fz30): its own generator too
            draws["odd_local"] = draw_odd_local(case_seed, draws)
            draws["wide_batch"] = draw_wide_batch(case_seed, draws)  # a batch of 3 or 4 (fz31): its own generator
            draws["disagree"] = draw_disagree(case_seed, draws)  # the last rank's option apart (fz31): its own too
            draws["disagree_input"] = draw_disagree_input(case_seed, draws)  # or its inputs (fz32): its own too
    if kind in ("attention", "dilated"):  # or its heads, head dim, dtype; dilated's inputs too (fz33): its own too
        draws["disagree_shape"] = draw_disagree_shape(case_seed, draws)
    elif kind in ("model", "engine", "compile") and draws.get("batch") == "packed":  # the packed rows' cu_seq_lens
        draws["empty_docs"] = draw_empty_documents(case_seed, [{"cu": [0, *itertools.accumulate(lens)]}
                                                               for lens in draws["lengths"]])
    elif kind == "dynamic":  # the planner's lengths (fz29): its own generator too, so the old draws stay
        from seqpar.testing.fuzz_dynamic import draw_empty_lengths

        draws["empty_docs"] = draw_empty_lengths(case_seed, draws["lengths"])
    elif kind == "trainer":  # a zero-length example where the data path carries one (fz29): its own generator too
        from seqpar.testing.fuzz_trainers_draw import draw_empty_rows

        draws["empty_docs"] = draw_empty_rows(case_seed, draws)
    if kind in ("engine", "dynamic", "trainer"):  # dkv_wire_dtype "bf16" in their config (fz33): its own generator
        from seqpar.testing.fuzz_models import draw_kind_dkv_wire

        draws["dkv_wire"] = draw_kind_dkv_wire(case_seed, kind)
    if kind == "model":  # the sequence_parallel keys no draw reached (fz30): its own generator, the old draws stay
        from seqpar.testing.fuzz_models import draw_config_knobs

        draws["config_knobs"] = draw_config_knobs(case_seed)
    if kind == "model":  # dkv_wire_dtype "bf16" through the config (fz31): its own generator, the old draws stay
        from seqpar.testing.fuzz_models import draw_dkv_wire, draw_swap

        draws["dkv_wire"] = draw_dkv_wire(case_seed)
        draws["swap"] = draw_swap(case_seed)  # an explicit swap value (fz31): its own generator too
    return draws


def without_fz33_draws(draws: dict[str, Any]) -> dict[str, Any]:
    """``draws`` without fz33's new draws (``disagree_shape``; ``dkv_wire`` in the ``engine``, ``dynamic`` and
    ``trainer`` kinds, not the ``model`` kind's own): the composition a case seed had before fz33, for the suite's
    pinned cases (tests/test_fuzz.py's ``fuzzer``), whose verdicts were pinned on it."""
    out = {**draws, "disagree_shape": None} if "disagree_shape" in draws else dict(draws)
    if out.get("kind") in ("engine", "dynamic", "trainer") and "dkv_wire" in out:
        out["dkv_wire"] = None
    return out


# --------------------------------------------------------------------------------------------------
# Running a case (the attention and dilated kinds' tensors, references, rank task and judging are in
# seqpar.testing.fuzz_attention_run; the other kinds' in their modules), the CLI
# --------------------------------------------------------------------------------------------------

def run_case(pools: Any, draws: dict[str, Any], timeout: float = 60.0, plant: str | None = None) -> dict[str, Any]:
    """Run one case on ``pools`` (a :class:`seqpar.testing.ranks.PoolSet`); returns its record
    ``{"case_seed", "kind", "draws", "verdict", "detail", "seconds"}``."""
    from seqpar.testing.ranks import PoolError, PoolTimeout, RankFailed

    t0 = time.time()
    trace = None
    record = draws
    draws = odd_local_applied(draws)  # an odd shard under contiguous sharding (fz30), before the documents' zeros
    draws = wide_batch_applied(draws)  # a batch of 3 or 4 (fz31)
    draws = big_scale_applied(draws)  # a scale above 1 (fz32)
    draws = empty_documents_applied(draws)  # each call's cu_seqlens with its zero-length documents (fz28)
    if draws["kind"] == "dynamic":  # the planner's lengths with theirs (fz29)
        from seqpar.testing.fuzz_dynamic import empty_lengths_applied

        draws = empty_lengths_applied(draws)
    restart = False  # the pool answered, but a case failed on it: its process groups may be broken
    try:
        if draws["kind"] == "model":
            from seqpar.testing.fuzz_models import run_model_case

            verdict, detail = run_model_case(pools, draws, timeout=timeout)
        elif draws["kind"] == "engine":
            from seqpar.testing.fuzz_engines import run_engine_case

            verdict, detail = run_engine_case(pools, draws, timeout=timeout)
        elif draws["kind"] == "dynamic":
            from seqpar.testing.fuzz_dynamic import run_dynamic_case

            verdict, detail = run_dynamic_case(pools, draws, timeout, plant)
        elif draws["kind"] == "compile":
            from seqpar.testing.fuzz_compile import run_compile_case

            verdict, detail, trace = run_compile_case(pools, draws, timeout, plant, positions=positions,
                                                      reference=attention_reference, dilated=dilated_reference)
        elif draws["kind"] == "trainer":
            from seqpar.testing.fuzz_trainers import run_trainer_case

            verdict, detail = run_trainer_case(pools, draws, timeout, plant)
        else:
            tensors = _tensors(draws)
            per_rank = pools.run(draws["world"], attention_task, draws, tensors, plant, timeout=timeout)
            trace = next((r["error"]["trace"] for r in per_rank if not r["ok"]), None)
            verdict, detail = classify_errors(per_rank) or ("", "")
            if not verdict and disagreement(draws):  # the last rank passed another option, and every rank ran
                verdict, detail = "WRONG", (f"the last rank passed another {disagreement(draws)} under check_inputs=True, "
                                            "but every rank ran (no refusal)")
            if not verdict and input_disagreement(draws):  # the last rank passed other inputs, and every rank ran
                verdict, detail = "WRONG", (f"the last rank passed another {input_disagreement(draws)} under "
                                            "check_inputs=True, but every rank ran (no refusal)")
            if not verdict:  # every rank ran: the reference decides
                ref = (attention_reference if draws["kind"] == "attention" else dilated_reference)(draws, tensors)
                verdict, detail = _judge_attention(draws, ref, per_rank)
        restart = verdict == "crash"
    except PoolTimeout:  # the pool was killed: the next case starts a fresh one
        verdict, detail = "crash", f"timeout after {timeout:.0f} s (the rank pool was restarted)"
    except PoolError as e:  # killed too, unless every rank answered (RankFailed.usable)
        verdict, detail = "crash", f"rank pool: {str(e)[-400:]}"
        restart = isinstance(e, RankFailed) and e.usable
    except Exception as e:  # noqa: BLE001 - a fuzzer error is a crash of the case, reported with its seed
        verdict, detail = "crash", f"driver: {type(e).__name__}: {str(e)[:300]}"
    if restart:
        pools.get(draws["world"]).kill()  # the next case on this world size starts a fresh pool
        detail += " (the rank pool was restarted)"
    return {"case_seed": draws["case_seed"], "kind": draws["kind"], "verdict": verdict, "detail": detail,
            "seconds": round(time.time() - t0, 2), "draws": record, **({"trace": trace} if trace else {})}


def summary(draws: dict[str, Any]) -> str:
    """One short line naming the case's composition."""
    if odd_local_applied(draws) is not draws:  # the sequence and documents as the run sees them (fz30)
        return summary({**odd_local_applied(draws), "odd_local": None}) + " odd-local"
    if wide_batch_applied(draws) is not draws:  # the batch as the run sees it (fz31)
        return summary({**wide_batch_applied(draws), "wide_batch": None}) + " wide-batch"
    if big_scale_applied(draws) is not draws:  # the scale as the run sees it (fz32)
        return summary({**big_scale_applied(draws), "big_scale": None}) + " big-scale"
    if draws.get("strided_pairs") and draws.get("group") == "pairs":  # the non-consecutive pairs (fz31)
        return summary({**draws, "strided_pairs": None}).replace("group=pairs", "group=pairs{0,2}{1,3}")
    if draws.get("dkv_wire") and draws["kind"] in ("engine", "dynamic", "trainer"):  # the bf16 wire (fz33)
        return summary({**draws, "dkv_wire": None}) + f" dkv={draws['dkv_wire']}"
    if disagreement(draws):  # the last rank's option apart (fz31)
        return summary({**draws, "disagree": None}) + f" disagree={disagreement(draws)}"
    if input_disagreement(draws):  # the last rank's inputs apart (fz32)
        return (summary({**draws, "disagree_input": None, "disagree_shape": None})
                + f" disagree-input={input_disagreement(draws)}")
    if draws.get("empty_docs") and (draws.get("batch") == "packed" or any(c.get("cu") is not None
                                                                         for c in draws.get("calls", []))):
        # the documents as the run sees them (lengths 0 among them), and a word saying so (not where a forced
        # empty_docs finds no documents to put them in)
        return summary({**empty_documents_applied(draws), "empty_docs": None}) + " empty-docs"
    if draws.get("empty_docs") and draws["kind"] == "dynamic":  # the lengths as the planner gets them (fz29)
        from seqpar.testing.fuzz_dynamic import empty_lengths_applied

        return summary({**empty_lengths_applied(draws), "empty_docs": None}) + " empty-docs"
    if draws["kind"] == "model":
        from seqpar.testing.fuzz_models import model_summary

        return model_summary(draws)
    if draws["kind"] == "engine":
        from seqpar.testing.fuzz_engines import engine_summary

        return engine_summary(draws)
    if draws["kind"] == "dynamic":
        from seqpar.testing.fuzz_dynamic import dynamic_summary

        return dynamic_summary(draws)
    if draws["kind"] == "compile":
        from seqpar.testing.fuzz_compile import compile_summary

        return compile_summary(draws)
    if draws["kind"] == "trainer":
        from seqpar.testing.fuzz_trainers import trainer_summary

        return trainer_summary(draws)
    return attention_summary(draws)  # the attention and dilated kinds (seqpar.testing.fuzz_attention)


class Fuzzer:
    """Runs cases on one :class:`~seqpar.testing.ranks.PoolSet` (one pool per world size, kept warm)."""

    def __init__(self, timeout: float = 60.0, model_timeout: float = 300.0) -> None:
        from seqpar.testing.ranks import PoolSet

        # DeepSpeed (the engine cases) JIT-builds a CPU comm op under TORCH_EXTENSIONS_DIR, one folder per user by
        # default: a rank killed mid-build elsewhere (a timed-out test) leaves a lock there that makes every later
        # build wait forever. One folder per Python environment, as tests/conftest.py sets; the ranks inherit it.
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
        self.pools = PoolSet("cpu", pg_timeout_s=60.0, max_threads=80)
        self.timeout, self.model_timeout = timeout, model_timeout

    def run(self, draws: dict[str, Any], plant: str | None = None) -> dict[str, Any]:
        slow = draws["kind"] in ("model", "engine", "dynamic", "trainer", "compile")
        return run_case(self.pools, draws, self.model_timeout if slow else self.timeout, plant)

    def close(self) -> None:
        self.pools.close()

    def __enter__(self) -> Fuzzer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_cases(seeds: list[int], kinds: tuple[str, ...] = ("attention", "dilated"), *, plant: str | None = None,
              timeout: float = 60.0, model_timeout: float = 300.0, out: Any = None,
              overrides: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Draw and run the cases of ``seeds`` (each draw forced with ``overrides`` by :func:`force`, e.g. ``{"world": 1}`` to
    narrow a finding down); prints one line per case to ``out`` (None: silent)."""
    records = []
    with Fuzzer(timeout, model_timeout) as fuzzer:
        for i, s in enumerate(seeds):
            draws, conflict = force(draw_case(s, kinds, (overrides or {}).get("engine")), overrides or {})
            if conflict:  # the forced draws cannot be judged: not seqpar's to answer for
                rec = {"case_seed": s, "kind": draws["kind"], "verdict": "skipped", "detail": conflict,
                       "seconds": 0.0, "draws": draws}
            else:
                rec = fuzzer.run(draws, plant)
            records.append(rec)
            if out is not None:
                print(f"[{i:4d}] case-seed {s:10d} {rec['verdict']:7s} {rec['seconds']:6.1f}s  {summary(draws)}  "
                      f"-- {rec['detail']}", file=out, flush=True)
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m seqpar.testing.fuzz", description=__doc__.split("\n")[0])
    parser.add_argument("--cases", type=int, default=20, help="how many cases to draw (default 20)")
    parser.add_argument("--seed", type=int, default=0, help="the run's seed: case i's seed is drawn from it")
    parser.add_argument("--case-seed", type=int, action="append", metavar="X",
                        help="run only the case of this case seed (repeatable); --cases and --seed are then ignored")
    parser.add_argument("--kinds", default=",".join(DEFAULT_KINDS),
                        help="comma-separated kinds to draw from: attention, dilated, model, engine, dynamic, "
                             "trainer, compile (default: all but compile)")
    parser.add_argument("--json", metavar="OUT", help="write every case (seed, draws, verdict, detail) to OUT")
    parser.add_argument("--timeout", type=float, default=60.0, help="per attention / dilated case, seconds")
    parser.add_argument("--model-timeout", type=float, default=300.0, help="per model, engine, dynamic or trainer case, seconds")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                        help='override a draw of every case, e.g. --set world=1 --set checkpointing=null')
    parser.add_argument("--verbose", action="store_true", help="print a failing rank's traceback under each crash")
    args = parser.parse_args(argv)
    kinds = tuple(k for k in args.kinds.split(",") if k)
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        parser.error(f"unknown kinds {bad}: choose from {list(KINDS)}")
    import transformers

    transformers.logging.set_verbosity_error()
    seeds = args.case_seed or case_seeds(args.seed, args.cases)
    t0 = time.time()
    overrides = {}
    for item in args.set:
        key, _, value = item.partition("=")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value  # a bare string: --set mode=ring
    records = run_cases(seeds, kinds, timeout=args.timeout, model_timeout=args.model_timeout, out=sys.stdout,
                        overrides=overrides)
    counts = Counter(r["verdict"] for r in records)
    print(f"{len(records)} cases in {time.time() - t0:.0f} s: " + ", ".join(f"{v} {counts.get(v, 0)}" for v in VERDICTS),
          flush=True)
    for r in records:
        if r["verdict"] in ("WRONG", "crash", "breaks"):
            sets = "".join(f" --set {k}={json.dumps(v)}" for k, v in overrides.items())
            print(f"  {r['verdict']}: --case-seed {r['case_seed']} --kinds {','.join(kinds)}{sets} ({summary(r['draws'])}): "
                  f"{r['detail']}")
            if args.verbose and r.get("trace"):
                print("    " + r["trace"].replace("\n", "\n    "))
    if args.json:
        Path(args.json).write_text(json.dumps({"seed": args.seed, "kinds": list(kinds), "counts": dict(counts),
                                               "cases": records}, indent=1, default=str))
    return 1 if counts.get("WRONG") or counts.get("crash") or counts.get("breaks") else 0


if __name__ == "__main__":
    sys.exit(main())
