"""``torch.compile(fullgraph=True)`` through ``seqpar.attention`` (issue 31 §1, first step).

The ring (also the one-rank planner) and all-gather attention run as ``torch.library`` custom ops while
dynamo traces (``seqpar.attn.ops``): a compiled call has no graph break, and its output and every
gradient equal the eager call's on the same shard (fp32 1e-5; eager itself is compared with a float64
reference in tests/test_attention.py). Each case on P = 1, 2 and 4 ranks: causal or not, zigzag and
contiguous, GQA, documents (as a tensor, which the op reads at run time, and as ints), a window, chunked attention, sinks, soft-cap and ALiBi; ring, all-gather,
Ulysses and (P = 4) hybrid.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_attention import make_case, reference, shard_rows

import seqpar

# (mode, sharding, causal, extra options)
CASES = (
    ("ring", "zigzag", True, {}),
    ("ring", "contiguous", False, {}),
    ("allgather", "zigzag", True, {}),
    ("allgather", "contiguous", False, {}),
    # documents as a tensor travel into the op and are read there at run time; as ints, as constants
    ("ring", "contiguous", True, {"cu_seqlens": "tensor", "window": 5}),
    ("allgather", "contiguous", True, {"chunk_size": 7, "cu_seqlens": "docs"}),
    ("ring", "zigzag", True, {"sinks": True}),
    ("ring", "contiguous", False, {"softcap": 3.0}),
    ("ring", "zigzag", True, {"alibi": True}),
    ("ulysses", "zigzag", True, {}),
    ("ulysses", "contiguous", False, {"sinks": True, "window": 6}),
    ("hybrid", "zigzag", True, {}),
    ("hybrid", "contiguous", True, {"cu_seqlens": "tensor", "sinks": True}),
    # the op must carry the option: compiled with the fp32 wire, dk/dv would differ from eager by ~1e-3
    ("ring", "zigzag", True, {"dkv_wire_dtype": "bf16"}),
)
HYBRID = tuple(i for i, c in enumerate(CASES) if c[0] == "hybrid")



def graph_breaks(call: Any, *args: Any, label: str = "") -> list[str]:
    """Dynamo's own count of the graph breaks of ``call(*args)``: one failure line naming them, or none."""
    explained = torch._dynamo.explain(call)(*args)
    if not explained.graph_break_count:
        return []
    return [f"{label}{explained.graph_break_count} graph breaks: {explained.break_reasons}"]

