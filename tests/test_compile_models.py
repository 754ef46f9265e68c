"""``torch.compile(fullgraph=True)`` of swapped tiny Hugging Face models (issue 31 §2, attention-only models).

Per model and SP size: the swapped model called on a ``shard_batch`` batch with ``labels`` compiles as one
graph (``torch.compile(model, fullgraph=True)`` with a counting ``aot_eager`` backend: one graph, the count
``torch._dynamo.explain`` reports, whose ``graph_break_count`` is the graph count less one; the outermost
model's pre-hooks run as a frame of their own, so a tensor made there would be a second graph), and its
loss, logits and every parameter's gradient equal the eager model's on the same shard (fp32 1e-5; eager
itself is compared with one process in float64 in tests/test_swap.py and tests/all_models.py).

The backend also reads the forward and backward graphs aot_autograd hands it: no host sync
(``_local_scalar_dense``, ``item``, ``nonzero``, ...) and no unbacked symbol, which is what lets a GPU
run ahead of the host through the compiled step.

Packed documents (Llama at SP = 2): eight ``DataCollatorWithFlattening`` batches of different layouts
(one to four documents, same length) run through one compiled model; each equals eager, and all eight
run in the first graph (no recompile: the boundaries travel as a tensor whose size ``shard_batch`` marks
dynamic). Seen failing: with the compiled op ignoring the boundary tensor (``seqpar.attn.ops._options``),
every packed layout's loss and gradients differed from eager; with ``shard_batch`` not marking the size
dynamic, 2 graphs (one recompile, the number of documents then dynamic). Dynamo's own counters over layouts
2-8 must show no recompile of any frame (``torch._dynamo.utils.guard_failures``, one entry per recompile,
whether or not it makes a graph) and no new graph (``counters["stats"]["unique_graphs"]``): stricter than the
acceptance's "at most one recompile", as this code makes none. Seen failing: with a layout-dependent Python
bool in the traced preparer (``if cu_seq_lens.shape[0] > 3: pass`` in ``seqpar.swap.traced.prepared_documents``,
a guard on the number of documents), "layouts 2-8 recompiled 2 times and made 2 graphs", naming the guard
``2 <= kwargs['cu_seq_lens_q'].size()[0] <= 3``. (A frame whose compile makes no graph is not recompiled in
torch 2.13: dynamo runs it eagerly from then on, tried; so the graph count and the recompile count agree here,
and the counters name the failing guard.)

Seen failing: with the traced preparer doubling ``position_ids`` on the compiled path only
(``seqpar.swap.hf_traced``), Llama at SP = 1 differed from eager in the loss and every gradient (up to
1.5e-3 in the embedding's).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import seqpar

# aten ops that read a tensor's values on the host (or make shapes depend on them)
HOST_SYNCS = ("_local_scalar_dense", "item", "nonzero", "unique", "masked_select", "_assert_async",
              "equal", "is_nonzero")
SEQ = 16  # zigzag over 4 ranks: 8 chunks of 2 tokens


def _model(model_type: str) -> torch.nn.Module:
    """A tiny model of ``model_type`` (``compile_kwargs``: the fewest layers that keep its layer kinds, seeded
    weights; MoE router losses on)."""
    import transformers
    from transformers.models.auto import modeling_auto as auto

    from seqpar.testing.tiny_models import compile_kwargs

    cls = getattr(transformers, auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    # the experts' default (batched) implementation: the "eager" loop's per-expert nonzero is a host sync
    # in transformers' own code
    config = transformers.CONFIG_MAPPING[model_type](**compile_kwargs(model_type))
    torch.manual_seed(0)
    return cls(config).train()


class GraphInspector:
    """An ``aot_eager`` backend that counts dynamo's graphs and reads aot_autograd's forward and
    backward graphs for host syncs and unbacked symbols."""

    def __init__(self) -> None:
        self.graphs = 0
        self.problems: list[str] = []
        self.ops: set[str] = set()  # every call_function target of the forward and backward graphs

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        from torch._dynamo.backends.common import aot_autograd

        self.graphs += 1
        return aot_autograd(fw_compiler=self._read, bw_compiler=self._read)(gm, example_inputs)

    def _read(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

        for node in gm.graph.nodes:
            name = str(node.target)
            if node.op == "call_function":
                self.ops.add(name)
            if node.op == "call_function" and any(f".{op}." in name or name.endswith(f".{op}") or name == op
                                                  for op in HOST_SYNCS):
                self.problems.append(f"host sync {name}")
            val = node.meta.get("val")
            vals = val if isinstance(val, (tuple, list)) else (val,)
            if any(isinstance(v, (torch.Tensor, torch.SymInt)) and free_unbacked_symbols(v) for v in vals):
                self.problems.append(f"unbacked symbol in {node.format_node()}")
        from functorch.compile import make_boxed_func

        return make_boxed_func(gm.forward)


# Packed documents (DataCollatorWithFlattening's position_ids and cu_seq_lens): eight layouts of SEQ tokens,
# different boundaries and numbers of documents (one to four). Under compile the boundaries are a tensor
# (seqpar.swap.traced) whose size shard_batch marks dynamic: all eight run in the first graph.
LAYOUTS = ((5, 11), (16,), (3, 6, 7), (8, 8), (2, 2, 12), (4, 4, 4, 4), (1, 15), (6, 5, 3, 2))


def _batches(model: torch.nn.Module, world: int, packed: bool) -> list[dict]:
    """This rank's shard_batch batches: one unpacked sequence, or the packed LAYOUTS."""
    import transformers

    from seqpar.sequence.batch import shard_batch

    group = dist.group.WORLD
    if not packed:
        ids = torch.randint(3, model.config.vocab_size, (1, SEQ), generator=torch.Generator().manual_seed(5))
        return [shard_batch({"input_ids": ids, "labels": ids.clone()}, group=group, sharding="zigzag")]
    collate = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_position_ids=True)
    batches = []
    for i, lengths in enumerate(LAYOUTS):
        g = torch.Generator().manual_seed(10 + i)
        docs = [torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist() for n in lengths]
        batches.append(shard_batch(collate([{"input_ids": d} for d in docs]), group=group, sharding="zigzag"))
    return batches


