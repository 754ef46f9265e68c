"""``mixer_kernels`` (issue 28 §1): flash-linear-attention and mamba_ssm are opt-in.

Neither has run on a GPU under seqpar, and their dt rounding differs from the torch path that seqpar's
state correction mirrors, so the default (``"torch"``) keeps transformers' torch functions even where a
kernel is importable on a kernel device; ``"auto"`` dispatches to it. Here the kernels are faked (modules
that count their calls and run the torch path) and "cpu" is made a kernel device.
"""

from __future__ import annotations

import functools
import inspect
import sys
import types

import pytest
import torch

from seqpar.config import MIXER_KERNELS, ConfigError, SeqParConfig
from seqpar.mixers import delta_rule
from seqpar.mixers import mamba as mamba_family
from seqpar.mixers.kernels import use_kernels
from seqpar.swap import swap_attention
from seqpar.swap.options import SwapOptions

transformers = pytest.importorskip("transformers")

VOCAB = 32


# ----------------------------------------------------------------------------------------- config
def test_mixer_kernels_config_default_values_and_errors() -> None:
    assert MIXER_KERNELS == ("torch", "auto")
    assert SeqParConfig().mixer_kernels == "torch"
    assert SeqParConfig.load({}).mixer_kernels == "torch"
    assert SeqParConfig.load({"sequence_parallel": {"mixer_kernels": "auto"}}).mixer_kernels == "auto"
    for bad in ("cuda", "fla", "Torch", "", 1, True, None):
        with pytest.raises(ConfigError, match=r"sequence_parallel\.mixer_kernels = .* is invalid: choose one of "
                                              r"\['torch', 'auto'\]"):
            SeqParConfig.from_dict({"mixer_kernels": bad})
    for value in MIXER_KERNELS:  # reaches the swap's options
        cfg = SeqParConfig.from_dict({"mixer_kernels": value})
        assert SwapOptions.from_config(cfg, None).mixer_kernels == value
    assert SwapOptions().mixer_kernels == "torch"


def test_use_kernels_only_under_auto_on_a_kernel_device() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert use_kernels("auto", cuda, {"cuda"})
    assert not use_kernels("torch", cuda, {"cuda"})
    assert not use_kernels("auto", cpu, {"cuda"})
    with pytest.raises(ValueError, match=r"mixer_kernels='fla' is invalid: choose one of \['torch', 'auto'\]"):
        use_kernels("fla", cuda, {"cuda"})


# ------------------------------------------------------------------------------- model-level dispatch
def _batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(3, VOCAB, (1, 16), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


def _swap_and_run(model: torch.nn.Module, mixer_kernels: str | None) -> list[str]:
    """Swap on one process with the given ``mixer_kernels`` (None: the config's default), run forward and
    backward; returns the swapped mixers' ``mixer_kernels``."""
    report = swap_attention(model, None if mixer_kernels is None else {"mixer_kernels": mixer_kernels})
    out = model(**_batch())
    out.loss.backward()
    mixers = [model.get_submodule(m.name) for m in report if m.route == "mixer"]
    assert mixers, str(report)
    return [m.mixer_kernels for m in mixers]


@pytest.mark.parametrize("mixer_kernels", [None, "torch", "auto"])
def test_gdn_flash_linear_attention_only_under_auto(monkeypatch: pytest.MonkeyPatch, mixer_kernels: str | None) -> None:
    """A tiny Qwen3-Next with flash-linear-attention importable (faked) on a kernel device: the default
    and ``"torch"`` run transformers' torch path, ``"auto"`` the kernel."""
    import transformers.models.qwen3_next.modeling_qwen3_next as qwen3_next

    torch_path = inspect.unwrap(qwen3_next.torch_chunk_gated_delta_rule)
    calls = []

    def chunk_gated_delta_rule(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append(1)
        return torch_path(*args, **kwargs)

    module, name = delta_rule.FLA_KERNELS["gdn"]
    parts = module.split(".")
    for i in range(1, len(parts) + 1):
        monkeypatch.setitem(sys.modules, ".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    setattr(sys.modules[module], name, chunk_gated_delta_rule)
    monkeypatch.setattr(delta_rule, "KERNEL_DEVICES", {"cpu"})

    cfg = transformers.Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, head_dim=8, linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"], num_experts=2,
        num_experts_per_tok=1, moe_intermediate_size=16, shared_expert_intermediate_size=16, use_cache=False)
    torch.manual_seed(0)
    kernels = _swap_and_run(transformers.Qwen3NextForCausalLM(cfg), mixer_kernels)
    assert kernels == [mixer_kernels or "torch"]
    assert bool(calls) == (mixer_kernels == "auto"), (mixer_kernels, calls)


@pytest.mark.parametrize("mixer_kernels", [None, "auto"])
def test_mamba_selective_scan_kernel_only_under_auto(monkeypatch: pytest.MonkeyPatch, mixer_kernels: str | None) -> None:
    """Mamba (Jamba): transformers' hub-kernel wrapper (mamba_ssm's selective_scan_fn where transformers
    finds it) only under ``"auto"`` on a kernel device; else the torch function beneath it."""
    import transformers.models.jamba.modeling_jamba as jamba

    torch_scan = inspect.unwrap(jamba.mamba_selective_scan)
    calls = []

    @functools.wraps(torch_scan)  # __wrapped__: the torch path, as transformers' decorator leaves it
    def hub_wrapper(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append(1)
        return torch_scan(*args, **kwargs)

    monkeypatch.setattr(jamba, "mamba_selective_scan", hub_wrapper)
    monkeypatch.setattr(mamba_family, "KERNEL_DEVICES", {"cpu"})
    cfg = transformers.JambaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_attention_heads=4,
                                   num_key_value_heads=4, mamba_d_state=4, mamba_d_conv=4, mamba_expand=2,
                                   mamba_dt_rank=4, num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1,
                                   expert_layer_period=2, expert_layer_offset=1, num_experts=1, use_cache=False)
    torch.manual_seed(0)
    kernels = _swap_and_run(transformers.JambaForCausalLM(cfg), mixer_kernels)
    assert kernels == [mixer_kernels or "torch"]
    assert bool(calls) == (mixer_kernels == "auto"), (mixer_kernels, calls)
