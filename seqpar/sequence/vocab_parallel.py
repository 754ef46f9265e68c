"""Cross-entropy over logits whose vocabulary is split across a tensor-parallel group, exact.

Under tensor parallelism the LM head is column-parallel on the vocabulary: TP rank t holds the
logits of its vocabulary slice ``[start_t, start_t + vocab_local)`` for every token,
``(rows, vocab / tp)``, and no rank ever holds ``(rows, vocab)``. The per-token loss
``lse(x) - x[target]`` needs three reductions over the TP group, all in fp32 (Megatron's
``vocab_parallel_cross_entropy``):

- ``m = max over ranks of the local row max`` (all-reduce MAX; a constant for the gradient),
- ``z = sum over ranks of sum(exp(x_local - m))`` (all-reduce SUM), so ``lse = m + log z``,
- ``x[target]``: picked on the one rank whose slice holds the target, 0 elsewhere (all-reduce SUM).

Backward needs no communication: ``dL/dx_local = softmax_local - onehot_local`` (``softmax_local =
exp(x_local - lse)``, the local slice of the global softmax), times the incoming per-token gradient.
The loss is the same on every TP rank; each rank's backward gives exactly the gradient of its own
vocabulary slice. What feeds the logits (the head's input, replicated over TP) gets a partial
gradient on each rank, which the TP region's entry sums (see
:func:`seqpar.sequence.vocab_parallel.enter_tp_region`).

torch's ``loss_parallel()`` computes the same forward for DTensor logits, but its backward must also
run inside the context manager: checked here (torch 2.13, gloo, 2 ranks), a ``loss.backward()`` outside it
raises "aten.nll_loss_backward.default got mixed torch.Tensor and DTensor", and the loss seqpar computes
inside the model (the swap's ``loss_function``) is differentiated by the user's loop, outside any context.
Nor can it enter a custom autograd Function such as the tiled loss (:mod:`seqpar.memory.tiling`). This
module serves both.

The slices follow torch's ``Shard`` layout (``torch.chunk``: ``ceil(vocab / tp)`` per rank, the last
ones shorter), the layout of a DTensor sharded on the vocabulary dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "vocab_slice",
    "vocab_parallel_token_losses",
    "vocab_sharded_logits",
    "VocabSlicedLogits",
    "VocabSplitHead",
    "enter_tp_group",
    "enter_tp_region",
    "lse_and_picked",
    "upcast",
    "loss_dtype",
]


def loss_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a loss over logits of ``dtype`` accumulates in: fp32 for half precision (as transformers'
    loss upcasts), else ``dtype`` itself (fp32, or fp64: a float64 run stays float64, as the gathered path does)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def upcast(x: Tensor) -> Tensor:
    """``x`` in :func:`loss_dtype` of its dtype (no copy when it already is)."""
    return x.to(loss_dtype(x.dtype))


def vocab_slice(vocab_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """``(start, length)`` of rank ``rank``'s slice of ``vocab_size`` entries under torch's ``Shard``
    layout (``torch.chunk``): slices of ``ceil(vocab_size / world_size)``, the last ones shorter or empty."""
    per = -(-vocab_size // world_size)
    start = min(rank * per, vocab_size)
    return start, min(per, vocab_size - start)


def lse_and_picked(
    logits_local: Tensor, target: Tensor, vocab_start: int, group: dist.ProcessGroup | None, ignore_index: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(lse, picked, valid)`` of rows ``(rows,)``, fp32, from this rank's slice of the logits.

    Args:
        logits_local: ``(rows, vocab_local)`` fp32, this rank's vocabulary slice (not modified).
        target: ``(rows,)`` global token ids, ``ignore_index`` for rows without a loss.
        vocab_start: the global id of this slice's first column.
        group: the TP group over which the vocabulary is split (``None``: the slice is the whole vocabulary).

    ``lse`` is the log-sum-exp over the whole vocabulary, ``picked`` the target's logit (0 on ignored
    rows); both the same on every rank of ``group``. Three all-reduces over ``group``: max, sum-exp, picked.
    """
    valid = target != ignore_index
    local_target = target - vocab_start
    owned = valid & (local_target >= 0) & (local_target < logits_local.shape[1])
    safe = torch.where(owned, local_target, 0).unsqueeze(1)  # (rows, 1)
    picked = logits_local.gather(1, safe).squeeze(1) * owned  # (rows,), 0 where another rank owns it
    if group is None or dist.get_world_size(group) == 1:
        return torch.logsumexp(logits_local, dim=-1), picked, valid
    row_max = logits_local.max(dim=-1).values  # (rows,)
    dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    # a row of -inf everywhere stays -inf (lse -inf) rather than NaN
    shift = torch.where(torch.isfinite(row_max), row_max, 0.0)
    sum_exp = (logits_local - shift.unsqueeze(1)).exp().sum(dim=-1)
    dist.all_reduce(sum_exp, op=dist.ReduceOp.SUM, group=group)
    dist.all_reduce(picked, op=dist.ReduceOp.SUM, group=group)
    return shift + sum_exp.log(), picked, valid


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token losses from a vocabulary slice; see the module docstring."""

    @staticmethod
    def forward(ctx, logits_local: Tensor, target: Tensor, vocab_start: int,  # type: ignore[override]
                group: dist.ProcessGroup | None, ignore_index: int) -> Tensor:
        x = upcast(logits_local)  # (rows, vocab_local) fp32 (fp64 for fp64 logits), as transformers' loss upcasts
        lse, picked, valid = lse_and_picked(x, target, vocab_start, group, ignore_index)
        losses = (lse - picked) * valid  # (rows,)
        ctx.save_for_backward(logits_local, target, lse)
        ctx.vocab_start, ctx.ignore_index = vocab_start, ignore_index
        return losses

    @staticmethod
    def backward(ctx, grad_losses: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        logits_local, target, lse = ctx.saved_tensors
        # softmax_local - onehot_local, computed in place on one fp32 buffer; no communication
        grad = upcast(logits_local).sub(lse.unsqueeze(1)).exp_()  # (rows, vocab_local), a new buffer
        valid = target != ctx.ignore_index
        local_target = target - ctx.vocab_start
        owned = valid & (local_target >= 0) & (local_target < grad.shape[1])
        safe = torch.where(owned, local_target, 0).unsqueeze(1)
        grad.scatter_add_(1, safe, -owned.to(grad.dtype).unsqueeze(1))
        grad.mul_((grad_losses.to(grad.dtype) * valid).unsqueeze(1))
        return grad.to(logits_local.dtype), None, None, None, None


def vocab_parallel_token_losses(
    logits_local: Tensor, target: Tensor, *, vocab_start: int, group: dist.ProcessGroup | None,
    ignore_index: int = -100,
) -> Tensor:
    """Per-token cross-entropy ``(rows,)`` (fp32, fp64 for fp64 logits; 0 where ignored) from this rank's
    vocabulary slice.

    Args:
        logits_local: ``(rows, vocab_local)``, the columns ``[vocab_start, vocab_start + vocab_local)``
            of the full ``(rows, vocab)`` logits; any float dtype (computed in fp32, fp64 for fp64).
        target: ``(rows,)`` global ids.
        vocab_start: first global id of this slice (:func:`vocab_slice`).
        group: the TP group that splits the vocabulary; every rank of it must call with the same rows.
    """
    if logits_local.dim() != 2 or target.shape != logits_local.shape[:1]:
        raise ValueError(f"vocab-parallel cross-entropy: expected logits (rows, vocab_local) and targets "
                         f"(rows,), got {tuple(logits_local.shape)} and {tuple(target.shape)}")
    return _VocabParallelCrossEntropy.apply(logits_local, target.to(logits_local.device), vocab_start, group,
                                            ignore_index)


@dataclass(frozen=True)
class VocabSlicedLogits:
    """Logits split on the vocabulary held as a plain tensor, with where this rank's columns sit: the output of a
    head that splits the vocabulary without DTensor (DeepSpeed AutoTP's ``VocabParallelLinear``, whose slices
    need not follow torch's ``Shard`` layout: its ``tp_grain_size`` rounding gives 25152 + 25105 columns for a
    vocabulary of 50257 where ``torch.chunk`` gives 25129 + 25128). seqpar's losses take it where they take logits
    (:func:`vocab_sharded_logits`), and compute the vocab-parallel cross-entropy over ``group``.

    Attributes:
        local: ``(..., vocab_local)``, the columns ``[vocab_start, vocab_start + vocab_local)`` of the logits.
        group: the TP group that splits the vocabulary (every rank of it holds the same rows).
        vocab_start: the global id of ``local``'s first column.
        vocab_size: the whole vocabulary.
    """

    local: Tensor
    group: dist.ProcessGroup
    vocab_start: int
    vocab_size: int

    @property
    def shape(self) -> torch.Size:
        """The whole logits' shape, ``(..., vocab_size)``."""
        return torch.Size((*self.local.shape[:-1], self.vocab_size))


