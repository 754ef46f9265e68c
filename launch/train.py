"""Train a small Llama on a long-range recall task with sequence parallelism (DeepSpeed or FSDP).

Launch it as you would any training script::

    deepspeed --num_gpus 2 launch/train.py --config configs/deepspeed_ring.json
    torchrun --nproc_per_node 2 launch/train.py --config configs/fsdp_ring.json
    python launch/train.py --config configs/fsdp_ring.json --sp-size 1      # one process

On a CPU-only machine both launchers start CPU ranks (gloo).

The task. Each sample is ``BOS k1 v1 k2 v2 ... kN vN <filler ...> (SEP k v)*Q``: key/value pairs at
the start, random filler, then queries at the end whose answer is the value paired with the key
earlier. Only the answers carry a loss. With contiguous (or zigzag) sharding the pairs and the
queries sit on different ranks, so the model can only learn the task if attention crosses shards
exactly; chance accuracy is ``1 / num_values``.

The config JSON. A DeepSpeed config (recognised by DeepSpeed's own keys) or a standalone seqpar
config, with three extra sections the launcher reads and removes before the engine sees the rest::

    "sequence_parallel": {...}                        # seqpar.config.SeqParConfig
    "model": {"hidden_size": 64, ...}                 # transformers.LlamaConfig fields, or with
                                                      # "architecture": "mixtral" (a transformers model
                                                      # type) that config class's fields (sizes:
                                                      # MODEL_SIZE_RANGES); hybrids too ("jamba",
                                                      # "lfm2", ...: configs/*_hybrid.json), whose
                                                      # mixers the swap makes sequence-parallel or
                                                      # refuses by name on every rank
    "train": {"seq_len": 1024, "steps": 30, ...}      # TrainSettings below; flags override
    "fsdp": {"version": 2, ...}                       # FSDP only: integrations.fsdp.FSDPOptions

An unknown key in any of them, or at the top level (other than DeepSpeed's own keys), fails before
any process group starts, naming the key and the allowed ones. ``model.vocab_size`` may exceed what
the task needs (``3 + num_keys + num_values + filler_vocab``): the task's tokens keep the first ids
and the ids above are never sampled.

Metrics (``--metrics-out``): per-step ``loss`` (global: mean over DP replicas of the SP-group loss),
``tokens_per_s`` (global tokens of the timed steps / their wall time), ``peak_mem_bytes`` per rank
and ``peak_mem_kind`` saying what that figure is, ``recall_accuracy`` on held-out samples, and the
run's settings. A resumed run continues with the same losses as an uninterrupted one (the data of
step ``s`` depends only on the seed and ``s``).

Beside this file: ``launch/recall.py`` (the task and its accuracy) and ``launch/engines.py`` (DeepSpeed and
FSDP behind the calls the loop makes); ``--dynamic`` steps are planned by ``seqpar.sequence.dynamic_step`` and
driven by ``seqpar.integrations.dynamic``, as under ``SeqParTrainer``.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import importlib.util
import inspect
import json
import logging
import math
import os
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["TrainSettings", "RecallTask", "parse_args", "main"]

logger = logging.getLogger("seqpar")

_DEEPSPEED_KEYS = (
    "zero_optimization", "train_micro_batch_size_per_gpu", "train_batch_size",
    "gradient_accumulation_steps", "optimizer", "bf16", "fp16",
)
_LAUNCHER_KEYS = ("model", "train", "fsdp")


def _sibling(name: str) -> Any:
    """``launch/<name>.py``, loaded by path once per process: the launcher is a script (``python launch/train.py``,
    or loaded by path as the tests and launch/soak.py do), so ``launch/`` is not on the import path."""
    key = f"seqpar_launch_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                                        f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


_recall, _engines = _sibling("recall"), _sibling("engines")
IGNORE, RecallTask, recall_accuracy = _recall.IGNORE, _recall.RecallTask, _recall.recall_accuracy  # the task
Engine, DeepSpeedEngine, FSDPEngine = _engines.Engine, _engines.DeepSpeedEngine, _engines.FSDPEngine
packed_kwargs = _engines.packed_kwargs


# ============================================================================ settings
@dataclass
class TrainSettings:
    """The ``"train"`` section; every field can be overridden by the flag of the same name."""

    engine: str = "auto"
    """``"deepspeed"``, ``"fsdp"``, or ``"auto"`` (DeepSpeed when the config has DeepSpeed keys)."""
    seq_len: int = 1024
    """Tokens per sample (before end padding to a multiple of the SP chunk count); >= 1."""
    steps: int = 30
    """Optimizer steps in total (a resumed run continues up to this number); >= 1."""
    seed: int = 0
    """Seeds the model init and the data (sample i of the run depends only on seed and i); >= 0."""
    micro_batch_size: int = 1
    """Samples per rank per micro-step, >= 1 (DeepSpeed: ``train_micro_batch_size_per_gpu`` wins)."""
    grad_accum: int = 1
    """Micro-steps per optimizer step, >= 1 (DeepSpeed: ``gradient_accumulation_steps`` wins)."""
    optimizer: str = "adamw"
    """The FSDP engine's optimizer: ``"adamw"`` (``torch.optim.AdamW``) or ``"sgd"`` (``torch.optim.SGD``, no
    momentum: its step is the learning rate times the gradient, so a gradient off by a factor shows in the
    losses, where Adam's normalisation hides it). DeepSpeed takes its own ``optimizer`` block; without one,
    the block made from ``train`` is AdamW, or ``{"type": "SGD"}`` (DeepSpeed's fallback to ``torch.optim``)
    with ``"sgd"``."""
    lr: float = 3e-3
    """The learning rate, a finite number >= 0 (FSDP; DeepSpeed takes its ``optimizer`` block)."""
    weight_decay: float = 0.0
    """Weight decay (AdamW's decoupled, SGD's L2), a finite number >= 0 (FSDP)."""
    grad_clip: float = 1.0
    """Max gradient norm, a finite number >= 0; 0 = off (FSDP; DeepSpeed takes ``gradient_clipping``)."""
    dtype: str = "fp32"
    """``fp32`` | ``bf16`` | ``fp16`` (DeepSpeed: its ``bf16``/``fp16`` blocks; FSDP: param dtype,
    fp32 reduction; fp16 needs loss scaling, so FSDP refuses it)."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer in backward (the ring exchange is repeated there too)."""
    num_pairs: int = 16
    """Key/value pairs at the start of each sample; >= 1 and <= ``num_keys``."""
    num_queries: int = 8
    """Queries at the end of each sample (each carries one answer token); >= 1."""
    num_keys: int = 64
    """Distinct key tokens of the recall task; >= 1."""
    num_values: int = 16
    """Distinct value tokens of the recall task; >= 1."""
    filler_vocab: int = 32
    """Filler tokens between the pairs and the queries; >= 1."""
    eval_samples: int = 16
    """Held-out samples for the final recall accuracy, >= 0 (0 = skip)."""
    packed: bool = False
    """Pack recall samples of long-tailed lengths (log-uniform between the shortest valid sample and
    ``seq_len``) into each sequence, as DataCollatorWithFlattening does: documents are separated
    exactly by seqpar (global boundaries from ``shard_batch``). Needs ``micro_batch_size`` 1."""
    save_every: int = 0
    """Save a checkpoint every N >= 0 steps (and at the end) when ``--save-dir`` is given; 0 = end only."""
    packed_lengths: str = "log-uniform"
    """Document lengths of ``packed`` rows: ``"log-uniform"`` in ``[shortest sample, seq_len]``, or
    ``"log-normal"`` (long-tailed: median ``packed_median``, sigma ``packed_sigma``, clipped to
    ``[max(packed_min, shortest sample), seq_len]``); seeded, the same on every rank."""
    packed_median: int = 1024
    """Median document length of ``packed_lengths = "log-normal"``, >= 1."""
    packed_sigma: float = 1.2
    """Sigma (of the log length) of ``packed_lengths = "log-normal"``, a finite number >= 0."""
    packed_min: int = 64
    """Shortest document of ``packed_lengths = "log-normal"`` (besides the task's shortest sample), >= 1."""
    dynamic: bool = False
    """Length-aware dynamic CP (``--dynamic``): each step's packed documents (the ``grad_accum x dp`` rows a
    static run would train on) are planned over the DP x SP pool by ``seqpar.sequence.dynamic`` with
    ``sequence_parallel.dynamic``, each rank runs its planned micro-batches (every rank as many), the loss is
    the per-token mean over the pool's step and gradients are reduced once per step. Needs ``packed``; FSDP2 or
    DeepSpeed ZeRO-1/2/3."""
    compile: bool = False
    """``torch.compile`` the model: FSDP2 compiles each block after ``fully_shard`` (torchtitan's per-block
    compile, ``fullgraph=True``; seqpar.integrations.fsdp.compile_blocks), DeepSpeed calls ``engine.compile()``.
    FSDP1 refuses it."""
    compile_backend: str = "inductor"
    """The ``torch.compile`` backend with ``compile`` (``"inductor"``; ``"aot_eager"`` traces without
    generating code, for checks)."""

    def __post_init__(self) -> None:
        self._check_types()
        if self.engine not in ("auto", "deepspeed", "fsdp"):
            raise ValueError(f"train.engine = {self.engine!r}: choose 'deepspeed', 'fsdp' or 'auto'")
        if self.optimizer not in ("adamw", "sgd"):
            raise ValueError(f"train.optimizer = {self.optimizer!r}: choose 'adamw' or 'sgd'")
        if self.dtype not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"train.dtype = {self.dtype!r}: choose 'fp32', 'bf16' or 'fp16'")
        if self.compile_backend not in compile_backends():
            raise ValueError(f"train.compile_backend = {self.compile_backend!r}: choose a torch.compile backend "
                             f"({', '.join(compile_backends())})")
        for name in ("seq_len", "steps", "micro_batch_size", "grad_accum", "num_pairs",
                     "num_queries", "num_keys", "num_values", "filler_vocab"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name} = {getattr(self, name)!r}: must be >= 1")
        if self.num_pairs > self.num_keys:
            raise ValueError("train.num_pairs must be <= train.num_keys (keys are distinct)")
        need = 1 + 2 * self.num_pairs + 3 * self.num_queries + 1
        if self.packed and self.micro_batch_size != 1:
            raise ValueError(
                f"train.packed needs train.micro_batch_size = 1 (got {self.micro_batch_size}): a packed "
                "row already holds several documents; raise seq_len or grad_accum instead"
            )
        if self.packed_lengths not in ("log-uniform", "log-normal"):
            raise ValueError(f"train.packed_lengths = {self.packed_lengths!r}: choose 'log-uniform' or 'log-normal'")
        if self.packed_median < 1 or self.packed_min < 1 or not (0 <= self.packed_sigma < math.inf):
            raise ValueError("train.packed_median and train.packed_min must be >= 1 and train.packed_sigma a "
                             "finite number >= 0")
        if self.dynamic and not self.packed:
            raise ValueError("train.dynamic (--dynamic) plans packed documents: set train.packed (--packed)")
        if self.seq_len < need:
            raise ValueError(
                f"train.seq_len = {self.seq_len} is too short for {self.num_pairs} pairs and "
                f"{self.num_queries} queries; use at least {need}"
            )

    def _check_types(self) -> None:
        """Each field has its annotated JSON type (an int is a valid float; a bool is no number)."""
        accepted = {"str": (str,), "int": (int,), "float": (int, float), "bool": (bool,)}
        for f in dataclasses.fields(self):
            value, types = getattr(self, f.name), accepted[str(f.type)]
            if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
                raise ValueError(f"train.{f.name} = {value!r}: expected {str(f.type)}")
        for name in ("lr", "weight_decay", "grad_clip", "eval_samples", "save_every", "seed"):
            if getattr(self, name) < 0 or not math.isfinite(getattr(self, name)):
                raise ValueError(f"train.{name} = {getattr(self, name)!r}: must be a finite number >= 0")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainSettings:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown key(s) {unknown} in 'train'; allowed keys are {sorted(known)}")
        return cls(**d)


