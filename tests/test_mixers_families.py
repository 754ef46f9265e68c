"""Mixer families as data (issue 30 §1), read from seqpar/mixers' source: each shared step is written once, and
no transformers class name is compared in the computation.

- the scalar-decay state-passing step (prefix fold with an elementwise transition, then each chunk's leading-run
  correction) is :func:`seqpar.mixers.state_passing.scalar_decay_correction`, which Mamba, Mamba2 / SSD,
  lightning attention and RG-LRU call;
- the depthwise causal convolution check is :func:`seqpar.mixers.conv.is_causal_depthwise_conv`, called by
  :func:`seqpar.mixers.family.has_mixer_parts` alone (each family's recogniser calls that);
- the ``cu_seqlens`` validation is :func:`seqpar.mixers.scan_layout.shard_boundaries`;
- a family's per-model differences are fields of its spec (one per transformers class), read by one forward:
  no comparison with a class name (nor with ``original_class``), and no comparison with a string constant in a
  swapped layer's methods (what was ``kind == "kda"`` or ``original_class == "FalconH1Mixer"``);
- nor a layout test in their place: no presence test of a model-specific field (``self.n_mamba_heads is not
  None``, Zamba's old branch; ``hasattr(self, "dt_layernorm")``; ``getattr(original, "n_mamba_heads", None)``;
  ``if self.n_mamba_heads:``; ``"n_mamba_heads" in vars(original)``) outside the families' recognisers. A field
  is model-specific when some but not all transformers classes of one family have it (read from transformers'
  own source: what each class stores on ``self``, its methods, the ``config`` fields it reads).

No process group, no model: the source is parsed.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import re
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
    # each family's recogniser checks its parts through the one helper, which holds the one conv check call
    for name in ("gdn.py", "mamba.py", "mamba2.py", "rglru.py", "short_conv.py"):
        assert _calls(_trees()[name], "has_mixer_parts") == 1, name
    users = [name for name, tree in _trees().items() if _calls(tree, "is_causal_depthwise_conv")]
    assert users == ["family.py"], users


def test_one_boundary_validation() -> None:
    found = [p.name for p in MIXERS.glob("*.py") for _ in range(p.read_text().count("must not decrease, running from 0"))]
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


# --------------------------------------------------------------------------- layout tests (model identity by presence)
# Presence tests of model-specific fields that are allowed, each with its reason; each must still be found (a
# stale entry fails), and nothing else may be. They decide no layout: the layout is the spec's.
ALLOWED_PRESENCE = {
    ("mamba.py", "use_mambapy"): "a setting's value with transformers' own default (Zamba's mixer has no "
                                 "use_mambapy and never takes that path); the layout is MambaSpec.multi_head",
    ("mamba.py", "dt_proj_bias"): "an optional bias, inside the branch MambaSpec.multi_head selects",
    ("gdn.py", "fix_query_key_value_ordering"): "Qwen3-Next's own method, taken at construction; whether it is "
                                                "called is DeltaNetSpec.fused",
}


def _transformers_class_defs() -> dict[str, ast.ClassDef]:
    """Each registered transformers class's definition, parsed from its modeling file (found by the longest model
    directory whose name, without underscores, prefixes the class name: ``Zamba2MambaMixer`` -> ``zamba2``)."""
    models = Path(importlib.util.find_spec("transformers").origin).parent / "models"  # source only: no import
    dirs = {d.name.replace("_", ""): d for d in models.iterdir() if d.is_dir()}
    found: dict[str, ast.ClassDef] = {}
    for cls in sorted(_class_names()):
        prefix = max((k for k in dirs if cls.lower().replace("_", "").startswith(k)), key=len, default=None)
        assert prefix is not None, f"no transformers model directory for {cls}"
        for path in sorted(dirs[prefix].glob("modeling_*.py")):
            # the class's own lines only (parsing whole modeling files costs seconds): to the next top-level line
            source = re.search(rf"^class {cls}\b.*?(?=^[^\s#)])", path.read_text() + "\nEND", re.M | re.S)
            if source is not None:
                found[cls] = ast.parse(source.group(0)).body[0]
        assert cls in found, f"{cls} not found in {dirs[prefix]}"
    return found


def _members(cls: ast.ClassDef) -> set[str]:
    """What a transformers class has: attributes it stores on ``self``, its methods, the ``config`` fields it reads."""
    names = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
    for n in ast.walk(cls):
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name):
            if (n.value.id == "self" and isinstance(n.ctx, ast.Store)) or n.value.id == "config":
                names.add(n.attr)
    return names


@functools.lru_cache(maxsize=1)
def _model_specific() -> frozenset[str]:
    """Fields some but not all transformers classes of one family have (the union over the families)."""
    from seqpar.mixers import gdn, lightning, mamba, mamba2, rglru, short_conv

    defs = _transformers_class_defs()
    specific: set[str] = set()
    for classes in (mamba.MAMBA_CLASSES, mamba2.MAMBA2_CLASSES, set(gdn.GDN_CLASSES), short_conv.SHORT_CONV_CLASSES,
                    lightning.LIGHTNING_CLASSES, rglru.RGLRU_CLASSES):
        members = [_members(defs[c]) for c in classes]
        specific |= set().union(*members) - set.intersection(*members)
    return frozenset(specific)


def _reads_spec(node: ast.AST) -> bool:
    """``spec.x`` / ``self.spec.x``: reading the family's spec is the way per-model differences are meant to be read."""
    while isinstance(node, ast.Attribute):
        node = node.value
        if getattr(node, "attr", getattr(node, "id", None)) == "spec":
            return True
    return False


