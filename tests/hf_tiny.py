"""Shared pieces of the Trainer / accelerate / PEFT tests: a tiny Llama, its data, the reference; and the check
of a sharded model's gradients against a one-process reference (:func:`assert_grads_equal`, the HF swap tests)
and a swapped model on one sharded sequence against the unswapped one on the whole (:func:`full_sequence_parity`).

The reference is single-device training on the full sequences with plain PyTorch (no seqpar, no
engine), in float64, so a seqpar run (fp32) must match it to ~1e-5 relative; the tests allow 1e-4.
Every run trains with plain SGD (:func:`sgd`): its step is proportional to the gradient, so a
gradient scaled by the SP size changes the losses from the second step on (by ~1e-3 relative at
``LR``), where Adam's step is scale-invariant and would hide it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from seqpar.testing.launcher_env import launcher_env  # noqa: F401 - the tests import it from here

VOCAB = 53
SEQ = 14  # not a multiple of 2 x SP: the cut pads at the end
ROWS = 10  # samples in the data set: 5 steps of batch 2
LR = 0.1  # SGD: large enough that a gradient x2 moves step 1's loss by ~1e-3 relative (tolerance 1e-4)


def sgd(params: Any) -> torch.optim.Optimizer:
    """The optimizer of every run and reference here: plain SGD at ``LR`` (see the module docstring)."""
    return torch.optim.SGD(params, lr=LR)


def enable_checkpointing(model: Any) -> None:
    """Non-reentrant HF activation checkpointing on any transformers 5.x: 5.2x names it
    ``activation_checkpointing_enable`` (``gradient_checkpointing_enable`` deprecated), 5.17 (the lent
    GPU machines' version) only has ``gradient_checkpointing_enable``."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def family_config(**overrides: Any) -> dict[str, Any]:
    """Fields of a tiny Llama-family config (Llama, Qwen2, Mistral, Phi3, Gemma take them all), with
    ``overrides`` applied: for the tiling and norm swaps' per-family tests."""
    return {"vocab_size": 211, "hidden_size": 32, "intermediate_size": 96, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
            "tie_word_embeddings": False, "use_cache": False, "bos_token_id": 1, "eos_token_id": 2,
            **overrides}


def tiny_llama(dtype: torch.dtype = torch.float32) -> Any:
    """A 2-layer GQA Llama with seeded random weights (the same on every rank)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(dtype)


def swapped_one_layer_llama(world: int) -> Any:
    """A float64 one-layer GQA Llama (vocab 64, 4 query / 2 K/V heads of 8) swapped for SP over ``world`` ranks, with
    seqpar's process groups made from ``{"size": world}`` (the default manager); seeded, the same on every rank."""
    import transformers

    import seqpar

    block = {"size": world}
    seqpar.init_process_groups(config=block)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).double()
    seqpar.swap_attention(model, block)
    return model


def samples() -> list[dict[str, torch.Tensor]]:
    """``ROWS`` fresh random token sequences (labels = input_ids, the HF causal-LM convention)."""
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


