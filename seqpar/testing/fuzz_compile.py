"""The fuzzer's ``compile`` cases (:mod:`seqpar.testing.fuzz`): ``torch.compile`` over a direct
:func:`seqpar.attention` call or a tiny swapped model, called several times with changing inputs, against one
process in float64 without compile.

Not drawn when ``--kinds`` is not given: a case traces forward and backward (and retraces on every recompile),
10-60 s of CPU per case on a loaded 2-core machine where an ``attention`` case takes ~1 s, so it would make the
default fuzz several times slower. Ask for it: ``python -m seqpar.testing.fuzz --kinds compile``.

Drawn, ``sub="attention"`` (a compiled function around :func:`seqpar.attention`): P in 1..4; mode (ring,
allgather, ulysses, hybrid with a drawn Ulysses degree, auto after one eager call that probes its links);
sharding (contiguous, zigzag; balanced with documents); MHA / GQA / MQA, odd head dims, V's head dim apart;
packed documents as an int tensor (read by the op at run time) or as ints (a graph constant: a new layout must
recompile); window (its value may change between calls), sinks, chunked attention, ALiBi, soft-cap, scale,
layout bshd, head_chunks, overlap, the bf16 dK/dV wire (dk and dv judged at its bound, as the attention kind's),
q / k / v as the views models pass (:mod:`seqpar.testing.fuzz_strides`: a ``bshd`` buffer seen ``bhsd``, a fused
qkv split); ``check_inputs`` (mostly off: on, the cross-rank check breaks the graph,
docs/performance.md); fp32 or float64; ``dynamic`` None / True / False; backend ``eager`` / ``aot_eager``
(``inductor`` now and then: its C++ builds are slow on CPU); ``fullgraph=True`` now and then where one graph is
promised (below). Then **two or three calls of the one compiled
function** with changing inputs: other documents, another sequence length, a second batch row, now and then
(P = 4) a call on the pairs ``{0, 1}, {2, 3}`` (the SP group changes between calls, passed as ``group=``), with
the backward after each call, after two forwards, or after all (``steps``).

Now and then (``_draw_dilated_tail``) a direct-call draw becomes ``sub="dilated"``: the same compiled calls through
:func:`seqpar.dilated_attention` (a pattern fitting every call's length and shard, ``head_layout``, ring or
allgather), against the ``dilated`` kind's float64 reference. Direct calls now and then run forward only under
``torch.no_grad()`` or ``torch.inference_mode()`` (``grad``; only the outputs judged).

``sub="model"``: a tiny model (:func:`seqpar.testing.fuzz_models.build_case_model`) under ``swap_attention``,
``torch.compile(model)``, two or three batches of :func:`seqpar.shard_batch` (rows of changing lengths; packed
documents of changing layouts; a right-padded row with its ``attention_mask``, which a compiled model refuses by
name), grouped in steps (a backward per batch, or two forwards before one backward); the types the compile tests
cover (``COVERED``) mostly, any decoder type now and then; activation checkpointing now and then.

Reference: the ``attention`` kind's float64 dense attention per call (each call on its own SP group's ranks)
and the sinks' gradient summed over the calls; the ``model`` kind's one-process model per step
(:func:`seqpar.testing.fuzz_models.model_reference`), every parameter's gradient summed over the SP ranks, per
step. Each output and gradient on its own scale (:func:`seqpar.testing.verdicts.close`, ``judge_model``).

Verdicts: ``exact``, ``refused`` (by name, on every rank), ``WRONG``, ``crash``, ``skipped`` (the model does
not run even without seqpar), and ``breaks``: every tensor exact, but dynamo broke the graph
(``torch._dynamo.utils.counters["graph_break"]``) where docs/performance.md promises one graph: a direct call
with ``check_inputs=False`` (and not balanced sharding with the boundaries as a tensor, refused while tracing); a
swapped model of ``ONE_GRAPH`` without checkpointing, padding mask or balanced sharding. Under ``fullgraph=True`` such a
break is dynamo's ``Unsupported`` on every rank (``breaks`` too), and a seqpar refusal raised while tracing reaches
the caller wrapped as ``Unsupported("Observed exception")``, which is still ``refused`` when it names a
``ValueError`` / ``TypeError`` / ``NotImplementedError`` raised in a seqpar frame (:func:`_record`). The detail names
the graph breaks, graphs and recompiles (dynamo's counters on rank 0).
"""

from __future__ import annotations

import contextlib
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from seqpar.testing.fuzz_attention import (
    HEADS,
    OptionRates,
    call_words,
    draw_call_options,
    draw_world_mode,
    knob_words,
)
from seqpar.testing.fuzz_shards import lay_shards
from seqpar.testing.fuzz_strides import STRIDES, strided_grads, strided_inputs

__all__ = ["COVERED", "draw_compile", "compile_summary", "run_compile_case", "compile_attention_task", "compile_dilated_task",
           "compile_model_task", "compile_reference", "compile_tensors"]

