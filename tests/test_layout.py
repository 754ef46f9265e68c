"""The attention entry's API points (issue 18): ``layout="bshd"`` equals ``"bhsd"`` in every mode, an
ambiguous layout is refused on every rank, a declared sharding binds, and a call is resolved once."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import seqpar
from seqpar.sequence.sharding import gather_sequence, shard_sequence

# (world, sp, ulysses_size, mode): every mode, world 1, 2 and 4 (hybrid needs 4 as 2 x 2)
MODES = [
    (1, 1, 1, "ring"), (2, 2, 1, "ring"), (2, 2, 1, "allgather"), (2, 2, 1, "ulysses"), (2, 2, 1, "auto"),
    (4, 4, 2, "hybrid"), (4, 4, 1, "ring"), (4, 4, 2, "auto"),
]
HEADS = (4, 2, 6)  # GQA, odd head dim


def _case(world: int, seed: int = 0) -> dict[str, torch.Tensor]:
    hq, hkv, d = HEADS
    seq = 8 * world
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(2, h, seq, d, generator=g, dtype=torch.float64)
            for n, h in (("q", hq), ("k", hkv), ("v", hkv), ("dout", hq))}


def _reference(case: dict, causal: bool) -> list[torch.Tensor]:
    """Single-process float64 attention on the full sequence: output and the q, k, v gradients."""
    q, k, v = (case[n].clone().requires_grad_() for n in "qkv")
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    out.backward(case["dout"])
    return [out.detach(), q.grad, k.grad, v.grad]


def _one_layout(case: dict, *, layout: str, mode: str, causal: bool, sharding: str) -> list[torch.Tensor]:
    """Shard, run seqpar.attention in ``layout`` (fp32), gather back to full bhsd float64 tensors."""
    parts = {n: shard_sequence(t, 2, sharding=sharding).float() for n, t in case.items()}
    if layout == "bshd":  # (batch, seq_local, heads, dim), contiguous in that layout, as flash-attn users hold it
        parts = {n: t.transpose(1, 2).contiguous() for n, t in parts.items()}
    q, k, v = (parts[n].requires_grad_() for n in "qkv")
    out = seqpar.attention(q, k, v, causal=causal, mode=mode, sharding=sharding, layout=layout)
    assert out.shape == q.shape, (out.shape, q.shape)  # the output comes back in the caller's layout
    out.backward(parts["dout"])
    seq_dim = 1 if layout == "bshd" else 2
    return [gather_sequence(t.detach(), seq_dim, sharding=sharding).double() for t in (out, q.grad, k.grad, v.grad)]


def _layouts(rank: int, world: int, sp: int, u: int, mode: str) -> list[tuple[str, float, float]]:
    seqpar.init_process_groups(sp_size=sp, ulysses_size=u)
    try:
        report = []
        for causal in (False, True):
            for sharding in ("contiguous", "zigzag"):
                case = _case(world, seed=3 + int(causal))
                ref = _reference(case, causal)
                bhsd = _one_layout(case, layout="bhsd", mode=mode, causal=causal, sharding=sharding)
                bshd = _one_layout(case, layout="bshd", mode=mode, causal=causal, sharding=sharding)
                bshd = [bshd[0].transpose(1, 2)] + [t.transpose(1, 2) for t in bshd[1:]]  # to bhsd to compare
                for name, a, b, r in zip(("out", "dq", "dk", "dv"), bhsd, bshd, ref):
                    report.append((f"{name} causal={causal} {sharding}",
                                   float((a - b).abs().max()), float((b - r).abs().max() / r.abs().max())))
        return report
    finally:
        seqpar.destroy_process_groups()


@pytest.mark.parametrize("world, sp, u, mode", MODES)
def test_bshd_equals_bhsd_in_every_mode(dist_pool, world: int, sp: int, u: int, mode: str) -> None:
    """The same shards in flash-attn's layout give the same output and gradients (to fp32 rounding of
    a different summation order at most), and both equal the float64 single-process reference."""
    for rank, report in enumerate(dist_pool.run(world, _layouts, sp, u, mode, timeout=240)):
        for what, vs_bhsd, vs_ref in report:
            assert vs_bhsd <= 1e-6, f"rank {rank} {mode} {what}: bshd differs from bhsd by {vs_bhsd}"
            assert vs_ref <= 1e-5, f"rank {rank} {mode} {what}: bshd off the float64 reference by {vs_ref}"


def test_bshd_takes_no_copy_on_one_rank() -> None:
    """On one rank the bshd path is views in and out: the output is a transposed view of SDPA's."""
    q, k, v = (torch.randn(1, 16, 4, 8) for _ in range(3))  # (batch, seq, heads, dim)
    out = seqpar.attention(q, k, v, causal=True, layout="bshd")
    ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True).transpose(1, 2)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_layout_must_be_known() -> None:
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match="layout='bsdh' is invalid"):
        seqpar.attention(q, q, q, layout="bsdh")


