"""Mutation audit 24 (session 23's AutoTP refusals): the cases the existing tests left open.

Config-only refusals run before any process group (so every rank raises alike); nothing here spawns processes.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist
from test_deepspeed_tp import SP, ds_tp_config


def test_tp_loss_parallel_true_is_refused_under_autotp_at_every_sp_size() -> None:
    """``sequence_parallel.tp_loss_parallel: true`` under DeepSpeed AutoTP is refused whatever the SP size: AutoTP
    gives every TP rank the whole logits, so at SP 1 the key would be silently ignored as much as at SP 2; "auto"
    and false are accepted there (the config check alone: an SP 1 x TP 2 run needs 2 processes).
    Seen failing: the refusal narrowed to ``tp_loss_parallel is True and sp_config.size > 1`` (SP 1 ran without
    the vocab-split logits it asked for, nothing raised)."""
    from seqpar.config import ConfigError, SeqParConfig
    from seqpar.integrations.deepspeed import _check_compatible

    sp1 = {**SP, "size": 1, "mode": "auto"}
    sp1.pop("sharding")
    config = {**ds_tp_config(1), "sequence_parallel": sp1}
    # _check_compatible is initialize's first step (test_deepspeed_tp checks that wiring at SP 2); called here
    # directly, as a mutant that lets SP 1 through would wait for a second process in initialize instead of failing
    with pytest.raises(ConfigError, match=r"tp_loss_parallel = true .*AutoTP gives every TP rank the whole logits"):
        _check_compatible(config, SeqParConfig.from_dict({**sp1, "tp_loss_parallel": True}), None, None)
    assert not dist.is_initialized()
    for setting in ("auto", False):
        _check_compatible(config, SeqParConfig.from_dict({**sp1, "tp_loss_parallel": setting}), None, None)
