"""The tiled loss's vocabulary-outer backward (``tiled_lm_loss(backward_order="vocab")``, the automatic choice for a
bf16 / fp16 head with fewer rows than vocabulary): the loss and every gradient equal one process's float64 cross
entropy, in bf16 and fp32, with ignored rows, several vocabulary blocks and row tiles, on a whole head, on a head split
over the vocabulary (``vocab_split``, 2 gloo ranks) and on a DTensor head split over a TP mesh (``Shard(0)``).

Tolerances, on each gradient's own scale (its largest magnitude): fp32 ``1e-5``; bf16 ``2^-6`` (a few bf16
roundings: the inputs are rounded to bf16 first and the reference is float64 on those rounded values, so what is
left is the backward's own rounding of dlogits and of the two gradients, as the row-outer order and autograd do).
"""

from __future__ import annotations

import pytest
import torch
from tiled_loss_reference import LOSS_RTOL
from tiled_loss_reference import close as _close
from tiled_loss_reference import inputs as _inputs
from tiled_loss_reference import reference as _reference

from seqpar.memory.tiling import loss_backward_order, loss_chunk_rows, tiled_lm_loss


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("vocab,hidden,chunk_rows", [(1000, 16, None), (517, 24, 3), (96, 32, 5)])
def test_vocab_order_matches_float64(vocab: int, hidden: int, chunk_rows: int | None, seed: int,
                                     dtype: torch.dtype) -> None:
    """One process, the whole head: the vocabulary order's loss and gradients against float64, and against the
    row order's. Shapes give several vocabulary blocks (``hidden`` head rows each, the last one short: 1000 / 16,
    517 / 24) and several row tiles (``chunk_rows`` 3 and 5), and 96 < 2 x 32 rows (a head of 3 blocks).

    Seen failing: the vocabulary order's one-hot subtracted at the target's id within the whole head instead of
    within its block (``col = local_target[sl]``): dhidden off by 3.06 of its scale (bf16 and fp32, 517 x 24); and
    with the tile's rows' ``lse`` not subtracted (``dl.exp_()`` alone): dhidden off by 1.3e4 of its scale."""
    h64, w64, t = _inputs(seed, vocab, hidden, 2, 37, dtype)
    ref_loss, ref_h, ref_w = _reference(h64, w64, t)
    grads = {}
    for order in ("vocab", "rows"):
        h, w = h64.to(dtype).requires_grad_(), w64.to(dtype).requires_grad_()
        loss, count = tiled_lm_loss(h, w, t, chunk_rows=chunk_rows, backward_order=order)
        loss.backward()
        assert int(count) == int((t != -100).sum())
        assert h.grad.dtype == dtype and w.grad.dtype == dtype
        torch.testing.assert_close(loss.double(), ref_loss, rtol=LOSS_RTOL[dtype], atol=0)
        _close(h.grad, ref_h, dtype, f"{order}: dhidden")
        _close(w.grad, ref_w, dtype, f"{order}: dweight")
        grads[order] = (h.grad.double(), w.grad.double())
    # the same products summed in another order: within the dtype's rounding of each other
    _close(grads["vocab"][0], grads["rows"][0], dtype, "vocab vs rows: dhidden")
    _close(grads["vocab"][1], grads["rows"][1], dtype, "vocab vs rows: dweight")


def test_vocab_order_only_hidden_or_only_weight() -> None:
    """A frozen head (only the hidden states need a gradient) and frozen hidden states (only the head): the
    vocabulary order returns the one gradient asked for, equal to the float64 reference."""
    h64, w64, t = _inputs(3, 300, 16, 1, 40, torch.float32)
    _, ref_h, ref_w = _reference(h64, w64, t)
    for want_h in (True, False):
        h, w = h64.float().requires_grad_(want_h), w64.float().requires_grad_(not want_h)
        loss, _ = tiled_lm_loss(h, w, t, backward_order="vocab")
        loss.backward()
        if want_h:
            _close(h.grad, ref_h, torch.float32, "dhidden")
            assert w.grad is None
        else:
            _close(w.grad, ref_w, torch.float32, "dweight")
            assert h.grad is None


def test_order_rule() -> None:
    """The automatic order: vocabulary-outer for a bf16 / fp16 head with fewer rows than vocabulary, row-outer for
    fp32 / fp64 heads and for rows at or above the vocabulary; Llama-3-8B (128256 x 4096) in bf16 at 1K and 64K
    rows is vocabulary-outer, at 256K rows row-outer."""
    v, h = 128256, 4096
    for rows, want in ((1024, "vocab"), (65536, "vocab"), (262144, "rows")):
        assert loss_backward_order(rows, h, v, 2, 2, loss_chunk_rows(rows, h, v)) == want, rows
    assert loss_backward_order(1024, h, v, 4, 4, loss_chunk_rows(1024, h, v)) == "rows"
    assert loss_backward_order(1024, h, v, 8, 8, loss_chunk_rows(1024, h, v)) == "rows"
    assert loss_backward_order(64, 64, 1024, 2, 2, 4) == "vocab"
    assert loss_backward_order(4096, 64, 1024, 2, 2, loss_chunk_rows(4096, 64, 1024)) == "rows"