def attention_options(extra: dict, seq: int, hq: int) -> dict:
    """The keyword options of one case: ``extra``'s plain values, plus documents (two lengths, ints or an int32
    tensor), sinks (fresh, requiring grad) and ALiBi slopes made for ``seq`` tokens and ``hq`` heads."""
    opts = {k: v for k, v in extra.items() if k not in ("cu_seqlens", "sinks", "alibi")}
    g = torch.Generator().manual_seed(7)
    if "cu_seqlens" in extra:
        opts["cu_seqlens"] = (0, 5, seq // 2 + 1, seq)
        if extra["cu_seqlens"] == "tensor":
            opts["cu_seqlens"] = torch.tensor(opts["cu_seqlens"], dtype=torch.int32)
    if "sinks" in extra:
        opts["sinks"] = torch.randn(hq, generator=g).requires_grad_()
    if "alibi" in extra:
        opts["alibi_slopes"] = torch.rand(hq, generator=g)
    return opts


def compile_cases(rank: int, world: int, seed: int, cases: tuple[int, ...]) -> list[str]:
    """Worker body: each case eager, then compiled (fullgraph, aot_eager); the mismatches as text."""
    failures = []
    if any(CASES[i][0] == "hybrid" for i in cases):  # Ulysses over pairs, the ring across them
        seqpar.init_process_groups(sp_size=world, ulysses_size=2)
    for i in cases:
        mode, sharding, causal, extra = CASES[i]
        # hybrid runs on the manager's two axes (group=None); the others on the whole world
        group = torch.distributed.group.WORLD if world > 1 and mode != "hybrid" else None
        case = make_case(seed + i, world, (4, 2, 8), batch=1)
        seq = case["q"].shape[2]
        q, k, v, dout = (shard_rows(case[n], rank, world, sharding).float() for n in ("q", "k", "v", "dout"))

        def call(q, k, v, opts, causal=causal, mode=mode, sharding=sharding, group=group):  # noqa: ANN001, ANN202
            return seqpar.attention(q, k, v, causal=causal, mode=mode, sharding=sharding, group=group,
                                    check_inputs=False, head_chunks=1, **opts)

        runs = []
        for compiled in (False, True):
            opts = attention_options(extra, seq, 4)
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            fn = torch.compile(call, fullgraph=True, backend="aot_eager") if compiled else call
            out = fn(*leaves, opts)
            out.backward(dout)
            grads = [t.grad for t in leaves] + ([opts["sinks"].grad] if "sinks" in opts else [])
            runs.append([out.detach(), *grads])
        for name, e, c in zip(("out", "dq", "dk", "dv", "dsinks"), *runs):
            if not torch.allclose(c, e, rtol=1e-5, atol=1e-5 * e.abs().max().item()):
                failures.append(f"case {i} {mode} {sharding} causal={causal} {extra}: {name} differs by "
                                f"{(c - e).abs().max().item():.3g}")
        if i == 0:  # dynamo's own count of graph breaks, once per world size
            failures += graph_breaks(call, q.clone(), k.clone(), v.clone(), attention_options(extra, seq, 4))
        torch._dynamo.reset()
    return failures


@pytest.mark.parametrize("world", [1, 2, 4])
def test_compiled_attention_equals_eager_without_breaks(dist_pool, world: int) -> None:
    # P = 4 (4 processes on CI's 2 cores, each compiling) runs two dense cases, one with documents and
    # the hybrids (which need 4 ranks: u = 2 x 2 super-ranks)
    cases = tuple(i for i in range(len(CASES)) if i not in HYBRID) if world < 4 else (0, 3, 4, *HYBRID)
    per_rank = dist_pool.run(world, compile_cases, 100 * world, cases, timeout=600)
    assert per_rank == [[]] * world, per_rank


def test_the_custom_ops_pass_torchs_own_checks() -> None:
    """torch.library.opcheck: the fake implementation's shapes, strides and dtypes match the real op's,
    autograd registration included (one process: the one-rank planner with a window)."""
    from seqpar.attn.ops import attention_fwd

    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 12, 8, generator=g).requires_grad_()
    k = torch.randn(1, 2, 12, 8, generator=g).requires_grad_()
    v = torch.randn(1, 2, 12, 8, generator=g).requires_grad_()
    args = (q, k, v, None, "single", "", True, 8 ** -0.5, "contiguous", True, 1, 4, None, None, None, "fp32",
            torch.tensor([0, 5, 12], dtype=torch.int32))  # documents as a tensor, read inside the op
    torch.library.opcheck(attention_fwd, args, test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def compile_auto(rank: int, world: int) -> list[str]:
    """mode='auto': before its group's links are probed (a timed collective, eager only) compiling names the
    fix; after one eager call the compiled call has no break and equals eager."""
    case = make_case(7, world, (4, 2, 8), batch=1)
    q, k, v, dout = (shard_rows(case[n], rank, world, "zigzag").float() for n in ("q", "k", "v", "dout"))
    group = torch.distributed.new_group(list(range(world)))  # a group nothing has probed yet

    def call(q, k, v):  # noqa: ANN001, ANN202
        return seqpar.attention(q, k, v, causal=True, mode="auto", sharding="zigzag", group=group, check_inputs=False)

    failures = []
    try:
        torch.compile(call, fullgraph=True, backend="aot_eager")(q, k, v)
        failures.append("compiled before the probe: no error")
    except Exception as error:  # dynamo wraps the ValueError raised while tracing
        if "links have not been probed yet" not in str(error):
            failures.append(f"compiled before the probe: {str(error)[:300]}")
    torch._dynamo.reset()
    failures += eager_vs_compiled(call, q, k, v, dout, "auto")
    torch._dynamo.reset()
    # A shape never chosen eagerly (batch 2): choose_mode must not log while tracing (a logger call is a graph
    # break under fullgraph). (Symbolic sizes: tests/test_compile_auto_dynamic.py.)
    wide = make_case(8, world, (4, 2, 8), batch=2)
    q, k, v, dout = (shard_rows(wide[n], rank, world, "zigzag").float() for n in ("q", "k", "v", "dout"))
    failures += eager_vs_compiled(call, q, k, v, dout, "auto, unseen shape", compiled_first=True)
    torch._dynamo.reset()
    return failures


def eager_vs_compiled(call, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,  # noqa: ANN001
                      label: str, compiled_first: bool = False) -> list[str]:
    """``call(q, k, v)`` eager, then compiled (fullgraph, aot_eager), each with ``dout`` backward: the
    outputs and gradients that differ (fp32 1e-5 of each one's own scale), as text."""
    runs = []
    for compiled in ((True, False) if compiled_first else (False, True)):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        fn = torch.compile(call, fullgraph=True, backend="aot_eager") if compiled else call
        try:
            out = fn(*leaves)
        except Exception as error:  # noqa: BLE001 - a graph break under fullgraph, or dynamo's crash
            return [f"{label}: compiled call raised {type(error).__name__}: {str(error)[:600]}"]
        out.backward(dout)
        runs.append([out.detach(), *(t.grad for t in leaves)])
    if compiled_first:
        runs.reverse()
    return [f"{label}: {name} differs by {(c - e).abs().max().item():.3g}"
            for name, e, c in zip(("out", "dq", "dk", "dv"), *runs)
            if not torch.allclose(c, e, rtol=1e-5, atol=1e-5 * e.abs().max().item())]


def test_auto_mode_compiles_once_its_links_are_probed(dist_pool) -> None:
    """Seen failing: the unseen shape with choose_mode logging while tracing (the fuzzer's compile kind, case
    1677996661: a graph break under fullgraph)."""
    per_rank = dist_pool.run(2, compile_auto, timeout=300)
    assert per_rank == [[], []], per_rank


# LongNet dilated attention (dilated_attention: its own custom ops, in seqpar.attn.dilated): at P = 2 with
# seq_local 12, segments of 4 stay on their rank and segments of 24 span both (their rows travel point to point)
DILATED = (
    ("ring", True, "mixed"),
    ("allgather", False, "grouped"),
)


def compile_dilated(rank: int, world: int) -> list[str]:
    """Worker body: each dilated case eager, then compiled (fullgraph, aot_eager); mismatches and
    dynamo's graph breaks as text."""
    from seqpar.attn.dilated import dilated_attention

    failures = []
    group = torch.distributed.group.WORLD
    for i, (mode, causal, head_layout) in enumerate(DILATED):
        case = make_case(300 + i, world, (4, 2, 8), batch=1)
        q, k, v, dout = (shard_rows(case[n], rank, world, "contiguous").float() for n in ("q", "k", "v", "dout"))

        def call(q, k, v, mode=mode, causal=causal, head_layout=head_layout):  # noqa: ANN001, ANN202
            # q: (1, 4, 12, 8) bhsd, this rank's contiguous shard
            return dilated_attention(q, k, v, segment_lengths=(4, q.shape[2] * world), dilation_rates=(1, 2), causal=causal,
                                     mode=mode, group=group, head_layout=head_layout, check_inputs=False)

        failures += eager_vs_compiled(call, q, k, v, dout, f"dilated {mode} causal={causal} {head_layout}")
        torch._dynamo.reset()
        if i == 0:
            failures += graph_breaks(call, q.clone(), k.clone(), v.clone(), label="dilated: ")
            torch._dynamo.reset()
    return failures


def test_compiled_dilated_attention_equals_eager_without_breaks(dist_pool) -> None:
    per_rank = dist_pool.run(2, compile_dilated, timeout=600)
    assert per_rank == [[], []], per_rank


def _compiled_uneven(rank: int, world: int) -> list[str]:
    """Worker body: Ulysses with 5 query / 5 K/V heads and 6 query / 3 K/V heads on 2 ranks (uneven shares,
    the middle K/V head of 6/3 on both), eager and compiled (fullgraph, aot_eager): the mismatches as text."""
    failures = []
    for i, (heads, sharding, causal) in enumerate((((5, 5, 8), "zigzag", True), ((6, 3, 8), "contiguous", False))):
        case = make_case(400 + i, world, heads, batch=1)
        q, k, v, dout = (shard_rows(case[n], rank, world, sharding).float() for n in ("q", "k", "v", "dout"))

        def call(q, k, v, causal=causal, sharding=sharding):  # noqa: ANN001, ANN202
            return seqpar.attention(q, k, v, causal=causal, mode="ulysses", sharding=sharding,
                                    group=torch.distributed.group.WORLD, check_inputs=False)

        runs = []
        for compiled in (False, True):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            fn = torch.compile(call, fullgraph=True, backend="aot_eager") if compiled else call
            out = fn(*leaves)
            out.backward(dout)
            runs.append([out.detach(), *(t.grad for t in leaves)])
        for name, e, c in zip(("out", "dq", "dk", "dv"), *runs):
            if not torch.allclose(c, e, rtol=1e-5, atol=1e-5 * e.abs().max().item()):
                failures.append(f"{heads} {name} differs by {(c - e).abs().max().item():.3g}")
        torch._dynamo.reset()
    # the op's fake against the real op on this rank's uneven share (torch.library.opcheck, a collective:
    # every rank runs the same calls): 5 heads on 2 ranks are 3 on rank 0, 2 on rank 1
    from seqpar.attn.ops import ulysses_fwd
    from seqpar.attn.ulysses import sequence_order
    from seqpar.comm.group_names import group_name

    case = make_case(402, world, (5, 5, 8), batch=1)
    q, k, v = (shard_rows(case[n], rank, world, "zigzag").float() for n in ("q", "k", "v"))
    order = sequence_order(0, world, world, "zigzag")
    args = (q, k, v, None, group_name(torch.distributed.group.WORLD), "", 5, 5, world, rank, order, 2, 1,
            True, 8 ** -0.5, "zigzag", True, 1, None, None, None, None, "fp32", None)
    try:
        torch.library.opcheck(ulysses_fwd, args, test_utils=("test_faketensor",))
    except Exception as error:  # noqa: BLE001 - reported as text, like the mismatches
        failures.append(f"opcheck: {str(error)[:300]}")
    return failures


@pytest.mark.compile_stage
def test_compiled_uneven_ulysses_heads_equal_eager(dist_pool) -> None:
    """The Ulysses custom op with uneven head shares: its fake gives each rank its own share's saved
    tensors (torch.library.opcheck's fake-tensor check), and a compiled call traces (fullgraph) and equals
    eager (which tests/test_ulysses.py checks against float64).

    Seen failing: the fake sizing the saved tensors by the even ``q_per_rank`` (``HeadSplit.counts`` ->
    ``(split.q_per_rank, split.kv_per_rank)``: a fake/real shape mismatch on rank 1 of 5/5)."""
    assert dist_pool.run(2, _compiled_uneven, timeout=600) == [[], []]


def _compiled_uneven_dynamic(rank: int, world: int) -> list[str]:
    """Worker body: Ulysses with uneven head shares (6 query / 3 K/V heads on 2 ranks, the middle K/V head on
    both; 5 / 5) compiled with ``dynamic=True`` (symbolic sizes: the head counts reach the op's fake as SymInts),
    two calls of one compiled function (batch 1, then 2), each against the float64 reference on the whole
    sequence: the mismatches as text."""
    failures = []
    for i, (heads, sharding, causal) in enumerate((((6, 3, 8), "contiguous", True), ((5, 5, 8), "zigzag", False))):

        def call(q, k, v, causal=causal, sharding=sharding):  # noqa: ANN001, ANN202
            return seqpar.attention(q, k, v, causal=causal, mode="ulysses", sharding=sharding,
                                    group=torch.distributed.group.WORLD, check_inputs=False)

        fn = torch.compile(call, backend="aot_eager", dynamic=True)
        for batch in (1, 2):
            case = make_case(420 + 2 * i + batch, world, heads, batch=batch)
            ref = [shard_rows(t, rank, world, sharding) for t in reference(case, causal, None)]
            leaves = [shard_rows(case[n], rank, world, sharding).float().requires_grad_() for n in "qkv"]
            try:
                out = fn(*leaves)
                out.backward(shard_rows(case["dout"], rank, world, sharding).float())
            except Exception as error:  # noqa: BLE001 - reported as text, like the mismatches
                failures.append(f"{heads} batch {batch}: {type(error).__name__}: {str(error)[:200]}")
                break
            for name, got, want in zip(("out", "dq", "dk", "dv"), [out.detach(), *(t.grad for t in leaves)], ref):
                err = (got.double() - want).abs().max().item()
                if err > 2e-5 * want.abs().max().item():
                    failures.append(f"{heads} batch {batch} {name} off by {err:.3g}")
        torch._dynamo.reset()
    return failures


def test_compiled_uneven_ulysses_heads_with_symbolic_sizes(dist_pool) -> None:
    """Uneven Ulysses head shares under ``torch.compile(dynamic=True)``: exact against float64 (fuzzer case
    1218503732: hybrid u = 2 at P = 2, 6 / 3 heads, ``dynamic=True``, raised on every rank).

    Seen failing: without ``guard_int`` in the Ulysses op's fake (seqpar/attn/ops.py), dynamo's fake call raised
    ``TypeError: unsupported operand type(s) for divmod(): 'SymInt' and 'SymInt'`` (runtime.grid.ulysses_shares)
    on both ranks for 6 / 3 and 5 / 5."""
    assert dist_pool.run(2, _compiled_uneven_dynamic, timeout=600) == [[], []]


def _compiled_balanced_ulysses(rank: int, world: int, dynamic: bool | None) -> list[str]:
    """Worker body: Ulysses over balanced sharding with packed documents as ints (graph constants), compiled
    with fullgraph (aot_eager) and ``dynamic``, 6 query / 3 K/V heads (uneven shares on 2 ranks), against float64
    dense attention with the causal document mask on the whole sequence: the failures as text."""
    import torch.nn.functional as F

    from seqpar.sequence.sharding import shard_index

    case = make_case(430, world, (6, 3, 8), batch=1)
    seq = case["q"].shape[2]
    cu = (0, 5, 13, seq)
    pos = shard_index(seq, rank, world, "balanced", cu_seqlens=cu)
    doc = torch.bucketize(torch.arange(seq), torch.tensor(cu[1:]), right=True)
    mask = (doc[:, None] == doc[None, :]) & torch.ones(seq, seq, dtype=torch.bool).tril()
    full = [case[n].clone().requires_grad_() for n in "qkv"]
    out = F.scaled_dot_product_attention(*full, attn_mask=mask, enable_gqa=True)
    out.backward(case["dout"])
    ref = [t.index_select(2, pos) for t in (out.detach(), *(x.grad for x in full))]

    def call(q, k, v):  # noqa: ANN001, ANN202
        return seqpar.attention(q, k, v, causal=True, mode="ulysses", sharding="balanced", cu_seqlens=cu,
                                group=torch.distributed.group.WORLD, check_inputs=False)

    leaves = [case[n].index_select(2, pos).float().requires_grad_() for n in "qkv"]
    try:
        got = torch.compile(call, fullgraph=True, backend="aot_eager", dynamic=dynamic)(*leaves)
        got.backward(case["dout"].index_select(2, pos).float())
    except Exception as error:  # noqa: BLE001 - reported as text
        return [f"{type(error).__name__}: {str(error)[:300]}"]
    finally:
        torch._dynamo.reset()
    failures = []
    for name, g, want in zip(("out", "dq", "dk", "dv"), [got.detach(), *(x.grad for x in leaves)], ref):
        err = (g.double() - want).abs().max().item()
        if err > 2e-5 * want.abs().max().item():
            failures.append(f"{name} off by {err:.3g}")
    return failures


@pytest.mark.parametrize("dynamic", [None, True])
def test_compiled_ulysses_over_balanced_documents_is_one_graph(dist_pool, dynamic: bool | None) -> None:
    """Ulysses with ``sharding="balanced"`` and documents as ints traces as one graph (fullgraph) and is exact
    against float64: the call's balanced sequence order (``sharding.balanced_layout``) is computed while dynamo
    traces, in plain Python it folds into constants (fuzzer case 1490451036: ``breaks``, 7).

    Seen failing: with ``_causal_chunk_work``'s ``bisect.bisect_right`` back (Unsupported "Attempted to call
    function marked as skipped", _bisect), and with ``balanced_layout``'s ``min(..., key=...)`` back (Unsupported
    "invalid call to builtin op handler"), each on both ranks. With ``dynamic=True`` (fuzzer case 456854197, 2
    breaks, then 6) also: without ``guard_scalar`` of the head counts in ``resolve._ulysses_plan`` (the uneven
    shares' divmod on SymInts: Unsupported "Observed exception") and of the length in ``sharding.chunk_ids``
    (Unsupported "sort with non-constant keys")."""
    assert dist_pool.run(2, _compiled_balanced_ulysses, dynamic, timeout=600) == [[], []]


def _fake_layout_failures(op, args: tuple, label: str) -> list[str]:  # noqa: ANN001
    """``[label: error]`` if ``op(*args)``'s real outputs disagree with its fake's (``torch.library.opcheck``'s
    fake-tensor check: shapes, dtypes, strides), else ``[]``."""
    try:
        torch.library.opcheck(op, args, test_utils=("test_faketensor",))
    except Exception as error:  # noqa: BLE001 - reported with its case
        return [f"{label}: {str(error)[:300]}"]
    return []


def _op_layouts(rank: int, world: int) -> list[str]:
    """The ring and all-gather ops' real outputs against their fake's layout (``torch.library.opcheck``'s
    fake-tensor check) on every rank, with packed documents that leave a rank's queries no remote block."""
    import torch.distributed as dist

    from seqpar.attn.ops import attention_fwd
    from seqpar.comm.group_names import group_name

    failures = []
    name = group_name(dist.group.WORLD)
    for cu in ([0, 14, 15, 16], [0, 1, 2, 15, 16], [0, 16]):
        g = torch.Generator().manual_seed(len(cu))
        q, k, v = (torch.randn(1, h, 16, 5, generator=g)[:, :, rank * 8:(rank + 1) * 8].clone().requires_grad_()
                   for h in (3, 1, 1))
        for algorithm in ("ring", "allgather"):
            args = (q, k, v, None, algorithm, name, True, 5 ** -0.5, "contiguous", True, 1, None, cu, None, None,
                    "fp32", None)
            failures += _fake_layout_failures(attention_fwd, args, f"{algorithm} cu={cu} rank {rank}")
    return failures


def test_the_ring_ops_outputs_have_their_fakes_layout(dist_pool) -> None:
    """Inductor asserts every custom op output's strides against the fake's: the ring op's log-sum-exp came back
    ``(batch, seq, heads)``-strided on rank 0 of fuzzer case 674949561 (P = 2, 3 query heads over 1 K/V head,
    packed documents, inductor with ``dynamic=True``): rank 0 raised in the compiled forward while rank 1 waited
    in the ring. Every op returns its lse contiguous now, as its fake says.

    Seen failing: without the ``.contiguous()`` on ``attention_fwd``'s lse."""
    assert dist_pool.run(2, _op_layouts, timeout=300) == [[], []]


def _latent_and_dilated_layouts(rank: int, world: int) -> list[str]:
    """The MLA latent ops (ring and all-gather) and the dilated op: real outputs against their fakes' layout
    (``torch.library.opcheck``'s fake-tensor check) on every rank, the latent ops with the packed documents of
    :func:`_op_layouts` (a rank whose queries meet no remote block)."""
    import torch.distributed as dist

    from seqpar.attn.dilated import dilated_fwd
    from seqpar.attn.latent import latent_attention_fwd
    from seqpar.comm.group_names import group_name

    failures = []
    name = group_name(dist.group.WORLD)
    heads, nope, rope, dv, lora = 3, 4, 2, 5, 6
    for cu in ([0, 14, 15, 16], [0, 16]):
        g = torch.Generator().manual_seed(len(cu))
        q, c, r = (torch.randn(1, h, 16, d, generator=g)[:, :, rank * 8:(rank + 1) * 8].clone().requires_grad_()
                   for h, d in ((heads, nope + rope), (1, lora), (1, rope)))
        weight = torch.randn(heads * (nope + dv), lora, generator=g, requires_grad=True)
        for algorithm in ("ring", "allgather"):
            args = (q, c, r, weight, None, algorithm, name, heads, nope, rope, dv, lora, True, 6 ** -0.5, "contiguous",
                    True, None, cu, None, None, "fp32")
            failures += _fake_layout_failures(latent_attention_fwd, args, f"latent {algorithm} cu={cu} rank {rank}")
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 16, 4, generator=g)[:, :, rank * 8:(rank + 1) * 8].clone() for _ in range(3))
    for causal in (True, False):
        args = (q, k, v, name, [4, 16], [1, 2], causal, 0.5, "ring", "grouped", "fp32")
        failures += _fake_layout_failures(dilated_fwd, args, f"dilated causal={causal} rank {rank}")
    return failures


