"""Activation offload on a model and its ``copy.deepcopy``, both training with checkpointing (a second trainable
model, an EMA/teacher with gradients, TRL's ``sync_ref_model``): each model's offloaded calls are recorded and
prefetched in its own state, through its own transfer, and both models' gradients stay exact under interleaved
forwards and backwards.

Offload is enabled through the documented key (``seqpar.apply_tiling(model, {"offload_activations": True})``; the
swap calls the same). On CPU the CUDA transfer is an exact no-op, so ``offload.CudaTransfer`` is replaced by a
stand-in that copies each input away and back and logs what it moved, as the model fuzzer does."""

from __future__ import annotations

import copy
import itertools
from typing import Any

import pytest
import torch
from hf_tiny import enable_checkpointing, family_config

transformers = pytest.importorskip("transformers")

import seqpar  # noqa: E402
from seqpar.memory import offload  # noqa: E402
from seqpar.testing.fuzz_models import HostCopyTransfer  # noqa: E402

LAYERS = 3
EVENTS: list[tuple[int, str, int]] = []  # (id of the transfer, "offload" / "prefetch", offload number)
_NUMBERS = itertools.count()


class _LoggedTransfer(HostCopyTransfer):
    """Copies away and back (HostCopyTransfer) and logs each move, naming the transfer object that made it."""

    def to_host(self, t: torch.Tensor) -> Any:
        n = next(_NUMBERS)
        EVENTS.append((id(self), "offload", n))
        return n, super().to_host(t)

    def prefetch(self, handle: Any) -> Any:
        EVENTS.append((id(self), "prefetch", handle[0]))
        return super().prefetch(handle[1])


def _base() -> Any:
    torch.manual_seed(21)
    cfg = transformers.LlamaConfig(**family_config(num_hidden_layers=LAYERS))
    cfg._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(cfg).double()


def _inputs(seed: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 20), generator=torch.Generator().manual_seed(seed))


def _loss(model: Any, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def _grads(model: Any) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], who: str, tol: float = 1e-12) -> None:
    assert set(got) == set(want)
    for name, ref in want.items():
        scale = ref.abs().max().item()
        assert scale > 0, (who, name)
        err = float((got[name] - ref).abs().max()) / scale
        assert err <= tol, (who, name, err)


def _offloads_and_prefetches(events: list[tuple[int, str, int]]) -> dict[int, list[tuple[str, int]]]:
    by_transfer: dict[int, list[tuple[str, int]]] = {}
    for tid, kind, n in events:
        by_transfer.setdefault(tid, []).append((kind, n))
    return by_transfer


def _state(model: Any) -> offload.OffloadState:
    """The offload state a model's layers record their calls in (each layer's wrapped checkpoint function)."""
    states = {id(layer._gradient_checkpointing_func.state): layer._gradient_checkpointing_func.state
              for layer in model.model.layers}
    assert len(states) == 1, "the layers of one model share one state"
    return next(iter(states.values()))


# Each pattern: a list of steps; ("f", model, seed) runs a forward and keeps its loss, ("b", model) back-propagates
# the sum of that model's kept losses. "o" is the original, "c" the copy.
PATTERNS = {
    "orig-fwd-copy-fwd-orig-bwd-copy-bwd": [("f", "o", 1), ("f", "c", 2), ("b", "o"), ("b", "c")],
    "orig-fwd-copy-fwd-copy-bwd-orig-bwd": [("f", "o", 1), ("f", "c", 2), ("b", "c"), ("b", "o")],
    "two-orig-fwds-between-copy-fwd-one-bwd": [("f", "o", 1), ("f", "c", 2), ("f", "o", 3), ("b", "o"), ("b", "c")],
    "two-copy-fwds-one-bwd-then-orig": [("f", "c", 4), ("f", "o", 5), ("f", "c", 6), ("b", "c"), ("b", "o")],
}


