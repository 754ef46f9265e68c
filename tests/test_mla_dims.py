"""Q/K head dim different from V's (MLA: DeepSeek-V2/V3, Kimi, GLM-4.5 MoE-lite, MiniCPM3), issue 19 §3.

Every mode (ring, all-gather, Ulysses, hybrid) at P = 1, 2, 4 against test_documents' float64 masked
reference on the full sequence: causal or not, GQA and MQA, odd head dims both ways (dk=10/dv=6 and
dk=6/dv=10), documents, windows and sinks, contiguous / zigzag / balanced shardings. The output is
``(batch, heads, seq_local, v_head_dim)``.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from test_documents import boundaries, check
from test_ulysses_documents import run_cases

import seqpar

# (q_heads, kv_heads, (head_dim, v_head_dim)): GQA with V narrower, MQA with V wider, MHA
HEADS = ((4, 2, (10, 6)), (4, 1, (6, 10)), (4, 4, (12, 8)))
# (window, docs, sinks); shard = 24 tokens per rank
VARIANTS = ((None, None, False), (None, 0, False), (3, 0, True), (29, 1, True), (29, None, False))


def make_case(seed: int, world: int, heads: tuple, *, mode: str, sharding: str, causal: bool,
              window: int | None, docs: int | None, sinks: bool) -> dict:
    """test_documents' case with V (and dout) at their own head dim."""
    hq, hkv, (dk, dv) = heads
    seq = 12 * 2 * world
    g = torch.Generator().manual_seed(seed)
    case = {n: torch.randn(1, h, seq, d, generator=g, dtype=torch.float64)
            for n, h, d in (("q", hq, dk), ("k", hkv, dk), ("v", hkv, dv), ("dout", hq, dv))}
    case.update(
        mode=mode, sharding=sharding, causal=causal, window=window, scale=dk ** -0.5,
        cu=None if docs is None else boundaries(seq, world, docs),
        sinks=torch.randn(hq, generator=g, dtype=torch.float64) if sinks else None,
    )
    return case


def _cases(world: int, modes: tuple[str, ...], shardings: tuple[str, ...], seed: int) -> list[dict]:
    cases = []
    for i, (mode, sharding, causal, (window, docs, sinks)) in enumerate(
        itertools.product(modes, shardings, (False, True), VARIANTS)
    ):
        if sharding == "balanced" and docs is None:
            continue  # the balanced layout is cut by documents
        cases.append(make_case(seed + i, world, HEADS[i % len(HEADS)], mode=mode, sharding=sharding,
                               causal=causal, window=window, docs=docs, sinks=sinks))
    return cases


@pytest.mark.parametrize("world", [1, 2, 4])
def test_ring_allgather_unequal_head_dims_exact(dist_pool, world: int) -> None:
    cases = _cases(world, ("ring", "allgather"), ("contiguous", "zigzag", "balanced"), 7000 + 100 * world)
    check(dist_pool.run(world, run_cases, cases, timeout=400), cases, world)


@pytest.mark.parametrize("world", [2, 4])
def test_ulysses_unequal_head_dims_exact(dist_pool, world: int) -> None:
    cases = _cases(world, ("ulysses",), ("contiguous", "zigzag", "balanced"), 7500 + 100 * world)
    check(dist_pool.run(world, run_cases, cases, timeout=400), cases, world)


def test_hybrid_unequal_head_dims_exact(dist_pool) -> None:
    """P = 4 as 2 x 2 Ulysses x ring."""
    cases = _cases(4, ("hybrid",), ("contiguous", "zigzag"), 7900)
    check(dist_pool.run(4, run_cases, cases, 2, timeout=400), cases, 4)


def test_output_has_v_head_dim_and_bad_shapes_are_refused() -> None:
    """One process: the output takes V's head dim (both layouts); k and v that differ in anything but
    the head dim, or q and k of different head dims, are refused by name."""
    q, k = torch.randn(1, 4, 8, 10), torch.randn(1, 2, 8, 10)
    v = torch.randn(1, 2, 8, 6)
    assert seqpar.attention(q, k, v, causal=True).shape == (1, 4, 8, 6)
    assert seqpar.attention(q, k, v, causal=True, window=3).shape == (1, 4, 8, 6)
    bshd = [t.transpose(1, 2) for t in (q, k, v)]
    assert seqpar.attention(*bshd, causal=True, layout="bshd", window=3).shape == (1, 8, 4, 6)
    with pytest.raises(ValueError, match="must agree in batch, kv_heads and seq_local"):
        seqpar.attention(q, k, torch.randn(1, 2, 7, 6))
    with pytest.raises(ValueError, match="must agree in batch, seq_local and head_dim"):
        seqpar.attention(q, torch.randn(1, 2, 8, 6), v)