def _ambiguous(rank: int, world: int) -> list[str]:
    seqpar.init_process_groups(sp_size=world)
    try:
        q = torch.randn(1, 16, 4, 8)  # bhsd: 16 heads x 4 tokens; bshd: 16 tokens x 4 heads (MHA: both pass)
        with pytest.raises(ValueError) as e:
            seqpar.attention(q, q, q, causal=True)
        out = seqpar.attention(q, q, q, causal=True, layout="bshd")  # explicit: accepted, ranks still in step
        assert out.shape == q.shape
        q = torch.randn(1, 4, 16, 8)
        seqpar.attention(q, q, q, causal=True)  # heads < seq_local: unambiguous enough to pass as bhsd
        seqpar.attention(torch.randn(1, 16, 4, 8), q.new_zeros(1, 16, 4, 8), q.new_zeros(1, 16, 4, 8),
                         check_inputs=False, layout=None)  # the check belongs to check_inputs
        return [str(e.value)]
    finally:
        seqpar.destroy_process_groups()


@pytest.mark.parametrize("world", [1, 2])
def test_ambiguous_mha_layout_is_refused_on_every_rank(dist_pool, world: int) -> None:
    for message in (m[0] for m in dist_pool.run(world, _ambiguous, timeout=120)):
        assert "ambiguous" in message and "layout='bhsd'" in message and "layout='bshd'" in message, message
        assert "16 heads and seq_local=4" in message and "seq_local=16 and 4 heads" in message, message


def _declared(rank: int, world: int) -> tuple[str, float]:
    seqpar.init_process_groups(sp_size=world, sharding="zigzag")
    try:
        case = _case(world)
        q, k, v = (shard_sequence(case[n], 2).float() for n in "qkv")  # cut zigzag: the declared sharding
        with pytest.raises(ValueError) as e:
            seqpar.attention(q, k, v, causal=True, sharding="contiguous")
        out = seqpar.attention(q, k, v, causal=True)  # no sharding=: the declared zigzag
        full = gather_sequence(out, 2).double()
        ref = _reference(case, True)[0]
        return str(e.value), float((full - ref).abs().max())
    finally:
        seqpar.destroy_process_groups()


def test_a_declared_sharding_binds_the_attention_entry(dist_pool) -> None:
    for message, err in dist_pool.run(2, _declared, timeout=120):
        assert "contradicts" in message and "'zigzag'" in message, message
        assert err <= 1e-5, err


# ------------------------------------------------------------------------------ resolve once
_WATCHED = [
    ("seqpar.attn.checks", "check_options"), ("seqpar.attn.checks", "check_local"),
    ("seqpar.attn.checks", "check_across_ranks"), ("seqpar.attn.masks", "check_mask_inputs"),
    ("seqpar.attn.checks", "resolve_head_chunks"), ("seqpar.attn.ulysses", "head_split"),
    ("seqpar.attn.masks", "host_boundaries"), ("seqpar.attn.choose", "choose_mode"),
    ("seqpar.attn.choose", "rank_modes"), ("seqpar.runtime.groups", "ulysses_heads_ok"),
]