@pytest.mark.parametrize("pattern", list(PATTERNS), ids=list(PATTERNS))
def test_a_deep_copy_trains_with_offload_apart_from_the_original(pattern: str, monkeypatch) -> None:
    """Both models' parameter gradients equal a float64 single-process run without checkpointing or offload
    (each against its own scale); every offload and prefetch of a model goes through that model's own transfer,
    each model's prefetches are its own layers, last first, one ahead; and both states are empty at the end."""
    monkeypatch.setattr(offload, "CudaTransfer", _LoggedTransfer)
    EVENTS.clear()
    base = _base()
    vocab = base.config.vocab_size
    models = {"o": copy.deepcopy(base)}
    enable_checkpointing(models["o"])
    seqpar.apply_tiling(models["o"], {"offload_activations": True})
    models["c"] = copy.deepcopy(models["o"])  # after offload was enabled: the copy carries the hooks
    with torch.no_grad():  # the copy is another model's weights (it trains on its own)
        for p in models["c"].parameters():
            p.add_(torch.randn_like(p) * 0.05)
    refs = {k: copy.deepcopy(base) for k in models}  # float64, no checkpointing, no offload
    for k, r in refs.items():
        r.load_state_dict(models[k].state_dict())
    for m in (*models.values(), *refs.values()):
        m.train()

    kept: dict[str, list[torch.Tensor]] = {"o": [], "c": []}
    owner_of: dict[int, str] = {}  # transfer id -> the model whose forward offloaded through it
    order: dict[str, list[tuple[str, int]]] = {"o": [], "c": []}  # what each model's steps moved, in order
    for step in PATTERNS[pattern]:
        start = len(EVENTS)
        if step[0] == "f":
            _, who, seed = step
            kept[who].append(_loss(models[who], _inputs(seed, vocab)))
            _loss(refs[who], _inputs(seed, vocab)).backward()  # the reference sums its calls' gradients
        else:
            who = step[1]
            sum(kept[who]).backward()
            kept[who] = []
        for tid, kind, n in EVENTS[start:]:
            if kind == "offload":
                owner_of.setdefault(tid, who)
            # a step of one model moves nothing through the other model's transfer (seen failing: one shared
            # state -> the copy's offloads go through the original's transfer, owned by "o")
            assert owner_of.get(tid) == who, (pattern, step, EVENTS[start:], owner_of)
            order[who].append((kind, n))
    assert sorted(owner_of.values()) == ["c", "o"], owner_of  # two transfers, one per model

    # each model's prefetches are its own offloads, each backward's last layer first (fetched at once), then the
    # one before it started one layer ahead (seen failing: calls shared between the models -> the copy's first
    # layer's backward prefetches the original's last layer)
    for who, moves in order.items():
        offloads = [n for kind, n in moves if kind == "offload"]
        prefetches = [n for kind, n in moves if kind == "prefetch"]
        assert sorted(prefetches) == offloads, (who, moves)
        forwards = [offloads[i:i + LAYERS] for i in range(0, len(offloads), LAYERS)]
        assert all(len(f) == LAYERS for f in forwards), (who, moves)
        for f in forwards:
            mine = [n for n in prefetches if n in f]
            assert mine == f[::-1], (who, f, prefetches)
    for who in models:
        _assert_exact(_grads(models[who]), _grads(refs[who]), who)
    states = {who: _state(m) for who, m in models.items()}
    assert states["o"] is not states["c"] and states["o"].transfer is not states["c"].transfer
    assert states["o"].calls == [] and states["c"].calls == [], states


def test_a_forward_never_back_propagated_leaves_nothing_in_the_state(monkeypatch) -> None:
    """A forward under grad whose loss is dropped (an evaluation under grad, an exception before backward) leaves
    no call in the state, so its host copies are freed, and the next step prefetches only its own layers, exact."""
    import gc
    import weakref

    monkeypatch.setattr(offload, "CudaTransfer", _LoggedTransfer)
    EVENTS.clear()
    base = _base()
    model = copy.deepcopy(base)
    enable_checkpointing(model)
    seqpar.apply_tiling(model, {"offload_activations": True})
    model.train()
    ids = _inputs(7, base.config.vocab_size)
    dropped = _loss(model, ids)
    held = [weakref.ref(c()) for c in _state(model).calls]
    assert len(held) == LAYERS
    del dropped
    gc.collect()
    # seen failing: calls held strongly -> the dropped forward's 3 calls (and their host copies) stay alive
    assert [r() for r in held] == [None] * LAYERS
    assert _state(model).pending() == []
    start = len(EVENTS)
    _loss(model, ids).backward()
    moves = [(kind, n) for _, kind, n in EVENTS[start:]]
    offloads = [n for kind, n in moves if kind == "offload"]
    assert [n for kind, n in moves if kind == "prefetch"] == offloads[::-1], moves
    ref = copy.deepcopy(base).train()
    _loss(ref, ids).backward()
    _assert_exact(_grads(model), _grads(ref), "model")
    assert _state(model).calls == []


