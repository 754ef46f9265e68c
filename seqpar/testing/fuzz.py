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
  sequence); q, k and v now and then as the views models pass (:mod:`seqpar.testing.fuzz_strides`: a ``bshd``
  buffer seen ``bhsd`` or the reverse, three narrow views of one fused qkv buffer); forward only under
  ``no_grad`` / ``inference_mode`` or a frozen K/V (:data:`GRADS`), frozen sinks, documents as an int32 tensor or a
  tuple (:data:`CU_AS`), ``sharding=None`` / ``layout=None``, ``group=`` the manager's SP group, balanced sharding
  without documents, MQA's one K/V head expanded (stride 0) to the query heads;
- ``dilated``: a direct :func:`seqpar.dilated_attention` call (patterns, head layouts, ring / allgather,
  P in 1..4, a shape the patterns do not fit now and then, ``dkv_wire_dtype`` as above, V's head dim apart,
  ``scale``, strided views as above, at P = 4 the pairs as ``group=``, ``mode="auto"``, :data:`GRADS`, two calls
  before one backward, ``group=torch.distributed.group.WORLD`` without a manager);
- ``model``: a tiny model of any type of :func:`seqpar.testing.tiny_models.decoder_model_types` under
  ``swap_attention`` on P in 1..4 (:mod:`seqpar.testing.fuzz_models`);
- ``engine``: a ``model`` case trained through an engine: DeepSpeed ZeRO-1/2/3, FSDP2, or TP 2 x SP P/2
  (:mod:`seqpar.testing.fuzz_engines`), every reduced gradient against one process;
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
import json
import os
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from seqpar.testing.fuzz_strides import STRIDES, strided_grads, strided_inputs
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
    "Fuzzer",
    "main",
]

VERDICTS = ("exact", "refused", "WRONG", "crash", "skipped", "breaks")
KINDS = ("attention", "dilated", "model", "engine", "dynamic", "trainer", "compile")
DEFAULT_KINDS = KINDS[:-1]  # without --kinds: not compile (a trace per case, 10-60 s on CPU)
# (q_heads, kv_heads, qk_head_dim, v_head_dim): MHA, GQA, MQA, an odd head dim, MLA-like V dim apart
_HEADS = ((4, 2, 8, 8), (4, 1, 6, 6), (2, 2, 8, 8), (4, 4, 4, 4), (8, 2, 8, 8), (4, 2, 8, 4), (3, 1, 5, 5),
          (6, 3, 4, 4))
_TOL = {torch.float32: 2e-5, torch.float64: 1e-9}


def case_seeds(seed: int, n: int) -> list[int]:
    """The case seeds of a run: ``n`` integers drawn from ``seed`` (case ``i`` is the same whatever ``n``)."""
    rng = random.Random(seed)
    return [rng.randrange(2 ** 31) for _ in range(n)]


# --------------------------------------------------------------------------------------------------
# Draws (plain JSON-able dicts; every tensor is rebuilt from the case seed)
# --------------------------------------------------------------------------------------------------

def _draw_documents(rng: random.Random, seq: int, world: int) -> list[int]:
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


