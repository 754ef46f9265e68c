"""``launch/train.py`` imported as a module, once per process (tests and the ranks of a pool).

The launcher is a script, not part of the installed package; tests call its ``main(argv)``,
``validate(argv)`` and helpers in-process instead of starting a new interpreter per run.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from seqpar.testing.deepspeed_teardown import released_deepspeed_engines

ROOT = Path(__file__).resolve().parents[1]
_NAME = "seqpar_launch_train"


def train_module() -> ModuleType:
    """The ``launch/train.py`` module (loaded on first use, then cached in ``sys.modules``)."""
    if _NAME not in sys.modules:
        spec = importlib.util.spec_from_file_location(_NAME, ROOT / "launch" / "train.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[_NAME] = module
        spec.loader.exec_module(module)
    return sys.modules[_NAME]


def run_main(argv: list[str], **kwargs: Any) -> dict[str, Any]:
    """``main(argv)`` on a pool rank, destroying what it made: the launcher's DeepSpeed engine is the
    task's to release (:mod:`seqpar.testing.deepspeed_teardown`); an FSDP run does not import DeepSpeed."""
    module = train_module()
    try:
        engine = module.build_plan(module.parse_args(argv)).engine
    except (Exception, SystemExit):  # a refused config: main raises the same, and makes no engine
        engine = None
    if engine != "deepspeed":
        return module.main(argv, **kwargs)
    with released_deepspeed_engines():
        return module.main(argv, **kwargs)
