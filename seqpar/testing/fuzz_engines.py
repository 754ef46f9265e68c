"""The fuzzer's ``engine`` cases (:mod:`seqpar.testing.fuzz`): a ``model`` case (:mod:`seqpar.testing.fuzz_models`)
trained through a training engine, as a user would wire it, against one process without seqpar or engine.

Drawn: everything a ``model`` case draws (model type, P in 1..4, mode, sharding, rows / end-padded /
right-padded / packed batches, activation checkpointing off / reentrant / non-reentrant, one step / two
forwards before one backward / gradient accumulation over two micro-batches, ``check_inputs``), then the
engine, one of :data:`ENGINES`:

- ``zero1``, ``zero2``, ``zero3``: :func:`seqpar.integrations.deepspeed.initialize` with that ZeRO stage
  over the P ranks (SP = P); accumulation is DeepSpeed's (``gradient_accumulation_steps`` 2,
  ``engine.backward(loss, scale_wrt_gas=False)`` so that the gradient is the sum the reference takes);
  gradients read with ``deepspeed.utils.safe_get_full_grad`` (reduced over the ranks, gathered under ZeRO-3);
- ``fsdp2``: :func:`seqpar.integrations.fsdp.wrap` (FSDP2 over the P ranks, SP = P); gradients are the
  reduced DTensors' ``full_tensor()``;
- ``tp2`` (P = 2 or 4 only): the same ``wrap`` with ``tp_size`` 2 (TP from the model's own plan,
  SP = P / 2, FSDP2 over the SP ranks).

No optimizer step is judged: the check is the gradient after the engine's reduction, before ``step()``
(the optimizer's arithmetic is the engine's, not seqpar's). A parameter with no gradient in the reference may
have an all-zero one under an engine (ZeRO materialises them); any other difference in which parameters
have gradients is WRONG.

Not drawn: ZeRO-1 with gradient accumulation. DeepSpeed 0.19's ZeRO-1 keeps no gradient readable between
the accumulation boundary's backward and ``step()`` (``safe_get_full_grad`` raises "Gradients are only
available immediately after backward and before engine step", tiny Llama included), so the case cannot be
judged before the optimizer step; ZeRO-2/3 accumulation is drawn.

Reference and tolerances: :func:`seqpar.testing.fuzz_models.model_reference` and
:func:`~seqpar.testing.fuzz_models.judge_model`, the ``model`` cases' own: every parameter's reduced
gradient judged on its own scale against one process in float64 (fp32 where the tiny model cannot run in
float64), in that dtype on the ranks too.
"""

from __future__ import annotations

import random
from typing import Any

import torch

__all__ = ["ENGINES", "draw_engine", "engine_summary", "engine_task", "run_engine_case"]

ENGINES = ("zero1", "zero2", "zero3", "fsdp2", "tp2")


def draw_engine(rng: random.Random) -> dict[str, Any]:
    """An ``engine`` case's draws (JSON-able): a ``model`` case's, then ``engine`` (``tp2`` only where the
    world is even; ``zero1`` not with accumulation, see the module docstring), and ``tp_size``."""
    from seqpar.testing.fuzz_models import draw_model

    draws = draw_model(rng)
    engine = rng.choice([e for e in ENGINES if (e != "tp2" or draws["world"] % 2 == 0)
                         and (e != "zero1" or draws["step"] != "accumulate")])
    tp = 2 if engine == "tp2" else 1
    sp = draws["world"] // tp
    if draws["mode"] == "hybrid":  # the model draw's Ulysses degree is for SP = world
        draws["ulysses_size"] = 2 if sp == 4 else sp
    draws.update(kind="engine", engine=engine, tp_size=tp)
    return draws


def engine_summary(draws: dict[str, Any]) -> str:
    """One short line naming the case's composition."""
    from seqpar.testing.fuzz_models import model_summary

    return f"engine {draws['engine']} " + model_summary(draws).removeprefix("model ")


def _full_grads_zero(engine: Any) -> dict[str, torch.Tensor]:
    """Every parameter's gradient after the engine's reduction (collective under ZeRO-3: every rank calls)."""
    from deepspeed.utils import safe_get_full_grad

    out = {}
    for name, p in engine.module.named_parameters():
        g = safe_get_full_grad(p)
        if g is not None:
            out[name] = g.detach().clone()
    return out


