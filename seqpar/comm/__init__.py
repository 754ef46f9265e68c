"""Communicators: the SP ring (point-to-point), collectives, and version shims."""

from seqpar.comm.collectives import AllGather, ReduceScatter, all_gather, reduce_scatter

__all__ = ["AllGather", "ReduceScatter", "all_gather", "reduce_scatter"]
