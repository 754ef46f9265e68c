"""A refusal of a compiled call's sizes or options reaches a ``torch.compile(fullgraph=True)`` caller as eager's ValueError.

Dynamo (torch 2.13) turns any exception raised while it traces into its own ``Unsupported: Observed exception``
under ``fullgraph=True`` (the message survives only as "Developer debug context"), and an f-string of a symbolic
size can fail first (``BUILD_STRING type error``, which loses the message). So the checks of sizes that a
traced call can hold symbolically (the local length, the head counts) are made inside seqpar's custom ops, at
the real sizes, where the exception propagates unchanged: :mod:`seqpar.attn.dilated_ops` (the dilated pattern
against the length and head count), :func:`seqpar.attn.ops.check_sizes` (zigzag's even length,
``head_chunks`` against the K/V heads, boundaries given as ints against the global length) and
:func:`seqpar.attn.ops.check_share` (``head_chunks`` against each Ulysses rank's share of the K/V heads).
The option refusals that :func:`seqpar.attn.resolve.resolve_attention` raises while dynamo traces are caught by
:func:`seqpar.attention` and raised when the graph runs, by the op :func:`seqpar.attn.ops.refusal`.
"""

from __future__ import annotations

import pytest
import torch

WORLD = 2

# name -> (function kwargs, [(q_heads, kv_heads, seq_local[, k's seq_local]) valid, then refused]); P = 2, head dim 6
CASES = {
    # segment 32 spans both ranks at seq_local 16, and straddles them unevenly at 48 (dil27's open case)
    "dilated_straddle": ({"dilated": True, "segment_lengths": (32,), "dilation_rates": (1,)}, [(4, 2, 16), (4, 2, 48)]),
    # a segment of 16 divides the global length 2 * 16 but not 2 * 12
    "dilated_length": ({"dilated": True, "segment_lengths": (16,), "dilation_rates": (2,)}, [(4, 2, 16), (4, 2, 12)]),
    # grouped heads split evenly among the 3 patterns: 6 query heads do, 4 do not
    "dilated_grouped_heads": ({"dilated": True, "segment_lengths": (4, 8, 16), "dilation_rates": (1, 2, 4),
                               "head_layout": "grouped"}, [(6, 2, 16), (4, 2, 16)]),
    "zigzag_odd_length": ({"mode": "ring", "sharding": "zigzag"}, [(4, 2, 8), (4, 2, 9)]),
    "head_chunks": ({"mode": "allgather", "head_chunks": 2}, [(4, 2, 8), (3, 3, 8)]),
    "ulysses_head_chunks": ({"mode": "ulysses", "head_chunks": 2}, [(4, 4, 8), (6, 3, 8)]),
    # head_chunks 4 divides the call's 4 K/V heads but not the 2 each of the 2 Ulysses ranks holds (8 heads: 4 each)
    "ulysses_share_head_chunks": ({"mode": "ulysses", "head_chunks": 4}, [(8, 8, 8), (4, 4, 8)]),
    # uneven Ulysses (3 K/V heads over 2 ranks: 2 and 1): head_chunks 3 divides the call's 3 but not the larger share,
    # checked while tracing (the uneven plan runs one pass, so the op cannot see the int) and raised by seqpar::refusal
    "ulysses_uneven_head_chunks": ({"mode": "ulysses", "head_chunks": 3}, [(6, 6, 8), (6, 3, 8)]),
    # ... and head_chunks 2 dividing neither the call's 5 K/V heads nor the share of 3: eager names the call's heads
    # first (its options' check, which a traced call leaves to the op), so the traced plan must too
    "ulysses_uneven_call_head_chunks": ({"mode": "ulysses", "head_chunks": 2}, [(4, 4, 8), (10, 5, 8)]),
    # q and k of different local lengths: the message shows both shapes (symbolic under dynamic=True)
    "qk_seq_local": ({"mode": "ring"}, [(4, 2, 8), (4, 2, 8, 9)]),
    # boundaries as ints: a constant of the graph, ending at 16 = 2 * 8 but not at 2 * 12
    "documents_ints": ({"mode": "ring", "cu_seqlens": (0, 5, 16)}, [(4, 2, 8), (4, 2, 12)]),
    # boundaries as a tensor (read in the op since session 26): ending at S + 1 at the second length
    "documents_tensor": ({"mode": "ring", "cu_seqlens": "tensor"}, [(4, 2, 8), (4, 2, 12)]),
    # q/k shape comparisons: 4 query heads are no multiple of 3 K/V heads
    "gqa_heads": ({"mode": "ring"}, [(4, 2, 8), (4, 3, 8)]),
    # balanced sharding cuts the sequence in at least 2 * P equal chunks: 16 tokens can be, 18 cannot
    "balanced_length": ({"mode": "ring", "sharding": "balanced"}, [(4, 2, 8), (4, 2, 9)]),
}

