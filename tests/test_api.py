"""The public API contract: ``seqpar.__all__`` is the user guide's list (docs/getting-started.md),
``dir(seqpar)`` shows only it, every name resolves; the module paths and top-level names that moved before 0.2 are gone (0.2.0 removed their
aliases), and CHANGELOG.md says where each one went.

Old module paths are imported in one fresh interpreter (``sys.executable -c``), so that nothing an
earlier test imported can make an old path resolve; an import that fails leaves nothing behind, so
the paths are tried one after the other there (22 interpreters took ~40 s of CI's 30 minutes).
"""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import seqpar

ROOT = Path(__file__).resolve().parents[1]

# Old path -> the module it now is, and the import statement a user of 0.1 wrote (now a ModuleNotFoundError).
MOVED_MODULES = {
    "seqpar.data": ("seqpar.sequence.batch", "import seqpar.data"),
    "seqpar.loss": ("seqpar.sequence.loss", "import seqpar.loss"),
    "seqpar.sharding": ("seqpar.sequence.sharding", "import seqpar.sharding"),
    "seqpar.training_memory": ("seqpar.memory.training", "import seqpar.training_memory"),
    "seqpar.memtrack": ("seqpar.memory.tracker", "import seqpar.memtrack"),
    "seqpar.groups": ("seqpar.runtime.groups", "import seqpar.groups"),
    "seqpar.liveness": ("seqpar.runtime.liveness", "import seqpar.liveness"),
    "seqpar.checkpoint": ("seqpar.runtime.checkpoint", "import seqpar.checkpoint"),
    "seqpar.costmodel": ("seqpar.attn.choose", "import seqpar.costmodel"),
    "seqpar.tiling": ("seqpar.memory.tiling", "import seqpar.tiling"),
    "seqpar.norm": ("seqpar.memory.norm", "import seqpar.norm"),
    "seqpar.offload": ("seqpar.memory.offload", "import seqpar.offload"),
    "seqpar.ranks": ("seqpar.testing.ranks", "import seqpar.ranks"),
    "seqpar.attention.ring": ("seqpar.attn.ring", "from seqpar.attention.ring import RingAttention"),
    "seqpar.attention.allgather": ("seqpar.attn.allgather", "from seqpar.attention.allgather import AllGatherAttention"),
    "seqpar.attention.ulysses": ("seqpar.attn.ulysses", "from seqpar.attention.ulysses import UlyssesAttention"),
    "seqpar.attention.hybrid": ("seqpar.attn.hybrid", "from seqpar.attention.hybrid import hybrid_attention"),
    "seqpar.attention.dilated": ("seqpar.attn.dilated", "from seqpar.attention.dilated import dilated_attention"),
    "seqpar.attention.masks": ("seqpar.attn.masks", "from seqpar.attention.masks import MaskSpec"),
    "seqpar.attention.plan": ("seqpar.attn.plan", "from seqpar.attention.plan import plan_blocks"),
    "seqpar.attention.common": ("seqpar.attn.common", "from seqpar.attention.common import AttentionOptions"),
    "seqpar.attention.checks": ("seqpar.attn.checks", "from seqpar.attention.checks import check_options"),
}

# Top-level names before 0.2 that are no longer public -> their home (now an AttributeError on seqpar).
MOVED_NAMES = {
    "PatternConfig": "seqpar.config.PatternConfig",
    "shard_index": "seqpar.sequence.sharding.shard_index",
    "pad_to_multiple": "seqpar.sequence.sharding.pad_to_multiple",
    "set_default_manager": "seqpar.runtime.groups.set_default_manager",
    "resolve_group": "seqpar.runtime.groups.resolve_group",
    "SeqParMultiheadAttention": "seqpar.swap.SeqParMultiheadAttention",
    "sequence_parallel_causal_lm_loss": "seqpar.sequence.loss.sequence_parallel_causal_lm_loss",
    "sequence_parallel_mean": "seqpar.sequence.loss.sequence_parallel_mean",
    "estimate_memory": "seqpar.memory.attention.estimate_attention_memory",
}


GUIDE = ROOT / "docs" / "getting-started.md"


def _docs_api() -> list[str]:
    """The names of the "Public API (`seqpar.__all__` ..." bullet list in docs/getting-started.md's "Use it
    from Python" (the user guide's list of the public API)."""
    text = GUIDE.read_text()
    section = re.search(r"^## Use it from Python\n(.*?)(?=^## )", text, re.M | re.S)
    assert section, "docs/getting-started.md has no '## Use it from Python' section"
    block = re.search(r"^Public API \(`seqpar.__all__`.*?\n\n((?:- .*\n)+)", section.group(1), re.M)
    assert block, "docs/getting-started.md's 'Use it from Python' has no 'Public API (`seqpar.__all__`)' bullet list"
    return [re.match(r"- `(\w+)`", line).group(1) for line in block.group(1).splitlines()]


