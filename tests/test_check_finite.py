"""``"check_finite": true``: a NaN/Inf in a swapped layer's attention inputs or output raises on
every rank of the SP group together, naming the layer and the rank; off, it costs nothing."""

from __future__ import annotations

import pytest
import torch

from seqpar.config import SeqParConfig
from seqpar.swap.options import SwapOptions

LAYER = "model.layers.1.self_attn"


def _qkv(rank: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(100 + rank)
    q = torch.randn(1, 4, 8, 16, generator=g)  # (batch, heads, seq_local, head_dim)
    kv = [torch.randn(1, 2, 8, 16, generator=g) for _ in range(2)]  # GQA: 2 kv heads
    return q, *kv


def _poisoned_call(rank: int, world: int, bad_rank: int, where: str) -> str:
    options = SwapOptions.from_config(SeqParConfig(size=world, mode="ring", check_finite=True),
                                      group=torch.distributed.group.WORLD)
    q, k, v = _qkv(rank)
    if rank == bad_rank and where == "input":
        k[0, 1, 3, 5] = float("nan")
    real = SwapOptions._attention
    if rank == bad_rank and where == "output":  # finite inputs, a non-finite result on this rank only
        SwapOptions._attention = lambda self, *a, **kw: real(self, *a, **kw) * float("inf")
    try:
        options.attention(q, k, v, causal=True, scale=None, layer=LAYER)
    except FloatingPointError as e:
        return str(e)
    finally:
        SwapOptions._attention = real
    return "no error"


@pytest.mark.parametrize("where", ["input", "output"])
def test_every_rank_raises_naming_layer_and_rank(dist_pool, where):
    messages = dist_pool.run(2, _poisoned_call, 1, where, timeout=120)
    for rank, message in enumerate(messages):
        assert LAYER in message and "rank 1" in message, (rank, message)
        assert ("inputs" in message and "key" in message) if where == "input" else "output" in message, message


def _clean_call(rank: int, world: int) -> float:
    from seqpar.attn import attention

    q, k, v = _qkv(rank)
    on = SwapOptions.from_config(SeqParConfig(size=world, mode="ring", check_finite=True),
                                 group=torch.distributed.group.WORLD)
    got = on.attention(q, k, v, causal=True, scale=None, layer=LAYER)
    ref = attention(q, k, v, causal=True, mode="ring", group=torch.distributed.group.WORLD)
    return float((got - ref).abs().max())


def test_finite_inputs_pass_unchanged(dist_pool):
    assert dist_pool.run(2, _clean_call, timeout=120) == [0.0, 0.0]


def test_off_by_default_and_never_called(monkeypatch):
    import seqpar.runtime.guard

    assert SeqParConfig().check_finite is False
    monkeypatch.setattr(seqpar.runtime.guard, "check_finite", lambda *a, **k: pytest.fail("called while off"))
    q, k, v = _qkv(0)
    q[0, 0, 0, 0] = float("nan")
    SwapOptions.from_config(SeqParConfig(), group=None).attention(q, k, v, causal=True, scale=None, layer=LAYER)


def test_config_key_type_checked():
    with pytest.raises(ValueError, match="check_finite"):
        SeqParConfig.from_dict({"sequence_parallel": {"check_finite": "yes"}})
