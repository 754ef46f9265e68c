"""The TP-SP tiled loss's automatic backward order is chosen from the largest vocabulary slice on every rank (audit 30).

``_GatheredTiledLMLoss``'s two orders run different collectives in the backward (the vocabulary order one all-gather
of every rank's rows and one reduce-scatter; the row order one all-gather and one reduce-scatter per chunk), so every
TP rank must pick the same one. ``tiled_lm_loss`` picks it from shapes and element sizes only, with the largest
vocabulary slice (``tile_vocab``) on every rank. With an uneven split (517 = 259 + 258) and 31 rows a rank (1 x 62
tokens, TP 2), bf16, hidden 24 and the automatic tile (3 rows a rank), the order rule gives "vocab" for 259 and
"rows" for 258: a rank that used its own slice would run the other order than its peer.
"""

from __future__ import annotations

import torch
from tiled_loss_reference import LOSS_RTOL
from tiled_loss_reference import close as _close
from tiled_loss_reference import inputs as _inputs
from tiled_loss_reference import reference as _reference

from seqpar.memory.tiling import loss_backward_order, loss_chunk_rows, tiled_lm_loss

# (row33: 2 x 30 tokens before; the tightened models give "vocab" for both slices there)
VOCAB, HIDDEN, BATCH, SEQ = 517, 24, 1, 62


def _auto_order_exact(rank: int, world: int) -> str:
    """bf16, ``backward_order="auto"`` and the automatic tile: loss, dhidden and dweight against float64."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    dtype = torch.bfloat16
    h64, w64, t = _inputs(41, VOCAB, HIDDEN, BATCH, SEQ, dtype)
    ref_loss, ref_h, ref_w = _reference(h64, w64, t)
    mesh = init_device_mesh("cpu", (world,))
    seq_t = SEQ // world
    leaf = h64[:, rank * seq_t:(rank + 1) * seq_t].to(dtype).requires_grad_()
    w = distribute_tensor(w64.to(dtype), mesh, [Shard(0)]).requires_grad_()
    loss, _ = tiled_lm_loss(DTensor.from_local(leaf, mesh, [Shard(1)]), w, t)
    loss.backward()
    torch.testing.assert_close(loss.double(), ref_loss, rtol=LOSS_RTOL[dtype], atol=0)
    _close(leaf.grad, ref_h[:, rank * seq_t:(rank + 1) * seq_t], dtype, f"rank {rank}: dhidden")
    _close(w.grad.full_tensor(), ref_w, dtype, f"rank {rank}: dweight")
    return "exact"


def test_the_shape_splits_the_order_rule_between_the_two_slices() -> None:
    """The premise of the test below: at this shape the rule's answer differs between the two slices' sizes."""
    rows = BATCH * SEQ // 2
    chunk = max(1, loss_chunk_rows(rows * 2, HIDDEN, 259) // 2)
    assert loss_backward_order(rows, HIDDEN, 259, 2, 2, chunk, tp=2) == "vocab"
    assert loss_backward_order(rows, HIDDEN, 258, 2, 2, chunk, tp=2) == "rows"


def test_auto_order_is_the_same_on_ranks_with_uneven_vocabulary_slices(dist_pool) -> None:  # noqa: ANN001
    """2 gloo ranks, TP sequence parallelism, an uneven vocabulary split where the rule gives each slice's size a
    different order: ``backward_order="auto"`` runs one order on both ranks, loss and gradients equal float64.

    Seen failing (audit 30's G7): ``_gathered_tiled_lm_loss`` choosing the order from this rank's slice
    (``weight.shape[0]``) instead of ``tile_vocab``: the ranks ran different orders' collectives and gloo aborted a
    rank ("Received data size doesn't match expected size", 720 vs 72 bytes)."""
    assert dist_pool.run(2, _auto_order_exact, timeout=240) == ["exact", "exact"]
