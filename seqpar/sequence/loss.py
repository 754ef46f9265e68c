"""Token-weighted losses over a sequence split across an SP group, with exact gradients.

Each rank holds the logits of its shard. The loss of the whole sequence is

    L = (sum over ranks r of s_r) / (sum over ranks r of n_r)

with ``s_r`` the sum of the per-token losses of rank r's valid tokens and ``n_r`` their count.
Every rank computes the same ``L`` (one all-reduce of ``s`` and one of ``n``).

Gradient derivation. ``n`` carries no gradient. For ``s`` we use an all-reduce whose backward is the
identity: rank r's backward seeds ``dL/ds_r = 1/N`` into its own graph only. That is exactly the
partial derivative of the true objective with respect to ``s_r``; rank q's backward covers ``s_q``.
Attention's own backward carries the cross-shard terms (rank r's queries read rank q's keys) to
the rank that owns them, so after every rank's backward each parameter's full gradient is the **sum**
over SP ranks of the per-rank gradients. Had the backward been an all-reduce too (the textbook
"differentiable all-reduce", e.g. ``torch.distributed.nn.all_reduce``), each rank would receive
``sum_q dL_q/dS = P / N`` and every gradient would be scaled by the SP size P: the bug users of SP
libraries most often report.

Consequences for the optimizer step: reduce parameter gradients with a **sum over the SP group**
(and a mean over DP replicas). The integrations arrange exactly that for each engine (checked
numerically in tests/test_engines.py): DeepSpeed ZeRO 0-2 with the manager as ``mpu`` already sums
over all ranks and divides by the DP size; ZeRO-3, FSDP and FairScale get their divide factor or
loss scale set by ``seqpar.integrations``. A hand-written loop must do the same: all-reduce (sum)
gradients over the SP x DP group and divide by the DP size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from seqpar.runtime.groups import resolve_group
from seqpar.sequence.batch import sp_rank_and_size
from seqpar.sequence.sharding import chunk_ids, num_chunks, resolve_sharding
from seqpar.sequence.vocab_parallel import upcast, vocab_parallel_token_losses, vocab_sharded_logits

__all__ = [
    "sequence_parallel_loss",
    "sequence_parallel_causal_lm_loss",
    "sequence_parallel_mean",
    "all_reduce_identity_backward",
    "shift_labels_across_shards",
]

_REDUCTIONS = ("mean", "sum", "none")


class _AllReduceSumIdentityBackward(torch.autograd.Function):
    """Forward: sum over the group. Backward: the identity (see the module docstring for why)."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:  # type: ignore[override]
        if torch.compiler.is_compiling():
            # torch's functional all-reduce: torch 2.11's dynamo traces the in-place one below in this Function
            # with the right value but cuts the gradient (every compiled SP loss and router loss gave zero
            # gradients there); 2.13 traces both. Still wrong on 2.11 under dynamo's "eager" backend (AOT backends and
            # inductor are exact): the session 39 note says what is next
            from torch.distributed import _functional_collectives as funcol

            return funcol.all_reduce(x, "sum", group)
        out = x.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return grad_out, None


def all_reduce_identity_backward(x: Tensor, *, group: dist.ProcessGroup | None = None) -> Tensor:
    """Sum ``x`` over the SP group; the backward passes each rank's gradient through unchanged.

    Use it for a quantity every rank then differentiates *the same way* (a loss): each rank's
    backward accounts for its own summand only, so summands' gradients are not multiplied by P.
    Without a group it returns ``x``.
    """
    group = resolve_group(group)
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _AllReduceSumIdentityBackward.apply(x, group)


