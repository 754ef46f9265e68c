"""MLA latent transfer (issue 19 §3): the ring moves the compressed latent ``(c, r)`` and expands each
block with ``kv_b_proj`` locally; output and every gradient (q, c, r, kv_b_proj's weight, sinks) equal a
float64 single-process MLA attention on the full sequence, and the ring sends latent-sized blocks."""

from __future__ import annotations

import itertools

import pytest
import torch
from test_attention import shard_rows, unshard_rows
from test_documents import boundaries, visible

from seqpar.attn.common import AttentionOptions
from seqpar.attn.latent import LatentRingAttention, MLADims
from seqpar.comm.ring import ThreadRing

DIMS = MLADims(heads=4, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5, kv_lora_rank=7)


def make_case(seed: int, seq: int, dims: MLADims = DIMS, sinks: bool = False) -> dict:
    g = torch.Generator().manual_seed(seed)
    h, dn, dr, dv, rank = dims.heads, dims.qk_nope_head_dim, dims.qk_rope_head_dim, dims.v_head_dim, dims.kv_lora_rank

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    return {"q": rnd(1, h, seq, dn + dr), "c": rnd(1, 1, seq, rank), "r": rnd(1, 1, seq, dr),
            "w": rnd(h * (dn + dv), rank) / rank ** 0.5, "dout": rnd(1, h, seq, dv),
            "sinks": rnd(h) if sinks else None}


def reference(case: dict, causal: bool, window: int | None, cu: list[int] | None) -> list[torch.Tensor]:
    """float64 MLA attention written out: expand the latent, masked softmax, every gradient."""
    d = DIMS
    q, c, r, w = (case[n].clone().requires_grad_() for n in "qcrw")
    seq = q.shape[2]
    kv = (c.squeeze(1) @ w.t()).view(1, seq, d.heads, -1).transpose(1, 2)
    k = torch.cat([kv[..., :d.qk_nope_head_dim], r.expand(1, d.heads, seq, -1)], -1)
    v = kv[..., d.qk_nope_head_dim:]
    s = (q @ k.transpose(-1, -2)) * 0.3
    s = s.masked_fill(~visible(seq, causal, window, cu), float("-inf"))
    leaves = [q, c, r, w]
    if case["sinks"] is not None:
        sinks = case["sinks"].clone().requires_grad_()
        leaves.append(sinks)
        p = torch.softmax(torch.cat([s, sinks.view(1, -1, 1, 1).expand(*s.shape[:3], 1)], -1), -1)[..., :-1]
    else:
        p = torch.softmax(s, -1)
    out = p @ v
    return [out.detach(), *torch.autograd.grad(out, leaves, case["dout"])]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_latent_ring_exact(world: int) -> None:
    """P virtual ranks (ThreadRing): contiguous and zigzag, causal or not, documents, a window, sinks."""
    seq = 12 * 2 * world
    variants = [(None, None, False), (None, 0, True), (5, 1, False)]  # (window, docs, sinks)
    for i, (sharding, causal, (window, docs, sinks)) in enumerate(
        itertools.product(("contiguous", "zigzag"), (False, True), variants)
    ):
        case = make_case(100 * world + i, seq, sinks=sinks)
        cu = None if docs is None else boundaries(seq, world, docs)
        want = reference(case, causal, window, cu)
        opts = AttentionOptions(causal=causal, scale=0.3, sharding=sharding, window=window,
                                cu_seqlens=None if cu is None else tuple(cu))

        def body(comm, case=case, opts=opts, sharding=sharding):  # noqa: ANN001, ANN202
            q, c, r, dout = (shard_rows(case[n], comm.rank, world, sharding).clone().requires_grad_()
                             for n in ("q", "c", "r", "dout"))
            w = case["w"].clone().requires_grad_()
            sk = None if case["sinks"] is None else case["sinks"].clone().requires_grad_()
            out = LatentRingAttention.apply(q, c, r, w, comm, opts, DIMS, sk)
            grads = torch.autograd.grad(out, [q, c, r, w] + ([sk] if sk is not None else []), dout.detach())
            return [out.detach(), *grads], comm.bytes_sent

        results = ThreadRing(world, timeout=60).run(body)
        per_rank = [res[0] for res in results]
        label = f"P={world} {sharding} causal={causal} window={window} docs={docs} sinks={sinks}"
        names = ["out", "dq", "dc", "dr", "dw", "dsinks"]
        for j, name in enumerate(names[: len(want)]):
            if name in ("dw", "dsinks"):  # replicated: each rank holds its share
                got = sum(per_rank[rk][j] for rk in range(world))
            else:
                got = unshard_rows([per_rank[rk][j] for rk in range(world)], world, sharding)
            torch.testing.assert_close(got, want[j], rtol=1e-10, atol=1e-10, msg=lambda s, n=name, lb=label: f"{lb} {n}: {s}")
        if window is None and docs is None and world > 1:
            # dense ring, per rank: P-1 latent blocks forward, P-1 latent blocks and P-1 latent gradient
            # accumulators (fp32, here float64 as the data) backward; nothing expanded travels
            block = seq // world * DIMS.latent_width * 8
            assert all(res[1] == 3 * (world - 1) * block for res in results), [res[1] for res in results]


