"""The layering rules, checked statically (by AST: nothing is imported).

- The core (``seqpar/``) never imports the engine adapters (``integrations/``, installed as
  ``seqpar.integrations``): not at the top, not inside a function, not through
  ``importlib.import_module("...")`` / ``__import__("...")`` with a string literal.
- ``seqpar/comm`` never imports ``seqpar.attention``; ``seqpar/kernels`` imports neither.
- No module imports another module's private name (``from seqpar.x import _y``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "seqpar"
INTEGRATIONS = ROOT / "integrations"

# (file relative to the repo root, imported module, name) exceptions to the private-import rule: none.
ALLOWED_PRIVATE: set[tuple[str, str, str]] = set()


def _module_name(path: Path) -> str:
    """The dotted name a file is imported under (integrations/ is seqpar.integrations)."""
    if path.is_relative_to(INTEGRATIONS):
        parts = ["seqpar", "integrations", *path.relative_to(INTEGRATIONS).with_suffix("").parts]
    else:
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _resolve(path: Path, here: str, node: ast.ImportFrom) -> str:
    """The absolute module of a ``from ... import`` in module ``here`` (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    package = here.split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(path: Path, here: str | None = None) -> list[tuple[str, str | None, int]]:
    """Every ``(module, imported name or None, line)`` a file imports, wherever the statement is
    (``here``: the file's module name, default from its place in the repository)."""
    here = here if here is not None else _module_name(path)
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[str, str | None, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, None, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = _resolve(path, here, node)
            for alias in node.names:
                found.append((module, alias.name, node.lineno))
                found.append((f"{module}.{alias.name}", None, node.lineno))  # a submodule import
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.append((node.args[0].value, None, node.lineno))
    return found


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if ".venv" not in p.parts)


def _violations(root: Path, forbidden: tuple[str, ...]) -> list[str]:
    return [f"{path.relative_to(ROOT)}:{line} imports {module}"
            for path in _files(root) for module, line in _forbidden(path, None, forbidden)]


def _forbidden(path: Path, here: str | None, forbidden: tuple[str, ...]) -> list[tuple[str, int]]:
    return [(module, line) for module, _, line in imports_of(path, here)
            if any(module == f or module.startswith(f"{f}.") for f in forbidden)]


def test_core_never_imports_integrations():
    assert _violations(CORE, ("integrations", "seqpar.integrations")) == []


def test_comm_never_imports_attention():
    assert _violations(CORE / "comm", ("seqpar.attention",)) == []


def test_kernels_import_neither_comm_nor_attention():
    assert _violations(CORE / "kernels", ("seqpar.attention", "seqpar.comm")) == []


def test_no_private_names_across_modules():
    bad = []
    for path in _files(CORE) + _files(INTEGRATIONS):
        here = _module_name(path)
        for module, name, line in imports_of(path):
            if name is None or not name.startswith("_") or name.startswith("__"):
                continue
            if not module.startswith("seqpar") or module == here:
                continue
            if (str(path.relative_to(ROOT)), module, name) in ALLOWED_PRIVATE:
                continue
            bad.append(f"{path.relative_to(ROOT)}:{line} imports private {module}.{name}")
    assert bad == []


@pytest.mark.parametrize("source,expected", [
    ("import seqpar.integrations.fsdp", "seqpar.integrations.fsdp"),
    ("def f():\n    from seqpar.integrations import deepspeed", "seqpar.integrations.deepspeed"),
    ("import importlib\nimportlib.import_module('seqpar.integrations.apex')", "seqpar.integrations.apex"),
    ("from .. import integrations", "seqpar.integrations"),
])
def test_the_check_sees_every_form_of_import(tmp_path, source, expected):
    """The scanner is not blind: each form of import is found (a check that cannot fail is a defect)."""
    probe = tmp_path / "probe.py"
    probe.write_text(source)
    assert _forbidden(probe, "seqpar.attention.probe", ("integrations", "seqpar.integrations")), (
        imports_of(probe, "seqpar.attention.probe")
    )
    assert any(m == expected for m, _, _ in imports_of(probe, "seqpar.attention.probe"))
