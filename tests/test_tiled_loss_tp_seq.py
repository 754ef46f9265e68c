"""The tiled loss under TP sequence parallelism (hidden states a DTensor ``Shard(1)`` over the TP mesh, the head a
DTensor ``Shard(0)``: ``_GatheredTiledLMLoss``) in both backward orders, on 2 gloo ranks.

- Exact: the loss and every gradient equal one process's float64 cross entropy, in bf16 and fp32, both orders
  forced and the automatic one, with ignored rows, an uneven vocabulary split (259 + 258 ids), several vocabulary
  blocks and row tiles. Tolerances as tests/test_tiled_loss_vocab_order.py (each gradient on its own scale: fp32
  ``1e-5``, bf16 ``2^-6`` on bf16-rounded inputs).
- Memory: the bf16 backward's peak on each rank (``backward_peak``: ``TensorMemoryTracker``'s peak of the loss's
  backward alone over the loss's own state, its inputs and what its graph saved) drops as the model says: the row order holds the fp32 ``(V / tp, h)`` accumulator and its bf16 cast
  (``V / tp * h * 6``) at its end, the vocabulary order ``V / tp * h * 2`` and the regathered rows. Each order's
  ``loss_backward_bytes(..., tp=2)`` against its measurement: never under, within 1% over; the row order also on
  small shapes and explicit chunks, where a gathered chunk's buffers are a large share of the peak; the automatic
  order on shapes where the TP rule (``tp=2``) picks the row order and the one-process rule would pick the
  vocabulary order, measured as that order's model.
"""

from __future__ import annotations

import pytest
import torch
from tiled_loss_reference import LOSS_RTOL
from tiled_loss_reference import close as _close
from tiled_loss_reference import inputs as _inputs
from tiled_loss_reference import reference as _reference

from seqpar.memory.tiling import (
    loss_backward_bytes,
    loss_backward_order,
    loss_chunk_rows,
    tiled_lm_loss,
)

SCALARS = 16  # the incoming loss gradient and a chunk's loss sum, which the model leaves out
BAND = 0.01  # every order's model is within +0.35% of its measurement here (est30; 6% before)