def _sp_copy_task(rank: int, world: int) -> dict[str, Any]:
    """Every rank: a swapped float64 Llama with offload (the stand-in transfer) and checkpointing, deep-copied and
    perturbed; the copy-first and two-forward interleavings; each model's gradients summed over the SP ranks, and
    whether every move of a step went through that step's model's own transfer."""
    import torch.distributed as dist

    from seqpar.testing.fuzz_models import sp_summed_grads

    saved = offload.CudaTransfer
    offload.CudaTransfer = _LoggedTransfer
    try:
        EVENTS.clear()
        cfg = {"size": world, "sharding": "zigzag", "offload_activations": True}
        models = {"o": _base()}
        seqpar.swap_attention(models["o"], cfg, group=dist.group.WORLD)
        enable_checkpointing(models["o"])
        models["c"] = copy.deepcopy(models["o"])
        torch.manual_seed(22)  # the same perturbation on every rank
        with torch.no_grad():
            for p in models["c"].parameters():
                p.add_(torch.randn_like(p) * 0.05)
        for m in models.values():
            m.train()
        kept: dict[str, list[torch.Tensor]] = {"o": [], "c": []}
        owner_of: dict[int, str] = {}
        own = True
        steps = [("f", "o", 1), ("f", "c", 2), ("b", "c"), ("f", "o", 3), ("b", "o")]
        for step in steps:
            start = len(EVENTS)
            if step[0] == "f":
                ids = _inputs(step[2], models["o"].config.vocab_size)
                local = seqpar.shard_batch({"input_ids": ids, "labels": ids.clone()}, group=dist.group.WORLD,
                                           sharding="zigzag")
                kept[step[1]].append(models[step[1]](**local).loss)
            else:
                sum(kept[step[1]]).backward()
            for tid, kind, _ in EVENTS[start:]:
                if kind == "offload":
                    owner_of.setdefault(tid, step[1])
                own = own and owner_of.get(tid) == step[1]
        return {"events": list(EVENTS), "own": own and sorted(owner_of.values()) == ["c", "o"] and len(EVENTS) == 3 * 2 * LAYERS,
                "grads": {k: sp_summed_grads(m, dist.group.WORLD) for k, m in models.items()},
                "params": {k: {n: p.detach().clone() for n, p in m.named_parameters()} for k, m in models.items()}}
    finally:
        offload.CudaTransfer = saved


def test_a_swapped_models_deep_copy_trains_with_offload_at_sp_2(dist_pool) -> None:
    """At SP = 2 (gloo, zigzag): both models' SP-summed gradients equal one float64 process's without seqpar,
    checkpointing or offload, each against its own scale; every move went through its own model's transfer."""
    results = dist_pool.run(2, _sp_copy_task, timeout=240)
    for r in results:
        assert r["own"], ("a step moved a tensor through the other model's transfer, or the count is off", r["events"])
    got = results[0]
    for who, seeds in (("o", (1, 3)), ("c", (2,))):
        ref = _base()
        ref.load_state_dict(got["params"][who])
        ref.train()
        for seed in seeds:
            _loss(ref, _inputs(seed, ref.config.vocab_size)).backward()
        # 1e-6 of each parameter's own scale: transformers' causal-LM loss casts the logits to fp32 (`logits.float()`,
        # a float64 model's too), on both sides; that rounding alone puts one process's float64 gradients 1.1e-7 off
        # a float64 cross-entropy's (measured, this model). A prefetch of the wrong input is O(1) off
        _assert_exact(got["grads"][who], _grads(ref), who, tol=1e-6)
