"""All-gather attention's collectives: what it gathers and reduce-scatters, counted at torch's entry points."""

from __future__ import annotations

import torch

import seqpar


def _collective_bytes_allgather(rank: int, world: int) -> dict:
    import seqpar.comm.compat as compat

    calls: list[tuple[str, int]] = []
    gather, scatter = compat._all_gather, compat._reduce_scatter

    def count_gather(out, inp, **kw):  # noqa: ANN001, ANN003, ANN202
        calls.append(("gather", inp.numel() * inp.element_size()))
        return gather(out, inp, **kw)

    def count_scatter(out, inp, **kw):  # noqa: ANN001, ANN003, ANN202
        calls.append(("scatter", out.numel() * out.element_size()))
        return scatter(out, inp, **kw)

    q = torch.randn(1, 4, 8, 16, requires_grad=True)
    k = torch.randn(1, 4, 8, 16, requires_grad=True)
    v = torch.randn(1, 4, 8, 16, requires_grad=True)
    compat._all_gather, compat._reduce_scatter = count_gather, count_scatter
    try:
        out = seqpar.attention(q, k, v, mode="allgather", check_inputs=False, head_chunks=1)
        fwd = list(calls)
        out.backward(torch.randn_like(out))
    finally:
        compat._all_gather, compat._reduce_scatter = gather, scatter
    return {"fwd": fwd, "bwd": calls[len(fwd):], "block": k.numel() * 4}


def test_allgather_volume(dist_pool) -> None:
    for got in dist_pool.run(2, _collective_bytes_allgather):
        b = got["block"]
        assert got["fwd"] == [("gather", b), ("gather", b)]  # K and V, once each
        # backward re-gathers K and V, then reduce-scatters fp32 dK and dV
        assert got["bwd"] == [("gather", b), ("gather", b), ("scatter", b), ("scatter", b)]