# ------------------------------------------------------------------ CUDA kernel paths, without a GPU
from test_cuda_fake import H100, _CudaContractsOnCpu, _only  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

import seqpar.kernels.local as local  # noqa: E402
from seqpar.kernels import block_backward, block_forward  # noqa: E402
from seqpar.kernels.backends import Backend, efficient_alignment  # noqa: E402
from seqpar.kernels.local import cuda_backend  # noqa: E402

# (head_dim, v_head_dim): DeepSeek-V3's, V wider, both odd (flash pads both to 8; the efficient kernel
# takes each side as it is when aligned, and is refused otherwise, as by torch)
DIMS = [(192, 128), (64, 100), (10, 6), (40, 24)]


class _Recording:
    """``torch.ops.aten`` stand-in recording (op, q/k/v head dims) of each call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int, int]] = []

    def __getattr__(self, name: str):  # noqa: ANN204
        op = getattr(torch.ops.aten, name)

        def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            if kwargs.get("query") is not None:
                q, k, v = kwargs["query"], kwargs["key"], kwargs["value"]
            else:
                q, k, v = args[1:4] if name.endswith("_backward") else args[0:3]
            self.calls.append((name, q.shape[-1], k.shape[-1], v.shape[-1]))
            return op(*args, **kwargs)

        return call


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("backend", list(Backend), ids=lambda b: b.value)
def test_unequal_head_dims_on_every_cuda_branch(backend: Backend, dtype: torch.dtype,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Fake CUDA tensors through each kernel's real op schema: out ``(..., v_head_dim)``, dq/dk/dv
    shaped like q/k/v; flash and cuDNN get q, k, v padded to one head dim (the wider, then to 8), the
    efficient kernel takes V's own (each side aligned, else refused)."""
    rec = _Recording()
    monkeypatch.setattr(local, "_aten", rec)
    ran = set()
    with FakeTensorMode(), _only(backend):
        for (hq, hkv), (dk, dv), causal in itertools.product(((4, 4), (4, 1)), DIMS, (False, True)):
            lq, lk = (24, 24) if causal else (24, 40)
            q = torch.empty(2, hq, lq, dk, device="cuda", dtype=dtype)
            k = torch.empty(2, hkv, lk, dk, device="cuda", dtype=dtype)
            v = torch.empty(2, hkv, lk, dv, device="cuda", dtype=dtype)
            dout = torch.empty(2, hq, lq, dv, device="cuda", dtype=dtype)
            case = f"{backend.value} {dtype} heads={hq}/{hkv} dk={dk} dv={dv} causal={causal}"
            chosen = cuda_backend(q, k, causal, H100, v_head_dim=dv)
            assert chosen in (backend, Backend.MATH), case
            rec.calls.clear()
            out, lse = block_forward(q, k, v, scale=dk**-0.5, causal=causal, caps=H100)
            dq, dk_, dv_ = block_backward(dout, q, k, v, out, lse, scale=dk**-0.5, causal=causal, caps=H100)
            assert (out.shape, out.dtype) == ((2, hq, lq, dv), dtype), case
            assert lse.shape == (2, hq, lq), case
            assert (dq.shape, dk_.shape, dv_.shape) == (q.shape, k.shape, v.shape), case
            if chosen is Backend.MATH:
                assert rec.calls == [], case
                continue
            ran.add(chosen)
            assert [c[0] for c in rec.calls] == [
                f"_scaled_dot_product_{chosen.value}_attention" + s for s in ("", "_backward")
            ], case
            if chosen is Backend.EFFICIENT:
                a = efficient_alignment(H100, dtype)
                assert dk % a == 0 and dv % a == 0, case  # else refused (math), as by torch
                want = (dk, dk, dv)
            else:
                common = max(dk, dv)
                common += (-common) % 8
                want = (common,) * 3
            assert {c[1:] for c in rec.calls} == {want}, case
    # flash takes d <= 256 and cuDNN <= 128 (DeepSeek's 192 goes to flash, padded V)
    expected = {Backend.FLASH: dtype != torch.float32, Backend.CUDNN: dtype != torch.float32,
                Backend.EFFICIENT: True, Backend.MATH: False}[backend]
    assert (backend in ran) == expected, f"{backend} ran: {ran}"


