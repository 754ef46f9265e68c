"""The halo exchange's custom op under dynamic shapes (fuzzer case 192080593, the ``compile`` kind).

A tiny Zamba2 compiled on rows of changing lengths crashed at its second length ("unhashable type: non-nested
SymInt" in ``seqpar::halo_fwd``'s fake function): dynamo's automatic dynamic shapes made the sequence length a
SymInt, and the fake built the whole ``halo_plan`` (an ``lru_cache``) just for its chunk count. The fake now takes
the count from the sharding alone (contiguous 1, zigzag 2 chunks per rank). Seen failing with the old fake: this
test's compiled call raised the TypeError (TorchRuntimeError) at the first length.
"""

from __future__ import annotations

import pytest
import torch

from seqpar.mixers.halo import halo_fwd


@pytest.mark.compile_stage
@pytest.mark.parametrize("sharding", ["contiguous", "zigzag"])
def test_halo_op_traces_with_a_symbolic_length(sharding: str) -> None:
    """One process (``group=""``): the op compiled with ``dynamic=True`` (the length a SymInt while tracing) on two
    lengths equals the op run eagerly; its output has the chunk count of the sharding."""

    def call(x: torch.Tensor) -> torch.Tensor:
        return halo_fwd(x, "", 1, 0, sharding, x.shape[-1], None, 3)

    compiled = torch.compile(call, backend="aot_eager", dynamic=True, fullgraph=True)
    for seq in (12, 16):
        x = torch.randn(2, 3, seq, generator=torch.Generator().manual_seed(seq))
        got, want = compiled(x), call(x)
        assert got.shape == want.shape == (2, 3, 1 if sharding == "contiguous" else 2, 3)
        assert torch.equal(got, want)
    torch._dynamo.reset()
