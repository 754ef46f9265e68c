"""Audit 36 (session 37), ZeRO-3's overflow at v_proj's gradient (est34's ``at_v_proj``) at the bucket's exact edge.
DeepSpeed's stage3 reduces the bucket when the arriving gradient would take it *past* ``reduce_bucket_size``
elements (``elements_in_ipg_bucket + numel > reduce_bucket_size``; audit 31 pinned the same ``>`` for the MLP's
gradients). In the whole-step table's model, 2,101,376 elements are in the bucket when v_proj's 2,048-element gradient
arrives: with a bucket of exactly 2,103,424 it fits (the bucket full), and the overflow comes at k_proj's, where
nothing in flight was recorded (not traced); one element less and v's overflows it.

Seen failing: the v rule as ``>=`` (audit 36's E2) -> v_proj's overflow traced at 2,103,424."""

from __future__ import annotations

from test_est32_zero3_overflow import MODEL

import seqpar.memory.training as training

IN_BUCKET, V_GRAD = 2_101_376, 32 * 64  # what est34 recorded; v_proj's weight: kv heads' width x hidden


def test_v_proj_fills_the_bucket_exactly_without_overflowing_it() -> None:
    m = training._model_shape(MODEL)
    edge = IN_BUCKET + V_GRAD
    fits = training._zero3_first_overflow(m, edge)
    assert fits.after_mlp and not fits.at_v_proj and not fits.at_o_proj and fits.contents == IN_BUCKET, fits
    over = training._zero3_first_overflow(m, edge - 1)
    assert over.at_v_proj and over.arriving == V_GRAD and over.contents == IN_BUCKET, over