class ListDataset(torch.utils.data.Dataset):
    def __init__(self, items: list[dict[str, torch.Tensor]]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.items[i]


def reference_losses(steps: int, batch: int, make_model: Callable[[torch.dtype], Any] = tiny_llama,
                     params: Callable[[Any], Any] | None = None, eval_rows: int = 0) -> list[float]:
    """Per-step losses of single-device SGD training on ``batch`` rows per step, in float64; with
    ``eval_rows``, followed by the trained model's loss on the first ``eval_rows`` samples."""
    model = make_model(torch.float64)
    trainable = [p for p in (params(model) if params else model.parameters()) if p.requires_grad]
    opt = sgd(trainable)
    data = samples()
    losses = []
    for step in range(steps):
        rows = [data[(step * batch + i) % len(data)] for i in range(batch)]
        ids = torch.stack([r["input_ids"] for r in rows])
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    if eval_rows:
        ids = torch.stack([r["input_ids"] for r in data[:eval_rows]])
        with torch.no_grad():
            losses.append(model(input_ids=ids, labels=ids).loss.item())
    return losses


# Packed batches (transformers.DataCollatorWithFlattening): documents of varied lengths, packed
# DOCS_PER_ROW to a row. Row lengths 15, 22, 22, 23, 26: most need end padding for zigzag over 2; a
# 1-token document has nothing to predict.
DOC_LENGTHS = (5, 1, 9, 12, 3, 7, 14, 2, 6, 11, 4, 8, 13, 10, 3)
DOCS_PER_ROW = 3


def documents() -> list[dict[str, torch.Tensor]]:
    """Fresh random documents of :data:`DOC_LENGTHS` tokens (labels = input_ids)."""
    g = torch.Generator().manual_seed(4321)
    docs = [torch.randint(0, VOCAB, (n,), generator=g) for n in DOC_LENGTHS]
    return [{"input_ids": d, "labels": d.clone()} for d in docs]


def targets_per_row(docs_per_row: int = DOCS_PER_ROW) -> list[int]:
    """Real target tokens of each packed row: every token but each document's first (once, not x SP)."""
    lengths = DOC_LENGTHS
    return [sum(n - 1 for n in lengths[i:i + docs_per_row]) for i in range(0, len(lengths), docs_per_row)]


def documents_alone_loss(model: Any, docs: list[list[int]]) -> torch.Tensor:
    """The per-document reference of a packed row: ``model`` on each document of token ids alone (no cache),
    its token losses summed over every document, over their count (a length-1 document predicts nothing)."""
    total, count = 0.0, 0
    for d in docs:
        if len(d) > 1:
            ids = torch.tensor([d])
            total = total + model(input_ids=ids, labels=ids, use_cache=False).loss * (len(d) - 1)
            count += len(d) - 1
    return total / count


def _per_document_loss(model: Any, docs: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    # Each document alone (no packing): token losses summed over every document, over their count.
    total, count = 0.0, 0
    for d in docs:
        n = d["input_ids"].numel()
        if n < 2:
            continue  # nothing to predict
        out = model(input_ids=d["input_ids"][None], labels=d["labels"][None])
        total = total + out.loss * (n - 1)
        count += n - 1
    return total / count


def per_document_reference_losses(steps: int, docs_per_row: int = DOCS_PER_ROW,
                                  eval_rows: int = 0) -> list[float]:
    """Per-step losses of single-device float64 SGD training where each step's ``docs_per_row``
    documents are run one at a time, unpacked: what packed training must equal (no attention or
    label leak across documents). With ``eval_rows``, followed by the trained model's mean over the
    first ``eval_rows`` rows of each row's per-document token mean (Trainer's eval loss)."""
    model = tiny_llama(torch.float64)
    opt = sgd(model.parameters())
    docs = documents()
    rows = [docs[i:i + docs_per_row] for i in range(0, len(docs), docs_per_row)]
    losses = []
    for step in range(steps):
        loss = _per_document_loss(model, rows[step % len(rows)])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    if eval_rows:
        with torch.no_grad():
            losses.append(sum(_per_document_loss(model, r).item() for r in rows[:eval_rows]) / eval_rows)
    return losses


def reference_first_gradients(batch: int, make_model: Callable[[torch.dtype], Any] = tiny_llama
                              ) -> dict[str, torch.Tensor]:
    """The float64 gradients of :func:`reference_losses`' first step (samples 0 .. ``batch`` - 1, one process),
    by parameter name: ``{name: tensor shaped as the parameter}``."""
    model = make_model(torch.float64)
    data = samples()
    ids = torch.stack([data[i]["input_ids"] for i in range(batch)])
    model(input_ids=ids, labels=ids).loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_gradients_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str,
                           rtol: float = 1e-4) -> None:
    """Every parameter's gradient in ``got`` (full tensors, by name) against ``want``'s, each on its own scale
    (``atol`` 1e-5 of its largest element). The losses alone cannot see one parameter's gradient off by a factor:
    measured on the tiny Llama at ``LR`` over 5 steps, q_proj's, k_proj's or a layer norm's gradient x2 moves the
    losses by ~1.2e-7 relative, an MLP weight's by <= 1.5e-5 (the loss tolerance is 1e-4; every gradient x2:
    4.8e-3)."""
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    for name, ref in want.items():
        torch.testing.assert_close(got[name].to(ref.dtype), ref, rtol=rtol, atol=1e-5 * ref.abs().max().item(),
                                   msg=lambda m, n=name: f"{what}: gradient of {n}: {m}")


def read_gradients_before_first_step(engine: Any, into: dict[str, torch.Tensor]) -> None:
    """Fill ``into`` with a DeepSpeed ``engine``'s reduced gradients (``safe_get_full_grad``, whole, by parameter
    name; trainable parameters only) just before its first ``step()``: accelerate calls ``engine.step()`` inside its ``backward``, so neither a
    Trainer callback nor the loop sees them. Idempotent (a second call on the same engine does nothing)."""
    from deepspeed.utils import safe_get_full_grad

    if "step" in vars(engine):
        return
    step = engine.step

    def read_then_step(*args: Any, **kwargs: Any) -> Any:
        if not into:
            into.update({n: safe_get_full_grad(p).detach().clone() for n, p in engine.module.named_parameters()
                         if p.requires_grad})
        return step(*args, **kwargs)

    engine.step = read_then_step


def assert_losses_close(got: list[float], ref: list[float], rtol: float = 1e-4) -> None:
    assert len(got) == len(ref), (got, ref)
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        assert abs(a - b) <= rtol * abs(b), f"step {i}: loss {a} vs single-device {b} (all: {got} vs {ref})"


def assert_grads_equal(model: torch.nn.Module, ref_grads: dict[str, torch.Tensor], world: int, what: str,
                       rtol: float = 1e-4, atol: float = 1e-5) -> None:
    """Every parameter's gradient, summed over the ranks (``world`` > 1: an all-reduce over the default
    group), equals the one-process reference's ``ref_grads`` (float64); a parameter without a gradient
    must have none in the reference either."""
    import torch.distributed as dist

    for name, p in model.named_parameters():
        if p.grad is None:
            assert name not in ref_grads, f"{what}: {name} got no gradient"
            continue
        grad = p.grad.detach().clone().to(ref_grads[name].dtype)
        if world > 1:
            dist.all_reduce(grad)
        torch.testing.assert_close(grad, ref_grads[name], rtol=rtol, atol=atol,
                                   msg=lambda m, name=name: f"{what} grad of {name}: {m}")


def full_sequence_parity(build: Callable[[str, torch.dtype], Any], kind: str, world: int, sharding: str,
                         seq_len: int, vocab: int, rtol: float = 1e-4, atol: float = 1e-5) -> Any:
    """One sequence of ``seq_len`` fresh random tokens (``(1, seq_len)``, below ``vocab``): the unswapped
    float64 ``build(kind, torch.float64)`` on the whole sequence in this process is the reference; the fp32
    ``build(kind, torch.float32)`` swapped at SP=``world`` (ring, ``sharding``) is fed this rank's shard
    (:func:`seqpar.sequence.batch.shard_batch`). Its loss must be within 1e-4 relative of the reference's and
    every gradient, summed over the ranks, equal (:func:`assert_grads_equal`, ``rtol`` / ``atol``). Returns
    the swap's report (call on every rank).

    Seen failing: feeding the swapped model the contiguous shard while it expects zigzag fails every zigzag
    case of test_hf_alibi and test_hf_window here."""
    import torch.distributed as dist

    from seqpar.config import SeqParConfig
    from seqpar.sequence.batch import shard_batch
    from seqpar.swap import swap_attention

    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, vocab, (1, seq_len), generator=g)
    ref = build(kind, torch.float64)
    ref_out = ref(input_ids=ids, labels=ids, use_cache=False)
    ref_out.loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}

    model = build(kind, torch.float32)
    report = swap_attention(model, SeqParConfig(size=world, mode="ring", sharding=sharding), group=dist.group.WORLD)
    local = shard_batch({"input_ids": ids, "labels": ids}, group=dist.group.WORLD, sharding=sharding)
    out = model(**local)
    out.loss.backward()
    loss, ref_loss = float(out.loss), float(ref_out.loss)
    assert abs(loss - ref_loss) <= 1e-4 * ref_loss, (kind, loss, ref_loss)
    assert_grads_equal(model, ref_grads, world, kind, rtol=rtol, atol=atol)
    return report