def sequence_parallel_mean(
    sum_local: Tensor, count_local: Tensor | int, *, group: dist.ProcessGroup | None = None
) -> Tensor:
    """``sum over ranks of sum_local / sum over ranks of count_local``, equal on every SP rank.

    For users with their own per-token loss: pass the local sum (differentiable, any shape) and
    the local count of valid tokens. A group with no valid token gives 0 rather than NaN.
    """
    total = all_reduce_identity_backward(sum_local, group=group)
    # int64: exact for any token count (fp32 would round beyond 2**24 tokens).
    count = torch.as_tensor(count_local, device=sum_local.device, dtype=torch.int64).clone()
    group = resolve_group(group)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(count, op=dist.ReduceOp.SUM, group=group)
    return total / count.clamp(min=1).to(total.dtype)


def _token_losses(logits: Tensor, targets: Tensor, ignore_index: int) -> Tensor:
    # logits (B, S_local, V), targets (B, S_local) -> per-token loss (B, S_local) in fp32 (or fp64),
    # 0 where ignored. Upcast as transformers' ForCausalLMLoss does: bf16 logits lose the tail.
    # Logits split over TP on the vocabulary (a DTensor Shard(-1), the column-parallel head's output, or a
    # VocabSlicedLogits, DeepSpeed AutoTP's split head):
    # the vocab-parallel cross-entropy, so no rank gathers (S_local, V).
    if (sharded := vocab_sharded_logits(logits)) is not None:
        local, tp_group, vocab_start = sharded
        if local.shape[:-1] != targets.shape:
            raise ValueError(
                f"logits {tuple(logits.shape)} and labels {tuple(targets.shape)} disagree: expected "
                "logits (batch, seq_local, vocab) and labels (batch, seq_local) of the same shard"
            )
        flat = vocab_parallel_token_losses(local.reshape(-1, local.shape[-1]), targets.reshape(-1),
                                           vocab_start=vocab_start, group=tp_group, ignore_index=ignore_index)
        return flat.view(targets.shape)
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and labels {tuple(targets.shape)} disagree: expected "
            "logits (batch, seq_local, vocab) and labels (batch, seq_local) of the same shard"
        )
    acc = upcast(logits)
    flat = F.cross_entropy(
        acc.reshape(-1, acc.shape[-1]), targets.reshape(-1).to(logits.device),
        ignore_index=ignore_index, reduction="none",
    )
    return flat.view(targets.shape)


