"""The tiled-loss memory tests' measurement (``backward_peak`` in tests/test_tiled_loss_tp_seq.py): a tensor alive
before the backward that something else frees during it does not move the measured peak. One process, the tiled
loss on plain tensors, the unrelated tensor freed by a hook on the loss as the backward starts (as an earlier
task's buffer released late by a gloo worker thread or the garbage collector, which lowered a loaded CI run's
TP-SP row-order measurement by 1,024 B: fp32 1024 x 16 / 64, 70,152 B against 71,176 in every other run).
"""

from __future__ import annotations

import torch
from test_tiled_loss_tp_seq import backward_peak
from tiled_loss_reference import inputs as _inputs

from seqpar.memory.tiling import tiled_lm_loss


def _peak(free_unrelated: bool) -> int:
    h64, w64, t = _inputs(5, 512, 16, 1, 64, torch.float32)
    hidden, weight = h64.float().requires_grad_(), w64.float().requires_grad_()
    loss, _ = tiled_lm_loss(hidden, weight, t, chunk_rows=16, backward_order="rows")
    unrelated = [torch.zeros(256)]  # 1,024 B, alive when the backward starts, no part of it
    if free_unrelated:
        loss.register_hook(lambda g: unrelated.clear())
    return backward_peak(loss, hidden, weight)


def test_a_tensor_freed_elsewhere_during_the_backward_does_not_move_the_peak() -> None:
    """The same backward measures the same peak whether or not an unrelated tensor alive at its start (1,024 B) is
    freed inside it.

    Seen failing: ``backward_peak`` with the whole-process baseline it had before mem32
    (``TensorMemoryTracker("cpu")``, every tensor alive at entry counted): 69,640 B when the tensor is freed against 70,664, 1,024 B less."""
    quiet = _peak(False)
    assert quiet > 0
    assert _peak(True) == quiet, (_peak(True), quiet)