def fsdp2_gradients_before_first_step(into: dict[str, torch.Tensor] | list[dict[str, torch.Tensor]],
                                      every_step: bool = False) -> Any:
    """A ``transformers.TrainerCallback`` that fills ``into`` with an FSDP2-sharded model's reduced gradients
    (``full_tensor()``, whole, by parameter name; parameters with a gradient only) in ``on_pre_optimizer_step`` of
    the first step, before the update: the FSDP2 path's analogue of :func:`read_gradients_before_first_step`
    (there the engine steps inside accelerate's ``backward``, before any callback). Collective: every rank runs it.

    ``every_step=True``: ``into`` is a list, and every optimizer step appends its own ``{name: gradient}`` dict
    (step k's at index k - 1), each read before that step's update (test_dynamic_engines compares every step)."""
    from torch.distributed.tensor import DTensor
    from transformers import TrainerCallback

    def read(model: Any) -> dict[str, torch.Tensor]:
        return {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
                for n, p in model.named_parameters() if p.grad is not None}

    class FirstGradients(TrainerCallback):
        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            if every_step:
                into.append(read(model))
            elif not into:
                into.update(read(model))

    if every_step and not isinstance(into, list):
        raise TypeError(f"every_step=True appends one dict per step: pass a list, not {type(into).__name__}")
    return FirstGradients()
