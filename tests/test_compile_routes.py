"""``torch.compile(fullgraph=True)`` of models swapped through the ``"sdpa"`` and ``"mha"`` routes (issue 31 §4).

The ``"sdpa"`` route: a nanoGPT-style model whose attention calls ``F.scaled_dot_product_attention`` (seqpar's
dispatcher, :mod:`seqpar.swap.sdpa`). The ``"mha"`` route: a causal ``nn.TransformerEncoderLayer`` plus a bare
``nn.MultiheadAttention`` (both replaced by :class:`seqpar.swap.SeqParMultiheadAttention`), batch-first and
sequence-first. Per SP size (1, 2, 4; zigzag, ring at P = 1 and 4, all-gather for the sequence-first model at
P = 2): the swapped model, fed ``shard_batch``'s shard, compiles as one graph (``torch.compile(model,
fullgraph=True)`` with a counting ``aot_eager`` backend: one graph is dynamo's 0 graph breaks), and its output
and every parameter's gradient equal the eager swapped model's on the same shard (fp32 1e-5 of each one's own
scale; eager itself is compared with the unswapped model on the full sequence in tests/test_swap.py).

These models are probed for position mixing at their first forward (:mod:`seqpar.swap.probe_batch`), which runs
eagerly: the eager run comes first, as it must (see :mod:`seqpar.swap.traced`).

Seen failing: with the dispatcher calling torch's own SDPA on the local shard while tracing
(``seqpar.swap.sdpa._sdpa_dispatch``), nanoGPT at P = 2 and 4 differed from eager in the output and every
gradient; with ``SeqParMultiheadAttention`` reading ``is_causal`` as False while tracing, both MHA models
differed at every P (the batch-first one's logits by 0.64).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from test_swap import VOCAB, build_model, run_model

from seqpar.config import SeqParConfig
from seqpar.sequence.batch import shard_batch
from seqpar.swap import swap_attention

# (model kind of tests/test_swap.py, its route, mode) per SP size: the P = 4 pool compiles the two routes once
KINDS = {
    1: (("nanogpt", "sdpa", "ring"), ("mha", "mha", "ring")),
    2: (("nanogpt", "sdpa", "ring"), ("mha", "mha", "ring"), ("mha_seq_first", "mha", "allgather")),
    4: (("nanogpt", "sdpa", "ring"), ("mha", "mha", "ring")),
}
SEQ = 16  # zigzag over 4 ranks: 8 chunks of 2 tokens


def compile_routes(rank: int, world: int, kinds: tuple[tuple[str, str, str], ...]) -> list[str]:
    """Worker body: each swapped model eager, then compiled (fullgraph, counting aot_eager backend); the
    mismatches, wrong routes and graph counts as text."""
    from torch._dynamo.testing import CompileCounterWithBackend

    failures = []
    for i, (kind, route, mode) in enumerate(kinds):
        torch.manual_seed(0)
        model = build_model(kind)
        report = swap_attention(model, SeqParConfig(size=world, mode=mode, sharding="zigzag"),
                                group=dist.group.WORLD if world > 1 else None)
        if {m.route for m in report.swapped} != {route}:
            failures.append(f"{kind}: swapped through {report}, not the {route} route")
        g = torch.Generator().manual_seed(10 + i)
        ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
        weight = torch.randn(2, SEQ, VOCAB, generator=g)  # a loss that touches every logit
        local = shard_batch({"input_ids": ids, "weight": weight}, group=dist.group.WORLD if world > 1 else None,
                            sharding="zigzag")
        counter = CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(model, fullgraph=True, backend=counter)
        runs = []
        for fn in (model, compiled):  # eager first: the position-mixing probe runs at the first forward
            model.zero_grad(set_to_none=True)
            logits = run_model(kind, fn, local["input_ids"], local["position_ids"])
            (logits * local["weight"]).sum().backward()
            runs.append({"logits": logits.detach(), **{n: p.grad for n, p in model.named_parameters()}})
        eager, comp = runs
        for name, e in eager.items():
            c = comp[name]
            if c is None or e is None:
                failures.append(f"{kind} P={world}: {name} has no gradient in the {'compiled' if c is None else 'eager'} run")
            elif not torch.allclose(c, e, rtol=1e-5, atol=1e-5 * e.abs().max().item()):
                failures.append(f"{kind} P={world}: {name} differs by {(c - e).abs().max().item():.3g}")
        if counter.frame_count != 1:
            failures.append(f"{kind} P={world}: {counter.frame_count} graphs (graph breaks: {counter.frame_count - 1})")
        torch._dynamo.reset()
    return failures


@pytest.mark.parametrize("world", sorted(KINDS))
def test_compiled_sdpa_and_mha_routes_equal_eager_in_one_graph(dist_pool, world: int) -> None:
    per_rank = dist_pool.run(world, compile_routes, KINDS[world], timeout=600)
    assert per_rank == [[]] * world, per_rank


def test_the_sdpa_route_compiles_once_for_every_thread() -> None:
    """The dispatcher's per-thread state is read while tracing (dynamo guards on it): a compiled nanoGPT called
    from a second thread runs the same graph (no recompile) and equals eager. One process (SP = 1).

    Seen failing: with the per-thread attributes made on first use (``getattr(_local, "stack", None)`` in
    ``seqpar.swap.state``), the second thread failed the guards and compiled a second graph."""
    import threading

    from torch._dynamo.testing import CompileCounterWithBackend

    torch.manual_seed(0)
    model = build_model("nanogpt")
    swap_attention(model, {"swap": "sdpa"})
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    positions = torch.arange(SEQ).expand(2, SEQ)
    expected = model(ids, positions).detach()  # eager first: the position-mixing probe
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    outs = [compiled(ids, positions)]
    thread = threading.Thread(target=lambda: outs.append(compiled(ids, positions)))
    thread.start()
    thread.join(timeout=300)
    torch._dynamo.reset()
    assert len(outs) == 2, "the compiled call on the second thread did not finish"
    assert counter.frame_count == 1, f"{counter.frame_count} graphs: the second thread recompiled"
    for out in outs:
        torch.testing.assert_close(out.detach(), expected, rtol=1e-5, atol=1e-5)


def test_compiling_the_routes_names_the_fix() -> None:
    """What cannot be traced is refused while tracing, naming the fix: a causal ``attn_mask`` handed to a swapped
    ``nn.MultiheadAttention`` without ``is_causal=True`` (its values cannot be read in the graph), and a model of
    these routes compiled before its first eager forward (the position-mixing probe runs there)."""

    class MaskOnly(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = torch.nn.MultiheadAttention(32, 4, batch_first=True)

        def forward(self, x: torch.Tensor, is_causal: bool = False) -> torch.Tensor:  # x: (batch, seq, 32)
            mask = torch.nn.Transformer.generate_square_subsequent_mask(x.shape[1])
            return self.attn(x, x, x, attn_mask=mask, need_weights=False, is_causal=is_causal)[0]

    torch.manual_seed(0)
    model = MaskOnly()
    swap_attention(model, {"swap": "mha"})
    x = torch.randn(2, 8, 32)
    with pytest.raises(Exception, match="probe"):  # compiled before the first (eager) forward
        torch.compile(model, fullgraph=True, backend="aot_eager")(x)
    torch._dynamo.reset()
    expected = model(x)  # eager reads the mask: the causal mask
    with pytest.raises(Exception, match=r"attn_mask given without is_causal=True.*Pass is_causal=True"):
        torch.compile(model, fullgraph=True, backend="aot_eager")(x)
    torch._dynamo.reset()
    out = torch.compile(model, fullgraph=True, backend="aot_eager")(x, is_causal=True)
    torch._dynamo.reset()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