def test_bad_order_is_refused() -> None:
    h, w, t = _inputs(0, 50, 8, 1, 4, torch.float32)
    with pytest.raises(ValueError, match="backward_order 'cols'"):
        tiled_lm_loss(h, w, t, backward_order="cols")


def _split_heads(rank: int, world: int, dtype_name: str) -> str:
    """On 2 gloo ranks, the pair as the TP group: the vocabulary order on this rank's slice of the head, given as
    ``vocab_split`` (uneven slices, 259 + 258 ids) and as a DTensor ``Shard(0)`` over a 1-D mesh, against one
    process's float64 cross entropy; both orders, with row tiles of 3 rows and the automatic tile."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from seqpar.sequence.vocab_parallel import VocabSplitHead, vocab_slice

    dtype = getattr(torch, dtype_name)
    vocab, hidden = 517, 24
    h64, w64, t = _inputs(11, vocab, hidden, 2, 19, dtype)
    ref_loss, ref_h, ref_w = _reference(h64, w64, t)
    start, rows = vocab_slice(vocab, rank, world)
    split = VocabSplitHead(dist.group.WORLD, start, vocab, vocab_slice(vocab, 0, world)[1])
    mesh = init_device_mesh("cpu", (world,))
    for order in ("vocab", "rows"):
        for chunk_rows in (3, None):
            h = h64.to(dtype).requires_grad_()
            w = w64[start:start + rows].to(dtype).requires_grad_()
            loss, _ = tiled_lm_loss(h, w, t, chunk_rows=chunk_rows, vocab_split=split, backward_order=order)
            loss.backward()
            torch.testing.assert_close(loss.double(), ref_loss, rtol=LOSS_RTOL[dtype], atol=0)
            _close(h.grad, ref_h, dtype, f"vocab_split {order} {chunk_rows}: dhidden")
            _close(w.grad, ref_w[start:start + rows], dtype, f"vocab_split {order} {chunk_rows}: dweight")
            hd = h64.to(dtype).requires_grad_()
            wd = distribute_tensor(w64.to(dtype), mesh, [Shard(0)]).requires_grad_()
            loss, _ = tiled_lm_loss(hd, wd, t, chunk_rows=chunk_rows, backward_order=order)
            loss.backward()
            torch.testing.assert_close(loss.double(), ref_loss, rtol=LOSS_RTOL[dtype], atol=0)
            _close(hd.grad, ref_h, dtype, f"DTensor {order} {chunk_rows}: dhidden")
            _close(wd.grad.full_tensor(), ref_w, dtype, f"DTensor {order} {chunk_rows}: dweight")
    return "exact"


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float32"])
def test_vocab_order_on_split_heads(dist_pool, dtype_name: str) -> None:  # noqa: ANN001
    """Seen failing: the vocabulary order's one-hot at the target's global id (``local_target = target``, the
    slice's ``vocab_start`` not subtracted): both ranks' gradients off (bf16)."""
    assert dist_pool.run(2, _split_heads, dtype_name, timeout=300) == ["exact", "exact"]


@pytest.mark.parametrize("order", ["vocab", "rows"])
def test_low_precision_matmul_path_matches_float64(order: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA path's fp32 accumulations by one bf16 matmul writing fp32 (``torch.addmm(..., out_dtype=float32)``,
    which torch has on CUDA only), played on CPU: the kernel is replaced by its definition (``acc += fp32(a) @
    fp32(b)``) and its inputs are checked to be the bf16 tensors themselves (no upcast copies). Both orders' loss and
    gradients still equal float64 on bf16-rounded inputs, as the upcast path does.

    Seen failing: ``addmm_fp32_out(dh[sl], dl, w_blk)`` given ``w_blk.t()`` (the shapes' assert), and the vocabulary
    order's ``dl`` left fp32 on this path (the bf16 assert)."""
    import seqpar.memory.tiling as tiling

    calls = []

    def emulated(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        assert a.dtype == b.dtype == torch.bfloat16 and acc.dtype == torch.float32
        assert acc.shape == (a.shape[0], b.shape[1]) and a.shape[1] == b.shape[0]
        calls.append(a.shape)
        acc.add_(a.float() @ b.float())

    monkeypatch.setattr(tiling, "fp32_out_matmul_supported", lambda device, dtype: True)
    monkeypatch.setattr(tiling, "addmm_fp32_out", emulated)
    h64, w64, t = _inputs(3, 517, 24, 2, 37, torch.bfloat16)
    ref_loss, ref_h, ref_w = _reference(h64, w64, t)
    h, w = h64.to(torch.bfloat16).requires_grad_(), w64.to(torch.bfloat16).requires_grad_()
    loss, _ = tiled_lm_loss(h, w, t, chunk_rows=5, backward_order=order)
    loss.backward()
    assert calls, "the low-precision path was not taken"
    torch.testing.assert_close(loss.double(), ref_loss, rtol=LOSS_RTOL[torch.bfloat16], atol=0)
    _close(h.grad, ref_h, torch.bfloat16, f"{order}: dhidden")
    _close(w.grad, ref_w, torch.bfloat16, f"{order}: dweight")