def _recompiles() -> int:
    """Dynamo's recompiles in this process so far: one guard failure list entry per recompile of a frame."""
    return sum(len(reasons) for reasons in torch._dynamo.utils.guard_failures.values())


def compile_models(rank: int, world: int, model_types: tuple[str, ...], packed: tuple[str, ...] = (),
                   options: dict | None = None, expect_ops: tuple[str, ...] = ()) -> list[str]:
    """Worker body: each model eager, then compiled, on each of its batches (``packed``: the models run on
    the eight packed LAYOUTS, all in one graph; ``options``: swap options beyond size and sharding;
    ``expect_ops``: ops each model's compiled graphs must call, e.g. ``"seqpar.latent_attention_fwd.default"``);
    the mismatches and problems as text."""
    failures = []
    for model_type in model_types:
        model = _model(model_type)
        seqpar.swap_attention(model, {"size": world, "sharding": "zigzag", **(options or {})},
                              group=dist.group.WORLD)
        inspector = GraphInspector()
        compiled_model = torch.compile(model, fullgraph=True, backend=inspector)
        dynamo = torch._dynamo.utils
        after_first = None  # dynamo's recompiles (guard failures, all frames) and graphs after the first batch
        for b, batch in enumerate(_batches(model, world, model_type in packed)):
            if b == 1:
                after_first = (_recompiles(), dynamo.counters["stats"]["unique_graphs"])
            runs = []
            for fn in (model, compiled_model):
                model.zero_grad(set_to_none=True)
                out = fn(**batch)
                out.loss.backward()
                grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
                runs.append({"loss": out.loss.detach(), "logits": out.logits.detach(), **grads})
            eager, comp = runs
            where = f"{model_type} P={world}" + (f" layout {LAYOUTS[b]}" if model_type in packed else "")
            if sorted(eager) != sorted(comp):
                failures.append(f"{where}: gradients of {sorted(set(eager) ^ set(comp))} only in one run")
            for name in eager.keys() & comp.keys():
                e, c = eager[name], comp[name]
                if not torch.allclose(c, e, rtol=1e-5, atol=1e-5 * e.abs().max().item()):
                    failures.append(f"{where}: {name} differs by {(c - e).abs().max().item():.3g}")
        if after_first is not None:
            # dynamo's own counters over layouts 2-8: every recompile of any frame (a guard failure, also in
            # a frame whose new compile makes no graph the backend would count) and every new graph
            recompiles = _recompiles() - after_first[0]
            graphs = dynamo.counters["stats"]["unique_graphs"] - after_first[1]
            if recompiles or graphs:
                reasons = [r.splitlines()[0] for rs in dynamo.guard_failures.values() for r in rs]
                failures.append(f"{model_type} P={world}: layouts 2-{len(LAYOUTS)} recompiled {recompiles} times "
                                f"and made {graphs} graphs (dynamo's counters): {reasons[-3:]}")
        if inspector.graphs != 1:  # a graph break, or (packed) a recompile for a new layout
            failures.append(f"{model_type} P={world}: {inspector.graphs} graphs (graph breaks and recompiles: "
                            f"{inspector.graphs - 1})")
        failures += [f"{model_type} P={world}: {p}" for p in sorted(set(inspector.problems))]
        failures += [f"{model_type} P={world}: no {op} in the graphs" for op in expect_ops if op not in inspector.ops]
        torch._dynamo.reset()
    return failures


