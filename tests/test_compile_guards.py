"""The guards that keep a traced attention call to one graph when its sizes are symbolic (``torch.compile(...,
dynamic=True)``), each tested alone: the session 24 mutation audit found that each of the three survived its own
removal, since on the end-to-end paths the other two specialise the same values first (a model's head counts, the
caller's ``head_chunks``). Here each is reached with nothing else specialising its values before it:

- the Ulysses op's fake (``seqpar/attn/ops.py``: ``guard_int`` of the head counts), traced by ``make_fx`` with
  symbolic sizes and the head counts taken from the tensors' shapes;
- ``choose_mode`` (``seqpar/attn/choose.py``: ``guard_scalar(head_chunks)``), traced by dynamo with a symbolic
  ``head_chunks`` argument and fullgraph;
- the resolved call's Ulysses plan (``seqpar/attn/resolve.py``: ``guard_scalar`` of the head counts before
  ``head_split``), traced by dynamo on 2 ranks with symbolic head counts and fullgraph, the plan read but no op run.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist


def test_ulysses_fake_takes_symbolic_head_counts() -> None:
    """The Ulysses forward op's fake, given uneven head counts as SymInts (6 query / 3 K/V heads over 2 ranks: shares
    of 3 query heads each, the middle K/V head on both), returns this rank's head-layout tensors, the head counts
    specialised (guards ``== 6`` and ``== 3``, a model's constants).

    Seen failing: without ``guard_int`` in the fake (seqpar/attn/ops.py), ``TypeError: unsupported operand type(s)
    for divmod(): 'SymInt' and 'int'`` (runtime.grid.ulysses_shares)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    import seqpar.attn.ops  # noqa: F401  (registers torch.ops.seqpar.*)

    def fake_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
        # group "" (no exchange: only the fake runs), u = 2, rank 0, contiguous, one head pass
        return torch.ops.seqpar.ulysses_fwd(q, k, v, None, "", "", q.shape[1], k.shape[1], 2, 0, None, 1, 1,
                                            True, 8 ** -0.5, "contiguous", True, 1, None, None, None, None, "fp32",
                                            None)

    q, k, v = torch.randn(1, 6, 8, 8), torch.randn(1, 3, 8, 8), torch.randn(1, 3, 8, 8)
    traced = make_fx(fake_call, tracing_mode="symbolic")(q, k, v)
    (call,) = [n for n in traced.graph.nodes if n.op == "call_function" and "ulysses_fwd" in str(n.target)]
    out, saved = call.meta["val"]
    # rank 0 attends query heads 0..2 (3) and K/V heads 0..1 (2) over u * L = 16 rows
    assert [tuple(t.shape) for t in saved] == [(1, 3, 16, 8), (1, 2, 16, 8), (1, 2, 16, 8), (1, 3, 16, 8), (1, 3, 16)]
    assert tuple(out.shape) == (1, 6, 8, 8)


def test_auto_mode_choice_takes_a_symbolic_head_chunks() -> None:
    """``choose_mode`` traced by dynamo (``dynamic=True``, fullgraph) with ``head_chunks`` an argument of the
    compiled function (3: symbolic, dynamo specialises only 0 and 1) and nothing before it specialising it: one
    graph, the choice made.

    Seen failing: without ``guard_scalar(head_chunks)`` in ``choose_mode`` (seqpar/attn/choose.py), dynamo's
    Unsupported (a graph break under fullgraph) at ``math.gcd`` in the cost model."""
    from seqpar.attn.choose import choose_mode

    def choose(q: torch.Tensor, k: torch.Tensor, head_chunks: int) -> torch.Tensor:
        mode = choose_mode(q, k, world=2, manager=None, causal=True, group=None, head_chunks=head_chunks,
                           head_chunks_given=True)
        return q * (2.0 if mode == "ring" else 3.0)

    q, k = torch.randn(1, 6, 16, 8), torch.randn(1, 6, 16, 8)
    try:
        compiled = torch.compile(choose, dynamic=True, fullgraph=True, backend="eager")
        assert compiled(q, k, 3).shape == q.shape
    finally:
        torch._dynamo.reset()


def _traced_ulysses_plan(rank: int, world: int) -> list[str]:
    """Worker body: ``resolve_attention(mode="ulysses")`` traced by dynamo (``dynamic=True``, fullgraph, the eager
    backend) with uneven head counts (6 / 3 and 5 / 5 over 2 ranks), the plan's share of this rank read into the
    result; no attention op runs. The failures as text."""
    from seqpar.attn.resolve import resolve_attention

    def plan_share(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        plan = resolve_attention(q, k, v, causal=True, mode="ulysses", group=dist.group.WORLD, check_inputs=False,
                                 sharding="contiguous")
        first_q, count_q, first_kv, count_kv = plan.ulysses.split.share(rank)
        return q.narrow(1, first_q, count_q).sum() + k.narrow(1, first_kv, count_kv).sum()

    failures = []
    for hq, hkv in ((6, 3), (5, 5)):
        q, k, v = torch.randn(1, hq, 8, 8), torch.randn(1, hkv, 8, 8), torch.randn(1, hkv, 8, 8)
        try:
            got = torch.compile(plan_share, dynamic=True, fullgraph=True, backend="eager")(q, k, v)
            if not torch.equal(got, plan_share(q, k, v)):  # the traced plan is the eager one
                failures.append(f"{hq}/{hkv}: {got} traced, {plan_share(q, k, v)} eager")
        except Exception as error:  # noqa: BLE001 - reported as text
            failures.append(f"{hq}/{hkv}: {type(error).__name__}: {str(error)[:200]}")
        finally:
            torch._dynamo.reset()
    return failures


@pytest.mark.compile_stage  # a 2-rank dynamo trace: about a minute under load with the pool's start
def test_ulysses_plan_takes_symbolic_head_counts(dist_pool) -> None:  # noqa: ANN001
    """The resolved call's Ulysses plan under dynamo with symbolic sizes: uneven shares (6 / 3, 5 / 5 over 2 ranks)
    computed without a graph break and equal to eager's, the op not reached (its fake's own guard not involved).

    Seen failing: without ``guard_scalar`` of the head counts in ``resolve._ulysses_plan`` (seqpar/attn/resolve.py),
    dynamo's Unsupported "Observed exception" (the uneven shares' divmod on SymInts) for 6 / 3 and 5 / 5 on both
    ranks; the end-to-end test (test_compile_attention.py, balanced documents under dynamic=True) passed it, the
    op's fake specialising the same head counts."""
    assert dist_pool.run(2, _traced_ulysses_plan, timeout=600) == [[], []]