def test_the_latent_and_dilated_ops_outputs_have_their_fakes_layout(dist_pool) -> None:
    """As :func:`test_the_ring_ops_outputs_have_their_fakes_layout` for the other custom ops that return an lse:
    the MLA latent ring / all-gather and the dilated op return it contiguous, as their fakes say (inductor asserts
    the strides; a rank raising there leaves the other waiting in the ring).

    Seen failing: the latent op's lse returned ``(batch, seq, heads)``-ordered (``lse.contiguous()`` ->
    ``lse.transpose(1, 2).contiguous().transpose(1, 2)`` in latent_attention_fwd), and the same in dilated_fwd."""
    assert dist_pool.run(2, _latent_and_dilated_layouts, timeout=300) == [[], []]


def test_mask_digest_of_symbolic_boundaries_compiles() -> None:
    """The cross-rank check's digest of the boundaries (``masks.mask_digest``) traced with ``dynamic=True``, the
    boundaries as a tuple argument (SymInts): the same digest as eager (fuzzer case 647716: Ulysses, P=4, balanced,
    documents as a tensor, ``check_inputs``, where dynamo traced the digest after the refused compiled frame).
    Seen failing: without ``guard_scalar`` of the boundaries, InternalTorchDynamoError RecursionError in dynamo's
    ``struct.pack`` polyfill (torch's TORCH_STRUCT_BUG)."""
    from seqpar.attn.masks import mask_digest

    def f(x, cu):  # noqa: ANN001, ANN202
        return x + mask_digest(cu, None, None)[1] % 1009

    cu = (0, 5, 13, 24)
    try:
        got = torch.compile(f, backend="eager", dynamic=True)(torch.zeros(2), cu)
    finally:
        torch._dynamo.reset()
    assert torch.equal(got, f(torch.zeros(2), cu)), (got, f(torch.zeros(2), cu))
