"""Adapters between seqpar and the engines users already run (installed as ``seqpar.integrations``).

One module per engine: ``deepspeed``, ``fsdp``, ``fairscale``, ``transformers``, ``apex``, ``trainer`` (HF Trainer), ``accelerate``.
"""