def _split_inputs(h64: torch.Tensor, w64: torch.Tensor, dtype: torch.dtype, mesh) -> tuple:  # noqa: ANN001
    """This rank's leaf of the hidden states (its sequence slice), the DTensor hidden states ``Shard(1)`` over it and
    the head as a DTensor ``Shard(0)``."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    tp, r = mesh.size(), mesh.get_local_rank()
    seq_t = h64.shape[1] // tp
    leaf = h64[:, r * seq_t:(r + 1) * seq_t].to(dtype).requires_grad_()
    w = distribute_tensor(w64.to(dtype), mesh, [Shard(0)]).requires_grad_()
    return leaf, DTensor.from_local(leaf, mesh, [Shard(1)]), w


def _exact(rank: int, world: int, dtype_name: str) -> str:
    """Both orders (and the automatic one), tiles of 3 gathered rows and the automatic tile, against float64."""
    from torch.distributed.device_mesh import init_device_mesh

    dtype = getattr(torch, dtype_name)
    vocab, hidden, batch, seq = 517, 24, 2, 38
    h64, w64, t = _inputs(29, vocab, hidden, batch, seq, dtype)
    ref_loss, ref_h, ref_w = _reference(h64, w64, t)
    mesh = init_device_mesh("cpu", (world,))
    seq_t = seq // world
    for order in ("vocab", "rows", "auto"):
        for chunk_rows in (6, None):
            leaf, h_in, w = _split_inputs(h64, w64, dtype, mesh)
            loss, count = tiled_lm_loss(h_in, w, t, chunk_rows=chunk_rows, backward_order=order)
            loss.backward()
            what = f"{dtype_name} {order} {chunk_rows}"
            torch.testing.assert_close(loss.double(), ref_loss, rtol=LOSS_RTOL[dtype], atol=0,
                                       msg=lambda m, what=what: f"{what}: loss {m}")
            assert count.item() == (t != -100).sum().item()
            _close(leaf.grad, ref_h[:, rank * seq_t:(rank + 1) * seq_t], dtype, f"{what}: dhidden")
            _close(w.grad.full_tensor(), ref_w, dtype, f"{what}: dweight")
            assert w.grad.dtype == dtype and leaf.grad.dtype == dtype
        # only one input wants a gradient: the other is None, the one asked for still exact
        for want in ("hidden", "weight"):
            leaf, h_in, w = _split_inputs(h64, w64, dtype, mesh)
            (w if want == "hidden" else leaf).requires_grad_(False)
            if want == "weight":
                from torch.distributed.tensor import DTensor, Shard

                h_in = DTensor.from_local(leaf, mesh, [Shard(1)])
            loss, _ = tiled_lm_loss(h_in, w, t, chunk_rows=6, backward_order=order)
            loss.backward()
            if want == "hidden":
                assert w.grad is None
                _close(leaf.grad, ref_h[:, rank * seq_t:(rank + 1) * seq_t], dtype, f"{order} only dhidden")
            else:
                assert leaf.grad is None
                _close(w.grad.full_tensor(), ref_w, dtype, f"{order} only dweight")
    return "exact"


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float32"])
def test_tp_sequence_parallel_orders_match_float64(dist_pool, dtype_name: str) -> None:  # noqa: ANN001
    """Seen failing: the forward's saved log-sum-exp stored chunk by chunk as ``lse[:, sl] = lse_c.view(-1,
    tp).t()`` (the gathered chunk's rank-major order read as row-major) instead of ``lse_c.view(tp, -1)``: dhidden
    off by 0.542 of its scale (bf16, vocabulary order, tiles of 6); and dhidden not reduce-scattered (this rank's
    rows of the fp32 accumulator, its own vocabulary slice's share only): dhidden off by 0.83 / 0.981 of its scale
    on the two ranks."""
    assert dist_pool.run(2, _exact, dtype_name, timeout=300) == ["exact", "exact"]



def _low_precision_exact(rank: int, world: int) -> str:
    """bf16, both orders, tiles of 6 gathered rows, with the CUDA path's fp32-output matmuls played on CPU (as
    tests/test_tiled_loss_vocab_order.py plays them in one process): ``addmm_fp32_out`` replaced by its definition,
    its inputs checked to be bf16 tensors themselves. Restored before returning (the pool's process runs other
    tests after)."""
    from torch.distributed.device_mesh import init_device_mesh

    import seqpar.memory.tiling as tiling

    calls: list[str] = []

    def emulated(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        assert a.dtype == b.dtype == torch.bfloat16 and acc.dtype == torch.float32, (a.dtype, b.dtype, acc.dtype)
        assert acc.shape == (a.shape[0], b.shape[1]) and a.shape[1] == b.shape[0], (acc.shape, a.shape, b.shape)
        calls.append(order)
        acc.add_(a.float() @ b.float())

    saved = tiling.fp32_out_matmul_supported, tiling.addmm_fp32_out
    tiling.fp32_out_matmul_supported, tiling.addmm_fp32_out = (lambda device, dtype: True), emulated
    try:
        dtype = torch.bfloat16
        vocab, hidden, batch, seq = 517, 24, 2, 38
        h64, w64, t = _inputs(31, vocab, hidden, batch, seq, dtype)
        ref_loss, ref_h, ref_w = _reference(h64, w64, t)
        mesh = init_device_mesh("cpu", (world,))
        seq_t = seq // world
        for order in ("vocab", "rows"):
            leaf, h_in, w = _split_inputs(h64, w64, dtype, mesh)
            loss, _ = tiled_lm_loss(h_in, w, t, chunk_rows=6, backward_order=order)
            loss.backward()
            assert order in calls, f"{order}: the fp32-output matmul path was not taken"
            torch.testing.assert_close(loss.double(), ref_loss, rtol=LOSS_RTOL[dtype], atol=0)
            _close(leaf.grad, ref_h[:, rank * seq_t:(rank + 1) * seq_t], dtype, f"{order}: dhidden")
            _close(w.grad.full_tensor(), ref_w, dtype, f"{order}: dweight")
    finally:
        tiling.fp32_out_matmul_supported, tiling.addmm_fp32_out = saved
    return "exact"


def test_tp_sequence_parallel_low_precision_matmul_path_matches_float64(dist_pool) -> None:  # noqa: ANN001
    """The CUDA-only branch of both orders under TP sequence parallelism (one bf16 matmul writing fp32, torch's
    ``addmm(..., out_dtype=float32)``), played on CPU on 2 gloo ranks: loss, dhidden and dweight equal float64 on
    bf16-rounded inputs (audit 29's survivor T16: no test took this branch under TP-SP).

    Seen failing (both ranks): the row order's ``addmm_fp32_out(dweight, dlogits.t(), gathered)`` given
    ``gathered.t()`` (the shapes' assert), and the vocabulary order's ``dl`` left in fp32 on this path (its
    ``dl.to(hidden.dtype)`` dropped: the bf16 assert)."""
    assert dist_pool.run(2, _low_precision_exact, timeout=300) == ["exact", "exact"]

# (vocab, hidden, seq): per rank V / tp = 4096 head rows of 64, 64 gathered rows (32 a rank)
MEM_SHAPE = (8192, 64, 64)


def _saved_by_graph(out: torch.Tensor) -> list[torch.Tensor]:
    """The tensors the autograd graph behind ``out`` saved for its backward (a custom Function's
    ``saved_tensors``, a built-in node's ``_saved_*`` attributes): held by C++ only, so a tracker that counts only
    what it is given must be given them."""
    found, todo, seen = [], [out.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        found.extend(getattr(node, "saved_tensors", None) or ())
        for name in dir(node):
            if name.startswith("_saved_"):
                value = getattr(node, name)
                found.extend(v for v in (value if isinstance(value, (tuple, list)) else [value])
                             if isinstance(v, torch.Tensor))
        todo.extend(fn for fn, _ in node.next_functions)
    return found


def backward_peak(loss: torch.Tensor, *inputs: torch.Tensor) -> int:
    """Peak bytes of ``loss.backward()`` over what is alive when it starts, on CPU. Why not a
    whole-process baseline:

    The baseline is the loss's own state only (``inputs`` and what its graph saved), not every tensor the
    process holds (count_existing=False): a tensor alive at entry that something else frees inside the window
    (an earlier task's buffers that a gloo worker thread or the garbage collector releases late) lowered the
    measured peak by its bytes in a loaded CI run (fp32 1024 x 16 / 64, chunks of 16: 70,152 B where quiet
    and loaded runs here measure 71,176 with the same live set at the peak: one 1,024 B tensor short, and only
    a free of a storage counted at entry can lower a peak). Tensors alive at entry that the backward never
    touches are now never counted, so nothing they do moves the measurement (every figure here the same to the
    byte as the whole-process baseline's in quiet runs)."""
    from seqpar.memory.tracker import TensorMemoryTracker

    tracker = TensorMemoryTracker("cpu", count_existing=False)
    tracker.track(*inputs, _saved_by_graph(loss))
    with tracker:
        loss.backward()
    return tracker.peak - tracker.baseline


def _measured(rank: int, world: int, order: str, dtype_name: str, shape: tuple = MEM_SHAPE,
              chunk_rows: int | None = None) -> tuple[int, int, str]:
    """This rank's peak bytes of the loss's backward alone over what is alive when it starts, the modelled bytes of
    ``order`` (``"auto"``: the order the loss picks, which is returned too). ``shape``: ``(vocab, hidden, seq)`` over
    the ranks; ``chunk_rows``: the gathered chunk's rows (default the loss's own)."""
    from torch.distributed.device_mesh import init_device_mesh

    dtype = getattr(torch, dtype_name)
    vocab, hidden, seq = shape
    h64, w64, t = _inputs(5, vocab, hidden, 1, seq, dtype)
    mesh = init_device_mesh("cpu", (world,))
    leaf, h_in, w = _split_inputs(h64, w64, dtype, mesh)
    loss, _ = tiled_lm_loss(h_in, w, t, backward_order=order, chunk_rows=chunk_rows)
    # over the loss's own state only (a whole-process baseline moved in a loaded CI run): see backward_peak
    peak = backward_peak(loss, leaf, w)
    assert leaf.grad is not None and w.grad is not None
    rows, v_local, e = seq // world, vocab // world, torch.empty((), dtype=dtype).element_size()
    chunk = max(1, (chunk_rows or loss_chunk_rows(rows * world, hidden, v_local)) // world)
    picked = order if order != "auto" else loss_backward_order(rows, hidden, v_local, e, e, chunk, tp=world)
    model = loss_backward_bytes(picked, rows, hidden, v_local, e, e, chunk, tp=world)
    return peak, model, picked


def _all_measured(rank: int, world: int) -> dict:
    return {(order, dtype): _measured(rank, world, order, dtype)
            for dtype in ("bfloat16", "float32") for order in ("rows", "vocab", "auto")}


@pytest.fixture(scope="module")
def measured(dist_pool) -> list:  # noqa: ANN001
    return dist_pool.run(2, _all_measured, timeout=300)


def test_tp_sequence_parallel_bf16_backward_drops(measured: list) -> None:
    """bf16, V / tp = 4096 x 64 per rank, 32 rows a rank: the automatic order is the vocabulary order, and its peak is
    below ``V / tp * h * 3`` (the row order holds ``V / tp * h * 6`` at its end) and at most 40% of the row order's.

    Seen failing: the backward before tl29 (the row order always: ``loss_backward_order`` returning ``"rows"`` for
    ``tp > 1``): 1,576,968 B on each rank against the bound of 786,432 (the code before tl29 measures the same
    1,576,968 B); the vocabulary order measures 615,556 B (-61%)."""
    vocab, hidden, _ = MEM_SHAPE
    for got in measured:
        rows_peak, _, _ = got["rows", "bfloat16"]
        auto_peak, _, picked = got["auto", "bfloat16"]
        assert auto_peak < vocab // 2 * hidden * 3, (auto_peak, rows_peak, picked)
        assert auto_peak <= 0.4 * rows_peak, (auto_peak, rows_peak, picked)
        assert picked == "vocab"


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float32"])
@pytest.mark.parametrize("order", ["rows", "vocab", "auto"])
def test_tp_sequence_parallel_orders_are_modelled(measured: list, order: str, dtype_name: str) -> None:
    """``loss_backward_bytes(order, ..., tp=2)`` against each rank's measured backward: never under (the two scalars
    aside), within the band over. fp32 picks the row order.

    Seen failing: the gathered vocabulary order's model without the regathered rows (``tp rows h e``): vocab and
    auto bf16 under by 1.2% (608,384 B modelled, 615,556 measured), vocab fp32 under by 1.5%."""
    for got in measured:
        peak, model, picked = got[order, dtype_name]
        if order == "auto" and dtype_name == "float32":
            assert picked == "rows"
        assert model + SCALARS >= peak, (order, dtype_name, peak, model, f"{model / peak - 1:+.1%}")
        assert model <= peak * (1 + BAND), (order, dtype_name, peak, model, f"{model / peak - 1:+.1%}")


# (vocab, hidden, seq, gathered chunk rows or None for the loss's own): the row order where one gathered chunk's
# logits and the reduce-scatter's buffers are a large share of the peak (small heads, long chunks)
ROW_SHAPES = [(2048, 32, 96, None), (1024, 64, 64, None), (1024, 16, 64, 16), (2048, 32, 96, 32), (512, 64, 128, 64)]


def _rows_measured(rank: int, world: int) -> dict:
    return {(shape, dtype): _measured(rank, world, "rows", dtype, shape[:3], shape[3])
            for dtype in ("bfloat16", "float32") for shape in ROW_SHAPES}


@pytest.mark.timeout(300)
def test_tp_sequence_parallel_row_order_small_shapes_are_modelled(dist_pool) -> None:  # noqa: ANN001
    """The gathered row order's model (``loss_backward_bytes("rows", ..., tp=2)``) on small heads and long chunks, each
    rank: never under (the scalars aside), within 1% over. Recorded at the peak (est30): one gathered chunk's logits,
    turned into dlogits in place (the saved log-sum-exp spares the vocab-parallel reductions), beside dlogits @
    weight, gloo's copy of it in the reduce-scatter and this rank's rows out (fp32); in bf16 the fp32 dlogits beside
    their cast and the fp32 copies the head's gradient's addmm takes on CPU. Not the previous chunk's gloo copy of its
    reduce-scatter input, which gloo's worker thread frees late in about 1 run in 8 and the tracker's wait rule never
    counts: the model counted it until row33 (+4.4% on 512 x 64 / 128; the band was 1% plus that copy).

    Seen failing: the row order's model before (two chunks' fp32 logits, no reduce-scatter buffers): fp32 +5.4% on
    2048 x 32 / 96 and +7.1% on 1024 x 64 / 64 with the loss's chunks, +42.9% / +12.3% / +18.5% (bf16) with the long
    explicit chunks."""
    for got in dist_pool.run(2, _rows_measured, timeout=300):
        for (shape, dtype_name), (peak, model, _) in got.items():
            assert model + SCALARS >= peak, (shape, dtype_name, peak, model, f"{model / peak - 1:+.2%}")
            lse = shape[2] * 4  # the saved log-sum-exp: the model counts it, the measurement's baseline holds it
            assert model - lse <= peak * (1 + BAND), (shape, dtype_name, peak, model, f"{model / peak - 1:+.2%}")


# (vocab, hidden, seq): bf16 shapes where the automatic order under TP (``loss_backward_order(..., tp=2)``) is the
# row order while the one-process rule at this rank's rows and slice would pick the vocabulary order (mut30's G6)
AUTO_SHAPES = [(1024, 16, 256), (4096, 64, 1024)]
AUTO_BAND = 0.002
"""The automatic-order test's band over the measured peak (beside the lse): measured -0.013% / -0.001% on its two
shapes, the same on both ranks in 2 runs (tst34); gloo's late copy that row33 took out of the model is +0.41% on both
(+256 B / +4,096 B), which :data:`BAND`'s 1% let through."""


def _auto_measured(rank: int, world: int) -> dict:
    return {shape: _measured(rank, world, "auto", "bfloat16", shape) for shape in AUTO_SHAPES}


@pytest.mark.timeout(300)
def test_tp_sequence_parallel_auto_order_is_chosen_with_tp(dist_pool) -> None:  # noqa: ANN001
    """bf16, the automatic order on shapes where the TP rule and the one-process rule differ (1024 x 16 over 256
    tokens, 4096 x 64 over 1024: 128 / 512 rows a rank): the loss picks the row order, the smaller modelled peak at
    ``tp=2``, and each rank's measured peak is that order's model: never under (the scalars aside), within 1% over
    beside the saved log-sum-exp (``seq 4``; measured: 62,216 B against 63,232 modelled, 1,016 B over, on 1024 x 16)
    (before row33 the model counted gloo's late copy of a gathered chunk's rows, which the tracker never measures,
    and the band allowed it).

    Seen failing: the order chosen without ``tp=`` in ``_gathered_tiled_lm_loss`` (mut30's G6: the vocabulary
    order runs): 80,388 B measured on 1024 x 16 against the row order's 63,488 modelled, -21.0%. Seen failing
    (tst34, at :data:`AUTO_BAND`): gloo's late copy put back into the row order's model (``gc h (a + e)`` in
    ``_gathered_backward_bytes``' inner term): +0.41% on 1024 x 16 (it passed the 1% band)."""
    for shape in AUTO_SHAPES:
        vocab, hidden, seq = shape
        rows, v_local = seq // 2, vocab // 2
        chunk = max(1, loss_chunk_rows(seq, hidden, v_local) // 2)
        # the premise: the two rules differ here
        assert loss_backward_order(rows, hidden, v_local, 2, 2, chunk, tp=2) == "rows", shape
        assert loss_backward_order(rows, hidden, v_local, 2, 2, chunk) == "vocab", shape
    for got in dist_pool.run(2, _auto_measured, timeout=300):
        for shape, (peak, model, picked) in got.items():
            vocab, hidden, seq = shape
            chunk = max(1, loss_chunk_rows(seq, hidden, vocab // 2) // 2)
            lse = seq * 4  # every rank's rows' saved log-sum-exp: the model counts it, the measurement's baseline holds it
            assert picked == "rows", (shape, picked)
            assert model + SCALARS >= peak, (shape, peak, model, f"{model / peak - 1:+.2%}")
            assert model - lse <= peak * (1 + AUTO_BAND), (shape, peak, model, f"{model / peak - 1:+.2%}")
