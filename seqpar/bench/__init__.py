"""Benchmarks: ``python -m seqpar.bench <suite>`` (or ``seqpar-bench``); results and how to read
them are in BENCHMARKS.md.

Suites, one module each: ``attention`` (fwd+bwd time and peak memory per rank of ring, all-gather,
dilated against single-process SDPA, over S and P; a one-GPU simulation of one ring rank),
``peers`` (DeepSpeed Ulysses, PyTorch context_parallel, ring-flash-attn on the same shapes),
``memory`` (peak bytes per rank against S, the estimator beside it, the largest S a budget fits),
``train`` (tokens/s and memory of launch/train.py at SP = 1, 2, 4), ``comm`` (bytes per rank per
layer against the theory). Shared machinery: ``runner`` (rank pools, timing, memory) and ``report``
(tables, JSON, plots).
"""
