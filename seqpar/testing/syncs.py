"""Host syncs as CUDA would make them, found without a GPU (issue 20 §1).

A CUDA host waits for the device at every data-dependent operation (``.item()``, ``nonzero``, a
boolean-mask index, ``torch.equal``...) and at every blocking copy between host and device
(``.cpu()``, ``.tolist()``, ``torch.tensor(data, device="cuda")``). On CPU none of these costs
anything, so a CPU test suite cannot see them. This module runs seqpar as one rank of a P-rank CUDA
world inside one CPU process:

- every tensor is a **fake CUDA tensor** (``FakeTensorMode``): shapes, dtypes and devices, no data;
  a fake tensor raises on data-dependent output, which is a ready-made detector;
- the process group is torch's **fake process group** (``init_process_group("fake", ...)``): its
  collectives and point-to-point ops accept fake CUDA tensors and do nothing;
- the device is answered as an H100 or an A100 (:func:`simulated_gpu`), so the kernel choice is the
  one those GPUs make.

Only torch's CUDA build runs more than single kernels on fake CUDA tensors (the CPU build raises "not
linked with support for cuda devices" at the first indexing); the CUDA build imports and runs on a
CPU-only machine (see ``.ci/cuda_venv``). The C++ autograd engine wants a real device, so the
backward is run by calling each seqpar ``autograd.Function``'s backward directly on its saved
tensors (:func:`run_backward`); the maths lives in those functions.

:class:`SyncChecker` (:mod:`seqpar.testing.sync_checker`) watches every operation: inside a **layer** scope
a host sync raises :class:`HostSyncError` naming the operation and the source line; in the **batch** scope
(what runs once per batch, before the first layer) syncs are counted and answered, so the once-per-batch
syncs can be counted and shown not to grow with depth.

:func:`run_scenario` / :data:`SCENARIOS` cover every mode and feature; ``python -m
seqpar.testing.syncs --world-sizes 2 4 8`` runs them all and prints the syncs per batch.

The pieces: :mod:`seqpar.testing.sync_checker` (:class:`SyncChecker`), :mod:`seqpar.testing.fake_world`
(fake rank, simulated GPU, Python backward, stub streams), :mod:`seqpar.testing.sync_scenarios` (the
scenarios) and :mod:`seqpar.testing.sync_mixers` (the mixer layers); this module runs them, and their
public names stay importable from here.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from seqpar.testing.fake_world import (
    GPU_SIZES,
    GPUS,
    FakeEvent,
    FakeStream,
    building,
    fake,
    fake_rank,
    fake_streams,
    layer_hooks,
    python_backward,
    python_grad,
    run_backward,
    simulated_gpu,
)
from seqpar.testing.sync_checker import HostSyncError, SyncChecker, SyncEvent, cuda_build
from seqpar.testing.sync_mixers import MIXERS, MixerLayer, mixer, mixer_layers
from seqpar.testing.sync_scenarios import (
    HEAD_DIM,
    LAYERS,
    MIXER_FAMILIES,
    SCENARIOS,
    SEQ_PER_RANK,
    Scenario,
    documents,
)

__all__ = [
    "HostSyncError", "SyncEvent", "SyncChecker", "GPUS", "GPU_SIZES", "simulated_gpu", "fake_rank", "run_backward",
    "python_grad", "python_backward", "fake_streams", "FakeStream", "FakeEvent", "layer_hooks", "building", "fake",
    "Scenario", "SCENARIOS", "MIXER_FAMILIES", "SEQ_PER_RANK", "HEAD_DIM", "LAYERS", "documents",
    "MixerLayer", "MIXERS", "mixer", "mixer_layers", "run_scenario", "check_world", "cuda_build",
]


# The names these helpers had in this module before the split, for code written against them (a new name's
# alias only: the helpers live in seqpar.testing.fake_world and seqpar.testing.sync_scenarios).
_FakeStream, _FakeEvent, _fake_streams = FakeStream, FakeEvent, fake_streams
_building, _fake, _layer_hooks, _documents, _mixer_layers = building, fake, layer_hooks, documents, mixer_layers


def _attention_layers(sc: Scenario, world: int, checker: SyncChecker, manager: Any) -> list[str]:
    import seqpar

    seq = SEQ_PER_RANK * world
    cu = checker.cuda(documents(seq), torch.int32) if sc.documents else None
    if cu is not None:  # the batch's one host copy of the boundaries (shard_batch / the batch check)
        seqpar.sequence.boundaries.host_boundaries(cu)
    q = fake((1, sc.q_heads, SEQ_PER_RANK, HEAD_DIM))
    k = fake((1, sc.kv_heads, SEQ_PER_RANK, HEAD_DIM))
    v = fake((1, sc.kv_heads, SEQ_PER_RANK, HEAD_DIM))
    sinks = fake((sc.q_heads,), torch.float32) if sc.sinks else None
    group = None if manager is not None else dist.group.WORLD
    outs = []
    x = q
    for i in range(LAYERS):
        with checker.layer(f"attention[{i}]"):
            x = seqpar.attention(
                x, k, v, causal=True, mode=sc.mode, group=group, sharding=sc.sharding, check_inputs=False,
                head_chunks=sc.head_chunks, cu_seqlens=cu, window=sc.window, sinks=sinks,
                **{k: v for k, v in sc.extra.items() if k != "warmup"},
            )
        outs.append(x)
    return run_backward([x], checker)


def _dilated_layers(sc: Scenario, world: int, checker: SyncChecker) -> list[str]:
    from seqpar.attn.dilated import dilated_attention

    q = fake((1, sc.q_heads, SEQ_PER_RANK, HEAD_DIM))
    k = fake((1, sc.kv_heads, SEQ_PER_RANK, HEAD_DIM))
    # one local pattern (segments inside a shard) and one spanning every rank
    seg, rates = (SEQ_PER_RANK // 2, SEQ_PER_RANK * world), (2, 4)
    x = q
    for i in range(LAYERS):
        with checker.layer(f"dilated[{i}]"):
            x = dilated_attention(x, k, k, segment_lengths=seg, dilation_rates=rates, causal=True,
                                  mode=sc.mode, group=dist.group.WORLD, check_inputs=False)
    return run_backward([x], checker)


def _gather_layers(sc: Scenario, world: int, checker: SyncChecker) -> list[str]:
    from seqpar.sequence.sharding import gather_sequence

    cu = checker.cuda(documents(SEQ_PER_RANK * world), torch.int32)
    x = fake((1, SEQ_PER_RANK, 32))
    with checker.layer("gather_sequence[0]"):
        # the first gather of a batch may copy the boundaries to the host once (counted, not an error)
        with checker.batch_scope():
            y = gather_sequence(x, 1, group=dist.group.WORLD, sharding="balanced", cu_seqlens=cu,
                                check_inputs=False)
    outs = [y]
    for i in range(1, LAYERS + 1):
        with checker.layer(f"gather_sequence[{i}]"):
            outs.append(gather_sequence(x * i, 1, group=dist.group.WORLD, sharding="balanced", cu_seqlens=cu,
                                        check_inputs=False))
    return run_backward(outs, checker)



def _mha_layers(sc: Scenario, world: int, checker: SyncChecker) -> list[str]:
    from seqpar.swap import swap_attention

    with checker.paused(), building():
        layer = nn.TransformerEncoderLayer(32, sc.q_heads, 64, dropout=0.0, batch_first=True)
        model = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        swap_attention(model, {"size": world, "sharding": sc.sharding, "mode": sc.mode}, group=dist.group.WORLD)
        x = fake((1, SEQ_PER_RANK, 32))
        # made once per batch by the caller, handed to every layer (nn.Transformer's own helper)
        mask = nn.Transformer.generate_square_subsequent_mask(SEQ_PER_RANK, device="cuda", dtype=torch.bool)
    handles = layer_hooks(list(model.layers), checker, "encoder_layer")
    # with the hint (nn.Transformer's usual call), or without: then nn.TransformerEncoder reads the
    # mask once per batch (torch.equal, its own sync) and hands its verdict to every layer
    out = model(x, mask=mask, is_causal=True if sc.extra.get("hint", True) else None)
    for h in handles:
        h.remove()
    return run_backward([out], checker)


def _hf_layers(sc: Scenario, world: int, checker: SyncChecker) -> list[str]:
    import transformers

    from seqpar.sequence.batch import shard_batch
    from seqpar.swap import swap_attention

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                                   num_attention_heads=sc.q_heads, num_key_value_heads=sc.kv_heads,
                                   max_position_embeddings=4096)
    config: dict[str, Any] = {"size": world, "sharding": sc.sharding, "mode": sc.mode}
    if sc.extra.get("tiling"):
        config.update(tiled_loss=True, tiled_mlp=2)
    if sc.extra.get("recompute_norm"):
        config["recompute_norm"] = True
    seq = SEQ_PER_RANK * world
    with checker.paused():
        with building():
            model = transformers.LlamaForCausalLM(cfg)
        swap_attention(model, config, group=dist.group.WORLD)
        batch: dict[str, Tensor] = {"input_ids": checker.cuda([[1] * seq], torch.long)}
        if sc.documents:  # as transformers.DataCollatorWithFlattening packs them
            bounds = documents(seq)
            batch["position_ids"] = checker.cuda([[i for a, b in zip(bounds, bounds[1:]) for i in range(b - a)]],
                                                 torch.long)
            batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = checker.cuda(bounds, torch.int32)
        batch["labels"] = checker.cuda([[1] * seq], torch.long)
    shard = shard_batch(batch, group=dist.group.WORLD, sharding=sc.sharding)  # batch scope
    handles = layer_hooks(list(model.model.layers), checker, "decoder_layer")
    out = model(**shard)
    for h in handles:
        h.remove()
    return run_backward([out.loss if out.loss is not None else out.logits], checker)



def _moe_layers(sc: Scenario, world: int, checker: SyncChecker) -> list[str]:
    """The MoE statistics the swap computes over the SP group (seqpar.swap.moe's dispatchers call
    these): the load-balancing loss from LAYERS routers' logits with a padding token mask, Bamba's
    z-loss, and the expert counts of aux-loss-free balancing; each a layer (no sync)."""
    from seqpar.sequence.router import (
        load_balancing_loss,
        sequence_parallel_expert_counts,
        sequence_parallel_z_loss,
    )

    experts, top_k = 8, 2
    logits = tuple(fake((SEQ_PER_RANK, experts), torch.float32) for _ in range(LAYERS))
    mask = fake((1, SEQ_PER_RANK), torch.long)
    lm_logits = fake((1, SEQ_PER_RANK, 64), torch.float32)
    with checker.layer("load_balancing_loss"):
        aux = load_balancing_loss(logits, experts, top_k, mask, group=dist.group.WORLD)
    with checker.layer("z_loss"):
        z = sequence_parallel_z_loss(lm_logits, group=dist.group.WORLD, mask=mask)
    with checker.layer("expert_counts"):
        top = logits[0].topk(top_k, dim=-1).indices
        sequence_parallel_expert_counts(top, experts, group=dist.group.WORLD, mask=mask.reshape(-1))
    return run_backward([aux + z], checker)


def _offload_layers(sc: Scenario, world: int, checker: SyncChecker) -> list[str]:
    """seqpar.memory.offload: LAYERS checkpointed MLP blocks whose inputs go to pinned host memory on a
    side stream in the forward and come back (prefetched one layer ahead) in the backward, through
    CudaTransfer's own code on stubbed streams and events (:func:`~seqpar.testing.fake_world.fake_streams`)."""
    from seqpar.memory.offload import OffloadState, offloading_checkpoint

    log: list[str] = []
    with checker.paused(), building():
        blocks = [nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in range(LAYERS)]
    state = OffloadState()
    checkpoint = offloading_checkpoint(lambda run_fn, *args: run_fn(*args), state)
    x = fake((1, SEQ_PER_RANK, 32))
    engine_backward = torch.autograd.backward
    with fake_streams(checker, log):
        for i, block in enumerate(blocks):
            with checker.layer(f"offload[{i}]"):
                x = checkpoint(block, x)
        torch.autograd.backward = python_backward
        try:
            ran = run_backward([x], checker)
        finally:
            torch.autograd.backward = engine_backward
    expected = {"pin_memory": LAYERS, "record_stream": 2 * LAYERS}
    missing = {k: n for k, n in expected.items() if log.count(k) != n}
    if missing or not all(b[0].weight.grad is not None for b in blocks):
        raise AssertionError(f"offload scenario: CudaTransfer's paths did not all run ({log})")
    return ran


