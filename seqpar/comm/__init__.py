"""Communicators: the SP ring (point-to-point), collectives, and version shims."""
