"""State that belongs to one forward travels with the call (issue 28 §1, first bullet): two packed batches of the
same length with different document boundaries, forwarded one after the other, then one backward of the sum of
both losses (DPO, forward-forward-backward), under transformers' activation checkpointing, reentrant and not.

The recompute in the backward replays each layer with the arguments its forward saved, so it must see that
forward's boundaries, not the last batch's. One model per mixer family (Mamba v1 in Jamba, whose decoder layer
does not pass the boundaries to its Mamba layer, and in a pure Mamba model, whose layers get none at all; SSD;
Gated DeltaNet; lightning attention; RG-LRU; short convolution) and the attention route (a tiny Llama): every
loss and gradient of a checkpointed run equals the same two batches run without checkpointing, which itself
equals each document run alone by transformers in float64. At SP=1 in this process, and at SP=2 (zigzag) on the
pool for the two Mamba v1 models and Llama."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")

from mixer_parity import ATOL, RTOL, per_document_reference  # noqa: E402

from seqpar.config import SeqParConfig  # noqa: E402
from seqpar.sequence.batch import shard_batch  # noqa: E402
from seqpar.swap import swap_attention  # noqa: E402

WORLD = dist.group.WORLD
# the same total length, different boundaries: a recompute that reads the other batch's boundaries runs without
# a shape error (and a 1-token document and one crossing the SP=2 shard edges are in the first)
LENGTHS = ((7, 1, 23, 3, 11), (20, 9, 16))
VOCAB = 53  # within every tiny model's vocabulary (the Llama's is the smallest)
CHECKPOINTING = ("none", "reentrant", "non-reentrant")


def batches() -> list[list[torch.Tensor]]:
    """The documents of the two packed batches (fresh random tokens)."""
    g = torch.Generator().manual_seed(28)
    return [[torch.randint(3, VOCAB, (n,), generator=g) for n in lengths] for lengths in LENGTHS]


def packed(docs: list[torch.Tensor]) -> dict:
    return transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)([{"input_ids": d.tolist()} for d in docs])


def tiny_model(name: str) -> Callable[[torch.dtype], torch.nn.Module]:
    """tiny(dtype) of ``name``: its family's own tiny model, from its test module (imported only when needed: a
    pool rank imports one)."""
    if name == "llama":
        import hf_tiny
        return hf_tiny.tiny_llama
    if name in ("jamba", "mamba"):
        import test_mixers_mamba as mamba
        return functools.partial(mamba.tiny, "jamba") if name == "jamba" else functools.partial(mamba.tiny_pure, "Mamba")
    if name == "bamba":
        import test_mixers_ssd as ssd
        return functools.partial(ssd.tiny, "bamba")
    if name == "qwen3_next":
        import test_mixers_gdn as gdn
        return functools.partial(gdn.tiny, "qwen3_next")
    if name == "minimax":
        import test_mixers_lightning as lightning
        return lightning.tiny
    if name == "recurrent_gemma":
        import test_mixers_rglru as rglru
        return rglru.tiny
    import test_mixers_conv as conv
    return conv.tiny_lfm2


MODELS = ("jamba", "mamba", "bamba", "qwen3_next", "minimax", "recurrent_gemma", "lfm2", "llama")
SHARDED = ("jamba", "mamba", "llama")


def _enable(model: torch.nn.Module, reentrant: bool) -> None:
    kwargs = {"use_reentrant": reentrant}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers 5.2x; 5.17 has only the old name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def two_forwards_one_backward(tiny: Callable[[torch.dtype], torch.nn.Module], checkpointing: str, world: int = 1,
                              sharding: str = "zigzag") -> tuple[float, dict[str, torch.Tensor]]:
    """fp32 swapped model: forward batch 1, forward batch 2, one backward of the sum of both losses; returns the
    summed loss and every parameter's gradient (summed over the SP ranks). Reentrant checkpointing is enabled
    before the swap and non-reentrant after it: both orders must carry the boundaries."""
    model = tiny(torch.float32).train()
    if checkpointing == "reentrant":
        _enable(model, reentrant=True)
    group = WORLD if world > 1 else None
    if world > 1:
        swap_attention(model, SeqParConfig(size=world, sharding=sharding), group=group)
    else:
        swap_attention(model)
    if checkpointing == "non-reentrant":
        _enable(model, reentrant=False)
    losses = [model(**(shard_batch(packed(docs), group=group, sharding=sharding) if world > 1 else packed(docs))).loss
              for docs in batches()]
    total = losses[0] + losses[1]
    total.backward()
    grads = {}
    for name, p in model.named_parameters():
        grad = (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone().double()
        if world > 1:
            dist.all_reduce(grad)
        grads[name] = grad
    return float(total.detach()), grads


def reference(tiny: Callable[[torch.dtype], torch.nn.Module]) -> tuple[float, dict[str, torch.Tensor]]:
    """float64: each document of both batches run alone by transformers; the two batches' token means summed."""
    loss, grads = 0.0, {}
    for docs in batches():
        one_loss, one_grads = per_document_reference(tiny, docs)
        loss += one_loss
        for name, g in one_grads.items():
            grads[name] = grads[name] + g if name in grads else g
    return loss, grads