# Option refusals (no size involved): name -> (the valid call's kwargs, the refused call's), at (4, 2, 8) then (4, 2, 12).
# Found while dynamo traces, they are raised by seqpar.attn.ops.refusal when the graph runs.
OPTION_CASES = {
    "bad_mode": ({"mode": "ring"}, {"mode": "rings"}),
    "bad_sharding": ({"mode": "ring"}, {"mode": "ring", "sharding": "zig-zag"}),
    "bad_layout": ({"mode": "ring"}, {"mode": "ring", "layout": "bsdh"}),
    "dkv_wire_allgather": ({"mode": "allgather"}, {"mode": "allgather", "dkv_wire_dtype": "bf16"}),
    "bad_dkv_wire": ({"mode": "ring"}, {"mode": "ring", "dkv_wire_dtype": "fp8"}),
    "bad_softcap": ({"mode": "ring", "softcap": 30.0}, {"mode": "ring", "softcap": -1.0}),
    "alibi_with_softcap": ({"mode": "ring", "alibi_slopes": "tensor"},
                           {"mode": "ring", "alibi_slopes": "tensor", "softcap": 30.0}),
    "bad_alibi_slopes": ({"mode": "ring", "alibi_slopes": "tensor"}, {"mode": "ring", "alibi_slopes": "short"}),
    # compile only: eager reads the tensor's values, a traced call cannot (seqpar.attn.resolve._traced_documents)
    "balanced_documents_tensor": ({"mode": "ring", "sharding": "zigzag", "cu_seqlens": "tensor"},
                                  {"mode": "ring", "sharding": "balanced", "cu_seqlens": "tensor"}),
    "dilated_head_layout": ({"dilated": True, "segment_lengths": (4,), "dilation_rates": (2,)},
                            {"dilated": True, "segment_lengths": (4,), "dilation_rates": (2,), "head_layout": "split"}),
    "dilated_zigzag": ({"dilated": True, "segment_lengths": (4,), "dilation_rates": (2,)},
                       {"dilated": True, "segment_lengths": (4,), "dilation_rates": (2,), "sharding": "zigzag"}),
    "bad_head_chunks": ({"mode": "ring", "head_chunks": 1}, {"mode": "ring", "head_chunks": 0}),
    # int options symbolic under dynamic=True, and a sinks length against the (symbolic) query heads
    "bad_window": ({"mode": "ring", "window": 4}, {"mode": "ring", "window": 0}),
    "bad_chunk_size": ({"mode": "ring", "chunk_size": 4}, {"mode": "ring", "chunk_size": 0}),
    "bad_sinks": ({"mode": "ring", "sinks": "tensor"}, {"mode": "ring", "sinks": "short"}),
    # a (1, 3) boundary tensor: the TypeError shows its shape
    "documents_2d": ({"mode": "ring", "cu_seqlens": "tensor"}, {"mode": "ring", "cu_seqlens": "tensor2d"}),
    "dilated_ulysses": ({"dilated": True, "segment_lengths": (4,), "dilation_rates": (2,)},
                        {"dilated": True, "segment_lengths": (4,), "dilation_rates": (2,), "mode": "ulysses"}),
}
COMPILE_ONLY = {"balanced_documents_tensor"}


def _call(q, k, v, cu, kw):  # noqa: ANN001, ANN202
    """q ``(1, q_heads, seq_local, 6)``, k/v ``(1, kv_heads, seq_local, 6)``: one rank's contiguous (or zigzag) shard."""
    import seqpar
    from seqpar.attn.dilated import dilated_attention

    kw = dict(kw)
    group = torch.distributed.group.WORLD
    if kw.pop("dilated", False):
        return dilated_attention(q, k, v, group=group, check_inputs=False, **kw)
    if kw.get("cu_seqlens") in ("tensor", "tensor2d"):
        kw["cu_seqlens"] = cu if kw["cu_seqlens"] == "tensor" else cu[None]
    for name in ("alibi_slopes", "sinks"):  # one per query head, or one too few
        if name in kw:
            # int(): a symbolic size minus a bool fails on torch 2.11
            kw[name] = torch.linspace(0.5, 0.1, q.shape[1] - int(kw[name] == "short"))
    kw.setdefault("layout", "bhsd")
    kw.setdefault("check_inputs", False)
    return seqpar.attention(q, k, v, group=group, **kw)


def _inputs(shape: tuple[int, ...], bad: bool) -> tuple[torch.Tensor, ...]:
    """q ``(1, q_heads, seq_local, 6)``, k/v ``(1, kv_heads, k_seq_local, 6)`` from ``shape`` = ``(q_heads, kv_heads,
    seq_local[, k_seq_local])`` (k's length defaults to q's), and the boundaries as a tensor."""
    q_heads, kv_heads, seq_local, *rest = shape
    g = torch.Generator().manual_seed(7 * seq_local + q_heads)
    q = torch.randn(1, q_heads, seq_local, 6, generator=g)
    k, v = (torch.randn(1, kv_heads, rest[0] if rest else seq_local, 6, generator=g) for _ in "kv")
    seq = WORLD * seq_local
    cu = torch.tensor([0, 3, seq + 1 if bad else seq])  # the refused call's boundaries overrun S by one
    return q, k, v, cu