def _presence_tests(tree: ast.Module, specific: frozenset[str]) -> list[tuple[tuple[int, str], str]]:
    """``((line, field), code)`` of every presence test of a field in ``specific``, outside the module-level ``is_*``
    recognisers (which decide whether a layer belongs to a family: the selection, not the computation)."""
    skip = {id(n) for f in tree.body if isinstance(f, ast.FunctionDef) and f.name.startswith("is_") for n in ast.walk(f)}

    def field(node: ast.AST) -> str | None:
        """The model-specific field ``node`` reads by name (``x.n``, ``getattr(x, "n"...)``), else None."""
        if isinstance(node, ast.Attribute) and node.attr in specific and not _reads_spec(node):
            return node.attr
        if (isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr")
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value in specific):
            return node.args[1].value
        return None

    found = []
    for n in ast.walk(tree):
        if id(n) in skip:
            continue
        hits: list[str | None] = []
        if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "hasattr":
            hits.append(field(n))  # hasattr(x, "n")
        elif isinstance(n, ast.Call) and getattr(n.func, "id", None) == "getattr" and len(n.args) == 3:
            hits.append(field(n))  # getattr(x, "n", default): present or not
        elif isinstance(n, ast.Compare):
            operands = [n.left, *n.comparators]
            if any(isinstance(op, (ast.Is, ast.IsNot)) for op in n.ops):  # x.n is (not) None
                hits += [field(o) for o in operands]
            if any(isinstance(op, (ast.In, ast.NotIn)) for op in n.ops):  # "n" in vars(x) / x.__dict__ / dir(x)
                hits += [o.value for o in operands if isinstance(o, ast.Constant) and o.value in specific]
        elif isinstance(n, (ast.If, ast.IfExp, ast.While, ast.Assert)):
            hits.append(field(n.test))  # if x.n: (truthiness)
        elif isinstance(n, ast.BoolOp):
            hits += [field(v) for v in n.values]
        elif isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.Not):
            hits.append(field(n.operand))
        found += [(n.lineno, h, ast.unparse(n)) for h in hits if h is not None]
    return sorted({(line, fld): code for line, fld, code in found}.items())  # once per line and field


def test_no_layout_test_on_a_model_specific_field() -> None:
    specific = _model_specific()
    assert {"n_mamba_heads", "dt_layernorm", "ssm_in_multiplier", "in_proj_qkvz"} <= specific  # the check sees them
    seen, bad = set(), []
    for name, tree in _trees().items():
        for (line, fld), code in _presence_tests(tree, specific):
            if (name, fld) in ALLOWED_PRESENCE:
                seen.add((name, fld))
            else:
                bad.append(f"{name}:{line}: {code} (a presence test of {fld!r}, which only some transformers classes "
                           "have: make the difference a field of the family's spec)")
    assert not bad, "\n".join(bad)
    assert seen == set(ALLOWED_PRESENCE), f"stale ALLOWED_PRESENCE entries: {set(ALLOWED_PRESENCE) - seen}"


@pytest.mark.parametrize("code", [
    "zamba = self.n_mamba_heads is not None",  # the old Zamba branch
    "if hasattr(self, 'dt_layernorm'):\n    pass",
    "heads = getattr(original, 'n_mamba_heads', None)",
    "if self.n_mamba_heads:\n    pass",
    "x = y if not self.ssm_in_multiplier else z",
    "ok = 'in_proj_qkvz' in vars(original)",
    "ok = config.n_mamba_heads is None or flag",
])
def test_the_layout_check_sees_every_form(code: str) -> None:
    tree = ast.parse("class SeqParX(SwappedMixer):\n    def forward(self, original, config, y, z, flag):\n"
                     + "".join(f"        {line}\n" for line in code.splitlines()))
    assert _presence_tests(tree, _model_specific()), code
    # reading the spec, or a field every class has, is no layout test
    fine = ast.parse("if spec.forget_gate is not None and self.spec.multi_head and self.conv1d is not None:\n    pass")
    assert not _presence_tests(fine, _model_specific())
