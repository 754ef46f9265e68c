"""The config file of ``launch/train.py``: the JSON read, and its top-level keys checked (the launcher's blocks, and
DeepSpeed's own keys when DeepSpeed runs) before any block is read."""

from __future__ import annotations

import difflib
import functools
import importlib.util
import json
import os
import re
from typing import Any

__all__ = ["BLOCKS", "DEEPSPEED_KEYS", "LAUNCHER_KEYS", "check_top_level", "deepspeed_keys", "did_you_mean",
           "load_json"]

DEEPSPEED_KEYS = (
    "zero_optimization", "train_micro_batch_size_per_gpu", "train_batch_size",
    "gradient_accumulation_steps", "optimizer", "bf16", "fp16",
)
"""Top-level keys that mark a DeepSpeed config (``train.engine = "auto"`` then runs DeepSpeed)."""
LAUNCHER_KEYS = ("model", "train", "fsdp")
"""The blocks the launcher reads and removes before the engine sees the rest of the config."""


def load_json(path: str) -> dict[str, Any]:
    """The JSON object at ``path``; a missing file, bad JSON or a non-object is a ConfigError naming ``--config``."""
    from seqpar.config import ConfigError

    try:
        with open(path) as f:
            d = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"--config {path}: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise ConfigError(f"--config {path}: expected a JSON object")
    return d


BLOCKS = ("sequence_parallel", *LAUNCHER_KEYS)
"""Top-level keys the launcher reads; a DeepSpeed config may also hold DeepSpeed's own keys."""


def did_you_mean(key: str, known: Any) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``known`` to a misspelt ``key``, else ``""``."""
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.75)
    return f" (did you mean {close[0]!r}?)" if close else ""


@functools.lru_cache(maxsize=1)
def deepspeed_keys() -> frozenset[str]:
    """Names DeepSpeed reads from its config, found in its sources without importing them.

    DeepSpeed accepts any top-level key and ignores those it does not know, so a misspelt launcher
    block ("modle") would vanish silently. This superset (config constants, ``param_dict`` look-ups,
    pydantic config fields and aliases) lets the launcher flag keys that neither it nor DeepSpeed reads.
    """
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or spec.origin is None:
        return frozenset()
    patterns = [
        re.compile(r"^\s*[A-Z][A-Z0-9_]* = [\"']([a-z][a-z0-9_]*)[\"']", re.M),
        re.compile(r"param_dict(?:\.get\(|\[)\s*[\"']([a-z][a-z0-9_]*)[\"']"),
        re.compile(r"get_\w+\(\s*param_dict\s*,\s*[\"']([a-z][a-z0-9_]*)[\"']"),
        re.compile(r"alias=[\"']([a-z][a-z0-9_]*)[\"']"),
    ]
    field = re.compile(r"^    ([a-z][a-z0-9_]*): [^=\n]+", re.M)
    keys: set[str] = set()
    for folder, _, files in os.walk(os.path.dirname(spec.origin)):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(folder, name), errors="ignore") as f:
                    text = f.read()
                for pattern in patterns:
                    keys.update(pattern.findall(text))
                if "ConfigModel" in text:
                    keys.update(field.findall(text))
    return frozenset(keys)


def check_top_level(raw: dict[str, Any], engine: str, path: str) -> None:
    """Every top-level key is a launcher block or (DeepSpeed engine) a key DeepSpeed reads."""
    from seqpar.config import ConfigError

    for block in BLOCKS:
        if raw.get(block) is not None and not isinstance(raw[block], dict):
            raise ConfigError(f"--config {path}: {block!r} must be a JSON object, got {type(raw[block]).__name__}")
    ds_keys = deepspeed_keys() if engine == "deepspeed" else frozenset()
    for key in ("sequence_parallel_size", "data_parallel_size"):  # DeepSpeed reads them: refused by
        if engine == "deepspeed" and key in raw:  # seqpar.integrations.deepspeed.initialize, here before any group
            raise ConfigError(f"--config {path}: the DeepSpeed config has {key!r}, which makes DeepSpeed build its "
                              "own mesh; set the SP degree in the 'sequence_parallel' block (\"size\") instead and "
                              f"remove {key!r}")
    for key in raw:
        if key in BLOCKS or key in ds_keys:
            continue
        if engine == "deepspeed":
            allowed = f"the launcher's blocks {list(BLOCKS)} or a DeepSpeed config key"
        elif key in DEEPSPEED_KEYS:
            raise ConfigError(f"--config {path}: {key!r} is a DeepSpeed key, but this config runs FSDP "
                              f"(train.engine); remove it or run with --engine deepspeed")
        else:
            allowed = f"the launcher's blocks {list(BLOCKS)} (FSDP engine)"
        raise ConfigError(f"--config {path}: unknown top-level key {key!r}{did_you_mean(key, BLOCKS)}; "
                          f"allowed are {allowed}")

