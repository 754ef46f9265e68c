"""The local block kernels (:mod:`seqpar.kernels.local`), one call at a time, against float64 autograd.

The distributed tests reach these kernels through the ring's head chunks, which on CPU hand each call
``kv_heads / head_chunks`` K/V heads ("auto": the largest divisor of the K/V heads up to 4, so one K/V head
for every head count those tests use). A GQA call with several K/V heads *and* several query heads per K/V
head, the only kind where it matters which K/V head a query head reads and which query heads' dK/dV add up,
is never made there on CPU. Here it is: 6 query heads on 2 K/V heads (a group of 3, odd), on the CPU kernel
and on the math kernel (the soft-capped path), causal and not, a query block shorter than its key block, and
V's head dim unlike Q/K's (MLA). out, lse, dq, dk and dv each against its own float64 reference scale.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from seqpar.kernels import block_backward, block_forward

# (q_heads, kv_heads, head_dim, v_head_dim, len_q, len_k, causal): the causal mask is top-left aligned,
# so its blocks are square (what the planners hand in)
SHAPES = (
    (6, 2, 12, 12, 7, 7, True),
    (6, 2, 12, 12, 5, 9, False),
    (6, 2, 16, 8, 6, 6, True),
    (4, 4, 8, 8, 5, 5, True),
    (3, 1, 8, 8, 4, 6, False),
)


def reference(q, k, v, dout, scale, causal, softcap):  # noqa: ANN001, ANN201
    """float64 out, lse, dq, dk, dv from the definition: query head h reads K/V head h // group."""
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    s = q @ k.repeat_interleave(group, 1).transpose(-1, -2) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(s, -1)
    out = torch.softmax(s, -1) @ v.repeat_interleave(group, 1)
    out.backward(dout.double())
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def assert_close_to_scale(name: str, got: torch.Tensor, want: torch.Tensor, label: object) -> None:
    """Within 1e-5 of ``want``'s own largest magnitude (fp32 kernels against float64)."""
    scale = want.abs().max().item()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * scale,
                               msg=lambda s: f"{name} {label} (scale {scale:.3g}): {s}")


@pytest.mark.parametrize("softcap", [None, 1.7], ids=["cpu_kernel", "math_softcap"])
def test_gqa_blocks_match_float64(softcap: float | None) -> None:
    """Seen failing: the math kernel's GQA fold summing dK/dV over the wrong query heads
    (``dx.reshape(b, group, hg // group, n, d).sum(dim=1)`` in ``_fold_kv_grad``: dk, dv off) and its K/V
    expansion tiling the heads instead of repeating each (``x.repeat(1, group, 1, 1)`` in ``_expand_kv``:
    out off); both passed every CPU test of the attention modes (test_chunked_softcap's GQA softcap cases
    included: their calls hold one K/V head). And its causal mask shifted by one (``triu(2)``)."""
    g = torch.Generator().manual_seed(2026)
    for i, (hq, hkv, d, dv, lq, lk, causal) in enumerate(SHAPES):
        q = torch.randn(2, hq, lq, d, generator=g)
        k = torch.randn(2, hkv, lk, d, generator=g)
        v = torch.randn(2, hkv, lk, dv, generator=g)
        dout = torch.randn(2, hq, lq, dv, generator=g)
        scale = 0.4 if i % 2 else d ** -0.5
        out, lse = block_forward(q, k, v, scale=scale, causal=causal, softcap=softcap)
        assert lse.dtype == torch.float32
        grads = block_backward(dout, q, k, v, out, lse, scale=scale, causal=causal, softcap=softcap)
        label = dict(heads=(hq, hkv), dims=(d, dv), lens=(lq, lk), causal=causal, softcap=softcap)
        for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads),
                                   reference(q, k, v, dout, scale, causal, softcap), strict=True):
            assert got.shape == want.shape, (name, label)
            assert_close_to_scale(name, got, want, label)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_inputs_keep_lse_in_fp32(dtype: torch.dtype) -> None:
    """lse comes back in fp32 for half inputs, and within fp32 rounding of the float64 one from the same
    (rounded) inputs: the ring merges on it, so a half-precision lse would weigh every block wrongly.

    Seen failing: ``lse.to(q.dtype)`` in block_forward's CPU branch (also killed, less directly, by
    test_low_precision_ring)."""
    g = torch.Generator().manual_seed(7)
    for (hq, hkv, d, dv, lq, lk, causal), softcap in itertools.product(SHAPES[:2], (None, 1.7)):
        q, k, v = (torch.randn(1, h, n, e, generator=g).to(dtype) for h, n, e in ((hq, lq, d), (hkv, lk, d), (hkv, lk, dv)))
        _, lse = block_forward(q, k, v, scale=d ** -0.5, causal=causal, softcap=softcap)
        assert lse.dtype == torch.float32, (dtype, softcap)
        _, want, *_ = reference(q, k, v, torch.zeros(1, hq, lq, dv), d ** -0.5, causal, softcap)
        assert_close_to_scale("lse", lse, want, (dtype, softcap, causal))


@pytest.mark.parametrize("softcap", [None, 1.7], ids=["cpu_kernel", "math_softcap"])
def test_fp64_inputs_keep_fp64(softcap: float | None) -> None:
    """fp64 inputs: lse and every output in fp64, equal to the reference to 1e-12 (the accumulators the
    attention modes build on them are fp64 too: ``lse_dtype``).

    Seen failing: ``lse_dtype`` returning fp32 for every input dtype."""
    g = torch.Generator().manual_seed(5)
    hq, hkv, d, dv, lq, lk, causal = SHAPES[0]
    q, k, v = (torch.randn(1, h, n, e, generator=g, dtype=torch.float64) for h, n, e in ((hq, lq, d), (hkv, lk, d), (hkv, lk, dv)))
    dout = torch.randn(1, hq, lq, dv, generator=g, dtype=torch.float64)
    out, lse = block_forward(q, k, v, scale=d ** -0.5, causal=causal, softcap=softcap)
    grads = block_backward(dout, q, k, v, out, lse, scale=d ** -0.5, causal=causal, softcap=softcap)
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads),
                               reference(q, k, v, dout, d ** -0.5, causal, softcap), strict=True):
        assert got.dtype == torch.float64, name
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=lambda s, n=name: f"{n}: {s}")
