"""``mode="auto"`` under ``torch.compile`` with symbolic shapes (``dynamic=True``, or dynamo's recompile after a
shape change, which marks the changed dim dynamic).

The cost model (:mod:`seqpar.attn.choose`) picks the mode on the call's sizes; while dynamo traces they may be
SymInts. The choice is made on their concrete values (the same on every rank of the group: the shapes are) and
recorded as guards on the decision only, so a compiled function recompiles when, and only when, another call's
shapes would choose another mode. Each case: one compiled ``seqpar.attention(mode="auto")`` called with changing
batch and length, every output and gradient against one process's float64 attention on the gathered sequence,
and dynamo's graph count.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from test_attention import shard_rows, unshard_rows

import seqpar
from seqpar.attn.choose import CallShape, Links, rank_modes

pytestmark = pytest.mark.compile_stage

# Slow links and compute, so that at these tiny sizes another batch or length flips the choice between the ring
# (its latency per step) and Ulysses (its bytes): per P, the heads (q, K/V, dim), the links and the calls
# (batch, tokens per rank), whose choices expected_mode gives: at P = 4 ring, ring, ulysses, ulysses, ring; at
# P = 2 ring, ulysses, ulysses, ulysses, ring. Batches of 3 and 5 and lengths of 6 to 14 differ from every head
# count and dim (dynamo "duck-sizes" equal sizes into one symbol, and the head counts are specialised) and from 1
# (dynamo specialises a size of 1): only the choice can add a graph.
SETUPS = {
    4: ((4, 2, 8), {"intra_gbps": 0.1, "inter_gbps": 0.1, "flops": 1e10, "latency_s": 1e-4, "node_size": 4},
        [(3, 6), (3, 10), (3, 14), (5, 6), (3, 6)]),
    2: ((4, 4, 8), {"intra_gbps": 0.1, "inter_gbps": 0.1, "flops": 1e10, "latency_s": 1e-5, "node_size": 4},
        [(3, 6), (5, 6), (3, 10), (5, 14), (3, 6)]),
}


def expected_mode(world: int, batch: int, seq_local: int) -> str:
    (hq, hkv, d), links, _ = SETUPS[world]
    return rank_modes(CallShape(batch, hq, hkv, seq_local, d, 4, True, world, 1), Links(**links))[0].mode


OPS = {"ring": "seqpar.attention_fwd", "ulysses": "seqpar.ulysses_fwd"}
"""The custom op a compiled graph of each mode calls (seqpar.attn.ops)."""


def compiled_auto_calls(rank: int, world: int, dynamic: bool | None, sharding: str,
                        check_inputs: bool = False, n_calls: int = 5, head_chunks: int | None = None) -> dict[str, Any]:
    """Worker body: one compiled ``seqpar.attention(mode="auto")`` (aot_eager; fullgraph unless ``check_inputs``),
    called with each ``(batch, seq_local)`` of ``SETUPS[world]`` (the first ``n_calls``; fresh inputs, a backward after each). Returns per
    call this rank's
    ``[out, dq, dk, dv]`` rows, the full float64 inputs, dynamo's graph count after the call
    (``counters["stats"]["unique_graphs"]``) and the seqpar op of the graph compiled last; and the graph breaks.
    ``head_chunks``: passed as an argument of the compiled function (an int argument is symbolic under
    ``dynamic=True``, unless 0 or 1); None: the default ``"auto"``."""
    from torch._dynamo.backends.registry import lookup_backend
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    heads, links, calls = SETUPS[world]
    calls = calls[:n_calls]
    seqpar.init_process_groups(config={"size": world, "links": links})
    ops: list[str] = []

    def backend(gm, example_inputs):  # noqa: ANN001, ANN202 - aot_eager, noting the graph's seqpar op
        ops.append(next((str(n.target).rsplit(".", 1)[0] for n in gm.graph.nodes if str(n.target).startswith("seqpar.")),
                        "none"))
        return lookup_backend("aot_eager")(gm, example_inputs)

    def call(q, k, v, chunks="auto"):  # noqa: ANN001, ANN202
        return seqpar.attention(q, k, v, causal=True, mode="auto", sharding=sharding,
                                check_inputs=check_inputs, head_chunks=chunks)

    compiled = torch.compile(call, backend=backend, dynamic=dynamic, fullgraph=not check_inputs)  # the check breaks
    hq, hkv, d = heads
    results = []
    try:
        for i, (batch, seq_local) in enumerate(calls):
            g = torch.Generator().manual_seed(100 + i)
            full = {n: torch.randn(batch, h, seq_local * world, d, generator=g, dtype=torch.float64)
                    for n, h in (("q", hq), ("k", hkv), ("v", hkv), ("dout", hq))}
            q, k, v = (shard_rows(full[n], rank, world, sharding).float().requires_grad_() for n in "qkv")
            out = compiled(q, k, v) if head_chunks is None else compiled(q, k, v, head_chunks)
            out.backward(shard_rows(full["dout"], rank, world, sharding).float())
            results.append({"full": full, "got": [out.detach(), q.grad, k.grad, v.grad],
                            "graphs": counters["stats"]["unique_graphs"], "op": ops[-1]})
        return {"calls": results, "breaks": sum(counters["graph_break"].values())}
    finally:
        torch._dynamo.reset()


def reference(full: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    q, k, v = (full[n].clone().requires_grad_() for n in "qkv")
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out.backward(full["dout"])
    return [out.detach(), q.grad, k.grad, v.grad]


def check_exact(per_rank: list[dict[str, Any]], world: int, sharding: str) -> None:
    """Every call's output and gradients, gathered over the ranks, against float64 (each on its own scale)."""
    assert per_rank[0]["calls"]
    for ci, call in enumerate(per_rank[0]["calls"]):
        ref = reference(call["full"])
        for ti, name in enumerate(("out", "dq", "dk", "dv")):
            got = unshard_rows([r["calls"][ci]["got"][ti].double() for r in per_rank], world, sharding)
            err = (got - ref[ti]).abs().max().item() / ref[ti].abs().max().item()
            assert err < 2e-5, f"call {ci} {name} off by {err:.2e} of its scale"


