"""Activation bytes per rank with TP sequence parallelism on and off, measured on CPU (issue 22).

    torchrun --nproc_per_node 4 launch/tp_memory.py --tp-size 2 --sp-size 2 --tokens 2048

A small Llama (hidden 256, 8 query / 4 K/V heads, MLP 512, 2 layers) swapped to seqpar's ring attention
over SP and split over TP by its own plan (``seqpar.integrations.tp``), ``--tokens`` per SP rank, one
forward and backward of the vocab-parallel loss, per rank (gloo, CPU):

- ``norm in+out``: the bytes of the local tensors entering and leaving every norm of the residual stream
  (forward hooks: ``numel x itemsize``), summed over the calls;
- ``residual``: the bytes of each decoder layer's output (the residual stream between layers);
- ``layer saved``: what decoder layer 0 saves for backward (``saved_tensors_hooks``, every storage once,
  parameters and the layer's input left out, DTensors counted by their local tensor), in units of
  ``tokens x hidden`` elements of the dtype, beside :func:`seqpar.memory.training.layer_saved_bytes`.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
import torch.distributed as dist

MODEL = {"vocab_size": 256, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
         "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32}


def _local(t: Any) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        with torch.no_grad():
            t = t.to_local()
    # a collective's result may still be torch's async wrapper (no storage of its own): its tensor
    return t.trigger_wait() if hasattr(t, "trigger_wait") else t


def measure(manager: Any, *, tp_sequence_parallel: bool, tokens: int, dtype: torch.dtype) -> dict[str, float]:
    """One forward + backward at the manager's TP x SP: the byte counts of the module docstring."""
    from torch._subclasses.fake_tensor import FakeTensor
    from transformers import LlamaConfig, LlamaForCausalLM

    from seqpar.integrations.tp import apply_tensor_parallel
    from seqpar.sequence.batch import shard_batch
    from seqpar.sequence.loss import sequence_parallel_loss
    from seqpar.swap import swap_attention

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**MODEL, max_position_embeddings=65536, tie_word_embeddings=False,
                                         use_cache=False)).to(dtype)
    swap_attention(model, {"size": manager.sp_size, "mode": "ring", "sharding": "zigzag"}, group=manager.sp_group)
    apply_tensor_parallel(model, manager, sequence_parallel=tp_sequence_parallel)
    counts = {"norm": 0, "residual": 0, "saved": 0}
    params = {_local(p).untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}
    layer_input: set[int] = set()
    active = [False]

    def real(t: Any) -> bool:  # the swap's first-forward check also runs the model on fake tensors
        return not isinstance(_local(t), FakeTensor)

    def pack(t: torch.Tensor) -> torch.Tensor:
        if active[0] and real(t):
            s = _local(t).untyped_storage()
            if s.data_ptr() not in params and s.data_ptr() not in layer_input:
                seen[s.data_ptr()] = s.nbytes()
        return t

    def nbytes(t: Any) -> int:
        t = _local(t)
        return t.numel() * t.element_size()

    def norm_hook(module: Any, args: tuple, output: Any) -> None:
        if real(output):
            counts["norm"] += nbytes(args[0]) + nbytes(output)

    def layer_out(module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        output = output[0] if isinstance(output, tuple) else output
        if real(output):
            counts["residual"] += nbytes(output)

    def first_pre(module: Any, args: tuple, kwargs: dict) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        if real(hidden):
            layer_input.add(_local(hidden).untyped_storage().data_ptr())
            active[0] = True

    def first_post(module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        active[0] = False

    for name, module in model.named_modules():
        if name.endswith(("input_layernorm", "post_attention_layernorm")) or name == "model.norm":
            module.register_forward_hook(norm_hook)
    for layer in model.model.layers:
        layer.register_forward_hook(layer_out, with_kwargs=True)
    model.model.layers[0].register_forward_pre_hook(first_pre, with_kwargs=True)
    model.model.layers[0].register_forward_hook(first_post, with_kwargs=True)

    ids = torch.randint(0, MODEL["vocab_size"], (1, tokens * manager.sp_size), generator=torch.Generator().manual_seed(1))
    local = shard_batch({"input_ids": ids, "labels": ids}, group=manager.sp_group, sharding="zigzag")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits
        loss = sequence_parallel_loss(logits, local["shift_labels"], group=manager.sp_group)
    loss.backward()
    unit = tokens * MODEL["hidden_size"] * torch.empty((), dtype=dtype).element_size()
    return {"norm_bytes": counts["norm"], "residual_bytes": counts["residual"],
            "layer_saved_units": round(sum(seen.values()) / unit, 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="launch/tp_memory.py", description=__doc__.split("\n")[0])
    p.add_argument("--tp-size", type=int, default=2)
    p.add_argument("--sp-size", type=int, default=2)
    p.add_argument("--tokens", type=int, default=2048, help="tokens per SP rank")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    args = p.parse_args(argv)
    from seqpar.memory.training import layer_saved_bytes
    from seqpar.runtime.groups import init_process_groups

    if "WORLD_SIZE" not in os.environ:
        raise SystemExit("run under torchrun: torchrun --nproc_per_node 4 launch/tp_memory.py")
    dist.init_process_group("gloo")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    manager = init_process_groups(config={"size": args.sp_size, "tp_size": args.tp_size, "mode": "ring",
                                          "sharding": "zigzag"})
    rows = {on: measure(manager, tp_sequence_parallel=on, tokens=args.tokens, dtype=dtype) for on in (False, True)}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, rows)
    if dist.get_rank() == 0:
        e = torch.empty((), dtype=dtype).element_size()
        unit = args.tokens * MODEL["hidden_size"] * e
        print(f"TP {args.tp_size} x SP {args.sp_size}, {args.tokens} tokens per SP rank, {args.dtype}, "
              f"per rank (measured; modelled layer units from seqpar.memory.training.layer_saved_bytes):")
        print("| tp_sequence_parallel | norm in+out (MiB) | residual (MiB) | layer 0 saved (units) | modelled (units) |")
        print("|---|---|---|---|---|")
        for on in (False, True):
            got = [r[on] for r in every]
            assert all(g == got[0] for g in got), got  # every rank holds the same amounts
            modelled = layer_saved_bytes(MODEL, dtype=dtype, sp_size=args.sp_size, tp_size=args.tp_size,
                                         tp_sequence_parallel=on) * args.tokens / unit
            print(f"| {'on' if on else 'off'} | {got[0]['norm_bytes'] / 2**20:.2f} | "
                  f"{got[0]['residual_bytes'] / 2**20:.2f} | {got[0]['layer_saved_units']} | {modelled:.3f} |")
    manager.destroy()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
