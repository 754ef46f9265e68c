"""The full compile matrix of ``seqpar.attention`` (issue 31 §1): CI's compile stage.

tests/test_compile_attention.py (main suite) runs a subset; this file runs the rest, marked ``compile_stage``
(skipped by the main suite for its time; ``SEQPAR_COMPILE_STAGE=1 python -m pytest -m compile_stage``, see
tests/conftest.py): every mode (ring, allgather, ulysses, hybrid, auto) at every P in {1, 2, 4} where the
mode exists (hybrid: P = 4, Ulysses over pairs), causal or not, zigzag and contiguous, and every option
(documents as a tensor and as ints, window, sinks, chunked, ALiBi, soft-cap) in every mode at every P, plus
``dilated_attention`` at P = 1, 2 and 4. Each case: eager, then ``torch.compile(fullgraph=True,
backend="aot_eager")``; the output and every gradient (q, k, v, sinks) equal eager's (fp32 1e-5 of each one's
own scale); ``torch._dynamo.explain`` counts one graph and 0 breaks on the first case of each mode and P.
seqpar refuses none of these combinations (tried: every case runs eagerly and compiled), so any error is a
failure.

Seen failing: with ``seqpar.attn.ops._flat`` handing the compiled op ``softcap=None`` (the eager path keeps
it), every soft-cap case at P = 2 (ring, allgather, ulysses, auto; zigzag causal and contiguous non-causal)
differed from eager in out, dq, dk and dv by 0.2 to 2.4; with ``seqpar.attn.dilated.dilated_attention`` handing
its compiled op the opposite ``causal``, the dilated cases at P = 1, 2 and 4 differed in out by 1.9 to 3.7.
"""

from __future__ import annotations

import pytest
import torch
from test_attention import make_case, shard_rows
from test_compile_attention import attention_options, graph_breaks

import seqpar

pytestmark = pytest.mark.compile_stage

MODES = ("ring", "allgather", "ulysses", "hybrid", "auto")
# one option per case (documents as a tensor, read inside the op at run time; as ints, constants of the graph)
OPTIONS = {
    "": {},
    "docs_tensor": {"cu_seqlens": "tensor"},
    "docs_ints": {"cu_seqlens": "docs"},
    "window": {"window": 5},
    "sinks": {"sinks": True},
    "chunked": {"chunk_size": 7},
    "alibi": {"alibi": True},
    "softcap": {"softcap": 3.0},
}


def _exists(mode: str, world: int) -> bool:
    return mode != "hybrid" or world == 4


def _cases(world: int, mode: str) -> list[tuple[str, str, bool, str]]:
    """(mode, sharding, causal, option) of one mode at one P: the plain grid (both shardings, causal and not),
    then each option zigzag causal and contiguous non-causal."""
    cases = [(mode, s, c, "") for s in ("zigzag", "contiguous") for c in (True, False)]
    for option in OPTIONS:
        if option:
            cases += [(mode, "zigzag", True, option), (mode, "contiguous", False, option)]
    return cases


