"""Each fused SDPA kernel's compute-capability range (``seqpar.kernels.backends``, session 31's ``_sm_rejection``)
at both of its ends: flash and cuDNN sm80-sm121, the memory-efficient kernel sm50-sm121 (torch's sdp_utils ranges,
as the module states them). tests/test_cuda_fake.py's devices (K80 .. H100) meet the lower ends only. A kernel
taken past its range fails on the device; one refused inside it falls back to a slower kernel. Fake devices only:
no GPU is needed.
"""

from __future__ import annotations

import pytest
import torch

from seqpar.kernels.backends import Backend, BlockSpec, DeviceCaps, SdpFlags, rejection

_RANGES = {Backend.FLASH: ((8, 0), (12, 1)), Backend.EFFICIENT: ((5, 0), (12, 1)), Backend.CUDNN: ((8, 0), (12, 1))}


@pytest.mark.parametrize("backend", list(_RANGES), ids=lambda b: b.value)
def test_each_kernel_runs_at_both_ends_of_its_range_and_not_past_them(backend: Backend) -> None:
    """At the range's lowest and highest capability no capability reason is given (a bf16 block of head dim 64
    that every kernel takes); one minor version past the top, and one major below the bottom, the reason names
    the range and the device.

    Seen failing (audit 32): the memory-efficient kernel's range ending at sm120 (K2: sm121 refused, "needs
    sm50-sm120")."""
    low, high = _RANGES[backend]
    spec = BlockSpec(torch.bfloat16, 64, 64, 4, 4, 128, 128, True)
    name = f"needs sm{low[0]}{low[1]}-sm{high[0]}{high[1]}"
    for cap in (low, high):
        why = rejection(backend, spec, DeviceCaps(cap, cudnn_version=91600, cuda_major=13), SdpFlags())
        assert why is None or "needs sm" not in why, (cap, why)
    for cap in ((high[0], high[1] + 1), (low[0] - 1, low[1])):
        why = rejection(backend, spec, DeviceCaps(cap, cudnn_version=91600, cuda_major=13), SdpFlags())
        assert why == f"{name}, the device is sm{cap[0]}{cap[1]}", (cap, why)