def test_all_is_the_docs_api_list():
    names = _docs_api()
    assert len(names) == len(set(names)), f"docs/getting-started.md lists a name twice: {names}"
    assert sorted(names) == sorted(seqpar.__all__), (
        f"in __all__ only: {sorted(set(seqpar.__all__) - set(names))}; "
        f"in docs/getting-started.md only: {sorted(set(names) - set(seqpar.__all__))}")


def test_dir_shows_only_the_public_api():
    assert sorted(dir(seqpar)) == sorted(seqpar.__all__)


@pytest.mark.parametrize("name", seqpar.__all__)
def test_every_public_name_resolves_without_warning(name):
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        assert getattr(seqpar, name) is not None


def test_the_package_root_holds_at_most_five_modules():
    root = sorted(p.name for p in (ROOT / "seqpar").glob("*.py"))
    assert len(root) <= 5, f"seqpar/ holds {root}: put a module in the folder of its layer"


def _python(code: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *flags, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)


def test_the_version_is_0_2_0_everywhere():
    assert seqpar.__version__ == "0.2.0"
    assert re.search(r"^version = 0\.2\.0$", (ROOT / "setup.cfg").read_text(), re.M), "setup.cfg's version"
    assert re.search(r"^## 0\.2\.0$", (ROOT / "CHANGELOG.md").read_text(), re.M), "CHANGELOG.md has no 0.2.0"


@pytest.fixture(scope="module")
def old_path_imports() -> dict[str, str]:
    """Each old path's import statement tried in one fresh interpreter: old path -> the missing module's
    name (``ModuleNotFoundError.name``), ``"IMPORTED"`` if it still imports, or the other error raised."""
    code = (
        "import json, sys\n"
        f"statements = {dict((old, st) for old, (_, st) in MOVED_MODULES.items())!r}\n"
        "out = {}\n"
        "for old, statement in statements.items():\n"
        "    try:\n"
        "        exec(statement, {})\n"
        "        out[old] = 'IMPORTED'\n"
        "    except ModuleNotFoundError as e:\n"
        "        out[old] = 'GONE: ' + str(e.name)\n"
        "    except Exception as e:\n"
        "        out[old] = repr(e)\n"
        "import seqpar, seqpar.attn.dispatch\n"
        "out['FUNCTION'] = seqpar.attention is seqpar.attn.dispatch.attention\n"
        "print(json.dumps(out))\n")
    proc = _python(code)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("old", sorted(MOVED_MODULES))
def test_an_old_module_path_is_gone(old, old_path_imports):
    _, statement = MOVED_MODULES[old]
    assert old_path_imports[old].startswith("GONE: seqpar."), f"{statement!r} still imports: {old_path_imports[old]}"
    assert old_path_imports["FUNCTION"] is True  # seqpar.attention stays the function


def test_the_attention_function_has_no_submodules():
    """The issue's case: ``import seqpar.attention.ring as r`` and ``seqpar.attention.ring``."""
    for statement in ("import seqpar.attention.ring as r", "import seqpar.attention"):
        with pytest.raises(ModuleNotFoundError):
            exec(statement, {})
    assert callable(seqpar.attention) and not hasattr(seqpar.attention, "ring")


@pytest.mark.parametrize("name", sorted(MOVED_NAMES))
def test_a_moved_name_is_gone_and_its_home_has_it(name):
    with pytest.raises(AttributeError, match=rf"no attribute '{name}'"):
        getattr(seqpar, name)
    module, new = MOVED_NAMES[name].rsplit(".", 1)
    assert getattr(importlib.import_module(module), new) is not None


def test_the_changelog_says_where_each_moved_path_and_name_went():
    """CHANGELOG.md has a table row ``| `old` | `new` ... |`` for each old module path and top-level name."""
    text = (ROOT / "CHANGELOG.md").read_text()
    rows = dict(re.findall(r"^\| `([\w.]+)` \| `([\w.]+)`", text, re.M))
    expected = {**{old: new for old, (new, _) in MOVED_MODULES.items()},
                **{f"seqpar.{name}": home for name, home in MOVED_NAMES.items()}}
    assert {old: rows.get(old) for old in expected} == expected
