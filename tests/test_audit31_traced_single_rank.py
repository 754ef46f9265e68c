"""Audit 31 (session 30's traced plans): a one-rank plan resolved while dynamo traces, run by Python.

On one rank :func:`seqpar.attn.resolve.resolve_attention` returns a ``"single"`` plan holding the boundary tensor
in ``plan.documents`` when it runs traced; ``"single"`` is one of the custom op's algorithms, so a Python run of
that plan (dynamo gave up the frame that runs it) must take the op too, not the eager path, which never reads
``plan.documents``. tests/test_compile_traced_plans.py runs every site on 2 ranks only.
"""

from __future__ import annotations

import pytest
import torch

SEQ = 16
CU = [0, 3, 11, 16]


@pytest.mark.compile_stage
def test_one_rank_traced_plan_run_by_python_is_exact() -> None:
    """``seqpar.attention`` on one rank (no group), a boundary tensor, float64, compiled without fullgraph with the
    frame that runs the plan given up (``torch.compiler.disable`` on ``run_attention``, as dynamo does past its
    recompile limit): output and dq, dk, dv equal the float64 document-masked reference.

    Seen failing (audit 31, mutant A2: the one-rank plan built with ``traced=False``): AssertionError 'single' at
    dispatch's ``assert plan.documents is None`` (Python ran the eager path with the traced documents)."""
    from test_documents import visible

    import seqpar
    import seqpar.attn.dispatch as dispatch

    g = torch.Generator().manual_seed(31)
    q = torch.randn(1, 4, SEQ, 6, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, 2, SEQ, 6, generator=g, dtype=torch.float64, requires_grad=True) for _ in "kv")
    dout = torch.randn(1, 4, SEQ, 6, generator=g, dtype=torch.float64)

    def fn(q, k, v, cu):  # noqa: ANN001, ANN202
        return seqpar.attention(q, k, v, causal=True, layout="bhsd", cu_seqlens=cu)

    run = dispatch.run_attention
    dispatch.run_attention = torch.compiler.disable(run)
    torch._dynamo.reset()
    try:
        out = torch.compile(fn, backend="aot_eager")(q, k, v, torch.tensor(CU))
    finally:
        dispatch.run_attention = run
        torch._dynamo.reset()
    got = dict(zip(("out", "dq", "dk", "dv"), (out.detach(), *torch.autograd.grad(out, [q, k, v], dout))))

    kx, vx = (t.detach().repeat_interleave(2, 1).requires_grad_() for t in (k, v))
    qr = q.detach().clone().requires_grad_()
    s = (qr @ kx.transpose(-1, -2) * 6 ** -0.5).masked_fill(~visible(SEQ, True, None, CU), float("-inf"))
    ref = torch.softmax(s, -1) @ vx
    dq, dkx, dvx = torch.autograd.grad(ref, [qr, kx, vx], dout)
    want = {"out": ref.detach(), "dq": dq, "dk": dkx.unflatten(1, (2, 2)).sum(2), "dv": dvx.unflatten(1, (2, 2)).sum(2)}
    failures = [f"{n} differs by {(got[n] - want[n]).abs().max().item():.3g}" for n in want
                if not torch.allclose(got[n], want[n], rtol=1e-10, atol=1e-10 * want[n].abs().max().item())]
    assert not failures, failures
