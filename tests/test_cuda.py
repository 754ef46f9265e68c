"""CUDA paths: the local kernels (flash / memory-efficient / cuDNN / math) and the ring on one GPU.

A single GPU cannot host a multi-rank NCCL ring, so the ring runs as P virtual ranks in one process
(ThreadRing) with real CUDA kernels and merges, compared with SDPA on the full sequence. Skipped on
machines without CUDA (CI is CPU-only; tests/test_cuda_fake.py runs every CUDA branch there on fake
tensors); on a GPU, ``python -m seqpar.bench gpu-check`` runs this file first.

Every reference is float64 attention on the full sequence. fp32 must match to ~1e-5; fp16/bf16 must be
no worse than torch's own SDPA in that dtype on the same inputs (its error against the same
reference, doubled, plus a rounding step of the dtype).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from seqpar.attn.ring import AttentionOptions, ring_backward, ring_forward
from seqpar.comm.ring import ThreadRing
from seqpar.kernels import block_backward, block_forward
from seqpar.kernels.backends import Backend
from seqpar.kernels.local import cuda_backend

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

from test_attention import shard_rows, unshard_rows  # noqa: E402

_SDP = {Backend.FLASH: SDPBackend.FLASH_ATTENTION, Backend.EFFICIENT: SDPBackend.EFFICIENT_ATTENTION,
        Backend.CUDNN: SDPBackend.CUDNN_ATTENTION, Backend.MATH: SDPBackend.MATH}


def _reference(q, k, v, dout, causal):  # noqa: ANN001, ANN202
    """float64 output, lse and gradients on the full block (GQA by repeat)."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=True)
    grads = torch.autograd.grad(ref, leaves, dout.double())
    group = q.shape[1] // k.shape[1]
    s = leaves[0].detach() @ leaves[1].detach().repeat_interleave(group, 1).transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return [ref.detach(), *grads], torch.logsumexp(s, -1)