def compile_backends() -> list[str]:
    """The ``torch.compile`` backends registered in this process (``train.compile_backend``'s choices)."""
    from torch._dynamo import list_backends

    return list_backends(exclude_tags=())


# ============================================================================ arguments
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="DeepSpeed or seqpar JSON (see module docstring)")
    p.add_argument("--engine", choices=["auto", "deepspeed", "fsdp"], help="override train.engine")
    p.add_argument("--sp-size", type=int, help="override sequence_parallel.size")
    p.add_argument("--tp-size", type=int, help="override sequence_parallel.tp_size (world = dp x sp x tp)")
    p.add_argument("--tp-sequence-parallel", action="store_true", default=None,
                   help="override sequence_parallel.tp_sequence_parallel (Megatron-style: norms and residuals "
                        "split along the sequence over the TP group)")
    p.add_argument("--mode", help="override sequence_parallel.mode (ring | allgather | ulysses | hybrid | auto)")
    p.add_argument("--ulysses-size", type=lambda x: x if x == "auto" else int(x),
                   help="override sequence_parallel.ulysses_size (an integer dividing the SP size, or auto)")
    p.add_argument("--sharding", help="override sequence_parallel.sharding (contiguous | zigzag | balanced)")
    p.add_argument("--zero-stage", type=int, help="DeepSpeed: override zero_optimization.stage")
    p.add_argument("--seq-len", type=int)
    p.add_argument("--steps", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--micro-batch-size", type=int)
    p.add_argument("--grad-accum", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--optimizer", help="override train.optimizer (adamw | sgd)")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--activation-checkpointing", action="store_true", default=None)
    p.add_argument("--tiled-loss", action="store_true", default=None,
                   help="override sequence_parallel.tiled_loss (LM head + loss over sequence chunks)")
    p.add_argument("--tiled-mlp", type=lambda v: v if v == "auto" else int(v),
                   help="override sequence_parallel.tiled_mlp: number of chunks or 'auto'")
    p.add_argument("--offload-activations", action="store_true", default=None,
                   help="override sequence_parallel.offload_activations (CUDA; a no-op on CPU)")
    p.add_argument("--recompute-norm", action="store_true", default=None,
                   help="override sequence_parallel.recompute_norm (RMSNorms save only their input)")
    p.add_argument("--packed", action="store_true", default=None,
                   help="train on packed documents of long-tailed lengths (sets train.packed)")
    p.add_argument("--dynamic", action="store_true", default=None,
                   help="length-aware dynamic CP over the packed documents (sets train.dynamic; needs "
                        "sequence_parallel.dynamic and train.packed)")
    p.add_argument("--compile", action="store_true", default=None,
                   help="torch.compile the model (sets train.compile: FSDP2 per block, DeepSpeed engine.compile())")
    p.add_argument("--compile-backend", help="override train.compile_backend (inductor | aot_eager | ...)")
    p.add_argument("--metrics-out", help="write the metrics JSON here (rank 0)")
    p.add_argument("--save-dir", help="checkpoint directory (the engine's own format)")
    p.add_argument("--save-every", type=int)
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --save-dir")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--validate-only", action="store_true",
                   help="check the config, every block and the model, then exit 0 (or non-zero naming the "
                        "key) before any process group exists")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--deepspeed", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.resume and not args.save_dir:
        p.error("--resume needs --save-dir")
    return args


