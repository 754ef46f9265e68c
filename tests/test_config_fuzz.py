"""Config fuzzing: seeded mutations of the shipped configs' ``sequence_parallel``, ``model`` and
``train`` blocks either validate or fail naming the key, before any process group exists.

The launcher's validation (``launch/train.py: validate``, the in-process form of ``--validate-only``)
runs in this process: 200 mutations cost about a second, not 200 launcher start-ups. A mutation
passes when it validates, or raises ``ValueError`` (``ConfigError`` is one) whose message names the
mutated key; any other exception (a ``TypeError`` from deep inside transformers, torch or DeepSpeed)
is a failure. A few valid mutations also train one step on two ranks.

Validating is not enough: a mutation that validates must hold a value inside the type and range its
field's documentation states (:data:`STATED`: transcribed from the docstrings of
``seqpar.config.SeqParConfig`` and ``launch/train.py``'s ``TrainSettings``, and the model sizes'
``MODEL_SIZE_RANGES``), or validation let a wrong value through (``num_hidden_layers=10**12`` did).
Every field of every block has an entry, so a new field must state its range here too.
"""

from __future__ import annotations

import copy
import dataclasses
import glob
import importlib.util
import json
import math
import os
import random
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.json")))
N_MUTATIONS = 200
SEED = 13


def _train_module() -> Any:
    name = "seqpar_launch_train"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "launch", "train.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _block_keys(block: str) -> list[str]:
    from seqpar.config import SeqParConfig

    if block == "sequence_parallel":
        return [f.name for f in dataclasses.fields(SeqParConfig)]
    if block == "train":
        return [f.name for f in dataclasses.fields(_train_module().TrainSettings)]
    return ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "vocab_size", "head_dim", "hidden_act", "rms_norm_eps",
            "max_position_embeddings"]


# values that break types; out-of-range numbers; sizes chosen not to divide the shipped ones
_WRONG_TYPES = ["two", [2], {"a": 1}, None, True, 1.5, -0.0]
_OUT_OF_RANGE = [0, -1, -7, 10**12, float("nan"), float("inf")]
_NON_DIVIDING = {
    "size": [3, 5], "ulysses_size": [3, 4], "head_chunks": [3, 5], "hidden_size": [63, 66],
    "num_key_value_heads": [3], "num_attention_heads": [3, 5], "seq_len": [7, 33],
    "num_pairs": [65, 500], "tiled_mlp": [7],
}


@dataclasses.dataclass
class Mutation:
    config: str
    block: str
    kind: str  # wrong_type | out_of_range | unknown | missing | non_dividing
    key: str
    value: Any = None

    def apply(self, raw: dict[str, Any]) -> dict[str, Any]:
        raw = copy.deepcopy(raw)
        block = raw.setdefault(self.block, {})
        if self.kind == "missing":
            block.pop(self.key, None)
        else:
            block[self.key] = self.value
        return raw


def _mutations() -> list[Mutation]:
    rng = random.Random(SEED)
    out = []
    for _ in range(N_MUTATIONS):
        config = rng.choice(CONFIGS)
        block = rng.choice(["sequence_parallel", "model", "train"])
        kind = rng.choice(["wrong_type", "out_of_range", "unknown", "missing", "non_dividing"])
        if kind == "non_dividing":
            key = rng.choice(sorted(_NON_DIVIDING))
            block = ("sequence_parallel" if key in ("size", "ulysses_size", "head_chunks", "tiled_mlp")
                     else "model" if key in ("hidden_size", "num_key_value_heads", "num_attention_heads")
                     else "train")
            out.append(Mutation(config, block, kind, key, rng.choice(_NON_DIVIDING[key])))
            continue
        if kind == "unknown":
            key = rng.choice(_block_keys(block))
            typos = [t for t in (key[:-1], key + "s", key.replace("_", ""), "extra_" + key)
                     if t not in _block_keys(block)]  # "seeds"[:-1] is a real key
            typo = rng.choice(typos)
            out.append(Mutation(config, block, kind, typo, 1))
            continue
        key = rng.choice(_block_keys(block))
        pool = _WRONG_TYPES if kind == "wrong_type" else _OUT_OF_RANGE
        out.append(Mutation(config, block, kind, key, rng.choice(pool)))
    return out


MUTATIONS = _mutations()


def _validate(mutation: Mutation, tmp_path) -> Any:
    """The launcher's validation on the mutated config; returns the plan or the exception."""
    with open(mutation.config) as f:
        raw = mutation.apply(json.load(f))
    path = tmp_path / "mutated.json"
    path.write_text(json.dumps(raw))
    try:
        return _train_module().validate(["--config", str(path)])
    except ValueError as e:  # ConfigError is a ValueError
        return e


