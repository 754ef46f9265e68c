"""The fuzzer's ``engine`` cases (:mod:`seqpar.testing.fuzz`): a ``model`` case (:mod:`seqpar.testing.fuzz_models`)
trained through a training engine, as a user would wire it, against one process without seqpar or engine.

Drawn: everything a ``model`` case draws (model type, P in 1..4, mode, sharding, rows / end-padded /
right-padded / packed batches, activation checkpointing off / reentrant / non-reentrant, one step / two
forwards before one backward / gradient accumulation over two micro-batches, ``check_inputs``), then the
engine, one of :data:`ENGINES`: ``zero1``, ``zero2``, ``zero3`` (DeepSpeed ZeRO over the P ranks), ``fsdp2``
(FSDP2), ``fsdp1`` (FSDP1, ``FullyShardedDataParallel`` as seqpar's adapter wires it: each block a unit,
``use_orig_params=True``; 40% of the FSDP2 draws), ``tp2`` (P = 2 or 4 only: TP 2 from the model's own plan),
then the data-parallel degree ``dp``: at P = 4, DP 2 x SP 2 (``tp2``: TP 2 x SP 1 x DP 2) 60% of the time; at
P = 2, DP 2 x SP 1 30% of the time (not ``tp2``); at P = 3, DP 3 x SP 1 30% of the time (the one split where
dividing by SP instead of DP shows: at DP 2 x SP 2 both are 2); else DP 1 (SP = P / tp). Each DP replica after
the first has batches of its own (``replicas``: its own case seed, so other tokens, and lengths drawn as the
model draw's: other rows, padding, documents), as a DP loader feeds it.

``tp2`` then draws its loss as a user's config sets it (:func:`draw_tp_loss`, after every other draw):
``tp_sequence_parallel`` on or off (on: the residual stream split over TP and the LM head's logits kept split on
the vocabulary, a DTensor ``Shard(-1)`` that the swap's loss reduces vocab-parallel,
:mod:`seqpar.sequence.vocab_parallel`; off: the plan's gathered logits), the tiled loss (``tiled_loss``; under
TP it is vocab-parallel with or without ``tp_sequence_parallel``) with its tile, the vocabulary size (odd ones
that TP 2 splits unevenly, 97 = 49 + 48) and ignored labels (a prompt of -100 labels, right padding, packed
documents), and the loss layout's own key ``tp_loss_parallel`` (``"auto"``, or true / false against
``tp_sequence_parallel``: the vocab-split logits without TP sequence parallelism, gathered ones with it; false with
the tiled loss is refused by name), from the case's own stream. The reference is unchanged: one process per DP
replica, float64, the whole vocabulary. Not drawn: label smoothing: the model's loss (the swap's ``loss_function``,
:func:`seqpar.sequence.loss.sequence_parallel_loss`) takes none, and Trainer's ``label_smoothing_factor`` is
refused by seqpar's trainer integration (the trainer kind's business).

``autotp`` (DeepSpeed's AutoTP: :func:`seqpar.integrations.deepspeed.initialize` with ``tp_size`` 2 in the
``sequence_parallel`` block, which sets ``tensor_parallel.autotp_size``) takes 40% of the ``tp2`` draws and
``accelerate`` (the plain accelerate loop: ``Accelerator``, :func:`seqpar.integrations.accelerate.prepare`,
``accelerator.backward``, its gradient accumulation inside ``accelerator.accumulate``; FSDP2 underneath) 35% of
the ``fsdp2`` draws left after ``fsdp1``'s, both from a stream of their own (seeded from the draw's state, so
every case seed draws what it drew before them), and both keep their parent's rules. ``autotp`` is TP 2 x SP
(world / (dp x 2)) x DP 1 or 2 at world 4, TP 2 x SP 1 at world 2 (an odd world forced to ``autotp`` becomes the
next even one), judged like ``tp2`` (the TP slices of each gradient gathered by the runner). Its draws
(:func:`draw_autotp`): the ZeRO stage, 1 or 2 (2 with accumulation: ZeRO-1's rule above), then 3 in 30% of the
cases (drawn last, so every other draw is what the case seed drew before it), the model type among
:func:`autotp_types`, the tiled loss, odd vocabularies and ignored labels as ``tp2`` draws them, and
``tp_sequence_parallel`` 10% of the time, which seqpar refuses under DeepSpeed by name (it is FSDP2's), then
(fz24e, last) ``vocab_parallel_lm_head`` true in 30% of the cases: ``tensor_parallel.vocab_parallel_lm_head`` set true,
DeepSpeed's ``VocabParallelLinear`` head (a tied embedding split with it), the loss seqpar's vocab-parallel one under
SP > 1 (``seqpar_loss_on_split_head``), DeepSpeed's at SP 1; the tiled loss vocab-parallel over TP on it since
session 25 (ts25; under ZeRO-3 too since session 26, z3t26) (false: the key left unset, seqpar's default false under SP,
DeepSpeed's own at SP 1). Not drawn for a type whose tied embedding
DeepSpeed refuses to split or whose forward DeepSpeed's split head breaks (:func:`vocab_split_refused`: the Gemma
family's scaled embeddings but Gemma 3's, Bamba's z-loss: both refused by name by seqpar's ``initialize`` now, on every
rank; Apertus 1.5's read of the head's width, which crashed, is exact since session 25 and drawn).
``accelerate`` draws what ``fsdp2`` draws and is judged like it. Apertus is drawn under ``autotp``: its xIELU
activation's parameters act on the features AutoTP splits, and DeepSpeed 0.19.8 does not sum their gradient over TP
(each TP rank's share, silently, without seqpar: case 1878399021); seqpar's ``initialize`` does
(``sum_split_activation_gradients`` in :mod:`seqpar.integrations.deepspeed_tp`), exact under ZeRO-2 and ZeRO-3.

Not drawn under ``autotp``, each DeepSpeed's own with or without seqpar (DeepSpeed 0.19.8, shown on 2 gloo ranks
with plain ``deepspeed.initialize``, ``tensor_parallel.autotp_size`` 2, no seqpar, tiny models in float64):

- ZeRO-0: its reduction (``engine.allreduce_gradients`` -> ``split_half_float_double_sparse``) asserts
  "attempting to reduce an unsupported grad type: torch.float64", so it cannot run the float64 cases (tiny
  llama, plain: the same assertion on both ranks). ZeRO-1/2 reduce float64.
- model types outside :func:`autotp_types`: a ``base_model_tp_plan`` with a style DeepSpeed does not convert
  (``packed_colwise``, ``moe_tp_experts``, ``rowwise_split_input``: DeepSpeed's own ``ValueError`` "HuggingFace
  tp_plan contains unsupported partition style(s)", phi3 and granitemoehybrid in seed 811's first run), mixture-of-
  experts blocks, and no plan at all, where AutoTP's name-pattern heuristic splits the mixers' projections and
  the model's own code fails (plain falcon_mamba and zamba2: "split_with_sizes expects split_sizes to sum exactly
  to ...", the crash seed 811's first run met under seqpar).

ZeRO-3 under ``autotp`` (drawn since session 24; ``--set engine=autotp --set zero_stage=3`` forces it): ZeRO-3
partitions each TP slice, and the runner gathers the slices over TP by their ``ds_shape``; seeds 915 and 916 (16
cases) found nothing wrong under ZeRO-3 itself (exact or refused by name).

Found by ``autotp`` in session 24: the tiled loss drawn under ``autotp`` never reached its config (set under
``tp_loss_parallel``, ``tp2``'s key alone, since session 23's merge), so those cases ran the plain loss and were
exact (case 2075268836 under ZeRO-3, and the pinned 756378705 with them); :func:`engine_task` sets it with
``tp_sequence_parallel`` (both engines' key) now, and they are refused by name. And tiny Dory under AutoTP (case
543632810: ``lm_head.logit_scale`` without a gradient): AutoTP swaps ``DoryLMHead``, an ``nn.Linear`` subclass
scaling its logits by a trained ``logit_scale``, for its plain ``LinearLayer``, dropping the scale, with or without
seqpar (plain ``deepspeed.initialize``, ``autotp_size`` 2, tiny dory in float64 on 2 gloo ranks with a trained scale:
the loss 1.5% off one process). seqpar cannot keep the parameter, so
:func:`seqpar.integrations.deepspeed.initialize` refuses by name, on every rank, a model whose parameters AutoTP
dropped; Dory stays drawn, its refusal checked.

Found by ``autotp``: the tiled loss under AutoTP was silently wrong (case 756378705, tiny qwen2, TP 2 x SP 1: the
loss 13% off): it computes the logits from ``lm_head.weight``, which AutoTP had replaced by the TP rank's slice
of the vocabulary. :func:`seqpar.integrations.deepspeed.initialize` refuses it by name now on every rank where
AutoTP split the head (a tied head AutoTP keeps whole is exact). And Gemma 3n's activation-sparse MLPs under AutoTP
(case 1709044604: the loss 5.5e-3 off; their cutoff is a statistic over ``gate_proj``'s output features, which
AutoTP splits), refused by name now as under FSDP2's TP. And tiny starcoder2 under AutoTP 2 x SP 2 (case 222158336 of seed 811: the
loss 6.9e-4 off; 3.7e-2 on plain rows; exact at TP 2 x SP 1): DeepSpeed 0.19.8 turns on its vocabulary-parallel LM
head by itself for a tied model whose transformers tp plan has ``embedding_rowwise`` and replaces ``loss_function``
by its ``VocabParallelCausalLMLoss`` without an SP group (each SP rank's shard mean), overriding seqpar's loss.
:func:`seqpar.integrations.deepspeed.initialize` sets ``tensor_parallel.vocab_parallel_lm_head`` false under SP now
(the head whole, seqpar's loss; exact) and refuses an explicit true by name.

The DP x SP contract judged (docs/integrations.md, integrations/fsdp.py's divide factor; DeepSpeed's with
seqpar's ``mpu`` the same): each replica's loss is the mean over its own batch's tokens (per document when
packed), and the reduced gradient is the mean over the DP replicas of each replica's full-sequence gradient
(divisor DP, not DP x SP). So the reference (:func:`dp_reference`) is one process per replica, on that
replica's batches, and every rank's loss is judged against its replica's, every reduced gradient against the
DP mean. Not the global token mean over the replicas: that is Trainer's ``num_items_in_batch`` path
(tests/test_trainer.py), not what a plain engine loop computes.

The engines are driven by an *engine runner* (:class:`EngineRunner`), not by this module: the harness is
part of ``seqpar/``, which never imports the engine adapters (``seqpar.integrations``, tests/test_layering.py).
Runners are found through the entry-point group :data:`ENTRY_POINT_GROUP` (one entry per engine name;
seqpar's own, ``seqpar.integrations.fuzz_engine:run_engine``, is declared in setup.cfg), so the dependency
points from the adapters to this protocol, never back. A drawn engine with no runner installed is a crash of
the case, named.

The check is the gradient after the engine's reduction, before ``step()`` (the optimizer's arithmetic is the
engine's, not seqpar's). A parameter with no gradient in the reference may have an all-zero one under an
engine (ZeRO materialises them); any other difference in which parameters have gradients is WRONG.

Not drawn: ZeRO-1 with gradient accumulation. DeepSpeed 0.19's ZeRO-1 keeps no gradient readable between
the accumulation boundary's backward and ``step()`` (``safe_get_full_grad`` raises "Gradients are only
available immediately after backward and before engine step", tiny Llama included), so the case cannot be
judged before the optimizer step; ZeRO-2/3 accumulation is drawn.

Not drawn either: ZeRO-2/3 with reentrant activation checkpointing and two forwards before one backward
(non-reentrant checkpointing is drawn in their place). Reentrant checkpointing recomputes each layer in a
backward of its own, so a parameter that two forwards used gets its gradient accumulated, and DeepSpeed's
per-parameter reduction hook fired, twice in one backward: ZeRO-2 stops with DeepSpeed's own "The parameter
... has already been reduced. Gradient computed twice for this partition. Multiple gradient reductions are
currently not supported" (fuzzer case 1722634749: qwen2, P = 3), and ZeRO-3 fails an assertion of its own
(below). That is DeepSpeed's limit with or without seqpar, not a composition seqpar can fix or refuse
(it cannot see two forwards coming): plain ``deepspeed.initialize`` on one rank, no seqpar, tiny qwen2 under
ZeRO-2 raises that assertion, and tiny dbrx under ZeRO-3 fails DeepSpeed's own
``assert len(set(p.ds_id for p in params_in_bucket)) == len(params_in_bucket)`` (stage3.py,
``__reduce_and_partition_ipg_grads``); with non-reentrant checkpointing both run (DeepSpeed 0.19.8).

Not drawn either: FSDP2 (``fsdp2``, ``tp2``; ``fsdp1``, which takes its draws, keeps the rule as a precaution)
with reentrant activation checkpointing and two forwards before one backward (non-reentrant checkpointing is
drawn in their place). FSDP2 gets the gradients of a unit nested
inside a reentrantly checkpointed block wrong when two forwards precede one backward: seqpar's adapter gives
a ``*Block`` class inside a decoder layer a unit of its own (the MoE blocks), and fuzzer case 1940826750 (tiny
flex_olmo, P = 1, rows) had ``model.layers.0.mlp.gate.weight`` 76% off, loss exact. torch's limit, with or
without seqpar: plain ``fully_shard`` on one rank (gloo), no seqpar, each layer's ``mlp`` and then each layer
sharded, reentrant ``gradient_checkpointing_enable``, two forwards then one backward, against the same model
unsharded: gradients 96% off (flex_olmo's experts), 91% (mixtral's gate), 110% (llama's ``down_proj``, its MLP
made a unit); exact with one forward, with non-reentrant checkpointing, or without the nested unit (torch
2.13). The adapter cannot refuse it: it cannot see two forwards coming. ``tp2`` wraps with the same units; its
MoE models are refused by their TP plans today (``packed_colwise``: mixtral, qwen3_moe), and tiny llama under
tp2 with reentrant checkpointing and two forwards is exact, so the pair is left out there as a precaution
(coverage lost: models without nested units, exact under both).

Not drawn either: ZeRO-3 with two forwards before one backward on a model with mixture-of-experts blocks
(gradient accumulation is drawn in its place). seqpar's DeepSpeed adapter makes every module owning an
``experts`` child a ZeRO-3 leaf module (:func:`has_expert_blocks`; without it the ranks' routing-dependent
gathers mismatch, case 1260527780: tiny dbrx, P = 3, gloo "Received data size doesn't match expected
size", rank 2 aborted). DeepSpeed reduces a leaf module's gradients in that module's backward hook, which
fires once per forward call: two forwards through one block reduce its parameters twice in one backward
and fail stage3's one-``ds_id``-per-bucket assertion, with or without seqpar (plain ``deepspeed.initialize``
on one rank, tiny dbrx with ``set_z3_leaf_modules``: the same assertion).

Not drawn either: LongCat-Flash (:data:`ZERO_COMPUTATION_EXPERTS`) under an engine other than ZeRO-3 (ZeRO-3
is drawn in its place). Its router may send every token of a shard to its zero-computation experts, so that
the real experts' weights get no gradient on that rank while they get one on another: ZeRO-1/2 and FSDP2
(and FSDP1) then reduce different sets of gradients on different ranks and abort (case 1535814214: P = 2, rank 1 with
no expert gradient; plain ZeRO-2 and plain FSDP2 abort the same way on a 2-rank toy whose parameter only one
rank uses). ZeRO-3's leaf module zero-fills the unused experts and is exact. With real shards of thousands of
tokens a layer whose every token skips the real experts is not to be expected; the tiny model's 2-16 token
shards meet it.

Reference and tolerances: :func:`seqpar.testing.fuzz_models.model_reference` and
:func:`~seqpar.testing.fuzz_models.judge_model`, the ``model`` cases' own: every parameter's reduced
gradient judged on its own scale against one process in float64 (fp32 where the tiny model cannot run in
float64), in that dtype on the ranks too.
"""