def _load_json(path: str) -> dict[str, Any]:
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


_BLOCKS = ("sequence_parallel", *_LAUNCHER_KEYS)
"""Top-level keys the launcher reads; a DeepSpeed config may also hold DeepSpeed's own keys."""


def _did_you_mean(key: str, known: Any) -> str:
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.75)
    return f" (did you mean {close[0]!r}?)" if close else ""


@functools.lru_cache(maxsize=1)
def _deepspeed_keys() -> frozenset[str]:
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


def _check_top_level(raw: dict[str, Any], engine: str, path: str) -> None:
    """Every top-level key is a launcher block or (DeepSpeed engine) a key DeepSpeed reads."""
    from seqpar.config import ConfigError

    for block in _BLOCKS:
        if raw.get(block) is not None and not isinstance(raw[block], dict):
            raise ConfigError(f"--config {path}: {block!r} must be a JSON object, got {type(raw[block]).__name__}")
    ds_keys = _deepspeed_keys() if engine == "deepspeed" else frozenset()
    for key in raw:
        if key in _BLOCKS or key in ds_keys:
            continue
        if engine == "deepspeed":
            allowed = f"the launcher's blocks {list(_BLOCKS)} or a DeepSpeed config key"
        elif key in _DEEPSPEED_KEYS:
            raise ConfigError(f"--config {path}: {key!r} is a DeepSpeed key, but this config runs FSDP "
                              f"(train.engine); remove it or run with --engine deepspeed")
        else:
            allowed = f"the launcher's blocks {list(_BLOCKS)} (FSDP engine)"
        raise ConfigError(f"--config {path}: unknown top-level key {key!r}{_did_you_mean(key, _BLOCKS)}; "
                          f"allowed are {allowed}")


ARCHITECTURE_KEY = "architecture"
"""``"model": {"architecture": "mixtral", ...}`` picks the transformers config class (``model_type`` as
transformers registers it: ``"llama"`` by default, ``"mixtral"``, ``"qwen3_moe"``, ``"deepseek_v3"``, ...);
the other keys set that config's fields."""