def check_graphs(per_rank: list[dict[str, Any]], world: int, expected: list[int]) -> None:
    """No graph break; dynamo's graph count after each call is ``expected``, the same on every rank; and a call that
    added a graph compiled the mode the cost model chooses for it (its seqpar op)."""
    modes = [expected_mode(world, *c) for c in SETUPS[world][2]]
    assert set(modes) == {"ring", "ulysses"}, modes  # the setup does flip the choice
    for r in per_rank:
        assert r["breaks"] == 0, r["breaks"]
        assert [c["graphs"] for c in r["calls"]] == expected, ([c["graphs"] for c in r["calls"]], modes)
        before = 0
        for c, mode in zip(r["calls"], modes, strict=True):
            if c["graphs"] > before:
                assert c["op"] == OPS[mode], (c["op"], mode, [x["op"] for x in r["calls"]])
            before = c["graphs"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 4])
def test_auto_mode_with_dynamic_shapes_is_exact_with_a_graph_per_choice(dist_pool, world: int) -> None:
    """``dynamic=True``: batch and length symbolic from the first call. Every call exact; one graph per mode
    chosen (ring, then Ulysses: a second graph exactly when the first call choosing Ulysses comes; every later
    batch or length reuses the graph of its choice). Seen failing: with the fix reverted (choose.py's reason
    formatted eagerly: InternalTorchDynamoError "Unknown format code 'f'", every call); with ``_cheapest_traced``
    deciding on specialised sizes (``guard_scalar`` of batch and length in ``choose_mode``: a graph per shape,
    [1, 2, 3, 4, 4] at both P)."""
    per_rank = dist_pool.run(world, compiled_auto_calls, True, "zigzag", timeout=600)
    check_exact(per_rank, world, "zigzag")
    check_graphs(per_rank, world, [1, 1, 2, 2, 2] if world == 4 else [1, 2, 2, 2, 2])


@pytest.mark.timeout(600)
def test_auto_mode_recompiles_once_per_choice_and_changed_dim(dist_pool) -> None:
    """``dynamic=None`` (torch.compile's default): the first call compiles static shapes; the first change of the
    length, and then of the batch, recompiles once with that dim symbolic (dynamo's automatic dynamic shapes), the
    change to Ulysses once more, and the last call (the first shape again) reuses a graph: 4 graphs for 5 calls, each
    exact. Seen failing: with the fix reverted (the length change's recompile, the first with symbolic sizes, crashed
    in the reason's format spec: torch's TORCH_FORMAT_BUG, the fuzzer's case 468232840)."""
    per_rank = dist_pool.run(4, compiled_auto_calls, None, "contiguous", timeout=600)
    check_exact(per_rank, 4, "contiguous")
    check_graphs(per_rank, 4, [1, 2, 3, 4, 4])


@pytest.mark.timeout(600)
def test_check_inputs_with_dynamic_shapes_is_exact(dist_pool) -> None:
    """``check_inputs=True`` with ``dynamic=True``: the cross-rank check's row packs the default scale
    ``head_dim ** -0.5``, a SymFloat while tracing (seqpar.attn.checks._scale_bits specialises it first). The check
    breaks the graph (a collective, docs/performance.md), so only exactness is asserted. Seen failing: with
    ``_scale_bits`` packing the SymFloat as before (InternalTorchDynamoError RecursionError in dynamo's
    struct.pack polyfill: torch's TORCH_STRUCT_BUG, the fuzzer's case 152934153)."""
    per_rank = dist_pool.run(2, compiled_auto_calls, True, "zigzag", True, 2, timeout=600)  # ring, then Ulysses
    check_exact(per_rank, 2, "zigzag")


@pytest.mark.timeout(600)
def test_auto_mode_with_a_symbolic_head_chunks_keeps_one_graph(dist_pool) -> None:
    """``head_chunks=2`` passed as an argument of the compiled function with ``dynamic=True`` (symbolic: dynamo
    specialises only 0 and 1), fullgraph: both calls (ring, then Ulysses) exact and no graph break. Fuzzer case
    920671610 (P = 2, 6 / 3 heads, ``head_chunks=3``): ``breaks``. Seen failing: without ``guard_scalar`` of
    ``head_chunks`` in ``choose_mode``, dynamo's Unsupported "torch.* op returned non-Tensor" at ``math.gcd(h,
    c.head_chunks)`` in ``mode_costs`` (fullgraph) on both ranks."""
    per_rank = dist_pool.run(2, compiled_auto_calls, True, "zigzag", False, 2, 2, timeout=600)
    check_exact(per_rank, 2, "zigzag")
    assert [r["breaks"] for r in per_rank] == [0, 0]