# ----------------------------------------------------------------------------- stated ranges
def _is_int(v: Any, low: int = 1, high: float = math.inf) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and low <= v <= high


def _is_number(v: Any, low: float = 0.0) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= low


def _one_of(*choices: Any) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, (str, type(None))) and v in choices


def _is_bool(v: Any) -> bool:
    return isinstance(v, bool)


def _stated() -> dict[tuple[str, str], Callable[[Any], bool]]:
    """(block, key) -> whether a value lies inside the type and range the field's docstring states."""
    from seqpar.config import MODES, SHARDINGS

    sizes = _train_module().MODEL_SIZE_RANGES
    stated: dict[tuple[str, str], Callable[[Any], bool]] = {
        # seqpar.config.SeqParConfig
        ("sequence_parallel", "size"): _is_int,  # a positive integer
        ("sequence_parallel", "mode"): _one_of(*MODES),
        ("sequence_parallel", "ulysses_size"): lambda v: v == "auto" or _is_int(v),  # dividing size: checked
        ("sequence_parallel", "tp_size"): _is_int,  # a positive integer (world = dp x size x tp_size: checked)
        ("sequence_parallel", "tp_sequence_parallel"): _is_bool,  # needs tp_size > 1: checked
        ("sequence_parallel", "tp_loss_parallel"): lambda v: v is True or v is False or v == "auto",  # true: tp_size > 1
        ("sequence_parallel", "mla_transfer"): _one_of("latent", "expanded"),
        ("sequence_parallel", "mixer_kernels"): _one_of("torch", "auto"),
        ("sequence_parallel", "links"): lambda v: v is None or isinstance(v, dict),
        ("sequence_parallel", "sharding"): _one_of(None, *SHARDINGS),
        ("sequence_parallel", "overlap"): _is_bool,
        ("sequence_parallel", "check_inputs"): _is_bool,
        ("sequence_parallel", "head_chunks"): lambda v: v == "auto" or _is_int(v),
        ("sequence_parallel", "swap"): lambda v: isinstance(v, str) or (
            isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v)),
        ("sequence_parallel", "pattern"): lambda v: isinstance(v, dict),
        ("sequence_parallel", "apex"): _is_bool,
        ("sequence_parallel", "timeout_s"): lambda v: v is None or _is_int(v),  # seconds, or None
        ("sequence_parallel", "check_finite"): _is_bool,
        ("sequence_parallel", "high_priority_streams"): _is_bool,
        ("sequence_parallel", "tiled_loss"): _is_bool,
        ("sequence_parallel", "tiled_mlp"): lambda v: v is False or v == "auto" or _is_int(v),
        ("sequence_parallel", "offload_activations"): _is_bool,
        ("sequence_parallel", "recompute_norm"): _is_bool,
        ("sequence_parallel", "dynamic"): lambda v: v is None or isinstance(v, dict),  # {"max_tokens_per_rank": N, ...}
        ("sequence_parallel", "dkv_wire_dtype"): _one_of("fp32", "bf16"),  # bf16 not with allgather/ulysses: checked
        # launch/train.py TrainSettings
        ("train", "engine"): _one_of("auto", "deepspeed", "fsdp"),
        ("train", "dtype"): _one_of("fp32", "bf16", "fp16"),
        ("train", "optimizer"): _one_of("adamw", "sgd"),
        **{("train", k): _is_int for k in ("seq_len", "steps", "micro_batch_size", "grad_accum", "num_pairs",
                                           "num_queries", "num_keys", "num_values", "filler_vocab")},
        **{("train", k): (lambda v: _is_int(v, 0)) for k in ("seed", "eval_samples", "save_every")},
        **{("train", k): _is_number for k in ("lr", "weight_decay", "grad_clip")},  # finite, >= 0
        ("train", "activation_checkpointing"): _is_bool,
        ("train", "packed"): _is_bool,
        ("train", "packed_lengths"): _one_of("log-uniform", "log-normal"),
        **{("train", k): _is_int for k in ("packed_median", "packed_min")},
        ("train", "packed_sigma"): _is_number,
        ("train", "dynamic"): lambda v: v is False,  # True needs train.packed and sequence_parallel.dynamic
        ("train", "compile"): _is_bool,
        ("train", "compile_backend"): lambda v: isinstance(v, str) and v in _train_module().compile_backends(),
        # the model block: sizes within MODEL_SIZE_RANGES (head_dim may be None: from hidden_size)
        **{("model", k): (lambda v, lo=lo, hi=hi: _is_int(v, lo, hi)) for k, (lo, hi) in sizes.items()},
        ("model", "hidden_act"): lambda v: isinstance(v, str),  # a transformers activation name
        ("model", "rms_norm_eps"): lambda v: _is_number(v) and v > 0,
    }
    head_dim = stated[("model", "head_dim")]
    stated[("model", "head_dim")] = lambda v: v is None or head_dim(v)
    return stated


