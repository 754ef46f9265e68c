"""A swapped mixer layer called directly (outside a swapped model, which refuses padding masks itself) with a
2D padding mask: this rank's shard of the mask gives exactly what transformers' layer gives on the whole
sequence with the whole mask (``apply_mask_to_padding_states`` zeroes positions, which the shard does locally),
and the whole mask (the caller's, not cut) is refused on every rank naming ``shard_sequence``, instead of a
broadcast error deep in the layer (``The size of tensor a (8) must match the size of tensor b (16)``).

Seen failing: with ``SwappedMixer.padding_mask`` returning the mask unchecked, the refusal tests fail on that
torch RuntimeError (Mamba, LFM2's short convolution, MiniMax's lightning attention); with the mask dropped in
``open_call`` (the padded positions not zeroed), the Mamba parity fails on its output, and with lightning's
mask multiplication dropped, the lightning parity."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from mixer_parity import elementwise, relative_to_largest

from seqpar.sequence.sharding import gather_sequence, shard_sequence

transformers = pytest.importorskip("transformers")


def _mamba() -> tuple[torch.nn.Module, type, int]:
    from seqpar.mixers.mamba import SeqParMambaMixer

    cfg = transformers.MambaConfig(hidden_size=16, state_size=4, expand=2, conv_kernel=4, time_step_rank=4,
                                   num_hidden_layers=1, use_cache=False)
    torch.manual_seed(0)
    layer = transformers.AutoModelForCausalLM.from_config(cfg).backbone.layers[0].mixer.double()
    with torch.no_grad():
        layer.D.normal_()
        layer.conv1d.bias.normal_()
    return layer, SeqParMambaMixer, 16


def _short_conv() -> tuple[torch.nn.Module, type, int]:
    from seqpar.mixers.short_conv import SeqParShortConv

    cfg = transformers.Lfm2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=2, conv_L_cache=3, layer_types=["conv"],
                                  use_cache=False)
    torch.manual_seed(0)
    layer = transformers.AutoModelForCausalLM.from_config(cfg).model.layers[0].conv.double()
    with torch.no_grad():
        if layer.conv.bias is not None:
            layer.conv.bias.normal_()
    return layer, SeqParShortConv, 16


def _lightning() -> tuple[torch.nn.Module, type, int]:
    from seqpar.mixers.lightning import SeqParLightningAttention

    if not hasattr(transformers, "MiniMaxConfig"):
        pytest.skip("this transformers has no MiniMax")
    cfg = transformers.MiniMaxConfig(
        vocab_size=61, hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, head_dim=8, layer_types=["linear_attention"], block_size=4, num_local_experts=2,
        num_experts_per_tok=2, initializer_range=0.2, use_cache=False)
    torch.manual_seed(0)
    layer = transformers.AutoModelForCausalLM.from_config(cfg).model.layers[0].self_attn.double()
    with torch.no_grad():  # the decay buffers were computed in fp32 at init: recompute them in float64
        for name, value in zip(("query_decay", "key_decay", "diagonal_decay"), layer.decay_factors(layer.slope_rate)):
            getattr(layer, name).copy_(value)
    return layer, SeqParLightningAttention, 16


LAYERS = {"mamba": _mamba, "short_conv": _short_conv, "lightning": _lightning}
# Mamba's layer runs its scan partly in fp32 even in float64 (test_mixers_mamba): judged against each tensor's
# largest entry; the convolution is float64 throughout
CLOSE = {"mamba": relative_to_largest(1e-6), "short_conv": elementwise(1e-10), "lightning": elementwise(1e-10)}


def _call(name: str, layer: torch.nn.Module, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The layer's output: MiniMax's lightning layer takes (hidden, position embeddings, mask) and returns a pair."""
    return layer(x, None, mask)[0] if name == "lightning" else layer(x, attention_mask=mask)


def _padded(rank: int, world: int, name: str) -> str:
    layer, sp_class, hidden = LAYERS[name]()
    seq, batch = 8 * world, 2
    g = torch.Generator().manual_seed(3)
    h = torch.randn(batch, seq, hidden, generator=g, dtype=torch.float64)
    grad = torch.randn(batch, seq, hidden, generator=g, dtype=torch.float64)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[1, :5] = 0  # left padding on row 1 (across rank 0's zigzag chunk and into the next)
    mask[0, seq - 3] = 0  # one masked position inside row 0, on the last rank's half
    ref_h = h.clone().requires_grad_()
    ref = _call(name, layer, ref_h, mask)
    (ref * grad).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad()

    group = dist.group.WORLD
    sp = sp_class(layer, group=group, sharding="zigzag")
    cut = dict(group=group, sharding="zigzag")
    h_sp = h.clone().requires_grad_()
    out = _call(name, sp, shard_sequence(h_sp, 1, **cut), shard_sequence(mask, 1, **cut))
    (out * shard_sequence(grad, 1, **cut)).sum().backward()
    close = CLOSE[name]
    close(gather_sequence(out.detach(), 1, **cut), ref.detach(), f"{name}: output")
    dist.all_reduce(h_sp.grad)
    close(h_sp.grad, ref_h.grad, f"{name}: grad of the input")
    for n, p in sp.named_parameters():
        dist.all_reduce(p.grad)
        close(p.grad, ref_grads[n], f"{name}: grad of {n}")

    # the whole sequence's mask, not cut: refused on this rank, naming the fix
    with pytest.raises(ValueError, match=r"whole sequence's.*seqpar\.shard_sequence\(attention_mask, 1, "
                                         r"sharding='zigzag'"):
        _call(name, sp, shard_sequence(h, 1, **cut), mask)
    with pytest.raises(ValueError, match=r"has batch 3; hidden_states has batch 2"):
        _call(name, sp, shard_sequence(h, 1, **cut), torch.ones(3, seq // world))
    return "ok"


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_padding_mask_shard_is_exact_and_whole_mask_refused(dist_pool, name):
    assert dist_pool.run(2, _padded, name, timeout=120) == ["ok", "ok"]
