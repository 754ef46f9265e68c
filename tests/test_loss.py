"""Sequence-parallel loss: the single-device value on every rank, and each rank exactly its share of
the single-device gradient (no factor P, no rank-to-rank differences)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from seqpar.sequence.batch import global_positions, shard_batch
from seqpar.sequence.loss import (
    sequence_parallel_causal_lm_loss,
    sequence_parallel_loss,
    sequence_parallel_mean,
)

VOCAB = 61


def _case(seq_len: int = 16, batch: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(batch, seq_len, VOCAB, generator=g)
    labels = torch.randint(0, VOCAB, (batch, seq_len), generator=g)
    # Uneven valid tokens per shard: a mean of per-rank means would be wrong here.
    labels[0, : seq_len // 2 + 3] = -100
    return logits, labels


def _shifted_reference(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    full = logits.clone().requires_grad_()
    loss = F.cross_entropy(full[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=-100)
    loss.backward()
    return loss.detach(), full.grad


def _loss_parity(rank: int, world_size: int, sharding: str, variant: str) -> float:
    logits, labels = _case()
    ref_loss, ref_grad = _shifted_reference(logits, labels)
    seq = logits.shape[1]
    pos = global_positions(seq, rank, world_size, sharding)
    local = logits[:, pos].clone().requires_grad_()
    if variant == "shifted":
        batch = shard_batch({"input_ids": labels.clamp(min=0), "labels": labels}, group=dist.group.WORLD, sharding=sharding)
        loss = sequence_parallel_loss(local, batch["shift_labels"], group=dist.group.WORLD)
    else:  # labels cut like input_ids, shifted across shard boundaries by the loss
        loss = sequence_parallel_causal_lm_loss(local, labels[:, pos], group=dist.group.WORLD, sharding=sharding)
    loss.backward()
    torch.testing.assert_close(loss.detach(), ref_loss, rtol=1e-6, atol=1e-6)
    # Exactly this rank's share: not multiplied by P, no need to reduce logits' grads at all.
    torch.testing.assert_close(local.grad, ref_grad[:, pos], rtol=1e-6, atol=1e-7)
    return loss.item()


@pytest.mark.parametrize("world,sharding,variant", [
    (1, "contiguous", "shifted"),
    (2, "contiguous", "shifted"),
    (2, "zigzag", "shifted"),
    (2, "zigzag", "unshifted"),
    (4, "zigzag", "unshifted"),
    (4, "contiguous", "unshifted"),
])
def test_loss_and_gradient_shares(dist_pool, world, sharding, variant):
    losses = dist_pool.run(world, _loss_parity, sharding, variant)
    assert len(set(losses)) == 1, f"ranks disagree on the loss: {losses}"


def _reductions(rank: int, world_size: int) -> None:
    logits, labels = _case()
    pos = global_positions(16, rank, world_size, "contiguous")
    targets = torch.cat([labels[:, 1:], torch.full((2, 1), -100)], dim=1)
    ref_sum = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="sum")
    got = sequence_parallel_loss(logits[:, pos], targets[:, pos], reduction="sum", group=dist.group.WORLD)
    torch.testing.assert_close(got, ref_sum)
    per_token = sequence_parallel_loss(logits[:, pos], targets[:, pos], reduction="none", group=dist.group.WORLD)
    assert per_token.shape == (2, 8)
    # A rank with no valid token still takes part, and a group with none gives 0, not NaN.
    none_valid = torch.full_like(targets[:, pos], -100)
    assert sequence_parallel_loss(logits[:, pos], none_valid, group=dist.group.WORLD).item() == 0.0
    # Custom per-token losses: the same reduction from sums and counts.
    mean = sequence_parallel_mean(per_token.sum(), (targets[:, pos] != -100).sum(), group=dist.group.WORLD)
    torch.testing.assert_close(mean, ref_sum / (targets != -100).sum())


def test_reductions(dist_pool):
    dist_pool.run(2, _reductions)


def _compiled_shares(rank: int, world_size: int, reduction: str) -> None:
    logits, labels = _case()
    pos = global_positions(16, rank, world_size, "zigzag")
    targets = torch.cat([labels[:, 1:], torch.full((2, 1), -100)], dim=1)
    full = logits.clone().requires_grad_()
    F.cross_entropy(full.reshape(-1, VOCAB), targets.reshape(-1), reduction=reduction).backward()

    def loss_of(local: torch.Tensor, local_targets: torch.Tensor) -> torch.Tensor:
        return sequence_parallel_loss(local, local_targets, reduction=reduction, group=dist.group.WORLD)

    local = logits[:, pos].clone().requires_grad_()
    torch.compile(loss_of, fullgraph=True, backend="aot_eager")(local, targets[:, pos]).backward()
    torch._dynamo.reset()
    torch.testing.assert_close(local.grad, full.grad[:, pos], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_compiled_loss_gives_each_rank_its_share(dist_pool, reduction):
    """Compiled (fullgraph), each rank's gradient is still its share of the single-device one. Seen failing on
    torch 2.11 (the floor) with the in-place all-reduce traced in the loss's autograd Function: every gradient 0
    (seqpar.sequence.loss._AllReduceSumIdentityBackward), so every compiled swapped model trained on nothing."""
    dist_pool.run(2, _compiled_shares, reduction)


def _half_logits(rank: int, world_size: int, dtype: torch.dtype) -> None:
    logits, labels = _case(seq_len=24)
    logits = (logits * 6).to(dtype)  # spread-out logits: a softmax in half precision is visibly off
    ref_loss, ref_grad = _shifted_reference(logits.double(), labels)
    pos = global_positions(24, rank, world_size, "zigzag")
    local = logits[:, pos].clone().requires_grad_()
    loss = sequence_parallel_causal_lm_loss(local, labels[:, pos], group=dist.group.WORLD, sharding="zigzag")
    loss.backward()
    assert loss.dtype == torch.float32 and local.grad.dtype == dtype
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-6, atol=1e-6)
    # the fp32 gradient rounded once to the logits' dtype: within one unit in the last place of it
    want = ref_grad[:, pos]
    torch.testing.assert_close(local.grad.double(), want, rtol=2 ** -7, atol=1e-3 * want.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_logits_loss_in_fp32(dist_pool, dtype):
    """bf16/fp16 logits (a model run in half precision): the loss is computed in fp32 from them, as
    transformers' ForCausalLMLoss upcasts, so it equals the float64 loss of the same rounded logits to
    fp32 accuracy (P = 2, zigzag, labels shifted across the shards).

    Seen failing: the cross-entropy run in the logits' own dtype (``acc = logits`` in ``_token_losses``):
    every other test here used fp32 logits."""
    dist_pool.run(2, _half_logits, dtype)


def test_single_process_matches_cross_entropy():
    logits, labels = _case()
    targets = torch.cat([labels[:, 1:], torch.full((2, 1), -100)], dim=1)
    ref = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
    torch.testing.assert_close(sequence_parallel_loss(logits, targets), ref)
    torch.testing.assert_close(sequence_parallel_causal_lm_loss(logits, labels), ref)
    with pytest.raises(ValueError, match="reduction="):
        sequence_parallel_loss(logits, targets, reduction="avg")
    with pytest.raises(ValueError, match="disagree"):
        sequence_parallel_loss(logits, targets[:, :-1])


def _assert_matches_reference(loss: torch.Tensor, ref_loss: torch.Tensor, model: torch.nn.Module,
                              ref: torch.nn.Module) -> None:
    """The swapped ``model``'s loss is the single-process ``ref``'s, and every parameter's gradient summed
    over the SP ranks is ``ref``'s (both already backpropagated)."""
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        grad = p.grad.clone()
        dist.all_reduce(grad)  # SUM over SP ranks (see seqpar.sequence.loss)
        torch.testing.assert_close(grad, ref_params[name].grad, rtol=1e-4, atol=1e-5)


