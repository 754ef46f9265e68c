"""The tiled loss (``tiled_loss: true``) on DeepSpeed AutoTP's vocabulary-split LM head (``vocab_parallel_lm_head:
true``) under AutoTP 2 x SP 2 on 4 gloo ranks: vocab-parallel, exact against one float64 process.

DeepSpeed's ``VocabParallelLinear`` holds rows ``[vocab_start_index, vocab_end_index)`` of the head as a plain tensor;
``complete_split_head`` attaches where they sit (``seqpar_vocab_split``), and the tiled forward reduces each tile's
logits over TP and sums the hidden states' gradient over TP (the head's own column-parallel backward, which would,
is bypassed: the tiled loss reads the weight).
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_deepspeed_tp import SP, ds_tp_config, split_head_step

from seqpar.testing.deepspeed_teardown import releases_deepspeed_engines

VOCAB, SEQ, BATCH, LR = 53, 16, 2, 0.5  # an odd vocabulary: DeepSpeed's slices 27 + 26 (or its grain's)


def _qwen2_tied():  # noqa: ANN202
    """Tiny Qwen2 in float64 (biases on q / k / v), its head tied to the input embedding (both split over the
    vocabulary)."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True, use_cache=False,
    )
    return transformers.Qwen2ForCausalLM(cfg).to(torch.float64)


def _llama(tied: bool):  # noqa: ANN202
    """Tiny Llama in float64, its head tied to the input embedding or its own."""
    import transformers

    torch.manual_seed(1)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=tied, use_cache=False,
    )
    return transformers.LlamaForCausalLM(cfg).to(torch.float64)


MODELS = {"qwen2_tied": _qwen2_tied, "llama_untied": lambda: _llama(False), "llama_tied": lambda: _llama(True)}


@releases_deepspeed_engines
def _tiled_split_head_steps(rank: int, world: int, stage: int, kinds: tuple[str, ...] = tuple(MODELS),
                            steps: int = 1) -> dict:
    """Each of ``kinds`` at AutoTP 2 x SP 2, ZeRO ``stage``, ``vocab_parallel_lm_head`` and ``tiled_loss`` true,
    3-row tiles, ``steps`` SGD steps beside one float64 process on fresh batches: every step's loss and every reduced
    gradient (TP slices gathered) equal the process's; returns what the head became."""
    from seqpar.integrations.deepspeed import initialize
    from seqpar.memory import tiling
    from seqpar.runtime.groups import set_default_manager

    out: dict = {}
    max_elements = tiling.MAX_LOSS_CHUNK_ELEMENTS
    for kind in kinds:
        model = MODELS[kind]()
        ref = copy.deepcopy(model)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
        config = {**ds_tp_config(stage, vocab_parallel_lm_head=True),
                  "sequence_parallel": {**SP, "mode": "ulysses", "sharding": "contiguous", "tiled_loss": True}}
        if stage == 3:  # every parameter partitioned: ZeRO-3 keeps those under 100000 elements whole by default
            config["zero_optimization"] = {**config["zero_optimization"], "stage3_param_persistence_threshold": 0}
        engine, _, _, _ = initialize(model=model, config=config,
                                     optimizer=lambda params: torch.optim.SGD(params, lr=LR))
        manager = engine.seqpar_manager
        try:
            head = engine.module.lm_head
            split = head.seqpar_vocab_split
            # ZeRO-3: the head's weight partitioned (empty here) until a forward gathers it
            partitioned = stage == 3 and head.weight.numel() == 0 and not head.weight.ds_persist
            # tiles of 3 rows of the largest slice: several tiles per shard, the same count on both TP ranks
            tiling.MAX_LOSS_CHUNK_ELEMENTS = 3 * split.largest_rows
            for step in range(steps):
                got, sharded = split_head_step(engine, ref, manager, VOCAB, f"{kind} ZeRO-{stage} step {step} ",
                                               seed=12 + step)
                engine.step()
                ref_opt.step()
                ref_opt.zero_grad()
            out[kind] = {"head": type(head).__name__, "logits": got.logits,
                         "slice": (split.vocab_start, int(getattr(head.weight, "ds_shape", head.weight.shape)[0]),
                                   split.vocab_size),
                         "tied": head.weight is engine.module.model.embed_tokens.weight, "partitioned": partitioned,
                         "head_split": "lm_head.weight" in sharded or "model.embed_tokens.weight" in sharded}
        finally:
            tiling.MAX_LOSS_CHUNK_ELEMENTS = max_elements
            manager.destroy()
            set_default_manager(None)
    return out


def _assert_heads(got: dict, rank: int, kinds: tuple[str, ...] = tuple(MODELS)) -> None:
    """What each model's head became on ``rank``: DeepSpeed's ``VocabParallelLinear``, no logits returned, tied as
    the model is, this TP rank's slice of the vocabulary."""
    tp_rank = rank % 2  # DeepSpeed's TP groups are consecutive ranks
    for kind in kinds:
        start, rows, vocab = got[kind]["slice"]
        assert got[kind]["head"] == "VocabParallelLinear" and got[kind]["logits"] is None, got[kind]
        assert got[kind]["tied"] is (kind != "llama_untied") and got[kind]["head_split"], got[kind]
        assert vocab == VOCAB and (start == 0) == (tp_rank == 0) and 0 < rows < VOCAB, got[kind]


