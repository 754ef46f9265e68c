"""session 33's mixer helpers at their edges (audit 34): ``optional_kernel`` falls back to the torch path (None) when
the optional package imports but lacks the kernel's name (an older or newer release), as when it does not import;
``has_mixer_parts`` requires every part it is given, the ``modules=`` children (GDN's, RG-LRU's) and the
``linears=`` too, so a module missing one is not swapped as a mixer (whose forward would then fail on it).

Seen failing (mut34): X1 (``except ImportError`` only) -> AttributeError "module 'math' has no attribute
'no_such_kernel'"; X3 (``modules=`` not checked) -> a module without its ``rg_lru`` child matched; X4 (``linears=``
not checked) -> a module without its ``in_proj`` matched.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from seqpar.mixers.family import has_mixer_parts
from seqpar.mixers.kernels import optional_kernel

CPU = torch.device("cpu")


def test_optional_kernel_falls_back_where_the_package_lacks_the_name() -> None:
    assert optional_kernel("auto", CPU, ("cpu",), "math", "sqrt") is math.sqrt
    assert optional_kernel("auto", CPU, ("cpu",), "math", "no_such_kernel") is None
    assert optional_kernel("auto", CPU, ("cpu",), "no_such_package_seqpar_audit34", "kernel") is None
    assert optional_kernel("torch", CPU, ("cpu",), "math", "sqrt") is None
    assert optional_kernel("auto", CPU, ("cuda",), "math", "sqrt") is None


class _Mixer(nn.Module):
    def __init__(self, *, in_proj: bool = True, inner: bool = True, a_log: bool = True) -> None:
        super().__init__()
        self.conv1d = nn.Conv1d(8, 8, 4, groups=8, padding=3)
        if in_proj:
            self.in_proj = nn.Linear(8, 16)
        if inner:
            self.rg_lru = nn.Module()
        if a_log:
            self.A_log = nn.Parameter(torch.zeros(8))


def test_has_mixer_parts_requires_every_part_given() -> None:
    parts = {"linears": ("in_proj",), "parameters": ("A_log",), "modules": ("rg_lru",)}
    assert has_mixer_parts(_Mixer(), "conv1d", **parts)
    assert not has_mixer_parts(_Mixer(inner=False), "conv1d", **parts), "a module without its rg_lru child matched"
    assert not has_mixer_parts(_Mixer(in_proj=False), "conv1d", **parts), "a module without its in_proj matched"
    assert not has_mixer_parts(_Mixer(a_log=False), "conv1d", **parts), "a module without A_log matched"
    assert not has_mixer_parts(_Mixer(), "conv", **parts), "a module without the named conv matched"
    plain = _Mixer()
    plain.conv1d = nn.Conv1d(8, 8, 4, padding=3)  # not depthwise
    assert not has_mixer_parts(plain, "conv1d", **parts)