@dataclass(frozen=True)
class VocabSplitHead:
    """Where the rows of an LM head weight split over the vocabulary as a plain tensor sit (DeepSpeed AutoTP's
    ``VocabParallelLinear``, whose ``tp_grain_size`` rounding need not follow torch's ``Shard`` layout; see
    :class:`VocabSlicedLogits`): what the tiled loss (:func:`seqpar.memory.tiling.tiled_lm_loss`) needs to reduce
    its logits vocab-parallel. The integration that split the head attaches it to the head as
    ``seqpar_vocab_split``.

    Attributes:
        group: the TP group that splits the vocabulary (every rank of it holds the same hidden states).
        vocab_start: the global id of this rank's first row.
        vocab_size: the whole vocabulary.
        largest_rows: the largest rank's row count, the same on every rank: the tiled loss sizes its tiles by it,
            since each tile's reductions are collectives every TP rank must reach alike.
    """

    group: dist.ProcessGroup
    vocab_start: int
    vocab_size: int
    largest_rows: int


class _EnterTPGroup(torch.autograd.Function):
    """Identity forward; backward sums the gradient over ``group`` (Megatron's copy to the TP region)."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def enter_tp_group(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """``x`` (a plain tensor replicated over ``group``) as the input of a column-parallel matmul split over
    ``group``: the same tensor, whose backward sums the TP ranks' partial gradients (each rank's covers its own
    slice of the output). :func:`enter_tp_region` for a process group instead of a DTensor mesh."""
    return _EnterTPGroup.apply(x, group)


def vocab_sharded_logits(logits: Any) -> tuple[Tensor, dist.ProcessGroup, int] | None:
    """For a DTensor sharded on its last dim over a 1-D mesh (a column-parallel LM head's output kept
    as a DTensor), or a :class:`VocabSlicedLogits`: ``(local logits, the TP group, the slice's first global id)``;
    else ``None``."""
    from torch.distributed.tensor import DTensor, Shard

    if isinstance(logits, VocabSlicedLogits):
        return logits.local, logits.group, logits.vocab_start
    if not isinstance(logits, DTensor):
        return None
    placements = logits.placements
    if len(placements) != 1 or not (isinstance(placements[0], Shard) and placements[0].dim in (-1, logits.dim() - 1)):
        raise ValueError(
            f"logits are a DTensor with placements {placements} on a {logits.device_mesh.ndim}-D mesh; seqpar's "
            "loss takes them sharded on the vocabulary (last) dim over the TP mesh (Shard(-1)), or as a plain tensor"
        )
    mesh = logits.device_mesh
    start, length = vocab_slice(logits.shape[-1], mesh.get_local_rank(), mesh.size())
    local = logits.to_local()
    if local.shape[-1] != length:
        raise ValueError(f"logits' local vocabulary slice has {local.shape[-1]} columns, torch's Shard layout "
                         f"gives {length}: seqpar's vocab-parallel loss expects the even (torch.chunk) split")
    return local, mesh.get_group(), start


def enter_tp_region(x: Tensor, mesh: Any) -> Tensor:
    """``x`` as the input of a TP region (a column-parallel matmul), a plain local tensor.

    A plain ``x`` is replicated over the TP mesh: returned as is, with a backward that sums the TP
    ranks' partial gradients (all-reduce). A DTensor ``x`` sharded on the sequence (``Shard(1)``, TP
    sequence parallelism) is all-gathered along the sequence; its backward reduce-scatters. Both are
    DTensor redistributions: ``to_local(grad_placements=[Partial()])`` declares the local gradient partial.
    """
    from torch.distributed.tensor import DTensor, Partial, Replicate

    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
    elif x.placements != (Replicate(),):
        x = x.redistribute(placements=[Replicate()])
    return x.to_local(grad_placements=[Partial()])
