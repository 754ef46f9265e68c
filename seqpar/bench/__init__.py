"""Benchmarks: python -m seqpar.bench <suite> (see BENCHMARKS.md)."""
