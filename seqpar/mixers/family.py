"""What a mixer family tells the swap: how to recognise its layers and build their sequence-parallel form.

Kept apart from :mod:`seqpar.mixers.registry` (which imports every family module) so that a family
module can define its entry without an import cycle.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

__all__ = ["MixerFamily"]


@dataclass(frozen=True)
class MixerFamily:
    """One family of mixers.

    Attributes:
        name: the family, as reports and errors say it (``"short_conv"``, ``"mamba2"``, ...).
        matches: ``matches(module)``: True for a layer of this family, unswapped (a transformers class
            the family reproduces) or already swapped (swapping again takes new options).
        build: ``build(original, *, group, sharding, position_wise) -> nn.Module``: the
            sequence-parallel module made from the original layer (or from an already swapped one).
            ``group`` is the SP group (None: the default manager's), ``sharding`` the layout the model's
            inputs are cut in, and ``position_wise()`` is True while the position-mixing probe runs
            (then only the current position may mix, with no communication; see
            :mod:`seqpar.swap.probe`).
    """

    name: str
    matches: Callable[[nn.Module], bool]
    build: Callable[..., nn.Module]
