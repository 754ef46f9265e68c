"""SeqParConfig: loading from dicts, standalone JSON and DeepSpeed JSON; every bad value named."""

from __future__ import annotations

import json

import pytest

from seqpar.config import ConfigError, PatternConfig, SeqParConfig


def test_defaults_and_round_trip() -> None:
    cfg = SeqParConfig()
    assert (cfg.size, cfg.mode, cfg.sharding, cfg.overlap, cfg.check_inputs) == (
        1,
        "ring",
        "contiguous",
        True,
        True,
    )
    again = SeqParConfig.from_dict(cfg.to_dict())
    assert again == cfg
    assert cfg.timeout_s is None  # torch's default
    assert SeqParConfig.from_dict({"timeout_s": 120}).timeout_s == 120


def test_standalone_and_deepspeed_json(tmp_path) -> None:
    block = {
        "size": 2,
        "mode": "allgather",
        "sharding": "zigzag",
        "overlap": False,
        "swap": ["LlamaAttention"],
    }
    standalone = tmp_path / "sp.json"
    standalone.write_text(json.dumps(block))
    ds = tmp_path / "ds.json"
    ds.write_text(
        json.dumps(
            {"train_batch_size": 8, "zero_optimization": {"stage": 2}, "sequence_parallel": block}
        )
    )
    for cfg in (
        SeqParConfig.from_json(standalone),
        SeqParConfig.from_json(ds),
        SeqParConfig.load(str(ds)),
        SeqParConfig.from_deepspeed_config(str(ds)),
        SeqParConfig.load(block),
    ):
        assert (cfg.size, cfg.mode, cfg.sharding, cfg.overlap, cfg.swap) == (
            2,
            "allgather",
            "zigzag",
            False,
            ("LlamaAttention",),
        )
    # a DeepSpeed config without the block keeps working: SP size 1
    assert SeqParConfig.from_deepspeed_config({"train_batch_size": 8}).size == 1


def test_dilated_pattern() -> None:
    cfg = SeqParConfig.from_dict(
        {
            "pattern": {
                "type": "dilated",
                "segment_lengths": [8, 16],
                "dilation_rates": [1, 2],
                "head_layout": "grouped",
            }
        }
    )
    assert cfg.pattern == PatternConfig("dilated", (8, 16), (1, 2), "grouped")


@pytest.mark.parametrize(
    "block, words",
    [
        ({"size": 0}, ["size", "0", "positive"]),
        ({"size": "2"}, ["size", "'2'"]),
        ({"size": True}, ["size", "True"]),
        ({"mode": "tree"}, ["mode", "'tree'", "ring", "allgather", "ulysses", "hybrid", "auto"]),
        ({"sharding": "striped"}, ["sharding", "striped", "contiguous", "zigzag"]),
        ({"overlap": "yes"}, ["overlap", "true or false"]),
        ({"check_inputs": 1}, ["check_inputs", "true or false"]),
        ({"swap": "everything"}, ["swap", "everything", "auto"]),
        ({"swap": []}, ["swap", "non-empty"]),
        ({"swap": 3}, ["swap", "string"]),
        ({"sizee": 2}, ["unknown", "sizee", "allowed keys"]),
        ({"pattern": {"type": "sparse"}}, ["pattern.type", "sparse", "dilated"]),
        (
            {"pattern": {"type": "dilated", "segment_lengths": [8], "dilation_rates": [1, 2]}},
            ["1 entries", "2", "one rate per"],
        ),
        (
            {"pattern": {"type": "dilated", "segment_lengths": [10], "dilation_rates": [4]}},
            ["rate 4", "segment length 10", "multiple"],
        ),
        (
            {"pattern": {"type": "dilated", "segment_lengths": [], "dilation_rates": []}},
            ["segment_lengths", "non-empty"],
        ),
        (
            {"pattern": {"type": "dilated", "segment_lengths": [8], "dilation_rates": [0]}},
            ["dilation_rates", "positive"],
        ),
        (
            {
                "pattern": {
                    "type": "dilated",
                    "segment_lengths": [8],
                    "dilation_rates": [1],
                    "head_layout": "x",
                }
            },
            ["head_layout", "mixed", "grouped"],
        ),
        ({"pattern": {"type": "dense", "segment_lengths": [8]}}, ["dense", "dilated"]),
        ({"pattern": {"type": "dilated", "window": 3}}, ["unknown", "window"]),
        ({"sequence_parallel": 2}, ["sequence_parallel", "object"]),
        ({"sequence_parallel": {"mode": "x"}}, ["mode", "'x'", "ring"]),
        ({"size": -2}, ["size", "-2", "positive"]),
        ({"apex": "no"}, ["apex", "true or false"]),
        ({"sharding": "random"}, ["sharding", "'random'", "balanced"]),
        ({"size": 4, "mode": "hybrid", "ulysses_size": 2, "sharding": "balanced"},
         ["sharding", "'balanced'", "ulysses_size 2", "zigzag"]),
        ({"timeout_s": 0}, ["timeout_s", "0", "positive integer"]),
        ({"timeout_s": 1.5}, ["timeout_s", "1.5", "seconds"]),
        ({"timeout_s": True}, ["timeout_s", "True", "positive"]),
        ({"head_chunks": 0}, ["head_chunks", "0", "positive integer", "auto"]),
        ({"head_chunks": "all"}, ["head_chunks", "'all'", "auto"]),
        ({"head_chunks": True}, ["head_chunks", "True", "auto"]),
        ({"mode": 3}, ["mode", "3", "ring"]),
        ({"swap": ["LlamaAttention", ""]}, ["swap", "non-empty"]),
        ({"pattern": "dense"}, ["pattern", "'dense'", "object"]),
        ({"pattern": {"type": 1}}, ["pattern.type", "string"]),
        (
            {"pattern": {"type": "dilated", "segment_lengths": 8, "dilation_rates": [1]}},
            ["pattern.segment_lengths", "list"],
        ),
        (
            {"pattern": {"type": "dilated", "segment_lengths": [8.0], "dilation_rates": [1]}},
            ["segment_lengths", "positive integer"],
        ),
    ],
)
def test_bad_values_name_key_value_and_allowed(block: dict, words: list[str]) -> None:
    with pytest.raises(ConfigError) as e:
        SeqParConfig.from_dict(block)
    msg = str(e.value)
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"


def test_bad_json_file(tmp_path) -> None:
    p = tmp_path / "broken.json"
    p.write_text('{"size": 2,,}')
    with pytest.raises(ConfigError, match="not valid JSON"):
        SeqParConfig.from_json(p)


def test_replace_revalidates() -> None:
    with pytest.raises(ConfigError, match="mode"):
        SeqParConfig().replace(mode="nope")
    assert SeqParConfig().replace(size=4).size == 4


def test_loaders_accept_what_users_have() -> None:
    assert SeqParConfig.load(None) == SeqParConfig()
    cfg = SeqParConfig(size=2)
    assert SeqParConfig.load(cfg) is cfg
    assert SeqParConfig.from_dict({"sequence_parallel": {"size": 2}, "fp16": {}}).size == 2
    assert SeqParConfig.from_deepspeed_config({"sequence_parallel": {"size": 4}}).size == 4
    with pytest.raises(ConfigError, match="JSON object"):
        SeqParConfig.from_dict([("size", 2)])
