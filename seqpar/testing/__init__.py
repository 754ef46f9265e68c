"""The test harness: pools of gloo ranks that run a test body on P processes (``ranks``) and counters
of the bytes and calls at torch's communication entry points (``traffic``). Only tests and
``seqpar.bench`` import it; the library never does.
"""
