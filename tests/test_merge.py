"""The LSE merge (seqpar.kernels.merge) against float64 softmax over the union of key sets."""

from __future__ import annotations

import importlib.util
import math
import warnings
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import seqpar.kernels.merge as merge_mod
from seqpar.kernels import Partials, add_sink, merge_into, sink_grad


def _partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = q @ k.transpose(-1, -2)
    lse = torch.logsumexp(s, -1)
    return torch.softmax(s, -1) @ v, lse


def test_pieces_over_some_rows_merge_to_the_softmax_over_their_union() -> None:
    """Three key blocks; pieces cover rows [0, 6), [4, 10) and [2, 8) of 12; rows 10, 11 see nothing
    and finish as out = 0, lse = -inf (no NaN). Accumulated in fp32, compared with fp64."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 12, 8, generator=g, dtype=torch.float64)
    ks = [torch.randn(2, 3, 5, 8, generator=g, dtype=torch.float64) for _ in range(3)]
    vs = [torch.randn(2, 3, 5, 8, generator=g, dtype=torch.float64) for _ in range(3)]
    rows = [slice(0, 6), slice(4, 10), slice(2, 8)]
    acc = Partials.like(q.float(), torch.float32)
    for r, k, v in zip(rows, ks, vs):
        o, lse = _partial(q[:, :, r], k, v)
        acc.add(r, o.float(), lse.float())
    out, lse = acc.finish()
    for i in range(12):
        seen = [b for b, r in enumerate(rows) if r.start <= i < r.stop]
        if not seen:
            assert torch.all(out[:, :, i] == 0) and torch.all(torch.isneginf(lse[:, :, i]))
            continue
        k = torch.cat([ks[b] for b in seen], 2)
        v = torch.cat([vs[b] for b in seen], 2)
        want_o, want_lse = _partial(q[:, :, i:i + 1], k, v)
        torch.testing.assert_close(out[:, :, i:i + 1].double(), want_o, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(lse[:, :, i:i + 1].double(), want_lse, rtol=1e-6, atol=1e-6)


def test_a_first_piece_over_every_row_becomes_the_accumulator() -> None:
    """A ring's own block covers every row: Partials.like adopts its (fresh) tensors instead of copying
    them, and later pieces merge into them; a piece in another dtype is copied (converted) instead.
    Both give the softmax over the union (fp64 reference)."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 2, 10, 8, generator=g, dtype=torch.float64)
    ks = [torch.randn(1, 2, 7, 8, generator=g, dtype=torch.float64) for _ in range(2)]
    vs = [torch.randn(1, 2, 7, 8, generator=g, dtype=torch.float64) for _ in range(2)]
    rows = [slice(0, 10), slice(3, 10)]
    want_all = _partial(q, torch.cat(ks, 2), torch.cat(vs, 2))
    want_top = _partial(q[:, :, :3], ks[0], vs[0])
    for piece_dtype in (torch.float32, torch.float64):
        acc = Partials.like(q.float(), torch.float32)
        first = None
        for r, k, v in zip(rows, ks, vs):
            o, lse = _partial(q[:, :, r], k, v)
            o, lse = o.to(piece_dtype), lse.to(piece_dtype)
            first = first if first is not None else o
            acc.add(r, o, lse)
        out, lse = acc.finish()
        assert out.dtype == torch.float32 and (out is first) == (piece_dtype == torch.float32)
        torch.testing.assert_close(out[:, :, 3:].double(), want_all[0][:, :, 3:], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(lse[:, :, 3:].double(), want_all[1][:, :, 3:], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(out[:, :, :3].double(), want_top[0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(lse[:, :, :3].double(), want_top[1], rtol=1e-6, atol=1e-6)
    empty = Partials.like(q.float(), torch.float32)  # no piece at all: zeros and -inf
    out, lse = empty.finish()
    assert torch.all(out == 0) and torch.all(torch.isneginf(lse))


def test_merge_edges_give_no_nan() -> None:
    """The empty partial (out 0, lse -inf) takes a block as it is; a block row with lse -inf leaves
    the accumulator as it is; a sink on an empty row gives out 0 and lse = sink."""
    out = torch.zeros(1, 2, 3, 4)
    lse = torch.full((1, 2, 3), float("-inf"))
    blk, blk_lse = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3)
    merge_into(out, lse, blk, blk_lse)
    assert torch.equal(out, blk) and torch.equal(lse, blk_lse)
    merge_into(out, lse, torch.zeros(1, 2, 3, 4), torch.full((1, 2, 3), float("-inf")))
    assert torch.equal(out, blk) and torch.equal(lse, blk_lse)
    # a row with lse -inf is left as it is whatever the block's out holds there (a kernel's value for a row
    # that saw no key is not promised to be 0); the other rows merge. Seen failing: the block's weight on
    # such a row filled with 1 instead of 0 (``masked_fill_(empty, 1.0)`` for w_blk in _merge_torch), which
    # the zero block above let through
    some = torch.tensor([float("-inf"), 0.3, float("-inf")]).expand(1, 2, 3)
    blk2 = torch.randn(1, 2, 3, 4)
    want_o = torch.where(torch.isneginf(some)[..., None], out, out * torch.sigmoid(lse - some)[..., None]
                         + blk2 * torch.sigmoid(some - lse)[..., None])
    want_lse = torch.logaddexp(lse, some)
    merge_into(out, lse, blk2, some.contiguous())
    torch.testing.assert_close(out, want_o, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse, want_lse)
    empty_o, empty_lse = torch.zeros(1, 2, 1, 4), torch.full((1, 2, 1), float("-inf"))
    add_sink(empty_o, empty_lse, torch.tensor([0.5, -1.0]))
    assert torch.equal(empty_o, torch.zeros(1, 2, 1, 4)) and torch.equal(empty_lse.flatten(), torch.tensor([0.5, -1.0]))


def test_sink_term_and_gradient_match_float64_autograd() -> None:
    g = torch.Generator().manual_seed(1)
    q, k, v, dout = (torch.randn(1, 3, 6, 4, generator=g, dtype=torch.float64) for _ in range(4))
    sink = torch.randn(3, generator=g, dtype=torch.float64, requires_grad=True)
    s = q @ k.transpose(-1, -2)
    p = torch.softmax(torch.cat([s, sink.view(1, 3, 1, 1).expand(1, 3, 6, 1)], -1), -1)[..., :-1]
    want = p @ v
    want.backward(dout)
    o, lse = _partial(q, k, v)
    add_sink(o, lse, sink.detach())
    torch.testing.assert_close(o, want.detach())
    torch.testing.assert_close(sink_grad(dout, o, lse, sink.detach()), sink.grad)


# ----------------------------------------------------------------------------- the fused merge
def _ulp(x: torch.Tensor) -> torch.Tensor:
    """fp32's ulp at |x| (float64 tensor)."""
    x = x.abs().float()
    return (torch.nextafter(x, torch.full_like(x, math.inf)) - x).double()


def merge64(out: torch.Tensor, lse: torch.Tensor, blk: torch.Tensor | None,
            blk_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The float64 merge of the given partials (``blk`` None: a sink, value 0): ``(out, lse, scale)``,
    ``scale`` per element the largest of |out| and the two terms of its sum (a sum's rounding is
    relative to its terms: where they cancel, no fp32 result is within an ulp of the result itself).
    Rows whose two lse are -inf keep their out and lse."""
    out, lse, c = out.double(), lse.double(), blk_lse.double().expand(lse.shape)
    blk = torch.zeros_like(out) if blk is None else blk.double()
    m = torch.maximum(lse, c)
    none = torch.isneginf(m)
    m0 = torch.where(none, 0.0, m)
    w_acc, w_blk = torch.exp(lse - m0), torch.exp(c - m0)
    total = w_acc + w_blk
    t_acc, t_blk = (w_acc / total).unsqueeze(-1) * out, (w_blk / total).unsqueeze(-1) * blk
    want = torch.where(none.unsqueeze(-1), out, t_acc + t_blk)
    want_lse = torch.where(none, m, m0 + torch.log(total))
    scale = torch.maximum(want.abs(), torch.maximum(t_acc.abs(), t_blk.abs())).nan_to_num(0.0)
    return want, want_lse, scale


def random_partials(g: torch.Generator, shape: tuple[int, ...], blk_dtype: torch.dtype,
                    device: str = "cpu") -> tuple[torch.Tensor, ...]:
    """fp32 accumulators and a block in ``blk_dtype``, lse spread over N(4, 3^2); along the rows, the
    accumulator's lse is -inf (out 0) in rows 0-2, the block's in rows 3-5 (out 0, as the kernels give
    a row that saw no key), both in rows 6-7."""
    out = torch.randn(shape, generator=g)
    lse = torch.randn(shape[:-1], generator=g) * 3 + 4
    blk = torch.randn(shape, generator=g).to(blk_dtype)
    blk_lse = torch.randn(shape[:-1], generator=g) * 3 + 4
    out[:, :, 0:3], lse[:, :, 0:3] = 0.0, -math.inf
    blk[:, :, 3:6], blk_lse[:, :, 3:6] = 0.0, -math.inf
    out[:, :, 6:8], lse[:, :, 6:8], blk[:, :, 6:8], blk_lse[:, :, 6:8] = 0.0, -math.inf, 0.0, -math.inf
    return tuple(t.to(device) for t in (out, lse, blk, blk_lse))


def assert_within_2_ulp(out: torch.Tensor, lse: torch.Tensor, want: tuple[torch.Tensor, ...], case: str) -> None:
    """``out`` within 2 ulp of its terms' scale, ``lse`` within 2 ulp of itself, -inf rows exact."""
    want_out, want_lse, scale = want
    err_out = ((out.double() - want_out).abs() / _ulp(scale)).nan_to_num(0.0)
    assert float(err_out.max()) <= 2.0, f"{case}: out off by {float(err_out.max()):.2f} ulp"
    finite = torch.isfinite(want_lse)
    assert torch.equal(torch.isneginf(lse), ~finite), case
    err_lse = (lse.double() - want_lse)[finite].abs() / _ulp(want_lse[finite])
    assert float(err_lse.max()) <= 2.0, f"{case}: lse off by {float(err_lse.max()):.2f} ulp"
    assert torch.isfinite(out).all(), case


def _layouts(out: torch.Tensor) -> dict[str, torch.Tensor]:
    """``out`` ``(b, h, n, d)`` as the accumulators the algorithms hand in: contiguous, a Hugging
    Face ``(b, n, h, d)`` buffer seen transposed, and a row range of a longer buffer."""
    b, h, n, d = out.shape
    bshd = out.transpose(1, 2).contiguous().transpose(1, 2)
    longer = torch.zeros(b, h, n + 5, d, dtype=out.dtype, device=out.device)
    longer.narrow(2, 2, n).copy_(out)
    return {"contiguous": out.clone(), "bshd": bshd, "rows-view": longer.narrow(2, 2, n)}


@pytest.mark.parametrize("chunk", [None, 40], ids=["default", "pieces"])
@pytest.mark.parametrize("blk_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_merge_within_2_ulp_of_float64(blk_dtype: torch.dtype, chunk: int | None,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """merge_into and add_sink against the float64 merge of the same fp32/``blk_dtype`` partials, on
    fresh random inputs with -inf rows on either side and both, into contiguous and strided
    accumulators, and 5-d ones (dilated attention's row groups); ``chunk`` 40 cuts the torch path into
    pieces of every kind (batch ranges, head ranges, row ranges of one head, single rows)."""
    if chunk is not None:
        monkeypatch.setattr(merge_mod, "_CPU_CHUNK", chunk)
    g = torch.Generator().manual_seed(29)
    for shape in [(2, 3, 37, 16), (1, 2, 9, 48), (2, 3, 2, 8), (3, 1, 2, 8)]:
        out, lse, blk, blk_lse = random_partials(g, shape, blk_dtype)
        want = merge64(out, lse, blk, blk_lse)
        for name, acc in _layouts(out).items():
            acc_lse = lse.clone()
            merge_into(acc, acc_lse, blk, blk_lse)
            assert_within_2_ulp(acc, acc_lse, want, f"{shape} {name}")
        sink = torch.randn(shape[1], generator=g).to(blk_dtype)
        acc, acc_lse = out.clone(), lse.clone()
        add_sink(acc, acc_lse, sink)
        assert_within_2_ulp(acc, acc_lse, merge64(out, lse, None, sink.view(1, -1, 1)), f"{shape} sink")
    out, lse, blk, blk_lse = random_partials(g, (2, 3, 10, 4, 8), blk_dtype)
    want = merge64(out, lse, blk, blk_lse)
    merge_into(out, lse, blk, blk_lse)
    assert_within_2_ulp(out, lse, want, "5-d")


def test_merge_makes_no_block_sized_temporary() -> None:
    """Every allocation inside merge_into, add_sink and Partials.add (CPU allocator events from
    torch.profiler, temporaries inside aten ops included) is at most the torch path's chunk in fp64,
    a quarter of the block's fp32 size: a bf16 block is never converted whole."""
    g = torch.Generator().manual_seed(3)
    shape = (2, 4, 512, 64)  # 1 MiB in fp32
    out, lse, blk, blk_lse = random_partials(g, shape, torch.bfloat16)
    block_fp32_bytes = blk.numel() * 4
    acc = Partials.like(out, torch.float32)
    acc.add(slice(0, 400), blk[:, :, :400], blk_lse[:, :, :400])  # a copy into fresh storage
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        merge_into(out, lse, blk, blk_lse)
        add_sink(out, lse, torch.randn(4, generator=g))
        acc.add(slice(100, 512), blk[:, :, 100:], blk_lse[:, :, 100:])  # merges rows 100-399, copies the rest
    allocs = [e.self_cpu_memory_usage for e in prof.events() if e.self_cpu_memory_usage > 0]
    assert allocs and max(allocs) <= min(merge_mod._CPU_CHUNK * 8, block_fp32_bytes // 4), sorted(allocs)[-5:]


def test_small_blocks_merge_in_few_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch path's pieces: a small block (a 128-row x 16-dim head-chunk piece of a short document)
    merges in one step, a large one still in pieces of 1/64 of it (its fp64 temporaries stay small), and
    both give the float64 merge. Seen failing: without the ``_CPU_MIN_PIECE`` floor the small block took
    64 steps of 2 rows (the Python steps were most of a short micro-batch's CPU time, BENCHMARKS.md)."""
    steps: list[int] = []
    pieces = merge_mod._pieces

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        out = list(pieces(*args, **kwargs))
        steps.append(len(out))
        return iter(out)

    monkeypatch.setattr(merge_mod, "_pieces", counted)
    g = torch.Generator().manual_seed(5)
    for shape, want_steps in (((1, 1, 128, 16), 1), ((1, 4, 1024, 64), 64)):
        out, lse, blk, blk_lse = random_partials(g, shape, torch.float32)
        want = merge64(out, lse, blk, blk_lse)
        steps.clear()
        merge_into(out, lse, blk, blk_lse)
        assert steps[-1] == want_steps, (shape, steps)  # the outermost call (it recurses) ends last
        assert_within_2_ulp(out, lse, want, f"{shape}")


def _interpreted_merge_triton(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN202
    """seqpar.kernels.merge_triton loaded afresh under ``TRITON_INTERPRET=1``: its kernel runs on CPU
    tensors in Triton's interpreter (where Triton is installed: torch's CUDA build, the fake-CUDA stage)."""
    pytest.importorskip("triton")
    pytest.importorskip("numpy")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    path = Path(merge_mod.__file__).with_name("merge_triton.py")
    spec = importlib.util.spec_from_file_location("seqpar_merge_triton_interpreted", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("blk_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_triton_kernel_in_the_interpreter_within_2_ulp(blk_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused CUDA kernel's own code (indexing, masks for the row and column tails, strides, the
    sink's broadcast lse, -inf rows) run by Triton's interpreter, against the float64 merge; head dims
    that are not powers of two leave masked columns, and 37 rows leave a masked row tail."""
    triton_merge = _interpreted_merge_triton(monkeypatch)
    g = torch.Generator().manual_seed(5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # numpy's -inf - -inf in the masked-off branch
        for shape in [(2, 3, 37, 24), (1, 2, 9, 64)]:
            out, lse, blk, blk_lse = random_partials(g, shape, blk_dtype)
            want = merge64(out, lse, blk, blk_lse)
            for name, acc in _layouts(out).items():
                acc_lse = lse.clone()
                triton_merge.launch_merge(acc, acc_lse, blk, blk_lse, kernel=triton_merge.merge_kernel)
                assert_within_2_ulp(acc, acc_lse, want, f"{shape} {name}")
            sink = torch.randn(shape[1], generator=g).to(blk_dtype)
            acc, acc_lse = out.clone(), lse.clone()
            triton_merge.launch_merge(acc, acc_lse, None, sink.view(1, -1, 1).expand(lse.shape),
                                      kernel=triton_merge.merge_kernel)
            assert_within_2_ulp(acc, acc_lse, merge64(out, lse, None, sink.view(1, -1, 1)), f"{shape} sink")


@pytest.mark.parametrize("arch", [80, 90])
def test_triton_kernel_compiles_for_the_gpu_without_approximations(arch: int) -> None:
    """The fused kernel compiled ahead of time (Triton's own compiler and ptxas, no GPU needed) for
    Ampere and Hopper, with a bf16 block and as a sink: it builds a cubin, and its PTX computes exp and
    log with libdevice's fp64 routines and divides in round-to-nearest (not the ``ex2.approx`` /
    ``lg2.approx`` Triton uses for fp32 ``exp`` / ``log``), rounding to fp32 once per store."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from seqpar.kernels.merge_triton import block_sizes, merge_kernel

    block_r, block_d = block_sizes(128)
    for blk_type, has_block_out in (("*bf16", True), ("*fp32", False)):
        signature = {name: "i32" for name in merge_kernel.arg_names}
        signature.update(out_ptr="*fp32", lse_ptr="*fp32", blk_ptr=blk_type, blk_lse_ptr="*fp32",
                         HAS_BLOCK_OUT="constexpr", BLOCK_R="constexpr", BLOCK_D="constexpr")
        source = ASTSource(fn=merge_kernel, signature=signature,
                           constexprs={"HAS_BLOCK_OUT": has_block_out, "BLOCK_R": block_r, "BLOCK_D": block_d})
        compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": 4})
        ptx = compiled.asm["ptx"]
        assert compiled.asm.get("cubin"), arch
        assert "__nv_exp" in ptx and "__nv_log" in ptx and "div.rn.f64" in ptx, arch
        assert "ex2.approx" not in ptx and "lg2.approx" not in ptx and "cvt.rn.f32.f64" in ptx, arch