def _sdpa_errors(q, k, v, dout, causal, want):  # noqa: ANN001, ANN202
    """torch's own SDPA in q's dtype (its default backend): max error of out, dq, dk, dv."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=True)
    got = [out, *torch.autograd.grad(out, leaves, dout)]
    return [float((a.detach().double() - b).abs().max()) for a, b in zip(got, want)]


@pytest.mark.parametrize("backend", list(Backend), ids=lambda b: b.value)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(8, 8, 64), (8, 2, 128), (4, 1, 40), (4, 2, 100), (2, 1, 256)],
                         ids=lambda h: f"{h[0]}/{h[1]}x{h[2]}")
def test_block_kernels_match_reference(backend: Backend, dtype: torch.dtype, causal: bool,
                                       heads: tuple[int, int, int]) -> None:
    """Each kernel (forced with torch's own switch; one that refuses the shape falls back to exact
    math) against float64: MHA/GQA/MQA, head dims 40/64/100 (padded)/128/256, rectangular blocks
    whose lengths are not multiples of 32 or 128."""
    hq, hkv, d = heads
    lq, lk = (264, 264) if causal else (200, 328)
    g = torch.Generator(device="cuda").manual_seed(hq * 1000 + d)
    q = torch.randn(2, hq, lq, d, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(2, hkv, lk, d, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(2, hkv, lk, d, device="cuda", dtype=dtype, generator=g)
    dout = torch.randn(2, hq, lq, d, device="cuda", dtype=dtype, generator=g)
    want, want_lse = _reference(q, k, v, dout, causal)
    with sdpa_kernel([_SDP[backend]]):
        chosen = cuda_backend(q, k, causal)
        out, lse = block_forward(q, k, v, scale=d**-0.5, causal=causal)
        got = [out, *block_backward(dout, q, k, v, out, lse, scale=d**-0.5, causal=causal)]
    assert chosen in (backend, Backend.MATH)
    assert lse.shape == (2, hq, lq) and lse.dtype == torch.float32
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=2e-5 if dtype == torch.float32 else 2e-2)
    if dtype == torch.float32:
        bounds = [1e-5] * 4
    else:
        step = torch.finfo(dtype).eps
        bounds = [2 * e + 4 * step for e in _sdpa_errors(q, k, v, dout, causal, want)]
    for name, a, b, bound in zip(("out", "dq", "dk", "dv"), got, want, bounds):
        assert a.dtype == dtype and a.shape == b.shape, name
        err = float((a.double() - b).abs().max())
        scale = float(b.abs().max()) if dtype == torch.float32 else 1.0
        assert err <= bound * max(scale, 1.0), f"{chosen.value} {name}: max error {err:.3g} > {bound:.3g}"


def test_default_choice_is_torchs() -> None:
    """With default flags seqpar picks the kernel torch's SDPA picks (``torch._fused_sdp_choice``)."""
    names = {0: Backend.MATH, 1: Backend.FLASH, 2: Backend.EFFICIENT, 3: Backend.CUDNN}
    for dtype, d, causal in itertools.product((torch.bfloat16, torch.float16, torch.float32), (64, 128), (False, True)):
        q = torch.randn(1, 8, 256, d, device="cuda", dtype=dtype, requires_grad=True)
        theirs = names[int(torch.ops.aten._fused_sdp_choice(q, q, q, None, 0.0, causal))]
        assert cuda_backend(q, q, causal) is theirs, (dtype, d, causal)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_efficient_kernel_takes_aligned_half_widths_only(dtype: torch.dtype) -> None:
    """The memory-efficient kernel forced, half precision: every multiple of 8 from 72 to 120 runs it,
    exact within the bound above (GQA, causal and not); 100 and 127 are refused for it (exact math
    instead), as torch refuses them: zero-padded to 104 or 128 they gave NaN / wrong dQ on an H200."""
    for d, causal in itertools.product((72, 80, 88, 96, 100, 104, 112, 120, 127), (False, True)):
        lq, lk = (264, 264) if causal else (200, 328)
        g = torch.Generator(device="cuda").manual_seed(d)
        q = torch.randn(2, 4, lq, d, device="cuda", dtype=dtype, generator=g)
        k, v = (torch.randn(2, 2, lk, d, device="cuda", dtype=dtype, generator=g) for _ in range(2))
        dout = torch.randn(2, 4, lq, d, device="cuda", dtype=dtype, generator=g)
        want, _ = _reference(q, k, v, dout, causal)
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
            chosen = cuda_backend(q, k, causal)
            out, lse = block_forward(q, k, v, scale=d**-0.5, causal=causal)
            got = [out, *block_backward(dout, q, k, v, out, lse, scale=d**-0.5, causal=causal)]
        assert chosen is (Backend.MATH if d % 8 else Backend.EFFICIENT), (d, chosen)
        with sdpa_kernel([SDPBackend.MATH]):  # torch's math in the same dtype is the bar
            bounds = [2 * e + 4 * torch.finfo(dtype).eps for e in _sdpa_errors(q, k, v, dout, causal, want)]
        for name, a, b, bound in zip(("out", "dq", "dk", "dv"), got, want, bounds):
            err = float((a.double() - b).abs().max())
            assert err <= bound, f"{chosen.value} d={d} causal={causal} {name}: max error {err:.3g} > {bound:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("world,sharding,causal", list(itertools.product((2, 4), ("contiguous", "zigzag"), (False, True))))
