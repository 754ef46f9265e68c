"""What a mixer family tells the swap: how to recognise its layers and build their sequence-parallel form.

Kept apart from :mod:`seqpar.mixers.registry` (which imports every family module) so that a family
module can define its entry without an import cycle.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch.distributed as dist
from torch import Tensor, nn

from seqpar.mixers.conv import causal_conv_shard, is_causal_depthwise_conv
from seqpar.mixers.documents import carried_documents, carried_group
from seqpar.mixers.scan_layout import ScanLayout, scan_layout
from seqpar.runtime.groups import resolve_group

__all__ = ["MixerFamily", "SwappedMixer", "is_transformers_class", "has_mixer_parts"]


def is_transformers_class(module: nn.Module, names: Collection[str]) -> bool:
    """Whether ``module``'s class is one of ``names`` and defined in transformers (not a look-alike of
    the same name elsewhere, nor a swapped layer)."""
    cls = type(module)
    return cls.__name__ in names and cls.__module__.startswith("transformers.")


def has_mixer_parts(module: nn.Module, conv: str, *, linears: Collection[str] = (), parameters: Collection[str] = (),
                    modules: Collection[str] = ()) -> bool:
    """Whether ``module`` has the parts a swapped convolution mixer reads: a causal depthwise ``nn.Conv1d``
    child named ``conv`` (:func:`seqpar.mixers.conv.is_causal_depthwise_conv`), ``nn.Linear`` children
    ``linears``, ``nn.Parameter`` attributes ``parameters`` and ``nn.Module`` children ``modules``."""
    return (is_causal_depthwise_conv(getattr(module, conv, None))
            and all(isinstance(getattr(module, name, None), nn.Linear) for name in linears)
            and all(isinstance(getattr(module, name, None), nn.Parameter) for name in parameters)
            and all(isinstance(getattr(module, name, None), nn.Module) for name in modules))


@dataclass(frozen=True)
class MixerFamily:
    """One family of mixers.

    Attributes:
        name: the family, as reports and errors say it (``"short_conv"``, ``"mamba2"``, ...).
        matches: ``matches(module)``: True for a layer of this family, unswapped (a transformers class
            the family reproduces) or already swapped (swapping again takes new options).
        build: ``build(original, *, group, sharding, position_wise, mixer_kernels) -> nn.Module``: the
            sequence-parallel module made from the original layer (or from an already swapped one).
            ``group`` is the SP group (None: the default manager's), ``sharding`` the layout the model's
            inputs are cut in, and ``position_wise()`` is True while the position-mixing probe runs
            (then only the current position may mix, with no communication; see
            :mod:`seqpar.swap.probe`). ``mixer_kernels``: ``"torch"`` or ``"auto"``
            (:mod:`seqpar.mixers.kernels`).
    """

    name: str
    matches: Callable[[nn.Module], bool]
    build: Callable[..., nn.Module]


class SwappedMixer(nn.Module):
    """What every sequence-parallel mixer layer shares: it takes over a transformers layer.

    The original's parameters, buffers (persistent or not, as they were) and child modules are the
    same objects, registered in the same order: the state_dict is unchanged, and optimizers or engines
    that already hold the parameters keep working. :attr:`COPIED` names the plain attributes a family
    reads (``None`` where the original lacks one); a family whose transformers classes differ by a spec
    names its table in :attr:`SPECS`, and each layer reads its class's as :attr:`spec`. Swapping a swapped
    layer again (new options) keeps the transformers class's name and module.

    Args:
        original: the transformers layer, or a swapped one to re-swap with other options.
        group: the SP group (None: the default manager's).
        sharding: the layout the model's inputs are cut in.
        position_wise: called at each forward; True -> every position alone, no communication (what
            the position-mixing probe runs; see :mod:`seqpar.swap.probe`).
        mixer_kernels: the local scans' kernels, ``"torch"`` (default) or ``"auto"`` (:mod:`seqpar.mixers.kernels`).
    """

    COPIED: ClassVar[tuple[str, ...]] = ("layer_idx",)
    SPECS: ClassVar[Mapping[str, Any] | None] = None
    """transformers class name -> what that class computes its own way (the family's spec table), read by
    the one forward as ``self.spec``; None: the family has none."""

    def __init__(self, original: nn.Module, *, group: dist.ProcessGroup | None, sharding: str,
                 position_wise: Callable[[], bool] = lambda: False, mixer_kernels: str = "torch") -> None:
        super().__init__()
        for name, param in original._parameters.items():
            self.register_parameter(name, param)
        for name, buffer in original._buffers.items():  # e.g. Falcon-H1's mup_vector (not persistent)
            self.register_buffer(name, buffer, persistent=name not in original._non_persistent_buffers_set)
        for name, child in original.named_children():
            self.add_module(name, child)
        for name in self.COPIED:
            setattr(self, name, getattr(original, name, None))
        self.original_class: str = getattr(original, "original_class", type(original).__name__)
        # the transformers module whose functions the layer calls (kernels, padding masks): looked up
        # at each forward, so a kernel swapped in there is used
        self.transformers_module: str = getattr(original, "transformers_module", type(original).__module__)
        self.swap_group = group
        self.sharding = sharding
        self.position_wise = position_wise
        self.mixer_kernels = mixer_kernels
        if self.SPECS is not None:
            self.spec = self.SPECS[self.original_class]
        self.take_over(original)

    def take_over(self, original: nn.Module) -> None:
        """What a family reads from ``original`` beyond :attr:`COPIED` (flags, sizes it derives), called last in
        the constructor, once the parameters, children and copied attributes are this layer's; by default nothing."""

    @property
    def group(self) -> dist.ProcessGroup | None:
        """This call's SP group: the one the parent layer's call carries (dynamic CP: each micro-batch's,
        :mod:`seqpar.mixers.documents`), else the swap's (``swap_group``). Read per call, never stored."""
        group = carried_group()
        return self.swap_group if group is None else group

    def refuse_cache(self, *caches: Any) -> None:
        """Raise for a generation cache: a cache of a sharded sequence would hold one rank's piece."""
        if any(c is not None and c is not False for c in caches):
            layer = "" if getattr(self, "layer_idx", None) is None else f" layer {self.layer_idx}"
            raise ValueError(f"seqpar ({self.original_class}{layer}): a cache is not supported on a sharded "
                             "sequence; call the model with use_cache=False")

    def cu_seqlens(self, kwargs: dict[str, Any]) -> Tensor | None:
        """This call's document boundaries: ``cu_seq_lens_q`` when the caller passes it, else the ones the
        parent layer's call carries (:func:`seqpar.mixers.documents.feed_documents`; None: one document).
        Never read from the module: a recompute under activation checkpointing must see its own call's."""
        cu = kwargs.get("cu_seq_lens_q")
        return carried_documents() if cu is None else cu

    def layout(self, seq_local: int, cu_seqlens: Tensor | None) -> ScanLayout | None:
        """This rank's chunks for the scan (:func:`seqpar.mixers.scan_layout.scan_layout`); None while the
        position-mixing probe runs (every position alone)."""
        if self.position_wise():
            return None
        return scan_layout(seq_local, group=self.group, sharding=self.sharding, cu_seqlens=cu_seqlens,
                           where=f"seqpar ({self.original_class})")

    def open_call(self, hidden_states: Tensor, attention_mask: Tensor | None,
                  kwargs: dict[str, Any]) -> tuple[Tensor, Tensor | None, ScanLayout | None]:
        """The start of a forward that transformers opens with ``apply_mask_to_padding_states`` (Mamba, Mamba2,
        GDN): hidden_states ``(batch, seq_local, hidden)`` with padded positions zeroed by the layer's own
        transformers module, this call's document boundaries (:meth:`cu_seqlens`) and scan layout
        (:meth:`layout`)."""
        tf = sys.modules[self.transformers_module]
        cu = self.cu_seqlens(kwargs)
        hidden_states = tf.apply_mask_to_padding_states(hidden_states, self.padding_mask(attention_mask, hidden_states))
        return hidden_states, cu, self.layout(hidden_states.shape[1], cu)

    def padding_mask(self, attention_mask: Tensor | None, hidden_states: Tensor) -> Tensor | None:
        """``attention_mask`` checked as this rank's shard of a 2D padding mask for ``hidden_states``
        ``(batch, seq_local, ...)``: ``(batch or 1, seq_local)``, zeroing the same positions transformers'
        ``apply_mask_to_padding_states`` zeroes in one process when it is cut as the sequence is. Returned as
        given when it fits (None, masks of other ranks, and the swapped model's own per-shard masks do).

        Raises ValueError for a 2D mask whose length is not ``seq_local``: the whole sequence's mask (a
        layer called directly, outside a swapped model, with the caller's mask) would otherwise fail on a
        broadcast deep in the layer, or, at batch 1 with one rank, be read as another rank's positions."""
        if attention_mask is None or attention_mask.dim() != 2:
            return attention_mask
        seq_local = hidden_states.shape[1]
        if attention_mask.shape[-1] == seq_local and attention_mask.shape[0] in (1, hidden_states.shape[0]):
            return attention_mask
        group = resolve_group(self.group)
        world = 1 if group is None else dist.get_world_size(group)
        rank = 0 if group is None else dist.get_rank(group)
        if attention_mask.shape[-1] == seq_local:
            raise ValueError(
                f"seqpar ({self.original_class}): attention_mask of shape {tuple(attention_mask.shape)} has batch "
                f"{attention_mask.shape[0]}; hidden_states has batch {hidden_states.shape[0]}: pass one mask row per "
                "batch row (or one row for all)")
        whole = (f"; it is the whole sequence's ({seq_local} x {world} SP ranks): pass this rank's shard, "
                 f"seqpar.shard_sequence(attention_mask, 1, sharding={self.sharding!r}, group=<the SP group>), cut as "
                 "hidden_states is") if attention_mask.shape[-1] == seq_local * world and world > 1 else (
                 ": pass this rank's shard of the padding mask, cut as hidden_states is (seqpar.shard_sequence)")
        raise ValueError(
            f"seqpar ({self.original_class}): attention_mask of shape {tuple(attention_mask.shape)} does not match "
            f"hidden_states (batch {hidden_states.shape[0]}, {seq_local} tokens on SP rank {rank} of {world}){whole}")

    def conv_shard(self, conv: nn.Conv1d, x: Tensor, cu_seqlens: Tensor | None) -> Tensor:
        """The layer's causal depthwise ``conv`` (one of its children: ``weight (channels, 1, k)``, optional
        bias) over this rank's shard, equal to the full sequence's (each document's; see
        :func:`seqpar.mixers.conv.causal_conv_shard`): x ``(batch, channels, seq_local)`` -> the same shape,
        no activation, in the dtype the convolution computes in (the caller casts back). While the
        position-mixing probe runs, only the current position's tap and no communication."""
        return causal_conv_shard(x, conv.weight.squeeze(1), conv.bias, group=self.group, sharding=self.sharding,
                                 cu_seqlens=cu_seqlens, position_wise=self.position_wise())

    def extra_repr(self) -> str:
        return f"{self.original_class}, sharding={self.sharding!r}"

    @classmethod
    def family(cls, name: str, is_original: Callable[[nn.Module], bool]) -> MixerFamily:
        """The family's entry for :data:`seqpar.mixers.registry.FAMILIES`: layers of ``is_original`` (or
        already swapped ones) are built as ``cls``."""
        return MixerFamily(name=name, matches=lambda module: isinstance(module, cls) or is_original(module), build=cls)
