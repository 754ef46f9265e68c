"""README.md and the user guide (docs/) name things that exist (issue 30 §5).

``mkdocs build --strict`` (CI's docs stage, .ci/docs) checks the site's own links and the API reference;
these checks need no mkdocs and run in the main suite: every dotted ``seqpar.*`` name written in backticks
is a module of the source tree or a name it defines (read with ``ast``, nothing imported), every repository path written in backticks exists, every relative
link of README.md reaches a file, and README stays a front page (at most about 150 lines).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# Names the pages mention as gone (the 0.1 module paths that 0.2.0 removed; CHANGELOG.md lists them all).
REMOVED = {"seqpar.data", "seqpar.groups", "seqpar.attention.ring"}

NAME = re.compile(r"`((?:seqpar)(?:\.\w+)+)")
PATH = re.compile(r"`((?:seqpar|tests|launch|configs|integrations|bench|\.ci)/[\w/.\-]*\w)")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _module_file(parts: list[str]) -> Path | None:
    """The source file of module ``seqpar.<parts>`` (``seqpar.integrations`` is ``integrations/``)."""
    base = ROOT / ("integrations" if parts[:2] == ["seqpar", "integrations"] else "seqpar")
    rest = parts[2:] if parts[:2] == ["seqpar", "integrations"] else parts[1:]
    path = base.joinpath(*rest)
    if path.with_suffix(".py").is_file():
        return path.with_suffix(".py")
    if (path / "__init__.py").is_file():
        return path / "__init__.py"
    return None


def _names(body: list[ast.stmt]) -> set[str]:
    """Names a module or class body defines: functions, classes, assignments, imports, ``__all__`` entries."""
    names: set[str] = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets) and node.value is not None:
                names.update(e.value for e in getattr(node.value, "elts", []) if isinstance(e, ast.Constant))
        elif isinstance(node, (ast.If, ast.Try)):  # optional imports
            names |= _names(node.body + getattr(node, "orelse", []) + getattr(node, "finalbody", []))
            for handler in getattr(node, "handlers", []):
                names |= _names(handler.body)
    return names


def _resolve(dotted: str) -> str | None:
    """None if ``dotted`` is a module of the source tree or a name one defines (read statically: no
    imports, so the check is fast and needs no optional package); else what is missing."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        path = _module_file(parts[:i])
        if path is None:
            continue
        if i == len(parts):
            return None
        tree = ast.parse(path.read_text())
        if parts[i] not in _names(tree.body):
            return f"{path.relative_to(ROOT)} defines no {parts[i]!r}"
        cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == parts[i]), None)
        if cls is not None and i + 1 < len(parts) and parts[i + 1] not in _names(cls.body):
            return f"class {parts[i]} in {path.relative_to(ROOT)} defines no {parts[i + 1]!r}"
        return None
    return "no module"


def test_the_guide_has_its_pages() -> None:
    names = {p.name for p in PAGES}
    for page in ("index.md", "getting-started.md", "concepts.md", "integrations.md", "models.md", "performance.md",
                 "reliability.md", "testing.md", "gpu-runbook.md", "names.md", "reference.md"):
        assert page in names, f"docs/{page} is missing"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_seqpar_name_resolves(page: Path) -> None:
    names = sorted(set(NAME.findall(page.read_text())) - REMOVED)
    missing = {n: why for n in names if (why := _resolve(n)) is not None}
    assert not missing, f"{page.relative_to(ROOT)} names what does not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_repository_path_exists(page: Path) -> None:
    paths = sorted(set(PATH.findall(page.read_text())))
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, f"{page.relative_to(ROOT)} names paths that do not exist: {missing}"


def test_readme_links_reach_files() -> None:
    links = [u for u in LINK.findall((ROOT / "README.md").read_text()) if "://" not in u]
    assert links, "README.md links nowhere: it should point at docs/"
    missing = [u for u in links if not (ROOT / u).exists()]
    assert not missing, f"README.md links to missing files: {missing}"


def test_readme_is_a_front_page() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines: move the detail into docs/ (at most about 150)"
