"""seqpar's end padding through a model whose pad token embeds to zero (tiny Gemma 3n).

``shard_batch`` pads a sequence to a multiple of the SP size (``2P`` for zigzag) with token 0, which is
``padding_idx`` of Gemma 3n's embedding (a zero row at init). Gemma 3n rescales every position by
``mean(h**2, -1) ** 0.5`` (AltUp), whose backward at a zero row is NaN, and the NaN reached every parameter
(fuzzer cases 971704548 and 1328448764: tiny ``gemma3n_text`` with packed documents, every gradient NaN with a
correct loss; one process running each document alone never sees a pad token). The swap's input preparer now
feeds the padded positions another token (:mod:`seqpar.swap.hf_padding`).

Packed batches only: there the padding is a document of its own, so its hidden state stays zero through
every layer and the NaN comes from the last AltUp magnitude; end padding of an unpacked row attends to the real
tokens (not zero at the end), and the first magnitude's NaN lands on the embedding's ``padding_idx`` row,
which ``nn.Embedding`` gives no gradient (an unpacked row padded at the end was exact without the fix).

Seen failing (``fill_padding``'s call in ``hf_inputs.prepare_inputs`` removed): every parity case below, each
run alone, NaN gradients (``model.layers.0.self_attn.q_proj.weight`` first); the ``inputs_embeds`` case with
only the ``input_ids`` branch of ``fill_padding`` kept; the unit test with the token-mask condition dropped
(the data's own pad token replaced).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from seqpar.config import SeqParConfig
from seqpar.sequence.batch import TOKEN_MASK_KEY, shard_batch
from seqpar.swap import swap_attention
from seqpar.swap.hf_padding import fill_padding
from seqpar.testing.tiny_models import build_model

transformers = pytest.importorskip("transformers")

KIND = "gemma3n_text"
VOCAB = 50  # below the tiny model's vocabulary


def _compare(model, ref, loss, ref_loss, world: int) -> None:
    """The loss, and every parameter's gradient summed over the ranks, each against its own reference scale."""
    got, want = float(loss.detach()), float(ref_loss.detach())
    # float64 models, but transformers' loss upcasts the logits to fp32 only: both sides round there
    assert abs(got - want) <= 1e-6 * abs(want), (got, want)
    for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        assert (p.grad is None) == (r.grad is None), name
        if r.grad is None:
            continue
        grad = p.grad.detach().clone()
        if world > 1:
            dist.all_reduce(grad)
        assert torch.isfinite(grad).all(), f"{name}: non-finite gradient"
        scale = float(r.grad.abs().max())  # 0 for the per-layer-input path of the tiny model (both sides)
        err = float((grad - r.grad).abs().max())
        assert err <= 1e-5 * scale, f"{name}: {err:.2e} of scale {scale:.2e}"


def _packed_parity(rank: int, world: int, sharding: str, lengths: list[int], embeds: bool = False) -> None:
    """A packed row (``DataCollatorWithFlattening``; ``embeds``: given as ``inputs_embeds``, which
    ``shard_batch`` pads with zeros) against each document run alone in one process in float64, token-weighted
    (per-document semantics)."""
    g = torch.Generator().manual_seed(5)
    docs = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]
    ref = build_model(KIND, torch.float64)
    model = build_model(KIND, torch.float64)

    def inputs(ids: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"inputs_embeds": ref.get_input_embeddings()(ids).detach()} if embeds else {"input_ids": ids}

    loss, count = 0.0, 0
    for d in docs:
        if len(d) > 1:
            ids = torch.tensor([d])
            loss = loss + ref(**inputs(ids), labels=ids, use_cache=False).loss * (len(d) - 1)
            count += len(d) - 1
    ref_loss = loss / count
    ref_loss.backward()

    batch = dict(transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)(
        [{"input_ids": d} for d in docs]))
    batch.update(inputs(batch.pop("input_ids")))
    swap_attention(model, SeqParConfig(size=world, mode="ring", sharding=sharding), group=dist.group.WORLD)
    sharded = shard_batch(batch, group=dist.group.WORLD, sharding=sharding)
    assert TOKEN_MASK_KEY in sharded  # the lengths below need end padding: the case this file is about
    out = model(**sharded)
    out.loss.backward()
    _compare(model, ref, out.loss, ref_loss, world)


def _cases(rank: int, world: int) -> None:
    if world == 1:  # zigzag at P = 1 pads to an even length
        _packed_parity(rank, world, "zigzag", [1, 2, 1, 6, 1])
        _packed_parity(rank, world, "zigzag", [3, 1, 7], embeds=True)
    else:
        _packed_parity(rank, world, "zigzag", [4, 1, 13, 5])
        _packed_parity(rank, world, "balanced", [5, 2, 1, 9, 1])


@pytest.mark.parametrize("world", [1, 2])
def test_end_padding_gives_exact_finite_gradients(dist_pool, world: int) -> None:
    """Packed documents (length-1 ones included), padded at the end by ``shard_batch``: the loss and every
    gradient equal each document run alone in one process, none NaN."""
    dist_pool.run(world, _cases, timeout=300)


def test_fill_padding_touches_the_padding_only() -> None:
    """Only the padded positions (token mask 0) holding ``padding_idx`` change; the data's own pad token (a
    kept position) stays, as one process sees it; no token mask: nothing changes."""
    model = build_model(KIND, torch.float32)
    pad = model.get_input_embeddings().padding_idx
    assert pad == 0 and not model.get_input_embeddings().weight[pad].any()  # the zero row this is about
    ids = torch.tensor([[5, pad, 7, pad, pad], [pad, 3, 4, 9, pad]])
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0]])
    args = {"input_ids": ids}
    fill_padding(model, args, mask)
    assert args["input_ids"].tolist() == [[5, pad, 7, pad + 1, pad + 1], [pad, 3, 4, 9, pad + 1]]
    assert ids[0, 3] == pad  # the caller's tensor is not changed
    kept = {"input_ids": ids}
    fill_padding(model, kept, None)
    assert kept["input_ids"] is ids
    embeds = torch.zeros(2, 5, 4)
    args = {"inputs_embeds": embeds}
    fill_padding(model, args, mask)
    assert args["inputs_embeds"].eq(1).all(-1).tolist() == mask.eq(0).tolist()