def test_tiled_loss_on_the_vocab_split_head_matches_one_process(dist_pool) -> None:
    """``tiled_loss`` on DeepSpeed AutoTP's vocabulary-split head (``vocab_parallel_lm_head: true``), AutoTP 2 x SP 2,
    ZeRO-1, vocabulary 53 (uneven slices), 3-row tiles, ignored targets on one shard: tiny Qwen2 (tied), Llama
    untied and tied, float64. The tiled forward reads the head's ``seqpar_vocab_split`` and is vocab-parallel over TP
    (no logits returned); the loss and every reduced gradient (TP slices gathered) equal one process's.

    Seen failing: the TP all-reduce of the hidden states' gradient dropped (``enter_tp_group`` returning ``x``: the
    gradients below the head off, Qwen2's ``model.embed_tokens.weight`` first, 704 of 1696 elements); the slice
    start off by one row (``max(0, vocab_start_index - 1)`` in ``complete_split_head``: Qwen2's loss off on every
    rank; ``+ 1`` instead is caught by ``tiled_lm_loss``'s own check, "the LM head's 26 rows from 28 do not fit")."""
    for rank, got in enumerate(dist_pool.run(4, _tiled_split_head_steps, 1, timeout=400)):
        _assert_heads(got, rank)


@pytest.mark.timeout(900)
def test_tiled_loss_on_the_vocab_split_head_under_zero3_trains_as_one_process(dist_pool) -> None:
    """``tiled_loss`` on DeepSpeed AutoTP's vocabulary-split head under ZeRO-3, AutoTP 2 x SP 2, vocabulary 53, 3-row
    tiles: tiny Qwen2 (tied) and Llama (untied), float64, every parameter partitioned
    (``stage3_param_persistence_threshold: 0``: the head's slice is empty outside a forward), 3 SGD steps on fresh
    batches. The tiled loss reads the head's weight outside the head's forward; ZeRO-3 gathers it for the causal
    LM's forward and again for its backward, which recomputes every tile (``gather_split_head_for_tiled_loss``
    registers it as an external parameter of the LM). Every step's loss and every reduced gradient equal one
    process's.

    Seen failing: the refusal put back (ConfigError on all 4 ranks); the persistence threshold left at DeepSpeed's
    100000 (the head's slice persistent, never partitioned: the ``partitioned`` check failed, and without it this
    test had passed on a whole weight)."""
    kinds = ("qwen2_tied", "llama_untied")
    for rank, got in enumerate(dist_pool.run(4, _tiled_split_head_steps, 3, kinds, 3, timeout=840)):
        _assert_heads(got, rank, kinds)
        assert all(got[kind]["partitioned"] for kind in kinds), got


def test_tiled_loss_refusals_on_split_heads() -> None:
    """What ``refuse_tiled_loss_on_split_head`` (called in ``initialize`` with the head rows read before
    ``deepspeed.initialize``) passes and refuses, on stand-in heads without a process group: DeepSpeed's
    ``VocabParallelLinear`` (``vocab_parallel_lm_head: true``) passes, its rows fewer than before; the same head under
    ZeRO-3 (its weight partitioned, ``ds_id``) passes too, its weight registered as an external parameter of the
    causal LM (ZeRO-3 gathers it for the LM's forward and backward, where the tiled loss reads it); any other head
    with fewer rows is refused (fuzzer case 756378705). Seen failing: the ``ds_id`` test dropped (the ZeRO-3 head's
    weight not registered)."""
    from deepspeed.module_inject.layers import VocabParallelLinear

    from seqpar.config import ConfigError
    from seqpar.integrations.deepspeed_tp import lm_head_rows, refuse_tiled_loss_on_split_head

    model = _llama(False)
    before = lm_head_rows(model)
    assert before == {"": VOCAB}
    head = VocabParallelLinear.__new__(VocabParallelLinear)
    torch.nn.Module.__init__(head)
    head.weight = torch.nn.Parameter(torch.zeros(VOCAB // 2 + 1, 32))  # TP rank 0's rows
    model.lm_head = head
    refuse_tiled_loss_on_split_head(model, before)
    assert not getattr(model, "_external_params", {})  # ZeRO 0-2: nothing to gather
    head.weight.ds_id = 7  # ZeRO-3's partitioned parameter
    refuse_tiled_loss_on_split_head(model, before)
    assert list(model._external_params.values()) == [head.weight]  # gathered with the causal LM's parameters
    model.lm_head = torch.nn.Linear(32, VOCAB // 2 + 1, bias=False)  # another split: AutoTP's LinearLayer's rows
    with pytest.raises(ConfigError, match=r"tiled_loss .*AutoTP split over the vocabulary \(lm_head: 27 of its 53 rows"
                                          r".*vocab_parallel_lm_head true"):
        refuse_tiled_loss_on_split_head(model, before)
