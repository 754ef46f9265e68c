"""Memory beyond attention: the LM head + loss and the decoder MLPs over sequence chunks.

Once attention costs O(S/P) per rank, two other terms dominate a long-context step:

- the logits, ``(batch, seq_local, vocab)``, with their fp32 softmax and gradient (Llama-3-8B at
  128K local tokens: ~33 GB in bf16 before the softmax);
- each decoder MLP's intermediate activations, ``(batch, seq_local, intermediate)``, three to four
  of them saved per layer for backward.

Both are token-wise, so computing them over chunks of the local rows is exact. Two autograd
Functions do it; each saves only its input and recomputes one chunk at a time in backward:

- :func:`tiled_lm_loss`: ``sum of cross-entropy(hidden @ W^T, target)`` over chunks of rows. Forward
  keeps a running fp32 sum and saves the rows' log-sum-exp; backward recomputes each tile's logits, turns
  them into ``softmax - onehot`` in place and multiplies back, over row chunks (the head's gradient
  accumulated in fp32) or, for a bf16 / fp16 head with fewer rows than vocabulary, over blocks of the
  head's rows (each block's gradient written once in the weight's dtype: no fp32 ``(vocab, hidden)``
  buffer). At most one tile's logits exist, in fp32.
- :func:`tiled_mlp`: ``mlp(x)`` chunk by chunk under ``no_grad``; backward recomputes each chunk
  with grad and takes ``torch.autograd.grad`` with respect to the chunk and the parameters. The
  parameters' gradients are summed inside the Function and returned **once**, as the gradients of
  the Function's parameter inputs: the engine's per-parameter gradient hooks (DeepSpeed ZeRO-1/2/3's
  reduce hooks, FSDP's post-backward reduce-scatter) see one complete gradient, as for an untiled
  MLP. (DeepSpeed's own TiledMLP lets each chunk accumulate into ``.grad`` and has to flag
  ``ds_grad_is_ready`` on all but the last chunk instead.) Under ZeRO-3 the MLP is marked a "leaf"
  module, so its parameters are gathered once for the whole MLP and are whole tensors when they
  enter the Function.

:func:`apply_tiling` applies both to a Hugging Face causal LM of the Llama family from the
``sequence_parallel`` config (``tiled_loss``, ``tiled_mlp``, ``offload_activations``); the swap
calls it. It refuses, naming the module, what it cannot tile exactly.
"""

from __future__ import annotations

import inspect
import logging
import math
import sys
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from seqpar.config import SeqParConfig
from seqpar.kernels.matmul import addmm_fp32_out, fp32_out_matmul_supported
from seqpar.sequence.call_group import call_group
from seqpar.sequence.vocab_parallel import (
    VocabSplitHead,
    enter_tp_group,
    enter_tp_region,
    loss_dtype,
    lse_and_picked,
    upcast,
    vocab_slice,
)

__all__ = [
    "TilingError",
    "TilingReport",
    "apply_tiling",
    "tiled_lm_loss",
    "tiled_mlp",
    "loss_chunk_rows",
    "loss_backward_order",
    "loss_backward_bytes",
    "loss_backward_tiles",
    "mlp_chunks",
    "CAUSAL_LM_CLASSES",
    "MLP_CLASSES",
]

logger = logging.getLogger("seqpar")

# The Hugging Face causal LMs whose head is a bias-free nn.Linear over the last hidden state and
# whose decoder MLPs are token-wise (checked against transformers 5.x modeling files).
CAUSAL_LM_CLASSES = (
    "LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "GemmaForCausalLM", "Phi3ForCausalLM",
)
MLP_CLASSES = ("LlamaMLP", "Qwen2MLP", "MistralMLP", "GemmaMLP", "Phi3MLP")


class TilingError(ValueError):
    """The model cannot be tiled exactly; the message names the module and the fix."""


# ============================================================================ chunk sizes
# where a tiled module keeps its own untiled forward (a bound method there follows the module into a deep copy)
UNTILED_FORWARD = "_seqpar_untiled_forward"
MAX_LOSS_CHUNK_ELEMENTS = 2**27  # 512 MiB of fp32 logits


