"""The public API contract: ``seqpar.__all__`` is README's list, ``dir(seqpar)`` shows only it, every name
resolves; the paths and names that moved in 0.2 keep working with a ``DeprecationWarning`` until 0.3.

Old module paths are imported in a fresh interpreter each (``sys.executable -c``): a module imported once
is cached, so a second import in the same process would not warn again and prove nothing.
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import seqpar

ROOT = Path(__file__).resolve().parents[1]

# Old path -> the module it now is, and the import statement a user of 0.1 wrote.
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

# Top-level names before 0.2 that are no longer public: reachable with a warning naming their home.
MOVED_NAMES = ["PatternConfig", "shard_index", "pad_to_multiple", "set_default_manager", "resolve_group",
               "SeqParMultiheadAttention", "sequence_parallel_causal_lm_loss", "sequence_parallel_mean",
               "estimate_memory"]


def _readme_api() -> list[str]:
    """The names of the "Public API (`seqpar.__all__`)" bullet list in README's "Use it from Python"."""
    text = (ROOT / "README.md").read_text()
    section = re.search(r"^## Use it from Python\n(.*?)(?=^## )", text, re.M | re.S)
    assert section, "README.md has no '## Use it from Python' section"
    block = re.search(r"^Public API \(`seqpar.__all__`\).*?\n\n((?:- .*\n)+)", section.group(1), re.M)
    assert block, "README's 'Use it from Python' has no 'Public API (`seqpar.__all__`)' bullet list"
    return [re.match(r"- `(\w+)`", line).group(1) for line in block.group(1).splitlines()]


def test_all_is_readmes_api_list():
    names = _readme_api()
    assert len(names) == len(set(names)), f"README lists a name twice: {names}"
    assert sorted(names) == sorted(seqpar.__all__), (
        f"in __all__ only: {sorted(set(seqpar.__all__) - set(names))}; "
        f"in README only: {sorted(set(names) - set(seqpar.__all__))}")


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


@pytest.mark.parametrize("old", sorted(MOVED_MODULES))
def test_an_old_module_path_warns_and_is_the_new_module(old):
    new, statement = MOVED_MODULES[old]
    # with warnings as errors: `import seqpar` itself is clean, and the old path raises its warning
    warned = _python(
        "import seqpar\n"
        "try:\n"
        f"    {statement}\n"
        "except DeprecationWarning as w:\n"
        "    print('WARNED:', w)\n", "-W", "error::DeprecationWarning")
    assert warned.returncode == 0, warned.stderr
    assert f"WARNED: {old} moved to {new}" in warned.stdout, warned.stdout + warned.stderr
    # without: the old name is the very module object of the new path; seqpar.attention stays the function
    same = _python(
        "import importlib, sys\n"
        f"{statement}\n"
        "import seqpar, seqpar.attn.dispatch\n"
        f"new = importlib.import_module({new!r})\n"
        f"assert sys.modules[{old!r}] is new, (sys.modules[{old!r}], new)\n"
        f"assert importlib.import_module({old!r}) is new\n"
        "assert callable(seqpar.attention), seqpar.attention\n"
        "assert seqpar.attention is seqpar.attn.dispatch.attention, seqpar.attention\n"
        "print('SAME')\n")
    assert same.returncode == 0 and "SAME" in same.stdout, same.stdout + same.stderr


@pytest.mark.parametrize("name", MOVED_NAMES)
def test_a_moved_name_resolves_with_a_warning_naming_its_home(name):
    with pytest.warns(DeprecationWarning, match=rf"seqpar\.{name} is not public API") as record:
        value = getattr(seqpar, name)
    home = re.search(r"use ([\w.]+)\.(\w+)", str(record[0].message))
    assert home, f"the warning does not say where {name} lives now: {record[0].message}"
    module, new = home.groups()
    assert getattr(importlib.import_module(module), new) is value
    if name == "estimate_memory":
        assert value is seqpar.estimate_attention_memory
