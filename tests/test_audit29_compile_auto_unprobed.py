"""``mode="auto"`` under ``torch.compile`` before the group's links are probed (seqpar.attn.choose._probed_while_tracing)
is a compile-only refusal (seqpar.attn.checks.CompileOnlyRefusal): raised while dynamo traces and never deferred to the
graph, so that without ``fullgraph=True`` dynamo runs the call eagerly, which probes the links and is exact.
tests/test_compile_attention.py checks the fullgraph side (the refusal names the fix)."""

from __future__ import annotations

import pytest
import torch


def _compiled_before_the_probe(rank: int, world: int) -> str:
    """2 gloo ranks, a group nothing has probed: ``torch.compile(backend="aot_eager")`` (no fullgraph) of a
    ``mode="auto"`` call, its output and gradients against the same call run eagerly afterwards (float64, zigzag,
    4 / 2 heads, 8 rows a rank). "exact", or what differed / was raised."""
    import seqpar

    g = torch.Generator().manual_seed(rank)
    q0 = torch.randn(1, 4, 8, 8, generator=g, dtype=torch.float64)
    k0 = torch.randn(1, 2, 8, 8, generator=g, dtype=torch.float64)
    v0 = torch.randn(1, 2, 8, 8, generator=g, dtype=torch.float64)
    dout = torch.randn(1, 4, 8, 8, generator=g, dtype=torch.float64)
    group = torch.distributed.new_group(list(range(world)))

    def call(q, k, v):  # noqa: ANN001, ANN202
        return seqpar.attention(q, k, v, causal=True, mode="auto", sharding="zigzag", group=group, check_inputs=False)

    results = []
    torch._dynamo.reset()
    try:
        for fn in (torch.compile(call, backend="aot_eager"), call):  # the compiled call first: nothing probed yet
            q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
            try:
                out = fn(q, k, v)
            except Exception as e:  # noqa: BLE001 - what reaches the caller is the point
                return f"{type(e).__name__}: {str(e)[:300]}"
            out.backward(dout)
            results.append((out.detach(), q.grad, k.grad, v.grad))
    finally:
        torch._dynamo.reset()
    for name, got, want in zip(("out", "dq", "dk", "dv"), results[0], results[1], strict=True):
        if not torch.allclose(got, want, rtol=1e-12, atol=1e-12):
            return f"{name} differs by {(got - want).abs().max().item():.3g}"
    return "exact"


@pytest.mark.timeout(420)
def test_auto_mode_compiled_before_the_probe_runs_eagerly_without_fullgraph(dist_pool) -> None:  # noqa: ANN001
    """Seen failing: the refusal raised as a plain ValueError (choose.py ``raise CompileOnlyRefusal(`` -> ``raise
    ValueError(``): deferred into the graph by seqpar::refusal, the compiled call raised "mode='auto' under
    torch.compile: this SP group's links have not been probed yet" instead of running
    (tests/test_compile_refusals.py and test_compile_attention.py passed it: under fullgraph both read the same)."""
    assert dist_pool.run(2, _compiled_before_the_probe, timeout=360) == ["exact", "exact"]