def test_latent_ring_on_fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """The expansion and its reduction on fake CUDA tensors (H100 capabilities), DeepSeek-V3's dims at
    a few tokens: every op has a CUDA schema and no host sync; shapes and dtypes of out, dq, dc, dr, dW.
    fp32 (the efficient kernel): with bf16 the merge copies the kernel's output into the fp32
    accumulator, and ``copy_`` of any fake CUDA tensor raises on a CPU-only build (the bf16 kernels
    themselves: tests/test_mla_dims.py)."""
    dtype = torch.float32
    from test_cuda_fake import H100
    from torch._subclasses.fake_tensor import FakeTensorMode

    import seqpar.kernels.backends as backends
    from seqpar.attn.common import SingleRank
    from seqpar.attn.latent import MLAExpander
    from seqpar.attn.ring import ring_backward, ring_forward

    monkeypatch.setattr(backends, "device_caps", lambda device: H100)
    dims = MLADims(heads=16, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, kv_lora_rank=512)
    opts = AttentionOptions(causal=True, scale=192**-0.5)
    with FakeTensorMode():
        q = torch.empty(1, 16, 32, 192, device="cuda", dtype=dtype)
        c = torch.empty(1, 1, 32, 512, device="cuda", dtype=dtype)
        r = torch.empty(1, 1, 32, 64, device="cuda", dtype=dtype)
        w = torch.empty(16 * 256, 512, device="cuda", dtype=dtype)
        dout = torch.empty(1, 16, 32, 128, device="cuda", dtype=dtype)
        out_acc, lse = ring_forward(q, c, r, SingleRank(), opts, expander=MLAExpander(w, dims))
        expander = MLAExpander(w, dims)
        dq, dc, dr = ring_backward(dout, q, c, r, out_acc.to(dtype), lse, SingleRank(), opts, expander=expander)
        assert out_acc.shape == (1, 16, 32, 128) and out_acc.device.type == "cuda"
        assert (dq.shape, dc.shape, dr.shape) == (q.shape, c.shape, r.shape)
        assert dq.dtype == dc.dtype == dr.dtype == dtype
        assert expander.grad_weight.shape == w.shape and expander.grad_weight.dtype == torch.float32


def _allgather_worker(rank: int, world: int, cases: list[dict]) -> list:
    """Worker: LatentAllGatherAttention on this rank's shard of each case."""
    import torch.distributed as dist

    from seqpar.attn.latent import LatentAllGatherAttention

    results = []
    for case in cases:
        sharding = case["sharding"]
        q, c, r, dout = (shard_rows(case[n], rank, world, sharding).clone().requires_grad_()
                         for n in ("q", "c", "r", "dout"))
        w = case["w"].clone().requires_grad_()
        sk = None if case["sinks"] is None else case["sinks"].clone().requires_grad_()
        out = LatentAllGatherAttention.apply(q, c, r, w, dist.group.WORLD, case["opts"], DIMS, sk)
        results.append([out.detach(), *torch.autograd.grad(out, [q, c, r, w] + ([sk] if sk is not None else []),
                                                           dout.detach())])
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_latent_allgather_exact(dist_pool, world: int) -> None:
    """The all-gather moving latents (backward: latent gradients reduce-scattered), gloo ranks."""
    seq = 12 * 2 * world
    cases, meta = [], []
    for i, (sharding, causal, (window, docs, sinks)) in enumerate(
        itertools.product(("contiguous", "zigzag"), (False, True), [(None, None, False), (5, 0, True)])
    ):
        case = make_case(500 * world + i, seq, sinks=sinks)
        cu = None if docs is None else boundaries(seq, world, docs)
        case.update(sharding=sharding, opts=AttentionOptions(causal=causal, scale=0.3, sharding=sharding,
                                                             window=window, cu_seqlens=None if cu is None else tuple(cu)))
        cases.append(case)
        meta.append((causal, window, cu, f"P={world} {sharding} causal={causal} window={window} docs={docs}"))
    per_rank = dist_pool.run(world, _allgather_worker, cases, timeout=300)
    for idx, (case, (causal, window, cu, label)) in enumerate(zip(cases, meta)):
        want = reference(case, causal, window, cu)
        for j, name in enumerate(["out", "dq", "dc", "dr", "dw", "dsinks"][: len(want)]):
            if name in ("dw", "dsinks"):
                got = sum(per_rank[rk][idx][j] for rk in range(world))
            else:
                got = unshard_rows([per_rank[rk][idx][j] for rk in range(world)], world, case["sharding"])
            torch.testing.assert_close(got, want[j], rtol=1e-10, atol=1e-10, msg=lambda s, n=name, lb=label: f"{lb} {n}: {s}")
