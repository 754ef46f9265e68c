"""The ``attention`` and ``dilated`` kinds of the composition fuzzer (:mod:`seqpar.testing.fuzz`), run and judged:
each case's full-sequence float64 inputs, the global positions a rank holds, the single-process float64
references, the pool task every rank runs (with the planted breaks the fuzzer's own tests use), and the verdict.
Their draws are in :mod:`seqpar.testing.fuzz_attention`. Neither module imports the driver: the ``compile`` kind
gets :func:`positions` and the references handed over by :func:`seqpar.testing.fuzz.run_case`.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from seqpar.testing.fuzz_attention import (
    disagreeing_inputs,
    disagreeing_options,
    disagreement,
    input_disagreement,
    sp_groups,
)
from seqpar.testing.fuzz_shards import lay_shards
from seqpar.testing.fuzz_strides import strided_grads, strided_inputs
from seqpar.testing.verdicts import close, error_record

__all__ = ["TOL", "tensors_of", "positions", "attention_reference", "dilated_reference", "attention_task",
           "judge_attention"]

TOL = {torch.float32: 2e-5, torch.float64: 1e-9}


def tensors_of(draws: dict[str, Any]) -> dict[str, Any]:
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


def _group_label(ranks: range) -> str:
    return f"ranks{ranks[0]}-{ranks[-1]}." if ranks.step == 1 else "ranks" + ",".join(map(str, ranks)) + "."


def _pair_group(draws: dict[str, Any], rank: int, world: int) -> tuple[Any, dict[str, Any], int]:
    """This rank's pair (:func:`~seqpar.testing.fuzz_attention.sp_groups`: ``{0, 1}, {2, 3}``, or ``{0, 2}, {1, 3}``
    where ``strided_pairs``, a non-consecutive group), the draws as its SP group of 2 sees them, and its rank there.
    Collective: every rank makes every subgroup (torch's rule)."""
    import torch.distributed as dist

    groups = sp_groups(draws, world)
    if draws.get("strided_pairs"):
        group, _ = dist.new_subgroups_by_enumeration([list(g) for g in groups])
    else:
        group, _ = dist.new_subgroups(2)
    mine = next(g for g in groups if rank in g)
    return group, {**draws, "world": 2}, list(mine).index(rank)


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
                group, sp_draws, sp_rank = _pair_group(draws, rank, world)
            pos = positions({**sp_draws, "sharding": "contiguous"}, None, sp_rank)
            leaves, outs, total = [], [], 0.0
            for t in tensors["calls"]:
                q, k, v, dout = (_local(t[n], pos, dtype) for n in ("q", "k", "v", "dout"))
                if input_disagreement(draws) and rank == world - 1:  # check_inputs must refuse it (fz33)
                    q, k, v, dout, _ = disagreeing_inputs(input_disagreement(draws), q, k, v, dout, None, draws["seq"])
                shapes = [x.shape for x in (q, k, v)]
                xs, (q, k, v) = strided_inputs(q, k, v, "bhsd", draws.get("strided"), frozen_kv=grad == "frozen_kv")
                with _grad_context(draws):
                    out = seqpar.dilated_attention(
                        q, k, v, segment_lengths=draws["segment_lengths"], dilation_rates=draws["dilation_rates"],
                        causal=draws["causal"], scale=draws.get("scale"), mode=draws["mode"], group=group,
                        sharding=draws["sharding"], head_layout=draws["head_layout"], check_inputs=draws["check_inputs"],
                        dkv_wire_dtype=draws.get("dkv_wire_dtype", "fp32"))
                if backward:
                    total = total + (out * dout).sum()
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
            group, sp_draws, sp_rank = _pair_group(draws, rank, world)
        elif draws.get("group_arg") == "manager":
            group = manager.sp_group
        # the defaults a caller leaves (fz26b): sharding=None means the declared one, else contiguous
        sharding = draws["sharding"]
        if draws.get("omit_sharding") and (draws["declare_sharding"] or sharding == "contiguous"):
            sharding = None
        omit_layout = draws.get("omit_layout") and draws["layout"] == "bhsd"
        sinks = tensors["sinks"].to(dtype) if "sinks" in tensors else None
        if sinks is not None and draws.get("sinks_grad", True) and grad != "frozen_kv":
            sinks.requires_grad_()
        alibi = tensors["alibi"].to(dtype) if "alibi" in tensors else None
        leaves, outs, total = [], [], 0.0
        for call, t in zip(draws["calls"], tensors["calls"], strict=True):
            pos = positions(sp_draws, call["cu"], sp_rank)
            q, k, v, dout = (_local(t[n], pos, dtype) for n in ("q", "k", "v", "dout"))
            # layout=None where the shape tells: heads == seq_local reads alike as bhsd and bshd, which is refused
            # without layout= (usr34); decided before a disagreement changes one rank's shard, as on every rank
            layout = None if omit_layout and q.shape[1] != q.shape[2] else draws["layout"]
            cu = call["cu"]
            if input_disagreement(draws) and rank == world - 1:  # a user's mistake: check_inputs must refuse it (fz32)
                q, k, v, dout, cu = disagreeing_inputs(input_disagreement(draws), q, k, v, dout, cu, sp_draws["seq"])
            shapes = [x.shape for x in (q, k, v)]
            xs, (q, k, v) = strided_inputs(q, k, v, draws["layout"], draws.get("strided"), frozen_kv=grad == "frozen_kv")
            if draws.get("expand_kv"):  # one K/V head seen as every query head's: stride 0 over the heads
                hd = 2 if draws["layout"] == "bshd" else 1
                k, v = (x.expand(*x.shape[:hd], q.shape[hd], *x.shape[hd + 1:]) for x in (k, v))
            if cu is not None:
                cu_as = draws.get("cu_as", "int64")
                cu = tuple(cu) if cu_as == "tuple" else torch.tensor(cu, dtype=getattr(torch, cu_as))
            opts = {"causal": draws["causal"], "scale": draws["scale"], "window": draws["window"],
                    "head_chunks": draws["head_chunks"]}
            if disagreement(draws) and rank == world - 1:  # a user's mistake: check_inputs must refuse it (fz31)
                opts = disagreeing_options(disagreement(draws), opts, q.shape[-1])
            with _grad_context(draws):
                out = seqpar.attention(
                    q, k, v, mode=draws["mode"], group=group,
                    sharding=sharding, overlap=draws["overlap"], check_inputs=draws["check_inputs"],
                    cu_seqlens=cu, sinks=sinks, layout=layout,
                    chunk_size=draws["chunk_size"], softcap=draws["softcap"], alibi_slopes=alibi,
                    dkv_wire_dtype=draws.get("dkv_wire_dtype", "fp32"), **opts)
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

def judge_attention(draws: dict[str, Any], ref: dict[str, Any], per_rank: list[dict[str, Any]]) -> tuple[str, str]:
    dtype = getattr(torch, draws["dtype"])
    tol = TOL[dtype]
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
            for ranks in sp_groups(draws, world):
                full, missing = lay_shards(ref_call[ti], per_rank, ranks, ci, ti,
                                           lambda r, cu=call["cu"]: positions(sharded, cu, r))
                if missing is not None:
                    return "WRONG", f"{name} missing on rank {missing}: no gradient reached the leaf"
                t_tol = wire_tol if name in ("dk", "dv") else tol
                ok, err = close(full, ref_call[ti], t_tol, t_tol * 0.1 * scale_all)
                label = (f"call{ci}." if len(ref["calls"]) > 1 else "") + (_group_label(ranks) if sp < world else "") + name
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
