"""recompute_norm (seqpar.memory.norm): the lean RMSNorm's forward is bitwise the Hugging Face module's,
its gradients equal the module's in float64 / fp32 and are no worse than the module's own bf16
rounding; it saves less; the swap applies it to the Llama family from the config and names what it
changed; an unknown norm class is refused, naming the module."""

from __future__ import annotations

import copy

import pytest
import torch
from hf_tiny import enable_checkpointing, family_config

from seqpar.config import ConfigError, SeqParConfig
from seqpar.memory.norm import NormError, apply_recompute_norm, lean_rms_norm
from seqpar.memory.tiling import TilingError, apply_tiling
from seqpar.memory.tracker import TensorMemoryTracker

transformers = pytest.importorskip("transformers")


def _norms() -> list[tuple[str, type]]:
    t = transformers.models
    return [("llama", t.llama.modeling_llama.LlamaRMSNorm), ("qwen2", t.qwen2.modeling_qwen2.Qwen2RMSNorm),
            ("mistral", t.mistral.modeling_mistral.MistralRMSNorm), ("phi3", t.phi3.modeling_phi3.Phi3RMSNorm),
            ("gemma", t.gemma.modeling_gemma.GemmaRMSNorm)]


def _pair(cls: type, dtype: torch.dtype, hidden: int = 40) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(11)
    hf = cls(hidden, eps=1e-5)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(hidden) * 0.5 + (0.0 if cls.__name__.startswith("Gemma") else 1.0))
    hf = hf.to(dtype)
    lean = copy.deepcopy(hf)
    assert apply_recompute_norm(lean) == [""]
    return hf, lean


def _run(module: torch.nn.Module, x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x = x.detach().clone().requires_grad_(True)
    module.zero_grad()
    out = module(x)
    out.backward(g)
    return out.detach(), x.grad, module.weight.grad


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral", "phi3", "gemma"])
def test_lean_norm_bitwise_forward_and_exact_gradients(name: str) -> None:
    cls = dict(_norms())[name]
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(2, 9, 40, generator=gen) * 3
    g = torch.randn(2, 9, 40, generator=gen)
    exact = _run(_pair(cls, torch.float64)[0], x.double(), g.double())
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        hf, lean = _pair(cls, dtype)
        for chunk_rows in (None, 5):  # one chunk, and 4 chunks of rows (the last one short)
            if chunk_rows:
                eps = lean.variance_epsilon if hasattr(lean, "variance_epsilon") else lean.eps
                formula = "gemma" if name == "gemma" else "llama"
                lean.forward = lambda t, m=lean, e=eps, f=formula: lean_rms_norm(t, m.weight, e, f, chunk_rows=5)
            ref, got = _run(hf, x.to(dtype), g.to(dtype)), _run(lean, x.to(dtype), g.to(dtype))
            assert torch.equal(got[0], ref[0]), (name, dtype)  # the same operations: bitwise
            assert torch.equal(got[1], ref[1]), (name, dtype)  # dx: the same row-wise operations
            assert got[2].dtype == ref[2].dtype
            if dtype == torch.bfloat16:
                # the weight's gradient summed in fp32: no worse than the module's own rounding, against
                # float64 on the same bf16 inputs (or within the final rounding to bf16)
                same = _run(copy.deepcopy(hf).double(), x.to(dtype).double(), g.to(dtype).double())[2]
                err_lean = (got[2].double() - same).abs().max().item()
                err_hf = (ref[2].double() - same).abs().max().item()
                half_ulp = same.abs().max().item() * 2.0**-8
                assert err_lean <= max(err_hf, half_ulp), (name, err_lean, err_hf, half_ulp)
            else:
                # summed in another order than the module's: equal to rounding (Gemma's module
                # computes in fp32 whatever the input dtype)
                fp32 = dtype == torch.float32 or name == "gemma"
                tol = (1e-6 if fp32 else 1e-13) * exact[2].abs().max()
                assert (got[2].double() - ref[2].double()).abs().max() <= tol, (name, dtype)
                assert (got[2].double() - exact[2]).abs().max() <= tol, (name, dtype)


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral", "phi3", "gemma"])
def test_lean_norm_without_grad_and_with_its_own_eps_is_the_module(name: str) -> None:
    """Evaluation (``torch.no_grad``: the lean forward's other branch) is bitwise the module's, for each
    formula, with a large epsilon of the module's own (1e-1: a wrong epsilon moves every output).
    Seen failing: the no-grad branch computing the Llama formula for every norm (Gemma's ``1 + weight``
    lost in evaluation, the grad-enabled path untouched), and the epsilon read as a fixed 1e-6."""
    cls = dict(_norms())[name]
    torch.manual_seed(13)
    hf = cls(24, eps=1e-1)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(24) * 0.5 + (0.0 if name == "gemma" else 1.0))
    lean = copy.deepcopy(hf)
    apply_recompute_norm(lean)
    x = torch.randn(3, 7, 24) * 0.2  # a mean square near eps: the epsilon is a large part of the RMS
    with torch.no_grad():
        assert torch.equal(lean(x), hf(x)), name
    x_hf, x_lean = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_hf, out_lean = hf(x_hf), lean(x_lean)
    assert torch.equal(out_lean, out_hf), name
    g = torch.randn_like(x)
    out_hf.backward(g)
    out_lean.backward(g)
    assert torch.equal(x_lean.grad, x_hf.grad), name