def matrix_cases(rank: int, world: int, mode: str, seed: int) -> list[str]:
    """Worker body: every case of ``mode`` at this P eager, then compiled; mismatches, unexpected errors and
    graph breaks as text."""
    failures = []
    if mode == "hybrid":  # Ulysses over pairs, the ring across them
        seqpar.init_process_groups(sp_size=world, ulysses_size=2)
    group = torch.distributed.group.WORLD if world > 1 and mode != "hybrid" else None
    for i, (mode_, sharding, causal, option) in enumerate(_cases(world, mode)):
        label = f"P={world} {mode_} {sharding} causal={causal} {option or 'plain'}"
        case = make_case(seed + i, world, (4, 2, 8), batch=1)
        seq = case["q"].shape[2]
        q, k, v, dout = (shard_rows(case[n], rank, world, sharding).float() for n in ("q", "k", "v", "dout"))

        def call(q, k, v, opts, causal=causal, sharding=sharding):  # noqa: ANN001, ANN202
            return seqpar.attention(q, k, v, causal=causal, mode=mode, sharding=sharding, group=group,
                                    check_inputs=False, head_chunks=1, **opts)

        runs = []
        try:
            for compiled in (False, True):
                opts = attention_options(OPTIONS[option], seq, 4)
                leaves = [t.clone().requires_grad_() for t in (q, k, v)]
                fn = torch.compile(call, fullgraph=True, backend="aot_eager") if compiled else call
                out = fn(*leaves, opts)
                out.backward(dout)
                grads = [t.grad for t in leaves] + ([opts["sinks"].grad] if "sinks" in opts else [])
                runs.append([out.detach(), *grads])
        except Exception as error:  # noqa: BLE001 - reported as text, the next case still runs
            failures.append(f"{label}: {'compiled' if runs else 'eager'} raised {str(error)[:400]}")
            torch._dynamo.reset()
            continue
        for name, e, c in zip(("out", "dq", "dk", "dv", "dsinks"), *runs):
            if not torch.allclose(c, e, rtol=1e-5, atol=1e-5 * e.abs().max().item()):
                failures.append(f"{label}: {name} differs by {(c - e).abs().max().item():.3g}")
        if i == 0:  # dynamo's own count of graph breaks, once per mode and P
            explained = torch._dynamo.explain(call)(q.clone(), k.clone(), v.clone(), attention_options({}, seq, 4))
            if explained.graph_break_count or explained.graph_count != 1:
                failures.append(f"{label}: {explained.graph_count} graphs, {explained.graph_break_count} "
                                f"breaks: {explained.break_reasons}")
        torch._dynamo.reset()
    return failures


@pytest.mark.parametrize(("world", "mode"), [(w, m) for w in (1, 2, 4) for m in MODES if _exists(m, w)])
def test_compile_matrix_equals_eager_without_breaks(dist_pool, world: int, mode: str) -> None:
    per_rank = dist_pool.run(world, matrix_cases, mode, 1000 * world + 100 * MODES.index(mode), timeout=900)
    assert per_rank == [[]] * world, "\n".join(f"rank {r}: {f}" for r, fs in enumerate(per_rank) for f in fs)


def compile_dilated(rank: int, world: int) -> list[str]:
    """Worker body: ``dilated_attention`` (ring and all-gather, causal or not, both head layouts) eager, then
    compiled; mismatches and graph breaks as text."""
    from test_compile_attention import eager_vs_compiled

    from seqpar.attn.dilated import dilated_attention

    failures = []
    group = torch.distributed.group.WORLD if world > 1 else None
    for i, (mode, causal, head_layout) in enumerate((("ring", True, "mixed"), ("allgather", False, "grouped"),
                                                     ("ring", False, "grouped"), ("allgather", True, "mixed"))):
        case = make_case(300 + i, world, (4, 2, 8), batch=1)
        q, k, v, dout = (shard_rows(case[n], rank, world, "contiguous").float() for n in ("q", "k", "v", "dout"))

        def call(q, k, v, mode=mode, causal=causal, head_layout=head_layout):  # noqa: ANN001, ANN202
            # q: (1, 4, 12, 8) bhsd, this rank's contiguous shard; the long segment spans every rank
            return dilated_attention(q, k, v, segment_lengths=(4, q.shape[2] * world), dilation_rates=(1, 2),
                                     causal=causal, mode=mode, group=group, head_layout=head_layout,
                                     check_inputs=False)

        label = f"dilated P={world} {mode} causal={causal} {head_layout}"
        try:
            failures += eager_vs_compiled(call, q, k, v, dout, label)
        except Exception as error:  # noqa: BLE001
            failures.append(f"{label}: raised {str(error)[:400]}")
        torch._dynamo.reset()
        if i == 0:
            failures += graph_breaks(call, q.clone(), k.clone(), v.clone(), label=f"{label}: ")
            torch._dynamo.reset()
    return failures


@pytest.mark.parametrize("world", [1, 2, 4])
def test_compiled_dilated_attention_matrix(dist_pool, world: int) -> None:
    per_rank = dist_pool.run(world, compile_dilated, timeout=900)
    assert per_rank == [[]] * world, "\n".join(f"rank {r}: {f}" for r, fs in enumerate(per_rank) for f in fs)