# scenario kind -> its layers' runner (sc, world, checker) -> the seqpar backwards run; "attention" takes the manager too
_RUNNERS: dict[str, Callable[[Scenario, int, SyncChecker], list[str]]] = {
    "dilated": _dilated_layers, "gather": _gather_layers, "mha": _mha_layers, "hf": _hf_layers,
    "offload": _offload_layers, "moe": _moe_layers, "mixer": mixer_layers,
}


def run_scenario(sc: Scenario, world: int, rank: int, gpu: str = "h100") -> dict[str, Any]:
    """Run ``sc`` as rank ``rank`` of ``world`` on fake CUDA tensors and the fake process group.

    Returns ``{"batch_syncs": {op: n}, "backward": [Function names], "where": [...]}``; raises
    :class:`HostSyncError` at the first sync inside a layer."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import seqpar

    with fake_rank(rank, world):
        manager = None
        if sc.mode == "hybrid":  # start-up on real host tensors (its agreement check reads them)
            manager = seqpar.init_process_groups(sp_size=world, ulysses_size=sc.ulysses)
        with simulated_gpu(gpu), FakeTensorMode(allow_non_fake_inputs=True), SyncChecker() as checker:
            if sc.kind == "attention":
                if sc.extra.get("warmup"):
                    with checker.startup():
                        _attention_layers(sc, world, checker, manager)
                ran = _attention_layers(sc, world, checker, manager)
            elif sc.kind in _RUNNERS:
                ran = _RUNNERS[sc.kind](sc, world, checker)
            else:
                raise ValueError(f"unknown scenario kind {sc.kind!r}")
    if not ran:
        raise AssertionError(f"{sc.name}: no seqpar backward ran (the checker would see nothing)")
    return {"batch_syncs": dict(checker.counts("batch")), "startup_syncs": dict(checker.counts("startup")),
            "backward": ran,
            "where": sorted({f"{e.op} at {e.where}" for e in checker.events})}


def check_world(world: int, scenarios: Sequence[Scenario] = SCENARIOS, gpus: Sequence[str] = ("h100", "a100"),
                ranks: Sequence[int] | None = None) -> dict[str, Any]:
    """Every scenario that applies to ``world``, on every rank and simulated GPU. Returns per
    scenario the most batch syncs any rank made and where; raises at the first layer sync."""
    report: dict[str, Any] = {}
    for sc in scenarios:
        if not sc.applies(world):
            continue
        worst: dict[str, Any] = {"batch_syncs": 0, "ops": {}, "where": []}
        for gpu in sc.extra.get("gpus", gpus):
            for rank in (range(world) if ranks is None else ranks):
                try:
                    res = run_scenario(sc, world, rank, gpu)
                except HostSyncError as e:
                    raise HostSyncError(f"{sc.name} (P={world}, rank {rank}, {gpu}): {e}") from None
                n = sum(res["batch_syncs"].values())
                if n >= worst["batch_syncs"]:
                    worst = {"batch_syncs": n, "ops": res["batch_syncs"], "where": res["where"],
                             "backward": res["backward"]}
        report[sc.name] = worst
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m seqpar.testing.syncs", description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--only", nargs="*", default=None, help="scenario names (default: all)")
    parser.add_argument("--json", default=None, help="write the report here")
    args = parser.parse_args(argv)
    if not cuda_build():
        print("seqpar.testing.syncs needs torch's CUDA build (see .ci/cuda_venv)", file=sys.stderr)
        return 2
    chosen = [s for s in SCENARIOS if args.only is None or s.name in args.only]
    full: dict[str, Any] = {}
    for world in args.world_sizes:
        start = time.perf_counter()
        try:
            report = check_world(world, chosen)
        except HostSyncError as e:
            print(f"FAIL P={world}: {e}", file=sys.stderr)
            return 1
        full[str(world)] = report
        print(f"P={world}: {len(report)} scenarios x {world} ranks x {{h100, a100}}: 0 syncs per layer "
              f"({time.perf_counter() - start:.1f} s)")
        for name, r in report.items():
            print(f"  {name:40s} batch syncs {r['batch_syncs']} {r['ops'] or ''}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(full, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