def test_lean_norm_saves_only_its_input() -> None:
    cls = dict(_norms())["llama"]
    hf, lean = _pair(cls, torch.bfloat16, hidden=64)
    x = torch.randn(256, 64, dtype=torch.bfloat16, requires_grad=True)

    def saved_bytes(module: torch.nn.Module) -> int:
        storages: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            s = t.untyped_storage()
            if t is not module.weight and s.data_ptr() != module.weight.untyped_storage().data_ptr():
                storages[s.data_ptr()] = s.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            module(x)
        return sum(storages.values())

    unit = x.numel() * 2
    # HF: the fp32 upcast (2 units) and the normalised bf16 copy (1); lean: the input only (1)
    assert saved_bytes(hf) >= 3 * unit
    assert saved_bytes(lean) == unit

    # forward + backward over row chunks: the recompute's fp32 copies are one chunk's, so the step's
    # peak (output, dx and a chunk's temporaries) is below the module's (measured: 13 -> 4.1 units)
    def peak(fn) -> int:
        xx = x.detach().clone().requires_grad_(True)
        g = torch.randn_like(xx)
        with TensorMemoryTracker(count_existing=False) as tr:
            fn(xx).backward(g)
        return tr.peak

    hf_peak = peak(hf)
    lean_peak = peak(lambda t: lean_rms_norm(t, lean.weight, lean.variance_epsilon, chunk_rows=16))
    assert hf_peak >= 10 * unit and lean_peak <= 5 * unit, (hf_peak / unit, lean_peak / unit)



def _family(name: str) -> tuple[type, object]:
    t = transformers
    return {
        "llama": (t.LlamaForCausalLM, lambda: t.LlamaConfig(**_cfg())),
        "qwen2": (t.Qwen2ForCausalLM, lambda: t.Qwen2Config(**_cfg())),
        "mistral": (t.MistralForCausalLM, lambda: t.MistralConfig(**_cfg(sliding_window=None))),
        "phi3": (t.Phi3ForCausalLM, lambda: t.Phi3Config(**_cfg(pad_token_id=0))),
        "gemma": (t.GemmaForCausalLM, lambda: t.GemmaConfig(**_cfg(head_dim=8))),
    }[name]


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral", "phi3", "gemma"])
def test_swap_config_applies_it_to_the_model_exactly(name: str) -> None:
    from seqpar.swap import swap_attention

    cls, make_cfg = _family(name)
    cfg = make_cfg()
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(4)
    model = cls(cfg)
    ref = copy.deepcopy(model)
    report = swap_attention(model, {"size": 1, "recompute_norm": True}).tiling  # the swap applies it
    # under activation checkpointing too: the recompute runs the lean norm's forward again
    enable_checkpointing(model)
    model.train()
    ref.train()
    assert report.norms == ["model.layers.0.input_layernorm", "model.layers.0.post_attention_layernorm",
                            "model.layers.1.input_layernorm", "model.layers.1.post_attention_layernorm",
                            "model.norm"], report
    assert "recompute_norm on 5 modules" in str(report)
    ids = torch.randint(0, cfg.vocab_size, (2, 24))
    out, want = model(input_ids=ids, labels=ids), ref(input_ids=ids, labels=ids)
    assert torch.equal(out.logits, want.logits)
    out.loss.backward()
    want.loss.backward()
    grads = dict(ref.named_parameters())
    for pname, p in model.named_parameters():
        r = grads[pname].grad
        torch.testing.assert_close(p.grad, r, rtol=1e-5, atol=1e-6 * r.abs().max().item(), msg=pname)


def test_unknown_norm_refused_naming_the_module_and_config_key_checked() -> None:
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_cfg()))
    model.model.layers[1].post_attention_layernorm = torch.nn.LayerNorm(32)
    with pytest.raises(TilingError, match=r"model\.layers\.1\.post_attention_layernorm.*LayerNorm.*recompute_norm"):
        apply_tiling(model, {"recompute_norm": True})
    assert not getattr(model.model.layers[0].input_layernorm, "_seqpar_lean_norm", False)  # nothing changed
    with pytest.raises(NormError, match="LayerNorm"):
        apply_recompute_norm(model)
    assert SeqParConfig().recompute_norm is False
    assert SeqParConfig.from_dict({"recompute_norm": True}).recompute_norm is True
    for bad in ("yes", 1, None):
        with pytest.raises(ConfigError, match="sequence_parallel.recompute_norm"):
            SeqParConfig.from_dict({"recompute_norm": bad})


def _cfg(**kw):
    return family_config(vocab_size=97, intermediate_size=64, max_position_embeddings=64, **kw)
