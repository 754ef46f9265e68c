"""A misspelt or foreign key in the ``sequence_parallel`` block reads as one sentence naming the key and its fix.

Session 30's and 31's new users reported ``(did you mean 'shardnig' -> 'sharding'?)``: an arrow from the wrong key
to the right one inside a question, read either way round. Now: ``unknown key(s) ['shardnig'] in
sequence_parallel: rename 'shardnig' to 'sharding'; allowed keys are [...]``."""

from __future__ import annotations

import json

import pytest

from seqpar.config import ConfigError, SeqParConfig


def _message(config) -> str:  # noqa: ANN001 - a block, or a path to a JSON file
    with pytest.raises(ConfigError) as info:
        SeqParConfig.load(config)
    return str(info.value)


@pytest.mark.parametrize(("block", "sentence"), [
    ({"size": 2, "shardnig": "zigzag"}, "unknown key(s) ['shardnig'] in sequence_parallel: rename 'shardnig' to "
                                        "'sharding'; allowed keys are ["),
    ({"sp_size": 2}, "unknown key(s) ['sp_size'] in sequence_parallel: rename 'sp_size' to 'size'; allowed keys"),
    ({"size": 2, "moed": "ring", "shardnig": "zigzag"},
     "in sequence_parallel: rename 'moed' to 'mode' and 'shardnig' to 'sharding'; allowed keys are ["),
    ({"size": 2, "dynamic": {"max_token_per_rank": 64}},
     "in sequence_parallel.dynamic: rename 'max_token_per_rank' to 'max_tokens_per_rank'; allowed keys are ["),
])
def test_a_misspelt_key_reads_as_one_sentence_with_its_fix(block, sentence):
    """Seen failing on the old wording: "unknown key(s) ['shardnig'] in sequence_parallel (did you mean
    'shardnig' -> 'sharding'?); allowed keys are [...]"."""
    message = _message(block)
    assert sentence in message, message
    assert "did you mean" not in message and "->" not in message, message


def test_a_misspelt_block_name_is_renamed_and_deepspeeds_keys_are_left_alone(tmp_path):
    """A DeepSpeed JSON whose block name is misspelt: the whole JSON was read as the block, so the fix is the
    block's name; DeepSpeed's own keys (no near name in the block) are not to be removed. Seen failing on the old
    wording ("(did you mean 'sequence_paralel' -> 'sequence_parallel'?)")."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "sequence_paralel": {"size": 2}}))
    message = _message(str(path))
    assert ": rename 'sequence_paralel' to 'sequence_parallel'; allowed keys" in message, message
    assert "remove" not in message, message