COVERED = ("llama", "qwen3", "mixtral", "qwen3_moe", "gpt_oss")
"""Model types tests/test_compile_models.py and tests/test_compile_breadth.py compile as one graph (docs)."""
ONE_GRAPH = ("llama", "qwen3")
"""Of ``COVERED``, those whose fuzz model (``tiny_config``) is promised one graph: the MoE types' tiny configs run
transformers' ``"eager"`` experts loop (a per-expert ``nonzero``), which breaks the graph without seqpar too (tiny
qwen3_moe, one process, no swap: 18 breaks; the compile tests build them with the batched experts)."""
_RATES = OptionRates(chunk_size=0.15, alibi=0.15, softcap=0.15, check_inputs=0.15, float64=0.25)
"""The compile kind's :class:`~seqpar.testing.fuzz_attention.OptionRates` (its calls' shared options)."""
_TOL = {"float32": 2e-5, "float64": 1e-9}
TORCH_FORMAT_BUG = """torch 2.13 (torch only):
    def f(x):
        mib = x.shape[0] * 4 / 2**20
        return x + len(f"{mib:.1f} MiB")
    torch.compile(f, backend="eager", dynamic=True)(torch.randn(8))
raises InternalTorchDynamoError "ValueError: Unknown format code 'f' for object of type 'str'" (dynamic=False: runs).
seqpar.attn.choose.mode_costs formatted its reason so: mode="auto" traced with symbolic sizes (dynamic=True, or a
recompile after a shape change) crashed (case 468232840: P=4, a second call with batch 2), and the kind drew
mode="auto" with static shapes only. Still torch's bug (test_fuzz.py::test_torch_format_spec_bug_is_still_there); seqpar
works around it since (ModeCost.reason is formatted when logged, never while tracing), and every dynamic is drawn."""
TORCH_STRUCT_BUG = """torch 2.13 (torch only):
    def f(x):
        bits = struct.unpack("<q", struct.pack("<d", float(x.shape[-1] ** -0.5)))[0]
        return x + (bits & 1)
    torch.compile(f, backend="eager", dynamic=True)(torch.zeros(8))
raises InternalTorchDynamoError "RecursionError: maximum recursion depth exceeded" (dynamo's struct.pack polyfill
calls itself; dynamic=False: runs). seqpar.attn.checks._scale_bits packed the scale so: check_inputs=True with
dynamic=True (a symbolic head dim) crashed (case 152934153, seed 602), and the kind drew dynamic=None instead. Still
torch's bug (test_fuzz.py::test_torch_struct_pack_bug_is_still_there); seqpar works around it since (_scale_bits
specialises a symbolic scale with guard_scalar first), and check_inputs is drawn with dynamic=True."""
PLANTS = ("stale_documents", "fake_stride")


# --------------------------------------------------------------------------------------------------
# Draws
# --------------------------------------------------------------------------------------------------

def _steps(rng: random.Random, n: int) -> list[list[int]]:
    """How the ``n`` calls group into backwards: one per call, two forwards before one, or all at once."""
    how = rng.choice(("each", "pairs", "all"))
    if how == "each" or n == 1:
        return [[i] for i in range(n)]
    if how == "all":
        return [list(range(n))]
    return [list(range(n))[i:i + 2] for i in range(0, n, 2)]


def _draw_attention(rng: random.Random, draw_documents: Callable[[random.Random, int, int], list[int]]) -> dict[str, Any]:
    world, mode, ulysses_size = draw_world_mode(rng)
    hq, hkv, d, dv = rng.choice(HEADS)
    docs = rng.choice((None, None, "tensor", "tensor", "ints"))
    sharding = rng.choice(("contiguous", "zigzag", "balanced") if docs else ("contiguous", "zigzag"))
    chunk = rng.randint(1, 5)
    n_calls = rng.randint(2, 3)
    switch = world == 4 and mode in ("ring", "allgather", "ulysses") and rng.random() < 0.3
    window = rng.random() < 0.3
    calls = []
    for i in range(n_calls):
        sp = 2 if switch and i == n_calls - 1 else world
        c = chunk if i == 0 or rng.random() < 0.5 else rng.randint(1, 5)  # another length now and then
        seq = 2 * sp * c
        calls.append({
            "sp": sp, "seq": seq, "cu": draw_documents(rng, seq, sp) if docs else None,
            "batch": 2 if not docs and rng.random() < 0.3 else 1,
            "window": rng.randint(1, seq) if window else None,
        })
    min_seq = min(c["seq"] for c in calls)
    return {
        "kind": "compile", "sub": "attention", "world": world, "mode": mode, "ulysses_size": ulysses_size,
        "sharding": sharding, "heads": [hq, hkv, d, dv], "docs": docs, "causal": rng.random() < 0.7,
        "calls": calls, "steps": _steps(rng, n_calls),
        **draw_call_options(rng, hkv, min_seq, _RATES),
        # every mode with every dynamic: seqpar steers around TORCH_FORMAT_BUG and TORCH_STRUCT_BUG itself
        "dynamic": rng.choice((None, True, False)),
        "backend": "inductor" if rng.random() < 0.05 else rng.choice(("eager", "aot_eager", "aot_eager")),
    }


def _draw_model(rng: random.Random) -> dict[str, Any]:
    from seqpar.testing.fuzz_models import draw_lengths
    from seqpar.testing.tiny_models import decoder_model_types

    world = rng.randint(1, 4)
    model_type = rng.choice(COVERED) if rng.random() < 0.75 else rng.choice(decoder_model_types())
    mode = rng.choice(("ring", "ring", "allgather", "ulysses", "hybrid"))
    ulysses_size = 2 if mode == "hybrid" and world == 4 else (world if mode == "hybrid" else 1)
    batch = rng.choice(("rows", "rows", "packed", "packed", "padded")) if rng.random() < 0.95 else "padded"
    sharding = rng.choice(("contiguous", "zigzag", "balanced") if batch == "packed" else ("contiguous", "zigzag"))
    lengths = draw_lengths(rng, world, batch) + draw_lengths(rng, world, batch)
    n = rng.randint(2, 3)
    return {
        "kind": "compile", "sub": "model", "model_type": model_type, "world": world, "mode": mode,
        "ulysses_size": ulysses_size, "sharding": sharding, "batch": batch, "lengths": lengths[:n],
        "steps": _steps(rng, n), "checkpointing": "non-reentrant" if rng.random() < 0.15 else None,
        "dynamic": rng.choice((None, True, False)),
        "backend": "inductor" if rng.random() < 0.03 else rng.choice(("eager", "aot_eager", "aot_eager")),
    }


