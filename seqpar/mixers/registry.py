"""The mixer families seqpar runs sequence-parallel, as the swap sees them.

Each family module (:mod:`seqpar.mixers.short_conv`, ...) defines one
:class:`seqpar.mixers.family.MixerFamily`: how to recognise its layers in a model and how to build the
sequence-parallel drop-in. The swap (:func:`seqpar.swap.swap_attention`, route ``"mixer"``) walks
:data:`FAMILIES`; a family that is not listed stays refused by name by the position-mixing probe
(:mod:`seqpar.swap.probe`).
"""

from __future__ import annotations

from torch import nn

from seqpar.mixers import gdn, lightning, mamba, mamba2, rglru, short_conv
from seqpar.mixers.family import MixerFamily

__all__ = ["FAMILIES", "family_of"]

FAMILIES: tuple[MixerFamily, ...] = (
    short_conv.FAMILY,
    mamba.FAMILY,
    mamba2.FAMILY,
    lightning.FAMILY,
    rglru.FAMILY,
    gdn.FAMILY,
)
"""Every family the swap puts in place, tried in order (the first that matches a module wins)."""


def family_of(module: nn.Module) -> MixerFamily | None:
    """The family ``module`` belongs to, or None when seqpar has no sequence-parallel form of it."""
    return next((family for family in FAMILIES if family.matches(module)), None)
