"""Parameters shared between modules under the engines (fuzzer cases of session 19, seed 2): FSDP2 over Zamba's
shared transformer block (one ``fully_shard`` over the modules that hold it, :func:`seqpar.integrations.fsdp.shard_groups`)
and tensor parallelism over tied input / output embeddings (:mod:`seqpar.integrations.tp`).

Each case is a fuzzer ``engine`` case run on the ``dist_pool`` ranks (the fuzzer's own runner, as a user wires
the engine) and judged by the fuzzer's rule: every parameter's reduced gradient, and the loss, against one
process in float64, each on its own scale (``seqpar.testing.fuzz_models.judge_model``).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from seqpar.testing.fuzz_engines import engine_task
from seqpar.testing.fuzz_models import case_batches, judge_model, model_reference


def _engine_rank(rank, world, draws, batches, dtype_name):
    # engine_task takes each DP replica's batches; these cases have one replica (DP 1)
    return engine_task(SimpleNamespace(rank=rank, world_size=world), draws, [batches], dtype_name)


def _judge(dist_pool, draws: dict) -> None:
    batches = case_batches(draws)
    ref = model_reference(draws, batches)
    assert ref["ok"], ref["error"]
    per_rank = dist_pool.run(draws["world"], _engine_rank, draws, batches, ref["dtype"], timeout=240)
    for rank, out in enumerate(per_rank):
        assert out["ok"], (rank, out["error"])
    verdict, detail = judge_model(ref, per_rank[0])
    assert verdict == "exact", detail


_ZAMBA = {"kind": "engine", "model_type": "zamba", "engine": "fsdp2", "tp_size": 1, "world": 2, "mode": "ring",
          "ulysses_size": 1, "sharding": "zigzag", "batch": "packed", "lengths": [[5, 11], [9, 7]],
          "check_inputs": True, "case_seed": 1739095319}


@pytest.mark.timeout(600)
def test_fsdp2_zamba_shared_block_is_exact(dist_pool):
    """Zamba's hybrid layers 1 and 2 hold one transformer block's parameters (tied ``nn.Parameter`` objects in two
    ``shared_transf`` modules): FSDP2 shards them as one unit, and their gradient, the sum of both layers' uses,
    is exact; twice, with two forwards before one backward and non-reentrant checkpointing (the block's unit
    all-gathered and reduced across the two uses and the recomputation).

    Seen failing: with one ``fully_shard`` per block (``shard_groups`` returning ``[[b] for b in blocks]``, main
    before this fix) torch raises "Parameter 'model.layers.2.shared_transf.self_attn.q_proj.weight' is shared
    with a parameter already managed by another FSDP group" on every rank."""
    _judge(dist_pool, {**_ZAMBA, "checkpointing": None, "step": "one"})
    _judge(dist_pool, {**_ZAMBA, "checkpointing": "non-reentrant", "step": "two-forwards"})


_TIED = {"kind": "engine", "engine": "tp2", "tp_size": 2, "world": 2, "mode": "ring", "ulysses_size": 1,
         "sharding": "contiguous", "batch": "packed", "lengths": [[3, 11]], "checkpointing": None, "step": "one",
         "check_inputs": True, "case_seed": 1096474577}


@pytest.mark.timeout(600)
def test_tp2_tied_embeddings_are_exact(dist_pool):
    """Tiny SmolLM3 and MiniCPM3 tie ``lm_head.weight`` to ``model.embed_tokens.weight``; under TP 2 the one
    parameter is sharded on the vocabulary once (its plan's ``embedding_rowwise`` and ``colwise_gather_output``
    agree) and held by both modules: the loss and its gradient (the sum of the lookup's and the head's) are exact
    (SmolLM3 with reentrant checkpointing; MiniCPM3's MLA plan).

    Seen failing: without the tie handling in ``apply_tensor_parallel`` (the plan's ``lm_head.weight`` entry passed
    to transformers), every rank raised ``KeyError: 'lm_head.weight'`` in transformers' apply_tensor_parallelism
    (``named_parameters`` lists a tied parameter once); without the tying again after sharding (the ``setattr``
    at the end of ``apply_tensor_parallel`` skipped), the head kept the unsharded weight and every rank crashed
    in its forward (torch's "aten.mm.default got mixed torch.Tensor and DTensor")."""
    _judge(dist_pool, {**_TIED, "model_type": "smollm3", "checkpointing": "reentrant"})
    _judge(dist_pool, {**_TIED, "model_type": "minicpm3", "batch": "rows", "lengths": [[14]]})


