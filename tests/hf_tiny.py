"""Shared pieces of the Trainer / accelerate / PEFT tests: a tiny Llama, its data, the reference.

The reference is single-device training on the full sequences with plain PyTorch (no seqpar, no
engine), in float64, so a seqpar run (fp32) must match it to ~1e-5 relative; the tests allow 1e-4.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

VOCAB = 53
SEQ = 14  # not a multiple of 2 x SP: the cut pads at the end
ROWS = 10  # samples in the data set: 5 steps of batch 2
LR = 1e-2


def tiny_llama(dtype: torch.dtype = torch.float32) -> Any:
    """A 2-layer GQA Llama with seeded random weights (the same on every rank)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(dtype)


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
    """Per-step losses of single-device AdamW training on ``batch`` rows per step, in float64; with
    ``eval_rows``, followed by the trained model's loss on the first ``eval_rows`` samples."""
    model = make_model(torch.float64)
    trainable = [p for p in (params(model) if params else model.parameters()) if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=LR, weight_decay=0.0)
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


@contextlib.contextmanager
def launcher_env(rank: int, world: int) -> Iterator[None]:
    """What a launcher would set (accelerate and DeepSpeed read it; the pool joined gloo already),
    undone on exit with everything accelerate / transformers left behind: pool ranks run later tests
    in the same process (``ACCELERATE_USE_DEEPSPEED``, accelerate's singletons, transformers'
    global DeepSpeed config, which would make later models build under ``zero.Init``)."""
    saved = dict(os.environ)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    try:
        yield
    finally:
        from accelerate.state import AcceleratorState, GradientState, PartialState
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        PartialState._reset_state()
        unset_hf_deepspeed_config()
        os.environ.clear()
        os.environ.update(saved)


def assert_losses_close(got: list[float], ref: list[float], rtol: float = 1e-4) -> None:
    assert len(got) == len(ref), (got, ref)
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        assert abs(a - b) <= rtol * abs(b), f"step {i}: loss {a} vs single-device {b} (all: {got} vs {ref})"