STATED = _stated()


def test_every_field_states_its_range():
    for block in ("sequence_parallel", "model", "train"):
        missing = [k for k in _block_keys(block) if (block, k) not in STATED]
        assert not missing, f"{block}: no stated type and range for {missing}"


def test_mutations_cover_every_kind_and_block():
    kinds = {(m.block, m.kind) for m in MUTATIONS}
    for block in ("sequence_parallel", "model", "train"):
        for kind in ("wrong_type", "out_of_range", "unknown", "missing", "non_dividing"):
            if kind == "non_dividing" and block not in ("sequence_parallel", "model", "train"):
                continue
            assert (block, kind) in kinds, (block, kind)


def test_each_mutation_validates_or_names_the_key(tmp_path):
    outcomes = {"valid": 0, "refused": 0}
    for i, mutation in enumerate(MUTATIONS):
        result = _validate(mutation, tmp_path)  # any non-ValueError propagates: a test failure
        assert not (dist.is_available() and dist.is_initialized()), "validation created a process group"
        if isinstance(result, ValueError):
            message = str(result)
            assert mutation.key in message, f"mutation {i} {mutation}: the error does not name the key: {message}"
            outcomes["refused"] += 1
        else:
            assert mutation.kind in ("missing", "out_of_range", "wrong_type", "non_dividing"), (
                f"mutation {i} {mutation}: an unknown key validated")
            assert mutation.kind == "missing" or STATED[mutation.block, mutation.key](mutation.value), (
                f"mutation {i} {mutation}: {mutation.block}.{mutation.key} = {mutation.value!r} validated, but "
                "lies outside the type and range its documentation states"
            )
            outcomes["valid"] += 1
    # the fuzz must exercise both outcomes, or it tests nothing
    assert outcomes["refused"] > 100 and outcomes["valid"] > 5, outcomes


def test_validate_only_flag_exits_before_any_process_group(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"sequence_parallel": {"size": 2}, "model": {"hidden_size": 65},
                               "train": {"engine": "fsdp"}}))
    with pytest.raises(ValueError, match="hidden_size"):
        _train_module().main(["--config", str(bad), "--validate-only"])
    assert _train_module().main(["--config", CONFIGS[0], "--validate-only"]) == {}
    assert "valid" in capsys.readouterr().out
    assert not dist.is_initialized()


def _train_one_step(rank: int, world: int, argv: list[str]) -> list[float]:
    from launch_module import run_main

    return run_main(argv)["loss"]


def test_valid_mutations_train_one_step(dist_pool, tmp_path):
    plans = [(m, _validate(m, tmp_path)) for m in MUTATIONS if m.kind != "unknown"]
    valid = [m for m, plan in plans if not isinstance(plan, ValueError) and 2 % plan.sp.size == 0]
    # cheap ones (the flags below bound the run)
    picked = {}
    for m in valid:
        engine = "deepspeed" if "deepspeed" in os.path.basename(m.config) else "fsdp"
        if engine not in picked and m.block != "train":
            picked[engine] = m
    assert len(picked) == 2, picked
    picked.pop("deepspeed")  # one valid mutation per engine costs ~1 min on the shared 2 cores; keep FSDP
    for i, m in enumerate(picked.values()):
        with open(m.config) as f:
            raw = m.apply(json.load(f))
        raw.get("sequence_parallel", {}).pop("pattern", None)  # dilated segments need the full length
        path = tmp_path / f"valid{i}.json"
        path.write_text(json.dumps(raw))
        argv = ["--config", str(path), "--steps", "1", "--seq-len", "128", "--no-progress",
                "--log-level", "WARNING"]
        raw.setdefault("train", {})["eval_samples"] = 0
        path.write_text(json.dumps(raw))
        losses = dist_pool.run(2, _train_one_step, argv, timeout=180)
        assert len(losses[0]) == 1 and losses[0] == losses[1], (m, losses)
        assert losses[0][0] == losses[0][0] and 0 < losses[0][0] < 100, (m, losses)
