"""The LSE merge (seqpar.kernels.merge) against float64 softmax over the union of key sets."""

from __future__ import annotations

import torch

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
