"""A DeepSpeed Ulysses / ALST user's JSON and arguments given to ``seqpar.integrations.deepspeed.initialize``: a
top-level ``"sequence_parallel_size"`` (instead of seqpar's block, beside it agreeing or disagreeing, beside an alias),
``register_with_transformers``' arguments written as keys (top level, where DeepSpeed ignores them without a word, or in
the block), DeepSpeed's Ulysses ``mpu``, a ``UlyssesSPDataLoaderAdapter`` as ``training_data``: each refused with a
message naming ``sequence_parallel.size`` or the key's seqpar form, before torch.distributed or any engine (no engine
is initialised here); the same message on both ranks of a gloo world of 2. The migrated JSON (the degree in the block,
also as DeepSpeed's own name ``sequence_parallel_size``) reads as seqpar's ``size``."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("deepspeed")

from seqpar.config import ConfigError, SeqParConfig  # noqa: E402
from seqpar.integrations.deepspeed import ULYSSES_KEYS, initialize  # noqa: E402

BASE = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2}


def _refused(config: dict, **kwargs: object) -> str:
    with pytest.raises(ConfigError) as e:
        initialize(model=torch.nn.Linear(2, 2), config=config, **kwargs)
    return str(e.value)


@pytest.mark.parametrize(("block", "words"), [
    (None, ['"sequence_parallel": {"size": 2}', "remove the top-level key"]),
    ({"size": 2}, ["the block already says 2", "remove the top-level key"]),
    ({"size": 4}, ["they disagree (sequence_parallel.size = 4)", "remove the top-level key"]),
    ({"sequence_parallel_size": 4}, ["they disagree (sequence_parallel.sequence_parallel_size = 4)"]),
    ({"size": 2.0}, ["they disagree (sequence_parallel.size = 2.0)"]),
])
def test_a_top_level_sequence_parallel_size_is_refused_naming_seqpars_key(block: dict | None, words: list) -> None:
    config = {**BASE, "sequence_parallel_size": 2, **({} if block is None else {"sequence_parallel": block})}
    message = _refused(config)
    assert "'sequence_parallel_size' = 2 at its top level" in message and "sequence_parallel.size" in message, message
    for w in words:
        assert w in message, (w, message)


@pytest.mark.parametrize("where", ["top", "block"])
def test_register_with_transformers_arguments_as_keys_are_refused_with_seqpars_form(where: str) -> None:
    """At the top level DeepSpeed would ignore them without a word (the run would go on); in the block they got a bare
    "unknown key". Size 1: were one let through, initialize would go on to build a 1-rank engine, not hang."""
    words = {"seq_length_is_variable": "whatever its length", "seq_length": "each batch's length",
             "max_length": "each batch's length", "core_attn_implementation": "swaps the model's attention",
             "micro_batch_size": "train_micro_batch_size_per_gpu", "disable_in_eval": "no such switch"}
    assert set(words) == set(ULYSSES_KEYS)
    for key, word in words.items():
        value = {"seq_length_is_variable": False, "core_attn_implementation": "sdpa"}.get(key, 8)
        config = ({**BASE, key: value, "sequence_parallel": {"size": 1}} if where == "top"
                  else {**BASE, "sequence_parallel": {"size": 1, key: value}})
        message = _refused(config)
        place = "top level" if where == "top" else "sequence_parallel"
        assert f"'{key}' ({place}) is an argument of DeepSpeed's UlyssesSPAttentionHF" in message, message
        assert word in message and "remove it" in message, (key, message)


def test_every_problem_is_named_in_one_message() -> None:
    import deepspeed.runtime.sequence_parallel.parallel_state_sp as ulysses_mpu

    message = _refused({**BASE, "sequence_parallel_size": 2, "seq_length_is_variable": True}, mpu=ulysses_mpu)
    for w in ("'sequence_parallel_size' = 2", "'seq_length_is_variable' (top level)", "mpu= is DeepSpeed Ulysses'",
              "sequence_parallel.size"):
        assert w in message, (w, message)


def test_deepspeeds_ulysses_mpu_and_any_mpu_are_refused_naming_the_block_size() -> None:
    import deepspeed.runtime.sequence_parallel.parallel_state_sp as ulysses_mpu

    message = _refused({**BASE, "sequence_parallel": {"size": 2}}, mpu=ulysses_mpu)
    assert "register_with_transformers" in message and "sequence_parallel.size = 2" in message, message
    message = _refused({**BASE, "sequence_parallel": {"size": 2}}, mpu=object())  # another library's mpu
    assert "do not pass mpu=" in message and "sequence_parallel.size" in message, message


def test_a_ulysses_loader_adapter_as_training_data_is_refused() -> None:
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter

    adapter = object.__new__(UlyssesSPDataLoaderAdapter)  # its constructor needs DeepSpeed's SP group
    # size 1: were it let through, initialize would go on to a 1-rank engine, not wait for a second rank
    message = _refused({**BASE, "sequence_parallel": {"size": 1}}, training_data=adapter)
    assert "UlyssesSPDataLoaderAdapter" in message and "pass the dataset" in message, message
    assert "sequence_parallel.size = 1" in message and "shard_batch" in message, message


def test_the_migrated_block_reads_as_seqpars_size() -> None:
    """The degree moved into the block, under seqpar's name or DeepSpeed's: the same config (what the engine tests
    run exactly), and nothing refused by the Ulysses check."""
    from seqpar.integrations.deepspeed import refuse_deepspeed_ulysses

    ours = SeqParConfig.from_deepspeed_config({**BASE, "sequence_parallel": {"size": 2, "mode": "ulysses"}})
    theirs = {**BASE, "sequence_parallel": {"sequence_parallel_size": 2, "mode": "ulysses"}}
    assert SeqParConfig.from_deepspeed_config(theirs) == ours and ours.size == 2
    refuse_deepspeed_ulysses(theirs)


def _refusal_on_rank(rank: int, world: int) -> str:
    try:
        initialize(model=torch.nn.Linear(2, 2),
                   config={**BASE, "sequence_parallel_size": world, "sequence_parallel": {"size": 1}})
    except ConfigError as e:
        return str(e)
    return "not refused"


def test_every_rank_raises_the_same_refusal(dist_pool) -> None:
    messages = dist_pool.run(2, _refusal_on_rank, timeout=120)
    assert messages[0] == messages[1] and "they disagree (sequence_parallel.size = 1)" in messages[0], messages
