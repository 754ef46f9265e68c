"""The test harness: pools of gloo ranks that run a test body on P processes (``ranks``) and counters
of the bytes and calls at torch's communication entry points (``traffic``), and a test communicator
that enforces NCCL's rules on gloo (``nccl_rules``); what a pool task calls to release the DeepSpeed
engines it made (``deepspeed_teardown``: the pool does not scrub DeepSpeed's state). Only tests and
``seqpar.bench`` import it; the library never does.
"""