def config_class(model: dict[str, Any]) -> Any:
    """The transformers config class the ``"model"`` block names (``LlamaConfig`` when it names none)."""
    from transformers import CONFIG_MAPPING

    from seqpar.config import ConfigError

    arch = model.get(ARCHITECTURE_KEY, "llama")
    if not isinstance(arch, str) or arch not in CONFIG_MAPPING:
        known = sorted(CONFIG_MAPPING.keys())
        raise ConfigError(f"model.{ARCHITECTURE_KEY} = {arch!r} is not a transformers model type"
                          f"{_did_you_mean(str(arch), known)}; e.g. 'llama', 'mixtral', 'qwen3_moe'")
    return CONFIG_MAPPING[arch]


def _llama_keys(model: dict[str, Any] | None = None) -> list[str]:
    """The fields the ``"model"`` block's config class takes (it would store any other key silently)."""
    cls = config_class(model or {})
    if dataclasses.is_dataclass(cls):
        return sorted(f.name for f in dataclasses.fields(cls))
    params = inspect.signature(cls.__init__).parameters.values()
    return sorted(p.name for p in params if p.name != "self" and p.kind is not p.VAR_KEYWORD)


def _check_model(model: dict[str, Any], train: TrainSettings) -> None:
    """Unknown ``model`` keys fail by name; ``vocab_size`` must hold the recall task's tokens."""
    from seqpar.config import ConfigError

    known = _llama_keys(model)
    for key in model:
        if key != ARCHITECTURE_KEY and key not in known:
            raise ConfigError(f"unknown key {key!r} in 'model'{_did_you_mean(key, known)}; allowed keys are "
                              f"{ARCHITECTURE_KEY!r} and transformers.{config_class(model).__name__}'s fields: "
                              f"{known}")
    if "vocab_size" in model:
        vocab, need = model["vocab_size"], RecallTask(train).vocab_size
        if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < need:
            raise ConfigError(
                f"model.vocab_size = {vocab!r} is smaller than the recall task needs: {need} ids (3 special "
                f"+ train.num_keys {train.num_keys} + train.num_values {train.num_values} + train.filler_vocab "
                f"{train.filler_vocab}); use vocab_size >= {need} or shrink those train keys"
            )


@dataclass
class Plan:
    """Everything resolved from the JSON and the flags, validated before any process group exists."""

    engine: str
    train: TrainSettings
    sp: Any  # SeqParConfig
    model: dict[str, Any]
    engine_config: dict[str, Any] = field(default_factory=dict)  # DeepSpeed JSON or "fsdp" section


