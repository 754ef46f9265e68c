"""The ``engine`` kind's model-type facts and tensor-parallel draws: which tiny model types each engine takes
(:data:`ZERO_COMPUTATION_EXPERTS`, :func:`has_expert_blocks`, :func:`tp_plan_types`, :func:`autotp_types`,
:func:`vocab_split_refused`) and the ``tp2`` / ``autotp`` loss draws (:func:`draw_tp_loss`, :func:`draw_autotp`,
:func:`fit_tp_lengths`), called by :func:`seqpar.testing.fuzz_engines.draw_engine`, whose module docstring says
what is drawn and why.
"""

from __future__ import annotations

import random
from typing import Any

import torch
from torch import nn

from seqpar.testing.fuzz_engines_lookup import CHECK_ENTRY_POINT_GROUP, engine_runner

ZERO_COMPUTATION_EXPERTS = frozenset({"longcat_flash"})
"""Model types whose router can skip every real expert for a whole shard (see fuzz_engines' docstring)."""


def draw_autotp(rng: random.Random, draws: dict[str, Any]) -> None:
    """An ``autotp`` case's draws, in place (JSON-able; from the case's own stream, after every other draw):
    the ZeRO stage ``zero_stage`` (1 or 2; 2 with accumulation, see fuzz_engines' docstring; then 3 30% of the time,
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
    The rest are not drawn under ``autotp`` (fuzz_engines' docstring: DeepSpeed refuses a plan with another style,
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