def _count_resolution(rank: int, world: int, route: str) -> dict[str, int]:
    """How often each resolution step runs for one call (direct, or through a swapped module's options).
    Each watched function is replaced wherever a seqpar module holds it, so a step repeated anywhere
    downstream (the algorithms, the swap) is counted too."""
    import importlib
    import sys

    from seqpar.config import SeqParConfig
    from seqpar.swap.options import SwapOptions

    # every module the route imports is loaded before the patching: one imported during the call would
    # bind the counting wrapper at its import and keep it after the restore (seen: swap.batch, mixers.conv
    # when no earlier task of the pool worker had imported them)
    importlib.import_module("seqpar.swap.batch")
    importlib.import_module("seqpar.mixers.conv")
    seqpar.init_process_groups(sp_size=world)
    counts: dict[str, int] = {}
    saved = []
    try:
        for module_name, fn_name in _WATCHED:
            fn = getattr(importlib.import_module(module_name), fn_name)
            key = f"{module_name.rsplit('.', 1)[-1]}.{fn_name}"

            def counted(*a, _fn=fn, _key=key, **kw):  # noqa: ANN002, ANN003
                counts[_key] = counts.get(_key, 0) + 1
                return _fn(*a, **kw)

            for module in [m for name, m in list(sys.modules.items()) if name.startswith("seqpar.") and m is not None]:
                if getattr(module, fn_name, None) is fn:
                    saved.append((module, fn_name, fn))
                    setattr(module, fn_name, counted)
        q, k, v = (torch.randn(1, 4, 8, 8) for _ in range(3))
        cu = (0, 5, 8 * world)
        if route == "direct":
            seqpar.attention(q, k, v, causal=True, mode="ulysses", cu_seqlens=cu)
        else:
            options = SwapOptions.from_config(SeqParConfig.load({"size": world, "mode": "ulysses"}), None)
            options.attention(q, k, v, causal=True, scale=None, cu_seqlens=cu)
        return counts
    finally:
        for module, fn_name, fn in saved:
            setattr(module, fn_name, fn)
        seqpar.destroy_process_groups()


@pytest.mark.parametrize("route", ["direct", "swap"])
def test_a_call_is_resolved_once(dist_pool, route: str) -> None:
    """Each check and choice runs once per call, from the swap as from a direct call (the swap hands
    its plan down; nothing downstream re-checks or re-splits the heads)."""
    for counts in dist_pool.run(2, _count_resolution, route, timeout=120):
        once = ("checks.check_options", "checks.check_local", "checks.check_across_ranks", "masks.check_mask_inputs",
                "ulysses.head_split", "masks.host_boundaries")
        for step in once:
            assert counts.get(step) == 1, (step, counts)
        # head chunks: once for the call's K/V heads, once for the heads each Ulysses rank holds
        assert counts.get("checks.resolve_head_chunks") == 2, counts
        assert counts.get("groups.ulysses_heads_ok") == 1, counts  # the head rule, inside head_split
        assert "choose.choose_mode" not in counts and "choose.rank_modes" not in counts, counts  # explicit mode


def _layouts_differ(rank: int, world: int) -> str:
    seqpar.init_process_groups(sp_size=world)
    try:
        q = torch.randn(1, 4, 4, 8)  # square: the shapes alone cannot show that the ranks read it two ways
        with pytest.raises(ValueError) as e:
            seqpar.attention(q, q, q, layout="bhsd" if rank == 0 else "bshd")
        return str(e.value)
    finally:
        seqpar.destroy_process_groups()


def test_ranks_passing_different_layouts_all_raise(dist_pool) -> None:
    for message in dist_pool.run(2, _layouts_differ, timeout=120):
        assert "different inputs or options" in message, message