def _error(fn, *args) -> tuple[str, str] | None:  # noqa: ANN001
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - what reaches the caller is the point
        return type(e).__name__, str(e)
    return None


def _four_ways(call, good: tuple, bad: tuple, good_kw: dict, bad_kw: dict, *extra) -> dict:  # noqa: ANN001
    """One refused call four ways, ``call(*inputs, kw, *extra)``: ``eager`` at the refused inputs; compiled with
    ``dynamic=True, fullgraph=True``, first at the ``valid`` ones, then at the refused ones (``dynamic``: symbolic
    sizes, or a new graph for new option constants); and a fresh ``static`` function whose first call is the
    refused one. Each the error :func:`_error` records (None: no error)."""
    eager = _error(call, *bad, bad_kw, *extra)
    torch._dynamo.reset()
    fn = torch.compile(call, backend="aot_eager", dynamic=True, fullgraph=True)
    valid = _error(fn, *good, good_kw, *extra)
    dynamic = _error(fn, *bad, bad_kw, *extra)
    torch._dynamo.reset()
    static = _error(torch.compile(call, backend="aot_eager", dynamic=False, fullgraph=True), *bad, bad_kw, *extra)
    return {"eager": eager, "valid": valid, "dynamic": dynamic, "static": static}


def _assert_eager_four_ways(per_rank: list[dict], names: list[str]) -> None:
    """Every rank's :func:`_four_ways` results: eager raised a ValueError, the valid call nothing, and both compiled
    refused calls (dynamic and static) eager's type and text."""
    failures = []
    for rank, results in enumerate(per_rank):
        for name in names:
            got = results[name]
            if got["eager"] is None or got["eager"][0] != "ValueError":
                failures.append(f"{name} rank {rank}: eager raised {got['eager']}, not a ValueError")
                continue
            if got["valid"] is not None:
                failures.append(f"{name} rank {rank}: the valid call raised {got['valid']}")
            for how in ("dynamic", "static"):
                if got[how] != got["eager"]:
                    failures.append(f"{name} rank {rank} ({how}): {got[how]!r:.400} is not eager's {got['eager']}")
    assert not failures, "\n".join(failures)


def compiled_refusals(rank: int, world: int, names: list[str]) -> dict:
    """Worker body: per case, one ``torch.compile(dynamic=True, fullgraph=True)`` function called at the valid
    sizes and then at the refused ones, and (dynamic=False) a fresh one whose first call is the refused one.
    Returns per case the three errors (None: no error) and eager's error at the refused sizes."""
    results = {}
    for name in names:
        if name in OPTION_CASES:
            results[name] = _option_refusal(*OPTION_CASES[name])
            continue
        kw, (good, bad) = CASES[name]
        results[name] = _four_ways(_call, _inputs(good, False), _inputs(bad, True), kw, kw)
    torch._dynamo.reset()
    return results


def _option_refusal(good_kw: dict, bad_kw: dict) -> dict:
    """As :func:`compiled_refusals` for one option case: the valid kwargs, then the refused ones (a new graph: the
    options are constants), dynamic=True; and a fresh static function called with the refused ones first."""
    return _four_ways(_call, _inputs((4, 2, 8), False), _inputs((4, 2, 12), False), good_kw, bad_kw)


@pytest.mark.compile_stage
def test_size_refusals_reach_a_fullgraph_caller(dist_pool) -> None:
    """Under ``torch.compile(fullgraph=True)``, with symbolic sizes (a second length under ``dynamic=True``) and
    with static ones (the refused sizes first), each refusal kind raises eager's ValueError, the same text, on
    both ranks: a dilated segment straddling the ranks, a segment not dividing the length, grouped heads not
    splitting among the patterns, zigzag's odd local length, ``head_chunks`` not dividing the K/V heads (all-gather
    and Ulysses) or dividing them but not each Ulysses rank's share (even and uneven splits), boundaries given as
    ints or as a tensor not ending at the global length, 4 query heads over 3 K/V heads, q and k of different local
    lengths, a global length balanced sharding cannot cut.

    Seen failing on the code before session 28's change (7da76dc: the seven source files restored from it): every
    kind but ``documents_tensor`` raised dynamo's ``Unsupported`` on both ranks, static and dynamic: "Observed
    exception" (seqpar's text only in its debug context), and with symbolic sizes "BUILD_STRING type error"
    (``dilated_straddle``, both ``head_chunks`` kinds) or "torch.* op returned non-Tensor" (``dilated_length``:
    ``math.lcm`` of a symbolic length), neither carrying seqpar's message. ``ulysses_share_head_chunks`` (added in
    session 28, cmp28b) seen failing with seqpar/attn/resolve.py and ops.py restored from 02dde11: "BUILD_STRING
    type error" (dynamic) and "Observed exception" (static), on both ranks. ``gqa_heads`` and ``balanced_length``
    (added by cmp28b, refused while tracing and raised by the op ``seqpar::refusal``) seen failing with
    seqpar/attn/dispatch.py and ops.py restored from 4f18a5a: "Observed exception", dynamic and static, both ranks.
    The three kinds cmp29 added seen failing with seqpar/attn/checks.py, resolve.py and ops.py restored from e2e58d9,
    on both ranks: ``ulysses_uneven_head_chunks`` "BUILD_STRING type error" (dynamic: the share's words formatted a
    symbolic K/V head count); ``ulysses_uneven_call_head_chunks`` the same (dynamic), and static the traced plan's
    share message ("does not divide the 3 K/V heads each of the 2 Ulysses ranks holds") where eager names the
    call's 5 heads; ``qk_seq_local`` (dynamic) "Failed to trace builtin operator `str`" (a shape's tuple)."""
    names = list(CASES)
    per_rank = dist_pool.run(WORLD, compiled_refusals, names, timeout=900)
    _assert_eager_four_ways(per_rank, names)


