"""Compiled :func:`seqpar.dilated_attention` under ``dynamic=True`` reuses its graph at every new local length.

The call compiles to the custom op ``seqpar::dilated_fwd`` (and ``dilated_bwd``), which plans from the real
sizes when it runs, so nothing traced needs to know whether a pattern is local or spanning at this length. Until
session 27 the traced code planned (``plan_dilated``: ``w // seq_local``, rows per offset) and checked the
straddle as two tests, and each branch became a guard on ``seq_local``: a length where a pattern spans the ranks
and one where it stays local recompiled (BENCHMARKS, session 26's compile kind).
"""

from __future__ import annotations

import pytest
import torch
from test_dilated import dilated_reference

# P = 2; head dim 6, no length's equal (dynamo's duck sizing would tie the two sizes and recompile when they part)
# segment 16 spans both ranks at seq_local 8 and stays on its rank at 16 and 32; segment 4 is always local
WORLD = 2
LENGTHS = (8, 16, 32)
PATTERN = ((4, 16), (1, 2))
CASES = (("ring", True, "mixed"), ("allgather", False, "grouped"))


def _inputs(seed: int, seq_local: int) -> dict[str, torch.Tensor]:
    """Full-sequence float64 q, k, v, dout ``(batch 1, heads 4 / kv 2, WORLD * seq_local, 6)``."""
    g = torch.Generator().manual_seed(seed)
    seq = WORLD * seq_local
    return {n: torch.randn(1, h, seq, 6, generator=g, dtype=torch.float64)
            for n, h in (("q", 4), ("k", 2), ("v", 2), ("dout", 4))}


