"""The model of ``launch/train.py``: the ``"model"`` block checked (its keys, sizes and transformers' own validators,
on no device) and the seeded random-init model built from it (a Llama by default; ``model.architecture`` names
another transformers model type)."""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
from typing import Any

import torch
from seqpar_launch.config_file import did_you_mean
from seqpar_launch.recall import RecallTask
from seqpar_launch.settings import Plan, TrainSettings

__all__ = ["ARCHITECTURE_KEY", "MODEL_SIZE_RANGES", "PROBE_MAX_PARAMS", "build_model", "check_model_keys", "check_swap",
           "config_class", "llama_config", "model_keys", "validate_model"]


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
                          f"{did_you_mean(str(arch), known)}; e.g. 'llama', 'mixtral', 'qwen3_moe'")
    return CONFIG_MAPPING[arch]


def model_keys(model: dict[str, Any] | None = None) -> list[str]:
    """The fields the ``"model"`` block's config class takes (it would store any other key silently)."""
    cls = config_class(model or {})
    if dataclasses.is_dataclass(cls):
        return sorted(f.name for f in dataclasses.fields(cls))
    params = inspect.signature(cls.__init__).parameters.values()
    return sorted(p.name for p in params if p.name != "self" and p.kind is not p.VAR_KEYWORD)


def check_model_keys(model: dict[str, Any], train: TrainSettings) -> None:
    """Unknown ``model`` keys fail by name; ``vocab_size`` must hold the recall task's tokens."""
    from seqpar.config import ConfigError

    known = model_keys(model)
    for key in model:
        if key != ARCHITECTURE_KEY and key not in known:
            raise ConfigError(f"unknown key {key!r} in 'model'{did_you_mean(key, known)}; allowed keys are "
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
    try:
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    except ValueError as e:  # a model without transformers' SDPA path (GPT-Neo): its eager one, which the swap
        if "scaled_dot_product_attention" not in str(e):  # replaces or refuses by name, not this traceback
            raise
        cfg._attn_implementation = "eager"
        torch.manual_seed(plan.train.seed)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    if plan.train.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


PROBE_MAX_PARAMS = 2**26
"""The largest model :func:`check_swap` builds with real weights (64M parameters, 256 MiB in fp32: a few seconds);
a larger one is built on the meta device, where the swap checks its modules but leaves the position-mixing probe,
which needs numbers, to the job's first forward."""


def check_swap(plan: Plan) -> str | None:
    """The swap's refusals, in this process, on the model the job would build (``--validate-only``): the model of
    the ``model`` block, seeded as the job seeds it, then ``seqpar.swap.swap_attention`` with the
    ``sequence_parallel`` block and no process group (world 1, no manager: the swap's checks and its
    position-mixing probe need none; the swap's ``size`` check has no group to compare with). Raises the
    ``SwapError`` the job would raise. Returns a note when the probe was left to the job (a model above
    :data:`PROBE_MAX_PARAMS`, built on the meta device), else None."""
    from seqpar.sequence.sharding import UNDECLARED_DEFAULT, padded_length

    if plan.sp.swap == "none":
        return None
    from seqpar.swap import swap_attention

    task = RecallTask(plan.train)
    seq_padded = padded_length(plan.train.seq_len, plan.sp.size, plan.sp.sharding or UNDECLARED_DEFAULT)
    with torch.device("meta"):
        model = build_model(plan, task.vocab_size, seq_padded)
    n_params = sum(p.numel() for p in model.parameters())
    note = None
    if n_params <= PROBE_MAX_PARAMS:
        model = build_model(plan, task.vocab_size, seq_padded)
    else:
        note = (f"the model has {n_params:,} parameters (> {PROBE_MAX_PARAMS:,}): its modules were checked on the "
                "meta device; the position-mixing probe runs at the job's first forward")
    swap_attention(model, plan.sp)
    return note
