"""The ``engine`` kind, run and judged: each DP replica's draws (:func:`replica_draws`), the plants
(:data:`PLANTS`, the fuzzer's own tests), the pool task (:func:`engine_task`), the DP x SP reference on one
process (:func:`dp_reference`) and :func:`run_engine_case`. What is drawn and why is
:mod:`seqpar.testing.fuzz_engines`' docstring.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from seqpar.testing.fuzz_engines_lookup import engine_runner, runner_dir


def replica_draws(draws: dict[str, Any]) -> list[dict[str, Any]]:
    """The case's draws as seen by each DP replica: replica 0's are ``draws`` itself, replica ``d``'s have
    ``case_seed`` and ``lengths`` of ``draws["replicas"][d - 1]`` (its own tokens, documents, padding)."""
    return [draws] + [{**draws, **r} for r in draws.get("replicas", [])]


PLANTS = ("dp_divide_world", "dp_divide_sp", "dp_same_data", "fsdp1_divide_world", "fsdp1_no_sp_sum",
          "zero_divide_world", "zero_no_sp_sum")
"""Deliberately broken compositions, for the fuzzer's own tests (:func:`run_engine_case`'s ``plant``), each what a
real adapter bug would look like:

- ``"dp_divide_world"``: FSDP2 divides reduced gradients by the world (``dp x sp``), FSDP's own default, instead
  of seqpar's DP size (the reduced gradient is ``1 / sp`` of the DP mean); ``"dp_divide_sp"``: by the SP size
  instead (``dp`` times the DP mean);
- ``"dp_same_data"``: every DP replica gets replica 0's batches (applied by :func:`engine_task`);
- ``"fsdp1_divide_world"``: the adapter's FSDP1 divide factor never reaches the units
  (``set_fsdp1_divide_factor`` without effect), so FSDP1 divides by its group's size, ``dp x sp``;
- ``"fsdp1_no_sp_sum"``: FSDP1 built over the DP group instead of the SP x DP one, so each SP rank's share of
  the gradient is averaged over the DP replicas and never summed with the other SP ranks' shares;
- ``"zero_divide_world"``: DeepSpeed's divisor is ``dp x sp`` uncompensated: under ZeRO-1/2 the optimizer is
  not told the SP size (its ``sequence_parallel_size`` 1: the sum over ``dp x sp`` ranks divided by all of
  them), under ZeRO-3 the adapter's loss scaling by ``sp`` in ``engine.backward`` is lost;
- ``"zero_no_sp_sum"``: the SP ranks' shares not summed: the reduction sees SP rank 0's share alone (the
  backward of every other SP rank contributes nothing), which is what a reduction over the DP group alone leaves
  on SP rank 0, whose gradients are read.

The new engines meet two of them: ``zero_divide_world`` under ``autotp`` (AutoTP's engine reports
``sequence_parallel_size`` 1, so the adapter's loss scaling by ``sp`` is all that makes the divisor DP: lost, the
reduced gradient is ``1 / sp`` of the DP mean), ``dp_divide_world`` under ``accelerate`` (``prepare`` shards
through the same FSDP2 wrap).

