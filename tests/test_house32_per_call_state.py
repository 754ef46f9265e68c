"""State of one forward travels with the call, at the attention Functions (the brief: "two forwards before one
backward must work"): two forwards of seqpar's ring attention with different packed-document boundaries (and, for
MLA's latent ring, one shared ``kv_b_proj`` weight, as a DPO step's two passes share it), then their backwards
together, in forward order and in reverse order. Every output and gradient equals a float64 one-process attention
of each batch on the full sequence (the shared weight's gradient: the sum of both batches'). P virtual ranks in
threads (ThreadRing), zigzag, causal, in float64.

tests/test_per_call_state.py covers the same property for the swapped models (every mixer family and the
attention route under activation checkpointing); this file covers what a backward reads from its forward below
the swap: the boundaries and options (``ctx.opts``), and the MLA expander that accumulates the weight's gradient.

Seen failing (planted: the audit found no real bug, see reports/house32b.md): (1) seqpar/attn/common.py's
``function_backward`` reading the options (boundaries) of the *last* forward from a module global instead of
``ctx.opts``: batch 0's dq failed in all three orders at P=2 and P=3; (2) seqpar/attn/latent.py's backward reusing
one MLAExpander per weight (a dict keyed on ``id(weight)``, so its ``grad_weight`` runs on into the next backward):
the shared weight's ``dw`` failed in all three orders at P=2 and P=3 (the second backward returned both batches'
terms)."""

from __future__ import annotations

import pytest
import torch
from test_attention import shard_rows, unshard_rows
from test_documents import boundaries
from test_documents import make_case as attention_case
from test_documents import reference as attention_reference
from test_mla_latent import DIMS
from test_mla_latent import make_case as latent_case
from test_mla_latent import reference as latent_reference

from seqpar.attn.common import AttentionOptions
from seqpar.attn.latent import LatentRingAttention
from seqpar.attn.ring import RingAttention
from seqpar.comm.ring import ThreadRing

ORDERS = ("together", "in_order", "reversed")
SHARDING = "zigzag"


def _backward(outs: list[torch.Tensor], douts: list[torch.Tensor], order: str) -> None:
    """The two forwards' backwards: one call over both (autograd runs the later forward's first), or one after
    the other in forward order, or in reverse order."""
    if order == "together":
        torch.autograd.backward(outs, douts)
    else:
        pairs = list(zip(outs, douts, strict=True))
        for out, dout in pairs if order == "in_order" else pairs[::-1]:
            out.backward(dout)


def _options(cu: list[int], scale: float) -> AttentionOptions:
    return AttentionOptions(causal=True, scale=scale, sharding=SHARDING, cu_seqlens=tuple(cu))


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Exact to float64 rounding, on the tensor's own scale."""
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10 * max(1.0, want.abs().max().item()),
                               msg=lambda s: f"{what}: {s}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("order", ORDERS)
def test_ring_two_forwards_before_their_backwards(world: int, order: str) -> None:
    """Expanded K/V: out, dq, dk, dv of each of two batches (boundary variants 0 and 1 of the same length)."""
    cases = [attention_case(7 * world + i, world, (4, 2, 8), mode="ring", sharding=SHARDING, causal=True,
                            window=None, docs=i, sinks=False) for i in range(2)]
    assert cases[0]["cu"] != cases[1]["cu"]

    def body(comm):  # noqa: ANN001, ANN202
        leaves, outs, douts = [], [], []
        for case in cases:
            q, k, v = (shard_rows(case[n], comm.rank, world, SHARDING).clone().requires_grad_() for n in "qkv")
            outs.append(RingAttention.apply(q, k, v, comm, _options(case["cu"], case["scale"])))
            douts.append(shard_rows(case["dout"], comm.rank, world, SHARDING))
            leaves.append((q, k, v))
        _backward(outs, douts, order)
        return [[out.detach(), *(t.grad for t in qkv)] for out, qkv in zip(outs, leaves, strict=True)]

    per_rank = ThreadRing(world, timeout=60).run(body)
    for i, case in enumerate(cases):
        for j, (name, want) in enumerate(zip(("out", "dq", "dk", "dv"), attention_reference(case), strict=True)):
            got = unshard_rows([per_rank[r][i][j] for r in range(world)], world, SHARDING)
            _close(got, want, f"P={world} {order} batch {i} {name}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("order", ORDERS)
def test_latent_ring_two_forwards_share_one_weight(world: int, order: str) -> None:
    """MLA latent ring: out, dq, dc, dr of each batch, and the shared ``kv_b_proj`` weight's gradient (summed over
    ranks, each holding its rows' share) equal to the sum of both batches' float64 gradients."""
    seq = 12 * 2 * world
    cus = [boundaries(seq, world, i) for i in range(2)]
    cases = [latent_case(11 * world + i, seq) for i in range(2)]
    cases[1]["w"] = cases[0]["w"]  # one layer's weight, read by both forwards
    wants = [latent_reference(case, True, None, cu) for case, cu in zip(cases, cus, strict=True)]

    def body(comm):  # noqa: ANN001, ANN202
        w = cases[0]["w"].clone().requires_grad_()
        leaves, outs, douts = [], [], []
        for case, cu in zip(cases, cus, strict=True):
            q, c, r = (shard_rows(case[n], comm.rank, world, SHARDING).clone().requires_grad_() for n in "qcr")
            outs.append(LatentRingAttention.apply(q, c, r, w, comm, _options(cu, 0.3), DIMS, None))
            douts.append(shard_rows(case["dout"], comm.rank, world, SHARDING))
            leaves.append((q, c, r))
        _backward(outs, douts, order)
        return [[out.detach(), *(t.grad for t in qcr)] for out, qcr in zip(outs, leaves, strict=True)], w.grad

    results = ThreadRing(world, timeout=60).run(body)
    for i, want in enumerate(wants):
        for j, name in enumerate(("out", "dq", "dc", "dr")):
            got = unshard_rows([results[r][0][i][j] for r in range(world)], world, SHARDING)
            _close(got, want[j], f"P={world} {order} batch {i} {name}")
    _close(sum(res[1] for res in results), wants[0][4] + wants[1][4], f"P={world} {order} dw (both batches)")
