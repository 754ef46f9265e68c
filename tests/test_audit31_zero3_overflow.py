"""Audit 31 (session 30's ZeRO-3 model): where the gradient bucket first overflows during the backward.

``seqpar.memory.training``'s rule for it (reached through the module, as tests/test_training_memory.py reaches its
estimators) follows DeepSpeed stage3's ``bucket.elements + param.ds_numel > self.reduce_bucket_size and
bucket.elements > 0``: a gradient that brings the bucket exactly to its size still fits. The measured settings
(tests/test_training_memory.py: buckets of 1e6 and 2.1e6 elements) are far from such a boundary; here the bucket
sizes sit on them, for a hand-counted model.

The model: vocabulary 100, hidden 8, intermediate 16, 2 heads of 4, 1 K/V head, 2 layers, untied. Gradients in
backward order: the head's 800 and the final norm's 8 (808); then each layer's MLP: down, up, gate 128 each and the
post-attention norm 8 (392: 1200 in all after the first); then its attention: o 64, q 64, k 32, v 32, the input norm 8
(200: 1400 in all after the first layer).
"""

from __future__ import annotations

import pytest

import seqpar.memory.training as training
from seqpar.memory.training import ModelShape

MODEL = ModelShape(vocab_size=100, hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=1)
TIED = ModelShape(vocab_size=100, hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, tie_word_embeddings=True)


@pytest.mark.parametrize(("model", "bucket", "want"), [
    (MODEL, 1191, (0, False)),  # the MLP's norm overflows (1192 + 8 > 1191)
    (MODEL, 1192, (0, False)),  # 1200 > 1192: the norm still overflows
    (MODEL, 1199, (0, False)),
    (MODEL, 1200, (0, True)),  # the norm brings it to exactly 1200: fits; o_proj's 64 overflows
    (MODEL, 1399, (0, True)),  # the input norm (1392 + 8 > 1399)
    (MODEL, 1400, (1, False)),  # the first layer fits exactly; the second layer's down_proj overflows
    (MODEL, 799, (0, False)),  # the head's gradient alone is larger than the bucket
    (MODEL, 10**6, None),  # everything fits: the one reduction is the end of backward's
    (TIED, 400, (0, True)),  # tied: no head gradient; 8 + 392 = 400 fits exactly, o_proj overflows
    (TIED, 399, (0, False)),
])
def test_first_overflow_at_the_bucket_boundaries(model: ModelShape, bucket: int, want: tuple | None) -> None:
    """``(layers whose backward has finished, whether the layer in flight finished its MLP's)`` at each boundary.

    Seen failing (audit 31): Z1 (``>=``: a gradient that fills the bucket exactly overflows it) at 1200 ((0, False))
    and 1400 ((0, True)); Z8 (the MLP's norm left out of its gradients) at 1192 ((0, True)); Z9 (a head gradient
    larger than the bucket taken for "never overflows") at 799 (None)."""
    got = training._zero3_first_overflow(model, bucket)
    # its first two fields; est31c's later ones (what is alive beside the reduction) are judged against measurements
    # in tests/test_training_memory.py
    assert (None if got is None else (got.done, got.after_mlp)) == want