@pytest.mark.compile_stage
def test_option_refusals_reach_a_fullgraph_caller(dist_pool) -> None:
    """Under ``torch.compile(fullgraph=True)`` (dynamic=True after a valid call, and static), each option refusal
    raises eager's exception, type and text, on both ranks: a bad mode, sharding or layout name, ``dkv_wire_dtype``
    bf16 with all-gather or an unknown wire dtype, a softcap <= 0, ALiBi with softcap, ALiBi slopes of the wrong
    length, ``head_chunks=0``, a 2-D boundary tensor (a TypeError), ``window=0``, ``chunk_size=0``, sinks one short; and ``sharding="balanced"`` with a tensor ``cu_seqlens``, refused under compile only: dynamo's
    ``Unsupported`` with seqpar's text (a CompileOnlyRefusal is not deferred: without fullgraph the call runs eagerly); ``dilated_attention``'s bad ``head_layout``, zigzag sharding and ``mode="ulysses"``.

    Seen failing with seqpar/attn/dispatch.py and ops.py restored from 4f18a5a (the refusal raised while dynamo
    traced): every kind raised dynamo's ``Unsupported: Observed exception`` on both ranks, dynamic and static. With
    resolve.py's ``_check_softcap`` message built from ``softcap`` itself (before the fix), ``bad_softcap`` under
    dynamic=True raised "BUILD_STRING type error" (a float argument is symbolic there). The three dilated kinds
    (cmp28b) seen failing with seqpar/attn/dilated.py restored from 0afef41: "Observed exception", both ranks,
    dynamic and static. cmp29's ``bad_head_chunks`` (0) and ``documents_2d`` (a ``(1, 3)`` boundary tensor) seen
    failing with seqpar/attn/checks.py, resolve.py and ops.py restored from e2e58d9, dynamic, both ranks:
    "BUILD_STRING type error" (``{head_chunks!r}`` of a symbolic int) and "Failed to trace builtin operator `str`"
    (the tensor's shape). ``bad_window`` and ``bad_chunk_size`` seen failing with seqpar/attn/masks.py restored
    from e2e58d9, dynamic, both ranks: "BUILD_STRING type error" (``{window!r}``, ``{chunk_size!r}``). ``bad_sinks``
    was not seen failing here (after the valid call the refused one passed on the old masks.py too); compiled
    with dynamic=True and called with the refused sinks first, the old message gave "Failed to trace builtin
    operator `str`" (cmp29's scratch run, both ranks)."""
    names = list(OPTION_CASES)
    per_rank = dist_pool.run(WORLD, compiled_refusals, names, timeout=900)
    failures = []
    for rank, results in enumerate(per_rank):
        for name in names:
            got = results[name]
            if got["valid"] is not None:
                failures.append(f"{name} rank {rank}: the valid call raised {got['valid']}")
            if name in COMPILE_ONLY:
                # eager runs it; traced, a CompileOnlyRefusal is raised while dynamo traces and never deferred, so
                # that without fullgraph dynamo runs the call eagerly (exact: tests/test_fuzz.py's found compile
                # cases 647716 and 1218503732); under fullgraph it is dynamo's Unsupported carrying seqpar's text
                expected = got["static"]
                if got["eager"] is not None or expected is None or expected[0] != "Unsupported" \
                        or "under torch.compile" not in expected[1]:
                    failures.append(f"{name} rank {rank}: eager {got['eager']}, compiled {expected!r:.400}")
            else:
                expected = got["eager"]
                if expected is None or expected[0] not in ("ValueError", "TypeError"):
                    failures.append(f"{name} rank {rank}: eager raised {expected}, not a ValueError / TypeError")
                    continue
            for how in ("dynamic", "static"):
                if got[how] != expected:
                    failures.append(f"{name} rank {rank} ({how}): {got[how]!r:.400} is not {expected}")
    assert not failures, "\n".join(failures)


