"""Adapters between seqpar and the engines users already run (installed as ``seqpar.integrations``).

One module per engine: ``deepspeed`` (its AutoTP steps in ``deepspeed_tp``), ``fsdp``, ``fairscale``, ``apex``,
``trainer`` (the Hugging Face Trainer and any subclass of it) and ``accelerate``; ``trl`` says what TRL's trainers need on top of
``trainer``; helpers they share in ``common``. The Hugging Face transformers glue is not
an engine: it lives with the swap (``seqpar.swap.hf``). The core (``seqpar/``) never imports this package
(tests/test_layering.py).
"""
