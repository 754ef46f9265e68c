"""Packed-document boundaries reach the host once per batch (issue 18).

:func:`seqpar.sequence.boundaries.host_boundaries` is the one conversion of ``cu_seqlens`` to host
ints. A swapped Hugging Face model with packed documents converts the batch's boundary tensors once,
in its per-batch input preparer, and every layer then reads host ints known already: the number of
conversions per forward is one, whatever the number of layers.

Counted two ways: calls of the module's copy function (what every conversion through the one
function does), and ``Tensor.tolist`` calls anywhere whose result starts with the boundaries (a
conversion that bypasses the one function, e.g. a layer's own ``cu.tolist()``). The HF route reads the
boundaries in its one combined read of the batch's inputs (a ``tolist`` that starts with them) and
remembers them (``remember_boundaries``): one ``tolist``, no call of the copy function.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator

import pytest
import torch

import seqpar.sequence.boundaries as boundaries
from seqpar.config import SeqParConfig
from seqpar.sequence.batch import shard_batch
from seqpar.sequence.boundaries import boundary_tensor, host_boundaries
from seqpar.swap import swap_attention

transformers = pytest.importorskip("transformers")

VOCAB = 61
LENGTHS = (7, 1, 23, 3, 11)  # 45 tokens: padded to 46 at the end for SP=2


def test_host_boundaries_forms():
    assert host_boundaries(None) is None
    assert host_boundaries([0, 3, 5]) == (0, 3, 5)
    assert host_boundaries((0, 3, 5)) == (0, 3, 5)
    for dtype in (torch.int32, torch.int64):
        assert host_boundaries(torch.tensor([0, 3, 5], dtype=dtype)) == (0, 3, 5)
    for bad in (torch.tensor([0.0, 3.0]), torch.tensor([[0, 3]]), [0, 1.5], [False, True], "0,3"):
        with pytest.raises(TypeError, match="cu_seqlens must be a 1-D int32/int64 tensor"):
            host_boundaries(bad)


@contextlib.contextmanager
def counting_conversions(bounds: tuple[int, ...]) -> Iterator[collections.Counter]:
    """Count conversions of ``bounds`` to the host inside the block (see the module docstring)."""
    counts: collections.Counter = collections.Counter()
    copy, tolist = boundaries._copy_to_host, torch.Tensor.tolist

    def counted_copy(t):
        counts["one_function"] += 1
        return copy(t)

    def counted_tolist(t):
        values = tolist(t)
        if isinstance(values, list) and tuple(values[: len(bounds)]) == bounds:
            counts["tolist"] += 1
        return values

    boundaries._copy_to_host = counted_copy
    torch.Tensor.tolist = counted_tolist
    try:
        yield counts
    finally:
        boundaries._copy_to_host = copy
        del torch.Tensor.tolist  # back to torch's own (defined on the C base class)


def test_cached_per_tensor():
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    with counting_conversions((0, 3, 5)) as counts:
        for _ in range(4):
            assert host_boundaries(cu) == (0, 3, 5)
        assert counts == {"one_function": 1, "tolist": 1}
        cu[1] = 2  # written in place: copied again
        assert host_boundaries(cu) == (0, 2, 5)
        assert counts["one_function"] == 2
        made = boundary_tensor((0, 4, 5))  # its host ints are known: no copy at all
        assert host_boundaries(made) == (0, 4, 5) and made.dtype == torch.int32
        assert counts["one_function"] == 2


def tiny_llama(layers: int) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=layers, num_attention_heads=4,
                                   num_key_value_heads=2, attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(cfg)


def packed_batch() -> dict:
    g = torch.Generator().manual_seed(3)
    docs = [torch.randint(0, VOCAB, (n,), generator=g) for n in LENGTHS]
    collate = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    return collate([{"input_ids": d.tolist()} for d in docs])


def _conversions_per_forward(rank: int, world: int, layers: int, batches: int = 2) -> list[dict]:
    model = tiny_llama(layers)
    swap_attention(model, SeqParConfig(size=world, mode="ring"), group=torch.distributed.group.WORLD)
    found = []
    for _ in range(batches):
        local = shard_batch(packed_batch(), group=torch.distributed.group.WORLD) if world > 1 else packed_batch()
        # Fresh boundary tensors, as a batch moved to an accelerator key by key holds them.
        for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
            local[key] = local[key].clone()
        bounds = tuple(local["cu_seq_lens_q"].tolist())
        with counting_conversions(bounds) as counts:
            model(**local).loss.backward()
        found.append(dict(counts))
    return found


@pytest.mark.parametrize("layers", [2, 4])
def test_hf_packed_one_conversion_per_batch_one_rank(layers):
    assert _conversions_per_forward(0, 1, layers) == [{"tolist": 1}] * 2


@pytest.mark.parametrize("layers", [2, 4])
def test_hf_packed_one_conversion_per_batch_two_ranks(dist_pool, layers):
    for per_rank in dist_pool.run(2, _conversions_per_forward, layers):
        assert per_rank == [{"tolist": 1}] * 2


def test_boundary_tensor_is_free_in_inference_mode():
    with torch.inference_mode(), counting_conversions((0, 4, 5)) as counts:
        made = boundary_tensor((0, 4, 5))
        assert host_boundaries(made) == (0, 4, 5) and host_boundaries(made) == (0, 4, 5)
    assert counts["one_function"] == 0