# per SP size, the models compiled (each costs a trace of forward and backward: ~10-20 s of CPU)
MODELS = {
    1: ("llama",),
    2: ("llama", "mixtral", "gpt_oss"),  # MoE: router losses over the SP group (more models: test_compile_breadth)
    4: ("llama",),
}
# per SP size, the models of MODELS that run on the packed LAYOUTS instead of one unpacked sequence (SP = 1:
# tried, equal in one graph; unpacked Llama stays covered at SP = 1 and 4)
PACKED = {2: ("llama",)}


@pytest.mark.parametrize("world", sorted(MODELS))
def test_compiled_swapped_models_equal_eager_in_one_graph(dist_pool, world: int) -> None:
    per_rank = dist_pool.run(world, compile_models, MODELS[world], PACKED.get(world, ()), timeout=900)
    assert per_rank == [[]] * world, per_rank


def test_the_graph_inspector_sees_host_syncs_and_unbacked_symbols() -> None:
    """The backend above can fail: a value read on the host (captured as a scalar) is a host sync and an
    unbacked symbol in the graphs it reads."""
    inspector = GraphInspector()

    def step(x: torch.Tensor) -> torch.Tensor:
        n = (x > 0).sum().item()  # an int read on the host, which sizes a tensor
        return x * torch.ones(n + 1).sum()

    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        torch.compile(step, fullgraph=True, backend=inspector)(torch.randn(4, requires_grad=True)).sum().backward()
    torch._dynamo.reset()
    assert inspector.graphs == 1
    assert any("host sync" in p and "_local_scalar_dense" in p for p in inspector.problems), inspector.problems
    assert any("unbacked symbol" in p for p in inspector.problems), inspector.problems


def test_a_compiled_model_names_shard_batch_for_an_unprepared_batch() -> None:
    """Under compile the per-batch checks cannot run, so a batch ``shard_batch`` did not prepare (no
    ``position_ids``) is refused while tracing, naming the fix; so are packed documents in a batch of more
    than one row. One process, no group: the refusals come before any graph."""
    model = _model("llama")
    seqpar.swap_attention(model)
    ids = torch.randint(3, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(1))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match=r"without position_ids.*seqpar\.shard_batch"):
        compiled(input_ids=ids, labels=ids)
    torch._dynamo.reset()
    packed = seqpar.shard_batch({"input_ids": ids, "labels": ids, "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])})
    rows = {k: torch.cat([v, v]) if k in ("input_ids", "position_ids", "shift_labels") else v for k, v in packed.items()}
    with pytest.raises(Exception, match=r"packed documents \(cu_seq_lens_q\) need batch 1, got batch 2"):
        compiled(**rows)
    torch._dynamo.reset()
    # a padding mask cannot be read while tracing: taken on trust it would be ignored, so any mask is refused
    prepared = seqpar.shard_batch({"input_ids": ids, "labels": ids, "attention_mask": (ids > 0).long()})
    with pytest.raises(Exception, match=r"attention_mask given to a compiled swapped model.*without attention_mask"):
        compiled(**prepared)
    torch._dynamo.reset()