@pytest.mark.compile_stage
def test_a_deferred_refusal_keeps_its_type() -> None:
    """The rule of :func:`seqpar.attn.ops.defer_refusals` (one process, no exchange): under ``fullgraph=True`` a
    ValueError, a TypeError and a ``seqpar.ConfigError`` (a ValueError subclass: ``except seqpar.ConfigError`` must
    catch it compiled as in eager) raised while dynamo traces reach the caller as themselves, their text intact; a
    ``CompileOnlyRefusal`` is not deferred (dynamo's ``Unsupported``, its text in the message), so that without
    fullgraph dynamo runs the call eagerly.

    Seen failing with ops.py's REFUSALS without ConfigError (session 28's rule, plain ValueError / TypeError only):
    the ConfigError kind raised dynamo's ``Unsupported: Observed exception``."""
    from seqpar.attn.checks import CompileOnlyRefusal
    from seqpar.attn.ops import defer_refusals
    from seqpar.config import ConfigError

    q = torch.randn(1, 2, 4, 6)
    failures = []
    for kind in (ValueError, TypeError, ConfigError, CompileOnlyRefusal):

        @defer_refusals
        def entry(q, k, v, kind=kind):  # noqa: ANN001, ANN202
            raise kind(f"refused: {kind.__name__}")

        torch._dynamo.reset()
        got = _error(torch.compile(entry, backend="aot_eager", fullgraph=True), q, q, q)
        want = ("Unsupported" if kind is CompileOnlyRefusal else kind.__name__, f"refused: {kind.__name__}")
        if got is None or got[0] != want[0] or (want[0] == "Unsupported") != (got[1] != want[1]) \
                or want[1] not in got[1]:
            failures.append(f"{kind.__name__}: {got!r:.400}")
    torch._dynamo.reset()
    assert not failures, "\n".join(failures)


def auto_falls_back(rank: int, world: int) -> list[str]:
    """Worker body: ``mode="auto"`` on a group nothing has probed, compiled without ``fullgraph``: the first call
    (dynamo cannot probe the links while tracing: a CompileOnlyRefusal) runs eagerly, which probes them. Its output
    and gradients (float64) against one process's float64 SDPA, each on its own scale; the mismatches as text."""
    from test_attention import make_case, reference, shard_rows

    import seqpar

    case = make_case(29, world, (4, 2, 6), batch=1)
    expected = [shard_rows(t, rank, world, "zigzag") for t in reference(case, True, None)]
    q, k, v, dout = (shard_rows(case[n], rank, world, "zigzag") for n in ("q", "k", "v", "dout"))
    group = torch.distributed.new_group(list(range(world)))  # a group nothing has probed yet

    def call(q, k, v):  # noqa: ANN001, ANN202
        return seqpar.attention(q, k, v, causal=True, mode="auto", sharding="zigzag", group=group, check_inputs=False)

    torch._dynamo.reset()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    try:
        out = torch.compile(call, backend="aot_eager")(*leaves)
    except Exception as error:  # noqa: BLE001 - what reaches the caller is the point
        return [f"compiled before the probe raised {type(error).__name__}: {str(error)[:400]}"]
    finally:
        torch._dynamo.reset()
    out.backward(dout)
    return [f"{name} differs by {(got - want).abs().max().item():.3g}"
            for name, want, got in zip(("out", "dq", "dk", "dv"), expected, (out.detach(), *(t.grad for t in leaves)))
            if not torch.allclose(got, want, rtol=1e-10, atol=1e-10 * want.abs().max().item())]


@pytest.mark.compile_stage
def test_auto_before_the_probe_runs_eagerly_without_fullgraph(dist_pool) -> None:
    """``mode="auto"`` before its group's links are probed, compiled without ``fullgraph=True``: dynamo falls back to
    the eager call (which probes the links), exact against one process in float64 on both ranks, not refused.

    Seen failing with seqpar/attn/choose.py's ``_probed_while_tracing`` raising a plain ValueError (deferred to
    ``seqpar::refusal``): the compiled graph raised that ValueError ("mode='auto' under torch.compile: this SP
    group's links have not been probed yet ...") on both ranks, where eager runs the call."""
    per_rank = dist_pool.run(WORLD, auto_falls_back, timeout=600)
    assert per_rank == [[]] * WORLD, per_rank


# A swapped layer's refusals (seqpar.swap.options.SwapOptions.attention calls resolve_attention itself, not through
# seqpar.attention): name -> (the valid call's keywords, the refused call's); "batch2": the refused call's batch is 2.
SWAP_CASES = {
    "swap_bad_softcap": ({"softcap": 30.0}, {"softcap": -1.0}),
    "swap_alibi_slopes": ({"alibi_slopes": 4}, {"alibi_slopes": 3}),
    "swap_documents_batch": ({"cu_seqlens": "tensor"}, {"cu_seqlens": "tensor", "batch2": True}),
}


def _swap_call(q, k, v, cu, kw, options):  # noqa: ANN001, ANN202
    """A swapped layer's attention (``options``: its SwapOptions, made outside the trace) on q ``(batch, 4, 8, 6)``,
    k/v ``(batch, 2, 8, 6)`` (ring, 2 ranks)."""
    kw = {n: cu if value == "tensor" else torch.linspace(0.5, 0.1, value) if n == "alibi_slopes" else value
          for n, value in kw.items() if n != "batch2"}
    return options.attention(q, k, v, causal=True, scale=None, **kw)


