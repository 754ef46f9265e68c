"""dK/dV on the wire (issue 29 §5): ``dkv_wire_dtype="fp32"`` (default, exact) or ``"bf16"``.

With ``"bf16"`` the ring backward's travelling dK/dV accumulators (ring, the hybrid's ring, dilated
attention's messages) are sent in bfloat16 and every hop adds its share in fp32, rounding once for the
next hop. Checked here against a float64 reference on the full sequence:

- out and dq are untouched (exact to fp32), dk and dv within ``(P - 1) * 2**-9`` norm-relative (at most
  P - 1 roundings to bf16, unit roundoff 2**-9) and, to show the rounding really happens, at least
  ``2**-12`` (the fp32 wire: ~2e-7);
- every dK/dV message is bf16 and the dK/dV bytes are half the fp32 wire's, equal to theory; the K/V
  messages are unchanged;
- bad values, and ``"bf16"`` with modes that move no dK/dV accumulators, are refused by name on every rank.

The in-process tests run the ring code on P virtual ranks (:class:`~seqpar.comm.ring.ThreadRing`); one
4-rank gloo run covers the public API (ring and hybrid), dilated attention (both modes), the bytes at
torch's entry points and the errors.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from test_attention import make_case, reference, rel_err, shard_rows, unshard_rows

import seqpar
from seqpar.attn.ring import AttentionOptions, ring_attention_backward, ring_forward
from seqpar.comm.ring import ThreadRing
from seqpar.config import ConfigError, SeqParConfig
from seqpar.testing.traffic import counting

DKV_CHANNELS = (1, 2)  # seqpar.attn.ring's channels of the travelling and the homecoming accumulators
BF16_BOUND = 2.0 ** -9  # bf16's unit roundoff: one rounding per hop, at most P - 1 hops
ROUNDED = 2.0 ** -12  # below this, no bf16 rounding happened (the fp32 wire gives ~2e-7)


class RecordingRing:
    """A ThreadRing rank's communicator that records the dtype and bytes of every message it sends."""

    def __init__(self, inner) -> None:  # noqa: ANN001
        self.inner, self.rank, self.world_size = inner, inner.rank, inner.world_size
        self.sent: dict[tuple[int, torch.dtype], int] = {}  # (channel, dtype) -> bytes

    @property
    def bytes_sent(self) -> int:
        return self.inner.bytes_sent

    def exchange(self, tensors, out=None, *, channel=0, shift=1, send=True, recv=True):  # noqa: ANN001, ANN201
        if send:
            for t in tensors:
                key = (channel, t.dtype)
                self.sent[key] = self.sent.get(key, 0) + t.numel() * t.element_size()
        return self.inner.exchange(tensors, out, channel=channel, shift=shift, send=send, recv=recv)


def doc_reference(case: dict, cu_seqlens: tuple[int, ...]) -> list[torch.Tensor]:
    """Causal attention inside packed documents, float64, as an explicit mask."""
    seq = case["q"].shape[2]
    doc = torch.bucketize(torch.arange(seq), torch.tensor(cu_seqlens[1:-1]), right=True)
    mask = (doc[:, None] == doc[None, :]) & torch.ones(seq, seq, dtype=torch.bool).tril()
    q, k, v = (case[n].clone().requires_grad_() for n in "qkv")
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25, enable_gqa=True)
    out.backward(case["dout"])
    return [out.detach(), q.grad, k.grad, v.grad]


def _ring_run(world: int, case: dict, opts: AttentionOptions) -> tuple[list[torch.Tensor], dict]:
    """The ring on ``world`` virtual ranks in fp32: gathered out, dq, dk, dv and the messages sent."""
    sent: dict = {}

    def body(comm):  # noqa: ANN001, ANN202
        rec = RecordingRing(comm)
        q, k, v, dout = (shard_rows(case[n], comm.rank, world, opts.sharding).float() for n in ("q", "k", "v", "dout"))
        out_acc, lse = ring_forward(q, k, v, rec, opts)
        out = out_acc.to(q.dtype)
        before = dict(rec.sent)
        grads = ring_attention_backward(dout, q, k, v, out, lse, rec, opts)
        for key, n in rec.sent.items():
            sent[key] = sent.get(key, 0) + n - before.get(key, 0)  # backward only (the GIL makes += safe enough)
        return [out, *grads]

    per_rank = ThreadRing(world).run(body)
    got = [unshard_rows([per_rank[r][j] for r in range(world)], world, opts.sharding) for j in range(4)]
    return got, sent


