"""seqpar: sequence (context) parallelism for PyTorch training.

The public API is what ``__all__`` lists (README's "Use it from Python" has the same list). Tensors
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

Old module paths (``seqpar.data``, ``seqpar.loss``, ``seqpar.sharding``, ``seqpar.training_memory``,
``seqpar.attention.<algorithm>``, ...) still import, with a ``DeprecationWarning``; they go in 0.3.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from typing import Any

from seqpar.attn.dispatch import attention
from seqpar.config import ConfigError, SeqParConfig
from seqpar.runtime.groups import (
    ProcessGroupManager,
    default_manager,
    destroy_process_groups,
    init_process_groups,
)

__version__ = "0.1.0"

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

# Names that were top-level before 0.2: still reachable as seqpar.<name>, with a DeprecationWarning
# that names their home. Removed in 0.3.
_MOVED_NAMES = {
    "PatternConfig": "seqpar.config",
    "shard_index": "seqpar.sequence.sharding",
    "pad_to_multiple": "seqpar.sequence.sharding",
    "set_default_manager": "seqpar.runtime.groups",
    "resolve_group": "seqpar.runtime.groups",
    "SeqParMultiheadAttention": "seqpar.swap",
    "sequence_parallel_causal_lm_loss": "seqpar.sequence.loss",
    "sequence_parallel_mean": "seqpar.sequence.loss",
}
_RENAMED = {"estimate_memory": ("seqpar.memory.attention", "estimate_attention_memory")}

# Module paths that were files before 0.2. Each is an import alias of its new module (not a file,
# so the package root stays small), warning on import. Removed in 0.3.
_MOVED_MODULES = {
    "seqpar.data": "seqpar.sequence.batch",
    "seqpar.loss": "seqpar.sequence.loss",
    "seqpar.sharding": "seqpar.sequence.sharding",
    "seqpar.training_memory": "seqpar.memory.training",
    "seqpar.memtrack": "seqpar.memory.tracker",
    "seqpar.groups": "seqpar.runtime.groups",
    "seqpar.liveness": "seqpar.runtime.liveness",
    "seqpar.checkpoint": "seqpar.runtime.checkpoint",
    "seqpar.costmodel": "seqpar.attn.choose",
    "seqpar.tiling": "seqpar.memory.tiling",
    "seqpar.norm": "seqpar.memory.norm",
    "seqpar.offload": "seqpar.memory.offload",
    "seqpar.ranks": "seqpar.testing.ranks",
    **{f"seqpar.attention.{name}": f"seqpar.attn.{name}" for name in (
        "allgather", "checks", "common", "dilated", "hybrid", "masks", "plan", "ring", "ulysses")},
}


class _MovedModuleLoader(importlib.abc.Loader):
    """Imports the new module and puts it in ``sys.modules`` under the old name as well: the import
    system reads the module back from ``sys.modules`` after ``exec_module``, so the old name *is* the
    new module (one module object, no copy of its state)."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        old = module.__name__
        new = _MOVED_MODULES[old]
        warnings.warn(f"{old} moved to {new}; the old path goes in seqpar 0.3", DeprecationWarning, stacklevel=2)
        sys.modules[old] = importlib.import_module(new)


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname in _MOVED_MODULES:
            return importlib.machinery.ModuleSpec(fullname, _MovedModuleLoader())
        return None


def _install_moved_modules() -> None:
    if not any(isinstance(f, _MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedModuleFinder())
    # `seqpar.attention` is the function; `from seqpar.attention.ring import X` still needs a parent
    # package of that name in sys.modules, or the import system would replace the function with it.
    if "seqpar.attention" not in sys.modules:
        parent = types.ModuleType("seqpar.attention", "Deprecated: the algorithms live in seqpar.attn.")
        parent.__path__ = []  # a package, whose submodules come from _MovedModuleFinder
        sys.modules["seqpar.attention"] = parent


_install_moved_modules()


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    if name in _MOVED_NAMES or name in _RENAMED:
        module, new = _RENAMED.get(name, (_MOVED_NAMES.get(name), name))
        warnings.warn(f"seqpar.{name} is not public API any more: use {module}.{new} (seqpar.{name} goes in 0.3)",
                      DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(module), new)
    raise AttributeError(f"module 'seqpar' has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(__all__)