def swap_refusals(rank: int, world: int, names: list[str]) -> dict:
    """Worker body: as :func:`_option_refusal` for each swap case (dynamic=True after the valid call, and a fresh
    static function called with the refused keywords first)."""
    from seqpar.swap.options import SwapOptions

    options = SwapOptions(group=torch.distributed.group.WORLD, mode="ring", check_inputs=False)
    results = {}
    for name in names:
        good_kw, bad_kw = SWAP_CASES[name]
        q, k, v, cu = _inputs((4, 2, 8), False)
        good = (q, k, v, cu)
        bad = tuple(t.repeat(2, 1, 1, 1) for t in (q, k, v)) + (cu,) if bad_kw.get("batch2") else good
        results[name] = _four_ways(_swap_call, good, bad, good_kw, bad_kw, options)
    torch._dynamo.reset()
    return results


@pytest.mark.compile_stage
def test_swapped_layer_refusals_reach_a_fullgraph_caller(dist_pool) -> None:
    """A swapped layer's call (``SwapOptions.attention``, which resolves the call itself) refused while dynamo traces
    raises eager's ValueError, its text, on both ranks under ``fullgraph=True``, dynamic and static: a softcap <= 0,
    ALiBi slopes one short, a boundary tensor with batch 2.

    Seen failing with seqpar/swap/options.py restored from e2e58d9 (resolve_attention's refusal raised while
    tracing, not deferred): dynamo's ``Unsupported: Observed exception`` for each kind, both ranks, dynamic and static."""
    names = list(SWAP_CASES)
    per_rank = dist_pool.run(WORLD, swap_refusals, names, timeout=900)
    _assert_eager_four_ways(per_rank, names)


# The MLA latent path (SwapOptions.latent_attention: the ring moves the latent, seqpar.swap.mla), DeepSeek-V2/V3's
# shape at toy sizes: 4 heads, d_nope 6, d_rope 4, d_v 5, kv_lora_rank 7; P = 2 ring, 8 tokens per rank.
# name -> (the valid call's keywords, the refused call's); "batch2": the refused call's batch is 2.
LATENT_CASES = {
    "latent_bad_softcap": ({"softcap": 30.0}, {"softcap": -1.0}),
    "latent_bad_window": ({"window": 4}, {"window": 0}),
    "latent_documents_batch": ({}, {"cu_seqlens": "tensor", "batch2": True}),
}


class _KVProjection(torch.nn.Module):
    """An MLA ``kv_b_proj`` as :func:`seqpar.swap.mla.install_latent_transfer` prepares it: ``forward(c, r,
    seqpar_latent=f)`` returns ``f(weight, c, r)``; weight ``(heads * (d_nope + d_v), kv_lora_rank)``."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight)

    def forward(self, c, r, seqpar_latent=None):  # noqa: ANN001, ANN201
        return seqpar_latent(self.weight, c, r)


def _mla_dims():  # noqa: ANN202
    from seqpar.attn.latent import MLADims

    return MLADims(heads=4, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5, kv_lora_rank=7)


def _expand(weight: torch.Tensor, c: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's own expansion: c ``(batch, 1, n, 7)``, r ``(batch, 1, n, 4)`` -> k ``(batch, 4, n, 10)``,
    v ``(batch, 4, n, 5)``."""
    d = _mla_dims()
    b, _, n, _ = c.shape
    kv = (c.squeeze(1) @ weight.t()).view(b, n, d.heads, -1).transpose(1, 2)
    return torch.cat([kv[..., :d.qk_nope_head_dim], r.expand(b, d.heads, n, -1)], -1), kv[..., d.qk_nope_head_dim:]


def _latent_call(q, c, r, proj, cu, kw, options):  # noqa: ANN001, ANN202
    """One MLA layer's latent attention: q ``(batch, 4, n, 10)``, c/r the latent, as the swapped layer makes it."""
    from seqpar.swap.mla import LatentCall

    d = _mla_dims()
    b, _, n, _ = c.shape
    zero = c.new_zeros(())
    key = zero.expand(b, d.heads, n, d.qk_nope_head_dim + d.qk_rope_head_dim)
    value = zero.expand(b, d.heads, n, d.v_head_dim)
    call = LatentCall(c, r, proj, d, key, value, lambda c_in, r_in: _expand(proj.weight, c_in, r_in))
    kw = {name: cu if value == "tensor" else value for name, value in kw.items() if name != "batch2"}
    return options.latent_attention(q, call, causal=True, scale=0.3, layer="0", **kw)


def _latent_inputs(seed: int, seq: int, dtype: torch.dtype) -> dict:
    d = _mla_dims()
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=dtype)

    return {"q": rnd(1, d.heads, seq, d.qk_nope_head_dim + d.qk_rope_head_dim), "c": rnd(1, 1, seq, d.kv_lora_rank),
            "r": rnd(1, 1, seq, d.qk_rope_head_dim), "w": rnd(d.heads * (d.qk_nope_head_dim + d.v_head_dim),
                                                              d.kv_lora_rank) / d.kv_lora_rank ** 0.5,
            "dout": rnd(1, d.heads, seq, d.v_head_dim)}


