"""The tiled loss's backward-order memory model against measurement on small shapes and explicit chunks (row33), and
the automatic order picking the order that measures less there.

- Each order's model (``loss_backward_bytes``) against the bf16 / fp32 backward's peak (``backward_peak``: the loss's
  backward alone over its own state), one process (TP 1) and the TP-sequence gathered path on 2 gloo ranks: never
  under (the scalars aside), and over by at most 1% plus the saved log-sum-exp (``rows a``), which the model counts
  (it is alive from the forward on) and the measurement's baseline holds. Recorded at the peak (row33): the
  vocabulary order's one-hot scatter buffers were counted beside its casts, never alive with them (bf16 +3.2% / +4.0%
  at TP 1 / 2 on 512 x 16 / 64), its TP end left out gloo's copy of the reduce-scatter's input (-9.1% under on
  1024 x 64 / 256, gathered chunks of 2), the one-process row order counted two chunks of logits (+13.2% on 512 x 16 /
  256) and the TP row order gloo's late copy the tracker never measures (+15% on 256 x 128 / 1024).
- The automatic order (``loss_backward_order``) on shapes where the models before row33 picked another order: the
  pick measures within 1% of the smaller of the two orders' peaks (before: up to +14%).
"""

from __future__ import annotations

import pytest
import torch
from test_tiled_loss_tp_seq import _split_inputs, backward_peak
from tiled_loss_reference import inputs as _inputs

from seqpar.memory.tiling import (
    loss_backward_bytes,
    loss_backward_order,
    loss_chunk_rows,
    tiled_lm_loss,
)

SCALARS = 16  # the incoming loss gradient and a chunk's loss sum, which the model leaves out
BAND = 0.01

# (vocab, hidden, seq, chunk rows or None for the loss's own; under TP the gathered chunk's rows)
TP1_SHAPES = [(512, 16, 64, None), (512, 16, 64, 1), (1024, 64, 256, 16), (512, 16, 256, None)]
TP2_SHAPES = [(512, 16, 64, None), (1024, 64, 256, 2), (2048, 32, 96, 8), (4096, 16, 128, 2)]
# bf16, TP 2, both orders measured: where the models before row33 or its step 1 alone picked the order measuring more
TP2_PICK_SHAPES = [(256, 16, 256, 64), (256, 128, 1024, None), (1024, 64, 256, 2), (256, 16, 512, 128),
                   (256, 8, 64, 8), (1024, 32, 1024, 128)]
TP1_PICK_SHAPES = [(256, 16, 128, 4), (512, 16, 256, None)]


