"""The step estimate's ``logits_loss`` term under TP sequence parallelism with the tiled loss is the tiled loss's own
backward model at the shape that loss runs on each rank (audit 30): this rank's ``seq_local / tp`` rows, the
largest vocabulary slice ``V / tp``, the gathered chunk's per-rank share ``loss_chunk_rows(seq_local, h, V / tp) //
tp`` (as ``seqpar.memory.tiling``'s ``_gathered_tiled_lm_loss`` cuts it) and ``tp``, in the order the loss picks
there. That model is measured against the loss's backward in both orders by tests/test_tiled_loss_tp_seq.py; here
the step estimate is held to it."""

from __future__ import annotations

import pytest

from seqpar.memory.tiling import loss_backward_bytes, loss_backward_order, loss_chunk_rows
from seqpar.memory.training import estimate_training_memory


def _llama(vocab: int, hidden: int) -> dict:
    return {"vocab_size": vocab, "hidden_size": hidden, "intermediate_size": 2 * hidden, "num_hidden_layers": 2,
            "num_attention_heads": 8, "num_key_value_heads": 4}


# bf16 picks the vocabulary order, fp32 the row order; at 4096 x 64, TP 2, 1024 tokens the order with ``tp=`` is
# "rows" and the single-process rule's (``tp`` left out) "vocab"
CASES = [(32000, 256, tp, seq, dtype, e) for tp, seq in ((2, 4096), (4, 2048), (2, 256))
         for dtype, e in (("bf16", 2), ("fp32", 4))] + [(4096, 64, 2, 1024, "bf16", 2)]


@pytest.mark.parametrize("vocab,hidden,tp,seq_len,dtype,e", CASES)
def test_tp_seq_tiled_loss_term_is_the_losss_own_model(vocab: int, hidden: int, tp: int, seq_len: int, dtype: str,
                                                         e: int) -> None:
    """Seen failing (audit 30): the term with the whole chunk as this rank's (``chunk_rows`` not divided by tp,
    K1), the order picked without ``tp=`` (K2: 4096 x 64 only), every rank's rows as this rank's (K3) and
    without ``tp=`` in the bytes (the single-process model, K4)."""
    est = estimate_training_memory(_llama(vocab, hidden), seq_len=seq_len, sp_size=1, tp_size=tp,
                                   tp_sequence_parallel=True, tiled_loss=True, dtype=dtype, engine="fsdp2")
    h, v = hidden, vocab // tp
    rows = seq_len // tp
    chunk = max(1, loss_chunk_rows(seq_len, h, v) // tp)
    order = loss_backward_order(rows, h, v, e, e, chunk, tp=tp)
    assert est["logits_loss"] == loss_backward_bytes(order, rows, h, v, e, e, chunk, tp=tp), (order, est)
