"""Mixer families as data (issue 30 §1), read from seqpar/mixers' source: each shared step is written once, and
no transformers class name is compared in the computation.

- the scalar-decay state-passing step (prefix fold with an elementwise transition, then each chunk's leading-run
  correction) is :func:`seqpar.mixers.state_passing.scalar_decay_correction`, which Mamba, Mamba2 / SSD,
  lightning attention and RG-LRU call;
- the depthwise causal convolution check is :func:`seqpar.mixers.conv.is_causal_depthwise_conv`;
- the ``cu_seqlens`` validation is :func:`seqpar.mixers.scan_layout.shard_boundaries`;
- a family's per-model differences are fields of its spec (one per transformers class), read by one forward:
  no comparison with a class name (nor with ``original_class``), and no comparison with a string constant in a
  swapped layer's methods (what was ``kind == "kda"`` or ``original_class == "FalconH1Mixer"``).

No process group, no model: the source is parsed.
"""

from __future__ import annotations

import ast
import functools
import importlib
from pathlib import Path

import pytest

import seqpar.mixers

MIXERS = Path(seqpar.mixers.__file__).parent
SCALAR_DECAY = ("ssd.py", "mamba.py", "lightning.py", "rglru.py")


@functools.lru_cache(maxsize=1)
def _trees() -> dict[str, ast.Module]:
    return {p.name: ast.parse(p.read_text(), filename=str(p)) for p in sorted(MIXERS.glob("*.py"))}


def _calls(tree: ast.AST, name: str) -> int:
    """Calls of ``name`` (a plain name or an attribute) in ``tree``."""
    return sum(isinstance(n, ast.Call) and (getattr(n.func, "id", None) == name or getattr(n.func, "attr", None) == name)
               for n in ast.walk(tree))


def _class_names() -> set[str]:
    """Every transformers class a mixer family recognises (the registries' keys)."""
    from seqpar.mixers import gdn, lightning, mamba, mamba2, rglru, short_conv

    return {*mamba.MAMBA_CLASSES, *mamba2.MAMBA2_CLASSES, *gdn.GDN_CLASSES, *short_conv.SHORT_CONV_CLASSES,
            *lightning.LIGHTNING_CLASSES, *rglru.RGLRU_CLASSES}


def test_one_scalar_decay_state_passing_step() -> None:
    trees = _trees()
    # the elementwise transition and the leading-run loop (layout.lead) live in state_passing only
    products = {name for name, tree in trees.items() for n in ast.walk(tree)
                if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mult)
                and {getattr(n.left, "id", None), getattr(n.right, "id", None)} == {"transition", "state"}}
    assert products == {"state_passing.py"}, products
    leads = {name for name, tree in trees.items() if _calls(tree, "lead")}
    assert leads == {"state_passing.py"}, leads
    for name in SCALAR_DECAY:
        assert _calls(trees[name], "scalar_decay_correction") == 1, name
        assert not _calls(trees[name], "chunk_initial_states"), name


def test_one_depthwise_conv_check() -> None:
    checks = [name for name, tree in _trees().items() for n in ast.walk(tree)
              if isinstance(n, ast.Compare) and getattr(n.left, "attr", None) == "groups"]
    assert checks == ["conv.py"], checks
    for name in ("gdn.py", "mamba.py", "mamba2.py", "rglru.py", "short_conv.py"):
        assert _calls(_trees()[name], "is_causal_depthwise_conv") == 1, name


def test_one_boundary_validation() -> None:
    found = [p.name for p in MIXERS.glob("*.py") for _ in range(p.read_text().count("must be strictly increasing"))]
    assert found == ["scan_layout.py"], found
    for name in ("conv.py", "scan_layout.py"):
        assert _calls(_trees()[name], "shard_boundaries") == 1, name


def test_no_class_name_compared_in_the_computation() -> None:
    classes = _class_names()
    bad = []
    for name, tree in _trees().items():
        swapped = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)
                   and any(getattr(b, "id", None) == "SwappedMixer" for b in n.bases)]
        in_layers = {id(n) for cls in swapped for n in ast.walk(cls)}
        for n in ast.walk(tree):
            if not isinstance(n, ast.Compare):
                continue
            operands = [n.left, *n.comparators]
            strings = [o.value for o in operands if isinstance(o, ast.Constant) and isinstance(o.value, str)]
            where = f"{name}:{n.lineno}: {ast.unparse(n)}"
            if any(s in classes for s in strings):
                bad.append(f"{where} (a transformers class name)")
            elif any(getattr(o, "attr", None) == "original_class" for o in operands):
                bad.append(f"{where} (original_class)")
            elif strings and id(n) in in_layers:
                bad.append(f"{where} (a string constant in a swapped layer: make it a field of the family's spec)")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("module,classes,specs", [("mamba", "MAMBA_CLASSES", "MAMBA_SPECS"),
                                                  ("mamba2", "MAMBA2_CLASSES", "MAMBA2_SPECS"),
                                                  ("gdn", "GDN_CLASSES", "GDN_SPECS")])
def test_one_spec_per_transformers_class(module: str, classes: str, specs: str) -> None:
    family = importlib.import_module(f"seqpar.mixers.{module}")
    assert set(getattr(family, specs)) == set(getattr(family, classes))
