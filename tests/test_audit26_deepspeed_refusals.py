"""``refuse_unsplittable_tied_embedding`` (seqpar.integrations.deepspeed_tp) asked directly, in one process, before
any engine: a Gemma head tied to its scaled embedding with ``vocab_parallel_lm_head: true`` is refused by name; the
same model untied, or the key unset / false, is not (DeepSpeed then keeps a tied head whole, or splits an untied
head alone, leaving the embedding's own forward). The end-to-end path is tests/test_deepspeed_tp.py's
``test_vocab_split_head_types_deepspeed_breaks_are_exact_or_refused_by_name`` (4 ranks under DeepSpeed)."""

from __future__ import annotations

import pytest

pytest.importorskip("deepspeed")


def _gemma(tied: bool):  # noqa: ANN202
    import transformers

    cfg = transformers.GemmaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                   max_position_embeddings=32, tie_word_embeddings=tied)
    return transformers.GemmaForCausalLM(cfg)


def test_a_tied_scaled_embedding_is_refused_only_when_the_head_would_be_split() -> None:
    """Tied Gemma with ``vocab_parallel_lm_head: true``: ``ConfigError`` naming the key, the embedding type and the
    fix; untied Gemma (true), tied Gemma with the key false or unset: nothing raised.

    Seen failing: the key's test inverted (``is not True`` -> ``is not False``: never checked); the tie's test
    inverted (``is not`` -> ``is``: the tied model let through, DeepSpeed's bare ``NotImplementedError`` later, and
    the untied one refused)."""
    from seqpar.config import ConfigError
    from seqpar.integrations.deepspeed_tp import refuse_unsplittable_tied_embedding

    on = {"tensor_parallel": {"autotp_size": 2, "vocab_parallel_lm_head": True}}
    with pytest.raises(ConfigError) as e:
        refuse_unsplittable_tied_embedding(_gemma(True), on)
    for word in ("vocab_parallel_lm_head", "GemmaTextScaledWordEmbedding", "false"):
        assert word in str(e.value), (word, str(e.value))
    refuse_unsplittable_tied_embedding(_gemma(False), on)
    for config in ({"tensor_parallel": {"autotp_size": 2, "vocab_parallel_lm_head": False}},
                   {"tensor_parallel": {"autotp_size": 2}}, {}):
        refuse_unsplittable_tied_embedding(_gemma(True), config)
