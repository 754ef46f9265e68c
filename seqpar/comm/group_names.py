"""Process groups by name, for ``torch.library`` custom ops.

A custom op takes tensors and primitives only, never a ``ProcessGroup``. seqpar's custom ops (attention in
:mod:`seqpar.attn.ops`, dilated attention, the mixers' halo exchange) therefore carry a group as its name
(``ProcessGroup.group_name``; ``""`` for no group: one process) and look it up inside the op in torch's
registry of named groups, the one torch's functional collectives use.

Not to be confused with :func:`seqpar.runtime.groups.resolve_group`, the rule behind every ``group=None``
(the default manager's SP group).
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["group_name", "group_by_name"]


def group_name(group: dist.ProcessGroup | None) -> str:
    """The name a custom op carries for ``group`` (``""``: no group, one process)."""
    return "" if group is None else str(group.group_name)


def group_by_name(name: str) -> dist.ProcessGroup | None:
    """The process group named ``name`` (torch's registry of named groups), None for ``""``."""
    if not name:
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)
