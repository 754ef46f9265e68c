"""The emulated links report the bytes their inner communicator sent (audit 36's EM1: ``_OnLinks.bytes_sent``
returning 0 got through, since only the benchmarks read it).

Counted against theory, not the code: the ring forward sends each rank's K and V once per hop, P - 1 hops; the
backward sends K / V again P - 1 hops and the dK / dV accumulators P - 1 hops in fp32 (the default wire), which is
twice a bf16 K / V's bytes: 3 (P - 1) K / V units in bf16. A segment exchange sends the bytes of what it is given.
"""

from __future__ import annotations

import pytest
import torch

from seqpar.attn.common import AttentionOptions
from seqpar.attn.ring import ring_backward, ring_forward
from seqpar.comm.emulated import EmulatedLinks, EmulatedRing, EmulatedSegment
from seqpar.comm.loopback import LoopbackComm, LoopbackSegmentComm


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("causal", [False, True])
def test_emulated_ring_reports_the_rings_bytes(world: int, causal: bool) -> None:
    g = torch.Generator().manual_seed(11 + world)
    q, k, v, dout = (torch.randn(1, 2, 8, 8, generator=g).bfloat16() for _ in range(4))
    opts = AttentionOptions(causal=causal, scale=0.3, sharding="zigzag" if causal else "contiguous")
    comm = EmulatedRing(LoopbackComm(1, world, transfer=False), EmulatedLinks(None))
    kv = k.numel() * 2 + v.numel() * 2  # bf16 K and V of one rank
    out, lse = ring_forward(q, k, v, comm, opts)
    assert comm.bytes_sent == (world - 1) * kv
    ring_backward(dout, q, k, v, out.to(q.dtype), lse, comm, opts)
    assert comm.bytes_sent == (world - 1) * kv + (world - 1) * (kv + 2 * kv)  # K / V again, fp32 dK / dV


def test_emulated_segment_reports_the_segments_bytes() -> None:
    comm = EmulatedSegment(LoopbackSegmentComm(1, 4), EmulatedLinks(None))
    a, b = torch.randn(3, 5), torch.randn(7, dtype=torch.float64)
    comm.exchange([(0, a), (2, b)], [(0, torch.empty(3, 5))]).wait()
    assert comm.bytes_sent == 3 * 5 * 4 + 7 * 8