def sequence_parallel_loss(
    logits_local: Tensor,
    labels_local: Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> Tensor:
    """Cross-entropy over the whole sequence of an SP group, from each rank's shard.

    Args:
        logits_local: ``(batch, seq_local, vocab)``, this rank's shard; under tensor parallelism also a
            DTensor sharded on the vocabulary over the TP mesh (``Shard(-1)``: the column-parallel LM
            head's output), or a :class:`~seqpar.sequence.vocab_parallel.VocabSlicedLogits` (a plain tensor of
            this TP rank's vocabulary columns, e.g. DeepSpeed AutoTP's split head), whose cross-entropy is then
            vocab-parallel (:mod:`seqpar.sequence.vocab_parallel`): the full vocabulary never exists on a rank.
        labels_local: ``(batch, seq_local)`` targets aligned with the logits, i.e. labels shifted
            for causal LM **before** sharding: the ``shift_labels`` of :func:`seqpar.sequence.batch.shard_batch`.
            For labels sharded unshifted, use :func:`sequence_parallel_causal_lm_loss`.
        group: the SP group (default: the default manager's SP group; without one on a world > 1: an
            error, see :func:`seqpar.runtime.groups.resolve_group`).
        ignore_index: targets that do not count.
        reduction: ``"mean"`` (token-weighted over the whole sequence and batch, as single-device
            ``cross_entropy`` would give; 0 when no token is valid), ``"sum"`` (the global sum),
            or ``"none"`` (this rank's per-token losses ``(batch, seq_local)``, no communication).

    Returns:
        A scalar identical on every SP rank (``"mean"``, ``"sum"``), in fp32 for half inputs.
        Backward gives every rank exactly its share of the single-device gradient; sum parameter
        gradients over the SP group (module docstring).
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction={reduction!r} is invalid: choose one of {list(_REDUCTIONS)}")
    losses = _token_losses(logits_local, labels_local, ignore_index)  # (B, S_local)
    if reduction == "none":
        return losses
    total = losses.sum()
    if reduction == "sum":
        return all_reduce_identity_backward(total, group=group)
    count = (labels_local != ignore_index).sum()
    return sequence_parallel_mean(total, count, group=group)


def shift_labels_across_shards(
    labels_local: Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    sharding: str | None = None,
    ignore_index: int = -100,
) -> Tensor:
    """Next-token targets ``(B, S_local)`` for labels sharded unshifted (like ``input_ids``).

    Each chunk's labels move one to the left; the last position of every chunk takes the first
    label of the next global chunk (one tiny all-gather of ``(B, chunks per rank)`` integers), and
    the sequence's last position gets ``ignore_index``. Collective over the SP group. ``sharding``:
    the layout the labels were cut with (default: the run's declared sharding, else ``"contiguous"``;
    see :func:`seqpar.sequence.sharding.resolve_sharding`).
    """
    sharding = resolve_sharding(sharding, where="shift_labels_across_shards")
    rank, world_size = sp_rank_and_size(group)
    if sharding == "balanced":
        raise ValueError(
            "labels cut with sharding='balanced' cannot be shifted after the cut: the layout depends on "
            "the batch's document boundaries. Cut the batch with seqpar.sequence.batch.shard_batch, which shifts "
            "the labels before the cut and passes shift_labels to the model"
        )
    n = num_chunks(world_size, sharding)
    mine = chunk_ids(rank, world_size, sharding)
    batch, seq_local = labels_local.shape
    chunk = seq_local // len(mine)
    # First label of each local chunk: (B, chunks_per_rank)
    heads = labels_local[:, ::chunk].contiguous()
    if world_size > 1:
        gathered = [torch.empty_like(heads) for _ in range(world_size)]
        dist.all_gather(gathered, heads, group=resolve_group(group))
    else:
        gathered = [heads]
    # first_of[c] = first label of global chunk c, (B,) each
    first_of: dict[int, Tensor] = {}
    for r, h in enumerate(gathered):
        for j, c in enumerate(chunk_ids(r, world_size, sharding)):
            first_of[c] = h[:, j]
    pieces = []
    for j, c in enumerate(mine):
        body = labels_local[:, j * chunk:(j + 1) * chunk]
        nxt = first_of[c + 1] if c + 1 < n else torch.full_like(body[:, 0], ignore_index)
        pieces.append(torch.cat([body[:, 1:], nxt[:, None]], dim=1))
    return torch.cat(pieces, dim=1)


def sequence_parallel_causal_lm_loss(
    logits_local: Tensor,
    labels_local: Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    sharding: str | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> Tensor:
    """Like :func:`sequence_parallel_loss`, for labels sharded **unshifted** (as ``input_ids``).

    The next-token shift crosses shard boundaries: each rank sends the first label of each of its
    chunks (one tiny all-gather of ``(batch, chunks)`` integers) so the last token of every chunk
    gets the true next token. ``sharding`` must be the layout the labels were cut with.

    Args:
        logits_local: ``(batch, seq_local, vocab)``.
        labels_local: ``(batch, seq_local)``, the same positions as the input ids of this shard.
        group, ignore_index, reduction: as for :func:`sequence_parallel_loss`.
        sharding: ``"contiguous"`` or ``"zigzag"``; default: the run's declared sharding, else
            ``"contiguous"``. A value that contradicts the declared one raises ``ValueError``.
    """
    sharding = resolve_sharding(sharding, where="sequence_parallel_causal_lm_loss")
    targets = shift_labels_across_shards(
        labels_local, group=group, sharding=sharding, ignore_index=ignore_index
    )
    return sequence_parallel_loss(
        logits_local, targets, group=group, ignore_index=ignore_index, reduction=reduction
    )