def latent_refusals(rank: int, world: int, names: list[str]) -> dict:
    """Worker body: as :func:`swap_refusals` for each MLA latent case."""
    from seqpar.swap.options import SwapOptions

    options = SwapOptions(group=torch.distributed.group.WORLD, mode="ring", check_inputs=False)
    full = _latent_inputs(29, 8 * world, torch.float32)
    q, c, r = (full[n][:, :, rank * 8:(rank + 1) * 8] for n in "qcr")
    proj = _KVProjection(full["w"])
    cu = torch.tensor([0, 3, 8 * world])
    results = {}
    for name in names:
        good_kw, bad_kw = LATENT_CASES[name]
        good = (q, c, r, proj, cu)
        bad = (*(t.repeat(2, 1, 1, 1) for t in (q, c, r)), proj, cu) if bad_kw.get("batch2") else good
        results[name] = _four_ways(_latent_call, good, bad, good_kw, bad_kw, options)
    torch._dynamo.reset()
    return results


@pytest.mark.compile_stage
def test_mla_latent_refusals_reach_a_fullgraph_caller(dist_pool) -> None:
    """An MLA layer's latent call (``SwapOptions.latent_attention``) refused while dynamo traces raises eager's
    ValueError, its text, on both ranks under ``fullgraph=True``, dynamic and static: a softcap <= 0, a window of 0,
    a boundary tensor with batch 2.

    Seen failing with seqpar/swap/options.py from dc97140 (latent_attention not deferred): dynamo's ``Unsupported:
    Observed exception`` for each kind, both ranks, dynamic and static."""
    names = list(LATENT_CASES)
    per_rank = dist_pool.run(WORLD, latent_refusals, names, timeout=900)
    _assert_eager_four_ways(per_rank, names)


def latent_documents_fall_back(rank: int, world: int, dynamic: bool | None) -> dict:
    """Worker body: an MLA latent call with packed documents as a boundary tensor, float64, compiled without
    ``fullgraph`` (``dynamic`` as torch.compile takes it; while tracing: the compile-only refusal, so dynamo runs it eagerly). This rank's output and
    dq, dc, dr, and its share of dW; or the error that reached the caller."""
    from seqpar.swap.options import SwapOptions

    options = SwapOptions(group=torch.distributed.group.WORLD, mode="ring", check_inputs=False)
    full = _latent_inputs(31, 8 * world, torch.float64)
    q, c, r, dout = (full[n][:, :, rank * 8:(rank + 1) * 8].clone().requires_grad_() for n in ("q", "c", "r", "dout"))
    proj = _KVProjection(full["w"].clone())
    cu = torch.tensor([0, 3, 11, 8 * world])
    torch._dynamo.reset()
    try:
        out = torch.compile(_latent_call, backend="aot_eager", dynamic=dynamic)(q, c, r, proj, cu,
                                                                              {"cu_seqlens": "tensor"}, options)
    except Exception as error:  # noqa: BLE001 - what reaches the caller is the point
        return {"error": f"{type(error).__name__}: {str(error)[:400]}"}
    finally:
        torch._dynamo.reset()
    out.backward(dout.detach())
    return {"out": out.detach(), "dq": q.grad, "dc": c.grad, "dr": r.grad, "dw": proj.weight.grad}


@pytest.mark.compile_stage
@pytest.mark.parametrize("dynamic", [None, True])
def test_mla_latent_documents_run_eagerly_without_fullgraph(dist_pool, dynamic: bool | None) -> None:
    """Packed documents (a boundary tensor) on the MLA latent path, compiled without ``fullgraph=True``: the
    compile-only refusal makes dynamo run the call eagerly, exact against one process's float64 MLA attention
    (output, dq, dc, dr, and dW summed over the ranks, each on its own scale), not refused.

    Seen failing: on dc97140's seqpar/swap/options.py, and with that refusal a plain ValueError (deferred to
    ``seqpar::refusal``), the compiled graph raised "packed documents under torch.compile with the MLA latent transfer
    are not supported" on both ranks; as a CompileOnlyRefusal without the eager branch's second resolve, the
    fallback raised it too (resolve_attention, compiled as a frame of its own, hands Python a traced plan); with that
    traced plan run as it is, the boundaries were dropped: out differs by 1.63, every gradient too (WRONG), static
    and dynamic=True; with the plan resolved again eagerly but the latent ring run with dynamo on (it compiled the
    ring's helpers frame by frame), dynamic=True failed: TorchRuntimeError "BooleanAtom not allowed" in ring.py."""
    from test_documents import visible

    world = WORLD
    per_rank = dist_pool.run(world, latent_documents_fall_back, dynamic, timeout=600)
    errors = [f"rank {rank}: {res['error']}" for rank, res in enumerate(per_rank) if "error" in res]
    assert not errors, errors
    full = _latent_inputs(31, 8 * world, torch.float64)
    q, c, r, w = (full[n].clone().requires_grad_() for n in "qcrw")
    k, v = _expand(w, c, r)
    s = (q @ k.transpose(-1, -2) * 0.3).masked_fill(~visible(8 * world, True, None, [0, 3, 11, 8 * world]),
                                                    float("-inf"))
    out = torch.softmax(s, -1) @ v
    want = dict(zip(("out", "dq", "dc", "dr", "dw"), (out.detach(), *torch.autograd.grad(out, [q, c, r, w],
                                                                                         full["dout"]))))
    got = {name: torch.cat([res[name] for res in per_rank], 2) for name in ("out", "dq", "dc", "dr")}
    got["dw"] = sum(res["dw"] for res in per_rank)
    failures = [f"{name} differs by {(got[name] - want[name]).abs().max().item():.3g}" for name in want
                if not torch.allclose(got[name], want[name], rtol=1e-10, atol=1e-10 * want[name].abs().max().item())]
    assert not failures, failures