from __future__ import annotations

import contextlib
import hashlib
import random
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

__all__ = ["ENGINES", "ENTRY_POINT_GROUP", "CHECK_ENTRY_POINT_GROUP", "EngineRunner", "engine_runner", "runner_dir", "draw_engine", "draw_tp_loss",
           "draw_autotp", "autotp_types", "vocab_split_refused", "fit_tp_lengths", "tp_plan_types", "engine_summary", "PLANTS",
           "engine_task", "run_engine_case", "has_expert_blocks", "replica_draws", "dp_reference", "force_engine"]

ENGINES = ("zero1", "zero2", "zero3", "fsdp2", "fsdp1", "tp2", "autotp", "accelerate")
ENTRY_POINT_GROUP = "seqpar.fuzz_engines"
CHECK_ENTRY_POINT_GROUP = "seqpar.fuzz_engine_checks"
"""The adapters' refusals the draws ask (setup.cfg): ``vocab_split_tied_embedding`` names
``seqpar.integrations.deepspeed_tp.refuse_unsplittable_tied_embedding`` (:func:`vocab_split_refused`)."""


class EngineRunner(Protocol):
    """What an entry point of :data:`ENTRY_POINT_GROUP` names: one step of a model through an engine, called
    on every rank of the default process group.

    Args:
        engine: the engine's name (the entry point's name, one of :data:`ENGINES`).
        build_model: makes the case's model (the same on every rank; activation checkpointing already set).
        batches: the case's full (unsharded) batches, as the model takes them; the runner shards each with
            :func:`seqpar.shard_batch` on its SP group and ``config["sharding"]``.
        config: the ``sequence_parallel`` config (``size``, ``tp_size``, ``mode``, ``sharding``,
            ``ulysses_size``, ``check_inputs``; ``tp2`` cases also ``tp_sequence_parallel`` and ``tiled_loss``).
        accumulate: one backward per batch (gradient accumulation); else every forward, then one backward of
            the summed losses.

    Returns:
        ``{"loss": float (summed over the batches), "grads": {parameter name: reduced full gradient}}`` (on
        every rank). A refusal is raised (seqpar's errors, or the runner's own ``ValueError``).
    """

    def __call__(self, engine: str, build_model: Callable[[], nn.Module], batches: list[dict[str, Any]],
                 config: dict[str, Any], *, accumulate: bool) -> dict[str, Any]: ...