def draw_compile(rng: random.Random, draw_documents: Callable[[random.Random, int, int], list[int]]) -> dict[str, Any]:
    """A ``compile`` case's draws (JSON-able): a direct call (60%) or a swapped tiny model; ``fullgraph=True`` now
    and then where the docs promise one graph (a refusal while tracing then reaches the caller, instead of the
    eager fallback dynamo makes of it without ``fullgraph``). ``draw_documents(rng, seq, world)``: the ``attention``
    kind's document boundaries (:mod:`seqpar.testing.fuzz` hands its own over: no import cycle)."""
    draws = _draw_attention(rng, draw_documents) if rng.random() < 0.6 else _draw_model(rng)
    draws["fullgraph"] = _promised_one_graph(draws) and rng.random() < 0.4
    if draws["sub"] == "attention":  # drawn after the rest (fz25b): a case seed's earlier draws stay
        # the bf16 dK/dV wire (dk, dv judged at its bound, as the attention kind's) and q, k, v as the views models
        # pass (fuzz_strides: a bshd buffer seen bhsd, a fused qkv split): the compiled op's fake must follow them
        draws["dkv_wire_dtype"] = "bf16" if rng.random() < 0.15 else "fp32"
        draws["strided"] = rng.choice(STRIDES[1:]) if rng.random() < 0.3 else None
        # drawn after them (fz26b): the compiled function called for evaluation or generation, forward only under
        # torch.no_grad() or torch.inference_mode() (only the outputs judged): a compiled graph without autograd
        draws["grad"] = rng.choice(("no_grad", "inference")) if rng.random() < 0.15 else None
        _draw_dilated_tail(rng, draws)
    return draws