def _draw_attention(rng: random.Random) -> dict[str, Any]:
    world = rng.randint(1, 4)
    mode = rng.choice(("ring", "ring", "allgather", "ulysses", "hybrid", "auto"))
    divisors = [u for u in range(1, world + 1) if world % u == 0]
    inner = [u for u in divisors if 1 < u < world]
    ulysses_size = (rng.choice(inner) if inner and rng.random() < 0.8 else rng.choice(divisors)) if mode == "hybrid" else 1
    hq, hkv, d, dv = rng.choice(_HEADS)
    docs = rng.random() < 0.5
    sharding = rng.choice(("contiguous", "zigzag", "balanced") if docs else ("contiguous", "zigzag", "zigzag"))
    chunk = rng.randint(1, 6)  # tokens per zigzag chunk
    seq = 2 * world * chunk
    two_calls = rng.random() < 0.25
    calls = []
    for _ in range(2 if two_calls else 1):
        calls.append({"cu": _draw_documents(rng, seq, world) if docs else None})
    # cu_seqlens needs batch 1 (its docstring): batch 2 with documents is drawn rarely, to see the refusal
    batch = 2 if (not docs and rng.random() < 0.3) or rng.random() < 0.03 else 1
    draws = {
        "kind": "attention", "world": world, "mode": mode, "ulysses_size": ulysses_size,
        "declare_sharding": rng.random() < 0.5, "sharding": sharding, "heads": [hq, hkv, d, dv],
        "batch": batch, "seq": seq, "causal": rng.random() < 0.7, "calls": calls,
        "window": rng.randint(1, seq) if rng.random() < 0.3 else None,
        "sinks": rng.random() < 0.25,
        "chunk_size": rng.randint(1, seq) if rng.random() < 0.2 else None,
        "alibi": rng.random() < 0.2,
        "softcap": round(rng.uniform(0.5, 5.0), 3) if rng.random() < 0.2 else None,
        "scale": round(rng.uniform(0.1, 1.0), 3) if rng.random() < 0.2 else None,
        "layout": "bshd" if rng.random() < 0.2 else "bhsd",
        "head_chunks": rng.choice([h for h in range(1, hkv + 1) if hkv % h == 0]) if rng.random() < 0.3 else "auto",
        "overlap": rng.random() < 0.8,
        "check_inputs": rng.random() < 0.7,
        # not bf16 / fp16: the bar is exact against float64 (fp32 to ~1e-5); low precision has its own bounds and
        # tests (tests/test_low_precision_ring.py, BENCHMARKS.md), not a per-tensor exactness verdict
        "dtype": "float64" if rng.random() < 0.2 else "float32",
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


def _draw_dilated(rng: random.Random) -> dict[str, Any]:
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
    hq, hkv, d, _ = rng.choice(_HEADS)
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
            c["cu"] = _draw_documents(rng, seq, sp)
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
                c["cu"] = _draw_documents(rng, seq, world)
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
        draws = _draw_attention(rng)
    elif kind == "dilated":
        draws = _draw_dilated(rng)
    elif kind == "model":
        from seqpar.testing.fuzz_models import draw_model

        draws = draw_model(rng, memory=True)  # the memory features: the model kind only (fuzz_models)
    elif kind == "dynamic":
        from seqpar.testing.fuzz_dynamic import draw_dynamic

        draws = draw_dynamic(rng)
    elif kind == "compile":
        from seqpar.testing.fuzz_compile import draw_compile

        draws = draw_compile(rng, _draw_documents)  # handed over: fuzz_compile does not import this module
    elif kind == "trainer":
        from seqpar.testing.fuzz_trainers import draw_trainer

        draws = draw_trainer(rng)
    else:
        from seqpar.testing.fuzz_engines import draw_engine

        draws = draw_engine(rng, engine)
    draws["case_seed"] = case_seed
    return draws


# --------------------------------------------------------------------------------------------------
# Tensors, sharding, references
# --------------------------------------------------------------------------------------------------

def _tensors(draws: dict[str, Any]) -> dict[str, Any]:
    """Full-sequence float64 inputs of every call of the case (from its seed)."""
    g = torch.Generator().manual_seed(draws["case_seed"])
    hq, hkv, d, dv = draws["heads"]
    b, s = draws["batch"], draws["seq"]
    calls = []
    for _ in draws.get("calls", [{}]):
        calls.append({n: torch.randn(b, h, s, w, generator=g, dtype=torch.float64)
                      for n, h, w in (("q", hq, d), ("k", hkv, d), ("v", hkv, dv), ("dout", hq, dv))})
    out: dict[str, Any] = {"calls": calls}
    if draws.get("sinks"):
        out["sinks"] = torch.randn(hq, generator=g, dtype=torch.float64)
    if draws.get("alibi"):
        out["alibi"] = torch.rand(hq, generator=g, dtype=torch.float64) * 0.5 + 0.01
    return out


def positions(draws: dict[str, Any], cu: list[int] | None, rank: int) -> torch.Tensor:
    """Global positions rank ``rank`` holds, in local order: contiguous and zigzag from their definition
    (DESIGN.md: zigzag rank r holds chunks r and 2P-1-r), balanced from seqpar's own ``shard_index``."""
    world, seq, sharding = draws["world"], draws["seq"], draws["sharding"]
    if sharding == "balanced":
        from seqpar.sequence.sharding import shard_index

        return shard_index(seq, rank, world, "balanced", cu_seqlens=cu)
    chunks = [rank] if sharding == "contiguous" else [rank, 2 * world - 1 - rank]
    c = seq // (world if sharding == "contiguous" else 2 * world)
    return torch.cat([torch.arange(i * c, (i + 1) * c) for i in chunks])


def _visible(draws: dict[str, Any], cu: list[int] | None) -> torch.Tensor:
    """``(S, S)`` bool: key j visible to query i (documents, causal, window, chunks)."""
    seq = draws["seq"]
    pos = torch.arange(seq)
    i, j = pos[:, None], pos[None, :]
    doc = torch.zeros(seq, dtype=torch.long) if cu is None else torch.bucketize(pos, torch.tensor(cu[1:]), right=True)
    ok = doc[:, None] == doc[None, :]
    if draws["causal"]:
        ok &= j <= i
    if draws.get("window") is not None:
        ok &= (i - j < draws["window"]) if draws["causal"] else ((i - j).abs() < draws["window"])
    if draws.get("chunk_size") is not None:
        starts = torch.tensor(cu if cu is not None else [0])[doc]
        idx = (pos - starts) // draws["chunk_size"]
        ok &= idx[:, None] == idx[None, :]
    return ok


def attention_reference(draws: dict[str, Any], tensors: dict[str, Any]) -> dict[str, list[torch.Tensor]]:
    """One process, float64, dense: per call ``[out, dq, dk, dv]``, plus ``dsinks`` (summed over calls).

    Scores ``scale * q.k``, soft-capped (``softcap * tanh(s / softcap)``), then ALiBi's ``-m_h (i - j)``
    added, then the mask; sinks join each softmax denominator."""
    hq, hkv, d, _ = draws["heads"]
    scale = draws.get("scale") or d ** -0.5
    sinks = tensors["sinks"].clone().requires_grad_() if "sinks" in tensors else None
    leaves, outs, total = [], [], 0.0
    for call, t in zip(draws["calls"], tensors["calls"], strict=True):
        q, k, v = (t[n].clone().requires_grad_() for n in "qkv")
        ke, ve = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
        s = q @ ke.transpose(-1, -2) * scale
        if draws.get("softcap") is not None:
            s = draws["softcap"] * torch.tanh(s / draws["softcap"])
        if "alibi" in tensors:
            pos = torch.arange(draws["seq"], dtype=torch.float64)
            s = s - tensors["alibi"].view(1, -1, 1, 1) * (pos[:, None] - pos[None, :])
        s = s.masked_fill(~_visible(draws, call["cu"]), float("-inf"))
        if sinks is not None:
            col = sinks.view(1, -1, 1, 1).expand(*s.shape[:3], 1)
            p = torch.softmax(torch.cat([s, col], -1), -1)[..., :-1]
        else:
            p = torch.softmax(s, -1)
        out = p @ ve
        total = total + (out * t["dout"]).sum()
        leaves.append((q, k, v))
        outs.append(out.detach())
    total.backward()
    res = {"calls": [[o, q.grad, k.grad, v.grad] for o, (q, k, v) in zip(outs, leaves, strict=True)]}
    if sinks is not None:
        res["dsinks"] = sinks.grad
    return res


def dilated_reference(draws: dict[str, Any], tensors: dict[str, Any]) -> dict[str, list[torch.Tensor]]:
    """LongNet's definition (:mod:`seqpar.attn.dilated`'s docstring) with explicit float64 masks: pattern
    ``(w, r)`` keeps, in each segment of ``w`` positions, those with ``p % r`` equal to the head's offset
    (mixed: ``h % r``; grouped: pattern ``i`` for head group ``i``, offset ``i % r``); patterns merge by
    their softmax denominators; a row no pattern selects is 0."""
    hq, hkv, d, _ = draws["heads"]
    seq, n = draws["seq"], len(draws["segment_lengths"])
    pos = torch.arange(seq)
    masks = torch.zeros(n, hq, seq, seq, dtype=torch.bool)
    for p, (w, r) in enumerate(zip(draws["segment_lengths"], draws["dilation_rates"], strict=True)):
        for h in range(hq):
            if draws["head_layout"] == "mixed":
                off = h % r
            elif h // (hq // n) != p:
                continue
            else:
                off = p % r
            sel = (pos % w) % r == off
            m = ((pos[:, None] // w) == (pos[None, :] // w)) & sel[:, None] & sel[None, :]
            if draws["causal"]:
                m &= pos[None, :] <= pos[:, None]
            masks[p, h] = m
    res = []
    for t in tensors["calls"]:  # each call on its own inputs (two calls: two layers)
        q, k, v = (t[x].clone().requires_grad_() for x in "qkv")
        ke, ve = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
        s = q @ ke.transpose(-1, -2) * (draws.get("scale") or d ** -0.5)
        cat = torch.cat([s.masked_fill(~m, float("-inf")) for m in masks], -1)
        peak = cat.amax(-1, keepdim=True)
        peak = torch.where(torch.isneginf(peak), torch.zeros_like(peak), peak).detach()
        e = torch.exp(cat - peak)
        out = (e @ torch.cat([ve] * n, 2)) / e.sum(-1, keepdim=True).clamp_min(1.0)
        out.backward(t["dout"])
        res.append([out.detach(), q.grad, k.grad, v.grad])
    return {"calls": res}


# --------------------------------------------------------------------------------------------------
# Rank side
# --------------------------------------------------------------------------------------------------

def _plant(name: str | None, rank: int) -> Any:
    """A deliberately broken seqpar, for the fuzzer's own tests: ``"ring_scale"`` scales the ring's output by
    1.001; ``"ring_hang"`` makes rank 0's ring call sleep for 10 minutes; ``"ring_raise"`` makes every rank's
    ring call raise a ``RuntimeError`` (a crash, not a refusal). Returns an undo callable (the pool's ranks
    must leave each task as they found it)."""
    if name is None:
        return lambda: None
    if name not in ("ring_scale", "ring_hang", "ring_raise"):
        raise ValueError(f"unknown plant {name!r}")
    from seqpar.attn import dispatch

    original = dispatch.RingAttention

    class Scaled:
        @staticmethod
        def apply(*args: Any) -> torch.Tensor:
            if name == "ring_hang" and rank == 0:
                time.sleep(600)
            if name == "ring_raise":
                raise RuntimeError("planted: the ring broke")
            out = original.apply(*args)
            return out * 1.001 if name == "ring_scale" else out

    dispatch.RingAttention = Scaled

    def undo() -> None:
        dispatch.RingAttention = original
    return undo


def _local(x: torch.Tensor, pos: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.index_select(2, pos).to(dtype)


def _grad_context(draws: dict[str, Any]) -> Any:
    """The context a case's forwards run in (:data:`GRADS`)."""
    import contextlib

    grad = draws.get("grad")
    return torch.no_grad() if grad == "no_grad" else torch.inference_mode() if grad == "inference" else contextlib.nullcontext()


def attention_task(ctx: Any, draws: dict[str, Any], tensors: dict[str, Any], plant: str | None = None) -> dict[str, Any]:
    """Pool task (every rank): this rank's part of an ``attention`` or ``dilated`` case. Returns
    ``{"ok": True, "calls": [[out, dq, dk, dv] (local rows; None where no gradient)], "dsinks"?}`` or
    ``{"ok": False, "error"}``."""
    import torch.distributed as dist

    import seqpar

    rank, world = ctx.rank, ctx.world_size
    dtype = getattr(torch, draws["dtype"])
    undo = _plant(plant, rank)
    grad = draws.get("grad")
    backward = grad in (None, "frozen_kv")
    try:
        if draws["kind"] == "dilated":
            group, sp_draws, sp_rank = None, draws, rank
            if draws.get("group") == "world":  # no manager: the whole world on purpose, as the docstring advises
                group = dist.group.WORLD
            else:
                seqpar.init_process_groups(sp_size=world)
            if draws.get("group") == "pairs":  # every rank makes every subgroup (torch's rule)
                group, _ = dist.new_subgroups(2)
                sp_draws, sp_rank = {**draws, "world": 2}, rank % 2
            pos = positions({**sp_draws, "sharding": "contiguous"}, None, sp_rank)
            leaves, outs, total = [], [], 0.0
            for t in tensors["calls"]:
                q, k, v = (_local(t[n], pos, dtype) for n in "qkv")
                shapes = [x.shape for x in (q, k, v)]
                xs, (q, k, v) = strided_inputs(q, k, v, "bhsd", draws.get("strided"), frozen_kv=grad == "frozen_kv")
                with _grad_context(draws):
                    out = seqpar.dilated_attention(
                        q, k, v, segment_lengths=draws["segment_lengths"], dilation_rates=draws["dilation_rates"],
                        causal=draws["causal"], scale=draws.get("scale"), mode=draws["mode"], group=group,
                        sharding=draws["sharding"], head_layout=draws["head_layout"], check_inputs=draws["check_inputs"],
                        dkv_wire_dtype=draws.get("dkv_wire_dtype", "fp32"))
                if backward:
                    total = total + (out * _local(t["dout"], pos, dtype)).sum()
                leaves.append((xs, shapes))
                outs.append(out.detach().clone())
            if backward:
                total.backward()
            return {"ok": True, "calls": [[o, *strided_grads(xs, shapes, "bhsd", draws.get("strided"))]
                                          for o, (xs, shapes) in zip(outs, leaves, strict=True)]}
        manager = seqpar.init_process_groups(sp_size=world, ulysses_size=draws["ulysses_size"],
                                             sharding=draws["sharding"] if draws["declare_sharding"] else None)
        group, sp_draws, sp_rank = None, draws, rank
        if draws.get("group") == "pairs":  # every rank makes every subgroup (torch's rule)
            group, _ = dist.new_subgroups(2)
            sp_draws, sp_rank = {**draws, "world": 2}, rank % 2
        elif draws.get("group_arg") == "manager":
            group = manager.sp_group
        # the defaults a caller leaves (fz26b): sharding=None means the declared one, else contiguous
        sharding = draws["sharding"]
        if draws.get("omit_sharding") and (draws["declare_sharding"] or sharding == "contiguous"):
            sharding = None
        layout = None if draws.get("omit_layout") and draws["layout"] == "bhsd" else draws["layout"]
        sinks = tensors["sinks"].to(dtype) if "sinks" in tensors else None
        if sinks is not None and draws.get("sinks_grad", True) and grad != "frozen_kv":
            sinks.requires_grad_()
        alibi = tensors["alibi"].to(dtype) if "alibi" in tensors else None
        leaves, outs, total = [], [], 0.0
        for call, t in zip(draws["calls"], tensors["calls"], strict=True):
            pos = positions(sp_draws, call["cu"], sp_rank)
            q, k, v, dout = (_local(t[n], pos, dtype) for n in ("q", "k", "v", "dout"))
            shapes = [x.shape for x in (q, k, v)]
            xs, (q, k, v) = strided_inputs(q, k, v, draws["layout"], draws.get("strided"), frozen_kv=grad == "frozen_kv")
            if draws.get("expand_kv"):  # one K/V head seen as every query head's: stride 0 over the heads
                hd = 2 if draws["layout"] == "bshd" else 1
                k, v = (x.expand(*x.shape[:hd], q.shape[hd], *x.shape[hd + 1:]) for x in (k, v))
            cu = call["cu"]
            if cu is not None:
                cu_as = draws.get("cu_as", "int64")
                cu = tuple(cu) if cu_as == "tuple" else torch.tensor(cu, dtype=getattr(torch, cu_as))
            with _grad_context(draws):
                out = seqpar.attention(
                    q, k, v, causal=draws["causal"], scale=draws["scale"], mode=draws["mode"], group=group,
                    sharding=sharding, overlap=draws["overlap"], check_inputs=draws["check_inputs"],
                    head_chunks=draws["head_chunks"], cu_seqlens=cu, window=draws["window"], sinks=sinks, layout=layout,
                    chunk_size=draws["chunk_size"], softcap=draws["softcap"], alibi_slopes=alibi,
                    dkv_wire_dtype=draws.get("dkv_wire_dtype", "fp32"))
            if draws["layout"] == "bshd":
                out = out.transpose(1, 2)
            if backward:
                total = total + (out * dout).sum()
            leaves.append((xs, shapes))
            outs.append(out.detach().clone())  # clone: an inference tensor leaves inference mode as a plain one
        if backward:
            total.backward()
        calls = []
        for o, (xs, shapes) in zip(outs, leaves, strict=True):
            calls.append([o, *strided_grads(xs, shapes, draws["layout"], draws.get("strided"))])
        res: dict[str, Any] = {"ok": True, "calls": calls}
        if sinks is not None and sinks.grad is not None:
            res["dsinks"] = sinks.grad
        return res
    except Exception as e:  # noqa: BLE001 - classified by the driver
        return {"ok": False, "error": error_record(e)}
    finally:
        undo()


# --------------------------------------------------------------------------------------------------
# Verdicts
# --------------------------------------------------------------------------------------------------

def _judge_attention(draws: dict[str, Any], ref: dict[str, Any], per_rank: list[dict[str, Any]]) -> tuple[str, str]:
    dtype = getattr(torch, draws["dtype"])
    tol = _TOL[dtype]
    world = draws["world"]
    sp = 2 if draws.get("group") == "pairs" else world  # each SP group computes the whole sequence
    scale_all = max(float(t.abs().max()) for c in ref["calls"] for t in c)
    # A tensor that is ~0 in exact arithmetic (dq where each query sees one key) carries the rounding of
    # the case's largest products: judge it on the case's scale, not on its own noise.
    floor = tol * 0.1 * scale_all
    # dkv_wire_dtype="bf16": the ring's travelling dK/dV accumulators are rounded to bf16 once per hop (at most P - 1
    # hops, unit roundoff 2**-9; docs/configuration.md), so dk and dv are judged at 4 (P - 1) 2**-9 of their scale
    # (elementwise: an accumulator on its way may exceed the finished gradient); out and dq must stay exact
    wire_tol = max(tol, 4 * (sp - 1) * 2.0 ** -9) if draws.get("dkv_wire_dtype", "fp32") == "bf16" else tol
    sharded = {**(draws if draws["kind"] == "attention" else {**draws, "sharding": "contiguous"}), "world": sp}
    worst = ("", 0.0)
    # what the case's grad draw (GRADS) asks for: forward only judges out; a frozen K/V out and dq
    grad = draws.get("grad")
    judged = ("out",) if grad in ("no_grad", "inference") else ("out", "dq") if grad == "frozen_kv" else ("out", "dq", "dk", "dv")
    for ci, (call, ref_call) in enumerate(zip(draws.get("calls", [{"cu": None}]), ref["calls"], strict=True)):
        for ti, name in enumerate(judged):
            for g0 in range(0, world, sp):
                full = torch.zeros_like(ref_call[ti])
                for r in range(sp):
                    got = per_rank[g0 + r]["calls"][ci][ti]
                    if got is None:
                        return "WRONG", f"{name} missing on rank {g0 + r}: no gradient reached the leaf"
                    full[:, :, positions(sharded, call["cu"], r)] = got.double()
                t_tol = wire_tol if name in ("dk", "dv") else tol
                ok, err = close(full, ref_call[ti], t_tol, t_tol * 0.1 * scale_all)
                label = (f"call{ci}." if len(ref["calls"]) > 1 else "") + (f"ranks{g0}-{g0 + sp - 1}." if sp < world else "") + name
                if not ok:
                    return "WRONG", f"{label} off by {err:.2e} of its scale (tol {t_tol:.0e})"
                worst = max(worst, (label, err), key=lambda x: x[1])
    if "dsinks" in ref and grad is None and draws.get("sinks_grad", True):  # the sinks trained
        # each SP group's ranks sum to the reference's: the pairs' to twice it
        if any("dsinks" not in p for p in per_rank):
            return "WRONG", "dsinks missing: no gradient reached the sinks"
        got = sum(p["dsinks"].double() for p in per_rank) / (world // sp)
        ok, err = close(got, ref["dsinks"], tol, floor)
        if not ok:
            return "WRONG", f"dsinks off by {err:.2e} of its scale (tol {tol:.0e})"
    return "exact", f"worst {worst[0]} {worst[1]:.1e}"


def run_case(pools: Any, draws: dict[str, Any], timeout: float = 60.0, plant: str | None = None) -> dict[str, Any]:
    """Run one case on ``pools`` (a :class:`seqpar.testing.ranks.PoolSet`); returns its record
    ``{"case_seed", "kind", "draws", "verdict", "detail", "seconds"}``."""
    from seqpar.testing.ranks import PoolError, PoolTimeout, RankFailed

    t0 = time.time()
    trace = None
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
            "seconds": round(time.time() - t0, 2), "draws": draws, **({"trace": trace} if trace else {})}


def summary(draws: dict[str, Any]) -> str:
    """One short line naming the case's composition."""
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
    for key in ("window", "chunk_size", "softcap", "scale"):
        if draws.get(key) is not None:
            parts.append(f"{key}={draws[key]}")
    for key in ("sinks", "alibi"):
        if draws.get(key):
            parts.append(key)
    if len(draws["calls"]) > 1:
        parts.append("two-calls")
    if draws["layout"] != "bhsd":
        parts.append(draws["layout"])
    if draws["head_chunks"] != "auto":
        parts.append(f"head_chunks={draws['head_chunks']}")
    if not draws["overlap"]:
        parts.append("no-overlap")
    if not draws["check_inputs"]:
        parts.append("no-check")
    parts.append(draws["dtype"])
    if draws.get("dkv_wire_dtype", "fp32") != "fp32":
        parts.append(f"dkv={draws['dkv_wire_dtype']}")
    if draws.get("group"):
        parts.append(f"group={draws['group']}")
    if draws.get("strided"):
        parts.append(f"strided={draws['strided']}")
    if draws.get("grad"):
        parts.append(f"grad={draws['grad']}")
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
