"""The installed wheel, imported from outside the checkout (issue 28 §4), run by .ci/wheel.

Imports every subpackage and module of the installed ``seqpar`` (``seqpar.integrations`` included,
which comes from ``integrations/`` through ``package_dir``), then swaps a tiny Llama (attention only)
and a tiny Jamba (a Mamba mixer, so ``seqpar.mixers`` must be in the wheel) at SP = 1 and checks that
each trains one step with the same loss and gradients as the unswapped model.
"""

from __future__ import annotations

import copy
import importlib
import pkgutil
import sys
from pathlib import Path

import torch
import transformers

import seqpar

checkout = Path(sys.argv[1]).resolve()
where = Path(seqpar.__file__).resolve()
assert checkout not in where.parents, f"seqpar was imported from the checkout ({where}), not the wheel"
assert "site-packages" in where.parts, where

# modules that need an optional package the wheel's smoke environment does not install: importing them
# may fail only for that package (the fused merge's Triton kernel: triton ships with torch's CUDA build)
OPTIONAL = {"seqpar.kernels.merge_triton": "triton"}
names = [m.name for m in pkgutil.walk_packages(seqpar.__path__, "seqpar.")]
for name in names:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as error:
        if OPTIONAL.get(name) != error.name:
            raise
        print(f"skipped {name}: needs {error.name}, an optional package not installed here")
packages = sorted(n for n in names if n in sys.modules and hasattr(sys.modules[n], "__path__"))
for expected in ("seqpar.attn", "seqpar.comm", "seqpar.integrations", "seqpar.kernels", "seqpar.memory",
                 "seqpar.mixers", "seqpar.runtime", "seqpar.sequence", "seqpar.swap", "seqpar.testing",
                 "seqpar.bench"):
    assert expected in packages, f"{expected} is missing from the wheel (found {packages})"
print(f"imported {len(names)} modules of {len(packages)} subpackages from {where.parent}")

from seqpar.swap import swap_attention  # noqa: E402

common = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_attention_heads=4,
              num_key_value_heads=4, num_hidden_layers=2, use_cache=False, pad_token_id=0)
configs = {
    "llama": transformers.LlamaConfig(**common),
    "jamba": transformers.JambaConfig(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                                      expert_layer_offset=1, num_experts=1, mamba_d_state=4, mamba_d_conv=4,
                                      mamba_expand=2, mamba_dt_rank=4, **common),
}
for family, cfg in configs.items():
    torch.manual_seed(0)
    plain = transformers.AutoModelForCausalLM.from_config(cfg)
    model = copy.deepcopy(plain)
    report = swap_attention(model)
    ids = torch.randint(3, 64, (2, 24))
    losses, grads = [], []
    for m in (plain, model):
        out = m(input_ids=ids, labels=ids)
        out.loss.backward()
        losses.append(out.loss.detach())
        grads.append({n: p.grad for n, p in m.named_parameters() if p.grad is not None})
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    assert grads[0].keys() == grads[1].keys() and grads[0], family
    for n, g in grads[0].items():
        torch.testing.assert_close(grads[1][n], g, rtol=1e-4, atol=1e-5 * float(g.abs().max()) + 1e-8, msg=n)
    print(f"{family}: swapped {sorted(set(report.routes.values()))}, loss {losses[1].item():.6f} "
          f"equal to the unswapped model, {len(grads[0])} gradients equal")
print("wheel smoke: ok")
