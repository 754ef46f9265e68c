"""What one Hugging Face decoder layer saves for backward, measured: ``python -m seqpar.bench.layer_memory``.

The whole-step model (:mod:`seqpar.memory.training`) counts a recomputed layer's saved tensors in
units of the hidden states (``seq_local x hidden_size`` elements of the training dtype). This
measures them: a tiny Llama (GQA 4:1 like Llama-3) swapped to seqpar attention at SP size 1, one
decoder layer's forward under ``torch.autograd.graph.saved_tensors_hooks``, every saved storage
counted once (parameters and the layer's input left out: the input is the checkpointed one,
counted apart), in units. With ``recompute_norm`` and the tiled MLP as the configuration says.
Under ``torchrun --nproc_per_node P`` (gloo), the layer runs ring attention over P ranks on
``tokens`` local tokens each (``--mode``, ``--head-chunks`` as attention's).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

__all__ = ["saved_units"]


def _model(dtype: torch.dtype, config: dict[str, Any]) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    from seqpar.swap import swap_attention

    cfg = LlamaConfig(vocab_size=64, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
                      tie_word_embeddings=False, use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(dtype)
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    # config may set mode; the SP group is the whole torchrun world (None: no torch.distributed)
    swap_attention(model, {"size": world, "mode": "ring", "sharding": "zigzag", **config}, group=dist.group.WORLD)
    return model


def saved_units(dtype: torch.dtype = torch.bfloat16, tokens: int = 1024, **config: Any) -> dict[str, float]:
    """Bytes one decoder layer saves for backward, in hidden-state units, by dtype of the storage.

    Args:
        dtype: the training dtype. tokens: the local sequence length.
        config: ``sequence_parallel`` keys (``recompute_norm``, ``tiled_mlp``, ...).

    Returns:
        ``{"total": units, "<dtype>": units, ...}``: one unit is ``tokens x hidden_size`` elements of ``dtype``.
    """
    model = _model(dtype, config)
    layer = model.model.layers[0]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, tuple[int, torch.dtype]] = {}
    inputs: set[int] = set()
    active = [False]

    def pack(t: torch.Tensor) -> torch.Tensor:
        if active[0]:
            s = t.untyped_storage()
            if s.data_ptr() not in params and s.data_ptr() not in inputs:
                seen[s.data_ptr()] = (s.nbytes(), t.dtype)
        return t

    def pre(module: Any, args: tuple, kwargs: dict) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        inputs.add(hidden.untyped_storage().data_ptr())
        active[0] = True

    def post(module: Any, args: tuple, kwargs: dict, out: Any) -> None:
        active[0] = False

    layer.register_forward_pre_hook(pre, with_kwargs=True)
    layer.register_forward_hook(post, with_kwargs=True)
    import torch.distributed as dist

    from seqpar.sequence.batch import shard_batch

    world = dist.get_world_size() if dist.is_initialized() else 1
    ids = torch.randint(0, 64, (1, tokens * world), generator=torch.Generator().manual_seed(1))
    batch = (shard_batch({"input_ids": ids}, group=dist.group.WORLD, sharding="zigzag") if world > 1
             else {"input_ids": ids})
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(**batch).logits.float().sum()
    unit = tokens * model.config.hidden_size * torch.empty((), dtype=dtype).element_size()
    out: dict[str, float] = {"total": 0.0}
    for nbytes, dt in seen.values():
        out["total"] += nbytes / unit
        out[str(dt).removeprefix("torch.")] = out.get(str(dt).removeprefix("torch."), 0.0) + nbytes / unit
    return {k: round(v, 3) for k, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m seqpar.bench.layer_memory", description=__doc__.split("\n")[0])
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--head-chunks", type=int, default=1)
    p.add_argument("--mode", default="ring", choices=["ring", "allgather", "ulysses"])
    args = p.parse_args(argv)
    import os

    import torch.distributed as dist

    if "WORLD_SIZE" in os.environ and not dist.is_initialized():
        dist.init_process_group("gloo")
    world = dist.get_world_size() if dist.is_initialized() else 1
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    lines = [f"one decoder layer's saved tensors at SP size {world}, in units of {args.tokens} local tokens x "
             f"hidden {args.dtype} (measured):"]
    for name, cfg in (("HF norms", {}), ("recompute_norm", {"recompute_norm": True}),
                      ("HF norms, tiled MLP", {"tiled_mlp": 4}),
                      ("recompute_norm, tiled MLP", {"recompute_norm": True, "tiled_mlp": 4})):
        cfg.update(head_chunks=args.head_chunks, mode=args.mode)
        lines.append(f"  {name:<28} {saved_units(dtype, args.tokens, **cfg)}")
    if not dist.is_initialized() or dist.get_rank() == 0:
        print("\n".join(lines))
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
