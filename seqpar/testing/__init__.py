"""The test harness: pools of gloo ranks that run a test body on P processes (``ranks``) and counters
of the bytes and calls at torch's communication entry points (``traffic``), and a test communicator
that enforces NCCL's rules on gloo (``nccl_rules``). Only tests and
``seqpar.bench`` import it; the library never does.
"""