@pytest.mark.parametrize("sharding, causal, head_chunks, docs", [
    ("zigzag", True, 1, None), ("contiguous", False, 2, None), ("contiguous", True, 1, (0, 5, 30, 48)),
])
def test_bf16_wire_ring_error_bytes_and_dtype(sharding: str, causal: bool, head_chunks: int, docs: tuple | None) -> None:
    """P = 4 virtual ranks, GQA 4/2 heads: the fp32 wire exact, the bf16 wire within its bound, every
    dK/dV message bf16 and half the bytes (documents: blocks stop early and go home with a shift)."""
    world = 4
    case = make_case(29 + head_chunks, world, (4, 2, 16), batch=1)
    want = doc_reference(case, docs) if docs else reference(case, causal, 0.25)
    runs = {}
    for wire in ("fp32", "bf16"):
        opts = AttentionOptions(causal=causal, scale=0.25, sharding=sharding, head_chunks=head_chunks,
                                cu_seqlens=docs, dkv_wire_dtype=wire)
        runs[wire] = _ring_run(world, case, opts)
    for wire, (got, _) in runs.items():
        errs = {name: rel_err(g, w) for name, g, w in zip(("out", "dq", "dk", "dv"), got, want)}
        assert errs["out"] < 1e-6 and errs["dq"] < 1e-6, (wire, errs)
        if wire == "fp32":
            assert errs["dk"] < 1e-6 and errs["dv"] < 1e-6, errs
        else:
            for name in ("dk", "dv"):
                assert ROUNDED < errs[name] <= (world - 1) * BF16_BOUND, (name, errs)
    fp32, bf16 = runs["fp32"][1], runs["bf16"][1]
    assert {dt for (ch, dt) in bf16 if ch in DKV_CHANNELS} == {torch.bfloat16}, bf16
    assert {dt for (ch, dt) in fp32 if ch in DKV_CHANNELS} == {torch.float32}, fp32
    kv_bytes = {ch: n for (ch, dt), n in fp32.items() if ch not in DKV_CHANNELS}
    assert kv_bytes == {ch: n for (ch, dt), n in bf16.items() if ch not in DKV_CHANNELS}  # K/V unchanged
    dkv = {wire: sum(n for (ch, _), n in sent.items() if ch in DKV_CHANNELS) for wire, sent in (("fp32", fp32), ("bf16", bf16))}
    assert dkv["bf16"] * 2 == dkv["fp32"] > 0, dkv
    if docs is None:  # dense: every rank sends P - 1 dK/dV pairs of one block (batch 1, 2 kv heads, 12 rows, 16)
        assert dkv["fp32"] == world * (world - 1) * 2 * (1 * 2 * 12 * 16) * 4, dkv


def test_config_dkv_wire_dtype() -> None:
    """The config key: default fp32, bf16 accepted and carried to the swap's options; bad values and bf16
    with a mode that moves no accumulators refused by name (no process group needed)."""
    from seqpar.swap.options import SwapOptions

    assert SeqParConfig.from_dict({"size": 2}).dkv_wire_dtype == "fp32"
    config = SeqParConfig.from_dict({"sequence_parallel": {"size": 2, "mode": "hybrid", "dkv_wire_dtype": "bf16"}})
    assert SwapOptions.from_config(config, None).dkv_wire_dtype == "bf16"
    dilated = {"type": "dilated", "segment_lengths": [8], "dilation_rates": [1]}
    assert SeqParConfig.from_dict({"mode": "allgather", "pattern": dilated, "dkv_wire_dtype": "bf16"})  # p2p there
    for block, words in (({"dkv_wire_dtype": "fp16"}, ("dkv_wire_dtype", "fp16", "bf16")),
                         ({"dkv_wire_dtype": "bfloat16"}, ("dkv_wire_dtype", '"fp32"')),
                         ({"dkv_wire_dtype": 16}, ("dkv_wire_dtype",)),
                         ({"mode": "allgather", "dkv_wire_dtype": "bf16"}, ("dkv_wire_dtype", "allgather", '"ring"')),
                         ({"mode": "ulysses", "dkv_wire_dtype": "bf16"}, ("dkv_wire_dtype", "ulysses"))):
        with pytest.raises(ConfigError) as e:
            SeqParConfig.from_dict({"size": 2, **block})
        assert all(w in str(e.value) for w in words), str(e.value)


# ------------------------------------------------------------------------------ 4 gloo ranks
BAD = ({"dkv_wire_dtype": "fp16"}, {"dkv_wire_dtype": "float32"}, {"dkv_wire_dtype": torch.bfloat16},
       {"dkv_wire_dtype": "bf16", "mode": "allgather"}, {"dkv_wire_dtype": "bf16", "mode": "ulysses"})