def build_plan(args: argparse.Namespace) -> Plan:
    """Read the config, apply the flags, validate; raises ConfigError/ValueError with a fix."""
    from seqpar.config import ConfigError, SeqParConfig

    raw = _load_json(args.config)
    if not isinstance(raw.get("train") or {}, dict):
        raise ConfigError(f"--config {args.config}: 'train' must be a JSON object")
    train_d = dict(raw.get("train") or {})
    for name in ("engine", "seq_len", "steps", "seed", "micro_batch_size", "grad_accum", "lr", "optimizer",
                 "dtype", "activation_checkpointing", "save_every", "packed", "compile", "compile_backend"):
        value = getattr(args, name, None)
        if value is not None:
            train_d[name] = value
    if getattr(args, "dynamic", None) is not None:
        train_d["dynamic"] = args.dynamic
    train = TrainSettings.from_dict(train_d)
    engine = train.engine
    if engine == "auto":
        engine = "deepspeed" if any(k in raw for k in _DEEPSPEED_KEYS) else "fsdp"
    _check_top_level(raw, engine, args.config)
    sp = SeqParConfig.from_dict({"sequence_parallel": raw.get("sequence_parallel") or {}})
    changes = {k: v for k, v in (("size", args.sp_size), ("mode", args.mode),
                                  ("sharding", args.sharding), ("tiled_loss", args.tiled_loss),
                                  ("tiled_mlp", args.tiled_mlp),
                                  ("offload_activations", args.offload_activations),
                                  ("recompute_norm", args.recompute_norm),
                                  ("ulysses_size", args.ulysses_size),
                                  ("tp_size", args.tp_size),
                                  ("tp_sequence_parallel", args.tp_sequence_parallel)) if v is not None}
    if changes:
        sp = sp.replace(**changes)
    if args.tp_size is not None and isinstance(raw.get("tensor_parallel"), dict) and "autotp_size" in raw["tensor_parallel"]:
        raw["tensor_parallel"] = {**raw["tensor_parallel"], "autotp_size": args.tp_size}  # the flag wins here too
    _check_tp(raw, sp, engine, dict(raw.get("model") or {}))
    if train.dynamic and sp.dynamic is None:
        raise ConfigError(
            "--dynamic (train.dynamic) needs a \"sequence_parallel\": {\"dynamic\": {\"max_tokens_per_rank\": N, "
            "\"min_size\": 1}} block"
        )
    _check_tp_sequence_parallel(sp, engine)
    model = dict(raw.get("model") or {})
    _check_model(model, train)
    if raw.get("fsdp"):
        from seqpar.integrations.fsdp import FSDPOptions

        FSDPOptions.from_dict(dict(raw["fsdp"]))  # unknown keys fail now, whichever engine runs
    if sp.pattern.type == "dilated":
        # the shape rules of a dilated pattern need the sequence and head counts: check them now,
        # before any process group or model exists
        from seqpar.attn.dilated import check_pattern
        from seqpar.sequence.sharding import UNDECLARED_DEFAULT, padded_length

        seq_padded = padded_length(train.seq_len, sp.size, sp.sharding or UNDECLARED_DEFAULT)
        try:
            check_pattern(sp.pattern.segment_lengths, sp.pattern.dilation_rates,
                          head_layout=sp.pattern.head_layout,
                          q_heads=model.get("num_attention_heads"),
                          seq_local=seq_padded // sp.size, world_size=sp.size)
        except ValueError as e:
            raise ConfigError(f"sequence_parallel.pattern does not fit --seq-len {train.seq_len} on "
                              f"sequence_parallel.size = {sp.size} ranks: {e}") from None

    if sp.head_chunks != "auto":
        from seqpar.attn import resolve_head_chunks

        kv_heads = model.get("num_key_value_heads") or model.get("num_attention_heads")
        if isinstance(kv_heads, int):
            try:
                resolve_head_chunks(sp.head_chunks, kv_heads)
            except ValueError as e:
                raise ConfigError(f"sequence_parallel.head_chunks does not fit the model: {e}") from None

    if engine == "deepspeed":
        ds = {k: v for k, v in raw.items() if k not in _LAUNCHER_KEYS}
        ds["sequence_parallel"] = sp.to_dict()
        # A flag wins over the DeepSpeed keys, which win over the "train" section.
        if args.micro_batch_size is not None or "train_micro_batch_size_per_gpu" not in raw:
            ds["train_micro_batch_size_per_gpu"] = train.micro_batch_size
        train.micro_batch_size = int(ds["train_micro_batch_size_per_gpu"])
        if args.grad_accum is not None or "gradient_accumulation_steps" not in raw:
            ds["gradient_accumulation_steps"] = train.grad_accum
        train.grad_accum = int(ds["gradient_accumulation_steps"])
        ds.pop("train_batch_size", None)  # derived by DeepSpeed from micro x accum x dp
        if args.zero_stage is not None:
            ds.setdefault("zero_optimization", {})["stage"] = args.zero_stage
        if args.dtype is not None:
            ds.pop("bf16", None)
            ds.pop("fp16", None)
            if args.dtype != "fp32":
                ds[args.dtype] = {"enabled": True}
        if args.lr is not None and isinstance(ds.get("optimizer"), dict):
            ds["optimizer"].setdefault("params", {})["lr"] = args.lr
        given = ds.get("optimizer")
        if (train.optimizer == "sgd" and isinstance(given, dict)
                and str(given.get("type", "")).lower() != "sgd"):
            raise ConfigError(f"train.optimizer = 'sgd' but the DeepSpeed optimizer block is {given.get('type')!r}: "
                              "DeepSpeed takes its own block; drop one of them or set its type to \"SGD\"")
        if train.optimizer == "sgd" and "optimizer" not in ds:
            # not one of DeepSpeed's own optimizers: DeepSpeed builds torch.optim.SGD, and ZeRO needs the opt-in
            ds["optimizer"] = {"type": "SGD", "params": {"lr": train.lr, "weight_decay": train.weight_decay}}
            ds.setdefault("zero_allow_untested_optimizer", True)
        ds.setdefault("optimizer", {"type": "AdamW", "params": {
            "lr": train.lr, "weight_decay": train.weight_decay, "torch_adam": True}})
        ds.setdefault("gradient_clipping", train.grad_clip)
        ds.setdefault("steps_per_print", 10**9)
        train.dtype = "bf16" if ds.get("bf16", {}).get("enabled") else (
            "fp16" if ds.get("fp16", {}).get("enabled") else "fp32")
        if train.dtype == "fp16" and not torch.cuda.is_available():
            raise ConfigError(
                "DeepSpeed runs fp16 only on GPUs (its CPU accelerator refuses it); on CPU use "
                "--dtype bf16 (or a \"bf16\": {\"enabled\": true} block)"
            )
        engine_config = ds
    else:
        if args.zero_stage is not None:
            raise ConfigError("--zero-stage is a DeepSpeed option; this config runs FSDP")
        fsdp_d = dict(raw.get("fsdp") or {})
        if train.compile and fsdp_d.get("version", 2) != 2:
            raise ConfigError("train.compile compiles each FSDP2 block; set fsdp.version to 2 (FSDP1 is not compiled)")
        if train.dtype == "fp16":
            raise ConfigError(
                "dtype fp16 needs loss scaling, which this FSDP launcher does not do; use bf16, or "
                "DeepSpeed with its fp16 block"
            )
        if train.dtype == "bf16":
            fsdp_d.setdefault("param_dtype", "bf16")
            fsdp_d.setdefault("reduce_dtype", "fp32")
        engine_config = fsdp_d
    return Plan(engine=engine, train=train, sp=sp, model=model, engine_config=engine_config)


# ============================================================================ model
def llama_config(plan: Plan, vocab_size: int, seq_len_padded: int) -> Any:
    """The transformers config of the run (``model.architecture``'s class, ``LlamaConfig`` by
    default): small defaults, then the ``"model"`` section."""
    fields: dict[str, Any] = {
        "hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": vocab_size, "max_position_embeddings": max(seq_len_padded, 64),
        "attention_dropout": 0.0, "tie_word_embeddings": False, "use_cache": False,
    }
    fields.update(plan.model)  # the "model" section wins (build_plan checked its keys and vocab_size)
    fields.pop(ARCHITECTURE_KEY, None)
    cfg = config_class(plan.model)(**fields)
    cfg._attn_implementation = "sdpa"
    return cfg


def _check_tp(raw: dict[str, Any], sp: Any, engine: str, model: dict[str, Any]) -> None:
    """``sequence_parallel.tp_size`` against DeepSpeed's ``tensor_parallel.autotp_size`` and the model's
    heads. TP > 1 runs on FSDP2 (the model's tp plan, seqpar.integrations.tp) and on DeepSpeed (AutoTP,
    ``tensor_parallel.autotp_size`` set from ``tp_size``)."""
    from seqpar.config import ConfigError, check_autotp
    from seqpar.runtime.groups import tp_heads_problem

    check_autotp(raw, sp)
    if sp.tp_size == 1:
        return
    heads = model.get("num_attention_heads", 4)
    kv_heads = model.get("num_key_value_heads", heads if "num_attention_heads" in model else 2)
    if isinstance(heads, int) and isinstance(kv_heads, int) and (problem := tp_heads_problem(heads, kv_heads, sp.tp_size)):
        raise ConfigError(f"model.num_attention_heads / model.num_key_value_heads vs {problem}")
    if engine == "fsdp":  # seqpar.integrations.fsdp.wrap applies the model's tp plan, then FSDP2 over dp x sp
        version = (raw.get("fsdp") or {}).get("version", 2)
        if version != 2:
            raise ConfigError(f"sequence_parallel.tp_size = {sp.tp_size} needs FSDP2 (DTensor parameters): set "
                              f"fsdp.version = 2 (got {version!r}), or tp_size 1")


def _check_tp_sequence_parallel(sp: Any, engine: str) -> None:
    """``tp_sequence_parallel`` is applied with the model's tp plan by seqpar.integrations.fsdp.wrap (FSDP2);
    DeepSpeed's AutoTP shards the model its own way and does not split the residual stream."""
    from seqpar.config import ConfigError

    if sp.tp_sequence_parallel and engine != "fsdp":
        raise ConfigError(f"sequence_parallel.tp_sequence_parallel runs on the FSDP engine (FSDP2 with the model's "
                          f"tp plan); the {engine} engine does not split activations over TP: set it false "
                          "(--tp-size alone), or use --engine fsdp")


def validate_model(plan: Plan) -> None:
    """Check the ``model`` block without building the model (no memory, no process group): sizes,
    head divisibility, then transformers' own field validators, as a ConfigError naming the key."""
    from seqpar.config import ConfigError
    from seqpar.sequence.sharding import UNDECLARED_DEFAULT, padded_length

    _check_model_values(plan.model)
    if os.environ.get("WORLD_SIZE", "").isdigit():  # under a launcher the world size is known already
        from seqpar.runtime.groups import check_layout

        check_layout(int(os.environ["WORLD_SIZE"]), plan.sp.size, plan.sp.tp_size)
    task = RecallTask(plan.train)
    seq_padded = padded_length(plan.train.seq_len, plan.sp.size, plan.sp.sharding or UNDECLARED_DEFAULT)
    try:
        llama_config(plan, task.vocab_size, seq_padded)  # transformers' strict field validators
    except Exception as e:  # transformers' validators name the field; say which block it is in
        raise ConfigError(f"'model' block (transformers.{config_class(plan.model).__name__}) refused: "
                          f"{type(e).__name__}: {e}") from None


# The ``model`` block's sizes: integers in [1, upper bound]. The bounds are far above any model
# trained today (Llama-3-405B: hidden 16384, 126 layers, 128 heads, vocab 128256, 131072 positions)
# and far below sizes no machine can build: a typo such as 10**12 layers is refused here, by name,
# instead of exhausting memory inside transformers.
MODEL_SIZE_RANGES: dict[str, tuple[int, int]] = {
    "hidden_size": (1, 2**18), "intermediate_size": (1, 2**20), "num_hidden_layers": (1, 2**12),
    "num_attention_heads": (1, 2**12), "num_key_value_heads": (1, 2**12), "head_dim": (1, 2**12),
    "vocab_size": (1, 2**24), "max_position_embeddings": (1, 2**26),
}


def _check_model_values(model: dict[str, Any]) -> None:
    """Sizes are integers within :data:`MODEL_SIZE_RANGES` and the head counts divide as attention needs."""
    from seqpar.config import ConfigError

    for key, (low, high) in MODEL_SIZE_RANGES.items():
        if key not in model or (key == "head_dim" and model[key] is None):  # None: derived from hidden_size
            continue
        value = model[key]
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ConfigError(f"model.{key} = {value!r}: expected an integer from {low} to {high}")
    heads, kv_heads = model.get("num_attention_heads", 4), model.get("num_key_value_heads", 2)
    if "num_attention_heads" in model and "num_key_value_heads" not in model:
        kv_heads = heads
    if heads % kv_heads:
        raise ConfigError(f"model.num_key_value_heads = {kv_heads} does not divide model.num_attention_heads "
                          f"= {heads}; choose a divisor (grouped-query attention)")
    hidden = model.get("hidden_size", 64)
    if "head_dim" not in model and hidden % heads:
        raise ConfigError(f"model.hidden_size = {hidden} is not a multiple of model.num_attention_heads = "
                          f"{heads}; change one of them (or set model.head_dim)")
    eps = model.get("rms_norm_eps")
    if eps is not None and (isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < math.inf):
        raise ConfigError(f"model.rms_norm_eps = {eps!r}: expected a positive finite number (e.g. 1e-6)")
    act = model.get("hidden_act")
    if act is not None:
        from transformers.activations import ACT2FN

        if not isinstance(act, str) or act not in ACT2FN:
            raise ConfigError(f"model.hidden_act = {act!r}: choose one of {sorted(ACT2FN)}")


def validate(argv: list[str] | None = None) -> Plan:
    """Everything ``--validate-only`` checks, in process: the JSON, every block, the flags and the
    model (on the meta device). No process group is created. Raises ConfigError/ValueError naming
    the key and the fix."""
    plan = build_plan(parse_args(argv))
    validate_model(plan)
    return plan


def build_model(plan: Plan, vocab_size: int, seq_len_padded: int) -> torch.nn.Module:
    """A randomly initialised Llama (seeded); any ``LlamaConfig`` field can be set in the ``"model"``
    section. ``vocab_size`` is the task's (the default); ``model.vocab_size`` (>= it) wins: the task's
    tokens keep the first ids and the ids above are never sampled."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        raise ImportError(
            "launch/train.py needs transformers: pip install 'transformers>=4.48' "
            "(or pip install 'seqpar[hf]')"
        ) from e
    cfg = llama_config(plan, vocab_size, seq_len_padded)
    torch.manual_seed(plan.train.seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    if plan.train.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


# ============================================================================ loop helpers
def _configure_logging(level: str) -> None:
    rank = int(os.environ.get("RANK", "0"))
    if dist.is_available() and dist.is_initialized():
        rank = dist.get_rank()
    log = logging.getLogger("seqpar")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"[rank {rank}] %(levelname)s %(message)s"))
        log.addHandler(handler)
    # Only rank 0 talks at INFO; others warn and worse.
    log.setLevel(getattr(logging, level.upper()) if rank == 0 else logging.WARNING)


class _PeakMemory:
    """Peak tensor memory of one tracked step (CUDA: the allocator's peak; CPU: every live tensor
    storage, counted by seqpar.memory.tracker in every setting: checkpointing, accumulation, tiling)."""

    def __init__(self, engine: Engine, settings: TrainSettings) -> None:
        self.kind = "unknown"
        self.value = 0
        self._tracker: Any = None
        self._engine = engine
        self._compiled = settings.compile

    def __enter__(self) -> _PeakMemory:
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
            self.kind = "cuda_max_memory_allocated over the run"
            return self
        if self._compiled:  # the CPU tracker is a dispatch mode, under which dynamo compiles nothing
            self.kind = "not measured (train.compile: the CPU tensor tracker cannot run in compiled code)"
            return self
        from seqpar.memory.tracker import TensorMemoryTracker

        # what this job holds (model, optimizer, engine buffers) plus what the step allocates; not
        # other tensors of the process (a test's persistent ranks run several jobs in turn)
        self._tracker = TensorMemoryTracker("cpu", count_existing=False)
        self._tracker.track_reachable(self._engine)
        self._tracker.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if torch.cuda.is_available():
            self.value = int(torch.cuda.max_memory_allocated())
            return
        if self._tracker is None:
            return
        self._tracker.__exit__(*exc)
        self.value = int(self._tracker.peak)
        self.kind = "cpu tensor bytes at the peak of one tracked step (seqpar.memory.tracker)"


def _all_gather(obj: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _summary(plan: Plan, manager: Any, metrics: dict[str, Any], n_params: int) -> str:
    losses = metrics["loss"]
    mem = ", ".join(f"{b / 2**20:.1f}" for b in metrics["peak_mem_bytes"])
    lines = [
        "=" * 72,
        f"seqpar train: {plan.engine} | world {manager.world_size} = dp {manager.dp_size} x "
        f"sp {manager.sp_size} | mode {plan.sp.mode} | sharding {manager.sharding or 'contiguous'}",
        f"model: {config_class(plan.model).model_type} {n_params / 1e6:.2f} M params ({plan.model or 'default sizes'}) | dtype "
        f"{plan.train.dtype} | activation checkpointing {plan.train.activation_checkpointing}",
        f"data: recall, seq_len {plan.train.seq_len}, {metrics['global_batch']} samples/step "
        f"(micro {plan.train.micro_batch_size} x accum {plan.train.grad_accum} x dp {manager.dp_size})",
        f"steps {metrics['start_step']}..{metrics['steps']}: loss {losses[0]:.4f} -> {losses[-1]:.4f}"
        if losses else "no steps run",
        f"throughput: {metrics['tokens_per_s']:.0f} tokens/s | wall {metrics['train_seconds']:.1f} s",
        f"peak memory per rank (MiB): {mem} [{metrics['peak_mem_kind']}]",
    ]
    if metrics.get("recall_accuracy") is not None:
        lines.append(
            f"recall accuracy on {plan.train.eval_samples} held-out samples: "
            f"{metrics['recall_accuracy']:.3f} (chance 1/{plan.train.num_values} = "
            f"{1 / plan.train.num_values:.4g})"
        )
    lines.append("=" * 72)
    return "\n".join(lines)


def _dynamic_step(engine: Engine, plan: Plan, task: RecallTask, manager: Any, step: int) -> float:
    """One step of length-aware dynamic CP (``train.dynamic``); returns the step's loss (the per-token mean
    over the pool's step, the same on every rank).

    The step's documents are those of the ``grad_accum x dp`` packed rows a static run trains on in this step;
    every rank plans them alike and cuts its micro-batches (``seqpar.sequence.dynamic_step.plan_step``), and
    ``seqpar.integrations.dynamic.run_dynamic_step`` runs them (each loss times dp, one reduction per step; the
    step's accumulation is not the engine's ``grad_accum``), then ``engine.update`` clips, updates and zeroes
    once."""
    from seqpar.integrations.dynamic import run_dynamic_step
    from seqpar.sequence.dynamic_step import plan_step

    rows = plan.train.grad_accum * manager.dp_size
    docs = [doc for row in range(step * rows, (step + 1) * rows) for doc in task.packed_docs(row)]
    planned = plan_step([ids for ids, _ in docs], manager, plan.sp.dynamic, labels=[labels for _, labels in docs],
                        sharding=plan.sp.sharding)
    return run_dynamic_step(engine.model, planned, deepspeed=plan.engine == "deepspeed", update=engine.update).item()


# ============================================================================ main
def main(argv: list[str] | None = None, on_step: Any = None) -> dict[str, Any]:
    """Train; returns the metrics dict (on every rank). Raises before training on a bad config.
    ``on_step(step)``, if given, is called on every rank after each optimizer step (launch/soak.py)."""
    args = parse_args(argv)
    _configure_logging(args.log_level)
    plan = build_plan(args)  # no process group yet: config errors surface first
    if args.validate_only:
        validate_model(plan)
        print(f"{args.config}: valid ({plan.engine}, sp size {plan.sp.size}, mode {plan.sp.mode})", flush=True)
        return {}
    from seqpar.sequence.batch import shard_batch
    from seqpar.sequence.loss import sequence_parallel_loss
    from seqpar.sequence.sharding import UNDECLARED_DEFAULT, padded_length

    task = RecallTask(plan.train)
    seq_padded = padded_length(plan.train.seq_len, plan.sp.size, plan.sp.sharding or UNDECLARED_DEFAULT)
    model = build_model(plan, task.vocab_size, seq_padded)
    n_params = sum(p.numel() for p in model.parameters())
    engine: Engine = (DeepSpeedEngine if plan.engine == "deepspeed" else FSDPEngine)(plan, model)
    manager = engine.manager
    if plan.train.dynamic and plan.train.compile:  # a large pool's groups must not silently run eagerly
        from seqpar.sequence.call_group import raise_recompile_limit

        raise_recompile_limit(manager.pool_size)
    _configure_logging(args.log_level)  # now that the rank is known
    rank0 = manager.rank == 0
    t = plan.train
    global_batch = t.micro_batch_size * t.grad_accum * manager.dp_size

    start = 0
    if args.resume:
        start = engine.load(args.save_dir)
        logger.info("[rank %d] resumed from step %d of %s", manager.rank, start, args.save_dir)
    if args.save_dir and rank0:
        os.makedirs(args.save_dir, exist_ok=True)

    bar = None
    if rank0 and not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=t.steps, initial=start, desc=f"{plan.engine} sp{manager.sp_size}",
                   dynamic_ncols=True, file=sys.stderr)
    losses: list[float] = []
    step_times: list[float] = []
    mem = _PeakMemory(engine, t)
    track_step = min(start + 1, t.steps - 1)
    for step in range(start, t.steps):
        engine.model.train()
        tic = time.perf_counter()
        tracking = step == track_step
        if tracking:
            mem.__enter__()
        total = torch.zeros((), dtype=torch.float64)
        for m in range(0 if t.dynamic else t.grad_accum):
            first = ((step * t.grad_accum + m) * manager.dp_size + manager.dp_rank) * t.micro_batch_size
            full = task.packed_batch(first) if t.packed else task.batch(first, t.micro_batch_size)
            batch = shard_batch(full, group=manager.sp_group, sharding=plan.sp.sharding)
            # The swapped model computes the SP loss itself: never the logits with a tiled loss, and
            # with its router losses (MoE, output_router_logits) added over the whole sequence.
            if plan.sp.tiled_loss or plan.model.get("output_router_logits"):
                loss = engine.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                                    shift_labels=batch["shift_labels"], **packed_kwargs(batch)).loss
            else:
                logits = engine.forward(batch)
                loss = sequence_parallel_loss(logits, batch["shift_labels"], group=manager.sp_group)
            engine.backward(loss, last_micro=m == t.grad_accum - 1)
            total += loss.detach().double() / t.grad_accum
        if t.dynamic:  # the planned micro-batches replace the grad_accum loop above (range(0))
            step_loss = _dynamic_step(engine, plan, task, manager, step)
        if tracking:
            mem.__exit__(None, None, None)
        if not t.dynamic:
            dist.all_reduce(total, group=manager.dp_group)
            step_loss = total.item() / manager.dp_size
        losses.append(step_loss)
        step_times.append(time.perf_counter() - tic)
        if not math.isfinite(step_loss):
            raise FloatingPointError(f"step {step}: loss is {step_loss}; lower the learning rate")
        if bar is not None:
            timed = step_times[1:] or step_times
            tps = global_batch * t.seq_len * len(timed) / sum(timed)
            bar.set_postfix(loss=f"{step_loss:.4f}", tok_s=f"{tps:.0f}")
            bar.update(1)
        elif rank0:  # --no-progress: a log line per step instead (repr: the exact value, for comparisons)
            logger.info("step %d/%d: loss %r", step + 1, t.steps, step_loss)
        done = step + 1
        if on_step is not None:
            on_step(done)
        if args.save_dir and ((t.save_every and done % t.save_every == 0) or done == t.steps):
            engine.save(args.save_dir, done)
    if bar is not None:
        bar.close()

    # Steady-state throughput: the first step of a run pays for lazy init and warm-up.
    timed = step_times[1:] if len(step_times) > 1 else step_times
    tokens_per_s = global_batch * t.seq_len * len(timed) / max(sum(timed), 1e-9)
    if mem.kind == "unknown":  # no step ran (resumed at the end)
        mem.kind = "not measured (no training step ran)"
    acc = None
    if t.eval_samples:
        acc = recall_accuracy(engine, task, plan, first=10**9)
    metrics: dict[str, Any] = {
        "loss": losses,
        "start_step": start,
        "steps": t.steps,
        "tokens_per_s": tokens_per_s,
        "step_seconds": step_times,
        "train_seconds": sum(step_times),
        "peak_mem_bytes": _all_gather(mem.value),
        "peak_mem_kind": mem.kind,
        "recall_accuracy": acc,
        "global_batch": global_batch,
        "engine": plan.engine,
        "world_size": manager.world_size,
        "sp_size": manager.sp_size,
        "dp_size": manager.dp_size,
        "mode": plan.sp.mode,
        "sharding": manager.sharding or "contiguous",  # the declared one, else the undeclared default
        "seq_len": t.seq_len,
        "dtype": t.dtype,
        "grad_accum": t.grad_accum,
        "activation_checkpointing": t.activation_checkpointing,
        "n_params": n_params,
    }
    if rank0:
        print(_summary(plan, manager, metrics, n_params), file=sys.stderr, flush=True)
        if args.metrics_out:
            os.makedirs(os.path.dirname(os.path.abspath(args.metrics_out)), exist_ok=True)
            with open(args.metrics_out, "w") as f:
                json.dump(metrics, f, indent=1)
    return metrics


def _cli() -> None:
    main()
    # Only after success: a rank that failed alone must not wait here for ranks stuck in a
    # collective; the launcher stops them when it exits non-zero.
    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # gloo can abort (SIGABRT) at exit when a rank destroys its group while a peer still uses it
        dist.destroy_process_group()


if __name__ == "__main__":
    _cli()
