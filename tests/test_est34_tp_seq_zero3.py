"""Audit 18's survivor "the TP-SP hidden gradient not split" (M16: ``hidden_grad=rows * h * e`` for ``// tp_seq``),
shown unreachable by any run (est34).

``_ActivationBytes.hidden_grad`` is read in one place: ``_moments``' ZeRO-3 reduction inside a layer's MLP backward
(``engine == "deepspeed" and sharded``, the overflow's contents traced, not after the MLP). There ``tp_seq`` is the
TP sequence-parallel degree, above 1 only with ``tp_sequence_parallel``, which no DeepSpeed run takes: the launcher
refuses it (``launch/plan.py``'s ``_check_tp_sequence_parallel``, below) and so does seqpar's DeepSpeed
``initialize`` (tests/test_deepspeed_tp.py). On every run that can be measured ``tp_seq`` is 1 there and the mutant's
bytes equal the code's, so no measured case can tell them apart; the estimate still answers such a configuration
(tests/test_tp_memory.py asks it), as a projection no run checks.
"""

from __future__ import annotations

import json

import pytest
from launch_module import train_module

from seqpar.config import ConfigError


def test_the_launcher_refuses_tp_sequence_parallel_under_deepspeed(tmp_path) -> None:  # noqa: ANN001
    """``--validate-only`` on a ZeRO-3 config with ``tp_size`` 2 and ``tp_sequence_parallel``: a ConfigError naming
    the key and the FSDP engine, before any process group.

    Seen failing: with the launcher's check removed (``_check_tp_sequence_parallel`` returning at once) the config
    validates (``main`` returns ``{}``): DID NOT RAISE."""
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 0.003}}, "zero_optimization": {"stage": 3},
           "sequence_parallel": {"size": 1, "tp_size": 2, "tp_sequence_parallel": True},
           "model": {"hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "vocab_size": 256}}
    path = tmp_path / "ds3_tpsp.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"tp_sequence_parallel runs on the FSDP engine"):
        train_module().main(["--config", str(path), "--validate-only"])
