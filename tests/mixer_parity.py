"""Shared by the mixer tests (test_mixers_conv, test_mixers_mamba, test_mixers_ssd, test_mixers_lightning,
test_mixers_rglru, ...): a packed batch of 5 documents (one crossing shard edges), the float64 reference of each
document run alone by transformers itself, and the check of an fp32 sharded model's loss and every gradient
against it; the swapped layer alone against transformers' layer run on each document (:func:`layer_parity`)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import transformers

import seqpar
from seqpar.config import SeqParConfig
from seqpar.sequence.batch import shard_batch
from seqpar.swap import swap_attention

WORLD = dist.group.WORLD
VOCAB = 61
LENGTHS = (7, 1, 23, 3, 11)  # 45 tokens, padded at the end; the 23-token document crosses shard edges
RTOL, ATOL = 1e-4, 1e-6


def documents() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in LENGTHS]


def packed_batch(docs: list[torch.Tensor]) -> dict:
    return transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)([{"input_ids": d.tolist()} for d in docs])


def per_document_reference(tiny: Callable[[torch.dtype], torch.nn.Module],
                           docs: list[torch.Tensor]) -> tuple[float, dict[str, torch.Tensor]]:
    """float64 loss and gradients of each document run alone by transformers itself, token-weighted."""
    ref = tiny(torch.float64)
    total, count = 0.0, 0
    for d in docs:
        if len(d) < 2:
            continue
        out = ref(input_ids=d[None], labels=d[None])
        total = total + out.loss * (len(d) - 1)
        count += len(d) - 1
    loss = total / count
    loss.backward()
    return float(loss.detach()), {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}


def check(model, loss: torch.Tensor, ref_loss: float, ref_grads: dict, world: int, what: str,
          atol: dict[str, float] | None = None) -> None:
    """fp32 loss within 1e-5 relative and every gradient (summed over the ranks) close to the reference
    (``atol``: per parameter, where a long sequence's fp32 rounding on one process exceeds :data:`ATOL`).

    :data:`ATOL` is capped at 1e-2 of the parameter's own largest reference gradient, floored at 1e-7 of the
    model's largest (the fp32 rounding of a gradient that is ~0, Qwen3.5-MoE's ``dt_bias`` at 7e-8: 1.4e-9 off at
    SP = 2): Zamba2's shared attention has q / k projection gradients of 4e-7 - 5e-7 at most, below the
    absolute 1e-6 (one process in fp32 errs by at most 5% of this bound on the families' tiny models).
    Seen failing: dq doubled in ``seqpar_attention_forward`` (``query + (query - query.detach())``) ->
    Zamba2's ``shared_transformer.self_attn.q_proj.weight`` 2x off; with the absolute 1e-6 alone
    test_zamba2_with_activation_checkpointing passed it."""
    loss = float(loss.detach())
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (what, loss, ref_loss)
    checked = 0
    top = max((float(g.abs().max()) for g in ref_grads.values()), default=0.0)
    for name, p in model.named_parameters():
        grad = (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone().double()
        if world > 1:
            dist.all_reduce(grad)
        want = ref_grads.get(name, torch.zeros_like(grad))
        own = float(want.abs().max())
        floor = min(ATOL, max(1e-2 * own, 1e-7 * top)) if own > 0 else ATOL  # a small parameter on its own scale
        torch.testing.assert_close(grad, want, rtol=RTOL, atol=max(floor, (atol or {}).get(name, 0.0)),
                                   msg=lambda m, name=name: f"{what}: grad of {name}: {m}")
        checked += 1
    assert checked == len(list(model.parameters()))


def modes(world: int) -> list[dict]:
    out = [{"mode": "ring"}, {"mode": "allgather"}, {"mode": "ulysses"}]
    if world >= 4:
        out.append({"mode": "hybrid", "ulysses_size": 2})
    return out


RING_AND_ULYSSES = [{"mode": "ring"}, {"mode": "ulysses"}]  # the shorter mode list of the balanced / extra cases


def assert_modes_run(dist_pool: Any, world: int, parity: Callable[..., list[str]], *args: Any,
                     mode_list: list[dict] | None = None) -> None:
    """``parity(rank, world, *args[, mode_list])`` (a :func:`sharded_parity` per rank, timeout 600 s) on
    ``world`` ranks ran every mode of ``mode_list`` (default: every mode at that size, :func:`modes`).

    Seen failing: with :func:`sharded_parity` running only the first two modes (test_mixers_lightning)."""
    expected = [m["mode"] for m in (modes(world) if mode_list is None else mode_list)]
    run_args = args if mode_list is None else (*args, mode_list)
    assert dist_pool.run(world, parity, *run_args, timeout=600)[0] == expected


def assert_bytes_as_theory(dist_pool: Any, world: int, parity: Callable[..., tuple[int, int]], *args: Any,
                           cases: list[list[int]]) -> None:
    """``parity(rank, world, *args, cu) -> (counted bytes, theory)`` (a :func:`layer_parity` or a scan's,
    checking outputs and gradients itself) for each ``cu`` of ``cases``: on one process (``world`` 1, run
    here) nothing is sent; on ``world`` ranks (timeout 300 s) every rank sends the theory's bytes, not none
    (flat in S: (T, state) per chunk, whatever the shard length).

    Seen failing: with :func:`seqpar.mixers.state_passing.summary_bytes` counting ``world`` peers, every case
    of test_mixers_lightning, test_mixers_rglru and test_mixers_gdn's scan (one process included)."""
    for cu in cases:
        if world == 1:
            assert parity(0, 1, *args, cu) == (0, 0)
            continue
        for counted, theory in dist_pool.run(world, parity, *args, cu, timeout=300):
            assert counted == theory > 0, (counted, theory)


def sharded_parity(tiny: Callable[[torch.dtype], torch.nn.Module], routes: dict[str, str], world: int, sharding: str,
                   mode_list: list[dict] | None = None,
                   reference: tuple[float, dict[str, torch.Tensor]] | None = None,
                   docs: list[torch.Tensor] | None = None, atol: dict[str, float] | None = None) -> list[str]:
    """Swap an fp32 ``tiny`` at SP=world for each attention mode and check it against the reference
    (``per_document_reference(tiny, docs)``, computed here unless given) on the packed ``docs`` (default:
    :func:`documents`; ``atol``: see :func:`check`); returns the modes run (call on every rank)."""
    docs = documents() if docs is None else docs
    ref_loss, ref_grads = reference if reference is not None else per_document_reference(tiny, docs)
    done = []
    for mode in mode_list if mode_list is not None else modes(world):
        # the hybrid takes its Ulysses and ring groups from a manager; the mixers then use its SP group
        manager = seqpar.init_process_groups(sp_size=world, ulysses_size=2) if mode["mode"] == "hybrid" else None
        group = None if manager is not None else WORLD
        try:
            model = tiny(torch.float32)
            report = swap_attention(model, SeqParConfig(size=world, sharding=sharding, **mode), group=group)
            assert report.routes == routes, report.routes
            out = model(**shard_batch(packed_batch(docs), group=group, sharding=sharding))
            out.loss.backward()
            check(model, out.loss, ref_loss, ref_grads, world, f"{mode} {sharding}", atol)
        finally:
            if manager is not None:
                seqpar.destroy_process_groups(manager)
        done.append(mode["mode"])
    return done


def one_process_parity(tiny: Callable[[torch.dtype], torch.nn.Module], config: dict | None = None) -> None:
    """The swapped model on one process, fed the packed batch, equals each document run alone.
    ``config``: the swap's (default: seqpar's defaults)."""
    docs = documents()
    ref_loss, ref_grads = per_document_reference(tiny, docs)
    model = tiny(torch.float32)
    swap_attention(model, config)
    out = model(**packed_batch(docs))
    out.loss.backward()
    check(model, out.loss, ref_loss, ref_grads, 1, "one process")


def elementwise(tol: float) -> Callable[[torch.Tensor, torch.Tensor, str], None]:
    """A check ``close(got, want, what)``: every entry within ``tol`` (relative and absolute)."""
    def close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
        torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")
    return close


def relative_to_largest(tol: float) -> Callable[[torch.Tensor, torch.Tensor, str], None]:
    """A check ``close(got, want, what)``: the largest error within ``tol`` of ``want``'s largest entry (for
    layers that run parts in fp32 even in float64: their roundings depend on the summation order), and
    ``want`` not all zero."""
    def close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
        err, scale = float((got.double() - want.double()).abs().max()), float(want.abs().max())
        assert err <= tol * scale and scale > 0, (what, err, scale)
    return close


def document_positions(seq: int, rank: int, world: int, sharding: str, cu: list[int]) -> torch.Tensor:
    """``(1, seq_local)``: the position of each of this rank's tokens within its document (position_ids
    restart at each start in ``cu``, as in a packed batch)."""
    from seqpar.sequence.sharding import shard_index

    positions = shard_index(seq, rank, world, sharding, cu_seqlens=cu)  # global positions of the shard
    starts = torch.tensor(cu)
    return (positions - starts[torch.searchsorted(starts, positions, right=True) - 1])[None]


def layer_parity(world: int, rank: int, layer64: torch.nn.Module, sp_class: type, call: Callable[..., torch.Tensor],
                 sharding: str, cu: list[int], batch: int, hidden: int,
                 close: Callable[[torch.Tensor, torch.Tensor, str], None], what: str) -> int:
    """The float64 layer swapped at SP=``world`` (``sp_class(layer, group=, sharding=)``) against the layer
    itself run on each document of ``cu`` alone: the gathered output, the input's gradient and every
    parameter's gradient (summed over the ranks) pass ``close(got, want, what)``. Inputs and the output's
    gradient ``(batch, cu[-1], hidden)`` float64, fresh random. ``call(layer, x, position_ids, **kwargs) ->
    output`` runs a layer (kwargs: ``cu_seq_lens_q``). Returns the collective bytes of the sharded forward
    (counted, :func:`seqpar.testing.traffic.counting`).

    Seen failing: with :func:`seqpar.mixers.state_passing.scalar_decay_correction` returning zeros (no
    incoming state), every sharded case of test_mixers_lightning / rglru / mamba / ssd fails here."""
    from seqpar.sequence.sharding import gather_sequence, shard_sequence
    from seqpar.testing.traffic import counting

    seq = cu[-1]
    g = torch.Generator().manual_seed(9)
    h = torch.randn(batch, seq, hidden, generator=g, dtype=torch.float64)
    grad = torch.randn(batch, seq, hidden, generator=g, dtype=torch.float64)
    ref_h = h.clone().requires_grad_()
    ref = torch.cat([call(layer64, ref_h[:, a:b], torch.arange(b - a)[None]) for a, b in zip(cu, cu[1:])], dim=1)
    (ref * grad).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in layer64.named_parameters()}
    layer64.zero_grad()
    group = WORLD if world > 1 else None
    sp = sp_class(layer64, group=group, sharding=sharding)
    h_sp = h.clone().requires_grad_()
    local = shard_sequence(h_sp, 1, group=group, sharding=sharding, cu_seqlens=cu)
    positions = document_positions(seq, rank, world, sharding, cu)
    with counting(world) as traffic:
        out = call(sp, local, positions, cu_seq_lens_q=torch.tensor(cu, dtype=torch.int32))
    (out * shard_sequence(grad, 1, group=group, sharding=sharding, cu_seqlens=cu)).sum().backward()
    close(gather_sequence(out.detach(), 1, group=group, sharding=sharding, cu_seqlens=cu), ref.detach(),
          f"{what}: output")
    if world > 1:
        dist.all_reduce(h_sp.grad)
    close(h_sp.grad, ref_h.grad, f"{what}: grad of the input")
    for n, p in sp.named_parameters():
        if world > 1:
            dist.all_reduce(p.grad)
        close(p.grad, ref_grads[n], f"{what}: grad of {n}")
    return traffic.collective_bytes