def _llama_end_to_end(rank: int, world_size: int, sharding: str, seq_len: int) -> float:
    """A padded (non-dividing) length: shard_batch + swap + loss == the model's own loss at SP=1."""
    from test_swap import build_model

    from seqpar.swap import swap_attention

    torch.manual_seed(0)
    model = build_model("llama")
    ref = copy.deepcopy(model)
    swap_attention(model, {"size": world_size, "sharding": sharding}, group=dist.group.WORLD)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, VOCAB, (2, seq_len), generator=g)
    ref_loss = ref(input_ids=ids, labels=ids).loss
    ref_loss.backward()

    batch = shard_batch({"input_ids": ids, "labels": ids}, group=dist.group.WORLD, sharding=sharding)
    shift_labels = batch.pop("shift_labels")
    logits = model(**batch).logits
    loss = sequence_parallel_loss(logits, shift_labels, group=dist.group.WORLD)
    loss.backward()
    _assert_matches_reference(loss, ref_loss, model, ref)
    return loss.item()


@pytest.mark.parametrize("world,sharding,seq_len", [(2, "zigzag", 13), (2, "contiguous", 15)])
def test_llama_padded_sequence_loss_matches_single_device(dist_pool, world, sharding, seq_len):
    pytest.importorskip("transformers")
    losses = dist_pool.run(world, _llama_end_to_end, sharding, seq_len)
    assert len(set(losses)) == 1, f"ranks disagree on the loss: {losses}"


