"""The running batch's packed-document boundaries, handed to swapped mixers whose caller does not pass them.

Some transformers decoder layers call their mixer with ``hidden_states``, the cache and the attention
mask only (Jamba's ``JambaMambaDecoderLayer``), so the ``cu_seq_lens_q`` the model was given never
reaches it, and a mixer that cannot see the documents of a packed batch would carry its state across
them. :func:`feed_documents` puts one forward pre-hook on the swapped model (after the batch check, which
fills in and checks the boundaries) that sets each such mixer's ``documents`` attribute to the batch's
boundaries (None: one sequence); the mixer uses the ``cu_seq_lens_q`` of its own call when it has one.

The attribute holds the last batch's boundaries, which is also what an activation-checkpointing
recompute of that batch (in its backward) needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

__all__ = ["DOCUMENTS_ATTR", "feed_documents", "batch_documents"]

DOCUMENTS_ATTR = "documents"
"""The attribute of a swapped mixer that :func:`feed_documents` sets (a mixer declares it to be fed)."""
_HANDLE_ATTR = "_seqpar_documents_feed"


def batch_documents(kwargs: dict[str, Any]) -> Any:
    """The packed-document boundaries among a forward's keyword arguments (None: one sequence)."""
    cu = kwargs.get("cu_seq_lens_q")
    return kwargs.get("cu_seq_lens_k") if cu is None else cu


def feed_documents(model: nn.Module, mixers: Sequence[str]) -> None:
    """Hand every forward's document boundaries of ``model`` to each of its submodules named in ``mixers``
    that declares :data:`DOCUMENTS_ATTR` (replacing a feed installed by an earlier swap of the same model).
    The hook looks the mixers up by name in the module it runs on, so a deep copy of the model feeds its
    own mixers."""
    old = model.__dict__.pop(_HANDLE_ATTR, None)
    if old is not None:
        old.remove()
    fed = tuple(name for name in mixers if hasattr(model.get_submodule(name), DOCUMENTS_ATTR))
    if not fed:
        return

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        cu = batch_documents(kwargs)
        for name in fed:
            setattr(module.get_submodule(name), DOCUMENTS_ATTR, cu)

    model.__dict__[_HANDLE_ATTR] = model.register_forward_pre_hook(hook, with_kwargs=True)