The DP-divisor plants show where the divisor differs from the right one: ``*_divide_world`` needs SP > 1
(DP 2 x SP 2, or DP 1 x SP 2), ``dp_divide_sp`` DP > 1 with DP != SP (DP 3 x SP 1); ``*_no_sp_sum`` needs SP > 1."""


def _plant(name: str | None, ctx: Any, draws: dict[str, Any]) -> Callable[[], None]:
    """Apply the plant ``name`` (:data:`PLANTS`) in this rank; returns the undo callable."""
    if name in (None, "dp_same_data"):
        return lambda: None
    if name not in PLANTS:
        raise ValueError(f"unknown plant {name!r}: choose one of {list(PLANTS)}")
    sp = ctx.world_size // (draws.get("dp", 1) * draws["tp_size"])
    if name.startswith("dp_"):
        from torch.distributed.fsdp import FSDPModule

        original = FSDPModule.set_gradient_divide_factor
        wrong = ctx.world_size if name == "dp_divide_world" else sp

        def divide_wrongly(self: Any, factor: float) -> None:
            original(self, float(wrong))

        FSDPModule.set_gradient_divide_factor = divide_wrongly

        def undo() -> None:
            FSDPModule.set_gradient_divide_factor = original
        return undo
    if name.startswith("fsdp1_"):
        return _plant_fsdp1(name)
    return _plant_zero(name)


def _plant_fsdp1(name: str) -> Callable[[], None]:
    """The FSDP1 plants (:data:`PLANTS`), on torch's ``FullyShardedDataParallel`` class."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    init = FSDP.__init__
    if name == "fsdp1_no_sp_sum":
        from seqpar.runtime.groups import default_manager

        def dp_group_init(self: Any, module: Any, process_group: Any = None, *args: Any, **kwargs: Any) -> None:
            manager = default_manager()  # the runner's, made before the wrap
            init(self, module, manager.dp_group if manager is not None else process_group, *args, **kwargs)

        FSDP.__init__ = dp_group_init

        def undo_init() -> None:
            FSDP.__init__ = init
        return undo_init
    # fsdp1_divide_world: once a unit is built, later settings of its divide factors (the adapter's) are lost
    names = ("_gradient_predivide_factor", "_gradient_postdivide_factor")

    def frozen_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.__dict__["_planted_frozen"] = True

    def factor(attr: str) -> property:
        def get(self: Any) -> Any:
            return self.__dict__["_planted" + attr]

        def put(self: Any, value: Any) -> None:
            if not self.__dict__.get("_planted_frozen"):
                self.__dict__["_planted" + attr] = value
        return property(get, put)

    FSDP.__init__ = frozen_init
    for attr in names:
        setattr(FSDP, attr, factor(attr))

    def undo() -> None:
        FSDP.__init__ = init
        for attr in names:
            delattr(FSDP, attr)
    return undo


