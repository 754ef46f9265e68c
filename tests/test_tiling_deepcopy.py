"""A deep copy of a tiled model runs its own weights (a DPO reference model, an EMA or a teacher copied after the
swap tiled the model): the tiled LM head's and the tiled MLPs' untiled forwards are bound methods kept on the module,
which ``copy.deepcopy`` rebinds to the copy; the closures that held them before shared the source's.

Seen failing: with the closures back (``original = lm.forward`` / ``mlp.forward`` called from the tiled forwards),
the copy's evaluation logits were the source model's (0.23 off from the reference at the first check)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from seqpar.memory.tiling import apply_tiling

transformers = pytest.importorskip("transformers")


def _llama() -> torch.nn.Module:
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False, use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(11)
    return transformers.LlamaForCausalLM(cfg).double()


def _perturb(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * p.abs().mean() * torch.randn(p.shape, generator=g, dtype=p.dtype))


def test_a_deep_copy_of_a_tiled_model_runs_its_own_weights() -> None:
    model = _llama()
    apply_tiling(model, {"tiled_loss": True, "tiled_mlp": 3})
    copied = copy.deepcopy(model)
    _perturb(copied, 5)
    reference = _llama()  # untiled, loaded with the copy's weights
    reference.load_state_dict(copied.state_dict())
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(7))

    # evaluation (no labels, no grad): the untiled forwards
    with torch.no_grad():
        torch.testing.assert_close(copied(input_ids=ids).logits, reference(input_ids=ids).logits,
                                   rtol=1e-12, atol=1e-12)
    # training: the tiled loss and the tiled MLPs (grad on, 3 chunks), every gradient on its own scale
    loss = copied(input_ids=ids, labels=ids).loss
    loss.backward()
    ref_logits = reference(input_ids=ids).logits
    ref = F.cross_entropy(ref_logits[:, :-1].reshape(-1, 97), ids[:, 1:].reshape(-1))
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=0)
    ref_grads = dict(reference.named_parameters())
    for name, p in copied.named_parameters():
        r = ref_grads[name].grad
        assert p.grad is not None, name
        assert (p.grad - r).abs().max().item() <= 1e-10 * r.abs().max().item(), name
    # the source model kept its own weights and received no gradient from the copy's step
    assert all(p.grad is None for p in model.parameters())
    source = _llama()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, source(input_ids=ids).logits, rtol=1e-12,
                                   atol=1e-12)
