"""Audit 33: est32's second route to ZeRO-3 keeping every gathered copy for the backward
(``training._zero3_gathered``): past the reuse distance, every copy is kept when the fetches before the first layer's
MLP is released (``ZERO3_FETCHES_BEFORE_RELEASE`` of them, each prefetching ``stage3_prefetch_bucket_size``
elements) can gather every non-persistent parameter, the root's among them (the embedding is the first fetch and the
untied head is in the trace the prefetcher drains). The two measured cases (tests/test_est32_zero3_overflow.py) sit
far from that edge (1.6e6 and 3.4e6 non-persistent elements against 13 x 5e7 and 13 x 1e6), so a rule that left
the root out or counted a fetch fewer moved no measured estimate. Counted here at the edge, by hand, as
tests/test_audit32_zero3_gathered_rules.py counts DeepSpeed's other edges.
"""

from __future__ import annotations

from seqpar.memory import training
from seqpar.memory.training import ModelShape

H, INTER, L = 64, 2048, 4  # each MLP weight 131,072 elements: over the default 1e5 persistence threshold


def test_the_drain_counts_the_roots_tensors_and_every_fetch() -> None:
    """4 layers' MLP weights (1,572,864 non-persistent elements; q, k, v, o and the norms persistent) and a
    non-persistent embedding and untied head (2 x 262,144): 2,097,152 elements in all, at a reuse distance of 0.
    At a prefetch of 161,320 elements 13 fetches hold 2,097,160, so every layer's copies are kept; at 161,319 they
    hold 2,097,147, short of the model, so only a layer and its prefetch are (2 x 393,216), although the layers alone
    (1,572,864) would fit either way.

    Seen failing (audit 33): with the root left out of the drain's comparison (``non_persistent <= 13 x prefetch``,
    M3): every copy kept at 161,319; with one fetch fewer (``ZERO3_FETCHES_BEFORE_RELEASE = 12``, M1): only a layer
    and its prefetch at 161,320."""
    m = ModelShape(vocab_size=4096, hidden_size=H, intermediate_size=INTER, num_hidden_layers=L, num_attention_heads=2,
                   num_key_value_heads=2)
    layers, root = L * 3 * H * INTER, 2 * 4096 * H
    assert 13 * 161_319 < layers + root <= 13 * 161_320 and layers <= 12 * 161_320
    kept = training._zero3_gathered(m, reuse=0, prefetch=161_320)
    assert kept[1:4:2] == (layers, (3 * H * INTER,) * L), kept
    short = training._zero3_gathered(m, reuse=0, prefetch=161_319)
    assert short[1:4:2] == (2 * 3 * H * INTER, ()), short