def test_thread_ring_on_one_gpu(world: int, sharding: str, causal: bool, dtype: torch.dtype) -> None:
    g = torch.Generator(device="cuda").manual_seed(world)
    full = {n: torch.randn(1, 8 if n in "q dout" else 2, 512, 64, device="cuda", dtype=dtype, generator=g)
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
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for j, name in enumerate(("out", "dq", "dk", "dv")):
        got = unshard_rows([per_rank[r][j] for r in range(world)], world, sharding)
        torch.testing.assert_close(got.double(), want[j], rtol=tol, atol=tol, msg=lambda s, n=name: f"{n}: {s}")


@pytest.mark.parametrize("backend", list(Backend), ids=lambda b: b.value)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dims", [(192, 128), (64, 100), (40, 24)], ids=lambda d: f"dk{d[0]}-dv{d[1]}")
def test_unequal_head_dims_match_reference(backend: Backend, dtype: torch.dtype, causal: bool,
                                           dims: tuple[int, int]) -> None:
    """MLA shapes (V's head dim differs from q/k's; DeepSeek-V3's 192/128) on each kernel against float64
    SDPA: flash and cuDNN get V or q/k zero-padded to one head dim, the efficient kernel takes V's own."""
    dk, dv = dims
    lq, lk = (264, 264) if causal else (200, 328)
    g = torch.Generator(device="cuda").manual_seed(dk * 1000 + dv)
    q = torch.randn(2, 8, lq, dk, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(2, 2, lk, dk, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(2, 2, lk, dv, device="cuda", dtype=dtype, generator=g)
    dout = torch.randn(2, 8, lq, dv, device="cuda", dtype=dtype, generator=g)
    want, _ = _reference(q, k, v, dout, causal)
    with sdpa_kernel([_SDP[backend]]):
        out, lse = block_forward(q, k, v, scale=dk**-0.5, causal=causal)
        got = [out, *block_backward(dout, q, k, v, out, lse, scale=dk**-0.5, causal=causal)]
    bounds = [1e-5] * 4 if dtype == torch.float32 else \
        [2 * e + 4 * torch.finfo(dtype).eps for e in _sdpa_errors(q, k, v, dout, causal, want)]
    for name, a, b, bound in zip(("out", "dq", "dk", "dv"), got, want, bounds):
        assert a.dtype == dtype and a.shape == b.shape, name
        err = float((a.double() - b).abs().max())
        scale = float(b.abs().max()) if dtype == torch.float32 else 1.0
        assert err <= bound * max(scale, 1.0), f"{backend.value} dk={dk} dv={dv} {name}: max error {err:.3g} > {bound:.3g}"


# ------------------------------------------------------------------ emulated links on the device (issue 29 §2, §8)
def test_cuda_links_hold_the_compute_stream_for_bytes_over_bandwidth():
    """A message of n bytes on a link of B bytes/s delays a wait by n / B (the sleep is calibrated), two
    messages on one link take twice as long (FIFO), and two on different links overlap; the host never
    blocks on a post."""
    import time

    from seqpar.comm.emulated import CudaLinks
    from seqpar.comm.ring import Pending

    dev = torch.device("cuda")
    links = CudaLinks(1e9, device=dev)  # 1 GB/s: 20 MB -> 20 ms
    nbytes, expect = 20_000_000, 0.020

    def timed(messages):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        pend = links.post(messages, Pending(lambda: None, []), channel=0)
        host = time.perf_counter() - t0
        pend.wait()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e-3, host

    timed([(("send", 1), 1000)])  # warm-up: the stream is created
    one, host = timed([(("send", 1), nbytes)])
    assert one == pytest.approx(expect, rel=0.15) and host < expect / 4
    fifo, _ = timed([(("send", 1), nbytes), (("send", 1), nbytes)])
    assert fifo == pytest.approx(2 * expect, rel=0.15)
    parallel, _ = timed([(("send", 1), nbytes), (("recv", 1), nbytes)])
    assert parallel == pytest.approx(expect, rel=0.15)


def test_gpu_perf_runs_one_case_on_the_device(tmp_path):
    """The GPU path of ``gpu-perf`` end to end at a small L (the full run is the run-book's)."""
    import json

    from seqpar.bench.__main__ import main as bench_main

    rc = bench_main(["gpu-perf", "--device", "cuda", "--seq-locals", "1024", "--head-chunks", "1", "--layouts", "hf",
                     "--hidden-at", "1024", "--profile-at", "1024", "--repeats", "2", "--out", str(tmp_path)])
    assert rc == 0
    rows = json.loads((tmp_path / "gpu_perf.json").read_text())["cases"]
    assert len(rows) == 2
    for r in rows:
        assert 0 < r["eta"] and 0 < r["t_transfer_50"] and r["profile"]["attention_s"] > 0
        # the ring's own kernels: 8 hops of bf16 attention are at least the one-block floor's work
        assert r["t_compute"] > 0.5 * r["t_floor"]


def test_overlap_on_the_device_hides_what_its_schedule_allows():
    """``overlap --device cuda``: the emulated-link step on one GPU, its compute segments measured on the
    compute stream. Structural checks only (the figures are BENCHMARKS'): every time positive, the replayed
    schedule's bound a share, above the bound of the old order (dK/dV waited before the hop's kernels)."""
    from seqpar.bench.overlap import run_case

    for causal in (True, False):
        (row,) = run_case("ring", 4, 65536, causal, ["auto"], repeats=3, device="cuda")
        assert row["t_compute"] > 0 and row["t_transfer"] > 0 and row["t_step"] > 0, row
        assert 0 < row["hidden_max"] <= 1 + 1e-9 and row["hidden_max"] > row["hidden_max_early"], row



@pytest.mark.parametrize("blk_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_fused_merge_one_kernel_within_2_ulp(blk_dtype: torch.dtype) -> None:
    """merge_into and add_sink on CUDA take the fused Triton kernel: within 2 ulp of the float64 merge
    (tests/test_merge.py's measure: out against its terms' scale, lse against itself; -inf rows on
    either side and both) into contiguous, bshd-transposed and row-range accumulators, head dims 128
    and 80 (masked columns), 37 rows (a masked row tail); then one kernel launch per merge, and no
    allocation."""
    pytest.importorskip("triton")
    from test_merge import _layouts, assert_within_2_ulp, merge64, random_partials

    from seqpar.kernels import add_sink, merge_into
    from seqpar.kernels.merge import _fused

    g = torch.Generator().manual_seed(7)
    for shape in [(2, 8, 300, 128), (1, 4, 37, 80)]:
        out, lse, blk, blk_lse = random_partials(g, shape, blk_dtype, device="cuda")
        want = merge64(out, lse, blk, blk_lse)
        for name, acc in _layouts(out).items():
            acc_lse = lse.clone()
            assert _fused(acc, acc_lse, blk, blk_lse), name
            merge_into(acc, acc_lse, blk, blk_lse)
            assert_within_2_ulp(acc.cpu(), acc_lse.cpu(), [w.cpu() for w in want], f"{shape} {name}")
        sink = torch.randn(shape[1], generator=g).to(blk_dtype).cuda()
        acc, acc_lse = out.clone(), lse.clone()
        add_sink(acc, acc_lse, sink)
        want_sink = merge64(out, lse, None, sink.view(1, -1, 1))
        assert_within_2_ulp(acc.cpu(), acc_lse.cpu(), [w.cpu() for w in want_sink], f"{shape} sink")

        merges = (lambda a, s, b=blk, bl=blk_lse: merge_into(a, s, b, bl), lambda a, s, k=sink: add_sink(a, s, k))
        for merge in merges:
            acc, acc_lse = out.clone(), lse.clone()
            merge(acc.clone(), acc_lse.clone())  # compiled for these arguments by now; once more to be sure
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=activities) as prof:
                merge(acc, acc_lse)
                torch.cuda.synchronize()
            kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            assert len(kernels) == 1 and "merge_kernel" in kernels[0], kernels
            assert torch.cuda.max_memory_allocated() == before, "the fused merge allocated"


def _bshd(x: torch.Tensor) -> torch.Tensor:
    """The same values seen through a (batch, seq, heads, dim) buffer: Hugging Face's layout."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


_LAYOUTS = ["hf", "hf-half", "bhsd-half"]


@pytest.mark.parametrize("backend", list(Backend), ids=lambda b: b.value)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", _LAYOUTS)
@pytest.mark.parametrize("heads", [(8, 2, 128), (4, 1, 64)], ids=lambda h: f"{h[0]}/{h[1]}x{h[2]}")
def test_strided_gqa_blocks_match_reference(backend: Backend, dtype: torch.dtype, causal: bool, layout: str,
                                            heads: tuple[int, int, int]) -> None:
    """GQA blocks as the ring hands them to each kernel, with no copies (issue 29 item 4): q/k/v/dout in
    Hugging Face's layout and as row ranges (the second zigzag half) of a batch-2 shard in either layout,
    against float64. Flash and cuDNN take K/V at kv_heads; the memory-efficient kernel folds the query
    group into the query length on non-causal blocks and expands K/V on causal ones. The backward gets
    ``out`` once as the forward returned it and once (B, H, S, D)-contiguous: the efficient kernel in
    half precision reads it with (B, S, H, D) row strides, which seqpar must provide."""
    hq, hkv, d = heads
    n = 264  # rows per half; not a multiple of 32 or 128
    g = torch.Generator(device="cuda").manual_seed(hq * 100 + d + causal)

    def make(h: int) -> torch.Tensor:
        half = layout.endswith("half")  # the second half of a 2n-row shard: a row view, batch stride 2n rows
        x = torch.randn(2, h, 2 * n if half else n, d, device="cuda", dtype=dtype, generator=g)
        x = _bshd(x) if layout.startswith("hf") else x
        return x.narrow(2, n, n) if half else x

    q, dout = make(hq), make(hq)
    k, v = make(hkv), make(hkv)
    want, want_lse = _reference(q, k, v, dout, causal)
    with sdpa_kernel([_SDP[backend]]):
        chosen = cuda_backend(q, k, causal)
        out, lse = block_forward(q, k, v, scale=d**-0.5, causal=causal)
        grads = [block_backward(dout, q, k, v, o, lse, scale=d**-0.5, causal=causal)
                 for o in (out, out.contiguous())]
    assert chosen in (backend, Backend.MATH)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=2e-5 if dtype == torch.float32 else 2e-2)
    if dtype == torch.float32:
        bounds = [1e-5] * 4
    else:
        bounds = [2 * e + 4 * torch.finfo(dtype).eps for e in _sdpa_errors(q, k, v, dout, causal, want)]
    for variant, got in (("out as returned", [out, *grads[0]]), ("out (B,H,S,D)-contiguous", [out, *grads[1]])):
        for name, a, b, bound in zip(("out", "dq", "dk", "dv"), got, want, bounds):
            assert a.dtype == dtype and a.shape == b.shape, name
            err = float((a.double() - b).abs().max())
            scale = float(b.abs().max()) if dtype == torch.float32 else 1.0
            assert err <= bound * max(scale, 1.0), \
                f"{chosen.value} {layout} {variant} {name}: max error {err:.3g} > {bound:.3g}"


@pytest.mark.parametrize("backend", [Backend.FLASH, Backend.EFFICIENT, Backend.CUDNN], ids=lambda b: b.value)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("sharding,causal", [("zigzag", True), ("contiguous", False)])
def test_thread_ring_hf_layout_gqa(backend: Backend, dtype: torch.dtype, sharding: str, causal: bool) -> None:
    """The ring (P = 4 virtual ranks on one GPU) on each kernel with Hugging Face-layout GQA inputs:
    the kernels get the zigzag halves and the (batch, seq, heads, dim) strides as views, dout/out are laid
    out once per backward, and dK/dV shares are added over the half-block rows a hop touches."""
    from seqpar.attn.ring import ring_attention_backward, ring_attention_forward

    world = 4
    g = torch.Generator(device="cuda").manual_seed(17)
    full = {n: torch.randn(2, 8 if n in "q dout" else 2, 512, 128, device="cuda", dtype=dtype, generator=g)
            for n in ("q", "k", "v", "dout")}
    want, _ = _reference(full["q"], full["k"], full["v"], full["dout"], causal)
    if dtype == torch.float32:
        bounds = [1e-5 * max(float(w.abs().max()), 1.0) for w in want]
    else:  # no worse than torch's SDPA on the full sequence in this dtype (doubled, plus a rounding step)
        errs = _sdpa_errors(full["q"], full["k"], full["v"], full["dout"], causal, want)
        bounds = [2 * e + 4 * torch.finfo(dtype).eps for e in errs]
    opts = AttentionOptions(causal=causal, scale=128**-0.5, sharding=sharding)

    def body(comm):  # noqa: ANN001, ANN202
        qs, ks, vs, ds = (_bshd(shard_rows(full[n], comm.rank, world, sharding)) for n in ("q", "k", "v", "dout"))
        out, lse = ring_attention_forward(qs, ks, vs, comm, opts)
        return [out, *ring_attention_backward(ds, qs, ks, vs, out, lse, comm, opts)]

    with sdpa_kernel([_SDP[backend]]):
        per_rank = ThreadRing(world).run(body)
    for j, name in enumerate(("out", "dq", "dk", "dv")):
        got = unshard_rows([per_rank[r][j] for r in range(world)], world, sharding)
        assert got.dtype == dtype and got.shape == want[j].shape, name
        err = float((got.double() - want[j]).abs().max())
        assert err <= bounds[j], f"{backend.value} {sharding} causal={causal} {name}: max error {err:.3g} > {bounds[j]:.3g}"


@pytest.mark.parametrize("order", ["vocab", "rows"])
def test_tiled_loss_bf16_takes_the_fp32_output_matmul_and_matches_float64(order: str) -> None:
    """The tiled LM loss in bf16 on the GPU: its fp32 accumulations run as bf16 matmuls writing fp32
    (``torch.addmm(..., out_dtype=torch.float32)``, seqpar.kernels.matmul; torch has it on CUDA only, so CI cannot
    run this path) and both backward orders equal float64 on the bf16-rounded inputs within bf16's rounding of each
    gradient's scale (as tests/test_tiled_loss_vocab_order.py holds them on CPU). Fails if the kernel is missing on
    this GPU's torch (the loss then takes the slower upcast path: say so in BENCHMARKS)."""
    from seqpar.kernels.matmul import fp32_out_matmul_supported
    from seqpar.memory.tiling import tiled_lm_loss

    assert fp32_out_matmul_supported(str(torch.device("cuda", torch.cuda.current_device())), torch.bfloat16)
    g = torch.Generator(device="cpu").manual_seed(5)
    vocab, hidden, rows = 1000, 64, 96
    h64 = torch.randn(rows, hidden, generator=g, dtype=torch.float64).bfloat16().double()
    w64 = (torch.randn(vocab, hidden, generator=g, dtype=torch.float64) / hidden**0.5).bfloat16().double()
    t = torch.randint(0, vocab, (rows,), generator=g)
    t[torch.rand(rows, generator=g) < 0.2] = -100
    hr, wr = h64.clone().requires_grad_(), w64.clone().requires_grad_()
    F.cross_entropy(hr @ wr.T, t, ignore_index=-100, reduction="sum").backward()
    h = h64.cuda().bfloat16().requires_grad_()
    w = w64.cuda().bfloat16().requires_grad_()
    loss, _ = tiled_lm_loss(h.unsqueeze(0), w, t.cuda().unsqueeze(0), chunk_rows=17, backward_order=order)
    loss.backward()
    for name, got, want in (("dhidden", h.grad, hr.grad), ("dweight", w.grad, wr.grad)):
        err = (got.double().cpu() - want).abs().max().item() / want.abs().max().item()
        assert err <= 2.0**-6, f"{order}: {name} off by {err:.3g} of its scale"