def _tied_tp_rank(rank, world):
    """TP 2 (SP 1) on tiny Llama with its head tied to the embedding: with Megatron-style TP sequence parallelism
    (the embedding sharded by torch's RowwiseParallel, the head's logits kept vocab-parallel) against one
    process; then a plan that shards the head but not the embedding, which must be refused."""
    import copy

    from test_tp_sequence_parallel import _batch, _check_grads, _reference
    from test_tp_train import _model

    from seqpar.integrations.tp import apply_tensor_parallel
    from seqpar.runtime.groups import init_process_groups, set_default_manager
    from seqpar.sequence.batch import shard_batch
    from seqpar.sequence.loss import sequence_parallel_loss

    manager = init_process_groups(config={"size": 1, "tp_size": 2})
    try:
        model = _model("llama")
        model.lm_head.weight = model.model.embed_tokens.weight  # what tie_word_embeddings does
        ref = copy.deepcopy(model)
        apply_tensor_parallel(model, manager, sequence_parallel=True)
        tied = model.lm_head.weight is model.model.embed_tokens.weight
        batch = _batch(3)
        loss_ref = _reference(ref, batch)
        local = shard_batch(batch, group=manager.sp_group, sharding="contiguous")
        logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits
        loss = sequence_parallel_loss(logits, local["shift_labels"], group=manager.sp_group)
        loss.backward()
        torch.testing.assert_close(loss.detach(), loss_ref, rtol=1e-5, atol=0)
        _check_grads(model, ref, manager, "tied, TP-SP")
        untied_plan = {k: v for k, v in ref.tp_plan.items() if k != "model.embed_tokens"}
        try:
            apply_tensor_parallel(_tied_llama(_model), manager, plan=untied_plan)
            refusal = None
        except ValueError as e:
            refusal = str(e)
        return {"tied": tied, "refusal": refusal}
    finally:
        manager.destroy()
        set_default_manager(None)


def _tied_llama(make):
    model = make("llama")
    model.lm_head.weight = model.model.embed_tokens.weight
    return model


@pytest.mark.timeout(300)
def test_tp_sequence_parallel_tied_head_and_refusal(dist_pool):
    """Tied embedding / head under TP sequence parallelism: exact, still one parameter after sharding; and a plan
    laying the tied parameter out two ways (head sharded, embedding replicated) refused by name on every rank.

    Seen failing: without the tying again after sharding, every rank crashed in the head's forward (torch's
    "mixed torch.Tensor and DTensor"); without ``_check_tied_layouts`` (the call skipped), the mixed plan was not
    refused (``refusal`` None): the head's column-parallel forward was left with a replicated weight."""
    for got in dist_pool.run(2, _tied_tp_rank, timeout=240):
        assert got["tied"]
        assert got["refusal"] is not None and "LlamaForCausalLM ties model.embed_tokens.weight and lm_head.weight" \
            in got["refusal"] and "tie_word_embeddings=False" in got["refusal"], got["refusal"]
        assert "lm_head.weight: colwise_gather_output -> [Shard(dim=0)]" in got["refusal"], got["refusal"]


class _Block(nn.Module):
    def __init__(self, shared: nn.Linear | None = None) -> None:
        super().__init__()
        self.own = nn.Linear(4, 4)
        self.proj = shared if shared is not None else nn.Linear(4, 4)


def test_shard_groups_units():
    """Which modules become one FSDP2 unit (no ranks needed): blocks tying a parameter go together, in model
    order; a block whose parameter is tied to a module outside every block is left to the enclosing unit (FSDP2
    manages a parameter in one unit only, so the root must hold both); nested blocks keep their order.

    Seen failing: without the leave-to-enclosing step (``dropped`` never filled) the block tied to ``head`` came
    back as a unit of its own; without the union (each block its own unit) ``[b1, b2]`` came back split."""
    from seqpar.integrations.fsdp import shard_groups

    b0 = _Block()
    b1 = _Block()
    b2 = _Block(shared=b1.proj)  # b1 and b2 hold one Linear (Zamba's layout: tied modules)
    b3 = _Block()
    model = nn.Module()
    model.layers = nn.ModuleList([b0, b1, b2, b3])
    model.head = nn.Linear(4, 4)
    model.head.weight = b3.own.weight  # tied outside the blocks
    blocks = list(reversed([b0, b1, b2, b3]))
    assert shard_groups(model, blocks) == [[b1, b2], [b0]]
    inner = _Block()
    outer = _Block()
    outer.inner = inner
    nested = nn.ModuleList([outer, _Block(shared=outer.proj)])
    assert shard_groups(nested, [inner, nested[1], outer]) == [[inner], [outer, nested[1]]]
