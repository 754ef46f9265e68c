"""Packed documents through decoder layers that drop the model's keyword arguments.

Nemotron's and StableLM's decoder layers call their attention with the hidden states, mask and positions
only, so the batch's ``cu_seq_lens_q/k`` (and dynamic CP's call group) never reach it: the swapped
attention attended across the documents of a packed row (the fuzzer's case 572881236: tiny Nemotron,
P = 1, packed, loss 11% off; StableLM 4%). The swap's probe now finds such layers with a packed run
(:func:`seqpar.swap.hf_probe._mark_dropping`), makes their decoder layers documents carriers and the
attention reads the boundaries from them (:func:`seqpar.mixers.documents.with_carried`).

Seen failing (the fix stashed): every parity case below (Nemotron's loss 11% off at P = 1) and the probe
test (nothing marked); with the carrier conversion but ``with_carried`` skipped in the attention, the
parity cases again; without ``carry_to`` at the first forward, the meta-device case.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hf_tiny import documents_alone_loss

from seqpar.config import SeqParConfig
from seqpar.mixers.documents import DROPS_DOCUMENTS_ATTR, DocumentsCarrier
from seqpar.sequence.batch import shard_batch
from seqpar.swap import swap_attention
from seqpar.testing.tiny_models import build_model

transformers = pytest.importorskip("transformers")

VOCAB = 50  # below every tiny model's vocabulary


def _marked(rank: int, world: int, kind: str) -> tuple[list[str], list[str], list[str]]:
    model = build_model(kind, torch.float32)
    swap_attention(model, SeqParConfig(size=world, mode="ring"), group=dist.group.WORLD)
    marked = [n for n, m in model.named_modules() if getattr(m, DROPS_DOCUMENTS_ATTR, False)]
    carriers = [n for n, m in model.named_modules() if isinstance(m, DocumentsCarrier)]
    attention = [n for n, m in model.named_modules() if n.endswith(".self_attn")]
    return marked, carriers, attention


@pytest.mark.parametrize("kind,drops", [("nemotron", True), ("stablelm", True), ("llama", False)])
def test_probe_marks_the_layers_that_drop_the_boundaries(dist_pool, kind: str, drops: bool) -> None:
    """Every attention layer of Nemotron and StableLM is marked and its decoder layer is a carrier; Llama,
    whose layers pass the keyword arguments on, is left as it was (no carrier)."""
    marked, carriers, attention = dist_pool.run(1, _marked, kind, timeout=120)[0]
    assert len(attention) == 2, attention
    assert marked == (attention if drops else []), (kind, marked)
    assert carriers == ([n.rpartition(".")[0] for n in attention] if drops else []), (kind, carriers)


def _packed_parity(rank: int, world: int, kind: str, sharding: str, lengths: list[int], checkpointing: bool,
                   meta: bool = False) -> None:
    """A packed row (``DataCollatorWithFlattening``) against each document run alone in one process in
    float64, token-weighted (per-document semantics): the loss, and every parameter's gradient summed over
    the ranks against its own reference scale."""
    g = torch.Generator().manual_seed(11)
    docs = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]
    ref = build_model(kind, torch.float64)
    ref_loss = documents_alone_loss(ref, docs)
    ref_loss.backward()

    batch = dict(transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)(
        [{"input_ids": d} for d in docs]))
    if meta:  # parameters not materialised at swap time: the probe (and the carriers) wait for the first forward
        with torch.device("meta"):
            model = build_model(kind, torch.float64)
    else:
        model = build_model(kind, torch.float64)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    swap_attention(model, SeqParConfig(size=world, mode="ring", sharding=sharding), group=dist.group.WORLD)
    if meta:
        assert not any(getattr(m, DROPS_DOCUMENTS_ATTR, False) for m in model.modules())  # not probed yet
        model.to_empty(device="cpu")
        fresh = build_model(kind, torch.float64)
        model.load_state_dict(fresh.state_dict())
        for name, buffer in fresh.named_buffers():  # non-persistent buffers (rotary frequencies)
            model.get_buffer(name).copy_(buffer)
    out = model(**shard_batch(batch, group=dist.group.WORLD, sharding=sharding))
    out.loss.backward()
    # float64 models, but transformers' loss upcasts the logits to fp32 only: both sides round there
    got, want = float(out.loss.detach()), float(ref_loss.detach())
    assert abs(got - want) <= 1e-6 * want, (kind, got, want)
    for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        grad = p.grad.detach().clone()
        if world > 1:
            dist.all_reduce(grad)
        scale = float(r.grad.abs().max())
        assert scale > 0, name
        err = float((grad - r.grad).abs().max())
        assert err <= 1e-5 * scale, f"{kind} {name}: {err:.2e} of scale {scale:.2e}"


CASES = [("nemotron", 1, "contiguous", False), ("nemotron", 2, "zigzag", True),
         ("stablelm", 1, "contiguous", True), ("stablelm", 2, "zigzag", False)]


@pytest.mark.parametrize("kind,world,sharding,checkpointing", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_packed_documents_reach_attention_their_layers_drop(dist_pool, kind: str, world: int, sharding: str,
                                                             checkpointing: bool) -> None:
    """Each document attends to itself, as it does run alone; with reentrant checkpointing the recompute
    reads its own forward's boundaries (the carrier's call carries them)."""
    dist_pool.run(world, _packed_parity, kind, sharding, [4, 1, 13, 6], checkpointing, timeout=300)


@pytest.mark.parametrize("kind", ["nemotron"])
def test_packed_documents_when_the_probe_waits_for_the_first_forward(dist_pool, kind: str) -> None:
    """A model swapped before its parameters exist (meta device; likewise ZeRO-3 partitions) is probed at its
    first forward: the dropping layers become carriers there, before they run."""
    dist_pool.run(2, _packed_parity, kind, "zigzag", [4, 1, 13, 6], True, True, timeout=300)
