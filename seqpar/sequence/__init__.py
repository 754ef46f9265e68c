"""The sequence itself: how it is cut across the SP group and put back (``sharding``), how a
training batch is cut with its positions, labels and document boundaries (``batch``), and the
token-weighted loss over the shards with exact gradients (``loss``); packed-document boundaries
as host ints, copied once per batch (``boundaries``). Layouts: sequence tensors are
``(batch, seq, ...)`` with the sequence on the dimension the caller names.
"""
