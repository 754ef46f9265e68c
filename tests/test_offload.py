"""seqpar.memory.offload's recompute on one process, with a stand-in transfer (the CUDA one needs a GPU):
what the recompute must reproduce beyond test_tiling.py's dropout-free checks."""

from __future__ import annotations

import copy

import pytest
import torch
from hf_tiny import enable_checkpointing, family_config

from seqpar.testing.fuzz_models import HostCopyTransfer

transformers = pytest.importorskip("transformers")


# "Offloads" by cloning: the tensors come back equal, so any difference is the recompute's.
_CloneTransfer = HostCopyTransfer


def test_offloaded_recompute_replays_the_forwards_dropout() -> None:
    """A tiny float64 Llama with attention dropout 0.5 (the CPU RNG): checkpointed layers with their
    inputs offloaded give the same loss and every parameter gradient (each against its own scale) as the
    model run without checkpointing or offload, so the recompute drew the forward's dropout masks.

    Seen failing: offload.py's backward without ``torch.set_rng_state(cpu_rng)`` (the recompute draws
    fresh masks: gradients off by O(1) relative) -- test_tiling.py's offload checks have no dropout and
    passed with it."""
    from seqpar.memory.offload import apply_offload

    torch.manual_seed(11)
    cfg = transformers.LlamaConfig(**family_config(num_hidden_layers=2, attention_dropout=0.5))
    cfg._attn_implementation = "sdpa"
    base = transformers.LlamaForCausalLM(cfg).double()
    ids = torch.randint(0, cfg.vocab_size, (2, 24))
    results = []
    for offload in (False, True):
        model = copy.deepcopy(base)
        if offload:
            enable_checkpointing(model)
            apply_offload(model, transfer=_CloneTransfer())
        model.train()
        torch.manual_seed(12)  # the same dropout masks in both forwards
        loss = model(input_ids=ids, labels=ids).loss
        torch.manual_seed(13)  # the recompute must not take the RNG as it finds it
        loss.backward()
        results.append((loss.detach(), [(n, p.grad.clone()) for n, p in model.named_parameters()]))
    (l0, g0), (l1, g1) = results
    torch.testing.assert_close(l1, l0, rtol=0, atol=0)
    for (name, a), (_, b) in zip(g1, g0):
        scale = b.abs().max().item()
        assert scale > 0, name
        torch.testing.assert_close(a / scale, b / scale, rtol=0, atol=1e-12, msg=name)