def latent_traced_plan(rank: int, world: int) -> dict:
    """Worker body: the MLA latent ring with ``check_finite=True`` (a collective inside the swap's ``with
    suspended()``: dynamo gives the latent frame up, and Python runs it holding the plan resolve_attention, compiled
    as a frame of its own, made while tracing), compiled without fullgraph. The valid call's output and grads
    (float64), and ``head_chunks=3`` over the 4 heads (a refusal a traced call leaves to the op): (type, text)
    eagerly and compiled."""
    from seqpar.swap.options import SwapOptions

    full = _latent_inputs(37, 8 * world, torch.float64)
    q, c, r, dout = (full[n][:, :, rank * 8:(rank + 1) * 8].clone().requires_grad_() for n in ("q", "c", "r", "dout"))
    proj = _KVProjection(full["w"].clone())
    got: dict = {}
    for chunks in (1, 3):
        options = SwapOptions(group=torch.distributed.group.WORLD, mode="ring", check_inputs=False, check_finite=True,
                              head_chunks=chunks)
        for how in ("eager", "compiled") if chunks == 3 else ("compiled",):
            torch._dynamo.reset()
            fn = torch.compile(_latent_call, backend="aot_eager") if how == "compiled" else _latent_call
            try:
                out = fn(q, c, r, proj, None, {}, options)
            except Exception as error:  # noqa: BLE001 - what reaches the caller is the point
                got[(how, chunks)] = (type(error).__name__, str(error))
                continue
            finally:
                torch._dynamo.reset()
            if chunks == 1:
                out.backward(dout.detach())
                got["exact"] = {"out": out.detach(), "dq": q.grad, "dc": c.grad, "dr": r.grad, "dw": proj.weight.grad}
            else:
                got[(how, chunks)] = None
    return got


@pytest.mark.compile_stage
def test_mla_latent_traced_plan_run_by_python(dist_pool) -> None:
    """The MLA latent path run by Python with a plan made while tracing (``check_finite=True`` breaks the graph
    inside the swap's ``with suspended()``, so dynamo gives the latent frame up, while resolve_attention, called from
    it, is compiled as a frame of its own): the valid call equals one process's float64 MLA attention (output and
    every gradient, each on its own scale), and ``head_chunks=3`` over 4 heads gets eager's ValueError and text on
    both ranks.

    Seen failing: on 3871d0f's seqpar/swap/options.py (the eager second resolve only when the plan held documents),
    the compiled ``head_chunks=3`` call ran without a word on both ranks (the traced plan's unchecked head_chunks),
    where eager raises "head_chunks=3 does not divide the 4 K/V heads: choose one of [1, 2, 4] or 'auto'". The
    valid call was exact there too."""
    world = WORLD
    per_rank = dist_pool.run(world, latent_traced_plan, timeout=600)
    for rank, got in enumerate(per_rank):
        assert "exact" in got, f"rank {rank}: {got.get(('compiled', 1))}"
        assert got[("eager", 3)] is not None and got[("eager", 3)][0] == "ValueError", (rank, got[("eager", 3)])
        assert got[("compiled", 3)] == got[("eager", 3)], f"rank {rank}: {got[('compiled', 3)]} vs {got[('eager', 3)]}"
    full = _latent_inputs(37, 8 * world, torch.float64)
    q, c, r, w = (full[n].clone().requires_grad_() for n in "qcrw")
    k, v = _expand(w, c, r)
    seq = 8 * world
    s = (q @ k.transpose(-1, -2) * 0.3).masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.softmax(s, -1) @ v
    want = dict(zip(("out", "dq", "dc", "dr", "dw"), (out.detach(), *torch.autograd.grad(out, [q, c, r, w],
                                                                                         full["dout"]))))
    got = {name: torch.cat([res["exact"][name] for res in per_rank], 2) for name in ("out", "dq", "dc", "dr")}
    got["dw"] = sum(res["exact"]["dw"] for res in per_rank)
    failures = [f"{name} differs by {(got[name] - want[name]).abs().max().item():.3g}" for name in want
                if not torch.allclose(got[name], want[name], rtol=1e-10, atol=1e-10 * want[name].abs().max().item())]
    assert not failures, failures