def _ref_forward(q, k, v, dropout_p, causal, *, scale):  # noqa: ANN001, ANN202
    """float64 attention with its log-sum-exp, any head dims (stands in for the kernels' numbers)."""
    g = q.shape[1] // k.shape[1]
    s = q @ k.repeat_interleave(g, 1).transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(s, -1)
    return torch.softmax(s, -1) @ v.repeat_interleave(g, 1), lse


def _ref_backward(dout, q, k, v, out, lse, dropout_p, causal, *, scale):  # noqa: ANN001, ANN202
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    o, _ = _ref_forward(*leaves, 0.0, causal, scale=scale)
    return torch.autograd.grad(o, leaves, dout)


class _UnequalContracts(_CudaContractsOnCpu):
    """The contracts of test_cuda_fake, with numbers from :func:`_ref_forward` (the CPU kernel takes only
    equal head dims) and one more rule: flash and cuDNN get q, k and v at one head dim."""

    cpu_fwd = staticmethod(_ref_forward)
    cpu_bwd = staticmethod(_ref_backward)

    def _scaled_dot_product_flash_attention(self, **kw):  # noqa: ANN003, ANN202
        assert kw["query"].shape[-1] == kw["key"].shape[-1] == kw["value"].shape[-1], "flash takes one head dim"
        return super()._scaled_dot_product_flash_attention(**kw)

    def _scaled_dot_product_flash_attention_backward(self, **kw):  # noqa: ANN003, ANN202
        dims = {kw[n].shape[-1] for n in ("grad_out", "query", "key", "value")}
        assert len(dims) == 1, "flash takes one head dim"
        return super()._scaled_dot_product_flash_attention_backward(**kw)

    def _scaled_dot_product_efficient_attention(self, **kw):  # noqa: ANN003, ANN202
        assert kw["query"].shape[-1] == kw["key"].shape[-1] and kw["value"].shape[-1] % self.align == 0
        return super()._scaled_dot_product_efficient_attention(**kw)

    def _scaled_dot_product_cudnn_attention(self, **kw):  # noqa: ANN003, ANN202
        assert kw["query"].shape[-1] == kw["key"].shape[-1] == kw["value"].shape[-1], "cuDNN: one head dim here"
        return super()._scaled_dot_product_cudnn_attention(**kw)

    def _scaled_dot_product_cudnn_attention_backward(self, **kw):  # noqa: ANN003, ANN202
        assert kw["grad_out"].shape[-1] == kw["query"].shape[-1] == kw["value"].shape[-1], "cuDNN: one head dim"
        return super()._scaled_dot_product_cudnn_attention_backward(**kw)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("backend", [Backend.FLASH, Backend.EFFICIENT, Backend.CUDNN], ids=lambda b: b.value)
def test_cuda_glue_with_unequal_head_dims_is_exact(backend: Backend, causal: bool,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """float64 data through each fused path's glue (padding to the common dim or per side, slicing
    back, GQA expansion and folding) equals float64 SDPA, V narrower or wider than Q/K."""
    align = efficient_alignment(H100, torch.float32)
    monkeypatch.setattr(local, "_aten", _UnequalContracts(align))
    g = torch.Generator().manual_seed(11)
    # flash pads (42, 20)... to one dim; the efficient kernel takes aligned dims as they are (4 for fp32)
    dims = {Backend.CUDNN: [(24, 16), (8, 40)], Backend.FLASH: [(42, 20), (10, 6), (6, 10)],
            Backend.EFFICIENT: [(44, 20), (12, 8), (8, 12)]}[backend]
    for (hq, hkv), (dk, dv) in itertools.product(((4, 4), (4, 2), (4, 1)), dims):
        lq, lk = (20, 20) if causal else (20, 37)
        q = torch.randn(2, hq, lq, dk, generator=g, dtype=torch.float64)
        k = torch.randn(2, hkv, lk, dk, generator=g, dtype=torch.float64)
        v = torch.randn(2, hkv, lk, dv, generator=g, dtype=torch.float64)
        dout = torch.randn(2, lq, hq, dv, generator=g, dtype=torch.float64).transpose(1, 2)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=True)
        want = [ref, *torch.autograd.grad(ref, leaves, dout)]
        out, lse = local._cuda_forward(q, k, v, dk**-0.5, causal, backend, align)
        got = [out, *local._cuda_backward(dout, q, k, v, out, lse, dk**-0.5, causal, backend, align)]
        case = f"{backend.value} heads={hq}/{hkv} dk={dk} dv={dv} causal={causal}"
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            assert a.shape == b.shape, f"{case} {name}"
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=lambda m, n=name, c=case: f"{c} {n}: {m}")