def engine_runner(engine: str, group: str = ENTRY_POINT_GROUP, what: str = "engine runner",
                  declared: str = "run_engine") -> EngineRunner:
    """The installed runner of ``engine`` (the entry point of that name in ``group``, default
    :data:`ENTRY_POINT_GROUP`; the ``dynamic`` kind's runners are another group, ``what`` and ``declared`` name
    them in the error).

    Raises:
        LookupError: none is installed (seqpar installed without its metadata, e.g. a source tree on
            ``sys.path``, or metadata older than the group: ``pip install -e .`` declares seqpar's own).
    """
    found = entry_points(group=group, name=engine)
    if not found:
        raise LookupError(
            f"no fuzzer {what} for {engine!r}: no entry point {engine!r} in group {group!r} "
            f"(installed: {sorted(ep.name for ep in entry_points(group=group))}). Install seqpar "
            f"(pip install -e . in a checkout), which declares "
            f"{declared if ':' in declared else 'seqpar.integrations.fuzz_engine:' + declared} in setup.cfg")
    return next(iter(found)).load()


def runner_dir(runner: Any) -> Path:
    """The folder of the package that holds ``runner``'s module: errors raised there are the adapters' own
    refusals (``integrations/`` in a checkout, ``seqpar/integrations`` in a wheel)."""
    import sys

    return Path(sys.modules[runner.__module__].__file__).resolve().parent