def _worst(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[str, float]:
    """The parameter whose gradient is furthest from ``want`` (relative to its own largest entry)."""
    errors = {n: float((got[n] - want[n]).abs().max() / want[n].abs().max().clamp_min(1e-30)) for n in want}
    name = max(errors, key=errors.get)
    return name, errors[name]


def _compare(tiny: Callable[[torch.dtype], torch.nn.Module], world: int, ref: tuple[float, dict]) -> list[str]:
    """Each checkpointing against no checkpointing (same fp32 arithmetic: to 1e-5) and no checkpointing against
    the float64 per-document reference (mixer_parity's tolerances); returns the failures' descriptions."""
    plain_loss, plain = two_forwards_one_backward(tiny, "none", world)
    failed = []
    try:
        assert abs(plain_loss - ref[0]) <= 1e-5 * abs(ref[0]), (plain_loss, ref[0])
        for name, g in plain.items():
            torch.testing.assert_close(g, ref[1].get(name, torch.zeros_like(g)), rtol=RTOL, atol=ATOL,
                                       msg=lambda m, name=name: f"grad of {name}: {m}")
    except AssertionError as e:
        failed.append(f"no checkpointing vs float64 per document: {str(e)[:300]}")
    for checkpointing in CHECKPOINTING[1:]:
        try:
            loss, grads = two_forwards_one_backward(tiny, checkpointing, world)
        except Exception as e:  # non-reentrant checkpointing notices a recompute that differs
            failed.append(f"{checkpointing}: {type(e).__name__}: {str(e)[:200]}")
            continue
        name, err = _worst(grads, plain)
        if abs(loss - plain_loss) > 1e-6 * abs(plain_loss) or err > 1e-5:
            failed.append(f"{checkpointing}: loss {loss} vs {plain_loss}, grad of {name} {100 * err:.3g}% off")
    return failed


@pytest.fixture(scope="module")
def single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny dispatch-bound runs: one thread is faster on a loaded 2-core machine
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("name", MODELS)
def test_two_forwards_one_backward_one_process(single_thread, name):
    tiny = tiny_model(name)
    failed = _compare(tiny, 1, reference(tiny))
    assert not failed, f"{name}: " + "\n".join(failed)


def _sharded(rank: int, world: int, name: str, ref: tuple[float, dict]) -> list[str]:
    return _compare(tiny_model(name), world, ref)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", SHARDED)
def test_two_forwards_one_backward_sharded(dist_pool, single_thread, name):
    ref = reference(tiny_model(name))
    failed = [f"rank {rank}: {message}" for rank, messages in enumerate(dist_pool.run(2, _sharded, name, ref, timeout=240))
              for message in messages]
    assert not failed, f"{name} SP=2: " + "\n".join(failed)