DILATED = {"segment_lengths": (8, 32), "dilation_rates": (1, 2)}  # the second spans all 4 ranks of 8 rows


def wire_body(rank: int, world: int, case: dict) -> dict:
    """Worker body: the public API's ring and hybrid (2 x 2), and dilated attention in both modes, with
    each wire dtype (their shards of out/dq/dk/dv and the p2p bytes of forward and backward); then the
    errors of every bad value."""
    from seqpar.attn.dilated import dilated_attention

    seqpar.init_process_groups(sp_size=world, ulysses_size=2)
    runs = {}
    for kind, wire in itertools.product(("ring", "hybrid", "dilated-ring", "dilated-allgather"), ("fp32", "bf16")):
        sharding = "contiguous" if kind.startswith("dilated") else "zigzag"
        q, k, v, dout = (shard_rows(case[n], rank, world, sharding).float() for n in ("q", "k", "v", "dout"))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        with counting(world) as sent:
            if kind.startswith("dilated"):
                out = dilated_attention(q, k, v, **DILATED, causal=True, mode=kind.split("-")[1],
                                        dkv_wire_dtype=wire)
            else:
                out = seqpar.attention(q, k, v, causal=True, mode=kind, sharding=sharding, dkv_wire_dtype=wire)
            fwd = sent.p2p_bytes
            out.backward(dout)
        runs[kind, wire] = {"grads": [out.detach(), q.grad, k.grad, v.grad], "fwd": fwd, "bwd": sent.p2p_bytes - fwd}
    errors = []
    q, k, v = (shard_rows(case[n], rank, world, "zigzag").float() for n in "qkv")
    for kwargs in BAD:
        try:
            seqpar.attention(q, k, v, causal=True, sharding="zigzag", **{"mode": "ring", **kwargs})
            errors.append("no error")
        except ValueError as e:
            errors.append(str(e))
    try:
        dilated_attention(q, k, v, **DILATED, dkv_wire_dtype="fp16")
        errors.append("no error")
    except ValueError as e:
        errors.append(str(e))
    check = torch.ones(1)
    dist.all_reduce(check)  # every rank is still in step
    return {"runs": runs, "errors": errors, "in_step": check.item() == world}


def dilated_bytes(rank: int, mode: str, wire: str) -> tuple[int, int]:
    """(forward, backward) p2p bytes one rank sends for :data:`DILATED`, causal, by hand: the (8, 1)
    pattern lies inside a shard (nothing sent); the (32, 2) one spans all c = 4 ranks, rank i is member i.
    A member's K/V block, per offset o in {0, 1}: the query heads h = o, o + 2 read kv heads 0 and 1
    (GQA 4 / 2), the member holds 8 / 2 = 4 rows at o, so B = 2 offsets x (K, V) x batch 2 x 2 kv heads x
    4 rows x 16 = 1024 values. Causal chain (ring): member i forwards blocks 0..i to i + 1 (none from the
    last); all-gather: its own block to the 3 - i later members. Backward: the same K/V again, and the
    dK/dV of the i blocks it attends that are not its own (ring: each travels one hop per visitor, a
    member sends i of them; all-gather: i shares, one to each owner), in the wire's dtype."""
    block, kv_bytes, dkv_bytes = 1024, 4, 4 if wire == "fp32" else 2
    hops = (rank + 1 if rank < 3 else 0) if mode == "ring" else 3 - rank
    return hops * block * kv_bytes, hops * block * kv_bytes + rank * block * dkv_bytes


