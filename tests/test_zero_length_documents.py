"""Zero-length documents: ``cu_seqlens`` with repeated entries, as flash-attn's varlen kernels, Megatron (a
fixed-size ``cu_seqlens`` padded with trailing copies of S, so shapes stay static under torch.compile / CUDA graphs)
and TransformerEngine accept them, or a collator that emits an empty sample.

A zero-length document holds no token, so it changes no mask: every call with repeats must equal the same call with
the repeats removed (bit for bit: the plans are the same) and the float64 single-process reference
(:func:`seqpar.testing.fuzz_attention_run.attention_reference`, fp32 1e-5 of each output's and gradient's own scale),
on P = 1..4 ranks, for ring, all-gather, Ulysses and hybrid, every sharding, causal or not, GQA / MQA, with windows,
chunked attention and sinks. Also: the compiled op drops the repeats at run time (a fixed-size padded tensor is one
graph whatever its values), the balanced layout, the Hugging Face swap's packed batches (cu_seq_lens_q with
repeats, beside position_ids; a Llama and a Qwen3-Next with Gated DeltaNet mixers), ``pack_documents`` and the dynamic-CP planner (a zero-length document is dropped: it
runs in no micro-batch). What is really wrong (decreasing, first != 0, last != S, negative, non-integer) is still
refused with a clear error on every rank.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import seqpar
from seqpar.attn.masks import check_boundary_values, document_bounds
from seqpar.sequence.boundaries import drop_empty_documents
from seqpar.sequence.sharding import balanced_layout, shard_index
from seqpar.testing.fuzz_attention_run import attention_reference, positions

TOL = 1e-5
NAMES = ("out", "dq", "dk", "dv", "dsinks")


def with_repeats(cu: list[int], seq: int, pad_to: int) -> list[int]:
    """``cu`` with zero-length documents: a leading one (0 twice), one in the middle, and trailing copies of S
    up to ``pad_to`` entries (Megatron's fixed-size padding)."""
    mid = len(cu) // 2
    padded = [0, *cu[:mid], cu[mid - 1] if mid > 1 else 0, *cu[mid:]]
    return padded + [seq] * max(0, pad_to - len(padded))


def clean_boundaries(seq: int, world: int, variant: int) -> list[int]:
    """Documents of length 1, shorter than a zigzag chunk (seq / 2P) and spanning shards (variant 0), or short
    ones only (variant 1)."""
    chunk = seq // (2 * world)
    lens = [1, chunk // 2 + 1, 2 * chunk + 3] if variant == 0 else [3, 1, chunk - 1, chunk // 2 + 2] * (2 * world)
    cu = [0]
    for n in lens:
        if cu[-1] + n < seq:
            cu.append(cu[-1] + n)
    return cu + [seq]


def draws_of(seed: int, world: int, heads: tuple[int, int, int], *, mode: str, sharding: str, causal: bool,
             variant: int, window: int | None = None, chunk_size: int | None = None, sinks: bool = False) -> dict:
    """One case in the shape of the fuzzer's draws (so seqpar.testing's reference and positions read it)."""
    hq, hkv, d = heads
    seq = 24 * world
    cu = clean_boundaries(seq, world, variant)
    return {"case_seed": seed, "world": world, "heads": (hq, hkv, d, d), "batch": 1, "seq": seq, "mode": mode,
            "sharding": sharding, "causal": causal, "window": window, "chunk_size": chunk_size, "sinks": sinks,
            "calls": [{"cu": cu}], "padded": with_repeats(cu, seq, len(cu) + 6)}


def run_pair(rank: int, world: int, cases: list[dict], ulysses_size: int | None = None) -> list[list[list]]:
    """Worker: per case, forward + backward with the padded boundaries (an int32 tensor) and with the clean ones
    (a tuple); this rank's out, dq, dk, dv (and dsinks) of each."""
    from seqpar.testing.fuzz_attention_run import tensors_of

    group = torch.distributed.group.WORLD if world > 1 else None
    if ulysses_size is not None:
        seqpar.init_process_groups(sp_size=world, ulysses_size=ulysses_size)
        group = None  # hybrid runs on the manager's two axes
    results = []
    for draws in cases:
        t = tensors_of(draws)
        call = t["calls"][0]
        padded = torch.tensor(draws["padded"], dtype=torch.int32)
        pos = positions(draws, draws["padded"], rank)  # the balanced layout read from the padded boundaries
        pair = []
        for cu in (padded, tuple(draws["calls"][0]["cu"])):
            q, k, v = (call[n][:, :, pos].float().requires_grad_() for n in "qkv")
            sinks = t["sinks"].float().requires_grad_() if "sinks" in t else None
            out = seqpar.attention(q, k, v, causal=draws["causal"], mode=draws["mode"], sharding=draws["sharding"],
                                   group=group, cu_seqlens=cu, window=draws["window"], chunk_size=draws["chunk_size"],
                                   sinks=sinks)
            out.backward(call["dout"][:, :, pos].float())
            pair.append([out.detach(), q.grad, k.grad, v.grad] + ([sinks.grad] if sinks is not None else []))
        results.append(pair)
    return results


def check_pairs(per_rank: list, cases: list[dict], world: int) -> None:
    for idx, draws in enumerate(cases):
        label = {k: draws[k] for k in ("mode", "sharding", "causal", "window", "chunk_size", "sinks", "padded")}
        pos = [positions(draws, draws["padded"], r) for r in range(world)]
        for r in range(world):  # the repeats change no plan: the two calls are the same computation
            for name, a, b in zip(NAMES, *per_rank[r][idx]):
                assert torch.equal(a, b), f"rank {r} {name} {label}: padded differs from clean by {(a - b).abs().max()}"
        ref = attention_reference(draws, _tensors(draws))
        want = ref["calls"][0] + ([ref["dsinks"]] if "dsinks" in ref else [])
        for j, (name, w) in enumerate(zip(NAMES, want)):
            if name == "dsinks":  # a replicated weight: the ranks' gradients are terms of the total
                got = sum(per_rank[r][idx][0][j].double() for r in range(world))
            else:
                got = torch.zeros_like(w)
                for r in range(world):
                    got[:, :, pos[r]] = per_rank[r][idx][0][j].double()
            err = (got - w).abs().max().item()
            assert err <= TOL * max(1.0, w.abs().max().item()), f"{name} {label}: off the float64 reference by {err:.3g}"


def _tensors(draws: dict) -> dict:
    from seqpar.testing.fuzz_attention_run import tensors_of

    return tensors_of(draws)


HEADS = {1: ((4, 2, 8), (4, 1, 6)), 2: ((4, 2, 8), (4, 1, 6)), 3: ((6, 3, 8), (3, 1, 6)), 4: ((4, 2, 8), (8, 2, 6))}
# (window, chunk_size, sinks, variant)
MASKS = ((None, None, False, 0), (5, None, True, 1), (None, 7, False, 1), (30, 9, True, 0))


def cases_for(world: int, modes: tuple[str, ...], shardings: tuple[str, ...], seed: int) -> list[dict]:
    cases = []
    for i, (mode, sharding, causal) in enumerate(itertools.product(modes, shardings, (True, False))):
        window, chunk, sinks, variant = MASKS[i % len(MASKS)]
        cases.append(draws_of(seed + i, world, HEADS[world][i % 2], mode=mode, sharding=sharding, causal=causal,
                              variant=variant, window=window, chunk_size=chunk, sinks=sinks))
    return cases


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_zero_length_documents_change_nothing(dist_pool, world: int) -> None:
    """Ring, all-gather and (P >= 2) Ulysses, contiguous / zigzag / balanced, causal or not, GQA / MQA, windows,
    chunks and sinks: with repeats == without, and == the float64 reference. Seen failing (P = 1..4): with
    check_boundary_values's strict test back ('<=': every padded call refused, 'got 0 then 0 at index 1')."""
    modes = ("ring", "allgather") + (("ulysses",) if world > 1 else ())
    cases = cases_for(world, modes, ("contiguous", "zigzag", "balanced"), 7000 + 100 * world)
    check_pairs(dist_pool.run(world, run_pair, cases, timeout=600), cases, world)


def test_zero_length_documents_hybrid(dist_pool) -> None:
    """Hybrid at P = 4 (2 x 2), contiguous and zigzag. Seen failing: with check_boundary_values's strict test back
    (every padded call refused)."""
    cases = cases_for(4, ("hybrid",), ("contiguous", "zigzag"), 7900)
    check_pairs(dist_pool.run(4, run_pair, cases, 2, timeout=600), cases, 4)


# --------------------------------------------------------------------------- host rules, no process group
def test_boundary_rules() -> None:
    """Repeats pass and are dropped; the balanced layout ignores them. Seen failing: with balanced_layout's strict
    test back ('never decreasing' raised for the padded boundaries)."""
    check_boundary_values((0, 0, 4, 4, 16, 16), 16)
    assert document_bounds((0, 0, 4, 4, 16, 16), 16) == (0, 4, 16)
    assert drop_empty_documents((0, 4, 16)) == (0, 4, 16)
    assert drop_empty_documents((0, 16, 16, 16)) == (0, 16)
    for world in (2, 3, 4):
        seq = 24 * world
        cu = clean_boundaries(seq, world, 1)
        padded = with_repeats(cu, seq, len(cu) + 5)
        assert balanced_layout(seq, world, tuple(padded)) == balanced_layout(seq, world, tuple(cu))
        for r in range(world):
            assert torch.equal(shard_index(seq, r, world, "balanced", cu_seqlens=torch.tensor(padded)),
                               shard_index(seq, r, world, "balanced", cu_seqlens=cu))


def test_plans_read_the_boundaries_without_repeats() -> None:
    """seqpar.attention's plan holds the boundaries without repeats, so a padded call plans exactly what the clean
    call plans; the memory estimate takes them and gives the clean figure. Seen failing: without the drop in
    resolve_attention (plan.opts.cu_seqlens kept the repeats; the results stayed exact: the planner already skips
    empty documents, so the drop is what makes the two calls one computation by construction)."""
    from seqpar.attn.resolve import resolve_attention
    from seqpar.memory.attention import estimate_attention_memory

    q, k, v = torch.randn(1, 4, 16, 8), torch.randn(1, 2, 16, 8), torch.randn(1, 2, 16, 8)
    for cu in (torch.tensor([0, 0, 4, 4, 16, 16, 16]), (0, 4, 4, 16)):
        plan = resolve_attention(q, k, v, causal=True, cu_seqlens=cu, window=3)
        assert plan.opts.cu_seqlens == (0, 4, 16), plan.opts.cu_seqlens
    sizes = {"world_size": 4, "mode": "ring", "batch": 1, "q_heads": 8, "kv_heads": 2, "head_dim": 16, "window": 100}
    assert (estimate_attention_memory(1024, cu_seqlens=(0, 0, 100, 100, 700, 1024, 1024), **sizes)
            == estimate_attention_memory(1024, cu_seqlens=(0, 100, 700, 1024), **sizes))


def _bad_call(rank: int, world: int, case: str) -> tuple[str, str] | None:
    torch.manual_seed(rank)
    q = torch.randn(1, 4, 8, 16, requires_grad=True)
    k, v = torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    seq = 8 * world
    cu = {"decreasing": torch.tensor([0, 5, 5, 3, seq]), "first_not_zero": torch.tensor([2, 2, 5, seq]),
          "negative": torch.tensor([0, -1, -1, seq]), "last_not_s": torch.tensor([0, 5, 5, seq - 1]),
          "past_s": torch.tensor([0, 5, seq + 1, seq + 1]), "float": torch.tensor([0.0, 5.0, 5.0, seq]),
          "float_ints": (0, 5, 5.5, seq)}[case]
    try:
        seqpar.attention(q, k, v, causal=True, cu_seqlens=cu, group=torch.distributed.group.WORLD)
    except (ValueError, TypeError) as e:
        return type(e).__name__, str(e)
    return None


@pytest.mark.parametrize("case,expect", [
    ("decreasing", "must not decrease"), ("first_not_zero", "must start at 0"), ("negative", "must not decrease"),
    ("last_not_s", "must end at the global sequence length 16"), ("past_s", "must end at the global sequence length"),
    ("float", "int32/int64"), ("float_ints", "tuple of ints"),
])
def test_what_is_wrong_is_still_refused_on_every_rank(dist_pool, case: str, expect: str) -> None:
    """Seen failing: without check_boundary_values's first-entry test, 'first_not_zero' ran on both ranks (no
    error); with its strict test back, 'last_not_s' and 'past_s' were refused for the repeat instead of naming the
    wrong end."""
    for rank, res in enumerate(dist_pool.run(2, _bad_call, case, timeout=60)):
        assert res is not None, f"rank {rank} did not raise for {case}"
        assert expect in res[1], (rank, res)


# --------------------------------------------------------------------------- torch.compile: one graph
def _compiled(rank: int, world: int) -> list[str]:
    """Worker: a fixed-size padded cu_seqlens tensor through a compiled call (fullgraph, aot_eager), two layouts of
    the same size: one graph, each result equal to eager with the clean boundaries."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    group = torch.distributed.group.WORLD

    def call(q, k, v, cu):  # noqa: ANN001, ANN202
        return seqpar.attention(q, k, v, causal=True, mode="ring", sharding="zigzag", group=group, cu_seqlens=cu,
                                check_inputs=False, window=11)

    fn = torch.compile(call, fullgraph=True, backend=counter)
    failures = []
    for seed, clean in ((1, [0, 5, 29, 48]), (2, [0, 13, 14, 30, 48])):
        padded = torch.tensor(with_repeats(clean, 48, 9), dtype=torch.int32)  # always 9 entries
        draws = draws_of(seed, world, (4, 2, 8), mode="ring", sharding="zigzag", causal=True, variant=0, window=11)
        draws["calls"] = [{"cu": clean}]
        t = _tensors(draws)["calls"][0]
        pos = positions(draws, clean, rank)
        runs = []
        for f, cu in ((fn, padded), (call, tuple(clean))):
            q, k, v = (t[n][:, :, pos].float().requires_grad_() for n in "qkv")
            out = f(q, k, v, cu)
            out.backward(t["dout"][:, :, pos].float())
            runs.append([out.detach(), q.grad, k.grad, v.grad])
        for name, c, e in zip(NAMES, *runs):
            if not torch.allclose(c, e, rtol=TOL, atol=TOL * e.abs().max().item()):
                failures.append(f"layout {clean}: compiled {name} differs from eager by {(c - e).abs().max():.3g}")
    if counter.frame_count != 1:
        failures.append(f"{counter.frame_count} graphs for one padded size")
    torch._dynamo.reset()
    return failures


def test_compiled_padded_boundaries_are_one_graph(dist_pool) -> None:
    """Seen failing: with check_boundary_values's strict test back, which the op runs at run time on the tensor it
    reads (seqpar.attn.ops._options): both ranks raised inside the compiled call."""
    assert dist_pool.run(2, _compiled, timeout=600) == [[], []]


# --------------------------------------------------------------------------- the Hugging Face swap and batches
def _hf_packed(rank: int, world: int, sharding: str) -> None:
    from test_hf_packed import (
        check_against_reference,
        documents,
        packed_batch,
        per_document_reference,
        tiny_llama,
    )

    from seqpar.config import SeqParConfig
    from seqpar.sequence.batch import shard_batch
    from seqpar.swap import swap_attention

    docs = documents()
    ref_loss, ref_grads = per_document_reference(tiny_llama, docs)
    model = tiny_llama(torch.float32)
    group = torch.distributed.group.WORLD if world > 1 else None
    if world > 1:
        swap_attention(model, SeqParConfig(size=world, mode="ring", sharding=sharding), group=group)
    else:
        swap_attention(model)
    batch = packed_batch(docs, True)  # position_ids restarting and cu_seq_lens_q/k
    cu = batch["cu_seq_lens_q"].tolist()
    padded = torch.tensor(with_repeats(cu, cu[-1], len(cu) + 4), dtype=torch.int32)
    batch.update(cu_seq_lens_q=padded, cu_seq_lens_k=padded.clone())
    if world > 1:
        batch = shard_batch(batch, group=group, sharding=sharding)
        assert batch["cu_seq_lens_q"].tolist()[: len(cu)] == cu  # the repeats dropped, the end padding appended
    out = model(**batch)
    out.loss.backward()
    check_against_reference(model, out.loss, ref_loss, ref_grads, world)


@pytest.mark.parametrize("world,sharding", [(1, "contiguous"), (2, "zigzag"), (2, "balanced")])
def test_hf_packed_batch_with_zero_length_documents(dist_pool, world: int, sharding: str) -> None:
    """A collator's packed batch whose cu_seq_lens_q/k carry repeats: loss and every gradient equal each document
    alone in float64 (P = 1 through the swap's own read, P = 2 through shard_batch). Seen failing: with
    batch._check_boundaries's strict test back (all three refused the batch)."""
    dist_pool.run(world, _hf_packed, sharding, timeout=600)


def test_pack_documents_and_dynamic_plan_drop_empty_documents() -> None:
    """pack_documents leaves out an empty document; plan_dynamic plans the others as without it and runs the empty
    one nowhere. Seen failing: plan_dynamic's lengths check back at n < 1 (the zeros refused); pack_documents
    without its filter (IndexError at the labels of an empty last document)."""
    from seqpar.sequence.dynamic import plan_dynamic
    from seqpar.sequence.dynamic_batch import pack_documents

    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 50, (n,), generator=g) for n in (5, 0, 9, 3, 0)]
    got, want = pack_documents(docs), pack_documents([d for d in docs if d.numel()])
    assert got.keys() == want.keys()
    for key in got:
        assert (torch.equal(got[key], want[key]) if isinstance(got[key], torch.Tensor) else got[key] == want[key]), key
    lengths = [40, 0, 7, 100, 0, 33, 0]
    kept = [i for i, n in enumerate(lengths) if n]
    for spread in (False, True):
        plan = plan_dynamic(lengths, 4, 32, spread_heavy=spread, slot_sync=spread)
        base = plan_dynamic([lengths[i] for i in kept], 4, 32, spread_heavy=spread, slot_sync=spread)
        assert plan.lengths == tuple(lengths)
        assert [[(mb.size, mb.index, mb.docs) for mb in s] for s in plan.slots] == [
            [(mb.size, mb.index, tuple(kept[d] for d in mb.docs)) for mb in s] for s in base.slots]
        assert (plan.rank_cost, plan.rank_tokens, plan.rank_bytes) == (base.rank_cost, base.rank_tokens,
                                                                        base.rank_bytes)
        runs = [sum(d in mb.docs for s in plan.slots for mb in s) for d in range(len(lengths))]
        assert runs == [1 if n else 0 for n in lengths]
    with pytest.raises(ValueError, match="integers >= 0"):
        plan_dynamic([4, -1], 4, 32)


def test_hybrid_mixer_model_packed_with_zero_length_documents(monkeypatch) -> None:
    """A swapped Qwen3-Next (Gated DeltaNet mixers and attention) on one process, fed a packed batch whose
    cu_seq_lens_q/k carry repeats: loss and every gradient equal each document alone (float64, transformers' own
    run). The mixers read the batch's boundaries after the swap's read dropped the repeats. Seen failing: with
    batch._check_boundaries returning the boundaries as given (repeats kept): the mixers' own check refused them
    ('must be strictly increasing'), before the mixers' check took repeats too (tests/test_mixers_conv.py's
    zero-length test guards that check now); the test still fails with the swap's read refusing repeats."""
    pytest.importorskip("transformers")
    import mixer_parity as mp
    from test_mixers_gdn import _small_kda_chunks, tiny

    from seqpar.swap import swap_attention

    _small_kda_chunks(monkeypatch)
    docs = mp.documents()
    ref_loss, ref_grads = mp.per_document_reference(lambda dtype: tiny("qwen3_next", dtype), docs)
    model = tiny("qwen3_next", torch.float32)
    swap_attention(model)
    batch = mp.packed_batch(docs)
    cu = batch["cu_seq_lens_q"].tolist()
    padded = torch.tensor(with_repeats(cu, cu[-1], len(cu) + 3), dtype=torch.int32)
    batch.update(cu_seq_lens_q=padded, cu_seq_lens_k=padded.clone())
    out = model(**batch)
    out.loss.backward()
    mp.check(model, out.loss, ref_loss, ref_grads, 1, "one process, zero-length documents")