def loss_chunk_rows(rows: int, hidden_size: int, vocab_size: int) -> int:
    """Rows per loss chunk: a chunk's fp32 logits are about as large as the hidden states
    ``(rows, hidden_size)``, so the loss never holds more than a few hidden-state-sized buffers,
    and at most :data:`MAX_LOSS_CHUNK_ELEMENTS` (long sequences: the chunk stops growing)."""
    by_hidden = math.ceil(rows * hidden_size / vocab_size)
    return max(1, min(rows, by_hidden, MAX_LOSS_CHUNK_ELEMENTS // vocab_size))


def mlp_chunks(setting: int | str, rows: int, hidden_size: int) -> int:
    """Number of MLP chunks for ``rows`` local tokens: the integer given (at most ``rows``), or for
    ``"auto"`` chunks of about ``hidden_size`` rows (one chunk's intermediate activations are then
    ``intermediate / hidden`` times a hidden-state-sized ``(hidden, hidden)`` block)."""
    n = math.ceil(rows / hidden_size) if setting == "auto" else int(setting)
    return max(1, min(rows, n))


def _row_slices(rows: int, chunk_rows: int) -> list[slice]:
    return [slice(i, min(i + chunk_rows, rows)) for i in range(0, rows, chunk_rows)]


# ============================================================================ tiled loss
BACKWARD_ORDERS = ("auto", "rows", "vocab")


def _acc_bytes(weight_bytes: int) -> int:
    """Bytes of the loss's accumulation dtype for a head of ``weight_bytes`` an element
    (:func:`seqpar.sequence.vocab_parallel.loss_dtype`: fp32 for bf16 / fp16, else the weight's own)."""
    return max(weight_bytes, 4)


def _low_precision_matmuls(hidden: Tensor, weight: Tensor) -> bool:
    """The backward's fp32 accumulations take one bf16 / fp16 matmul writing fp32
    (:func:`seqpar.kernels.matmul.addmm_fp32_out`: no upcast copies, the tensor-core rate) instead of the fp32
    matmul of upcast inputs: both inputs in one 16-bit dtype, on a device with that kernel (CUDA). The sums are
    the same up to their order (a product of two bf16 numbers is exact in fp32); the buffers are fewer, so the
    memory model (:func:`loss_backward_bytes`, the upcast path's, which CPU measures) stays an upper bound."""
    return (hidden.dtype == weight.dtype and hidden.dtype in (torch.bfloat16, torch.float16)
            and fp32_out_matmul_supported(str(weight.device), weight.dtype))


def loss_backward_tiles(rows: int, hidden_size: int, vocab_size: int, chunk_rows: int) -> tuple[int, int]:
    """``(tile rows, vocabulary block)`` of the vocabulary-outer backward (:func:`tiled_lm_loss`, ``backward_order
    "vocab"``) over ``rows`` local rows and a head of ``vocab_size`` rows: blocks of ``hidden_size`` head rows (a
    block's weight and gradient in fp32 are then ``(hidden, hidden)``), each crossed with tiles of rows holding at
    most as many logits as the row-outer order's tile (``chunk_rows x vocab_size``)."""
    block = max(1, min(vocab_size, hidden_size))
    return max(1, min(rows, (chunk_rows * vocab_size) // block)), block


def loss_backward_bytes(order: str, rows: int, hidden_size: int, vocab_size: int, hidden_bytes: int,
                        weight_bytes: int, chunk_rows: int, tp: int = 1) -> int:
    """Modelled peak bytes of :func:`tiled_lm_loss`'s backward on one rank, beyond what is alive when it starts
    (the hidden states ``(rows, hidden_size)``, the head ``(vocab_size, hidden_size)``), plus the rows'
    log-sum-exp the forward saved for it; ``hidden_bytes`` / ``weight_bytes``: their dtypes' element sizes.
    ``order``: ``"rows"`` or ``"vocab"`` (see :func:`loss_backward_order`). The whole-step estimate's tiled-loss
    term (:mod:`seqpar.memory.training`); measured in tests/test_memory_tiled_loss_bf16.py.

    - ``"rows"``: the dW accumulator ``V h a`` (``a``: the accumulation dtype's bytes, fp32 for bf16 / fp16),
      ``dhidden`` ``rows h e``, and the larger of two moments never alive together: inside the loop a chunk's
      logits turned into dlogits in place (one chunk's worth) and their cast or matmul buffers, at its end the head's gradient in the weight's dtype cast from
      the accumulator while it is alive (``V h e``, low precision only: in fp32 / fp64 the cast is no copy).
    - ``"vocab"``: the head's gradient in the weight's dtype ``V h e``, written block by block, and dhidden's
      accumulator ``rows h a``; inside the loop a block's weight in ``a`` (no copy in fp32), its gradient's
      accumulator, one tile's logits (``a``) beside one at a time their cast to the hidden dtype, the tile's rows in
      ``a`` or the one-hot scatter's buffers; at its end dhidden cast once from the accumulator (``rows h e``).

    ``tp > 1``: TP sequence parallelism (:class:`_GatheredTiledLMLoss`); ``rows`` and ``chunk_rows`` are this rank's
    (every rank holds ``rows``, a gathered chunk is ``tp x chunk_rows``), the saved log-sum-exp covers the gathered
    ``tp x rows``. ``"rows"``: the row order's moments over one gathered chunk, beside it the chunk of hidden rows
    (``tp chunk_rows h e``) and ``dhidden`` of this rank's rows. ``"vocab"``: the hidden rows regathered once
    (``tp rows h e``) for the loop above over ``tp x rows`` rows, dhidden's accumulator ``tp rows h a``; at its end
    (the gathered rows freed) the accumulator reduce-scattered in ``a`` into this rank's ``rows h a`` (beside gloo's
    copy of the accumulator), then cast.
    """
    if tp > 1:
        return _gathered_backward_bytes(order, rows, tp, hidden_size, vocab_size, hidden_bytes, weight_bytes,
                                        chunk_rows)
    h, v, a = hidden_size, vocab_size, _acc_bytes(weight_bytes)
    lse = rows * a
    if order == "rows":
        cast = v * h * weight_bytes if weight_bytes < a else 0
        # inside the loop one chunk's fp32 logits, turned into dlogits in place (the saved lse spares the second
        # chunk's worth the old term counted: bf16 +13.2% over on 512 x 16 / 256, fp32 +25.6%, recorded at the peak,
        # row33), beside one at a time: in bf16 / fp16 their cast with the fp32 copies of it and of the chunk's rows
        # that the head's gradient's addmm takes (CPU); dlogits @ weight (``chunk h e``); the one-hot scatter's
        # buffers with the chunk's targets and masks (``chunk (18 + 2 a)``)
        c, e = chunk_rows, hidden_bytes
        inner = c * v * a + max(c * v * e + c * h * a if e < a else c * h * e, c * (18 + 2 * a))
        return max(inner, cast) + v * h * a + rows * h * e + lse
    if order != "vocab":
        raise ValueError(f"backward order {order!r}: expected 'rows' or 'vocab'")
    loop = _vocab_loop_bytes(rows, h, v, hidden_bytes, weight_bytes, chunk_rows)
    # at its end dhidden's cast, beside the targets' mask and indices (``rows * 9``) and the last tile's (``tile *
    # 9``), alive until the function returns (the loop's term has them too)
    tile = loss_backward_tiles(rows, h, v, chunk_rows)[0]
    end = (rows * h * hidden_bytes + rows * 9 + tile * 9) * (hidden_bytes < a)
    return v * h * weight_bytes + rows * h * a + max(loop, end) + lse


def _vocab_loop_bytes(rows: int, h: int, v: int, hidden_bytes: int, weight_bytes: int, chunk_rows: int) -> int:
    """The vocabulary order's loop (:func:`_vocab_outer_backward`) over ``rows`` rows: its transient bytes."""
    a = _acc_bytes(weight_bytes)
    tile, block = loss_backward_tiles(rows, h, v, chunk_rows)
    low_h, low_w = hidden_bytes < a, weight_bytes < a  # fp32 / fp64: the casts below make no copy
    # a block's weight in fp32 and its gradient's accumulator; a tile's fp32 logits; beside them, one at a time
    # (recorded at the peak, row33): the logits in the hidden dtype before their upcast or their cast back, the
    # tile's rows in fp32 for the head's gradient, or the one-hot scatter's index and value (``tile (8 + 2 a)``:
    # int64 indices, the mask in ``a`` and its negation); throughout, the targets' mask and indices (``rows 9``) and
    # the tile's (``tile 9``: its columns and mask, alive until the next tile's replace them). Before, the scatter's
    # buffers were counted beside the casts, never alive with them: bf16 +3.2% over on 512 x 16 / 64 (TP 1), +4.0%
    # at TP 2; fp32 ``tile 4`` under
    return (block * h * a * low_w + block * h * a + tile * block * a
            + max(tile * block * hidden_bytes * low_h, tile * h * a * low_h, tile * (8 + 2 * a))
            + rows * 9 + tile * 9)


def _gathered_backward_bytes(order: str, rows: int, tp: int, hidden_size: int, vocab_size: int, hidden_bytes: int,
                             weight_bytes: int, chunk_rows: int) -> int:
    """:func:`loss_backward_bytes` under TP sequence parallelism (``tp > 1``; see there)."""
    h, v, a = hidden_size, vocab_size, _acc_bytes(weight_bytes)
    gathered_rows, gathered_chunk = tp * rows, tp * chunk_rows
    lse = gathered_rows * a
    if order == "rows":
        cast = v * h * weight_bytes if weight_bytes < a else 0
        # inside the loop one gathered chunk's logits, turned into dlogits in place (the saved lse spares the
        # vocab-parallel reductions, whose buffers the old term's second chunk of logits stood for: +5.4% / +7.1%
        # over the fp32 measurements of 2048 x 32 and 1024 x 64, recorded at the peak, est30). fp32: beside them
        # dlogits @ weight, gloo's copy of it inside the reduce-scatter and this rank's rows out. bf16 / fp16: the
        # larger of dlogits' cast beside the fp32 ones with the fp32 copies of it and of the gathered rows that the
        # head's gradient's addmm takes (CPU), and the cast dlogits beside the reduce-scatter's buffers. Not the
        # previous chunk's gloo copy, which gloo's worker thread releases late in about 1 run in 8 and the tracker's
        # wait rule never counts (mem32b; it made this model +4.4% over on 512 x 64 / 128 and +15% on 256 x 128 /
        # 1024, and so picked the vocabulary order where the row order measures 7-14% less, row33)
        e, gc = hidden_bytes, gathered_chunk
        scatter = 2 * gc * h * e + chunk_rows * h * e
        inner = (max(gc * v * (a + e) + gc * h * a, gc * v * e + scatter) if e < a else gc * v * a + scatter)
        return max(inner, cast) + v * h * a + rows * h * e + gc * h * e + lse
    if order != "vocab":
        raise ValueError(f"backward order {order!r}: expected 'rows' or 'vocab'")
    # held throughout: the head's gradient, dhidden's accumulator over the gathered rows, the saved lse; in the loop
    # the regathered rows beside the single-process loop's buffers; at its end (the gathered rows freed) the
    # accumulator reduce-scattered into this rank's rows in ``a`` beside gloo's copy of the accumulator (``tp rows h
    # a``, recorded at the peak, row33: without it -9.1% under on bf16 1024 x 64 / 256 with gathered chunks of 2,
    # where the loop is small; NCCL scatters in place, so on GPUs an upper bound). Its cast to the hidden dtype
    # comes after the accumulator is freed, and is smaller.
    loop = _vocab_loop_bytes(gathered_rows, h, v, hidden_bytes, weight_bytes, gathered_chunk)
    held = v * h * weight_bytes + gathered_rows * h * a + lse
    return held + max(gathered_rows * h * hidden_bytes + loop, rows * h * a + gathered_rows * h * a)


def loss_backward_order(rows: int, hidden_size: int, vocab_size: int, hidden_bytes: int, weight_bytes: int,
                        chunk_rows: int, tp: int = 1) -> str:
    """The tiled loss's backward order, from shapes and element sizes only (the same on every TP rank when given
    the same ``vocab_size``, the largest slice): ``"vocab"`` when the head is in low precision (bf16 / fp16: the
    row-outer order's fp32 ``(V, h)`` accumulator and its cast hold ``V h (4 + e)`` at its end) and the
    vocabulary-outer order's modelled peak (:func:`loss_backward_bytes`) is the smaller, about when ``rows`` is
    below ``vocab_size``; else ``"rows"`` (fp32 / fp64 heads: the accumulator is the gradient itself, nothing to
    save). ``tp > 1``: TP sequence parallelism, ``rows`` / ``chunk_rows`` this rank's (see
    :func:`loss_backward_bytes`)."""
    if weight_bytes >= _acc_bytes(weight_bytes):
        return "rows"
    args = (rows, hidden_size, vocab_size, hidden_bytes, weight_bytes, chunk_rows, tp)
    return "vocab" if loss_backward_bytes("vocab", *args) < loss_backward_bytes("rows", *args) else "rows"


def _chunk_loss_and_grad(
    hidden_c: Tensor, weight: Tensor, target_c: Tensor, ignore_index: int, want_grad: bool,
    vocab: tuple[int, dist.ProcessGroup | None] = (0, None), saved_lse: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """One chunk: ``(sum of per-token losses (fp32 scalar), dlogits (rows, vocab) fp32)`` with ``want_grad``, else
    ``(the sum, the rows' log-sum-exp (rows,) fp32)``, which the forward saves for the backward.

    ``hidden_c (rows, hidden)``, ``weight (vocab, hidden)``, ``target_c (rows,)`` with
    ``ignore_index`` for tokens without a loss. Logits are computed in the input dtype and upcast,
    as transformers' loss does. ``vocab = (start, tp_group)``: ``weight`` is the rows
    ``[start, start + vocab_local)`` of a head split over ``tp_group`` (vocab-parallel: the
    log-sum-exp and the target's logit are reduced over the group, see
    :mod:`seqpar.sequence.vocab_parallel`); ``dlogits`` is then this slice's. ``saved_lse (rows,)``: the rows'
    log-sum-exp from the forward; given, ``dlogits`` uses it and no reduction runs (the loss sum is then 0).
    """
    logits = upcast(hidden_c @ weight.t())  # (rows, vocab_local) fp32 (fp64 for fp64 inputs)
    valid = target_c != ignore_index
    if saved_lse is None:
        lse, picked, valid = lse_and_picked(logits, target_c, vocab[0], vocab[1], ignore_index)  # (rows,) each
        loss_sum = ((lse - picked) * valid).sum()
    else:
        lse, loss_sum = saved_lse, logits.new_zeros(())
    if not want_grad:
        return loss_sum, lse
    # d(lse - picked)/dlogits = softmax - onehot, zero on ignored rows; computed in place
    local_target = target_c - vocab[0]
    owned = valid & (local_target >= 0) & (local_target < logits.shape[1])
    dlogits = logits.sub_(lse.unsqueeze(1)).exp_()
    dlogits.scatter_add_(1, torch.where(owned, local_target, 0).unsqueeze(1), -owned.to(dlogits.dtype).unsqueeze(1))
    dlogits.mul_(valid.unsqueeze(1))
    return loss_sum, dlogits


def _vocab_outer_backward(hidden: Tensor, weight: Tensor, target: Tensor, lse: Tensor, grad_total: Tensor,
                          ignore_index: int, vocab_start: int, tiles: tuple[int, int], want_h: bool,
                          want_w: bool, cast_dhidden: bool = True) -> tuple[Tensor | None, Tensor | None]:
    """The tiled loss's gradients, vocabulary blocks outer: ``(dhidden (rows, hidden), dweight (vocab_local,
    hidden))`` in the inputs' dtypes. ``lse (rows,)``: the rows' log-sum-exp over the whole vocabulary (every TP
    rank's slice included) saved by the forward, so no collective runs. ``tiles = (tile rows, vocabulary block)``
    (:func:`loss_backward_tiles`). Each block's gradient is accumulated over the row tiles in the loss's dtype
    (fp32) and written once into ``dweight`` in the weight's dtype; ``dhidden`` accumulates over the blocks in fp32
    and is cast once at the end: the full fp32 ``(vocab, hidden)`` accumulator never exists. The products are the
    row-outer order's (``dlogits`` cast to the hidden dtype as autograd would, then back to fp32), summed in
    another order. ``cast_dhidden=False``: ``dhidden`` is returned as its fp32 accumulator (TP sequence
    parallelism reduce-scatters it before the cast)."""
    acc = loss_dtype(weight.dtype)
    tile, block = tiles
    rows, width = hidden.shape
    dweight = torch.empty_like(weight) if want_w else None
    dh = torch.zeros((rows, width), dtype=acc, device=hidden.device) if want_h else None
    valid = target != ignore_index  # (rows,)
    local_target = target - vocab_start
    low_mm = _low_precision_matmuls(hidden, weight)
    for v0 in range(0, weight.shape[0], block):
        w_blk = weight[v0:v0 + block]  # (block, hidden), a view
        w_acc = w_blk.to(acc) if want_h and not low_mm else None  # no copy in fp32
        dw_blk = torch.zeros(w_blk.shape, dtype=acc, device=weight.device) if want_w else None
        for sl in _row_slices(rows, tile):
            dl = upcast(hidden[sl] @ w_blk.t())  # (tile, block) fp32: the logits of the block's columns
            dl.sub_(lse[sl].unsqueeze(1)).exp_()  # softmax over the whole vocabulary
            col = local_target[sl] - v0
            owned = valid[sl] & (col >= 0) & (col < w_blk.shape[0])
            dl.scatter_add_(1, torch.where(owned, col, 0).unsqueeze(1), -owned.to(dl.dtype).unsqueeze(1))
            dl.mul_(valid[sl].unsqueeze(1)).mul_(grad_total)
            if low_mm:  # dlogits rounded to the hidden dtype, as autograd rounds them, and multiplied as they are
                dl = dl.to(hidden.dtype)
                if want_w:
                    addmm_fp32_out(dw_blk, dl.t(), hidden[sl])
                if want_h:
                    addmm_fp32_out(dh[sl], dl, w_blk)
                del dl
                continue
            if hidden.dtype != acc:
                dl.copy_(dl.to(hidden.dtype))  # rounded as the row-outer order (and autograd) rounds dlogits
            if want_w:
                dw_blk.addmm_(dl.t(), hidden[sl].to(acc))
            if want_h:
                dh[sl].addmm_(dl, w_acc)
            del dl
        if want_w:
            dweight[v0:v0 + block].copy_(dw_blk)
        del w_acc, dw_blk
    return (dh.to(hidden.dtype) if want_h and cast_dhidden else dh), dweight


class _TiledLMLoss(torch.autograd.Function):
    """``sum over valid rows of CE(hidden @ weight^T, target)``; see :func:`tiled_lm_loss`."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, target: Tensor, chunk_rows: int,  # type: ignore[override]
                ignore_index: int, vocab: tuple[int, dist.ProcessGroup | None],
                order: tuple[str, tuple[int, int]]) -> Tensor:
        total = torch.zeros((), dtype=loss_dtype(hidden.dtype), device=hidden.device)  # fp32 (fp64 for fp64)
        lse = []
        for sl in _row_slices(hidden.shape[0], chunk_rows):
            loss_c, lse_c = _chunk_loss_and_grad(hidden[sl], weight, target[sl], ignore_index, False, vocab)
            total += loss_c
            lse.append(lse_c)
        # the rows' log-sum-exp (rows,), reduced over the vocabulary split: the backward needs no collective
        ctx.save_for_backward(hidden, target, torch.cat(lse))
        # the weight as an attribute, not a saved tensor: FSDP2 / ZeRO-3 refill a parameter's
        # storage between forward and backward, which a saved tensor's version check would refuse
        ctx.weight = weight
        ctx.chunk_rows, ctx.ignore_index, ctx.vocab, ctx.order = chunk_rows, ignore_index, vocab, order
        return total

    @staticmethod
    def backward(ctx, grad_total: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        hidden, target, lse = ctx.saved_tensors
        weight = ctx.weight
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        order, tiles = ctx.order
        if order == "vocab":
            dhidden, dweight = _vocab_outer_backward(hidden, weight, target, lse, grad_total, ctx.ignore_index,
                                                     ctx.vocab[0], tiles, want_h, want_w)
            return dhidden, dweight, None, None, None, None, None
        dhidden = torch.empty_like(hidden) if want_h else None
        # fp32 accumulator for dW over the chunks (one matmul would accumulate in fp32 as well)
        dweight = torch.zeros(weight.shape, dtype=loss_dtype(weight.dtype), device=weight.device) if want_w else None
        low_mm = _low_precision_matmuls(hidden, weight)
        for sl in _row_slices(hidden.shape[0], ctx.chunk_rows):
            _, dlogits = _chunk_loss_and_grad(hidden[sl], weight, target[sl], ctx.ignore_index, True, ctx.vocab,
                                              lse[sl])
            dlogits = dlogits.mul_(grad_total).to(hidden.dtype)  # (rows, vocab), as autograd would cast
            if want_h:
                dhidden[sl] = dlogits @ weight
            if want_w and low_mm:
                addmm_fp32_out(dweight, dlogits.t(), hidden[sl])
            elif want_w:
                dweight.addmm_(dlogits.t().to(dweight.dtype), hidden[sl].to(dweight.dtype))  # no copy in fp32
            del dlogits
        return dhidden, (dweight.to(weight.dtype) if want_w else None), None, None, None, None, None


def _gather_rows(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """``(rows, hidden)`` of every rank of ``group``, stacked in rank order: ``(ranks * rows, hidden)``."""
    out = x.new_empty((dist.get_world_size(group) * x.shape[0], x.shape[1]))
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


def _reduce_scatter_rows(y: Tensor, group: dist.ProcessGroup) -> Tensor:
    """The dual of :func:`_gather_rows`: rank r receives the sum over ranks of rows ``[r * rows, (r+1) * rows)``."""
    out = y.new_empty((y.shape[0] // dist.get_world_size(group), y.shape[1]))
    dist.reduce_scatter_tensor(out, y.contiguous(), group=group)
    return out


class _GatheredTiledLMLoss(torch.autograd.Function):
    """The tiled loss under TP sequence parallelism: the hidden rows split over the TP group, the head over the
    vocabulary. Chunk by chunk, every rank's rows of the chunk are all-gathered (``(tp * rows, hidden)``), their
    local-vocabulary logits reduced vocab-parallel; backward recomputes each chunk (the same all-gather) and
    reduce-scatters its input gradient (partial over the vocabulary slices) back to the rows' owners, the dual
    of the gather. At most one gathered chunk exists: the whole ``(seq_local, hidden)`` never does. The forward
    saves every rank's rows' log-sum-exp ``(tp, rows)``. The vocabulary order's backward (``order``, as in
    :class:`_TiledLMLoss`) regathers all of them once (``(tp * rows, hidden)``, the one moment the gathered rows
    exist, small beside the ``(V / tp, hidden)`` fp32 accumulator of the row order it avoids)."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets_by_rank: Tensor, chunk_rows: int,  # type: ignore[override]
                ignore_index: int, vocab: tuple[int, dist.ProcessGroup], order: tuple[str, tuple[int, int]]) -> Tensor:
        # hidden (rows_local, hidden), targets_by_rank (tp, rows_local): the targets of every rank's rows
        total = torch.zeros((), dtype=loss_dtype(hidden.dtype), device=hidden.device)  # fp32 (fp64 for fp64)
        lse = torch.empty(targets_by_rank.shape, dtype=total.dtype, device=hidden.device)  # (tp, rows_local)
        for sl in _row_slices(hidden.shape[0], chunk_rows):
            gathered = _gather_rows(hidden[sl], vocab[1])  # (tp * rows_c, hidden)
            loss_c, lse_c = _chunk_loss_and_grad(gathered, weight, targets_by_rank[:, sl].reshape(-1), ignore_index,
                                                 False, vocab)
            total += loss_c
            lse[:, sl] = lse_c.view(lse.shape[0], -1)  # the gathered chunk is rank-major: (tp, rows_c)
        # every rank's rows' log-sum-exp, reduced over the vocabulary split: the backward runs no reduction for it
        ctx.save_for_backward(hidden, targets_by_rank, lse)
        ctx.weight = weight  # an attribute, as in _TiledLMLoss (FSDP2 refills the parameter's storage)
        ctx.chunk_rows, ctx.ignore_index, ctx.vocab, ctx.order = chunk_rows, ignore_index, vocab, order
        return total

    @staticmethod
    def backward(ctx, grad_total: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        hidden, targets_by_rank, lse = ctx.saved_tensors
        weight, group = ctx.weight, ctx.vocab[1]
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        order, tiles = ctx.order
        if order == "vocab":
            # every rank's rows regathered once (one all-gather, the same rows and bytes the row order gathers chunk
            # by chunk; every TP rank runs it, the order being chosen from shapes only), held for the loop over this
            # rank's head rows: (tp * rows, hidden), small beside the (V / tp, hidden) fp32 accumulator it avoids.
            # Regathered rather than saved by the forward: nothing more is held between forward and backward.
            gathered = _gather_rows(hidden, group)
            dh, dweight = _vocab_outer_backward(gathered, weight, targets_by_rank.reshape(-1), lse.reshape(-1),
                                                grad_total, ctx.ignore_index, ctx.vocab[0], tiles, want_h, want_w,
                                                cast_dhidden=False)
            del gathered
            dhidden = None
            if want_h:  # summed over the vocabulary slices in fp32, then cast once: (rows, hidden)
                dhidden = _reduce_scatter_rows(dh, group)
                del dh
                dhidden = dhidden.to(hidden.dtype)
            return dhidden, dweight, None, None, None, None, None
        dhidden = torch.empty_like(hidden) if want_h else None
        dweight = torch.zeros(weight.shape, dtype=loss_dtype(weight.dtype), device=weight.device) if want_w else None
        low_mm = _low_precision_matmuls(hidden, weight)
        for sl in _row_slices(hidden.shape[0], ctx.chunk_rows):
            gathered = _gather_rows(hidden[sl], group)
            _, dlogits = _chunk_loss_and_grad(gathered, weight, targets_by_rank[:, sl].reshape(-1), ctx.ignore_index,
                                              True, ctx.vocab, lse[:, sl].reshape(-1))
            dlogits = dlogits.mul_(grad_total).to(hidden.dtype)  # (tp * rows_c, vocab_local)
            if want_h:
                dhidden[sl] = _reduce_scatter_rows(dlogits @ weight, group)
            if want_w and low_mm:
                addmm_fp32_out(dweight, dlogits.t(), gathered)
            elif want_w:
                dweight.addmm_(dlogits.t().to(dweight.dtype), gathered.to(dweight.dtype))
            del dlogits, gathered
        return dhidden, (dweight.to(weight.dtype) if want_w else None), None, None, None, None, None


def tiled_lm_loss(
    hidden: Tensor, weight: Tensor, targets: Tensor, *, ignore_index: int = -100, chunk_rows: int | None = None,
    vocab_split: VocabSplitHead | None = None, backward_order: str = "auto",
) -> tuple[Tensor, Tensor]:
    """LM head + cross-entropy over row chunks: ``(loss_sum, count)``, never the full logits.

    Args:
        hidden: ``(batch, seq_local, hidden)`` final hidden states of this rank's shard.
        weight: ``(vocab, hidden)`` LM-head weight (bias-free); under tensor parallelism a DTensor split
            on the vocabulary over the TP mesh (``Shard(0)``): the loss is then vocab-parallel (each rank
            computes only its ``(rows, vocab / tp)`` logits per chunk) and ``hidden`` may be a DTensor
            split on the sequence (``Shard(1)``, TP sequence parallelism), whose rows are then all-gathered one
            chunk at a time (``chunk_rows`` counts the gathered rows).
        targets: ``(batch, seq_local)`` already-shifted labels (``shift_labels`` of
            :func:`seqpar.sequence.batch.shard_batch`), ``ignore_index`` where a token has no loss.
        chunk_rows: rows per chunk (default :func:`loss_chunk_rows`).
        vocab_split: for a plain ``weight`` that holds rows ``[vocab_split.vocab_start, + weight.shape[0])`` of a
            head split over ``vocab_split.group`` (DeepSpeed AutoTP's vocabulary-parallel head): the loss is then
            vocab-parallel over that group, and ``hidden`` (replicated over it) gets its gradient summed over it.
        backward_order: how the backward loops. ``"rows"``: over row chunks, the head's gradient accumulated in a
            ``(vocab, hidden)`` fp32 buffer (cast to the weight's dtype at the end: ``V h (4 + e)`` bytes then in
            bf16 / fp16). ``"vocab"``: over blocks of the head's rows outer, each block's gradient accumulated
            over row tiles and written once in the weight's dtype, ``dhidden`` accumulated in fp32 (``V h e +
            rows h 4`` and a block's buffers). Both exact (the same products, summed in another order), neither
            with a collective (the forward saves the rows' log-sum-exp). ``"auto"`` (default):
            :func:`loss_backward_order`, the smaller modelled peak (``"vocab"`` for a bf16 / fp16 head with fewer
            rows than vocabulary, else ``"rows"``). Under TP sequence parallelism the rule is the same, on this
            rank's rows and the gathered chunk (``loss_backward_order(..., tp=)``); its vocabulary order regathers
            every rank's rows once in the backward (``(tp * rows, hidden)``), loops over this rank's head rows and
            reduce-scatters dhidden in fp32: one all-gather and one reduce-scatter in the backward.

    Returns:
        ``loss_sum``: fp32 scalar, the sum of the valid tokens' losses (differentiable w.r.t.
        ``hidden`` and ``weight``, exact); ``count``: int64 scalar, the number of valid tokens.
        The SP-correct mean over the group is ``seqpar.sequence.loss.sequence_parallel_mean(loss_sum, count)``.
    """
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(
            f"hidden states {tuple(hidden.shape)} and labels {tuple(targets.shape)} disagree: expected "
            "(batch, seq_local, hidden) and (batch, seq_local) of the same shard"
        )
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"LM-head weight {tuple(weight.shape)} does not match hidden size {hidden.shape[-1]}")
    if backward_order not in BACKWARD_ORDERS:
        raise ValueError(f"tiled_lm_loss: backward_order {backward_order!r}; expected one of {BACKWARD_ORDERS}")
    vocab: tuple[int, dist.ProcessGroup | None] = (0, None)
    tile_vocab = weight.shape[0]  # the logits' columns the automatic tile is sized for
    if vocab_split is not None:
        if _vocab_sharded_weight(weight) is not None:
            raise TilingError("tiled_loss: the LM head's weight is a DTensor and a vocab_split was given too; "
                              "pass one description of the split, not both")
        start = vocab_split.vocab_start
        _check_vocab_split(weight.shape[0], vocab_split, hidden.device)
        # the logits are this rank's columns; the head's input is replicated over TP, and each rank's gradient
        # of it covers its columns only: summed over TP on the way back (the split head's own backward does that,
        # which the tiled loss bypasses by reading the weight)
        vocab = (start, vocab_split.group)
        tile_vocab = vocab_split.largest_rows  # the same tiles on every TP rank (see below)
        hidden = enter_tp_group(hidden, vocab_split.group)
    elif (sharded := _vocab_sharded_weight(weight)) is not None:
        # tensor parallelism: the head is split on the vocabulary; the hidden states enter the TP region
        # (all-gathered along the sequence under TP sequence parallelism) and the loss is vocab-parallel
        weight, mesh, vocab_start = sharded
        vocab = (vocab_start, mesh.get_group())
        # the largest slice, not this rank's: every TP rank must cut the same tiles, since each tile's
        # vocab-parallel reductions are collectives (a vocabulary TP does not divide, 97 = 49 + 48, gave
        # the ranks different tile counts: gloo aborted on "Received data size doesn't match expected size")
        tile_vocab = vocab_slice(tile_vocab, 0, mesh.size())[1]
        if _sequence_split(hidden, mesh):
            return _gathered_tiled_lm_loss(hidden, weight, targets, vocab, chunk_rows, ignore_index, tile_vocab,
                                           backward_order)
        hidden = enter_tp_region(hidden, mesh)
    hidden_2d = hidden.reshape(-1, hidden.shape[-1])  # (batch * seq_local, hidden)
    targets_1d = targets.reshape(-1).to(hidden.device)
    rows = hidden_2d.shape[0]
    chunk = chunk_rows or loss_chunk_rows(rows, hidden.shape[-1], tile_vocab)
    # the order from shapes and dtypes only, with the largest vocabulary slice: the same on every TP rank
    if backward_order == "auto":
        backward_order = loss_backward_order(rows, hidden.shape[-1], tile_vocab, hidden.element_size(),
                                             weight.element_size(), chunk)
    tiles = loss_backward_tiles(rows, hidden.shape[-1], tile_vocab, chunk)
    loss_sum = _TiledLMLoss.apply(hidden_2d, weight, targets_1d, chunk, ignore_index, vocab, (backward_order, tiles))
    count = (targets_1d != ignore_index).sum()
    return loss_sum, count


def _sequence_split(hidden: Tensor, mesh: Any) -> bool:
    """``hidden`` is a DTensor split on the sequence (``Shard(1)``) over ``mesh``: TP sequence parallelism."""
    from torch.distributed.tensor import DTensor, Shard

    return isinstance(hidden, DTensor) and hidden.device_mesh == mesh and hidden.placements == (Shard(1),)


def _gathered_tiled_lm_loss(hidden: Any, weight: Tensor, targets: Tensor, vocab: tuple[int, dist.ProcessGroup],
                            chunk_rows: int | None, ignore_index: int, tile_vocab: int,
                            backward_order: str) -> tuple[Tensor, Tensor]:
    """:func:`tiled_lm_loss` for hidden states split on the sequence over the TP group (a DTensor ``Shard(1)``
    of ``(batch, seq_local, hidden)``), with :class:`_GatheredTiledLMLoss`; ``tile_vocab``: the vocabulary slice
    the automatic tile is sized for, the same on every TP rank, as are the backward order and its tiles (from
    shapes and element sizes only: the vocabulary order's one all-gather and one reduce-scatter must run on every
    rank or none)."""
    tp = dist.get_world_size(vocab[1])
    local = hidden.to_local()  # (batch, seq_local / tp, hidden); its gradient stays this rank's rows
    batch, seq_t, width = local.shape
    if seq_t * tp != hidden.shape[1]:
        raise ValueError(f"tiled_loss: hidden states of {hidden.shape[1]} tokens split unevenly over TP {tp}; "
                         "each SP shard's length must be a multiple of tp_size")
    # the targets of each rank's rows, in that rank's flattened (batch, seq_local / tp) order: (tp, rows_local)
    targets_by_rank = targets.to(local.device).reshape(batch, tp, seq_t).permute(1, 0, 2).reshape(tp, -1)
    rows = batch * seq_t
    # rows per rank and chunk: a gathered chunk (tp x rows) is about loss_chunk_rows' size
    chunk = max(1, (chunk_rows or loss_chunk_rows(rows * tp, width, tile_vocab)) // tp)
    if backward_order == "auto":
        backward_order = loss_backward_order(rows, width, tile_vocab, local.element_size(), weight.element_size(),
                                             chunk, tp=tp)
    tiles = loss_backward_tiles(rows * tp, width, tile_vocab, chunk * tp)  # over the gathered rows
    loss_sum = _GatheredTiledLMLoss.apply(local.reshape(rows, width), weight, targets_by_rank, chunk, ignore_index,
                                          vocab, (backward_order, tiles))
    return loss_sum, (targets != ignore_index).sum()


def _vocab_sharded_weight(weight: Tensor) -> tuple[Tensor, Any, int] | None:
    """A head weight that is a DTensor split on the vocabulary (dim 0) over a 1-D TP mesh:
    ``(local rows, mesh, first global id)``; a plain tensor: ``None``."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(weight, DTensor):
        return None
    mesh = weight.device_mesh
    if mesh.ndim != 1 or weight.placements != (Shard(0),):
        raise TilingError(f"tiled_loss: the LM head's weight is a DTensor with placements {weight.placements} on a "
                          f"{mesh.ndim}-D mesh; the tiled loss takes it whole or split on the vocabulary over TP "
                          "(Shard(0), the colwise head of the model's tp plan)")
    start, length = vocab_slice(weight.shape[0], mesh.get_local_rank(), mesh.size())
    local = weight.to_local()
    # agreed over the TP group before the tiles' collectives: a rank raising alone would leave the others blocked
    table = _gather_ints([int(local.shape[0] == length), local.shape[0]], mesh.get_group(), local.device)
    bad = [(r, rows) for r, (ok, rows) in enumerate(table) if not ok]
    if bad:
        where = ", ".join(f"TP rank {r}: {rows} rows where torch's Shard layout gives "
                          f"{vocab_slice(weight.shape[0], r, mesh.size())[1]}" for r, rows in bad)
        raise TilingError(f"tiled_loss: the LM head's weight, a DTensor of {weight.shape[0]} rows split over TP "
                          f"{mesh.size()}, has local slices that do not follow its Shard(0) layout ({where}). Build "
                          "the head's DTensor with torch's even split (distribute_tensor / the model's tp plan), or "
                          "give DTensor.from_local each rank's torch.chunk slice")
    return local, mesh, start


def _gather_ints(values: list[int], group: dist.ProcessGroup, device: torch.device) -> list[list[int]]:
    """``values`` of every rank of ``group``, in group rank order: one small all-gather, on ``device`` (the
    backend's: the rank's GPU under NCCL)."""
    world = dist.get_world_size(group)
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    out = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(out, mine, group=group)
    return torch.stack(out).tolist()


def _check_vocab_split(rows: int, split: VocabSplitHead, device: torch.device) -> None:
    """Raise on every rank of ``split.group`` alike unless the ranks' head rows tile the vocabulary: this rank
    holds ``rows`` rows from ``split.vocab_start``. Each rank's slice must lie in ``[0, split.vocab_size)`` and
    hold at most ``split.largest_rows`` rows, the same ``vocab_size`` and ``largest_rows`` on every rank (the tile
    count follows them), and the slices together cover the vocabulary once. One all-gather of five integers, before
    the tiles' collectives: a rank raising alone (its slice inconsistent) would leave the others blocked in them."""
    me = [split.vocab_start, rows, split.vocab_size, split.largest_rows]
    fits = int(0 <= me[0] and me[0] + rows <= split.vocab_size and rows <= split.largest_rows)
    if dist.get_world_size(split.group) == 1:
        table = [[fits, *me]]
    else:
        table = _gather_ints([fits, *me], split.group, device)
    problems = [f"TP rank {r}'s {n} rows from {start} do not fit the split it describes ({vocab} ids, at most "
                f"{largest} a rank)" for r, (ok, start, n, vocab, largest) in enumerate(table) if not ok]
    if not problems and len({(vocab, largest) for _, _, _, vocab, largest in table}) > 1:
        problems.append("the ranks describe different splits (ids, most rows a rank: "
                        + ", ".join(f"TP rank {r}: {vocab}, {largest}" for r, (*_, vocab, largest) in enumerate(table))
                        + ")")
    if not problems:
        covered = 0
        for start, n in sorted((start, n) for _, start, n, _, _ in table):
            if start != covered:
                problems.append(f"the slices (first id, rows) {[(start, n) for _, start, n, _, _ in table]} by TP "
                                f"rank do not cover the {split.vocab_size} ids once")
                break
            covered += n
        if not problems and covered != split.vocab_size:
            problems.append(f"the slices (first id, rows) {[(start, n) for _, start, n, _, _ in table]} by TP rank "
                            f"cover {covered} of the {split.vocab_size} ids")
    if problems:
        raise TilingError("tiled_loss: the LM head's rows do not match the vocabulary split it carries "
                          f"(seqpar_vocab_split): {'; '.join(problems)}. Each TP rank's VocabSplitHead must give "
                          "where that rank's weight rows sit (complete_split_head sets it from DeepSpeed's "
                          "VocabParallelLinear); rebuild it after changing the head, or set tiled_loss false")


# ============================================================================ tiled MLP
class _TiledMLP(torch.autograd.Function):
    """``forward_fn(x)`` over row chunks; backward recomputes per chunk. See :func:`tiled_mlp`."""

    @staticmethod
    def forward(ctx, forward_fn: Callable[[Tensor], Tensor], x: Tensor, chunks: int,  # type: ignore[override]
                *params: Tensor) -> Tensor:
        x_2d = x.reshape(-1, x.shape[-1])  # (batch * seq_local, hidden): the MLP is token-wise
        chunk_rows = math.ceil(x_2d.shape[0] / chunks)
        with torch.no_grad():
            out = torch.cat([forward_fn(x_2d[sl]) for sl in _row_slices(x_2d.shape[0], chunk_rows)])
        ctx.save_for_backward(x)
        ctx.forward_fn, ctx.chunk_rows = forward_fn, chunk_rows
        ctx.params = params  # attributes, not saved tensors: engines refill parameter storages
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        params = ctx.params
        want_x = ctx.needs_input_grad[1]
        want_p = [ctx.needs_input_grad[3 + i] for i in range(len(params))]
        wrt = [p for p, w in zip(params, want_p) if w]
        x_2d = x.detach().reshape(-1, x.shape[-1])
        g_2d = grad_out.reshape(-1, grad_out.shape[-1])
        dx = torch.empty_like(x_2d) if want_x else None
        acc: list[Tensor | None] = [None] * len(wrt)
        for sl in _row_slices(x_2d.shape[0], ctx.chunk_rows):
            x_c = x_2d[sl].detach().requires_grad_(want_x)
            with torch.enable_grad():
                out_c = ctx.forward_fn(x_c)
            inputs = ([x_c] if want_x else []) + wrt
            grads = torch.autograd.grad(out_c, inputs, g_2d[sl], allow_unused=True)
            if want_x:
                dx[sl] = grads[0]
                grads = grads[1:]
            for i, g in enumerate(grads):
                if g is None:
                    continue
                if acc[i] is None:  # the first chunk's gradient becomes the accumulator
                    acc[i] = g.float() if g.dtype in (torch.float16, torch.bfloat16) else g
                else:
                    acc[i].add_(g)
            del out_c, grads
        it = iter(acc)
        dparams = []
        for p, w in zip(params, want_p):
            g = next(it) if w else None
            dparams.append(None if g is None else g.to(p.dtype))
        return (None, dx.view_as(x) if want_x else None, None, *dparams)


def tiled_mlp(mlp_forward: Callable[[Tensor], Tensor], x: Tensor, chunks: int, params: Sequence[Tensor]) -> Tensor:
    """``mlp_forward(x)`` computed over ``chunks`` chunks of the rows of ``x``, recomputed in backward.

    Args:
        mlp_forward: the token-wise function (the MLP module's own forward); it must read exactly
            ``params`` (their gradients come from ``torch.autograd.grad`` through it).
        x: ``(batch, seq_local, hidden)`` (any leading shape; rows are the flattened leading dims).
        chunks: number of row chunks (>= 1).
        params: the parameters ``mlp_forward`` uses; their gradients are returned once, complete.
    Returns:
        ``(batch, seq_local, out_features)``, equal to ``mlp_forward(x)``.
    """
    return _TiledMLP.apply(mlp_forward, x, chunks, *params)


# ============================================================================ applying to a model
@dataclass
class TilingReport:
    """What :func:`apply_tiling` changed."""

    loss: str | None = None
    """The causal LM whose LM head + loss is tiled (its class name), or None."""
    mlps: list[str] = field(default_factory=list)
    """Qualified names of the tiled MLP modules."""
    mlp_chunks: int | str | bool = False
    offload: str | None = None
    """What ``offload_activations`` did (or why it changed nothing)."""
    norms: list[str] = field(default_factory=list)
    """Qualified names of the RMSNorms made lean (``recompute_norm``, :mod:`seqpar.memory.norm`)."""

    def __bool__(self) -> bool:
        return bool(self.loss or self.mlps or self.offload or self.norms)

    def __str__(self) -> str:
        parts = []
        if self.loss:
            parts.append(f"tiled loss on {self.loss}")
        if self.mlps:
            parts.append(f"tiled MLP ({self.mlp_chunks} chunks) on {len(self.mlps)} modules: "
                         + ", ".join(self.mlps))
        if self.offload:
            parts.append(f"offload_activations: {self.offload}")
        if self.norms:
            parts.append(f"recompute_norm on {len(self.norms)} modules: " + ", ".join(self.norms))
        return "seqpar tiling: " + ("; ".join(parts) if parts else "nothing")


def _find_causal_lm(model: nn.Module, key: str) -> tuple[str, nn.Module]:
    for name, module in model.named_modules():
        if type(module).__name__ in CAUSAL_LM_CLASSES:
            return name, module
    raise TilingError(
        f"sequence_parallel.{key} is on, but {type(model).__name__} has no Hugging Face causal LM of the "
        f"Llama family ({', '.join(CAUSAL_LM_CLASSES)}) inside; seqpar tiles only those. Set "
        f"\"{key}\": false, or call seqpar.memory.tiling.tiled_lm_loss / tiled_mlp from your model's code"
    )


def _loss_problems(name: str, lm: nn.Module) -> list[str]:
    where = f"'{name or type(lm).__name__}' ({type(lm).__name__})"
    head = getattr(lm, "lm_head", None)
    problems = []
    if not isinstance(head, nn.Linear):
        problems.append(f"{where}: lm_head is {type(head).__name__}, not nn.Linear")
    elif head.bias is not None:
        problems.append(f"{where}: lm_head has a bias, which the tiled loss does not add")
    cfg = getattr(lm, "config", None)
    if getattr(cfg, "final_logit_softcapping", None):
        problems.append(f"{where}: final_logit_softcapping is set, which the tiled loss does not apply")
    if not hasattr(lm, "model"):
        problems.append(f"{where}: no .model (the decoder) to take the hidden states from")
    return problems


def _tiled_causal_lm_forward(lm: nn.Module, group: dist.ProcessGroup | None) -> Callable[..., Any]:
    """A replacement ``forward`` for a causal LM: with ``labels`` / ``shift_labels`` it returns the
    SP-correct loss from the tiled LM head and ``logits=None``; without, the original forward.

    The original forward is kept on the module (``UNTILED_FORWARD``), not in this closure: ``copy.deepcopy`` rebinds a
    bound method stored on the module to the copy, but shares a closure's, so a copy (a DPO reference model, an EMA
    or teacher copied after the swap) would run the original module's weights."""
    setattr(lm, UNTILED_FORWARD, lm.forward)
    signature = inspect.signature(lm.forward)

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        from seqpar.runtime.groups import resolve_group
        from seqpar.sequence.loss import sequence_parallel_mean

        call = dict(signature.bind_partial(*args, **kwargs).arguments)
        extra = call.pop("kwargs", {})
        labels, shift_labels = call.pop("labels", None), extra.pop("shift_labels", None)
        if labels is None and shift_labels is None:
            return getattr(self, UNTILED_FORWARD)(*args, **kwargs)  # no loss wanted: logits as before (evaluation)
        num_items = extra.pop("num_items_in_batch", None)
        call.pop("logits_to_keep", None)
        loss_group = call_group(extra, group)  # dynamic CP: the micro-batch's group travels with the call
        if shift_labels is None:
            sp_group = resolve_group(loss_group)
            if sp_group is not None and dist.get_world_size(sp_group) > 1:
                raise ValueError(
                    "tiled_loss under sequence parallelism needs shift_labels= (labels shifted before "
                    "sharding, from seqpar.sequence.batch.shard_batch); unshifted labels cannot be shifted on a shard"
                )
            shift_labels = nn.functional.pad(labels[..., 1:], (0, 1), value=-100)
        outputs = self.model(**call, **extra)
        hidden = outputs.last_hidden_state  # (batch, seq_local, hidden)
        # a head split over the vocabulary as a plain tensor (DeepSpeed AutoTP) carries where its rows sit
        split = getattr(self.lm_head, "seqpar_vocab_split", None)
        loss_sum, count = tiled_lm_loss(hidden, self.lm_head.weight, shift_labels, vocab_split=split)
        if num_items is not None:  # transformers' convention: a sum over the micro-batches' tokens
            from seqpar.sequence.loss import all_reduce_identity_backward

            loss = all_reduce_identity_backward(loss_sum, group=loss_group) / num_items
        else:
            loss = sequence_parallel_mean(loss_sum, count, group=loss_group)
        from transformers.modeling_outputs import CausalLMOutputWithPast

        return CausalLMOutputWithPast(loss=loss, logits=None, past_key_values=outputs.past_key_values,
                                      hidden_states=outputs.hidden_states, attentions=outputs.attentions)

    return types.MethodType(forward, lm)


def _tiled_mlp_forward(mlp: nn.Module, setting: int | str) -> Callable[[Tensor], Tensor]:
    """A replacement ``forward`` for a token-wise MLP: its rows in ``mlp_chunks`` chunks when grad is on, the
    original forward (kept on the module as ``UNTILED_FORWARD``, so a deep copy runs its own weights) otherwise."""
    setattr(mlp, UNTILED_FORWARD, mlp.forward)
    hidden_size = None

    def forward(self: nn.Module, x: Tensor) -> Tensor:
        nonlocal hidden_size
        hidden_size = hidden_size or x.shape[-1]
        rows = x.numel() // x.shape[-1]
        chunks = mlp_chunks(setting, rows, hidden_size)
        params = [p for p in self.parameters()]
        untiled = getattr(self, UNTILED_FORWARD)
        if chunks == 1 or not torch.is_grad_enabled():
            return untiled(x)
        return tiled_mlp(untiled, x, chunks, params)

    return types.MethodType(forward, mlp)


def _mark_zero3_leaf(module: nn.Module) -> None:
    # ZeRO-3 then gathers the MLP's parameters once, for the whole module, so they are whole
    # tensors when they enter the tiled Function (and the backward's re-gather covers them).
    if "deepspeed" in sys.modules:
        from deepspeed.utils import set_z3_leaf_module

        set_z3_leaf_module(module, True)


def apply_tiling(
    model: nn.Module, config: SeqParConfig | dict | str | None, *, group: dist.ProcessGroup | None = None
) -> TilingReport:
    """Tile the LM head + loss and/or the decoder MLPs of a Llama-family causal LM, in place.

    Reads ``tiled_loss``, ``tiled_mlp``, ``offload_activations`` and ``recompute_norm`` (the lean
    RMSNorms of :mod:`seqpar.memory.norm`) from the config; all off: no-op.
    Call before the engine wraps the model (the swap does it). With ``tiled_loss`` the model must be
    called with ``shift_labels=`` (or ``labels=`` at SP size 1) and returns ``loss`` (the SP-correct
    token-weighted mean over ``group``) with ``logits=None``; without labels it returns logits as
    before.

    Raises:
        TilingError: naming every module that cannot be tiled exactly; nothing is changed then.
    """
    cfg = SeqParConfig.load(config)
    report = TilingReport()
    if not (cfg.tiled_loss or cfg.tiled_mlp is not False or cfg.offload_activations or cfg.recompute_norm):
        return report
    key = ("tiled_loss" if cfg.tiled_loss else "tiled_mlp" if cfg.tiled_mlp is not False
           else "offload_activations" if cfg.offload_activations else "recompute_norm")
    lm_name, lm = _find_causal_lm(model, key)
    problems: list[str] = []
    if cfg.tiled_loss:
        problems += _loss_problems(lm_name, lm)
    mlps: list[tuple[str, nn.Module]] = []
    if cfg.tiled_mlp is not False:
        prefix = f"{lm_name}." if lm_name else ""
        for name, module in lm.named_modules():
            if name.endswith("mlp") and isinstance(module, nn.Module) and ".layers." in f".{name}":
                if type(module).__name__ in MLP_CLASSES:
                    mlps.append((prefix + name, module))
                else:
                    problems.append(f"'{prefix + name}' ({type(module).__name__}) is not a token-wise MLP "
                                    f"seqpar knows ({', '.join(MLP_CLASSES)})")
        if not mlps and not problems:
            problems.append(f"'{lm_name or type(lm).__name__}' has no decoder MLPs under .layers")
    if cfg.recompute_norm:
        from seqpar.memory.norm import norm_problems

        problems += norm_problems(lm, f"{lm_name}." if lm_name else "")
    if problems:
        raise TilingError("seqpar cannot tile this model exactly:\n  - " + "\n  - ".join(problems)
                          + "\nSet the key to false, or nothing is changed.")
    if cfg.tiled_loss and not getattr(lm, "_seqpar_tiled_loss", False):
        lm.forward = _tiled_causal_lm_forward(lm, group)
        lm._seqpar_tiled_loss = True
    if cfg.tiled_loss:
        report.loss = type(lm).__name__
    for name, mlp in mlps:
        if not getattr(mlp, "_seqpar_tiled_mlp", False):
            mlp.forward = _tiled_mlp_forward(mlp, cfg.tiled_mlp)
            mlp._seqpar_tiled_mlp = True
            _mark_zero3_leaf(mlp)
        report.mlps.append(name)
    report.mlp_chunks = cfg.tiled_mlp
    if cfg.recompute_norm:
        from seqpar.memory.norm import apply_recompute_norm

        report.norms = apply_recompute_norm(lm, f"{lm_name}." if lm_name else "")
    if cfg.offload_activations:
        from seqpar.memory.offload import apply_offload

        report.offload = apply_offload(lm)
    logger.info("%s", report)
    return report
