"""``torch.compile(fullgraph=True)`` of swapped tiny hybrid Hugging Face models (issue 31, the mixers).

The machinery of tests/test_compile_models.py (its ``GraphInspector`` backend: one graph, no host sync,
no unbacked symbol): a swapped LFM2 (a short convolution layer and an attention layer) and Qwen3.5 (a
Gated DeltaNet layer and an attention layer) called on a ``shard_batch`` batch with ``labels`` compile as
one graph at SP = 1 and 2 (the convolutions' halo exchange runs as the custom ops ``seqpar::halo_fwd`` /
``halo_bwd``, the scan's state passing as torch's functional all-gather), and their loss, logits and every
parameter's gradient equal the eager model's on the same shard (fp32 1e-5; eager itself is compared with
one process in float64 in tests/test_mixers_conv.py and tests/test_mixers_gdn.py).

Falcon-H1 (Mamba2), Jamba (Mamba) and Qwen3-Next (GDN) at SP = 2 and 4, and LFM2 and Qwen3.5 at SP = 4:
tests/test_compile_breadth.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from test_compile_models import SEQ, GraphInspector, _model

import seqpar

# (SP size, models): each model costs a trace of forward and backward (~20-50 s of CPU at SP = 2)
CASES = [(1, ("lfm2", "qwen3_5_text")), (2, ("lfm2",)), (2, ("qwen3_5_text",))]


def compile_mixer_models(rank: int, world: int, model_types: tuple[str, ...]) -> list[str]:
    """Worker body: each model eager, then compiled; the mismatches and problems as text."""
    failures = []
    group = dist.group.WORLD
    for model_type in model_types:
        model = _model(model_type)
        seqpar.swap_attention(model, {"size": world, "sharding": "zigzag"}, group=group)
        ids = torch.randint(3, model.config.vocab_size, (1, SEQ), generator=torch.Generator().manual_seed(5))
        batch = seqpar.shard_batch({"input_ids": ids, "labels": ids.clone()}, group=group, sharding="zigzag")
        inspector = GraphInspector()
        runs = []
        for compiled in (False, True):
            model.zero_grad(set_to_none=True)
            fn = torch.compile(model, fullgraph=True, backend=inspector) if compiled else model
            out = fn(**batch)
            out.loss.backward()
            grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
            runs.append({"loss": out.loss.detach(), "logits": out.logits.detach(), **grads})
        eager, comp = runs
        if sorted(eager) != sorted(comp):
            failures.append(f"{model_type}: gradients of {sorted(set(eager) ^ set(comp))} only in one run")
        for name in sorted(eager.keys() & comp.keys()):
            e, c = eager[name], comp[name]
            if not torch.allclose(c, e, rtol=1e-5, atol=1e-5 * e.abs().max().item()):
                failures.append(f"{model_type} P={world}: {name} differs by {(c - e).abs().max().item():.3g}")
        if inspector.graphs != 1:
            failures.append(f"{model_type} P={world}: {inspector.graphs} graphs (explain: "
                            f"{inspector.graphs - 1} graph breaks)")
        failures += [f"{model_type} P={world}: {p}" for p in sorted(set(inspector.problems))]
        torch._dynamo.reset()
    return failures


@pytest.mark.parametrize(("world", "model_types"), CASES)
def test_compiled_swapped_hybrid_models_equal_eager_in_one_graph(dist_pool, world: int,
                                                                 model_types: tuple[str, ...]) -> None:
    per_rank = dist_pool.run(world, compile_mixer_models, model_types, timeout=280)
    assert per_rank == [[]] * world, per_rank