# ------------------------------------------------------------------------- cost and memory models
def test_cost_and_memory_models_count_v_head_dim() -> None:
    """The ``mode="auto"`` cost model and the memory estimate read V's head dim: K/V bytes are
    ``head_dim + v_head_dim`` per pair (DeepSeek-V3: 192 + 128, not 2 x 192), and equal dims change nothing."""
    from seqpar.attn.choose import CallShape, Links, mode_costs
    from seqpar.memory.attention import estimate_attention_memory

    base = dict(batch=1, q_heads=8, kv_heads=8, seq_local=1024, head_dim=192, elem_bytes=2, causal=True,
                sp_size=4, ulysses_size=1)
    mla = {c.mode: c.bytes_sent for c in mode_costs(CallShape(**base, v_head_dim=128), Links(), ["ring", "ulysses"])}
    wide = {c.mode: c.bytes_sent for c in mode_costs(CallShape(**base), Links(), ["ring", "ulysses"])}
    same = {c.mode: c.bytes_sent for c in mode_costs(CallShape(**base, v_head_dim=192), Links(), ["ring", "ulysses"])}
    assert same == wide
    # ring: 3 steps of K (192) + V (128) per rank, each 2 bytes forward and backward plus fp32 dK/dV
    assert mla["ring"] == 3 * 8 * 1024 * (192 + 128) * (2 * 2 + 4)
    assert mla["ulysses"] * 2 * 192 == wide["ulysses"] * (192 + 128)
    # ... and by hand, as the ratio above holds for any Ulysses count that scales with the head dims: 3/4 of
    # q + out (8 heads) and k + v (8 heads), each 192 + 128 values a row, leave the rank forward and backward.
    # Seen failing: mode_costs' Ulysses charging the whole (u, not (u - 1) / u) passes the ratio, fails this.
    assert mla["ulysses"] == 3 * 2 * 1024 * (8 + 8) * (192 + 128) * 2 // 4
    kw = dict(world_size=4, mode="ring", batch=1, q_heads=8, kv_heads=8, dtype=torch.bfloat16)
    assert estimate_attention_memory(4096, head_dim=192, v_head_dim=192, **kw) == \
        estimate_attention_memory(4096, head_dim=192, **kw)
    assert estimate_attention_memory(4096, head_dim=192, v_head_dim=128, **kw) == \
        estimate_attention_memory(4096, head_dim=160, **kw)


# ------------------------------------------------------------------------------------- dilated
def _dilated_case(seed: int, world: int, heads: tuple, kwargs: dict) -> dict:
    from test_dilated_dist import SEQ_LOCAL

    hq, hkv, (dk, dv) = heads
    g = torch.Generator().manual_seed(seed)
    case = {n: torch.randn(2, h, SEQ_LOCAL * world, d, generator=g, dtype=torch.float64)
            for n, h, d in (("q", hq, dk), ("k", hkv, dk), ("v", hkv, dv), ("dout", hq, dv))}
    case["kwargs"] = kwargs
    return case


@pytest.mark.parametrize("world", [1, 2, 4])
def test_dilated_unequal_head_dims_exact(dist_pool, world: int) -> None:
    """LongNet dilated attention (local and spanning segments, ring and all-gather) with V's head dim
    different from q/k's, against test_dilated's O(S^2) float64 reference."""
    from test_dilated_dist import PATTERNS, _reference
    from test_dilated_dist import run_cases as dilated_cases

    cases = []
    for i, ((ws, rs), mode, causal) in enumerate(itertools.product(PATTERNS[world], ("ring", "allgather"),
                                                                   (False, True))):
        kwargs = dict(segment_lengths=ws, dilation_rates=rs, causal=causal, mode=mode, head_layout="mixed")
        cases.append(_dilated_case(31 * world + i, world, HEADS[i % len(HEADS)], kwargs))
    per_rank = dist_pool.run(world, dilated_cases, cases, torch.float32, timeout=300)
    for idx, case in enumerate(cases):
        got = [torch.cat([per_rank[r][idx][j] for r in range(world)], dim=2) for j in range(4)]
        for name, g, w in zip(("out", "dq", "dk", "dv"), got, _reference(case), strict=True):
            assert g.shape == w.shape, name
            torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-5,
                                       msg=lambda s, n=name, kw=case["kwargs"]: f"{n} {kw}: {s}")
