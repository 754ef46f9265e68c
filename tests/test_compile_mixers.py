"""``torch.compile(fullgraph=True)`` of swapped tiny hybrid Hugging Face models (issue 31, the mixers).

The machinery of tests/test_compile_models.py (its ``GraphInspector`` backend: one graph, no host sync,
no unbacked symbol): a swapped LFM2 (a short convolution layer and an attention layer) called on a
``shard_batch`` batch with ``labels`` compiles as one graph at SP = 1 and 2, the convolution's halo
exchange running as the custom ops ``seqpar::halo_fwd`` / ``halo_bwd``, and its loss, logits and every
parameter's gradient equal the eager model's on the same shard (fp32 1e-5; eager itself is compared with
one process in float64 in tests/test_mixers_conv.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from test_compile_models import SEQ, GraphInspector, _model

import seqpar

MIXER_MODELS = ("lfm2",)


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


@pytest.mark.parametrize("world", [1, 2])
def test_compiled_swapped_hybrid_models_equal_eager_in_one_graph(dist_pool, world: int) -> None:
    per_rank = dist_pool.run(world, compile_mixer_models, MIXER_MODELS, timeout=600)
    assert per_rank == [[]] * world, per_rank
