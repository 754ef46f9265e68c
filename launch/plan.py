"""The run of ``launch/train.py`` resolved: the config file and the flags into one checked :class:`Plan` (the ``train``
block, the ``sequence_parallel`` block, the ``model`` block, the engine's own config), in named steps, before any
process group exists: a bad key fails here, naming it and the fix."""

from __future__ import annotations

import argparse
from typing import Any

import torch
from seqpar_launch.config_file import DEEPSPEED_KEYS, LAUNCHER_KEYS, check_top_level, load_json
from seqpar_launch.model import check_model_keys
from seqpar_launch.settings import Plan, TrainSettings

__all__ = ["build_plan"]

TRAIN_FLAGS = ("engine", "seq_len", "steps", "seed", "micro_batch_size", "grad_accum", "lr", "optimizer",
               "dtype", "activation_checkpointing", "save_every", "packed", "compile", "compile_backend", "dynamic")
"""The flags that override a key of the ``train`` block (the flag's dest is the key's name)."""


def build_plan(args: argparse.Namespace) -> Plan:
    """Read the config, apply the flags, validate; raises ConfigError/ValueError with a fix."""
    raw = load_json(args.config)
    train = _train_settings(raw, args)
    engine = train.engine
    if engine == "auto":
        engine = "deepspeed" if any(k in raw for k in DEEPSPEED_KEYS) else "fsdp"
    check_top_level(raw, engine, args.config)
    sp = _sequence_parallel(raw, args)
    _check_tp(raw, sp, engine, dict(raw.get("model") or {}))
    _check_dynamic(train, sp)
    _check_tp_sequence_parallel(sp, engine)
    model = dict(raw.get("model") or {})
    check_model_keys(model, train)
    if raw.get("fsdp"):
        from seqpar.integrations.fsdp import FSDPOptions

        FSDPOptions.from_dict(dict(raw["fsdp"]))  # unknown keys fail now, whichever engine runs
    if sp.pattern.type == "dilated":
        _check_dilated_pattern(sp, train, model)
    if sp.head_chunks != "auto":
        _check_head_chunks(sp, model)
    engine_config = _deepspeed_config(raw, args, train, sp) if engine == "deepspeed" else _fsdp_config(raw, args, train)
    return Plan(engine=engine, train=train, sp=sp, model=model, engine_config=engine_config)


def _train_settings(raw: dict[str, Any], args: argparse.Namespace) -> TrainSettings:
    """The ``train`` block with the flags that were given applied over it."""
    from seqpar.config import ConfigError

    if not isinstance(raw.get("train") or {}, dict):
        raise ConfigError(f"--config {args.config}: 'train' must be a JSON object")
    train_d = dict(raw.get("train") or {})
    for name in TRAIN_FLAGS:
        value = getattr(args, name, None)
        if value is not None:
            train_d[name] = value
    return TrainSettings.from_dict(train_d)


def _sequence_parallel(raw: dict[str, Any], args: argparse.Namespace) -> Any:
    """The ``sequence_parallel`` block (a ``SeqParConfig``) with the flags that were given applied over it;
    ``--tp-size`` also sets DeepSpeed's ``tensor_parallel.autotp_size`` in ``raw`` when the config has one."""
    from seqpar.config import SeqParConfig

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
    return sp


def _check_dynamic(train: TrainSettings, sp: Any) -> None:
    """``--dynamic`` plans with the ``sequence_parallel.dynamic`` block: it must be there, with a
    ``max_tokens_per_rank`` the sharding's cut can keep (a multiple of what it pads each rank's share to)."""
    from seqpar.config import ConfigError

    if train.dynamic and sp.dynamic is None:
        raise ConfigError(
            "--dynamic (train.dynamic) needs a \"sequence_parallel\": {\"dynamic\": {\"max_tokens_per_rank\": N, "
            "\"min_size\": 1}} block"
        )
    if train.dynamic and sp.dynamic is not None:
        # the cut of every planned micro-batch checks this once the job runs; sharding and budget are both in the
        # config, so --validate-only says it before any job is queued, in the runtime's words
        from seqpar.sequence.batch import dynamic_budget_problem

        problem = dynamic_budget_problem(sp.dynamic.max_tokens_per_rank, sp.sharding or "contiguous")
        if problem is not None:  # undeclared sharding: the calls' default, contiguous
            raise ConfigError(problem)


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


def _check_dilated_pattern(sp: Any, train: TrainSettings, model: dict[str, Any]) -> None:
    """A dilated pattern's shape rules need the sequence and head counts: checked now, before any process group
    or model exists."""
    from seqpar.attn.dilated import check_pattern
    from seqpar.config import ConfigError
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


def _check_head_chunks(sp: Any, model: dict[str, Any]) -> None:
    """``sequence_parallel.head_chunks`` against the model's K/V heads (when the block gives them)."""
    from seqpar.attn import resolve_head_chunks
    from seqpar.config import ConfigError

    kv_heads = model.get("num_key_value_heads") or model.get("num_attention_heads")
    if isinstance(kv_heads, int):
        try:
            resolve_head_chunks(sp.head_chunks, kv_heads)
        except ValueError as e:
            raise ConfigError(f"sequence_parallel.head_chunks does not fit the model: {e}") from None


def _deepspeed_config(raw: dict[str, Any], args: argparse.Namespace, train: TrainSettings, sp: Any) -> dict[str, Any]:
    """The DeepSpeed config the engine gets: the JSON without the launcher's blocks, the ``sequence_parallel`` block
    resolved, the flags applied, and from the ``train`` block what DeepSpeed's keys leave unset. Sets ``train``'s
    micro-batch size, accumulation and dtype to what DeepSpeed will run with."""
    from seqpar.config import ConfigError

    ds = {k: v for k, v in raw.items() if k not in LAUNCHER_KEYS}
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
    return ds


def _fsdp_config(raw: dict[str, Any], args: argparse.Namespace, train: TrainSettings) -> dict[str, Any]:
    """The ``fsdp`` block the engine gets (``seqpar.integrations.fsdp.FSDPOptions``' keys), bf16 mixed precision
    filled in from ``train.dtype``."""
    from seqpar.config import ConfigError

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
    return fsdp_d
