"""The verified-batch scope of :mod:`seqpar.runtime.verified`: a swapped model's forward, whose inputs the SP ranks
agreed on once, lets its layers skip their per-call cross-rank check; the scope must end with that forward, or
every later call (a direct ``seqpar.attention`` on inputs nobody checked) would skip it too, and ranks that disagree
would pair up wrongly or hang instead of raising."""

from __future__ import annotations

import torch

from seqpar.runtime import verified


def test_the_scope_ends_with_its_forward_and_nests() -> None:
    """Outside a backward: verified only between ``enter_verified`` and the matching ``exit_verified`` (nested
    scopes count), never after; inside a backward: the last forward's verdict, dropped by ``mark_unverified``.

    Seen failing: ``exit_verified`` not decrementing the depth (``max(_depth(), 0)``): every call after the first
    verified forward was taken for a verified one."""
    assert not verified.batch_verified()
    verified.enter_verified()
    verified.enter_verified()  # a verified forward inside another (a wrapped model)
    verified.exit_verified()
    assert verified.batch_verified()
    verified.exit_verified()
    assert not verified.batch_verified()
    verified.exit_verified()  # one exit too many (an exception path) does not go below zero
    verified.enter_verified()
    assert verified.batch_verified()
    verified.exit_verified()

    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            seen.append(verified.batch_verified())
            return g

    x = torch.ones(2, requires_grad=True)
    Probe.apply(x).sum().backward()  # the last forward was verified: its recompute may borrow the verdict
    verified.mark_unverified()
    Probe.apply(x).sum().backward()  # a forward that started without a verdict: no borrowing
    assert seen == [True, False]
    assert not verified.batch_verified()
