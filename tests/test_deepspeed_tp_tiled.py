"""The tiled loss (``tiled_loss: true``) on DeepSpeed AutoTP's vocabulary-split LM head (``vocab_parallel_lm_head:
true``) under AutoTP 2 x SP 2 on 4 gloo ranks: vocab-parallel, exact against one float64 process.

DeepSpeed's ``VocabParallelLinear`` holds rows ``[vocab_start_index, vocab_end_index)`` of the head as a plain tensor;
``complete_split_head`` attaches where they sit (``seqpar_vocab_split``), and the tiled forward reduces each tile's
logits over TP and sums the hidden states' gradient over TP (the head's own column-parallel backward, which would,
is bypassed: the tiled loss reads the weight).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from test_deepspeed_tp import SP, assert_tp_grads, ds_tp_config

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


@releases_deepspeed_engines
def _tiled_split_head_steps(rank: int, world: int, stage: int) -> dict:
    """Each model at AutoTP 2 x SP 2, ``vocab_parallel_lm_head`` and ``tiled_loss`` true, 3-row tiles: the loss and
    every reduced gradient (TP slices gathered) against one float64 process; what the head became."""
    from seqpar.integrations.deepspeed import initialize
    from seqpar.memory import tiling
    from seqpar.runtime.groups import set_default_manager
    from seqpar.sequence.batch import shard_batch

    out: dict = {}
    max_elements = tiling.MAX_LOSS_CHUNK_ELEMENTS
    for kind, build in (("qwen2_tied", _qwen2_tied), ("llama_untied", lambda: _llama(False)),
                        ("llama_tied", lambda: _llama(True))):
        model = build()
        ref = copy.deepcopy(model)
        config = {**ds_tp_config(stage, vocab_parallel_lm_head=True),
                  "sequence_parallel": {**SP, "mode": "ulysses", "sharding": "contiguous", "tiled_loss": True}}
        engine, _, _, _ = initialize(model=model, config=config,
                                     optimizer=lambda params: torch.optim.SGD(params, lr=LR))
        manager = engine.seqpar_manager
        try:
            head = engine.module.lm_head
            split = head.seqpar_vocab_split
            # tiles of 3 rows of the largest slice: several tiles per shard, the same count on both TP ranks
            tiling.MAX_LOSS_CHUNK_ELEMENTS = 3 * split.largest_rows
            ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(12))
            ids[1, 5] = VOCAB - 1  # the last id: the last slice's last row
            labels = ids.clone()
            labels[0, 3:6] = -100  # ignored targets, on one SP rank's shard only
            logits_ref = ref(input_ids=ids).logits
            loss_ref = F.cross_entropy(logits_ref[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
            loss_ref.backward()
            got = engine(**shard_batch({"input_ids": ids, "labels": labels}, group=manager.sp_group,
                                       sharding="contiguous"))
            engine.backward(got.loss)
            torch.testing.assert_close(got.loss.detach().to(loss_ref.dtype), loss_ref.detach(), rtol=1e-7, atol=0,
                                       msg=lambda m, k=kind: f"{k} ZeRO-{stage} loss: {m}")
            sharded = assert_tp_grads(engine, ref, manager, f"{kind} ZeRO-{stage} ")
            out[kind] = {"head": type(head).__name__, "logits": got.logits,
                         "slice": (split.vocab_start, int(head.weight.shape[0]), split.vocab_size),
                         "tied": head.weight is engine.module.model.embed_tokens.weight,
                         "head_split": "lm_head.weight" in sharded or "model.embed_tokens.weight" in sharded}
        finally:
            tiling.MAX_LOSS_CHUNK_ELEMENTS = max_elements
            manager.destroy()
            set_default_manager(None)
    return out


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
        tp_rank = rank % 2  # DeepSpeed's TP groups are consecutive ranks
        for kind, tied in (("qwen2_tied", True), ("llama_untied", False), ("llama_tied", True)):
            start, rows, vocab = got[kind]["slice"]
            assert got[kind]["head"] == "VocabParallelLinear" and got[kind]["logits"] is None, got[kind]
            assert got[kind]["tied"] is tied and got[kind]["head_split"], got[kind]
            assert vocab == VOCAB and (start == 0) == (tp_rank == 0) and 0 < rows < VOCAB, got[kind]


def test_tiled_loss_refusals_on_split_heads() -> None:
    """What ``refuse_tiled_loss_on_split_head`` (called in ``initialize`` with the head rows read before
    ``deepspeed.initialize``) passes and refuses, on stand-in heads without a process group: DeepSpeed's
    ``VocabParallelLinear`` (``vocab_parallel_lm_head: true``) passes, its rows fewer than before; the same head under
    ZeRO-3 (its weight partitioned, ``ds_id``) is refused by name, since the tiled loss reads the weight outside the
    head's forward, where ZeRO-3 has not gathered it; any other head with fewer rows is refused (fuzzer case
    756378705). Seen failing: the ``ds_id`` test dropped from the refusal (the ZeRO-3 head passed)."""
    import pytest
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
    head.weight.ds_id = 7  # ZeRO-3's partitioned parameter
    with pytest.raises(ConfigError, match=r"tiled_loss reads the LM head's weight outside the head's forward.*lm_head "
                                          r"over the vocabulary under ZeRO-3.*Set tiled_loss false, or use ZeRO stage"):
        refuse_tiled_loss_on_split_head(model, before)
    model.lm_head = torch.nn.Linear(32, VOCAB // 2 + 1, bias=False)  # another split: AutoTP's LinearLayer's rows
    with pytest.raises(ConfigError, match=r"tiled_loss .*AutoTP split over the vocabulary \(lm_head: 27 of its 53 rows"
                                          r".*vocab_parallel_lm_head true"):
        refuse_tiled_loss_on_split_head(model, before)