def _one(order: str, dtype_name: str, shape: tuple, rank: int = 0, world: int = 1) -> tuple[int, int, int]:
    """``(measured peak, modelled bytes, the saved log-sum-exp's bytes)`` of this rank's backward in ``order``."""
    dtype = getattr(torch, dtype_name)
    vocab, hidden, seq, chunk_rows = shape
    h64, w64, t = _inputs(5, vocab, hidden, 1, seq, dtype)
    if world == 1:
        leaf, w = h64.to(dtype).requires_grad_(), w64.to(dtype).requires_grad_()
        h_in = leaf
    else:
        from torch.distributed.device_mesh import init_device_mesh

        leaf, h_in, w = _split_inputs(h64, w64, dtype, init_device_mesh("cpu", (world,)))
    loss, _ = tiled_lm_loss(h_in, w, t, backward_order=order, chunk_rows=chunk_rows)
    peak = backward_peak(loss, leaf, w)
    assert leaf.grad is not None and w.grad is not None
    rows, v_local, e = seq // world, vocab // world, torch.empty((), dtype=dtype).element_size()
    chunk = max(1, (chunk_rows or loss_chunk_rows(seq, hidden, v_local)) // world)
    kw = {"tp": world} if world > 1 else {}
    return peak, loss_backward_bytes(order, rows, hidden, v_local, e, e, chunk, **kw), seq * max(e, 4)


def _check(got: dict) -> None:
    for key, (peak, model, lse) in got.items():
        assert model + SCALARS >= peak, (key, peak, model, f"{model / peak - 1:+.2%}")
        assert model - lse <= peak * (1 + BAND), (key, peak, model, f"{model / peak - 1:+.2%}")


def test_one_process_orders_are_modelled() -> None:
    """TP 1, both orders, bf16 and fp32. Seen failing: the models before row33: bf16 vocab +3.20% on 512 x 16 / 64
    (32,896 modelled, 31,876 measured), rows +13.16% on 512 x 16 / 256 (74,752 against 66,056)."""
    _check({(order, dt, shape): _one(order, dt, shape) for dt in ("bfloat16", "float32") for order in ("vocab", "rows")
            for shape in TP1_SHAPES})


def _tp2_measured(rank: int, world: int, shapes: list, dtypes: tuple) -> dict:
    return {(order, dt, shape): _one(order, dt, shape, rank, world) for dt in dtypes for order in ("vocab", "rows")
            for shape in shapes}


@pytest.mark.timeout(600)
def test_tp_sequence_parallel_orders_are_modelled(dist_pool) -> None:  # noqa: ANN001
    """TP 2 (the gathered path), both orders, bf16 and fp32, each rank. Seen failing: the models before row33: the
    vocabulary order -9.12% under on bf16 1024 x 64 / 256 with gathered chunks of 2 (208,464 modelled, 229,380
    measured; fp32 -2.93%), +3.96% over on bf16 512 x 16 / 64."""
    for got in dist_pool.run(2, _tp2_measured, TP2_SHAPES, ("bfloat16", "float32"), timeout=600):
        _check(got)


def _pick_check(got: dict, shapes: list, world: int) -> None:
    for shape in shapes:
        vocab, hidden, seq, chunk_rows = shape
        rows, v_local = seq // world, vocab // world
        chunk = max(1, (chunk_rows or loss_chunk_rows(seq, hidden, v_local)) // world)
        kw = {"tp": world} if world > 1 else {}
        picked = loss_backward_order(rows, hidden, v_local, 2, 2, chunk, **kw)
        peaks = {order: got[order, "bfloat16", shape][0] for order in ("rows", "vocab")}
        assert peaks[picked] <= min(peaks.values()) * (1 + BAND), (shape, picked, peaks,
                                                                    f"{peaks[picked] / min(peaks.values()) - 1:+.2%}")


@pytest.mark.timeout(600)
def test_tp_sequence_parallel_auto_order_measures_less(dist_pool) -> None:  # noqa: ANN001
    """bf16, TP 2: the automatic order's measured peak is within 1% of the smaller order's. Seen failing: the models
    before row33 (the vocabulary order on 256 x 128 / 1024, +14.0% over the row order's 1,769,480 B; on 1024 x 64 /
    256, chunks of 2, +7.7%), and row33's vocabulary model with the row order's late gloo copy kept (the vocabulary
    order on 256 x 128 / 1024, +14.0%, as before; on 256 x 16 / 512 with chunks of 128, +2.4%, measured)."""
    for got in dist_pool.run(2, _tp2_measured, TP2_PICK_SHAPES, ("bfloat16",), timeout=600):
        _pick_check(got, TP2_PICK_SHAPES, 2)


def test_one_process_auto_order_measures_less() -> None:
    """bf16, TP 1: as above. Seen failing: the models before row33 (the row order on 256 x 16 / 128, chunks of 4,
    +1.1%), and the vocabulary model tightened without the row model (the vocabulary order on 512 x 16 / 256, +9.3%)."""
    got = {(order, "bfloat16", shape): _one(order, "bfloat16", shape) for order in ("vocab", "rows")
           for shape in TP1_PICK_SHAPES}
    _pick_check(got, TP1_PICK_SHAPES, 1)
