"""The composition fuzzer's engine runner: a model trained through one of the engines of this package, as a
user would wire it, for the fuzzer's ``engine`` cases (``seqpar.testing.fuzz_engines``).

The fuzzer lives in the core's test harness, which never imports this package (tests/test_layering.py); it
finds :func:`run_engine` through the entry-point group ``seqpar.fuzz_engines`` (setup.cfg: one entry per
engine name, all naming this function). The runner takes plain arguments and knows nothing of the fuzzer
(it does not import ``seqpar.testing``).

Engines (the entry-point names):

- ``zero1``, ``zero2``, ``zero3``: :func:`seqpar.integrations.deepspeed.initialize` with that ZeRO stage over
  every rank (SP = world / tp_size); accumulation is DeepSpeed's (``gradient_accumulation_steps`` 2,
  ``engine.backward(loss, scale_wrt_gas=False)`` so that the gradient is the sum of the micro-batches'),
  gradients read with ``deepspeed.utils.safe_get_full_grad`` (reduced over the ranks, gathered under ZeRO-3);
- ``fsdp2``: :func:`seqpar.integrations.fsdp.wrap` (FSDP2); gradients are the reduced DTensors'
  ``full_tensor()``;
- ``fsdp1``: the same ``wrap`` with ``{"version": 1}`` (``FullyShardedDataParallel``, ``use_orig_params=True``
  as the adapter sets it, each block a unit); gradients read inside
  ``FullyShardedDataParallel.summon_full_params(with_grads=True)``;
- ``tp2``: the same ``wrap`` with the config's ``tp_size`` (TP from the model's own plan, FSDP2 over the SP
  ranks);
- ``autotp``: :func:`seqpar.integrations.deepspeed.initialize` with the config's ``tp_size`` (DeepSpeed's AutoTP,
  ``tensor_parallel.autotp_size`` set from it) under ZeRO stage ``config["zero_stage"]`` (the key is
  the runner's, taken out before the block reaches DeepSpeed; so is ``config["vocab_parallel_lm_head"]``, when
  given DeepSpeed's ``tensor_parallel.vocab_parallel_lm_head``), driven as the ZeRO engines above but for
  ``engine.step()`` after each accumulated micro-batch but the last, as a DeepSpeed loop calls it (off the
  boundary it only counts the micro-step; without it a stage that reduces at the boundary alone, ZeRO-0,
  never reaches one and leaves every rank's gradient unreduced: fuzzer cases 295 and 442 of ``--set
  engine=autotp`` at ZeRO-0, the embedding's gradient 100% off), then each
  parameter AutoTP split gathered over the TP group (the TP ranks' slices in TP rank order, concatenated on the
  one dim where the slice is smaller than the parameter the model was built with; a vocabulary-split head or
  embedding checked against DeepSpeed's own slice bounds, ``vocab_start_index``);
- ``accelerate``: the plain accelerate loop as a user writes it (docs/integrations.md): ``Accelerator()``
  (``gradient_accumulation_steps=2`` when accumulating), :func:`seqpar.integrations.accelerate.prepare` with an
  optimizer factory and a map-style loader of the replicas' full batches (one batch an item, interleaved
  replica by replica, so that accelerate's split over the DP axis hands each replica its own), then
  ``model(**batch).loss`` and ``accelerator.backward`` (inside ``accelerator.accumulate(model)`` when
  accumulating). accelerate divides each loss by its ``gradient_accumulation_steps`` (its documented mean over
  the micro-batches), so the gradient returned is the reduced one times that count: the sum over the batches,
  as every other engine returns it. The caller sets the launcher's environment (``RANK``, ``WORLD_SIZE``, ...)
  and resets accelerate's singletons afterwards (the fuzzer's ``launcher_env``).

Data parallelism: the world is DP x SP x TP (``config["size"]`` is SP); each DP replica trains on its own
batches (``batches[manager.dp_rank]``), as a user's DP loader feeds it, and the engine averages the gradients
over the replicas (docs/integrations.md). Each rank returns its replica's loss and index.

No optimizer step is taken: the result is the gradient after the engine's reduction, before ``step()`` (the
optimizer's arithmetic is the engine's, not seqpar's).

The fuzzer's ``dynamic`` cases drawn with an engine (``seqpar.testing.fuzz_dynamic``) run
:func:`run_dynamic_engine`, found through the entry-point group ``seqpar.fuzz_dynamic_engines`` (one entry per
name of :data:`DYNAMIC_ENGINES`): one planned step of length-aware dynamic CP through
:func:`seqpar.integrations.dynamic.run_dynamic_step`, as ``launch/train.py --dynamic`` and ``SeqParTrainer``
drive it, over the whole world as the pool (DP x SP). ZeRO-1/2/3 at ``gradient_accumulation_steps`` 1 (the
step's accumulation is the plan's), gradients read at the boundary in place of ``engine.step()``; FSDP2 as
above. ``run_dynamic_step`` multiplies each micro-batch's loss by ``dp`` and the engine divides its reduction
over the pool by ``dp``, so the gradient returned is the sum over the pool of every rank's: the gradient of the
step's per-token mean, what one process gives (tests/test_dynamic_engines.py judges it so).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["ENGINES", "DYNAMIC_ENGINES", "run_engine", "run_dynamic_engine"]

ENGINES = ("zero1", "zero2", "zero3", "fsdp2", "fsdp1", "tp2", "autotp", "accelerate")
DYNAMIC_ENGINES = ("zero1", "zero2", "zero3", "fsdp2")
"""The engines :func:`run_dynamic_engine` drives (``run_dynamic_step``'s: FSDP2 and DeepSpeed ZeRO-1/2/3)."""


def _full_grads_zero(engine: Any) -> dict[str, torch.Tensor]:
    """Every parameter's gradient after the engine's reduction (collective under ZeRO-3: every rank calls)."""
    from deepspeed.utils import safe_get_full_grad

    out = {}
    for name, p in engine.module.named_parameters():
        g = safe_get_full_grad(p)
        if g is not None:
            out[name] = g.detach().clone()
    return out


def _full_grads_fsdp(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's reduced gradient, DTensors gathered (collective: every rank calls)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is None:
            continue
        out[name] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone()
    return out


def _full_grads_fsdp1(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's reduced gradient under FSDP1 (``use_orig_params``: each original parameter's ``grad``
    is this rank's slice of it until the full parameters are summoned with their gradients; collective)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    out = {}
    with FSDP.summon_full_params(model, writeback=False, with_grads=True):
        for name, p in model.named_parameters():
            if p.grad is not None:
                clean = name.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", "")
                out[clean] = p.grad.detach().clone()
    return out


def _gather_tp(grads: dict[str, torch.Tensor], shapes: dict[str, torch.Size], model: nn.Module,
               tp_group: Any) -> dict[str, torch.Tensor]:
    """``grads`` (ZeRO-gathered, each this rank's AutoTP slice) with every parameter AutoTP split made whole:
    the TP ranks' slices in TP rank order, concatenated on the one dim where this rank's parameter (its full
    ``ds_shape`` under ZeRO-3) is smaller than ``shapes[name]`` (the model's before AutoTP; slices may be uneven, an
    odd vocabulary). Collective over
    the TP group: every rank calls, with the same parameters."""
    import torch.distributed as dist

    # a vocabulary-split head / embedding (DeepSpeed's VocabParallelLinear / VocabParallelEmbedding; tied, one
    # parameter) holds rows [vocab_start_index, vocab_end_index) of the vocabulary: DeepSpeed's own bounds, which its
    # tp_grain_size may make uneven
    starts = {id(m.weight): int(m.vocab_start_index) for m in model.modules()
              if hasattr(m, "vocab_start_index") and isinstance(getattr(m, "weight", None), torch.Tensor)}
    out = {}
    for name, p in model.named_parameters():
        g = grads.get(name)
        want = shapes[name]
        shape = tuple(getattr(p, "ds_shape", p.shape))  # ZeRO-3 partitions p (p.shape (0,)); ds_shape is this TP slice's
        if shape == tuple(want):
            if g is not None:
                out[name] = g
            continue
        (dim,) = [d for d, (a, b) in enumerate(zip(shape, want, strict=True)) if a != b]
        parts: list[Any] = [None] * dist.get_world_size(tp_group)
        dist.all_gather_object(parts, (g, shape, starts.get(id(p))), group=tp_group)
        if parts[0][2] is not None:  # rank order must be vocabulary order, with no gap or overlap
            offsets = [sum(s[dim] for _, s, _ in parts[:r]) for r in range(len(parts))]
            if [start for _, _, start in parts] != offsets or dim != 0:
                raise ValueError(f"{name}: the TP slices start at rows {[s for _, _, s in parts]} of the vocabulary "
                                 f"(DeepSpeed's vocab_start_index), not at {offsets} on dim 0 as gathered")
        if any(x is not None for x, _, _ in parts):  # a TP rank without a gradient holds zeros there
            out[name] = torch.cat([x if x is not None else torch.zeros(shape, dtype=p.dtype) for x, shape, _ in parts],
                                  dim=dim)
    return out


def _replica_loader(batches: list[list[dict[str, Any]]]) -> Any:
    """A map-style loader of every replica's full batches, one batch an item, interleaved replica by replica
    (item ``i x dp + d`` is replica ``d``'s batch ``i``): accelerate's split over ``dp`` processes with batches
    of one item hands DP rank ``d`` the items ``d, d + dp, ...``, its own batches in order."""
    from torch.utils.data import DataLoader

    items = [replica[i] for i in range(len(batches[0])) for replica in batches]
    return DataLoader(items, batch_size=1, shuffle=False, collate_fn=lambda one: one[0])


def run_engine(engine: str, build_model: Callable[[], nn.Module], batches: list[list[dict[str, Any]]],
               config: dict[str, Any], *, accumulate: bool) -> dict[str, Any]:
    """One step of ``build_model()`` through ``engine`` on this rank (every rank of the default group calls).

    Args:
        engine: one of :data:`ENGINES`.
        build_model: makes the model (the same on every rank; activation checkpointing already set).
        batches: ``batches[d]``: DP replica ``d``'s full (unsharded) batches of ``(batch, seq)`` tensors as the
            model takes them (one list per replica, ``world / (size x tp_size)`` lists); this rank runs its
            replica's, each sharded here with :func:`seqpar.shard_batch` on the SP group and the config's
            sharding.
        config: the ``sequence_parallel`` config (``size``, ``tp_size``, ``mode``, ``sharding``, ...).
        accumulate: one backward per batch (gradient accumulation over the batches); else every batch's
            forward first, then one backward of the summed losses.

    Returns:
        ``{"loss": float (this replica's, summed over its batches), "replica": this rank's DP index,
        "grads": {name: reduced full gradient}}``.

    Raises:
        ValueError: an unknown engine; not one list of batches per DP replica; whatever seqpar or the engine
            raises otherwise.
    """
    import seqpar
    from seqpar.sequence.batch import shard_batch

    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}: choose one of {list(ENGINES)}")
    manager = None
    try:
        model = build_model()
        if engine == "accelerate":
            return _run_accelerate(model, batches, config, accumulate=accumulate)
        if engine.startswith("zero") or engine == "autotp":
            from seqpar.integrations.deepspeed import initialize

            config = dict(config)
            stage = config.pop("zero_stage") if engine == "autotp" else int(engine[-1])
            vocab_split = config.pop("vocab_parallel_lm_head", None)
            shapes = {n: p.shape for n, p in model.named_parameters()}  # before AutoTP splits them
            ds_config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2 if accumulate else 1,
                         "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
                         "gradient_clipping": 0.0, "steps_per_print": 10 ** 9, "sequence_parallel": config}
            if vocab_split is not None:
                ds_config["tensor_parallel"] = {"vocab_parallel_lm_head": bool(vocab_split)}
            ds_engine, _, _, _ = initialize(model=model, config=ds_config,
                                            optimizer=lambda params: torch.optim.SGD(params, lr=0.0))
            manager, forward = ds_engine.seqpar_manager, ds_engine

            def backward(loss: torch.Tensor) -> None:
                ds_engine.backward(loss, scale_wrt_gas=False)  # the sum of the micro-batches' losses

            def full_grads() -> dict[str, torch.Tensor]:
                grads = _full_grads_zero(ds_engine)
                if engine == "autotp":
                    grads = _gather_tp(grads, shapes, ds_engine.module, manager.tp_group)
                return grads
        else:
            from seqpar.integrations.fsdp import wrap

            manager = seqpar.init_process_groups(config=config)
            version = 1 if engine == "fsdp1" else 2
            forward = wrap(model, config, manager=manager, fsdp={"version": version})

            def backward(loss: torch.Tensor) -> None:
                loss.backward()

            def full_grads() -> dict[str, torch.Tensor]:
                return _full_grads_fsdp1(forward) if version == 1 else _full_grads_fsdp(forward)
        if len(batches) != manager.dp_size:
            raise ValueError(f"run_engine: {len(batches)} lists of batches for {manager.dp_size} DP replicas "
                             f"(world {manager.world_size} = dp x sp {manager.sp_size} x tp {manager.tp_size}): "
                             "pass one list per replica")
        losses = []
        mine = batches[manager.dp_rank]
        for i, b in enumerate(mine):
            out = forward(**shard_batch(b, group=manager.sp_group, sharding=config["sharding"]))
            if accumulate:
                backward(out.loss)
                if engine == "autotp" and i < len(mine) - 1:
                    forward.step()  # off the boundary: counts the micro-step (ZeRO-0 reduces at the boundary)
            losses.append(out.loss)
        if not accumulate:
            backward(sum(losses))
        return {"loss": float(sum(x.detach() for x in losses)), "replica": manager.dp_rank, "grads": full_grads()}
    finally:
        if manager is not None:
            manager.destroy()


def _run_accelerate(model: nn.Module, batches: list[list[dict[str, Any]]], config: dict[str, Any], *,
                    accumulate: bool) -> dict[str, Any]:
    """The ``accelerate`` engine (module docstring): the loop as a user writes it, on this rank."""
    from accelerate import Accelerator

    import seqpar
    from seqpar.integrations.accelerate import prepare

    gas = 2 if accumulate else 1
    accelerator = Accelerator(gradient_accumulation_steps=gas)
    manager = seqpar.init_process_groups(config=config)
    try:
        if len(batches) != manager.dp_size:
            raise ValueError(f"run_engine: {len(batches)} lists of batches for {manager.dp_size} DP replicas "
                             f"(world {manager.world_size} = dp x sp {manager.sp_size}): pass one list per replica")
        model, _, loader = prepare(accelerator, model, lambda params: torch.optim.SGD(params, lr=0.0),
                                   _replica_loader(batches), config=config, manager=manager)
        losses = []
        for batch in loader:
            if accumulate:
                with accelerator.accumulate(model):
                    loss = model(**batch).loss
                    accelerator.backward(loss)
            else:
                loss = model(**batch).loss
            losses.append(loss)
        if not accumulate:
            accelerator.backward(sum(losses))
        grads = {n: g * gas for n, g in _full_grads_fsdp(model).items()}  # accelerate's mean over micro-batches
        return {"loss": float(sum(x.detach() for x in losses)), "replica": manager.dp_rank, "grads": grads}
    finally:
        manager.destroy()


def run_dynamic_engine(engine: str, build_model: Callable[[], nn.Module], plan: Any, docs: list[torch.Tensor],
                       config: dict[str, Any],
                       prepare: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> dict[str, Any]:
    """One planned dynamic step of ``build_model()`` through ``engine`` on this rank (every rank of the default
    group calls, the pool being the world).

    Args:
        engine: one of :data:`DYNAMIC_ENGINES`.
        build_model: makes the model (the same on every rank; activation checkpointing already set).
        plan: the step's :class:`~seqpar.sequence.dynamic.DynamicPlan` over the world (the same on every rank).
        docs: the step's documents, 1-D token tensors, ``docs[i]`` of length ``plan.lengths[i]``.
        config: the ``sequence_parallel`` config (``size``, ``mode``, ``sharding``, and its ``dynamic`` block).
        prepare: passed to ``run_dynamic_step`` (maps each micro-batch's inputs before its forward).

    Returns:
        ``{"loss": float (the step's per-token mean, the same on every rank), "grads": {name: reduced full
        gradient}, "ran": [(group size, local tokens) of each of this rank's micro-batches]}``.

    Raises:
        ValueError: an unknown engine; whatever seqpar, the planner's cut or the engine raises otherwise.
    """
    import seqpar
    from seqpar.integrations.dynamic import run_dynamic_step
    from seqpar.sequence.batch import rank_micro_batches
    from seqpar.sequence.call_group import GROUP_KEY
    from seqpar.sequence.dynamic_step import DynamicStep

    if engine not in DYNAMIC_ENGINES:
        raise ValueError(f"unknown dynamic engine {engine!r}: choose one of {list(DYNAMIC_ENGINES)}")
    manager = None
    grads: dict[str, torch.Tensor] = {}
    try:
        model = build_model()
        if engine.startswith("zero"):
            from seqpar.integrations.deepspeed import initialize

            ds_config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                         "zero_optimization": {"stage": int(engine[-1])}, "zero_allow_untested_optimizer": True,
                         "gradient_clipping": 0.0, "steps_per_print": 10 ** 9, "sequence_parallel": config}
            ds_engine, _, _, _ = initialize(model=model, config=ds_config,
                                            optimizer=lambda params: torch.optim.SGD(params, lr=0.0))
            manager, driven = ds_engine.seqpar_manager, ds_engine

            def read() -> None:  # at the boundary, before step(): the reduced gradients
                grads.update(_full_grads_zero(ds_engine))
        else:
            from seqpar.integrations.fsdp import wrap

            manager = seqpar.init_process_groups(config=config)
            driven = wrap(model, config, manager=manager, fsdp={"version": 2})

            def read() -> None:
                grads.update(_full_grads_fsdp(driven))
        micro = rank_micro_batches(plan, list(docs), manager, sharding=config["sharding"])
        ran = [(torch.distributed.get_world_size(m[GROUP_KEY]), int(m["input_ids"].shape[1])) for m in micro]
        step = DynamicStep(plan, micro, manager)
        loss = run_dynamic_step(driven, step, deepspeed=engine.startswith("zero"), update=read, prepare=prepare)
        return {"loss": float(loss), "grads": grads, "ran": ran}
    finally:
        if manager is not None:
            manager.destroy()
