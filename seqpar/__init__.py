"""seqpar: sequence (context) parallelism for PyTorch training.

Public API (layouts are ``(batch, heads, seq_local, head_dim)``):

- ``attention(q, k, v, *, causal, scale, mode, group, sharding)``: exact attention across the SP group.
- ``dilated_attention(...)``: LongNet dilated attention, distributed the same way.
- ``shard_sequence`` / ``gather_sequence``: cut a full tensor into this rank's part and back.
- ``SeqParConfig``: the validated ``sequence_parallel`` config block.
- ``init_process_groups(...)`` -> ``ProcessGroupManager`` (SP x DP groups, a DeepSpeed/Megatron ``mpu``).
- ``swap_attention(model, config)``: route an existing model's attention through seqpar.
- ``estimate_training_memory(model_config, *, seq_len, sp_size, ...)``: per-rank bytes of a training
  step by category (``seqpar.training_memory``).

``seqpar.attention`` is both the package of attention algorithms (``seqpar.attention.ring``, ...) and
callable as the function above.
"""

from __future__ import annotations

import importlib
from typing import Any

from seqpar import attention  # the package is callable: seqpar.attention(q, k, v, ...)
from seqpar.config import ConfigError, PatternConfig, SeqParConfig
from seqpar.groups import (
    ProcessGroupManager,
    default_manager,
    destroy_process_groups,
    init_process_groups,
)

__version__ = "0.1.0"

# Resolved on first use, so `import seqpar` stays light (no transformers import, for one).
_LAZY = {
    "shard_sequence": "seqpar.sharding",
    "gather_sequence": "seqpar.sharding",
    "shard_index": "seqpar.sharding",
    "pad_to_multiple": "seqpar.sharding",
    "set_default_manager": "seqpar.groups",
    "resolve_group": "seqpar.groups",
    "dilated_attention": "seqpar.attention.dilated",
    "swap_attention": "seqpar.swap",
    "SwapReport": "seqpar.swap",
    "SwapError": "seqpar.swap",
    "SeqParMultiheadAttention": "seqpar.swap",
    "shard_batch": "seqpar.data",
    "ShardedDataLoader": "seqpar.data",
    "sequence_parallel_loss": "seqpar.loss",
    "sequence_parallel_causal_lm_loss": "seqpar.loss",
    "sequence_parallel_mean": "seqpar.loss",
    "estimate_memory": "seqpar.memory",
    "estimate_training_memory": "seqpar.training_memory",
    "apply_tiling": "seqpar.tiling",
}

__all__ = [
    "attention",
    "ConfigError",
    "PatternConfig",
    "SeqParConfig",
    "ProcessGroupManager",
    "default_manager",
    "init_process_groups",
    "destroy_process_groups",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'seqpar' has no attribute {name!r}")
