"""check_inputs' row of a call (seqpar.attn.checks.describe_call): the softmax scale enters as its float64 bit
pattern, so ranks whose scales differ in any bit disagree (and the call is refused on every rank, see
tests/test_attention_errors.py), and the default scale is ``head_dim ** -0.5`` exactly. One process."""

from __future__ import annotations

import math

import torch

from seqpar.attn.checks import describe_call


def test_the_scale_is_compared_on_all_its_float64_bits() -> None:
    """Two scales one float64 ulp apart (below float32's precision: both round to the same float32) give
    different rows; ``scale=None`` gives the row of ``head_dim ** -0.5``, and the row is the same for equal
    scales (the comparison is not vacuous).

    Seen failing: the scale packed through float32 (``struct.pack("<d", float(scale))`` on the float32-rounded
    scale in _scale_bits: the 1-ulp difference, a silently different softmax on one rank, went unseen)."""
    q = k = v = torch.zeros(1, 2, 4, 8)

    def row(scale: float | None) -> list[int]:
        return describe_call(q, k, v, causal=True, mode="ring", sharding="zigzag", scale=scale)

    a = 0.3
    b = math.nextafter(a, 1.0)
    assert torch.tensor(a, dtype=torch.float32) == torch.tensor(b, dtype=torch.float32)  # float32 can't tell
    assert row(a) != row(b) and row(a) == row(0.3)
    assert row(None) == row(8 ** -0.5) != row(math.nextafter(8 ** -0.5, 0.0))
