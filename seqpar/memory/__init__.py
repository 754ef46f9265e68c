"""Memory beyond attention, and the model of it.

- ``tiling``: the LM head + loss and the MLP over chunks of the local sequence.
- ``norm``: RMSNorm that saves only its input and recomputes in backward.
- ``offload``: checkpointed layers' inputs kept on the host.
- ``attention``: per-rank bytes of one attention call (:func:`estimate_attention_memory`).
- ``training``: per-rank bytes of a whole training step (:func:`estimate_training_memory`).
- ``tracker``: exact tensor accounting (on CPU too), the ground truth the estimators are checked against.
"""
