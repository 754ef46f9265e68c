"""CUDA paths: the local kernels (flash / memory-efficient) and the ring on one GPU.

A single GPU cannot host a multi-rank NCCL ring, so the ring runs as P virtual ranks in one process
(ThreadRing) with real CUDA kernels and merges, compared with SDPA on the full sequence. Skipped on
machines without CUDA (CI is CPU-only); run with `python -m pytest tests/test_cuda.py` on a GPU.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from seqpar.attention.ring import AttentionOptions, ring_backward, ring_forward
from seqpar.comm.ring import ThreadRing
from seqpar.kernels import block_backward, block_forward

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

from test_attention import shard_rows, unshard_rows  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(8, 8, 64), (8, 2, 128), (4, 1, 40)])
def test_block_kernels_match_sdpa(dtype: torch.dtype, causal: bool, heads: tuple[int, int, int]) -> None:
    hq, hkv, d = heads
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, hq, 256, d, device="cuda", dtype=dtype, generator=g, requires_grad=True)
    k = torch.randn(2, hkv, 256, d, device="cuda", dtype=dtype, generator=g, requires_grad=True)
    v = torch.randn(2, hkv, 256, d, device="cuda", dtype=dtype, generator=g, requires_grad=True)
    dout = torch.randn(2, hq, 256, d, device="cuda", dtype=dtype, generator=g)
    ref = F.scaled_dot_product_attention(*(t.double() for t in (q, k, v)), is_causal=causal, enable_gqa=True)
    want = [ref, *torch.autograd.grad(ref, (q, k, v), dout.double())]
    out, lse = block_forward(q, k, v, scale=d**-0.5, causal=causal)
    got = [out, *block_backward(dout, q, k, v, out, lse, scale=d**-0.5, causal=causal)]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert a.dtype == dtype
        torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=tol, msg=lambda s, n=name: f"{n}: {s}")


@pytest.mark.parametrize("world,sharding,causal", list(itertools.product((2, 4), ("contiguous", "zigzag"), (False, True))))
def test_thread_ring_on_one_gpu(world: int, sharding: str, causal: bool) -> None:
    g = torch.Generator(device="cuda").manual_seed(world)
    full = {n: torch.randn(1, 8 if n in "q dout" else 2, 512, 64, device="cuda", dtype=torch.bfloat16, generator=g)
            for n in ("q", "k", "v", "dout")}
    q, k, v = (full[n].double().requires_grad_() for n in "qkv")
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    want = [ref.detach(), *torch.autograd.grad(ref, (q, k, v), full["dout"].double())]
    opts = AttentionOptions(causal=causal, scale=64**-0.5, sharding=sharding)

    def body(comm):  # noqa: ANN001, ANN202
        qs, ks, vs, ds = (shard_rows(full[n], comm.rank, world, sharding) for n in ("q", "k", "v", "dout"))
        out_acc, lse = ring_forward(qs, ks, vs, comm, opts)
        out = out_acc.to(qs.dtype)
        return [out, *ring_backward(ds, qs, ks, vs, out, lse, comm, opts)]

    per_rank = ThreadRing(world).run(body)
    for j, name in enumerate(("out", "dq", "dk", "dv")):
        got = unshard_rows([per_rank[r][j] for r in range(world)], world, sharding)
        torch.testing.assert_close(got.double(), want[j], rtol=3e-2, atol=3e-2, msg=lambda s, n=name: f"{n}: {s}")