def compiled_lengths(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """Worker body: per (mode, causal, layout), one ``torch.compile(dynamic=True, fullgraph=True)`` function called
    at every length (forward and backward) on this rank's contiguous shard. Returns per case the shards of out,
    dq, dk, dv per length, dynamo's frames compiled and its guard failures (recompiles)."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import guard_failures

    from seqpar.attn.dilated import dilated_attention

    results = []
    for case in cases:
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("aot_eager")

        def call(q, k, v, case=case):  # noqa: ANN001, ANN202
            # q (1, 4, seq_local, 6), k/v (1, 2, seq_local, 6): this rank's contiguous shard
            return dilated_attention(q, k, v, segment_lengths=PATTERN[0], dilation_rates=PATTERN[1],
                                     causal=case["causal"], mode=case["mode"], head_layout=case["layout"],
                                     group=torch.distributed.group.WORLD, check_inputs=False)

        fn = torch.compile(call, backend=counter, dynamic=True, fullgraph=True)
        runs = []
        for full in case["inputs"]:
            n = full["q"].shape[2] // world
            q, k, v, dout = (full[x][:, :, rank * n:(rank + 1) * n].float() for x in ("q", "k", "v", "dout"))
            q, k, v = (t.requires_grad_() for t in (q, k, v))
            out = fn(q, k, v)
            out.backward(dout)
            runs.append([out.detach(), q.grad, k.grad, v.grad])
        results.append({"runs": runs, "frames": counter.frame_count,
                        "recompiles": [str(r) for rs in guard_failures.values() for r in rs]})
    torch._dynamo.reset()
    return results


@pytest.mark.compile_stage
def test_compiled_dilated_reuses_its_graph_at_new_lengths(dist_pool) -> None:
    """One compile (dynamo's frame count 1, no guard failure) serves local lengths 8, 16, 32 at P = 2, where the
    segment of 16 first spans both ranks and then stays local; each length's out, dq, dk, dv equal the float64
    reference on the full sequence (each on its own scale).

    Seen failing: with ``check_pattern``'s straddle test as ``seq_local % w and w % seq_local`` again (frames 2,
    the guard ``(q.size()[2] % 16) != 0`` failed at length 16), and with ``plan_dilated`` called while tracing
    (frames 2: ``max(1, 16 // q.size()[2]) == 2`` failed). Since session 28 the traced call runs no check of the
    length at all (``check_pattern`` with the sizes runs in the op, for ``fullgraph``'s refusals), so the first
    break no longer reaches this test; the second still does."""
    cases = [{"mode": mode, "causal": causal, "layout": layout,
              "inputs": [_inputs(100 * i + n, n) for n in LENGTHS]}
             for i, (mode, causal, layout) in enumerate(CASES)]
    per_rank = dist_pool.run(WORLD, compiled_lengths, cases, timeout=600)
    failures = []
    for c, case in enumerate(cases):
        label = f"{case['mode']} causal={case['causal']} {case['layout']}"
        for rank, results in enumerate(per_rank):
            got = results[c]
            if got["frames"] != 1 or got["recompiles"]:
                failures.append(f"{label} rank {rank}: {got['frames']} frames, recompiles {got['recompiles']}")
        for li, full in enumerate(case["inputs"]):
            q, k, v = (full[x].clone().requires_grad_() for x in "qkv")
            out = dilated_reference(q, k, v, *PATTERN, causal=case["causal"], head_layout=case["layout"])
            out.backward(full["dout"])
            for name, i, want in zip(("out", "dq", "dk", "dv"), range(4), (out.detach(), q.grad, k.grad, v.grad)):
                have = torch.cat([results[c]["runs"][li][i] for results in per_rank], dim=2).double()
                err = (have - want).abs().max().item()
                if err > 1e-5 * max(1.0, want.abs().max().item()):
                    failures.append(f"{label} seq_local {LENGTHS[li]}: {name} differs by {err:.3g}")
    assert not failures, failures


def _heads_as_length(mark: bool) -> tuple[int, list[str], list[tuple[torch.Tensor, torch.Tensor]]]:
    """One process: compiled dilated attention (``dynamic=True``, ``fullgraph=True``) at local lengths 8, 4, 16
    with 8 query heads and head dim 8, the length marked dynamic on q, k, v when ``mark``. Returns dynamo's
    frames, its guard failures and per length (compiled out, float64 reference out)."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import guard_failures

    from seqpar.attn.dilated import dilated_attention

    def call(q, k, v):  # noqa: ANN001, ANN202
        # q (2, 8, n, 8), k/v (2, 2, n, 8)
        return dilated_attention(q, k, v, segment_lengths=(4,), dilation_rates=(2,), causal=True, check_inputs=False)

    torch._dynamo.reset()
    guard_failures.clear()
    counter = CompileCounterWithBackend("aot_eager")
    fn = torch.compile(call, backend=counter, dynamic=True, fullgraph=True)
    outs = []
    for i, n in enumerate((8, 4, 16)):
        g = torch.Generator().manual_seed(i)
        q, k, v = (torch.randn(2, h, n, 8, generator=g, dtype=torch.float64) for h in (8, 2, 2))
        args = [t.float() for t in (q, k, v)]
        if mark:
            for t in args:
                torch._dynamo.mark_dynamic(t, 2)  # the compiled call's own inputs: a copy's mark is lost
        got = fn(*args)
        outs.append((got, dilated_reference(q, k, v, (4,), (2,), causal=True, head_layout="mixed")))
    recompiles = [str(r) for rs in guard_failures.values() for r in rs]
    torch._dynamo.reset()
    return counter.frame_count, recompiles, outs


@pytest.mark.compile_stage
def test_marking_the_length_dynamic_unties_it_from_the_head_count() -> None:
    """Fuzz case 405606974 recompiled once: its first local length (8) equalled the query heads (8), and dynamo's
    duck sizing gave both one symbol and guarded ``q.size()[2] == q.size()[1]``, which failed at the next
    length. Seqpar cannot avoid it (dynamo picks the symbols when it wraps the inputs); the user's knob, marking
    the length dynamic on q, k, v before the first call (docs/performance.md), keeps one graph at lengths
    8, 4, 16, each output equal to the float64 reference. Without the mark: 2 frames, and the guard failure
    names duck sizing (checked here too, so the test notices when dynamo stops tying the sizes).

    Seen failing: with the ``mark_dynamic`` line removed (2 frames, ``q.size()[2] == q.size()[1]``)."""
    frames, recompiles, outs = _heads_as_length(mark=True)
    assert (frames, recompiles) == (1, []), (frames, recompiles)
    for got, want in outs:
        err = (got.double() - want).abs().max().item()
        assert err <= 1e-5 * max(1.0, want.abs().max().item()), err
    frames, recompiles, _ = _heads_as_length(mark=False)
    assert frames == 2 and any("duck sizing" in r for r in recompiles), (frames, recompiles)