def _full_grads_fsdp(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's reduced gradient, DTensors gathered (collective: every rank calls)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is None:
            continue
        out[name] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone()
    return out


def engine_task(ctx: Any, draws: dict[str, Any], batches: list[dict[str, Any]], dtype_name: str) -> dict[str, Any]:
    """Pool task (every rank): the case through its engine; rank 0 returns the loss and the reduced gradients,
    every rank ``{"ok": False, "error"}`` on an exception."""
    import warnings

    import transformers

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # gradient_checkpointing_enable's rename
            return _engine_task(ctx, draws, batches, dtype_name)
    finally:
        transformers.logging.set_verbosity(verbosity)


def _engine_task(ctx: Any, draws: dict[str, Any], batches: list[dict[str, Any]], dtype_name: str) -> dict[str, Any]:
    import seqpar
    from seqpar.sequence.batch import shard_batch
    from seqpar.testing.fuzz_models import build_case_model, enable_checkpointing
    from seqpar.testing.verdicts import error_record

    engine_name, accumulate = draws["engine"], draws["step"] == "accumulate"
    cfg = {"size": ctx.world_size // draws["tp_size"], "tp_size": draws["tp_size"], "mode": draws["mode"],
           "sharding": draws["sharding"], "ulysses_size": draws["ulysses_size"], "check_inputs": draws["check_inputs"]}
    manager = None
    try:
        model = build_case_model(draws, getattr(torch, dtype_name))
        enable_checkpointing(model, draws["checkpointing"])
        if engine_name.startswith("zero"):
            from seqpar.integrations.deepspeed import initialize

            ds_config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2 if accumulate else 1,
                         "zero_optimization": {"stage": int(engine_name[-1])}, "zero_allow_untested_optimizer": True,
                         "gradient_clipping": 0.0, "steps_per_print": 10 ** 9, "sequence_parallel": cfg}
            engine, _, _, _ = initialize(model=model, config=ds_config,
                                         optimizer=lambda params: torch.optim.SGD(params, lr=0.0))
            manager, forward = engine.seqpar_manager, engine

            def backward(loss: torch.Tensor) -> None:
                engine.backward(loss, scale_wrt_gas=False)  # the sum of the micro-batches' losses, as the reference

            def full_grads() -> dict[str, torch.Tensor]:
                return _full_grads_zero(engine)
        else:
            from seqpar.integrations.fsdp import wrap

            manager = seqpar.init_process_groups(config=cfg)
            forward = wrap(model, cfg, manager=manager, fsdp={"version": 2})

            def backward(loss: torch.Tensor) -> None:
                loss.backward()

            def full_grads() -> dict[str, torch.Tensor]:
                return _full_grads_fsdp(forward)
        losses = []
        for b in batches:
            out = forward(**shard_batch(b["batch"], group=manager.sp_group, sharding=draws["sharding"]))
            if accumulate:
                backward(out.loss)
            losses.append(out.loss)
        if not accumulate:
            backward(sum(losses))
        grads = full_grads()
        return {"ok": True, "loss": float(sum(x.detach() for x in losses)), "grads": grads if ctx.rank == 0 else None}
    except Exception as e:  # noqa: BLE001 - classified by the driver
        return {"ok": False, "error": error_record(e)}
    finally:
        if manager is not None:
            manager.destroy()


def run_engine_case(pools: Any, draws: dict[str, Any], timeout: float) -> tuple[str, str]:
    """Verdict and detail of an ``engine`` case (``"skipped"``: the tiny model does not run even without
    seqpar)."""
    from seqpar.testing.fuzz_models import case_batches, judge_model, model_reference
    from seqpar.testing.verdicts import classify_errors

    batches = case_batches(draws)
    ref = model_reference(draws, batches)
    if not ref["ok"]:
        return "skipped", f"cannot run without seqpar: {ref['error']}"
    per_rank = pools.run(draws["world"], engine_task, draws, batches, ref["dtype"], timeout=timeout)
    bad = classify_errors(per_rank)
    if bad is not None:
        return bad
    got = per_rank[0]
    # an engine may hold an all-zero gradient where the reference has none (ZeRO's flat buffers)
    got["grads"] = {n: g for n, g in got["grads"].items() if n in ref["grads"] or bool(g.ne(0).any())}
    return judge_model(ref, got)
