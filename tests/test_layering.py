"""The layering rules, checked statically (by AST: nothing is imported).

- The core (``seqpar/``) never imports the engine adapters (``integrations/``, installed as
  ``seqpar.integrations``): not at the top, not inside a function, not through
  ``importlib.import_module("...")`` / ``__import__("...")`` / ``importlib.util.find_spec("...")`` (which
  imports the parent packages) with a string literal. The composition fuzzer's engine cases reach the
  adapters the other way round: ``integrations/fuzz_engine.py`` registers itself under the entry-point group
  ``seqpar.fuzz_engines`` (setup.cfg) and the harness loads whatever is registered there.
- No import cycles among the modules of ``seqpar/`` and ``integrations/``. Every import statement is an
  edge wherever it sits (top level, ``if TYPE_CHECKING:``, inside a function, an ``import_module`` /
  ``__import__`` string literal); importing a package is an edge to its ``__init__``; a module importing
  its own parent package is not an edge (the parent runs first anyway).
- ``seqpar/comm`` never imports ``seqpar.attn``; ``seqpar/kernels`` imports neither ``seqpar.attn`` nor
  ``seqpar.comm``; ``seqpar/runtime`` imports none of ``seqpar.attn``, ``seqpar.sequence``,
  ``seqpar.memory``, ``seqpar.swap`` (the old path ``seqpar.attention`` counts as ``seqpar.attn``).
- Only ``seqpar/testing`` and ``seqpar/bench`` import ``seqpar.testing`` (the harness stays out of the library).
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
            if name in ("import_module", "__import__", "find_spec") and isinstance(node.args[0].value, str):
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


ATTN = ("seqpar.attn", "seqpar.attention")  # seqpar.attention.<algorithm>: the old path of seqpar.attn.<algorithm>


def test_comm_never_imports_attn():
    assert _violations(CORE / "comm", ATTN) == []


def test_kernels_import_neither_comm_nor_attn():
    assert _violations(CORE / "kernels", (*ATTN, "seqpar.comm")) == []


def test_runtime_imports_no_upper_layer():
    """The process groups sit under everything: they know nothing of attention, sequences, memory or the swap."""
    found = _violations(CORE / "runtime", (*ATTN, "seqpar.sequence", "seqpar.memory", "seqpar.swap"))
    assert found == [], "\n".join(found)


def _library_modules() -> dict[str, Path]:
    return {_module_name(path): path for path in _files(CORE) + _files(INTEGRATIONS)}


def _testing_violations(modules: dict[str, Path]) -> list[str]:
    """Modules outside ``seqpar.testing`` and ``seqpar.bench`` that import ``seqpar.testing``."""
    return [f"{here}:{line} imports {module}" for here, path in sorted(modules.items())
            if not any(here == p or here.startswith(f"{p}.") for p in ("seqpar.testing", "seqpar.bench"))
            for module, line in _forbidden(path, here, ("seqpar.testing",))]


def test_only_testing_and_bench_import_the_harness():
    assert _testing_violations(_library_modules()) == []


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """``{module: modules it imports}`` among ``modules`` (``{dotted name: file}``).

    ``from X import name`` is an edge to ``X.name`` when that is a module, else to ``X`` (the package's
    ``__init__`` when X is a package); ``import X.Y`` is an edge to ``X.Y``. An edge to a package that
    contains the importing module is dropped: its ``__init__`` has run before the module does."""
    graph: dict[str, set[str]] = {}
    for here, path in modules.items():
        edges = graph.setdefault(here, set())
        for module, name, _ in imports_of(path, here):
            if name is not None and f"{module}.{name}" in modules:
                continue  # a submodule: its own (module.name, None) entry is the edge
            if module not in modules or module == here or here.startswith(f"{module}."):
                continue
            edges.add(module)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One shortest cycle per strongly connected component of more than one module, each as its modules
    in import order, starting from the alphabetically first (Tarjan's algorithm, then a BFS)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    cycles = []
    for component in components:
        start = min(component)
        paths = {start: [start]}
        frontier = [start]
        while frontier:  # BFS inside the component back to the start
            nxt = []
            for v in frontier:
                for w in sorted(graph[v] & component):
                    if w == start:
                        cycles.append(paths[v])
                        nxt = []
                        break
                    if w not in paths:
                        paths[w] = paths[v] + [w]
                        nxt.append(w)
                else:
                    continue
                break
            frontier = nxt
    return sorted(cycles)


def _describe(cycles: list[list[str]]) -> str:
    return "import cycles:\n" + "\n".join("  " + " -> ".join(c + c[:1]) for c in cycles)


def test_no_import_cycles():
    cycles = find_cycles(import_graph(_library_modules()))
    assert cycles == [], _describe(cycles)


def test_no_private_names_across_modules():
    """The library, the engine adapters, the launchers and the benchmark scripts import no private seqpar name.
    Seen failing: bench/scripts/calibration_attribution.py importing seqpar.bench.dynamic._documents (before
    launch/ and bench/ were scanned it passed)."""
    bad = []
    for path in _files(CORE) + _files(INTEGRATIONS) + _files(ROOT / "launch") + _files(ROOT / "bench"):
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
    ("import importlib.util\nimportlib.util.find_spec('seqpar.integrations')", "seqpar.integrations"),
])
def test_the_check_sees_every_form_of_import(tmp_path, source, expected):
    """The scanner is not blind: each form of import is found (a check that cannot fail is a defect)."""
    probe = tmp_path / "probe.py"
    probe.write_text(source)
    assert _forbidden(probe, "seqpar.attention.probe", ("integrations", "seqpar.integrations")), (
        imports_of(probe, "seqpar.attention.probe")
    )
    assert any(m == expected for m, _, _ in imports_of(probe, "seqpar.attention.probe"))


@pytest.mark.parametrize("back_edge", [
    "def load():\n    from seqpar.probe import a\n    return a",
    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from seqpar.probe.a import A",
    "import importlib\nA = importlib.import_module('seqpar.probe.a')",
    "__import__('seqpar.probe.a')",
])
def test_the_cycle_check_sees_a_hidden_back_edge(tmp_path, back_edge):
    """a -> b at the top, b -> a in a function, under TYPE_CHECKING or by a string: a cycle, reported in order."""
    (tmp_path / "a.py").write_text("from seqpar.probe.b import B\nA = 1\n")
    (tmp_path / "b.py").write_text(back_edge + "\nB = 2\n")
    modules = {"seqpar.probe.a": tmp_path / "a.py", "seqpar.probe.b": tmp_path / "b.py"}
    cycles = find_cycles(import_graph(modules))
    assert cycles == [["seqpar.probe.a", "seqpar.probe.b"]], import_graph(modules)
    assert "seqpar.probe.a -> seqpar.probe.b -> seqpar.probe.a" in _describe(cycles)


def test_the_cycle_check_sees_a_package_init(tmp_path):
    """Importing a package runs its __init__: ``from seqpar.probe import X`` is an edge to the package's
    ``__init__``, which here imports the importer back. A module importing its own parent is no edge."""
    (tmp_path / "probe").mkdir()
    (tmp_path / "probe" / "__init__.py").write_text("from seqpar.other import helper\nX = 1\nfrom .inner import Y\n")
    (tmp_path / "probe" / "inner.py").write_text("from seqpar.probe import X\nY = X\n")  # its parent: not an edge
    (tmp_path / "other.py").write_text("def helper():\n    from seqpar.probe import X\n    return X\n")
    modules = {"seqpar.probe": tmp_path / "probe" / "__init__.py", "seqpar.probe.inner": tmp_path / "probe" / "inner.py",
               "seqpar.other": tmp_path / "other.py"}
    graph = import_graph(modules)
    assert graph == {"seqpar.probe": {"seqpar.other", "seqpar.probe.inner"}, "seqpar.probe.inner": set(),
                     "seqpar.other": {"seqpar.probe"}}, graph
    assert find_cycles(graph) == [["seqpar.other", "seqpar.probe"]]


def test_the_harness_check_sees_a_library_import(tmp_path):
    """A library module importing seqpar.testing is reported; seqpar.bench importing it is allowed."""
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from seqpar.testing.ranks import RankPool\n")
    found = _testing_violations({"seqpar.attn.probe": probe, "seqpar.bench.probe": probe})
    assert "seqpar.attn.probe:2 imports seqpar.testing.ranks" in found, found
    assert all(f.startswith("seqpar.attn.probe:") for f in found), found


@pytest.mark.parametrize("folder", ["swap", "runtime"])
def test_no_file_in_swap_or_runtime_is_over_450_lines(folder: str) -> None:
    # issue 30 §2: each file owns one step and says so in its opening docstring; a file past the bound
    # is a second concern that wants a module of its own (as runtime/dynamic_groups.py was split out)
    long = {p.name: n for p in sorted((ROOT / "seqpar" / folder).glob("*.py"))
            if (n := len(p.read_text().splitlines())) > 450}
    assert not long, f"seqpar/{folder}: {long} lines; split by what each part does"
    for p in (ROOT / "seqpar" / folder).glob("*.py"):
        assert ast.get_docstring(ast.parse(p.read_text())), f"{p.name} has no opening docstring saying what it owns"