def test_public_api_hybrid_dilated_bytes_and_errors(dist_pool) -> None:
    """Ring, hybrid and dilated (both modes) through the public API, each wire: results against float64 on
    the full sequence (dilated: :func:`test_dilated.dilated_reference`), bytes per rank against hand-written
    theory (ring, hybrid: hops x K/V and dK/dV blocks; dilated: :func:`dilated_bytes`).

    Seen failing (2026-11-29, in seqpar/attn/dilated.py's all-gather backward, the dK/dV shares sent twice and
    the copies added, ``shares += shares`` with ``back`` doubled): passed when dilated was judged against its
    own fp32 wire and its bytes as the ratio of the two wires; fails on the float64 reference and on the bytes.
    Sending them twice but adding once fails on the bytes alone."""
    from test_dilated import dilated_reference

    world, seq_local, d = 4, 8, 16
    g = torch.Generator().manual_seed(2911)
    case = {n: torch.randn(2, 4 if n in ("q", "dout") else 2, world * seq_local, d, generator=g, dtype=torch.float64)
            for n in ("q", "k", "v", "dout")}
    per_rank = dist_pool.run(world, wire_body, case, timeout=240)
    want = reference(case, True, None)
    q, k, v = (case[n].clone().requires_grad_() for n in "qkv")
    out = dilated_reference(q, k, v, DILATED["segment_lengths"], DILATED["dilation_rates"], causal=True)
    out.backward(case["dout"])
    want_dilated = [out.detach(), q.grad, k.grad, v.grad]
    kv_numel = 2 * 2 * seq_local * d  # one rank's K (batch 2, 2 kv heads)
    for kind in ("ring", "hybrid", "dilated-ring", "dilated-allgather"):
        sharding = "contiguous" if kind.startswith("dilated") else "zigzag"
        got = {wire: [unshard_rows([per_rank[r]["runs"][kind, wire]["grads"][j] for r in range(world)], world, sharding)
                      for j in range(4)] for wire in ("fp32", "bf16")}
        base = want if not kind.startswith("dilated") else want_dilated
        for j, name in enumerate(("out", "dq", "dk", "dv")):
            e32, e16 = rel_err(got["fp32"][j], base[j]), rel_err(got["bf16"][j], base[j])
            assert e32 < 1e-6, (kind, name, e32)
            if name in ("out", "dq"):
                assert e16 < 1e-6, (kind, name, e16)
            else:
                assert ROUNDED < e16 <= (world - 1) * BF16_BOUND, (kind, name, e16)
        for r in range(world):
            runs = per_rank[r]["runs"]
            fwd, b32, b16 = runs[kind, "fp32"]["fwd"], runs[kind, "fp32"]["bwd"], runs[kind, "bf16"]["bwd"]
            assert runs[kind, "bf16"]["fwd"] == fwd  # the forward is untouched
            # the backward resends the forward's K/V (fp32 inputs); the rest is dK/dV, halved on the bf16 wire
            assert b32 - fwd == 2 * (b16 - fwd), (kind, r, fwd, b32, b16)
            if kind == "ring":  # P - 1 K/V pairs, and P - 1 dK/dV pairs of 4 (fp32) or 2 (bf16) bytes
                assert (fwd, b32, b16) == (3 * 2 * kv_numel * 4, 3 * 2 * kv_numel * 8, 3 * 2 * kv_numel * 6)
            if kind == "hybrid":  # the ring over 2 super-ranks: one hop of a block as big as this rank's K/V
                assert (fwd, b32, b16) == (2 * kv_numel * 4, 2 * kv_numel * 8, 2 * kv_numel * 6)
            if kind.startswith("dilated"):
                mode = kind.split("-")[1]
                assert (fwd, b32) == dilated_bytes(r, mode, "fp32"), (kind, r, fwd, b32)
                assert (fwd, b16) == dilated_bytes(r, mode, "bf16"), (kind, r, fwd, b16)
        dkv_bytes = [per_rank[r]["runs"][kind, "bf16"]["bwd"] - per_rank[r]["runs"][kind, "bf16"]["fwd"]
                     for r in range(world)]
        assert sum(dkv_bytes) > 0, (kind, dkv_bytes)  # (causal dilated: rank 0's block is no one else's)
    for r in range(world):
        errors = per_rank[r]["errors"]
        assert per_rank[r]["in_step"], r
        assert "no error" not in errors, (r, errors)
        assert all("dkv_wire_dtype" in e for e in errors), errors
        assert "fp16" in errors[0] and "underflow" in errors[0], errors[0]
        assert '"fp32"' in errors[1] and "fp16" in errors[5], errors
        assert "allgather" in errors[3] and "ulysses" in errors[4] and "mode='ring'" in errors[3], errors