def scan_parity(world: int, inputs: dict[str, torch.Tensor], grad: torch.Tensor, seq_names: tuple[str, ...], dim: int,
                reference: Callable[[dict[str, torch.Tensor]], torch.Tensor],
                sharded: Callable[[dict[str, torch.Tensor], Any, Any], torch.Tensor], sharding: str,
                cu: list[int] | None, close: Callable[[torch.Tensor, torch.Tensor, str], None], what: str) -> None:
    """A sharded scan at SP=``world`` against its reference on the whole sequence: ``reference(inputs) ->
    out`` (each document alone) and ``sharded(local inputs, layout, group) -> this rank's out``, where the
    ``seq_names`` inputs are cut along ``dim`` (the sequence dimension of ``grad``, the output's gradient)
    and ``layout`` is :func:`seqpar.mixers.scan_layout.scan_layout` of ``cu``. The gathered output and
    every input's gradient (summed over the ranks) pass ``close(got, want, what)``.

    Seen failing: with :func:`seqpar.mixers.state_passing.scalar_decay_correction` returning zeros, every
    sharded scan case of test_mixers_mamba and test_mixers_ssd fails here."""
    from seqpar.mixers.scan_layout import scan_layout
    from seqpar.sequence.sharding import gather_sequence, shard_sequence

    ref_in = {k: v.clone().requires_grad_() for k, v in inputs.items()}
    ref = reference(ref_in)
    (ref * grad).sum().backward()
    group = WORLD if world > 1 else None
    ins = {k: v.clone().requires_grad_() for k, v in inputs.items()}
    local = {k: (shard_sequence(v, dim, group=group, sharding=sharding, cu_seqlens=cu) if k in seq_names else v)
             for k, v in ins.items()}
    layout = scan_layout(grad.shape[dim] // world, group=group, sharding=sharding, cu_seqlens=cu)
    out = sharded(local, layout, group)
    (out * shard_sequence(grad, dim, group=group, sharding=sharding, cu_seqlens=cu)).sum().backward()
    full = gather_sequence(out.detach(), dim, group=group, sharding=sharding, cu_seqlens=cu)
    close(full, ref.detach(), f"{what}: output")
    for k in inputs:
        got = ins[k].grad.clone()
        if world > 1:
            dist.all_reduce(got)  # each rank holds its share of the full gradient
        close(got, ref_in[k].grad, f"{what}: grad {k}")


def scan_traffic(world: int, inputs: dict[str, torch.Tensor], seq_names: tuple[str, ...], dim: int, sharding: str,
                 sharded: Callable[[dict[str, torch.Tensor], Any, Any], Any]) -> tuple[Any, Any]:
    """``(traffic, layout)``: what ``sharded(local inputs, layout, group)`` sends on the default group at
    SP=``world`` (:func:`seqpar.testing.traffic.counting`), the ``seq_names`` inputs cut along ``dim``, one
    document; ``layout``: the :func:`seqpar.mixers.scan_layout.scan_layout` it ran with."""
    from seqpar.mixers.scan_layout import scan_layout
    from seqpar.sequence.sharding import shard_sequence
    from seqpar.testing.traffic import counting

    local = {k: (shard_sequence(v, dim, group=WORLD, sharding=sharding) if k in seq_names else v)
             for k, v in inputs.items()}
    layout = scan_layout(inputs[seq_names[0]].shape[dim] // world, group=WORLD, sharding=sharding)
    with counting(world) as traffic:
        sharded(local, layout, WORLD)
    return traffic, layout


def assert_summary_bytes_flat(dist_pool: Any, world: int, summary_traffic: Callable[..., tuple], sharding: str,
                              seqs: tuple[int, int]) -> None:
    """``summary_traffic(rank, world, sharding, seq) -> (collective bytes, p2p bytes, theory, calls)`` at the
    two sequence lengths ``seqs``: on every rank the collective bytes are the theory's (one all-gather of
    (T, state) per chunk) at both, nonzero, and nothing goes point to point (the scan alone has no halo).

    Seen failing: with :func:`seqpar.mixers.state_passing.summary_bytes` counting ``world`` peers instead of
    ``world - 1``, every case of test_mixers_mamba and test_mixers_ssd fails here."""
    short = dist_pool.run(world, summary_traffic, sharding, seqs[0])
    long = dist_pool.run(world, summary_traffic, sharding, seqs[1])
    for (got, p2p, theory, calls), (got_long, _, _, _) in zip(short, long):
        assert (got, got_long) == (theory, theory) and theory > 0, (calls, got, got_long, theory)
        assert p2p == 0


def checkpointed_parity(tiny: Callable[[torch.dtype], torch.nn.Module], world: int) -> None:
    """The fp32 ``tiny`` in train mode with activation checkpointing (:func:`hf_tiny.enable_checkpointing`),
    swapped at SP=``world`` (zigzag), on the packed :func:`documents`: loss and every gradient against each
    document run alone (:func:`check`). The recompute in the backward repeats the mixers' halo exchanges,
    scans and summary all-gathers on every rank alike, with the documents of the batch's forward.

    Seen failing: Jamba's (test_mixers_mamba) with SwappedMixer.cu_seqlens ignoring the documents the
    decoder layer's call carries."""
    from hf_tiny import enable_checkpointing

    docs = documents()
    ref_loss, ref_grads = per_document_reference(tiny, docs)
    model = tiny(torch.float32).train()
    enable_checkpointing(model)
    swap_attention(model, SeqParConfig(size=world, sharding="zigzag"), group=WORLD)
    out = model(**shard_batch(packed_batch(docs), group=WORLD, sharding="zigzag"))
    out.loss.backward()
    check(model, out.loss, ref_loss, ref_grads, world, "checkpointed")


def assert_swap_keeps_state(model: torch.nn.Module, path: str, class_name: str) -> Any:
    """Swapping ``model`` keeps its parameters (the same objects under the same names), its buffers (the
    same objects) and its state_dict keys; so does swapping it again with other options (zigzag), which
    rebuilds the mixer layer at ``path`` with them, still named after its transformers class ``class_name``.
    Returns the second swap's report.

    Seen failing: with SwappedMixer registering copies of the original's buffers, in test_mixers_lightning
    and test_mixers_ssd (the families with buffers)."""
    before = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    keys = list(model.state_dict())
    for config in (None, SeqParConfig(sharding="zigzag")):  # then again, with other options
        report = swap_attention(model, config)
        assert dict(model.named_parameters()) == before and list(model.state_dict()) == keys
        assert all(b is buffers[n] for n, b in model.named_buffers())
    layer = model.get_submodule(path)
    assert (layer.sharding, layer.original_class) == ("zigzag", class_name)
    return report


def assert_left_out_refused(model: torch.nn.Module, swap: tuple[str, ...], path: str, class_name: str) -> None:
    """Swapping ``model`` with ``swap`` limited to other modules fails naming the mixer layer at ``path``
    and its transformers class ``class_name`` (the position-mixing probe finds it), and leaves it as it was."""
    import re

    import pytest

    from seqpar.swap import SwapError

    with pytest.raises(SwapError, match=re.escape(path) + ".*" + class_name):
        swap_attention(model, SeqParConfig(swap=swap))
    assert type(model.get_submodule(path)).__name__ == class_name


def assert_clear_call_errors(layer: torch.nn.Module, call: Callable[..., torch.Tensor], hidden: int,
                             cache: dict[str, Any]) -> None:
    """The swapped ``layer`` refuses a generation cache (``cache``: the keyword argument that passes one) and
    documents that do not end at the sequence's length, each with an error naming the problem.
    ``call(layer, x, position_ids, **kwargs)`` runs the layer on ``x`` ``(1, seq, hidden)``.

    Seen failing: with SwappedMixer.refuse_cache refusing nothing, in test_mixers_lightning / rglru / mamba / ssd."""
    import pytest

    with pytest.raises(ValueError, match="cache"):
        call(layer, torch.randn(1, 5, hidden), torch.arange(5)[None], **cache)
    with pytest.raises(ValueError, match=r"cu_seqlens \[0, 4, 9\] must not decrease, running from 0 to the global"):
        call(layer, torch.randn(1, 10, hidden), torch.arange(10)[None], cu_seq_lens_q=torch.tensor([0, 4, 9]))


def layer_bf16_errors(world: int, rank: int, layer64: torch.nn.Module, sp_class: type,
                      call: Callable[..., torch.Tensor], cu: list[int], hidden: int) -> tuple[float, float]:
    """Largest error against the float64 layer run on each document alone of: the layer swapped in bf16 at
    SP=``world`` (zigzag), and transformers' own layer in bf16 on one process (each document alone).
    ``call(layer, x, position_ids, **kwargs) -> output`` runs a layer (kwargs: ``cu_seq_lens_q``)."""
    from seqpar.sequence.sharding import gather_sequence, shard_sequence

    seq = cu[-1]
    h = torch.randn(1, seq, hidden, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    docs = list(zip(cu, cu[1:]))
    with torch.no_grad():
        exact = torch.cat([call(layer64, h[:, a:b], torch.arange(b - a)[None]) for a, b in docs], dim=1)
        own_layer = copy.deepcopy(layer64).bfloat16()
        own = torch.cat([call(own_layer, h[:, a:b].bfloat16(), torch.arange(b - a)[None]) for a, b in docs], dim=1)
        sp = sp_class(copy.deepcopy(layer64).bfloat16(), group=WORLD, sharding="zigzag")
        positions = document_positions(seq, rank, world, "zigzag", cu)
        out = call(sp, shard_sequence(h.bfloat16(), 1, group=WORLD, sharding="zigzag"), positions,
                   cu_seq_lens_q=torch.tensor(cu, dtype=torch.int32))
        assert out.dtype == torch.bfloat16
        full = gather_sequence(out, 1, group=WORLD, sharding="zigzag").double()
    return float((full - exact).abs().max()), float((own.double() - exact).abs().max())


def simple_gla_by_token(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g_gamma: torch.Tensor, scale: float,
                        output_final_state: bool, initial_state: torch.Tensor | None = None,
                        cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A fake of flash-linear-attention's ``chunk_simple_gla``: simple GLA token by token in its layout.

    q, k: (batch, seq, heads, dk); v: (batch, seq, heads, dv); g_gamma: (heads,) log decays. Returns the output
    (batch, seq, heads, dv) and the final state (batch, heads, dk, dv). ``initial_state`` and ``cu_seqlens`` are
    accepted for the kernel's signature and ignored: callers that depend on them assert they are None."""
    state = q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3])
    outs = []
    for t in range(q.shape[1]):
        state = g_gamma.exp()[:, None, None] * state + k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, t], state))
    return torch.stack(outs, dim=1), state
