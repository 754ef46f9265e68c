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

The kind is four modules, re-exported here: this one (the engine draw, :func:`draw_engine`, :func:`force_engine`,
:func:`engine_summary`), :mod:`seqpar.testing.fuzz_engines_lookup` (the installed runners and checks, by entry
point), :mod:`seqpar.testing.fuzz_engines_tp` (the model types each engine takes, the ``tp2`` / ``autotp`` loss
draws) and :mod:`seqpar.testing.fuzz_engines_run` (the plants, the pool task, the DP x SP reference,
:func:`run_engine_case`).
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

from seqpar.testing.fuzz_engines_lookup import (
    CHECK_ENTRY_POINT_GROUP,
    ENTRY_POINT_GROUP,
    EngineRunner,
    engine_runner,
    runner_dir,
)
from seqpar.testing.fuzz_engines_run import (
    PLANTS,
    dp_reference,
    engine_task,
    replica_draws,
    run_engine_case,
)
from seqpar.testing.fuzz_engines_tp import (
    ZERO_COMPUTATION_EXPERTS,
    autotp_types,
    draw_autotp,
    draw_tp_loss,
    fit_tp_lengths,
    has_expert_blocks,
    tp_plan_types,
    vocab_split_refused,
)

__all__ = ["ENGINES", "ENTRY_POINT_GROUP", "CHECK_ENTRY_POINT_GROUP", "EngineRunner", "engine_runner", "runner_dir",
           "draw_engine", "draw_tp_loss", "draw_autotp", "autotp_types", "vocab_split_refused", "fit_tp_lengths",
           "tp_plan_types", "engine_summary", "PLANTS", "engine_task", "run_engine_case", "has_expert_blocks",
           "replica_draws", "dp_reference", "force_engine", "ZERO_COMPUTATION_EXPERTS"]


ENGINES = ("zero1", "zero2", "zero3", "fsdp2", "fsdp1", "tp2", "autotp", "accelerate")


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