def _draw_dilated_tail(rng: random.Random, draws: dict[str, Any]) -> None:
    """Now and then (fz26b, drawn last) turn a direct-call draw into ``sub="dilated"``: the same compiled calls
    (SP sizes, lengths, batches, the pairs, steps, heads, causal, scale, the wire, strided views, grad, dtype,
    dynamic, backend) through :func:`seqpar.dilated_attention` with a drawn pattern that fits every call's length
    and shard, ``head_layout`` and ``dilated_mode`` (ring or allgather). Its attention-only draws (documents,
    window, sinks, ALiBi, soft-cap, chunks, layout, head_chunks, overlap, mode) are left unused. The compile kind
    never drew dilated attention; its op (``dilated_fwd``) must follow every call's shapes and groups."""
    if rng.random() >= 0.2:
        return
    seqs = [(c["seq"], c["sp"]) for c in draws["calls"]]
    fits = [w for w in range(1, max(s for s, _ in seqs) + 1)
            if all(s % w == 0 and (sp == 1 or (s // sp) % w == 0 or w % (s // sp) == 0) for s, sp in seqs)]
    segs = [rng.choice(fits) for _ in range(rng.randint(1, 3))]
    # not mode="auto": it probes the links with a collective outside the graph (the attention sub makes one eager call
    # first); the dilated kind draws it eagerly. Not zigzag: refused by design (contiguous segments)
    draws.update(sub="dilated", segment_lengths=segs,
                 dilation_rates=[rng.choice([r for r in range(1, w + 1) if w % r == 0]) for w in segs],
                 head_layout=rng.choice(("mixed", "mixed", "grouped")), dilated_mode=rng.choice(("ring", "allgather")))
    # one graph is promised where the cross-rank check is off (docs/performance.md: dilated compiles as custom ops)
    draws["fullgraph"] = not draws["check_inputs"] and rng.random() < 0.4


COMPILE_STRIDED_PAIRS_RATE = 0.5
"""How often a direct-call ``compile`` case with a call on the pairs takes the non-consecutive ones
(:func:`call_groups`)."""


def draw_compile_strided_pairs(case_seed: int, draws: dict[str, Any]) -> bool | None:
    """Whether a direct-call ``compile`` case (``sub`` attention or dilated) whose calls switch to SP 2 of P = 4 runs
    those calls on ``{0, 2}, {1, 3}`` (a non-consecutive group, made by ``dist.new_subgroups_by_enumeration``)
    instead of ``{0, 1}, {2, 3}``: the compiled op's group changes between calls to one whose ranks are not
    consecutive. None where no call is on the pairs. Drawn from a generator of its own
    (``f"{case_seed}:compile_strided_pairs"``), never the case's: every case seed keeps every draw it had before
    (fz32), as the attention kind's ``strided_pairs`` (fz31)."""
    if draws.get("kind") != "compile" or draws.get("sub") not in ("attention", "dilated") or not any(
            c["sp"] != draws["world"] for c in draws.get("calls", [])):
        return None
    return random.Random(f"{case_seed}:compile_strided_pairs").random() < COMPILE_STRIDED_PAIRS_RATE


def call_groups(draws: dict[str, Any], sp: int) -> list[range]:
    """The SP groups of a direct-call ``compile`` case's call at SP size ``sp``, each a range of global ranks in
    its group order: the whole world; ``{0, 1}, {2, 3}``; or, where ``draws["strided_pairs"]``, ``{0, 2}, {1, 3}``
    (every ``P / sp``-th rank)."""
    world = draws["world"]
    if sp == world:
        return [range(world)]
    if draws.get("strided_pairs"):
        return [range(g, world, world // sp) for g in range(world // sp)]
    return [range(g0, g0 + sp) for g0 in range(0, world, sp)]


def _ranks_word(ranks: range) -> str:
    return f"{ranks[0]}-{ranks[-1]}" if ranks.step == 1 else ",".join(map(str, ranks))


def _rank_in_call(draws: dict[str, Any], sp: int, rank: int) -> int:
    """Global rank ``rank``'s rank in its SP group of a call at SP size ``sp`` (:func:`call_groups`)."""
    return next(list(g).index(rank) for g in call_groups(draws, sp) if rank in g)


def compile_summary(draws: dict[str, Any]) -> str:
    d = draws
    if d["sub"] == "dilated":
        calls = " ".join(f"[P{c['sp']} B{c['batch']} S{c['seq']}]" for c in d["calls"])
        return (f"compile/dilated P={d['world']} {d['dilated_mode']} {d['backend']} dynamic={d['dynamic']} "
                f"w={d['segment_lengths']} r={d['dilation_rates']} {d['head_layout']} H={'/'.join(map(str, d['heads']))} "
                f"causal={int(d['causal'])} {calls} steps={d['steps']} {d['dtype']}"
                + "".join(f" {k}={d[k]}" for k in ("scale", "strided", "grad") if d.get(k))
                + (" dkv=bf16" if d.get("dkv_wire_dtype") == "bf16" else "") + (" check_inputs" if d["check_inputs"] else "")
                + (" fullgraph" if d.get("fullgraph") else "") + (" pairs{0,2}{1,3}" if d.get("strided_pairs") else ""))
    head = (f"compile/{d['sub']} P={d['world']} {d['mode']}" + (f"(u={d['ulysses_size']})" if d["mode"] == "hybrid" else "")
            + f" {d['sharding']} {d['backend']} dynamic={d['dynamic']}")
    if d["sub"] == "model":
        return (f"{head} {d['model_type']} {d['batch']}={d['lengths']} steps={d['steps']}"
                + (f" ckpt={d['checkpointing']}" if d["checkpointing"] else ""))
    parts = [head, "H=" + "/".join(map(str, d["heads"])), f"causal={int(d['causal'])}"]
    for c in d["calls"]:
        docs = "" if c["cu"] is None else " docs=" + ",".join(str(b - a) for a, b in zip(c["cu"], c["cu"][1:]))
        parts.append(f"[P{c['sp']} B{c['batch']} S{c['seq']}{docs}" + (f" w={c['window']}" if c["window"] else "") + "]")
    if d["docs"]:
        parts.append(f"docs-as-{d['docs']}")
    parts.append(f"steps={d['steps']}")
    parts += knob_words(d, ("chunk_size", "softcap", "scale"), ("sinks", "alibi", "check_inputs"))
    parts += call_words(d, no_check=False)
    if d.get("strided_pairs"):  # the non-consecutive pairs (fz32)
        parts.append("pairs{0,2}{1,3}")
    return " ".join(parts)


# --------------------------------------------------------------------------------------------------
# Attention: tensors and reference
# --------------------------------------------------------------------------------------------------

def compile_tensors(draws: dict[str, Any]) -> dict[str, Any]:
    """Full-sequence float64 inputs of every call (each call its own batch and length), sinks and slopes."""
    g = torch.Generator().manual_seed(draws["case_seed"])
    hq, hkv, d, dv = draws["heads"]
    calls = [{n: torch.randn(c["batch"], h, c["seq"], w, generator=g, dtype=torch.float64)
              for n, h, w in (("q", hq, d), ("k", hkv, d), ("v", hkv, dv), ("dout", hq, dv))}
             for c in draws["calls"]]
    out: dict[str, Any] = {"calls": calls}
    if draws["sinks"]:
        out["sinks"] = torch.randn(hq, generator=g, dtype=torch.float64)
    if draws["alibi"]:
        out["alibi"] = torch.rand(hq, generator=g, dtype=torch.float64) * 0.5 + 0.01
    return out


def _call_draws(draws: dict[str, Any], ci: int) -> dict[str, Any]:
    """Call ``ci`` as a one-call ``attention`` draw of :mod:`seqpar.testing.fuzz` (its SP size, length,
    batch, documents and window), for its reference and its ranks' positions."""
    c = draws["calls"][ci]
    return {**draws, "kind": "attention", "world": c["sp"], "seq": c["seq"], "batch": c["batch"],
            "window": c["window"], "calls": [{"cu": c["cu"]}]}


def compile_reference(draws: dict[str, Any], tensors: dict[str, Any], attention_reference: Callable) -> dict[str, Any]:
    """One process, float64, no compile: per call ``[out, dq, dk, dv]`` (``attention_reference``: the ``attention``
    kind's, :func:`seqpar.testing.fuzz.attention_reference`); ``dsinks`` summed over every rank of every call (a
    call on the pairs counts once per pair: both pairs run it)."""
    res: dict[str, Any] = {"calls": []}
    for ci, c in enumerate(draws["calls"]):
        t = {k: v for k, v in tensors.items() if k != "calls"}
        r = attention_reference(_call_draws(draws, ci), {**t, "calls": [tensors["calls"][ci]]})
        res["calls"].append(r["calls"][0])
        if "dsinks" in r:
            res["dsinks"] = res.get("dsinks", 0) + r["dsinks"] * (draws["world"] // c["sp"])
    return res


# --------------------------------------------------------------------------------------------------
# Rank side
# --------------------------------------------------------------------------------------------------

def _plant(name: str | None) -> Any:
    """A deliberately broken compile path, for the fuzzer's own tests. ``"stale_documents"``: the ops read the first
    document boundaries they see forever (a compiled call reusing the first call's boundaries);
    ``"fake_stride"``: the attention op's fake output laid out ``bshd`` (the wrong strides) while the real one is
    q's; tried on tests/test_fuzz.py's ``_compile_case``: exact under ``aot_eager`` (eager kernels read the real
    strides), a crash under ``inductor`` (torch's own check of the fake's strides against the real output's,
    "incorrect fake kernel"), so a wrong fake stride cannot pass silently there. Returns an undo callable."""
    if name is None:
        return lambda: None
    if name not in PLANTS:
        raise ValueError(f"unknown plant {name!r}: one of {PLANTS}")
    from seqpar.attn import ops

    if name == "stale_documents":
        original = ops.host_boundaries
        first: list[Any] = []

        def stale(documents: torch.Tensor) -> Any:
            if not first:
                first.append(original(documents))
            return first[0]

        ops.host_boundaries = stale

        def undo() -> None:
            ops.host_boundaries = original
        return undo
    fake = ops.attention_fwd._abstract_fn

    def wrong(q, k, v, *rest):  # noqa: ANN001, ANN202
        out, lse = fake(q, k, v, *rest)
        b, h, s, dv = out.shape
        return out.new_empty((b, s, h, dv)).transpose(1, 2), lse

    ops.attention_fwd._abstract_fn = wrong

    def undo_fake() -> None:
        ops.attention_fwd._abstract_fn = fake
    return undo_fake


def _counts() -> dict[str, int]:
    """Dynamo's counters of this process: graph breaks (each break once per trace), graphs, recompiles."""
    from torch._dynamo import utils

    return {"breaks": sum(utils.counters["graph_break"].values()), "graphs": utils.counters["stats"]["unique_graphs"],
            "recompiles": sum(len(r) for r in utils.guard_failures.values())}


def _break_reasons() -> list[str]:
    from torch._dynamo import utils

    return [str(r).splitlines()[0][:160] for r in list(utils.counters["graph_break"])[:3]]


def _fresh_dynamo() -> None:
    from torch._dynamo import utils

    torch._dynamo.reset()
    utils.counters.clear()
    utils.guard_failures.clear()


def _compiled(fn: Any, draws: dict[str, Any]) -> Any:
    return torch.compile(fn, backend=draws["backend"], dynamic=draws["dynamic"], fullgraph=draws.get("fullgraph", False))


def _compiled_task(draws: dict[str, Any], world: int, plant: str | None, groups: dict[str, Any],
                   body: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
    """The rank side the compiled attention and dilated tasks share: a fresh dynamo and the plant ``plant``
    applied, seqpar's groups (``groups``: :func:`seqpar.init_process_groups`' keywords), 2-rank subgroups where a
    call runs at SP 2 of a larger world (``body``'s argument, else None); ``body``'s result, or ``{"ok": False,
    "error"}`` seen through dynamo (:func:`_record`); the plant, dynamo and the subgroups undone after, whatever
    happened."""
    import torch.distributed as dist

    import seqpar

    _fresh_dynamo()
    undo = _plant(plant)
    pairs = None
    try:
        seqpar.init_process_groups(**groups)
        subs = [c["sp"] for c in draws["calls"] if c["sp"] != world]
        if subs and draws.get("strided_pairs"):  # {0, 2}, {1, 3} (fz32): every rank makes every subgroup
            pairs, _ = dist.new_subgroups_by_enumeration([list(g) for g in call_groups(draws, subs[0])])
        elif subs:
            pairs, _ = dist.new_subgroups(2)
        return body(pairs)
    except Exception as e:  # noqa: BLE001 - classified by the driver
        return {"ok": False, "error": _record(e)}
    finally:
        undo()
        _fresh_dynamo()
        if pairs is not None:
            dist.destroy_process_group(pairs)


def _run_steps(draws: dict[str, Any], compiled: Callable, inputs: Callable[[int], tuple[tuple, Any, torch.Tensor]],
               layout: str) -> dict[str, Any]:
    """Each step of ``draws["steps"]``: its calls of ``compiled`` (``inputs(ci)``: call ``ci``'s arguments, its
    ``(leaves, shapes)`` and dout) under the drawn grad context, then one backward of the step's ``(out x dout)``
    sums, unless forward only. Returns ``{"calls": [[out (bhsd), dq, dk, dv] per call], "counts": dynamo's counts
    over the steps, "reasons"}``."""
    forward_only = draws.get("grad") in ("no_grad", "inference")
    before = _counts()
    leaves: dict[int, tuple[list[torch.Tensor], list]] = {}
    outs: dict[int, torch.Tensor] = {}
    for step in draws["steps"]:
        total = 0.0
        for ci in step:
            args, leaves[ci], dout = inputs(ci)
            with (torch.no_grad() if draws.get("grad") == "no_grad" else torch.inference_mode()
                  if draws.get("grad") == "inference" else contextlib.nullcontext()):
                out = compiled(*args)
            if layout == "bshd":
                out = out.transpose(1, 2)
            if not forward_only:
                total = total + (out * dout).sum()
            outs[ci] = out.detach().clone()  # clone: an inference tensor leaves inference mode as a plain one
        if not forward_only:
            total.backward()
    after = _counts()
    calls = [[outs[ci], *strided_grads(*leaves[ci], layout, draws.get("strided"))] for ci in range(len(draws["calls"]))]
    return {"calls": calls, "counts": {k: after[k] - before[k] for k in after}, "reasons": _break_reasons()}


def compile_attention_task(ctx: Any, draws: dict[str, Any], tensors: dict[str, Any], plant: str | None,
                           positions: Callable) -> dict[str, Any]:
    """Pool task (every rank): the case's calls of one compiled function around :func:`seqpar.attention`
    (``positions``: :func:`seqpar.testing.fuzz.positions`, the global positions a rank holds). Returns
    ``{"ok": True, "calls": [[out, dq, dk, dv] (local rows)], "dsinks"?, "counts"}`` or ``{"ok": False, "error"}``."""
    import seqpar

    rank, world = ctx.rank, ctx.world_size
    dtype = getattr(torch, draws["dtype"])

    def body(pairs: Any) -> dict[str, Any]:
        sinks = tensors["sinks"].to(dtype).requires_grad_() if "sinks" in tensors else None
        alibi = tensors["alibi"].to(dtype) if "alibi" in tensors else None

        def call(q, k, v, sinks, alibi, cu, window, group):  # noqa: ANN001, ANN202
            return seqpar.attention(
                q, k, v, causal=draws["causal"], scale=draws["scale"], mode=draws["mode"], group=group,
                sharding=draws["sharding"], overlap=draws["overlap"], check_inputs=draws["check_inputs"],
                head_chunks=draws["head_chunks"], cu_seqlens=cu, window=window, sinks=sinks, layout=draws["layout"],
                chunk_size=draws["chunk_size"], softcap=draws["softcap"], alibi_slopes=alibi,
                dkv_wire_dtype=draws.get("dkv_wire_dtype", "fp32"))

        def args(ci: int) -> tuple[tuple, tuple[list[torch.Tensor], list], torch.Tensor, tuple]:
            """The call's ``(q, k, v)`` (views of its leaves, as ``strided`` says), ``(leaves, shapes)``, dout, rest."""
            c, t = draws["calls"][ci], tensors["calls"][ci]
            sub = c["sp"] != world
            pos = positions(_call_draws(draws, ci), c["cu"], _rank_in_call(draws, c["sp"], rank))
            q, k, v, dout = (t[n].index_select(2, pos).to(dtype) for n in ("q", "k", "v", "dout"))
            shapes = [x.shape for x in (q, k, v)]
            xs, qkv = strided_inputs(q, k, v, draws["layout"], draws.get("strided"))
            cu = c["cu"]
            if cu is not None:
                cu = torch.tensor(cu, dtype=torch.int32) if draws["docs"] == "tensor" else tuple(cu)
            return qkv, (xs, shapes), dout, (sinks, alibi, cu, c["window"], pairs if sub else None)

        def inputs(ci: int) -> tuple[tuple, Any, torch.Tensor]:
            qkv, leaves, dout, rest = args(ci)
            return (*qkv, *rest), leaves, dout

        if draws["mode"] == "auto":  # its links are probed by one eager call (docs/performance.md)
            (q, k, v), _, _, rest = args(0)
            call(q.detach(), k.detach(), v.detach(), *rest)
        res: dict[str, Any] = {"ok": True, **_run_steps(draws, _compiled(call, draws), inputs, draws["layout"])}
        if sinks is not None and sinks.grad is not None:
            res["dsinks"] = sinks.grad
        return res

    return _compiled_task(draws, world, plant, {"sp_size": world, "ulysses_size": draws["ulysses_size"]}, body)


def _dilated_call_draws(draws: dict[str, Any], ci: int) -> dict[str, Any]:
    """Call ``ci`` of a ``sub="dilated"`` case as a one-call ``dilated`` draw (contiguous shards, its SP size and
    length), for its reference and its ranks' positions."""
    c = draws["calls"][ci]
    return {**draws, "kind": "dilated", "world": c["sp"], "seq": c["seq"], "batch": c["batch"], "sharding": "contiguous",
            "calls": [{"cu": None}]}


def compile_dilated_task(ctx: Any, draws: dict[str, Any], tensors: dict[str, Any], plant: str | None,
                         positions: Callable) -> dict[str, Any]:
    """Pool task (every rank): the case's calls of one compiled function around :func:`seqpar.dilated_attention`
    (``sub="dilated"``), contiguous shards. Returns as :func:`compile_attention_task`."""
    import seqpar

    rank, world = ctx.rank, ctx.world_size
    dtype = getattr(torch, draws["dtype"])

    def body(pairs: Any) -> dict[str, Any]:
        def call(q, k, v, group):  # noqa: ANN001, ANN202
            return seqpar.dilated_attention(
                q, k, v, segment_lengths=draws["segment_lengths"], dilation_rates=draws["dilation_rates"],
                causal=draws["causal"], scale=draws["scale"], mode=draws["dilated_mode"], group=group,
                head_layout=draws["head_layout"], check_inputs=draws["check_inputs"],
                dkv_wire_dtype=draws.get("dkv_wire_dtype", "fp32"))

        def inputs(ci: int) -> tuple[tuple, Any, torch.Tensor]:
            c, t = draws["calls"][ci], tensors["calls"][ci]
            pos = positions(_dilated_call_draws(draws, ci), None, _rank_in_call(draws, c["sp"], rank))
            q, k, v, dout = (t[n].index_select(2, pos).to(dtype) for n in ("q", "k", "v", "dout"))
            shapes = [x.shape for x in (q, k, v)]
            xs, (q, k, v) = strided_inputs(q, k, v, "bhsd", draws.get("strided"))
            return (q, k, v, pairs if c["sp"] != world else None), (xs, shapes), dout

        return {"ok": True, **_run_steps(draws, _compiled(call, draws), inputs, "bhsd")}

    return _compiled_task(draws, world, plant, {"sp_size": world}, body)


_OBSERVED = re.compile(r"raised exception (ValueError|TypeError|NotImplementedError)\((.*)\)\s*$", re.M)


def _record(e: BaseException) -> dict[str, Any]:
    """:func:`seqpar.testing.verdicts.error_record` of ``e``, seeing through dynamo: with ``fullgraph=True`` an
    exception seqpar raised while dynamo traced reaches the caller as ``Unsupported("Observed exception")``,
    which names the original (``raised exception ValueError(...)``) and the user frames (``from user code:``);
    it is a refusal when the original is a refusal type and the innermost user frame lies in seqpar (not
    seqpar.testing), as for an eager call."""
    from seqpar.testing.verdicts import error_record

    rec = error_record(e)
    text = str(e)
    found = _OBSERVED.search(text) if type(e).__module__.startswith("torch._dynamo") else None
    if found is None or "from user code:" not in text:
        return rec
    files = re.findall(r'File "([^"]+)", line \d+', text.split("from user code:", 1)[1])
    where = Path(files[-1]).resolve() if files else None
    seqpar_dir = Path(__file__).resolve().parents[1]
    inside = where is not None and seqpar_dir in where.parents and Path(__file__).resolve().parent not in where.parents
    if inside:
        rec.update(type=found.group(1), message=found.group(2).strip("'\"")[:600], refusal=True, where=str(where))
    return rec


def compile_model_task(ctx: Any, draws: dict[str, Any], steps: list[list[dict[str, Any]]], dtype_name: str) -> dict[str, Any]:
    """Pool task (every rank): the swapped model compiled, each step's batches forward then one backward; rank 0
    returns per step the loss and every gradient summed over the SP ranks."""
    import warnings

    import transformers

    import seqpar
    from seqpar.testing.fuzz_models import build_case_model, enable_checkpointing, sp_summed_grads

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    _fresh_dynamo()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            cfg = {"size": ctx.world_size, "mode": draws["mode"], "sharding": draws["sharding"],
                   "ulysses_size": draws["ulysses_size"], "check_inputs": False}
            manager = seqpar.init_process_groups(config=cfg)
            model = build_case_model({**draws, "kind": "model"}, getattr(torch, dtype_name))
            seqpar.swap_attention(model, cfg)
            enable_checkpointing(model, draws["checkpointing"])
            compiled = _compiled(model, draws)
            before = _counts()
            results = []
            for batches in steps:
                losses = [compiled(**seqpar.shard_batch(b["batch"])).loss for b in batches]
                sum(losses).backward()
                grads = sp_summed_grads(model, manager.sp_group)
                results.append({"loss": float(sum(x.detach() for x in losses)), "grads": grads if ctx.rank == 0 else None})
                model.zero_grad(set_to_none=True)
            after = _counts()
            return {"ok": True, "steps": results, "counts": {k: after[k] - before[k] for k in after},
                    "reasons": _break_reasons()}
    except Exception as e:  # noqa: BLE001 - classified by the driver
        return {"ok": False, "error": _record(e)}
    finally:
        transformers.logging.set_verbosity(verbosity)
        _fresh_dynamo()


# --------------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------------

def _promised_one_graph(draws: dict[str, Any]) -> bool:
    """Whether docs/performance.md promises one graph for the case (then a break is the ``breaks`` verdict)."""
    if draws["sub"] == "dilated":  # custom ops; the cross-rank check (a collective with a host read) breaks it
        return not draws["check_inputs"]
    if draws["sub"] == "attention":
        # balanced sharding with the boundaries as a tensor is refused while tracing (resolve.py), which dynamo
        # without fullgraph turns into an eager fallback (a break), as the docs say for compile
        return not draws["check_inputs"] and not (draws["sharding"] == "balanced" and draws["docs"] == "tensor")
    # packed batches compile with zigzag or contiguous; a mask passed to a compiled model is not one graph (docs)
    return (draws["model_type"] in ONE_GRAPH and draws["checkpointing"] is None and draws["batch"] != "padded"
            and draws["sharding"] != "balanced")


def _with_counts(verdict: str, detail: str, draws: dict[str, Any], per_rank: list[dict[str, Any]]) -> tuple[str, str]:
    counts = per_rank[0]["counts"]
    note = f"; {counts['breaks']} graph breaks, {counts['graphs']} graphs, {counts['recompiles']} recompiles (rank 0)"
    breaks = max(r["counts"]["breaks"] for r in per_rank)
    if verdict == "exact" and breaks and _promised_one_graph(draws):
        return "breaks", f"{breaks} graph breaks where one graph is promised: {per_rank[0]['reasons']}" + note
    return verdict, detail + note


def _judge_attention(draws: dict[str, Any], ref: dict[str, Any], per_rank: list[dict[str, Any]],
                     positions: Callable) -> tuple[str, str]:
    from seqpar.testing.verdicts import close

    tol = _TOL[draws["dtype"]]
    world = draws["world"]
    scale_all = max(float(t.abs().max()) for c in ref["calls"] for t in c)
    floor = tol * 0.1 * scale_all  # as the attention kind: a ~0 tensor is judged on the case's scale
    worst = ("", 0.0)
    forward_only = draws.get("grad") in ("no_grad", "inference")
    names = ("out",) if forward_only else ("out", "dq", "dk", "dv")  # forward only: the outputs alone
    for ci, (c, ref_call) in enumerate(zip(draws["calls"], ref["calls"], strict=True)):
        cd = _call_draws(draws, ci)
        # the bf16 dK/dV wire: dk and dv at the attention kind's bound, 4 (P - 1) 2**-9 of their scale; out, dq exact
        wire_tol = max(tol, 4 * (c["sp"] - 1) * 2.0 ** -9) if draws.get("dkv_wire_dtype", "fp32") == "bf16" else tol
        for ranks in call_groups(draws, c["sp"]):  # each SP group of the call (the pairs: two)
            for ti, name in enumerate(names):
                full, missing = lay_shards(ref_call[ti], per_rank, ranks, ci, ti,
                                           lambda r, cd=cd, cu=c["cu"]: positions(cd, cu, r))
                if missing is not None:
                    return "WRONG", f"call{ci}.{name} missing on rank {missing}: no gradient reached the leaf"
                t_tol = wire_tol if name in ("dk", "dv") else tol
                ok, err = close(full, ref_call[ti], t_tol, t_tol * 0.1 * scale_all)
                label = f"call{ci}" + (f"(ranks {_ranks_word(ranks)})" if c["sp"] != world else "") + f".{name}"
                if not ok:
                    return "WRONG", f"{label} off by {err:.2e} of its scale (tol {t_tol:.0e})"
                worst = max(worst, (label, err), key=lambda x: x[1])
    if "dsinks" in ref and not forward_only:
        if any("dsinks" not in p for p in per_rank):
            return "WRONG", "dsinks missing: no gradient reached the sinks"
        ok, err = close(sum(p["dsinks"].double() for p in per_rank), ref["dsinks"], tol, floor)
        if not ok:
            return "WRONG", f"dsinks off by {err:.2e} of its scale (tol {tol:.0e})"
    return "exact", f"worst {worst[0]} {worst[1]:.1e}"


def _step_draws(draws: dict[str, Any], i: int, step: list[int]) -> dict[str, Any]:
    """Step ``i`` (the batches ``step`` of the case) as a ``model`` draw (its batches' lengths and zero-length
    documents; its own tokens: the case seed plus ``i``)."""
    lengths, empty = [draws["lengths"][j] for j in step], draws.get("empty_docs")
    return {**draws, "kind": "model", "lengths": lengths, "step": "one" if len(lengths) == 1 else "two-forwards",
            "case_seed": (draws["case_seed"] + 7919 * i) % 2 ** 31,
            "empty_docs": [empty[j] if j < len(empty) else [] for j in step] if empty else None}


def run_compile_case(pools: Any, draws: dict[str, Any], timeout: float, plant: str | None = None, *,
                     positions: Callable, reference: Callable, dilated: Callable | None = None) -> tuple[str, str, str | None]:
    """Verdict, detail and (when a rank raised) the first failing rank's traceback of a ``compile`` case.
    ``positions``, ``reference``, ``dilated``: :func:`seqpar.testing.fuzz.positions`, ``attention_reference`` and
    ``dilated_reference`` (for ``sub="dilated"``), handed over by :mod:`seqpar.testing.fuzz` (which imports this
    module: no cycle)."""

    if draws["sub"] == "dilated":
        if dilated is None:
            raise ValueError("a sub='dilated' compile case needs dilated= (seqpar.testing.fuzz.dilated_reference)")
        tensors = compile_tensors(draws)
        per_rank = pools.run(draws["world"], compile_dilated_task, draws, tensors, plant, positions, timeout=timeout)
        bad = _classify(draws, per_rank)
        if bad is not None:
            return (*bad, _trace(per_rank))
        ref = {"calls": [dilated(_dilated_call_draws(draws, ci), {"calls": [tensors["calls"][ci]]})["calls"][0]
                         for ci in range(len(draws["calls"]))]}
        flat = {**draws, "sharding": "contiguous", "calls": [{**c, "cu": None} for c in draws["calls"]]}
        return (*_with_counts(*_judge_attention(flat, ref, per_rank, positions), draws, per_rank), None)
    if draws["sub"] == "attention":
        tensors = compile_tensors(draws)
        per_rank = pools.run(draws["world"], compile_attention_task, draws, tensors, plant, positions, timeout=timeout)
        bad = _classify(draws, per_rank)
        if bad is not None:
            return (*bad, _trace(per_rank))
        ref = compile_reference(draws, tensors, reference)
        return (*_with_counts(*_judge_attention(draws, ref, per_rank, positions), draws, per_rank), None)
    from seqpar.testing.fuzz_models import case_batches, judge_model, model_reference

    refs, steps = [], []
    for i, step in enumerate(draws["steps"]):
        sd = _step_draws(draws, i, step)
        batches = case_batches(sd)
        ref = model_reference(sd, batches)
        if not ref["ok"]:
            return "skipped", f"cannot run without seqpar: {ref['error']}", None
        refs.append(ref)
        steps.append(batches)
    dtype = refs[0]["dtype"]
    if any(r["dtype"] != dtype for r in refs):
        return "skipped", "the reference runs its steps in different dtypes", None
    per_rank = pools.run(draws["world"], compile_model_task, draws, steps, dtype, timeout=timeout)
    bad = _classify(draws, per_rank)
    if bad is not None:
        return (*bad, _trace(per_rank))
    worst = []
    for i, (ref, got) in enumerate(zip(refs, per_rank[0]["steps"], strict=True)):
        verdict, detail = judge_model(ref, got)
        if verdict != "exact":
            return (*_with_counts(verdict, f"step {i}: {detail}", draws, per_rank), None)
        worst.append(detail)
    return (*_with_counts("exact", worst[-1], draws, per_rank), None)


def _classify(draws: dict[str, Any], per_rank: list[dict[str, Any]]) -> tuple[str, str] | None:
    """``classify_errors``, but a graph break under ``fullgraph=True`` (dynamo's ``Unsupported`` on every rank,
    not a seqpar refusal) is ``breaks``: the docs promised one graph (``fullgraph`` is drawn only then)."""
    from seqpar.testing.verdicts import classify_errors

    errors = [r["error"] for r in per_rank if not r["ok"]]
    if (draws.get("fullgraph") and errors and len(errors) == len(per_rank)
            and all(e["type"] == "Unsupported" and not e["refusal"] for e in errors)):
        return "breaks", f"fullgraph=True: {errors[0]['message'][:300]}"
    return classify_errors(per_rank)


def _trace(per_rank: list[dict[str, Any]]) -> str | None:
    return next((r["error"]["trace"] for r in per_rank if not r["ok"]), None)
