"""ZeRO-3 on a hybrid (Jamba: a Mamba layer, then an attention layer) with a bucket that overflows at the attention
layer's o_proj gradient (est34; audit 18's survivor "the o_proj rule applied to a hybrid's layers").

configs/fsdp_hybrid.json's model with a 256-token vocabulary (hidden 32, I 64, 4 q / 2 kv heads), 64 tokens over
SP 2, untiled loss, fp32, DeepSpeed 0.19 ZeRO-3 on gloo CPU, ``reduce_bucket_size`` 14,401 (the head's 8,192, the
final norm's, the attention layer's MLP's 6,144 and its pre-MLP norm's fill 14,400 elements: o_proj's 1,024 overflow).
Recorded (``TensorMemoryTracker(record_peak=True)``; /work/tmp/est34/record_jamba.py, ``torchrun --nproc_per_node 2
record_jamba.py 14401 64``): 1,390,109 B on rank 0 (rank 1: 1,388,053). The estimate (``backward_reduction``) is
1,392,460 B, +0.17%; with est32's o_proj rule applied to the hybrid's layer (the post-attention norm's release, o_proj's
gradients; M5) 1,388,236 B, -0.13%: under. Caveat: the recorded peak holds the 57,604-B bucket but no flat
reduce-scatter input, so the measured peak is not that reduction; the hybrid's moment is not located, and this test
only holds the estimate at or above the measured peak (the whole-step tests' rule), which M5 breaks.
"""

from __future__ import annotations

import json
from pathlib import Path

import seqpar.memory.training as training
from seqpar.memory.training import estimate_training_memory

ROOT = Path(__file__).resolve().parents[1]
MEASURED = 1_390_109


def test_the_hybrid_estimate_is_not_under_its_recorded_peak() -> None:
    """0 .. +0.5% of the recorded peak, and the overflow not traced as o_proj's on a hybrid.

    Seen failing: M5 (``traced = j == 0``, the o_proj rule on the hybrid's attention layer): -0.13% (1,388,236 B)."""
    model = dict(json.loads((ROOT / "configs" / "fsdp_hybrid.json").read_text())["model"], vocab_size=256)
    overflow = training._zero3_first_overflow(training._model_shape(model), 14_401)
    assert overflow.after_mlp and overflow.done == 0, overflow
    est = estimate_training_memory(model, seq_len=64, sp_size=2, engine="deepspeed", zero_stage=3,
                                   reduce_bucket_size=14_401)
    assert est["moment"] == "backward_reduction", est
    assert 0 <= est["peak"] / MEASURED - 1 <= 0.005, (est["peak"], f"{est['peak'] / MEASURED - 1:+.3%}")