def _plant_zero(name: str) -> Callable[[], None]:
    """The DeepSpeed plants (:data:`PLANTS`), on DeepSpeed's engine and ZeRO optimizer classes."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    backward, zero_init = DeepSpeedEngine.backward, DeepSpeedZeroOptimizer.__init__
    setattr_ = DeepSpeedEngine.__setattr__
    own_setattr = "__setattr__" in DeepSpeedEngine.__dict__
    if name == "zero_no_sp_sum":
        def own_share_only(self: Any, loss: Any, *args: Any, **kwargs: Any) -> Any:
            keep = 1.0 if self.seqpar_manager.sp_rank == 0 else 0.0
            return backward(self, loss * keep, *args, **kwargs)

        DeepSpeedEngine.backward = own_share_only
    else:
        def unscaled(self: Any, key: str, value: Any) -> None:
            if key in ("backward", "scale"):
                return  # the adapter's loss scaling by sp (ZeRO-3's divisor dp x sp), its one setter, is lost
            setattr_(self, key, value)

        def no_sp_size(self: Any, *args: Any, **kwargs: Any) -> None:
            zero_init(self, *args, **kwargs)
            self.sequence_parallel_size = 1  # ZeRO-1/2 then divide the sum over dp x sp ranks by all of them

        DeepSpeedEngine.__setattr__ = unscaled
        DeepSpeedZeroOptimizer.__init__ = no_sp_size

    def undo() -> None:
        DeepSpeedEngine.backward, DeepSpeedZeroOptimizer.__init__ = backward, zero_init
        if own_setattr:
            DeepSpeedEngine.__setattr__ = setattr_
        elif "__setattr__" in DeepSpeedEngine.__dict__:
            del DeepSpeedEngine.__setattr__
    return undo


def _forget_autotp_groups() -> None:
    """Drop DeepSpeed's module-level TP / DP groups after an ``autotp`` case, as a fresh process has none: AutoTP
    keeps the first engine's TP group for every later engine of the process (``groups._init_tp_mesh_device``
    returns early once it is set), so the next case of another layout would run on stale groups (seen: DeepSpeed's
    "data parallel group is not initialized" in the case after an AutoTP one on the same pool). DeepSpeed's own
    reset (``_release_process_group_references(None)``, what its WORLD teardown calls); the groups' objects are
    left to the pool (a few per case)."""
    from deepspeed.utils import groups

    groups._release_process_group_references(None)


def engine_task(ctx: Any, draws: dict[str, Any], batches: list[list[dict[str, Any]]], dtype_name: str,
                plant: str | None = None) -> dict[str, Any]:
    """Pool task (every rank): the case through its engine's runner; ``batches[d]`` are DP replica ``d``'s
    (the runner feeds this rank its own replica's). Every rank returns its replica's loss and its index
    (``replica``), rank 0 the reduced gradients too; every rank ``{"ok": False, "error"}`` on an exception."""
    import warnings

    import transformers

    from seqpar.testing.fuzz_models import build_case_model, enable_checkpointing
    from seqpar.testing.verdicts import error_record

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    from seqpar.memory import tiling
    from seqpar.testing.tiny_models import VOCAB

    runner = None
    cap = tiling.MAX_LOSS_CHUNK_ELEMENTS
    mem = draws.get("memory") or {}
    if mem.get("loss_tile_rows"):  # the tile of this many rows, as the model kind sets it (fuzz_models)
        tiling.MAX_LOSS_CHUNK_ELEMENTS = mem["loss_tile_rows"] * mem.get("vocab", VOCAB)
    undo = _plant(plant, ctx, draws)
    try:
        runner = engine_runner(draws["engine"])

        def build_model() -> nn.Module:
            model = build_case_model(draws, getattr(torch, dtype_name))
            enable_checkpointing(model, draws["checkpointing"])
            return model

        dp = draws.get("dp", 1)
        config = {"size": ctx.world_size // (draws["tp_size"] * dp), "tp_size": draws["tp_size"], "mode": draws["mode"],
                  "sharding": draws["sharding"], "ulysses_size": draws["ulysses_size"],
                  "check_inputs": draws["check_inputs"]}
        if "tp_sequence_parallel" in draws:  # tp2's and autotp's loss draws, as a user's config sets them
            config["tp_sequence_parallel"] = draws["tp_sequence_parallel"]
            # autotp's too (fz24a: set under tp_loss_parallel alone since session 23's merge, autotp's tiled loss
            # was drawn, never configured: its cases ran the plain loss, case 756378705's refusal exact)
            config["tiled_loss"] = bool((draws.get("memory") or {}).get("tiled_loss"))
        if "tp_loss_parallel" in draws:  # tp2's loss layout (a case pinned before the key runs "auto")
            config["tp_loss_parallel"] = draws["tp_loss_parallel"]
        if draws.get("dkv_wire"):  # the bf16 dK/dV wire (fz33), as a user's sequence_parallel block sets it
            config["dkv_wire_dtype"] = draws["dkv_wire"]
        if draws["engine"] == "autotp":
            config["zero_stage"] = draws["zero_stage"]  # the runner's key (integrations/fuzz_engine.py)
            if draws.get("vocab_parallel_lm_head"):  # the runner's too (tensor_parallel); else the default stands
                config["vocab_parallel_lm_head"] = True
        fed = [[b["batch"] for b in replica] for replica in batches]
        if plant == "dp_same_data":
            fed = [fed[0]] * len(fed)
        with warnings.catch_warnings(), contextlib.ExitStack() as env:
            warnings.simplefilter("ignore", FutureWarning)  # gradient_checkpointing_enable's rename
            if draws["engine"] == "accelerate":  # what a launcher sets; accelerate's singletons reset after
                from seqpar.testing.launcher_env import launcher_env

                env.enter_context(launcher_env(ctx.rank, ctx.world_size))
            if draws["engine"] == "autotp":
                from seqpar.testing.deepspeed_teardown import released_deepspeed_engines

                env.callback(_forget_autotp_groups)
                env.enter_context(released_deepspeed_engines())
            out = runner(draws["engine"], build_model, fed, config, accumulate=draws["step"] == "accumulate")
        return {"ok": True, "loss": out["loss"], "replica": out["replica"],
                "grads": out["grads"] if ctx.rank == 0 else None}
    except Exception as e:  # noqa: BLE001 - classified by the driver
        return {"ok": False, "error": error_record(e, also=() if runner is None else (runner_dir(runner),))}
    finally:
        undo()
        tiling.MAX_LOSS_CHUNK_ELEMENTS = cap
        transformers.logging.set_verbosity(verbosity)


def dp_reference(draws: dict[str, Any], batches: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """The engines' DP x SP contract (docs/integrations.md: "each replica's ``loss`` is the mean over its own
    batch's tokens and the gradients are averaged over replicas"; integrations/fsdp.py's divide factor DP, not
    DP x SP): one process without seqpar per replica (:func:`~seqpar.testing.fuzz_models.model_reference` on
    its batches), then ``{"ok", "dtype", "losses": [replica d's loss], "loss": their mean, "grads": the mean
    over replicas of each parameter's gradient}`` (a parameter without a gradient in some replica, an expert
    its tokens missed, counts zeros there). ``dtype`` is fp32 if any replica's model fell back to it."""
    from seqpar.testing.fuzz_models import model_reference

    refs = []
    for rd, rb in zip(replica_draws(draws), batches, strict=True):
        ref = model_reference(rd, rb)
        if not ref["ok"]:
            return ref
        refs.append(ref)
    names = [n for n in refs[0]["grads"]] + sorted({n for r in refs[1:] for n in r["grads"]} - set(refs[0]["grads"]))
    grads = {}
    for n in names:
        present = [r["grads"][n].double() for r in refs if n in r["grads"]]
        grads[n] = sum(present) / len(refs)
    dtype = "float32" if any(r["dtype"] == "float32" for r in refs) else "float64"
    losses = [r["loss"] for r in refs]
    return {"ok": True, "dtype": dtype, "losses": losses, "loss": sum(losses) / len(losses), "grads": grads}


def run_engine_case(pools: Any, draws: dict[str, Any], timeout: float, plant: str | None = None) -> tuple[str, str]:
    """Verdict and detail of an ``engine`` case (``"skipped"``: the tiny model does not run even without
    seqpar). Judged against :func:`dp_reference`: every rank's loss against its replica's, then the DP-mean
    loss and every reduced gradient with :func:`~seqpar.testing.fuzz_models.judge_model`. ``plant``: see
    :func:`_plant` (the fuzzer's own tests)."""
    from seqpar.testing.fuzz_models import (
        case_batches,
        decoder_layers,
        judge_model,
        judge_model_wire,
        kind_dkv_wire_bound,
        run_ranks,
    )

    dp = draws.get("dp", 1)
    if draws["world"] % (dp * draws["tp_size"]) or len(draws.get("replicas", [])) != dp - 1:
        raise ValueError(f"engine draws inconsistent: world {draws['world']}, dp {dp}, tp_size {draws['tp_size']}, "
                         f"{len(draws.get('replicas', []))} other replicas (a --set of dp needs replicas too)")
    batches = [case_batches(rd) for rd in replica_draws(draws)]
    ref = dp_reference(draws, batches)
    ended, per_rank = run_ranks(pools, draws, ref, engine_task, batches, plant, timeout)
    if ended is not None:
        return ended
    replicas = sorted({r["replica"] for r in per_rank})
    if replicas != list(range(len(batches))):
        return "WRONG", f"the ranks fed replicas {replicas}, not 0..{len(batches) - 1}"
    for rank, r in enumerate(per_rank):  # each replica's loss is its own batch's token mean (the DP contract)
        verdict, detail = judge_model({"dtype": ref["dtype"], "loss": ref["losses"][r["replica"]], "grads": {}},
                                      {"loss": r["loss"], "grads": {}})
        if verdict != "exact":
            return verdict, f"rank {rank} (replica {r['replica']}): {detail}"
    by_replica = {r["replica"]: r["loss"] for r in per_rank}
    got = {"loss": sum(by_replica.values()) / len(by_replica), "grads": per_rank[0]["grads"]}
    # an engine may hold an all-zero gradient where the reference has none (ZeRO's flat buffers)
    got["grads"] = {n: g for n, g in got["grads"].items() if n in ref["grads"] or bool(g.ne(0).any())}
    if draws.get("dkv_wire"):  # the bf16 wire (fz33): each gradient within the wire's bound, not exact
        sp = draws["world"] // (draws["tp_size"] * dp)
        return judge_model_wire(ref, got, kind_dkv_wire_bound(sp, decoder_layers(draws["model_type"])))
    return judge_model(ref, got)
