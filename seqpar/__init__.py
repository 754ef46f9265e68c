"""seqpar: sequence (context) parallelism for PyTorch training.

The public API is what ``__all__`` lists (docs/getting-started.md has the same list). Tensors
are ``(batch, heads, seq_local, head_dim)`` unless a call says ``layout="bshd"``.

The package reads like its layers, from the edge down:

- ``config``: :class:`SeqParConfig`, the ``sequence_parallel`` block, validated once at the edge.
- ``swap/``: find every token mixer of a model and route it through seqpar, or refuse it by name.
- ``memory/``: tiling, recomputed norms, offload, and the memory estimators.
- ``attn/``: softmax attention across the SP group, one module per algorithm (ring, allgather,
  ulysses, hybrid, dilated); :func:`attention` is its entry.
- ``sequence/``: shard and gather sequences and batches; the SP loss.
- ``comm/``: communicators (ring P2P, collectives, all-to-all, agreement, the loopback ring).
- ``runtime/``: process groups (the SP x DP rank grid and its mesh), liveness, checkpoints.
- ``kernels/``: local block attention -> (out, lse), its backward, the log-sum-exp merge.
- ``testing/`` (the rank-pool harness, traffic counters) serves tests and ``bench/`` only.
- ``seqpar.integrations`` (``integrations/`` in the repository): DeepSpeed, FSDP, FairScale,
  Trainer, accelerate and apex adapters; the core never imports them.

The module paths and top-level names that moved in 0.2 are listed, with their new homes, in
CHANGELOG.md; the old ones no longer import.
"""

from __future__ import annotations

import importlib
from typing import Any

from seqpar.attn.dispatch import attention
from seqpar.config import ConfigError, SeqParConfig
from seqpar.runtime.groups import (
    ProcessGroupManager,
    default_manager,
    destroy_process_groups,
    init_process_groups,
)

__version__ = "0.2.0"

# Resolved on first use, so `import seqpar` stays light (no transformers import, for one).
_LAZY = {
    "dilated_attention": "seqpar.attn.dilated",
    "shard_sequence": "seqpar.sequence.sharding",
    "gather_sequence": "seqpar.sequence.sharding",
    "shard_batch": "seqpar.sequence.batch",
    "ShardedDataLoader": "seqpar.sequence.batch",
    "sequence_parallel_loss": "seqpar.sequence.loss",
    "swap_attention": "seqpar.swap",
    "SwapError": "seqpar.swap",
    "SwapReport": "seqpar.swap",
    "estimate_attention_memory": "seqpar.memory.attention",
    "estimate_training_memory": "seqpar.memory.training",
    "apply_tiling": "seqpar.memory.tiling",
}

__all__ = [
    "attention",
    "dilated_attention",
    "shard_sequence",
    "gather_sequence",
    "shard_batch",
    "ShardedDataLoader",
    "sequence_parallel_loss",
    "SeqParConfig",
    "ConfigError",
    "init_process_groups",
    "destroy_process_groups",
    "ProcessGroupManager",
    "default_manager",
    "swap_attention",
    "SwapError",
    "SwapReport",
    "estimate_attention_memory",
    "estimate_training_memory",
    "apply_tiling",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'seqpar' has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(__all__)