def test_bf16_wire_mla_latent_ring() -> None:
    """MLA's latent ring (the compressed block's gradients travel, :mod:`seqpar.attn.latent`), float64 data:
    with the bf16 wire dc and dr carry its rounding and the accumulators' bytes shrink 4x (8 -> 2 bytes);
    out, dq and kv_b_proj's weight gradient (summed where the shares are made) stay exact."""
    from test_mla_latent import DIMS
    from test_mla_latent import make_case as mla_case
    from test_mla_latent import reference as mla_reference

    from seqpar.attn.latent import LatentRingAttention

    world, seq, sharding = 4, 48, "zigzag"
    case = mla_case(5, seq)
    want = mla_reference(case, True, None, None)
    block = seq // world * DIMS.latent_width  # one rank's latent (c, r) values
    for wire in ("fp32", "bf16"):
        opts = AttentionOptions(causal=True, scale=0.3, sharding=sharding, dkv_wire_dtype=wire)

        def body(comm, opts=opts):  # noqa: ANN001, ANN202
            q, c, r, dout = (shard_rows(case[n], comm.rank, world, sharding).clone().requires_grad_()
                             for n in ("q", "c", "r", "dout"))
            w = case["w"].clone().requires_grad_()
            out = LatentRingAttention.apply(q, c, r, w, comm, opts, DIMS, None)
            return [out.detach(), *torch.autograd.grad(out, [q, c, r, w], dout.detach())], comm.bytes_sent

        results = ThreadRing(world, timeout=60).run(body)
        for j, name in enumerate(("out", "dq", "dc", "dr", "dw")):
            parts = [res[0][j] for res in results]
            got = sum(parts) if name == "dw" else unshard_rows(parts, world, sharding)
            err = rel_err(got, want[j])
            if wire == "bf16" and name in ("dc", "dr"):
                assert ROUNDED < err <= (world - 1) * BF16_BOUND, (name, err)
            else:
                assert err < 1e-12, (wire, name, err)
        dkv_bytes = (world - 1) * block * (8 if wire == "fp32" else 2)
        assert all(res[1] == 2 * (world - 1) * block * 8 + dkv_bytes for res in results), [res[1] for res in results]


def test_the_custom_ops_carry_the_option(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torch.compile the ring runs as custom ops whose options travel as flat arguments
    (:mod:`seqpar.attn.ops`): forward and backward rebuild the very options they were given, the wire
    dtype included (one process, the planner's single rank, called eagerly)."""
    import seqpar.attn.ops as ops

    seen = []
    forward, backward = ops.ring_attention_forward, ops.ring_attention_backward

    def spy_forward(q, k, v, comm, opts, sinks=None):  # noqa: ANN001, ANN202
        seen.append(opts)
        return forward(q, k, v, comm, opts, sinks)

    def spy_backward(dout, q, k, v, out, lse, comm, opts):  # noqa: ANN001, ANN202
        seen.append(opts)
        return backward(dout, q, k, v, out, lse, comm, opts)

    monkeypatch.setattr(ops, "ring_attention_forward", spy_forward)
    monkeypatch.setattr(ops, "ring_attention_backward", spy_backward)
    opts = AttentionOptions(causal=True, scale=0.25, window=4, dkv_wire_dtype="bf16")
    q, k, v = (torch.randn(1, 2, 12, 8, requires_grad=True) for _ in range(3))
    ops.compiled_attention("single", None, opts, q, k, v, None).sum().backward()
    assert seen == [opts, opts], seen


def test_bf16_wire_rounds_once_per_hop() -> None:
    """Each hop adds its fp32 share to the bf16 accumulator in fp32 and rounds once, never rounding the
    share first. P = 4 virtual ranks, all scores 0 (q = 0: every weight 1/16), dout's last column (``e``)
    +1 on rank 1's rows, -1 + 2**-12 on rank 2's, 0 elsewhere: block 0's dV accumulator starts at rank 1
    with the bf16-exact 0.5 (two query heads on the K/V head), and rank 2's share cancels it to 0.5 * 2**-12,
    which one rounding keeps. dv[..., e] of block 0's keys against float64 (2**-13) at its own scale.

    Seen failing: the share rounded to the wire dtype before the add (``.add_(self.dk.to(dk_acc.dtype))``
    and the same for dv in ``_BlockShare.add_to``): 0 instead of 2**-13, within the norm bound of the test
    above."""
    world, n = 4, 4
    g = torch.Generator().manual_seed(3)
    seq = world * n
    case = {"q": torch.zeros(1, 2, seq, 8, dtype=torch.float64),
            "k": torch.randn(1, 1, seq, 8, generator=g, dtype=torch.float64),
            "v": torch.randn(1, 1, seq, 8, generator=g, dtype=torch.float64),
            "dout": torch.randn(1, 2, seq, 8, generator=g, dtype=torch.float64).float().double()}
    case["dout"][..., -1] = 0.0
    case["dout"][:, :, n:2 * n, -1] = 1.0
    case["dout"][:, :, 2 * n:3 * n, -1] = -1.0 + 2.0 ** -12
    opts = AttentionOptions(causal=False, scale=0.25, sharding="contiguous", dkv_wire_dtype="bf16")
    got, _ = _ring_run(world, case, opts)
    want = reference(case, False, 0.25)[3]
    col, want_col = got[3][:, :, :n, -1].double(), want[:, :, :n, -1]
    torch.testing.assert_close(want_col, torch.full_like(want_col, 2.0 ** -13))  # the construction holds
    torch.testing.assert_close(col, want_col, rtol=0, atol=2.0 ** -5 * 2.0 ** -13)