def _hf_labels_loss(rank: int, world_size: int, sharding: str, how: str) -> float:
    """``labels=`` (or shard_batch's ``shift_labels``) given to a swapped HF model: its ``.loss`` is
    the single-process model's, and the ranks' gradients sum to the single-process ones."""
    import transformers
    from test_swap import build_model

    from seqpar.sequence.sharding import shard_sequence
    from seqpar.swap import swap_attention

    torch.manual_seed(0)
    model = build_model("llama")
    ref = copy.deepcopy(model)
    swap_attention(model, {"size": world_size, "sharding": sharding}, group=dist.group.WORLD)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (2, 16), generator=g)
    labels = ids.clone()
    labels[0, :11] = -100  # uneven valid tokens per shard: a mean of per-rank means is wrong
    extra = {}
    if how == "num_items":  # transformers' Trainer passes the batch's token count: sum / count
        extra = {"num_items_in_batch": int((labels[:, 1:] != -100).sum())}
    ref_loss = ref(input_ids=ids, labels=labels, **extra).loss
    ref_loss.backward()

    if how == "shift_labels":  # model(**shard_batch(batch)) must return the loss too
        loss = model(**shard_batch({"input_ids": ids, "labels": labels}, group=dist.group.WORLD, sharding=sharding)).loss
    else:  # labels cut unshifted, like input_ids: the shift crosses shard boundaries
        local_ids, local_labels = (shard_sequence(t, 1, group=dist.group.WORLD, sharding=sharding) for t in (ids, labels))
        loss = model(input_ids=local_ids, labels=local_labels, **extra).loss
    loss.backward()
    _assert_matches_reference(loss, ref_loss, model, ref)

    if how != "labels":
        return loss.item()
    # A pooled (not token-level) loss cannot be split by tokens: refused on every rank, not wrong.
    torch.manual_seed(0)
    classifier = transformers.LlamaForSequenceClassification(
        transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2, num_labels=3, pad_token_id=0)
    )
    swap_attention(classifier, {"size": world_size, "sharding": sharding}, group=dist.group.WORLD)
    with pytest.raises(ValueError, match="sequence_parallel_loss"):
        classifier(input_ids=shard_sequence(ids, 1, group=dist.group.WORLD, sharding=sharding), labels=torch.tensor([0, 2]))
    return loss.item()


@pytest.mark.parametrize("sharding,how", [
    ("zigzag", "labels"), ("contiguous", "shift_labels"), ("zigzag", "num_items"),
])
def test_hf_model_labels_loss_is_sequence_parallel(dist_pool, sharding, how):
    pytest.importorskip("transformers")
    losses = dist_pool.run(2, _hf_labels_loss, sharding, how)
    assert len(set(losses)) == 1, f"ranks disagree on the loss: {losses}"
