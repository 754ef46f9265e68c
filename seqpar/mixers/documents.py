"""The running batch's packed-document boundaries, carried to swapped mixers whose caller does not pass them.

Some transformers decoder layers call their mixer with ``hidden_states``, the cache and the attention
mask only (Jamba's ``JambaMambaDecoderLayer``), and some models call their layers with no boundaries at
all (``MambaModel`` calls each ``MambaBlock`` with the hidden states, the cache and the mask), so the
``cu_seq_lens_q`` the model was given never reaches the mixer, and a mixer that cannot see the documents
of a packed batch would carry its state across them.

The boundaries are state of one forward, so they travel with the call, never on a module: activation
checkpointing runs a layer again in the backward with the arguments its forward saved, possibly after
other forwards of other batches (two forwards, then one backward), and only what travels as an argument
is replayed as it was. :func:`feed_documents` does this in three steps:

- a forward pre-hook on the swapped model (after the batch check, which fills in and checks the
  boundaries) holds the batch's boundaries on this thread while the model's forward runs (a forward
  hook that runs even when the forward raises lets them go);
- the class of each mixer's parent layer becomes :class:`DocumentsCarrier` over its own class (the same
  name, the same parameters and state_dict, as FSDP2's ``fully_shard`` does): when the layer is called
  without ``cu_seq_lens_q/k`` of its own, its ``__call__`` adds the held boundaries to the call's keyword
  arguments as :data:`DOCUMENTS_KEY`, before transformers' activation checkpointing (which saves the
  keyword arguments of the layer's call, in every transformers 5.x form) sees them;
- its ``forward`` takes that argument off again (or reads the call's own ``cu_seq_lens_q/k``) and holds
  it while the layer's own forward runs, so the recompute of the layer holds its own forward's
  boundaries.

:meth:`seqpar.mixers.family.SwappedMixer.cu_seqlens` reads its own call's ``cu_seq_lens_q`` when it has
one, else the boundaries its innermost carrier holds (None: one sequence).

Limit: a checkpoint that wraps the layer's ``__call__`` from outside transformers (torch's
``checkpoint_wrapper``, as FSDP's ``apply_activation_checkpointing`` puts in) saves the call's arguments
before the carrier adds the boundaries; it replays them correctly only for a layer whose caller passes
``cu_seq_lens_q`` (every decoder layer of the transformers hybrids, Jamba's included), not for a layer
that gets none (``MambaBlock``): use transformers' ``gradient_checkpointing_enable`` there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor, nn

from seqpar.runtime.thread_state import ThreadState
from seqpar.sequence.call_group import GROUP_KEY

__all__ = ["DOCUMENTS_KEY", "DROPS_DOCUMENTS_ATTR", "DocumentsCarrier", "feed_documents", "carry_to", "with_carried",
           "batch_documents", "carried_documents", "carried_group"]

DOCUMENTS_KEY = "seqpar_documents"
"""The keyword argument a :class:`DocumentsCarrier`'s call carries its batch's boundaries in (taken off
again before the layer's own forward runs)."""

DROPS_DOCUMENTS_ATTR = "_seqpar_layer_drops_documents"
"""Set (True) on a swapped attention module whose parent layer does not pass the model's packed-document
boundaries and SP group on to it (found by :mod:`seqpar.swap.hf_probe`); the parent is then a carrier and
the attention reads them from it (:func:`with_carried`)."""

_HANDLES_ATTR = "_seqpar_documents_feed"
_local = ThreadState(stack=list)  # stack: list[tuple[nn.Module, Tensor | None, Any]], see _held


def _held() -> list[tuple[nn.Module, Tensor | None, Any]]:
    """This thread's stack of ``(holder, boundaries, group)`` (innermost last): the running swapped model's
    batch, then each running carrier's. The group is the call's SP group under dynamic CP
    (:mod:`seqpar.sequence.call_group`; None: the swap's), carried the same way as the boundaries."""
    return _local.stack


def batch_documents(kwargs: dict[str, Any]) -> Any:
    """The packed-document boundaries among a forward's keyword arguments (None: one sequence)."""
    cu = kwargs.get("cu_seq_lens_q")
    return kwargs.get("cu_seq_lens_k") if cu is None else cu


def carried_documents() -> Tensor | None:
    """The boundaries held by the innermost running carrier (or swapped model) on this thread; None
    outside any (one sequence)."""
    stack = _held()
    return stack[-1][1] if stack else None


def carried_group() -> Any:
    """The SP group the innermost running carrier's (or swapped model's) call carries (dynamic CP); None
    outside any, or when the call carries none (the swap's group then)."""
    stack = _held()
    return stack[-1][2] if stack else None


class DocumentsCarrier(nn.Module):
    """Mixed in before the class of a mixer's parent layer (see the module docstring): its call carries
    the held boundaries as :data:`DOCUMENTS_KEY`, and its forward holds them while it runs."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        stack = _held()
        if stack and DOCUMENTS_KEY not in kwargs and (batch_documents(kwargs) is None or GROUP_KEY not in kwargs):
            kwargs[DOCUMENTS_KEY] = stack[-1][1:]  # (boundaries, group)
        return super().__call__(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        carried, held_group = kwargs.pop(DOCUMENTS_KEY, (None, None))
        own, own_group = batch_documents(kwargs), kwargs.get(GROUP_KEY)
        stack = _held()
        stack.append((self, own if own is not None else carried, own_group if own_group is not None else held_group))
        try:
            return super().forward(*args, **kwargs)
        finally:
            stack.pop()


_CARRIERS: dict[type, type] = {}


def _carrier_class(cls: type) -> type:
    """``cls`` with :class:`DocumentsCarrier` mixed in, under the same name (one class per ``cls``).
    transformers' ``GradientCheckpointingLayer`` wraps the new class's ``forward`` (the carrier's) as the
    outermost one, so that its recompute runs the carrier's forward too."""
    if issubclass(cls, DocumentsCarrier):
        return cls
    if cls not in _CARRIERS:
        _CARRIERS[cls] = type(cls.__name__, (DocumentsCarrier, cls),
                              {"__module__": cls.__module__, "__qualname__": cls.__qualname__})
    return _CARRIERS[cls]


def _hold(module: nn.Module, args: tuple, kwargs: dict) -> None:
    _held().append((module, batch_documents(kwargs), kwargs.get(GROUP_KEY)))


def _release(module: nn.Module, args: tuple, output: Any) -> None:
    # runs even when the forward (or an earlier pre-hook) raised: let go only of what _hold took
    stack = _held()
    if stack and stack[-1][0] is module:
        stack.pop()


def feed_documents(model: nn.Module, mixers: Sequence[str], hold: bool = False) -> None:
    """Carry every forward's document boundaries of ``model`` to each of its submodules named in
    ``mixers`` (see the module docstring): their parent layers become carriers, and ``model`` holds its
    batch's boundaries while it runs (replacing the hooks of an earlier swap of the same model, so that
    they run after its batch check). ``hold``: hold them even with no ``mixers`` yet (a model probed at its
    first forward gets its carriers then, :func:`carry_to`). The hooks look nothing up by name: a deep copy
    of the model carries its own batches."""
    for handle in model.__dict__.pop(_HANDLES_ATTR, ()):
        handle.remove()
    carry_to(model, mixers)
    if mixers or hold:
        model.__dict__[_HANDLES_ATTR] = (model.register_forward_pre_hook(_hold, with_kwargs=True),
                                         model.register_forward_hook(_release, always_call=True))


def carry_to(model: nn.Module, modules: Sequence[str]) -> None:
    """Make the parent layer of each submodule of ``model`` named in ``modules`` a carrier, without the
    model-level hold of :func:`feed_documents`: enough for a module whose parent layer is called with the
    boundaries but does not pass them on (Nemotron's and StableLM's decoder layers call their attention
    with the hidden states, mask and positions only), as its carrier holds its own call's."""
    for name in sorted({name.rpartition(".")[0] for name in modules if "." in name}):
        parent = model.get_submodule(name)
        parent.__class__ = _carrier_class(type(parent))


def with_carried(kwargs: dict[str, Any]) -> dict[str, Any]:
    """A mixer call's keyword arguments with what its caller dropped filled in from the innermost carrier:
    the boundaries as ``cu_seq_lens_q/k`` when the call has none, and the call's SP group (dynamic CP) as
    :data:`GROUP_KEY` when it has none. ``kwargs`` itself is not changed."""
    out = dict(kwargs)
    if batch_documents(kwargs) is None and (cu := carried_documents()) is not None:
        out["cu_seq_lens_q"] = out["cu_seq_lens_k"] = cu
    if kwargs.get(GROUP_KEY) is None and (group := carried_group()) is not None:
        out[GROUP_KEY] = group
    return out
