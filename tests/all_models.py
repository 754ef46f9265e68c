"""Every decoder-only causal-LM class of the installed transformers under SP=2: exact, or refused by name.

Issue 19 §1. For each model type of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` that is a decoder-only text
model (:func:`decoder_model_types` states the rule), :func:`tiny_config` builds a tiny random-init
config in code, with one layer of each kind the full-size default has and every length parameter
(sliding window, chunk, top-k, block) below the shard length, so the mechanism fires across shards.
Every dropout and jitter is zero. MoE router losses are on (``output_router_logits``, coefficient 0.1,
and Bamba's z-loss), and experts run transformers' ``experts_implementation="eager"`` loop, which takes
float64 where the grouped matmul takes only fp32, so MoE models compare in float64 too.

On 2 ranks (ring, zigzag; seqpar's public path: ``init_process_groups``, ``swap_attention``,
``shard_batch``) each model lands in exactly one class:

- ``exact``: loss within 1e-4 relative, and each parameter's gradient (summed over the SP ranks) judged
  on its own: ``max|g - g_ref| <= 1e-4 * max|g_ref| of that parameter + 1e-8 * max|g_ref| over the model``
  (floor 1e-6 where the model runs in fp32 only), against one process without seqpar on the full sequence
  (float64 where the model runs in it, else fp32): a gradient off by 2x fails however small it is;
- ``refused``: ``swap_attention`` raised :class:`seqpar.swap.SwapError` (its message names the module),
  or the first forward did, before any communication (models of the "sdpa" route are probed there);
- ``cannot_run``: the tiny config does not run even in one process without seqpar;
- ``crash``: anything else raised under seqpar (a failure: it must be a clear refusal instead);
- ``wrong``: ran, but the loss or a gradient differs (a failure: silently wrong).

Run ``python -m tests.all_models --table`` (repository root) to print the table of docs/models.md,
``--write-docs`` to replace it there, ``--only TYPE ...`` to run some model types with their details, ``--mutate
A_log=2`` to break the SP run's gradients on purpose (every model holding an ``A_log`` must come out wrong).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

import torch

# The tiny configs live in seqpar.testing.tiny_models (shared with the composition fuzzer).
from seqpar.testing.tiny_models import (  # noqa: F401 - re-exported: other tests import them from here
    LENGTH,
    MAX_PARAMS,
    VOCAB,
    build_model,
    decoder_model_types,
    excluded_reason,
    tiny_config,
    tiny_kwargs,
)

SEQ = 48  # zigzag over 2 ranks: 4 chunks of 12 tokens, 24 per rank
BATCH = 2
WORLD = 2
# model types per pool task: one seqpar process-group manager serves the SP runs of them all (setting one up
# and tearing it down, 4 gloo groups, takes ~0.05 s of wall time on a loaded 2-core machine, 0.01 CPU-s a rank)
GROUP = 8
RTOL = 1e-4  # loss, and each gradient against its own largest entry
FLOOR = 1e-8  # x the model's largest gradient entry: float64 models
FLOOR_FP32 = 1e-6  # ... and models that run in fp32 only
STATUSES = ("exact", "refused", "cannot_run", "wrong", "crash")

PAGE = Path(__file__).resolve().parents[1] / "docs" / "models.md"
TABLE_BEGIN = "<!-- all-models table: python -m tests.all_models --write-docs -->"
TABLE_END = "<!-- end of all-models table -->"


def make_batch() -> dict[str, torch.Tensor]:
    """Fresh random tokens (labels = input_ids); ids >= 3 so that no pad / bos / eos id occurs."""
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


# --------------------------------------------------------------------------------------------------
# One process, no seqpar
# --------------------------------------------------------------------------------------------------

def _short_error(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip().replace("\n", " ")
    return text[:300]


def reference(model_type: str) -> dict[str, Any]:
    """Loss and gradients of one process on the full batch, float64 if the model runs in it, else fp32.

    Returns ``{"ok": True, "dtype", "loss", "grads"}`` or ``{"ok": False, "error"}``.
    """
    errors = []
    for dtype in (torch.float64, torch.float32):
        try:
            model = build_model(model_type, dtype)
            out = model(**make_batch())
            loss = out.loss
            if loss is None or not torch.isfinite(loss):
                raise RuntimeError(f"loss is {loss}")
            loss.backward()
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
            return {"ok": True, "dtype": str(dtype).removeprefix("torch."), "loss": float(loss.detach()),
                    "grads": grads}
        except Exception as e:  # noqa: BLE001 - recorded as "cannot run"
            errors.append(_short_error(e))
    return {"ok": False, "error": errors[0] if errors[0] == errors[-1] else f"{errors[0]} / fp32: {errors[-1]}"}


# --------------------------------------------------------------------------------------------------
# SP=2 on the rank pool
# --------------------------------------------------------------------------------------------------

SP_CONFIG = {"size": WORLD, "mode": "ring", "sharding": "zigzag"}


def _sp_run(model_type: str, dtype: torch.dtype, manager: Any) -> dict[str, Any]:
    """This rank's part of the SP=2 run on ``manager`` (``seqpar.init_process_groups``' result):
    ``{"status": "ran", "loss", "grads"}`` (gradients summed over the SP ranks), or
    ``{"status": "refused" | "crash", "error"}``."""
    import torch.distributed as dist

    import seqpar
    from seqpar.swap import SwapError

    model = build_model(model_type, dtype)
    try:
        seqpar.swap_attention(model, SP_CONFIG)
    except SwapError as e:
        return {"status": "refused", "error": str(e), "where": "swap"}
    try:
        out = model(**seqpar.shard_batch(make_batch()))
        out.loss.backward()
    except SwapError as e:  # models of the sdpa / mha routes are probed at their first forward
        return {"status": "refused", "error": str(e), "where": "first forward"}
    except Exception as e:  # noqa: BLE001 - a crash under seqpar is a finding, not a test error
        return {"status": "crash", "error": _short_error(e), "trace": traceback.format_exc()[-2000:]}
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        g = p.grad.detach().clone()
        dist.all_reduce(g, group=manager.sp_group)  # each rank holds its share of the full gradient
        grads[name] = g
    return {"status": "ran", "loss": float(out.loss.detach()), "grads": grads}


def compare(ref: dict[str, Any], got: dict[str, Any]) -> tuple[bool, str]:
    """Loss within ``RTOL`` relative; each parameter's gradient judged on its own scale:
    ``max|g - g_ref| <= RTOL * max|g_ref of that parameter| + FLOOR * max|g_ref| over the model``.

    The floor admits the rounding of a gradient that is ~0 in exact arithmetic (a key bias under softmax),
    which is noise of the model's scale, not its own; it is ``FLOOR`` (1e-8) in float64 models and
    ``FLOOR_FP32`` (1e-6) in the few that run in fp32 only. A parameter whose gradient is off by a factor
    of two fails, however small it is beside the model's largest. Returns (exact, the worst parameter as text).
    """
    loss_rel = abs(got["loss"] - ref["loss"]) / max(abs(ref["loss"]), 1e-30)
    model_scale = max((float(g.abs().max()) for g in ref["grads"].values() if g.numel()), default=0.0)
    missing = sorted(set(ref["grads"]) ^ set(got["grads"]))
    if missing:
        return False, f"gradients present on one side only: {missing[:4]}"
    floor = (FLOOR if all(g.dtype == torch.float64 for g in ref["grads"].values()) else FLOOR_FP32) * model_scale
    worst_name, worst, worst_ratio = "", 0.0, 0.0
    for name, g in ref["grads"].items():
        if not g.numel():
            continue
        d = float((got["grads"][name].to(g.dtype) - g).abs().max())
        bound = RTOL * float(g.abs().max()) + floor
        ratio = d / bound if bound > 0 else (0.0 if d == 0 else math.inf)
        if not math.isfinite(ratio) or ratio > worst_ratio:
            worst_name, worst, worst_ratio = name, d, ratio if math.isfinite(ratio) else math.inf
    text = (f"loss rel {loss_rel:.1e}, worst grad {worst_name}: max diff {worst:.1e} = {worst_ratio:.2g} x its "
            f"bound (1e-4 x its own max |grad| + floor)")
    return loss_rel <= RTOL and worst_ratio <= 1.0, text


def mutate_grads(grads: dict[str, torch.Tensor], mutate: dict[str, float] | None) -> dict[str, torch.Tensor]:
    """``grads`` with every parameter whose name ends in a key of ``mutate`` scaled by its factor (a deliberate
    break, to show :func:`compare` sees it: ``{"A_log": 2.0}`` doubles every Mamba / GDN decay's gradient)."""
    if not mutate:
        return grads
    return {n: next((g * f for suffix, f in mutate.items() if n.endswith(suffix)), g) for n, g in grads.items()}


def classify_group(rank: int, world: int, model_types: list[str],
                   mutate: dict[str, float] | None = None) -> list[dict[str, Any]]:
    """Pool task (every rank): classify ``model_types``. Model ``i``'s one-process reference is built by rank
    ``i % world`` (the ranks build theirs side by side), then every rank runs each model under SP=2 on one
    process-group manager set up for the task, and the reference's owner compares (after
    :func:`mutate_grads`, when ``mutate`` asks for a deliberate break). Returns the owner's records; a
    record's ``cpu_s`` is its reference and SP run on the owner, plus its share of the manager's set-up."""
    import torch.distributed as dist

    import seqpar

    assert world == WORLD, world
    refs, ref_cpu = {}, {}
    for model_type in model_types[rank::world]:
        t0 = time.process_time()
        refs[model_type] = reference(model_type)
        ref_cpu[model_type] = time.process_time() - t0
    refs_ok: list[Any] = [None] * world
    dist.all_gather_object(refs_ok, {t: (ref["ok"], ref.get("dtype")) for t, ref in refs.items()})
    records = []
    t0 = time.process_time()
    manager = seqpar.init_process_groups(config=SP_CONFIG)
    setup_cpu = (time.process_time() - t0) / len(model_types)
    try:
        for i, model_type in enumerate(model_types):
            owner = i % world
            ok, dtype_name = refs_ok[owner][model_type]
            record: dict[str, Any] = {"model_type": model_type, "dtype": dtype_name}
            if not ok:
                if owner == rank:
                    records.append({**record, "status": "cannot_run", "detail": refs[model_type]["error"]})
                continue
            t1 = time.process_time()
            got = _sp_run(model_type, getattr(torch, dtype_name), manager)
            statuses: list[Any] = [None] * world
            dist.all_gather_object(statuses, (got["status"], got.get("error"), got.get("where")))
            if owner != rank:
                continue
            ref = refs[model_type]
            record["cpu_s"] = round(ref_cpu[model_type] + setup_cpu + time.process_time() - t1, 2)
            bad = [s for s in statuses if s[0] != "ran"]
            if bad:
                record.update(status=bad[0][0], detail=bad[0][1], where=bad[0][2])
                if "trace" in got:
                    record["trace"] = got["trace"]
            else:
                exact, text = compare(ref, {**got, "grads": mutate_grads(got["grads"], mutate)})
                if mutate:  # the unbroken verdict too: one run shows both
                    record["mutated"] = sorted(n for n in got["grads"] if any(n.endswith(k) for k in mutate))
                    record["unmutated"] = "exact" if compare(ref, got)[0] else "wrong"
                record.update(status="exact" if exact else "wrong", detail=text)
            records.append(record)
    finally:
        seqpar.destroy_process_groups()
    return records


def run_all(pool: Any, model_types: list[str] | None = None, timeout: float = 300.0,
            progress: bool = False, mutate: dict[str, float] | None = None) -> dict[str, dict[str, Any]]:
    """Classify ``model_types`` (default: :func:`decoder_model_types`) on ``pool``, a
    ``tests/dist_harness.DistPool``, :data:`GROUP` model types per task. A group whose task fails or hangs is
    re-run one model at a time, and a model that still fails is a ``crash`` carrying the pool's error. ``mutate`` (parameter-name suffix ->
    factor) scales those gradients of the SP run before the comparison: a deliberate break."""
    types = list(model_types or decoder_model_types())
    results: dict[str, dict[str, Any]] = {}

    def run(group: list[str]) -> list[dict[str, Any]]:
        out = pool.run(WORLD, classify_group, group, mutate, timeout=timeout)
        return [r for per_rank in out for r in per_rank]

    for start in range(0, len(types), GROUP):
        group = types[start:start + GROUP]
        try:
            records = run(group)
        except (AssertionError, TimeoutError) as e:
            records = []
            for t in group:
                try:
                    records += run([t])
                except (AssertionError, TimeoutError) as e1:
                    records.append({"model_type": t, "status": "crash", "detail": _short_error(e1)})
            del e
        for r in records:
            results[r["model_type"]] = r
            if progress:
                print(f"{r['model_type']:28s} {r['status']:10s} {r.get('dtype') or '':8s} "
                      f"{(r.get('detail') or '')[:160]}", file=sys.stderr, flush=True)
    return results


# --------------------------------------------------------------------------------------------------
# the table of docs/models.md
# --------------------------------------------------------------------------------------------------

_LABELS = {
    "exact": "exact (loss within 1e-4; each gradient within 1e-4 of its own largest entry + 1e-8 of the model's)",
    "refused": "refused by a `SwapError` naming the module, at swap time (sdpa route: first forward)",
    "cannot_run": "tiny config cannot run even without seqpar",
    "wrong": "silently wrong",
    "crash": "error in the forward or backward under seqpar (must be a refusal at swap time)",
}


def counts(results: dict[str, dict[str, Any]]) -> dict[str, int]:
    c = Counter(r["status"] for r in results.values())
    return {s: c.get(s, 0) for s in STATUSES}


# The probe's refusal (seqpar.swap.probe.mixing_refusal): a module seqpar cannot route mixes positions.
MIXES_POSITIONS = ("mixes positions in code seqpar cannot route (attention scores computed in the model's own "
                   "code, or a state-space, linear-attention or convolution layer)")


def refusal_reason(detail: str) -> tuple[str, str]:
    """``(reason, class)`` of a ``SwapError`` message: the reason without paths and numbers (so that a
    family shares one), and the refused module's class where the message names one."""
    m = re.search(r"'[\w.]+' \((\w+)\): its output changed", detail)
    if m:
        return MIXES_POSITIONS, m.group(1)
    m = re.search(r"'[\w.]+' \((\w+)\) raised (\w+)", detail)
    if m:
        return (f"the model fails with its attention routed to seqpar ({m.group(2)} in the layer: DSA "
                "indexers read the dense mask and pass indices=)"), m.group(1)
    if "found nothing to swap" in detail:
        return ("no attention seqpar can route: the model computes attention in its own code "
                "(found nothing to swap)"), ""
    m = (re.search(r"seqpar \(layer '[\w.]+'(?:, (\w+))?\): (.+?)(?:\.\s|\.?$)", detail, re.M)
         or re.search(r"layer '[\w.]+'()(?:, \w+)?: (.+?)(?:\.\s|\.?$)", detail, re.M)
         or re.search(r"seqpar()[^:]*: (.+?)(?:\.\s|\.?$)", detail, re.M))
    cls, reason = (m.group(1) or "", m.group(2)) if m else ("", detail.splitlines()[0])
    reason = re.sub(r"\b\d+ (queries|keys)\b", r"N \1", reason)  # per-model numbers: families share a reason
    reason = re.sub(r"\(\d+(\.\d+)?\)", "(N)", reason).strip()
    return reason[:160], cls


def table(results: dict[str, dict[str, Any]]) -> str:
    """The page's markdown: the counts, then the refused model types grouped by reason."""
    import transformers

    c = counts(results)
    lines = [
        f"Decoder-only causal-LM model types of transformers {transformers.__version__} "
        f"(`tests/all_models.py` states the filter), tiny random-init configs, SP=2, ring, zigzag, "
        f"against one process without seqpar (float64 where the model runs in it):",
        "",
        "| outcome | models |",
        "|---|---|",
        *[f"| {_LABELS[s]} | {c[s]} |" for s in STATUSES],
        f"| total | {sum(c.values())} |",
        "",
        "Refused, by reason (the `SwapError` names each module by its path):",
        "",
        "| reason | model types (refused module's class) |",
        "|---|---|",
    ]
    by_reason: dict[str, list[str]] = {}
    for t, r in sorted(results.items()):
        if r["status"] == "refused":
            reason, cls = refusal_reason(r["detail"])
            notes = [n for n in (cls, "at its first forward" if r.get("where") == "first forward" else "") if n]
            by_reason.setdefault(reason, []).append(f"{t} ({', '.join(notes)})" if notes else t)
    for reason, types in sorted(by_reason.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        lines.append(f"| {reason.replace('|', '/')} | {', '.join(types)} |")
    failing = {t: r for t, r in sorted(results.items()) if r["status"] in ("wrong", "crash", "cannot_run")}
    if failing:
        lines += ["", "Not yet exact or refused:", "", "| model type | outcome |", "|---|---|"]
        lines += [f"| {t} | {r['status']}: {(r['detail'] or '').splitlines()[0][:160].replace('|', '/')} |"
                  for t, r in failing.items()]
    return "\n".join(lines)


def page_table(page: Path = PAGE) -> str:
    """The table docs/models.md holds between :data:`TABLE_BEGIN` and :data:`TABLE_END`."""
    text = page.read_text()
    if TABLE_BEGIN not in text or TABLE_END not in text:
        raise ValueError(f"{page} has no all-models table (between {TABLE_BEGIN!r} and {TABLE_END!r})")
    return text.split(TABLE_BEGIN, 1)[1].split(TABLE_END, 1)[0].strip()


def page_counts(page: Path = PAGE) -> dict[str, int]:
    """The counts the page's table states, by status."""
    found = {}
    for line in page_table(page).splitlines():
        for s, label in _LABELS.items():
            if line.startswith(f"| {label} |"):
                found[s] = int(line.rsplit("|", 2)[1])
    return found


def write_page(results: dict[str, dict[str, Any]], page: Path = PAGE) -> None:
    text = page.read_text()
    head, rest = text.split(TABLE_BEGIN, 1)
    tail = rest.split(TABLE_END, 1)[1]
    page.write_text(f"{head}{TABLE_BEGIN}\n{table(results)}\n{TABLE_END}{tail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.all_models", description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="+", metavar="TYPE", help="model types to run (default: all)")
    parser.add_argument("--table", action="store_true", help="print the table of docs/models.md")
    parser.add_argument("--write-docs", action="store_true", help="replace the table in docs/models.md")
    parser.add_argument("--mutate", nargs="+", metavar="SUFFIX=FACTOR", default=[],
                        help="a deliberate break: scale the SP run's gradients of parameters ending in SUFFIX "
                             "(A_log=2 doubles every Mamba / GDN decay's gradient); the models holding one must "
                             "come out wrong")
    parser.add_argument("--json", metavar="PATH", help="write every record (status, detail, cpu_s) to PATH")
    args = parser.parse_args(argv)
    import transformers

    transformers.logging.set_verbosity_error()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from dist_harness import DistPool

    import tests.all_models as this  # pickled by this name in the rank pool, not as __main__

    pool = DistPool()
    t0, c0 = time.time(), time.process_time()
    try:
        mutate = {k: float(v) for k, v in (m.split("=", 1) for m in args.mutate)}
        results = this.run_all(pool, args.only, progress=True, mutate=mutate or None)
    finally:
        pool.close()
    print(f"{len(results)} model types in {time.time() - t0:.0f} s wall, "
          f"{sum(r.get('cpu_s', 0) for r in results.values()):.0f} s CPU on rank 0+1 "
          f"(+{time.process_time() - c0:.0f} s here)", file=sys.stderr)
    print(json.dumps(counts(results)), file=sys.stderr)
    if args.mutate:
        hit = {t: f"{r['status']} (unbroken: {r['unmutated']})" for t, r in sorted(results.items()) if r.get("mutated")}
        print(f"mutated ({' '.join(args.mutate)}): {json.dumps(hit)}", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    if args.table:
        print(table(results))
    if args.write_docs:
        write_page(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
