"""A deep copy of a swapped MLA model computes with its own weights (a real bug found by the per-call state audit,
reports/house32b.md): DPO's frozen reference model is ``copy.deepcopy(policy)`` of the swapped policy, and the
policy then trains. The swap had put closures over the *source* module on each MLA layer (``expand_kv``) and on
its ``kv_b_proj`` (``forward``); a deep copy shares a plain function, so the copy's layers expanded K/V with the
policy's ``kv_b_proj`` weights (and fed gradients into them) and read the policy's call frames, never its own.

Here: a tiny DeepSeek-V3 in float64, swapped, deep-copied, then the policy's weights moved (a training step). One
forward of the policy on batch A, one of the copy on batch B, then one backward of the sum. Each loss and every
gradient of both models equals a float64 one-process model without seqpar that holds the same weights, each
gradient on its own scale. At SP=1 in this process and at SP=2 (zigzag, the latent ring) on the pool.

Seen failing on the closures (seqpar/swap/mla.py before the fix, which binds both as methods so that a deep copy
rebinds them), at SP=1 and at SP=2 alike: the copy's loss 4.13674 vs 4.14410, its embedding's gradient off by
0.52 (largest entry 0.27), its kv_b_proj gradients zero, and the policy's kv_b_proj gradients off by 0.048 and
0.060 (they held the copy's batch too)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")

from test_mla_models import VOCAB, tiny_mla  # noqa: E402

from seqpar.config import SeqParConfig  # noqa: E402
from seqpar.sequence.batch import shard_batch  # noqa: E402
from seqpar.swap import swap_attention  # noqa: E402

SEQ = 16


def _batches() -> list[dict[str, torch.Tensor]]:
    """Batches A (the policy's) and B (the copy's): ``input_ids`` and ``labels`` ``(1, SEQ)``."""
    g = torch.Generator().manual_seed(3207)
    out = []
    for _ in range(2):
        ids = torch.randint(3, VOCAB, (1, SEQ), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def _step(model: torch.nn.Module) -> None:
    """Move every weight as a training step would (the same move for every model it is applied to)."""
    g = torch.Generator().manual_seed(3208)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))


def _loss_and_grads(model: torch.nn.Module, loss: torch.Tensor, world: int) -> tuple[float, dict[str, torch.Tensor]]:
    grads = {}
    for name, p in model.named_parameters():
        grad = (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
        if world > 1:
            dist.all_reduce(grad)  # each rank's share of a replicated weight's gradient
        grads[name] = grad
    return float(loss.detach()), grads


def _references() -> list[tuple[float, dict[str, torch.Tensor]]]:
    """float64 without seqpar: the stepped policy on batch A, the unstepped weights on batch B."""
    batches, out = _batches(), []
    for stepped, batch in zip((True, False), batches, strict=True):
        model = tiny_mla("deepseek_v3")
        if stepped:
            _step(model)
        loss = model(**batch).loss
        loss.backward()
        out.append(_loss_and_grads(model, loss, 1))
    return out


def _run(rank: int, world: int) -> list[tuple[float, dict[str, torch.Tensor]]]:
    """The swapped policy and its deep copy: forward A (policy), forward B (copy), one backward of the sum."""
    policy = tiny_mla("deepseek_v3")
    group = dist.group.WORLD if world > 1 else None
    if world > 1:
        swap_attention(policy, SeqParConfig(size=world, sharding="zigzag"), group=group)
    else:
        swap_attention(policy)
    frozen = copy.deepcopy(policy)
    _step(policy)
    models, losses = (policy, frozen), []
    for model, batch in zip(models, _batches(), strict=True):
        inputs = shard_batch(batch, group=group, sharding="zigzag") if world > 1 else batch
        losses.append(model(**inputs).loss)
    (losses[0] + losses[1]).backward()
    return [_loss_and_grads(m, loss, world) for m, loss in zip(models, losses, strict=True)]


def _failures(got: list, want: list) -> list[str]:
    """Each loss and gradient to 1e-6 of its own scale: transformers' loss casts float64 logits to float32
    (``logits.float()``), seqpar's SP loss keeps them in float64, so the two differ at float32 rounding."""
    failed = []
    for what, (loss, grads), (ref_loss, ref_grads) in zip(("policy (A)", "deep copy (B)"), got, want, strict=True):
        if abs(loss - ref_loss) > 1e-6 * abs(ref_loss):
            failed.append(f"{what}: loss {loss!r} vs {ref_loss!r}")
        for name, ref in ref_grads.items():
            scale = float(ref.abs().max()) or 1.0
            err = float((grads[name] - ref).abs().max())
            if err > 1e-6 * scale:
                failed.append(f"{what}: grad of {name} off by {err:.3e} (its largest entry {scale:.3e})")
    return failed


def test_deep_copy_of_swapped_mla_model_one_process() -> None:
    failed = _failures(_run(0, 1), _references())
    assert not failed, "\n".join(failed[:12])


def _sharded(rank: int, world: int, want: list) -> list[str]:
    return [f"rank {rank}: {f}" for f in _failures(_run(rank, world), want)]


@pytest.mark.timeout(300)
def test_deep_copy_of_swapped_mla_model_sharded(dist_pool) -> None:
    want = _references()
    failed = [f for per_rank in dist_pool.run(2, _sharded, want, timeout=240) for f in per_rank]
    assert not failed, "\n".join(failed[:12])
