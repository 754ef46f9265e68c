"""What ``launch/train.py`` runs: the ``"train"`` block of its config (:class:`TrainSettings`, one field per key, each
with a flag of the same name, checked when it is built) and the :class:`Plan` resolved from the whole config and the
flags (by ``seqpar_launch.plan.build_plan``)."""

# TrainSettings checks its fields against their annotations, read as strings
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from seqpar_launch.config_file import did_you_mean

__all__ = ["Plan", "TrainSettings", "compile_backends"]


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
            hints = "".join(did_you_mean(key, known) for key in unknown)
            raise ValueError(f"unknown key(s) {unknown} in 'train'{hints}; allowed keys are {sorted(known)}")
        return cls(**d)


def compile_backends() -> list[str]:
    """The ``torch.compile`` backends registered in this process (``train.compile_backend``'s choices)."""
    from torch._dynamo import list_backends

    return list_backends(exclude_tags=())


@dataclass
class Plan:
    """Everything resolved from the JSON and the flags, validated before any process group exists."""

    engine: str
    train: TrainSettings
    sp: Any  # SeqParConfig
    model: dict[str, Any]
    engine_config: dict[str, Any] = field(default_factory=dict)  # DeepSpeed JSON or "fsdp" section