ZERO_COMPUTATION_EXPERTS = frozenset({"longcat_flash"})
"""Model types whose router can skip every real expert for a whole shard (see the module docstring)."""


def force_engine(draws: dict[str, Any], free: list[str], rng: random.Random) -> str | None:
    """Re-derive, in place, what forced keys (``--set``, :func:`seqpar.testing.fuzz.force`) make stale in an
    ``engine`` case's ``draws``; ``free`` names the keys not forced, ``rng`` draws what must be new. Returns the
    conflict (the case is then ``skipped``) or None. ``dp`` must divide ``world / tp_size`` (a forced world keeps
    the drawn ``dp`` where it still does, else the largest divisor under it), and ``replicas`` holds the batches
    of replicas 1..dp-1: cut to the first ones, or extended by replicas drawn as :func:`draw_engine` draws them
    (a forced ``dp=1`` needs no ``--set replicas=[]``)."""
    from seqpar.testing.fuzz_models import draw_lengths

    world, dp, tp = draws["world"], draws.get("dp", 1), draws["tp_size"]
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        return f"dp={dp!r} (a positive int)"
    if world % (dp * tp):
        if "dp" not in free or world % tp:
            return f"world={world} is not a multiple of dp={dp} x tp_size={tp}"
        dp = max(d for d in range(1, dp + 1) if (world // tp) % d == 0)
    draws["dp"] = dp
    replicas = list(draws.get("replicas", []))
    if len(replicas) != dp - 1:
        if "replicas" not in free:
            return f"replicas ({len(replicas)}) != dp - 1 = {dp - 1} (one batch draw per replica after the first)"
        draws["replicas"] = replicas[:dp - 1] + [
            {"case_seed": rng.randrange(2 ** 31), "lengths": draw_lengths(rng, world, draws["batch"])}
            for _ in range(dp - 1 - len(replicas))]
    return None


def draw_engine(rng: random.Random, engine: str | None = None) -> dict[str, Any]:
    """An ``engine`` case's draws (JSON-able): a ``model`` case's, then ``engine`` (``tp2`` only where the
    world is even; ``zero1`` not with accumulation, see the module docstring), ``tp_size``, and the data-parallel
    degree ``dp`` with the batches of the replicas after the first (``replicas``: one ``{"case_seed",
    "lengths"}`` per replica 1..dp-1, drawn independently of replica 0's, which are the model draw's own).

    The draws added with DP and FSDP1 are taken after every other draw, so a case seed's model, checkpointing,
    step and replica-0 batches are those it had before them: ``fsdp1`` takes 40% of the ``fsdp2`` draws, then
    DP: at world 4, DP 2 x SP 2 for the ZeRO and FSDP engines and TP 2 x SP 1 x DP 2 for
    ``tp2``, 60% of the time; at world 2, DP 2 x SP 1 30% of the time (not ``tp2``: no rank left); at world 3,
    DP 3 x SP 1 30% of the time. ``tp2`` then draws its loss (:func:`draw_tp_loss`), after everything else.

    ``engine``: drawn as that engine (``--set engine=tp2`` of the fuzzer's CLI): an odd world becomes the next
    even one for ``tp2`` (its lengths redrawn), ``zero1`` makes accumulation two forwards, a model type with
    zero-computation experts is redrawn for an engine other than ``zero3``; every other draw is as drawn."""
    from seqpar.testing.fuzz_models import draw_lengths, draw_model
    from seqpar.testing.tiny_models import decoder_model_types

    draws = draw_model(rng)
    drawn = rng.choice([e for e in ENGINES if e not in ("fsdp1", "autotp", "accelerate")
                        and (e != "tp2" or draws["world"] % 2 == 0)
                        and (e != "zero1" or draws["step"] != "accumulate")])
    if engine is not None:
        if engine not in ENGINES:
            raise ValueError(f"unknown engine {engine!r}: choose one of {list(ENGINES)}")
        if engine in ("tp2", "autotp") and draws["world"] % 2:
            draws["world"] += 1
            draws["lengths"] = draw_lengths(rng, draws["world"], draws["batch"])
        if engine == "zero1" and draws["step"] == "accumulate":
            draws["step"] = "two-forwards"
        if engine != "zero3" and draws["model_type"] in ZERO_COMPUTATION_EXPERTS:
            draws["model_type"] = rng.choice([t for t in decoder_model_types() if t not in ZERO_COMPUTATION_EXPERTS])
        drawn = engine
    engine, forced = drawn, engine
    if draws["model_type"] in ZERO_COMPUTATION_EXPERTS:
        engine = "zero3"  # the other engines' own limit with experts unused on some rank (the module docstring)
    if (engine in ("zero2", "zero3", "fsdp2", "tp2", "autotp", "accelerate") and draws["step"] == "two-forwards"
            and draws["checkpointing"] == "reentrant"):
        # DeepSpeed's own limit (ZeRO-2/3) and FSDP2's (fsdp2, tp2; the module docstring): no draw taken
        draws["checkpointing"] = "non-reentrant"
    if engine == "zero3" and draws["step"] == "two-forwards" and has_expert_blocks(draws["model_type"]):
        draws["step"] = "accumulate"  # DeepSpeed's limit for ZeRO-3 leaf modules (the module docstring)
    world = draws["world"]
    if engine == "fsdp2" and rng.random() < 0.4 and forced != "fsdp2":
        # FSDP1 takes 40% of FSDP2's draws and their rules (the module docstring); 40%, not half: the fsdp2 cases
        # pinned in tests/test_fuzz.py (1556311079, 1739095319, 1940826750) stay fsdp2
        engine = "fsdp1"
    # autotp and accelerate take a share of tp2's and fsdp2's draws from a stream of their own, seeded from rng's
    # state without drawing from it, so that every case seed draws from rng exactly what it drew before them (the
    # pinned cases)
    own = random.Random(hashlib.sha256(repr(rng.getstate()).encode()).hexdigest())
    if engine == "tp2" and forced != "tp2" and own.random() < 0.4:
        engine = "autotp"
    elif engine == "fsdp2" and forced != "fsdp2" and own.random() < 0.35:
        engine = "accelerate"
    tp = 2 if engine in ("tp2", "autotp") else 1
    dp = 1
    if world == 4 and rng.random() < 0.6:
        dp = 2
    elif world == 2 and engine not in ("tp2", "autotp") and rng.random() < 0.3:
        dp = 2
    elif world == 3 and rng.random() < 0.3:
        dp = 3  # DP 3 x SP 1: the one split whose divisor DP differs from SP (DP 2 x SP 2's is 2 either way)
    sp = world // (tp * dp)
    if draws["mode"] == "hybrid":  # the model draw's Ulysses degree is for SP = world
        draws["ulysses_size"] = 2 if sp == 4 else sp
    replicas = [{"case_seed": rng.randrange(2 ** 31), "lengths": draw_lengths(rng, world, draws["batch"])}
                for _ in range(dp - 1)]
    draws.update(kind="engine", engine=engine, tp_size=tp, dp=dp, replicas=replicas)
    if engine == "tp2":
        draw_tp_loss(rng, draws)
        # the loss layout's key, from the case's own stream (rng's draws, and so the pinned cases, unchanged):
        # "auto" (follow tp_sequence_parallel) 60%, else true or false against it (false with the tiled loss: a
        # refusal by name)
        u = own.random()
        draws["tp_loss_parallel"] = "auto" if u < 0.6 else not draws["tp_sequence_parallel"] if u < 0.9 else \
            draws["tp_sequence_parallel"]
    elif engine == "autotp":
        draw_autotp(own, draws)
    return draws


def draw_autotp(rng: random.Random, draws: dict[str, Any]) -> None:
    """An ``autotp`` case's draws, in place (JSON-able; from the case's own stream, after every other draw):
    the ZeRO stage ``zero_stage`` (1 or 2; 2 with accumulation, see the module docstring; then 3 30% of the time,
    after every other draw, so that they are what each case seed drew before ZeRO-3 was drawn), the model
    type redrawn among :data:`~seqpar.testing.fuzz_models.TILEABLE_TYPES` 30% of the time, then the loss knobs
    as :func:`draw_tp_loss` draws them for ``tp2`` (the tiled loss with its tile, odd vocabularies, ignored
    labels), but ``tp_sequence_parallel`` 10% of the time only: seqpar refuses it under DeepSpeed by name
    (docs/integrations.md), which those cases check on every rank; last (fz24e), ``vocab_parallel_lm_head``: DeepSpeed's
    vocabulary-split LM head, true 30% of the time but for the types :func:`vocab_split_refused` names."""
    from seqpar.testing.fuzz_models import TILEABLE_TYPES
    from seqpar.testing.tiny_models import VOCAB

    draws["zero_stage"] = 2 if draws["step"] == "accumulate" else rng.choice((1, 2))
    shardable = autotp_types()
    tileable_shardable = [t for t in TILEABLE_TYPES if t in shardable]
    if rng.random() < 0.3 and tileable_shardable:
        draws["model_type"] = rng.choice(tileable_shardable)
    elif draws["model_type"] not in shardable:
        draws["model_type"] = rng.choice(shardable)
    tileable = draws["model_type"] in TILEABLE_TYPES
    tiled = rng.random() < (0.5 if tileable else 0.1)
    tile = rng.choice((None, None, 1, rng.randint(2, 7)))
    vocab = rng.choice((VOCAB, VOCAB, 97, 61, 31))
    draws["tp_sequence_parallel"] = rng.random() < 0.1
    draws["memory"] = {"tiled_loss": tiled, "loss_tile_rows": tile if tiled else None,
                       "vocab": vocab if tileable else VOCAB, "ignored_prefix": rng.choice((0, 0, 1, rng.randint(2, 8)))}
    if rng.random() < 0.3:
        # ZeRO-3, last: every draw above is what the case seed drew before it (a third of the stage draws flip to 3).
        # Its rules are ZeRO-3's: two forwards with reentrant checkpointing are already non-reentrant (draw_engine),
        # and autotp_types has no mixture-of-experts blocks (ZeRO-3's leaf modules)
        draws["zero_stage"] = 3
    # DeepSpeed's vocabulary-split LM head (tensor_parallel.vocab_parallel_lm_head: true), last (fz24e): every draw
    # above is what the case seed drew before it. 30% of the cases, the band [0.4, 0.7) of the draw: the pinned autotp
    # cases (AUTOTP_CASE 810, AUTOTP_ZERO3_CASE 21304, 1709044604 in tests/test_fuzz.py) fall outside it and keep the
    # head they were pinned on. Not drawn where DeepSpeed's split head fails the type by itself (vocab_split_refused)
    draws["vocab_parallel_lm_head"] = 0.4 <= rng.random() < 0.7 and not vocab_split_refused(draws["model_type"])


_VOCAB_SPLIT_REFUSED: dict[str, bool] = {}


def vocab_split_refused(model_type: str) -> bool:
    """Whether DeepSpeed 0.19.8's vocabulary-split LM head (``vocab_parallel_lm_head: true``) fails the tiny
    ``model_type`` by itself (fz24e; each shown with plain ``deepspeed.initialize``, no seqpar, ``autotp_size`` 2 at
    SP 1 on 2 gloo ranks), so that it is not drawn there (each refused by name by seqpar's ``initialize`` on every
    rank, tests/test_deepspeed_tp.py::test_vocab_split_head_types_deepspeed_breaks_are_exact_or_refused_by_name):

    - a tied embedding whose ``forward`` is not ``nn.Embedding``'s (Gemma 3's scaled embedding aside): AutoTP splits
      it with the head and refuses it, ``NotImplementedError: Vocabulary-parallel sharding does not support the custom
      embedding forward of GemmaTextScaledWordEmbedding`` (case 491650326 of seed 952; gemma, gemma2, gemma3n_text,
      gemma4_unified_text, vaultgemma), asked of seqpar's own refusal,
      :func:`seqpar.integrations.deepspeed_tp.refuse_unsplittable_tied_embedding` (DeepSpeed's
      ``VocabParallelEmbedding.validate_embedding`` on a tied embedding), found through the entry point
      ``vocab_split_tied_embedding`` of :data:`CHECK_ENTRY_POINT_GROUP` (the harness does not import the adapters),
      so that the draw and the library cannot drift;
    - a causal-LM ``forward`` that normalises the logits over the vocabulary outside ``loss_function``
      (``logsumexp``: Bamba's z-loss, over this TP rank's slice of the vocabulary only, the loss silently 8% off:
      case 1297835562 of seed 951), asked of the class's source.

    Apertus 1.5, whose ``forward`` reads ``self.lm_head.out_features`` (``AttributeError`` on DeepSpeed's
    ``VocabParallelLinear``: case 60306700 of seed 951), is drawn since session 25: seqpar's ``initialize`` gives the
    split head the whole head's width (:func:`seqpar.integrations.deepspeed_tp.complete_split_head`), exact.

    Once per type (the tiny model built once)."""
    if model_type not in _VOCAB_SPLIT_REFUSED:
        import inspect

        from transformers import AutoModelForCausalLM

        from seqpar.config import ConfigError
        from seqpar.testing.tiny_models import tiny_config

        refuse = engine_runner("vocab_split_tied_embedding", CHECK_ENTRY_POINT_GROUP, "check",
                               "seqpar.integrations.deepspeed_tp:refuse_unsplittable_tied_embedding")
        model = AutoModelForCausalLM.from_config(tiny_config(model_type))
        refused = "logsumexp" in inspect.getsource(type(model).forward)
        try:
            refuse(model, {"tensor_parallel": {"vocab_parallel_lm_head": True}})
        except ConfigError:
            refused = True
        _VOCAB_SPLIT_REFUSED[model_type] = refused
    return _VOCAB_SPLIT_REFUSED[model_type]


def draw_tp_loss(rng: random.Random, draws: dict[str, Any]) -> None:
    """A ``tp2`` case's loss draws, in place (JSON-able; taken after every other draw, so a case seed's other
    draws are those it had before them, but for the model type): first the model type, redrawn among
    :data:`~seqpar.testing.fuzz_models.TILEABLE_TYPES` 30% of the time (the tiled loss and the odd vocabularies
    run there), and among the types with a tensor-parallel plan (:func:`tp_plan_types`) 60% of the time when
    the drawn one has none (the rest keep it, a refusal by name); then ``tp_sequence_parallel`` (the config key: the residual stream split
    over TP and the LM head's logits kept split on the vocabulary, so the loss is the vocab-parallel one), half
    the time; ``memory``: ``tiled_loss`` (the config key; under TP the tiled loss is vocab-parallel whatever
    ``tp_sequence_parallel``) with its tile ``loss_tile_rows`` as the ``model`` kind draws it, the vocabulary
    size ``vocab`` (96, or 97 / 61 / 31, which TP 2 splits unevenly) and ``ignored_prefix`` (row 0's first
    labels -100, on rows and right-padded batches). The tiled loss and the odd vocabularies are drawn for
    :data:`~seqpar.testing.fuzz_models.TILEABLE_TYPES`; any other type takes the tiled loss 10% of the time,
    which must be refused by name. Under ``tp_sequence_parallel`` with contiguous sharding each SP shard must
    hold a multiple of ``tp`` tokens (zigzag and balanced padding always gives one): 85% of those cases have
    lengths cut to fit, as a user's collator pads them (:func:`fit_tp_lengths`); the rest must be refused by
    name where a shard does not divide."""
    from seqpar.testing.fuzz_models import TILEABLE_TYPES
    from seqpar.testing.tiny_models import VOCAB

    u = rng.random()
    if u < 0.3:
        draws["model_type"] = rng.choice(TILEABLE_TYPES)
    elif u < 0.9 and draws["model_type"] not in tp_plan_types():
        draws["model_type"] = rng.choice([t for t in tp_plan_types() if t not in ZERO_COMPUTATION_EXPERTS])
    tp_sp = rng.random() < 0.5
    tileable = draws["model_type"] in TILEABLE_TYPES
    tiled = rng.random() < (0.5 if tileable else 0.1)
    tile = rng.choice((None, None, 1, rng.randint(2, 7)))
    vocab = rng.choice((VOCAB, VOCAB, 97, 61, 31))
    ignored = rng.choice((0, 0, 1, rng.randint(2, 8)))
    fit = rng.random() < 0.85
    draws["tp_sequence_parallel"] = tp_sp
    draws["memory"] = {"tiled_loss": tiled, "loss_tile_rows": tile if tiled else None,
                       "vocab": vocab if tileable else VOCAB, "ignored_prefix": ignored}
    if tp_sp and fit and draws["sharding"] == "contiguous":
        multiple = draws["world"] // draws["dp"]  # sp x tp
        draws["lengths"] = fit_tp_lengths(draws["lengths"], draws["batch"], multiple)
        for r in draws["replicas"]:
            r["lengths"] = fit_tp_lengths(r["lengths"], draws["batch"], multiple)


_TP_PLAN_TYPES: list[str] = []
_AUTOTP_TYPES: list[str] = []


def autotp_types() -> list[str]:
    """The tiny model types DeepSpeed's AutoTP shards from their own plan: a ``base_model_tp_plan`` (the config
    class's) whose every style DeepSpeed converts (``deepspeed.module_inject.tp_plan_converter.SUPPORTED_STYLES``),
    and no mixture-of-experts blocks (:data:`ZERO_COMPUTATION_EXPERTS` aside, their plans are the MoE styles).
    The rest are not drawn under ``autotp`` (the module docstring: DeepSpeed refuses a plan with another style,
    and without a plan its name-pattern heuristic splits the mixers' projections, a crash in the model's own
    code without seqpar)."""
    if not _AUTOTP_TYPES:
        from deepspeed.module_inject.tp_plan_converter import SUPPORTED_STYLES
        from transformers import CONFIG_MAPPING

        for t in tp_plan_types():
            plan = CONFIG_MAPPING[t].base_model_tp_plan
            if all(str(style).lower() in SUPPORTED_STYLES for style in plan.values()) and not has_expert_blocks(t):
                _AUTOTP_TYPES.append(t)
    return _AUTOTP_TYPES


def tp_plan_types() -> list[str]:
    """The tiny model types whose config carries a tensor-parallel plan (``base_model_tp_plan``): the ones
    ``tp2`` can shard (a plan with a style seqpar does not apply is still refused by name)."""
    if not _TP_PLAN_TYPES:
        from transformers import CONFIG_MAPPING

        from seqpar.testing.tiny_models import decoder_model_types

        # the config class's own plan (what the tiny configs carry, without building one per type)
        _TP_PLAN_TYPES.extend(t for t in decoder_model_types() if getattr(CONFIG_MAPPING[t], "base_model_tp_plan", None))
    return _TP_PLAN_TYPES


def fit_tp_lengths(lengths: list[list[int]], batch: str, multiple: int) -> list[list[int]]:
    """``lengths`` (:func:`~seqpar.testing.fuzz_models.draw_lengths`) with every sequence a multiple of
    ``multiple``: rows cut down to one, a right-padded batch's too (its padded row keeping at most all but one
    token), packed documents given one more document of the missing tokens."""
    out = []
    for lens in lengths:
        if batch == "packed":
            extra = -sum(lens) % multiple
            out.append(list(lens) + ([extra] if extra else []))
        else:
            seq = lens[0] - lens[0] % multiple
            out.append([seq] if batch == "rows" else [seq, min(lens[1], seq - 1)])
    return out


def replica_draws(draws: dict[str, Any]) -> list[dict[str, Any]]:
    """The case's draws as seen by each DP replica: replica 0's are ``draws`` itself, replica ``d``'s have
    ``case_seed`` and ``lengths`` of ``draws["replicas"][d - 1]`` (its own tokens, documents, padding)."""
    return [draws] + [{**draws, **r} for r in draws.get("replicas", [])]


def has_expert_blocks(model_type: str) -> bool:
    """Whether ``model_type``'s tiny model has a module owning an ``experts`` child: the mixture-of-experts
    blocks that seqpar's DeepSpeed adapter makes ZeRO-3 leaf modules (built on the meta device: no weights)."""
    import transformers
    from transformers.models.auto import modeling_auto as auto

    from seqpar.testing.tiny_models import tiny_config

    cls = getattr(transformers, auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    with torch.device("meta"):
        model = cls(tiny_config(model_type))
    return any(isinstance(getattr(m, "experts", None), nn.Module) for m in model.modules())


def engine_summary(draws: dict[str, Any]) -> str:
    """One short line naming the case's composition (``dp=2``: the data-parallel degree, SP = P / (dp x tp),
    and the other replicas' lengths)."""
    from seqpar.testing.fuzz_models import model_summary

    dp = draws.get("dp", 1)
    stage = f"zero{draws['zero_stage']} " if draws["engine"] == "autotp" else ""
    head = (f"engine {draws['engine']} " + stage + ("tp_sp " if draws.get("tp_sequence_parallel") else "")
            + ("vocab_head " if draws.get("vocab_parallel_lm_head") else "")
            + (f"dp={dp} " if dp > 1 else ""))
    tail = ""
    if dp > 1:
        n_batches = 1 if draws["step"] == "one" else 2
        tail = " replicas=" + ";".join(str(r["lengths"][:n_batches]) for r in draws["replicas"])
    return head + model_summary(draws).removeprefix("model ") + tail


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
    from seqpar.testing.fuzz_models import case_batches, judge_model
    from seqpar.testing.verdicts import classify_errors

    dp = draws.get("dp", 1)
    if draws["world"] % (dp * draws["tp_size"]) or len(draws.get("replicas", [])) != dp - 1:
        raise ValueError(f"engine draws inconsistent: world {draws['world']}, dp {dp}, tp_size {draws['tp_size']}, "
                         f"{len(draws.get('replicas', []))} other replicas (a --set of dp needs replicas too)")
    batches = [case_batches(rd) for rd in replica_draws(draws)]
    ref = dp_reference(draws, batches)
    if not ref["ok"]:
        return "skipped", f"cannot run without seqpar: {ref['error']}"
    per_rank = pools.run(draws["world"], engine_task, draws, batches, ref["dtype"], plant, timeout=timeout)
    bad = classify_errors(per_rank)
    if bad is not None:
        return bad
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
    return judge_model(ref, got)
