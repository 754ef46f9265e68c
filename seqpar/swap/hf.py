"""The ``"hf"`` route of :func:`seqpar.swap.swap_attention`: Hugging Face transformers models.

transformers is a model library, not an engine, so its glue lives with the swap; the swap imports
this module only when transformers is installed (``import seqpar`` does not need it).

What it registers, under the name ``"seqpar"``:

- an attention function (``transformers.AttentionInterface``): called by every modern HF attention
  module with ``query`` ``(batch, q_heads, seq_local, head_dim)``, ``key``/``value``
  ``(batch, kv_heads, seq_local, head_dim)`` (GQA included), it runs seqpar attention on the
  shards and returns ``(out (batch, seq_local, q_heads, head_dim), None)``;
- a mask function (``transformers.masking_utils.AttentionMaskInterface``): the mask transformers
  would build is the local ``S_local x S_local`` one, wrong on a shard. seqpar attention is causal
  (or bidirectional) over the *global* sequence by construction, so the mask function only checks
  that the model asked for nothing more (no padding, no packed-document or custom mask) and returns
  ``None``.

And, on every swapped ``PreTrainedModel``, an input preparer (run by the swapped model's batch
check, :mod:`seqpar.swap.batch`, for the outermost model; a forward pre-hook of its own for models
nested in something else) that

- fills ``position_ids`` with the *global* positions of this rank's shard when they are absent
  (transformers would number the shard from 0, which is wrong for rotary and absolute positions),
  and checks given ones (per-document positions for packed batches);
- reads packed documents (batch 1): ``cu_seq_lens_q/k`` (as :func:`seqpar.sequence.batch.shard_batch` or
  ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` give them; they win), or on one rank
  restarting ``position_ids``; the *global* boundaries go to the host once per batch, are compared
  across ranks by the batch check, and every layer passes them to ``seqpar.attention(cu_seqlens=)``,
  so each document sees only itself, with or without ``use_cache`` given;
- passes an all-ones ``attention_mask`` when none is given: without one, transformers reads the jump
  in a zigzag shard's positions as two packed documents;
- refuses a padding mask with zeros, a KV cache and ``use_cache=True`` (a cache of a sharded
  sequence is meaningless), and turns ``use_cache`` off when it is not given;
- passes ``shift_labels`` (as :func:`seqpar.sequence.batch.shard_batch` returns them) on as ``labels`` too, so
  ``model(**shard_batch(batch)).loss`` is computed;
- refuses ``labels=`` under SP for models whose loss is not token-level (sequence classification ...).

Losses: the model's ``loss_function`` becomes :class:`SequenceParallelLMLoss`. Under SP, transformers'
own causal-LM loss would shift the labels inside each shard (losing every shard's last target) and
average per rank: a wrong loss. seqpar's is token-weighted over the whole sequence, with the shift
done before the cut (``shift_labels``) or across shards (``labels`` cut unshifted), and its backward
gives every rank its share of the full-sequence gradient (see :mod:`seqpar.sequence.loss`).

Sliding-window layers run exactly: the ``sliding_window`` transformers passes to each layer's
attention call (Mistral: every layer; Qwen2, Gemma 2/3, GPT-OSS: the ``"sliding_attention"`` entries
of ``layer_types``, ``None`` for full layers) becomes ``window`` (causal: the same number; bidirectional:
one more, transformers' is inclusive). GPT-OSS sinks (``s_aux``) become ``sinks=``.

MoE router losses (``output_router_logits``) and Bamba's z-loss are made those of the whole sequence
by :mod:`seqpar.swap.moe` (installed by :func:`apply`); the input preparer hands it the batch's
``seqpar_token_mask`` (padding to leave out of the router statistics) and removes it from the call.
A sliding-window mask reaches the attention function as a :class:`WindowMask`, so layers that leave
the window to the mask (PhiMoE) run it too.

Llama 4's ``"chunked_attention"`` layers pass ``config.attention_chunk_size`` as ``chunk_size=`` (chunks
counted from each packed document's start, as transformers' own packed mask does). Its NoPE layers'
attention temperature tuning scales each query row by a function of the row's position, which
transformers numbers from 0 on every shard: the attention function rescales the rows to their *global*
positions (of the packed row, as one process numbers them). Gemma 2's logit soft-capping (``softcap``)
becomes ``softcap=`` (seqpar's math kernel: CPU, or float64 on CUDA; refused at swap time for a model
on CUDA in another dtype, whose fused kernels have no soft-capping).

ALiBi models (BLOOM, MPT, Falcon with ``alibi=True``), whose attention modules compute their own
scores, get a forward of their own (:mod:`seqpar.swap.hf_alibi`) that runs ``seqpar.attention`` with
``alibi_slopes=`` at global positions.

Layer features refused when swapping (named with the layer): a ``"chunked_attention"`` layer without
``attention_chunk_size``, soft-capping on CUDA (outside float64), cross-attention,
``output_attentions`` in the config, attention dropout in training. Keyword arguments of the attention call outside :data:`ATTENTION_KWARGS` (DSA's ``indices=``) are refused by name at every call.

Before anything is changed, :func:`probe_at_swap` runs the position-mixing probe
(:mod:`seqpar.swap.probe`) on 13 synthetic tokens, with the attention routed to seqpar (self-only) for
the probe alone: a module mixing positions outside attention, or a refused keyword argument, is a
:class:`SwapError` naming it, and the model is left as it was.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import transformers
from torch import Tensor, nn
from transformers import masking_utils
from transformers.loss.loss_utils import LOSS_MAPPING

from seqpar.sequence.batch import (
    PACKED_KEYS,
    document_boundaries,
    global_positions,
    sp_rank_and_size,
)
from seqpar.sequence.boundaries import (
    boundary_tensor,
    host_boundaries,
    known_boundaries,
    remember_boundaries,
)
from seqpar.sequence.loss import sequence_parallel_loss, shift_labels_across_shards
from seqpar.sequence.vocab_parallel import vocab_sharded_logits
from seqpar.swap import moe
from seqpar.swap.batch import Preparer
from seqpar.swap.hf_alibi import alibi_problems, is_alibi_attention
from seqpar.swap.hf_alibi import install as install_alibi
from seqpar.swap.mla import install_latent_transfer, take_latent
from seqpar.swap.options import SwapError, SwapOptions, self_only_attention
from seqpar.swap.probe import (
    PROBE_LENGTH,
    PROBE_POSITION,
    ProbeFailed,
    find_mixers,
    first_forward_probe,
    is_materialised,
    is_simulated,
    mixing_refusal,
    raised_by_seqpar,
)
from seqpar.swap.state import is_probing

__all__ = [
    "ATTN_IMPLEMENTATION",
    "register",
    "is_hf_attention",
    "swap_problems",
    "apply",
    "seqpar_attention_forward",
    "seqpar_mask",
    "WindowMask",
    "SequenceParallelLMLoss",
    "probe_at_swap",
    "ATTENTION_KWARGS",
]

logger = logging.getLogger("seqpar")

ATTN_IMPLEMENTATION = "seqpar"
_OPTIONS_ATTR = "_seqpar_options"
_HOOK_ATTR = "_seqpar_input_hook"
_SLIDING_TYPES = ("sliding_attention", "chunked_attention")


def _name(module: nn.Module) -> str:
    return getattr(module, "_seqpar_name", type(module).__name__)


# ----------------------------------------------------------------------------- registration
def register() -> None:
    """Register the ``"seqpar"`` attention and mask functions with transformers (idempotent)."""
    transformers.AttentionInterface.register(ATTN_IMPLEMENTATION, seqpar_attention_forward)
    masking_utils.AttentionMaskInterface.register(ATTN_IMPLEMENTATION, seqpar_mask)


@functools.cache
def _dispatches_through_interface(cls: type) -> bool:
    if not cls.__module__.startswith("transformers"):
        return False
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    return "ALL_ATTENTION_FUNCTIONS" in source


def is_hf_attention(module: nn.Module) -> bool:
    """A transformers attention module that dispatches through ``ALL_ATTENTION_FUNCTIONS``, or one of
    the ALiBi modules (BLOOM, MPT, Falcon with alibi=True) served by :mod:`seqpar.swap.hf_alibi`."""
    return _dispatches_through_interface(type(module)) or is_alibi_attention(module)


def _dropout_p(module: nn.Module) -> float:
    for attr in ("attention_dropout", "attn_dropout", "dropout"):
        value = getattr(module, attr, None)
        if isinstance(value, nn.Dropout):
            return float(value.p)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return 0.0


def _layer_type(module: nn.Module) -> str | None:
    """The layer's entry of ``config.layer_types`` (or its own ``layer_type``), None if unknown."""
    layer_type = getattr(module, "layer_type", None)
    layer_types = getattr(getattr(module, "config", None), "layer_types", None)
    layer_idx = getattr(module, "layer_idx", None)
    if layer_type is None and layer_types is not None and isinstance(layer_idx, int):
        if 0 <= layer_idx < len(layer_types):
            layer_type = layer_types[layer_idx]
    return layer_type


def _chunk_size(module: nn.Module) -> int | None:
    """Llama 4's chunked local attention: ``config.attention_chunk_size`` on ``"chunked_attention"`` layers."""
    if _layer_type(module) != "chunked_attention":
        return None
    return getattr(getattr(module, "config", None), "attention_chunk_size", None)


def swap_problems(module: nn.Module) -> list[str]:
    """Features of this attention layer that seqpar does not honour (empty when it can swap)."""
    if is_alibi_attention(module):
        return alibi_problems(module)
    config = getattr(module, "config", None)
    problems = []
    if _layer_type(module) == "chunked_attention" and _chunk_size(module) is None:
        problems.append(
            "chunked_attention layer without config.attention_chunk_size: seqpar cannot tell its chunks; "
            "set attention_chunk_size"
        )
    softcap = getattr(config, "attn_logit_softcapping", None) or getattr(module, "softcap", None)
    param = next(module.parameters(), None)
    if softcap and param is not None and param.device.type == "cuda" and param.dtype != torch.float64:
        problems.append(
            f"attention logit soft-capping ({softcap}) on CUDA: torch's fused attention kernels have no "
            "soft-capping and seqpar's exact math kernel runs on CPU or in float64 only; set "
            "config.attn_logit_softcapping=None or train this model on CPU"
        )
    if getattr(module, "is_cross_attention", False):
        problems.append("cross-attention is not supported (self-attention on a sharded sequence only)")
    if getattr(config, "output_attentions", False):
        problems.append(
            "config.output_attentions=True: attention weights of a sharded sequence are never "
            "materialised; set it to False"
        )
    p = _dropout_p(module)
    if p > 0 and module.training:
        problems.append(
            f"attention dropout {p} in training is not supported; set it to 0.0 in the config "
            "(attention_dropout / attn_pdrop)"
        )
    return problems


# ----------------------------------------------------------------------------- the swap
def _top_pretrained(model: nn.Module) -> list[nn.Module]:
    """The outermost PreTrainedModel instances in ``model`` (``model`` itself if it is one)."""
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if isinstance(module, transformers.PreTrainedModel) and not any(
            name.startswith(f"{n}.") or n == "" for n, _ in found
        ):
            found.append((name, module))
    return [m for _, m in found]


def apply(
    model: nn.Module, modules: list[tuple[str, nn.Module]], options: SwapOptions
) -> list[Preparer]:
    """Point the given attention modules (and the models holding them) at seqpar.

    Returns:
        The input preparers for ``model`` itself, for its batch check to run (empty when ``model``
        is not a ``PreTrainedModel``: nested models then prepare their inputs in their own hook).
    """
    register()
    moe.install(model, options.group)  # router losses and z-loss over the whole sequence
    for name, module in modules:
        setattr(module, _OPTIONS_ATTR, options)
        module._seqpar_name = name
        if options.mla_transfer == "latent":
            install_latent_transfer(module, options)  # MLA layers only: their ring moves the latent
        if is_alibi_attention(module):
            install_alibi(module, options)  # its own forward: no attention interface to switch
    modules = [(name, module) for name, module in modules if not is_alibi_attention(module)]
    tops = _top_pretrained(model)
    if not tops:
        raise SwapError(
            f"found transformers attention modules in {type(model).__name__} but no PreTrainedModel "
            "holding them: swap the transformers model itself"
        )
    for top in tops if modules else ():
        top.set_attn_implementation(ATTN_IMPLEMENTATION)
    for name, module in modules:
        impl = getattr(getattr(module, "config", None), "_attn_implementation", None)
        if impl != ATTN_IMPLEMENTATION:
            raise SwapError(
                f"layer '{name}': transformers kept attn_implementation={impl!r} for "
                f"{type(module).__name__} (it does not support switching dynamically); load the "
                f"model with attn_implementation='{ATTN_IMPLEMENTATION}' after "
                "seqpar.swap.hf.register()"
            )
    preparers: list[Preparer] = []
    for pm in model.modules():
        if not isinstance(pm, transformers.PreTrainedModel):
            continue
        if "labels" in _forward_signature(type(pm)).parameters:
            pm.loss_function = SequenceParallelLMLoss(options, _loss_type(pm))
        old = getattr(pm, _HOOK_ATTR, None)
        if old is not None:
            old.remove()
            delattr(pm, _HOOK_ATTR)
        prepare = functools.partial(_prepare_inputs, options)
        if pm is model:
            preparers.append(prepare)
        else:
            setattr(pm, _HOOK_ATTR, pm.register_forward_pre_hook(prepare, with_kwargs=True))
    return preparers


# ----------------------------------------------------------------------------- the position-mixing probe
_MISSING = object()
FirstForward = Callable[[nn.Module, tuple, dict], None]
"""A probe put off to the swapped model's first forward: ``(model, args, kwargs) -> None``, raising
:class:`SwapError`."""


def probe_at_swap(
    model: nn.Module, modules: list[tuple[str, nn.Module]], options: SwapOptions
) -> FirstForward | None:
    """The position-mixing probe (:mod:`seqpar.swap.probe`) of the transformers models in ``model``.

    Each outermost ``PreTrainedModel`` runs twice on 13 synthetic tokens of its vocabulary (the same on
    every rank, so the verdict is too, with no collective), with its attention routed to seqpar in
    self-only mode for the probe only.

    Returns:
        None when the probe ran and found nothing. When the parameters are not materialised (meta
        device, DeepSpeed ZeRO-3 partitions), the same probe to run at the swapped model's first
        forward, when the engine gathers them; when the model cannot run on synthetic tokens alone
        (it needs other inputs), a probe of the first forward's real batch, cut to 13 positions.

    Raises:
        SwapError: naming every module that mixes positions, or an attention keyword argument or mask
            seqpar does not know; the model is left as it was.
    """
    tops = _named_top_pretrained(model)
    if not tops:
        return None  # apply() refuses with its own message
    if any(is_simulated(top) for _, top in tops):
        return None  # fake tensors: nothing to compare (seqpar.swap.probe.is_simulated)
    if not all(is_materialised(top) for _, top in tops):
        return functools.partial(_first_forward_tops, tops)
    with _probe_routing([top for _, top in tops], modules, options) as routed:
        if not routed:
            return None  # apply() refuses: transformers kept another attention implementation
        failure = _probe_tops(tops, "Nothing was changed.")
    if failure is None:
        return None
    top, failed = failure
    if _runs_plain(top):  # it runs with its own attention: routing it to seqpar is what breaks it
        raise SwapError(
            f"{type(top).__name__} fails with its attention routed to seqpar: {failed}. Its attention needs "
            "something seqpar does not provide (e.g. DeepSeek-V3.2 / GLM-MoE-DSA sparse attention indexes "
            "the attention mask and passes indices= of the keys each query may see); run this model "
            "without sequence parallelism. Nothing was changed."
        ) from failed.error
    logger.warning(
        "seqpar: %s did not run on %d synthetic tokens for the position-mixing probe, with or without "
        "seqpar (%s); the probe runs on the first batch instead", type(top).__name__, PROBE_LENGTH, failed,
    )
    return first_forward_probe


def _named_top_pretrained(model: nn.Module) -> list[tuple[str, nn.Module]]:
    tops = {id(m) for m in _top_pretrained(model)}
    seen: set[int] = set()
    named = []
    for name, module in model.named_modules():
        if id(module) in tops and id(module) not in seen:
            seen.add(id(module))
            named.append((name, module))
    return named


def _first_forward_tops(tops: list[tuple[str, nn.Module]], model: nn.Module, args: tuple, kwargs: dict) -> None:
    failure = _probe_tops(tops, "The model stays swapped, and refuses every forward.")
    if failure is not None:
        logger.warning("seqpar: %s did not run on %d synthetic tokens for the position-mixing probe (%s); "
                       "probing this batch instead", type(failure[0]).__name__, PROBE_LENGTH, failure[1])
        first_forward_probe(model, args, kwargs)


def _probe_tops(tops: list[tuple[str, nn.Module]], after: str) -> tuple[nn.Module, ProbeFailed] | None:
    """Probe each model on synthetic tokens; raises SwapError naming what it found (``after`` ends the
    message). Returns the first model that raised, with the failure (not a seqpar refusal), or None."""
    for prefix, top in tops:
        try:
            mixers = find_mixers(top, _synthetic_run(top), PROBE_LENGTH, PROBE_POSITION)
        except ProbeFailed as failed:
            if not raised_by_seqpar(failed.error):
                return top, failed
            raise SwapError(
                f"{type(top).__name__}: seqpar refused a layer while probing the model: {failed.error}. {after}"
            ) from failed.error
        if mixers:
            raise SwapError(f"{mixing_refusal(mixers, type(top).__name__, prefix)} {after}")
    return None


def _runs_plain(top: nn.Module) -> bool:
    """Whether ``top`` runs on the probe's tokens with its own attention (no seqpar)."""
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            _synthetic_run(top)(False)
    except Exception:  # noqa: BLE001 - any failure means: not seqpar's routing alone
        return False
    return True


def _synthetic_run(top: nn.Module) -> Callable[[bool], Any]:
    """``run(perturbed)`` for :func:`seqpar.swap.probe.find_mixers`: ``top`` on 13 seeded tokens of its
    vocabulary, batch 1, no cache; perturbed: the middle token replaced by the next id."""
    embeddings = top.get_input_embeddings()
    vocab = getattr(embeddings, "num_embeddings", None)
    if vocab is None:
        vocab = top.config.get_text_config().vocab_size
    weight = getattr(embeddings, "weight", None)
    device = weight.device if isinstance(weight, Tensor) else next(top.parameters()).device
    ids = torch.randint(0, vocab, (1, PROBE_LENGTH), generator=torch.Generator().manual_seed(0)).to(device)
    changed = ids.clone()
    changed[0, PROBE_POSITION] = (ids[0, PROBE_POSITION] + 1) % vocab
    extra = {"use_cache": False} if "use_cache" in _forward_signature(type(top)).parameters else {}

    def run(perturbed: bool) -> Any:
        return top(input_ids=changed if perturbed else ids, **extra)

    return run


def _all_configs(tops: list[nn.Module]) -> list[Any]:
    found: dict[int, Any] = {}
    queue = [m.config for top in tops for m in top.modules()
             if isinstance(getattr(m, "config", None), transformers.PretrainedConfig)]
    while queue:
        config = queue.pop()
        if id(config) in found:
            continue
        found[id(config)] = config
        for key in getattr(config, "sub_configs", {}) or {}:
            sub = getattr(config, key, None)
            if isinstance(sub, transformers.PretrainedConfig):
                queue.append(sub)
    return list(found.values())


@contextlib.contextmanager
def _probe_routing(
    tops: list[nn.Module], modules: list[tuple[str, nn.Module]], options: SwapOptions
) -> Iterator[bool]:
    """Route the attention modules to seqpar for the probe only; everything is put back afterwards.
    Yields whether transformers took the routing for every module."""
    register()
    configs = [(c, c.__dict__.get("_attn_implementation_internal", _MISSING)) for c in _all_configs(tops)]
    saved = [(m, m.__dict__.get(_OPTIONS_ATTR, _MISSING), m.__dict__.get("_seqpar_name", _MISSING),
              m.__dict__.get("forward", _MISSING)) for _, m in modules]
    # ALiBi modules (BLOOM, MPT, Falcon) compute their own scores: they get seqpar's forward for the
    # probe, as apply() gives them for good; the others are routed through transformers' interface.
    interfaced = [m for _, m in modules if not is_alibi_attention(m)]
    try:
        for name, module in modules:
            setattr(module, _OPTIONS_ATTR, options)
            module._seqpar_name = name
            if is_alibi_attention(module):
                install_alibi(module, options)
        for top in tops if interfaced else ():
            top.set_attn_implementation(ATTN_IMPLEMENTATION)
        yield all(getattr(getattr(m, "config", None), "_attn_implementation", None) == ATTN_IMPLEMENTATION
                  for m in interfaced)
    finally:
        for module, old_options, old_name, old_forward in saved:
            for attr, old in ((_OPTIONS_ATTR, old_options), ("_seqpar_name", old_name), ("forward", old_forward)):
                if old is _MISSING:
                    module.__dict__.pop(attr, None)
                else:
                    setattr(module, attr, old)
        for config, old in configs:
            if old is _MISSING:
                config.__dict__.pop("_attn_implementation_internal", None)
            else:
                config._attn_implementation_internal = old


def _loss_type(model: nn.Module) -> str:
    # transformers' own rule (PreTrainedModel.loss_function): an unknown type means ForCausalLM.
    loss_type = getattr(model, "loss_type", None)
    return loss_type if loss_type in LOSS_MAPPING else "ForCausalLM"


# Losses that are a mean over tokens, so a token-weighted mean over the SP group is exact.
_TOKEN_LOSSES = ("ForCausalLM", "ForMaskedLM")


class SequenceParallelLMLoss:
    """A swapped model's ``loss_function``: transformers' token-level loss, exact under SP.

    Called by transformers as ``loss_function(logits=..., labels=..., vocab_size=..., **kwargs)``
    with this rank's ``logits`` ``(batch, seq_local, vocab)`` and ``labels`` ``(batch, seq_local)``.

    - Causal LM: the targets are ``shift_labels`` when given (shifted before the cut, as
      :func:`seqpar.sequence.batch.shard_batch` returns them), else ``labels`` cut unshifted like
      ``input_ids``, shifted across shard boundaries here (one tiny all-gather).
    - Masked LM: ``labels`` as cut.
    - ``num_items_in_batch`` (given by transformers' Trainer): the loss is the sum over the whole
      sequences divided by it, so it must count the target tokens of the *full* sequences of this
      replica's batch; without it, the token-weighted mean over the SP group.

    With one rank it is transformers' own loss. The value is the same on every SP rank, and each
    rank's backward gives its share of the full-sequence gradient (sum them over the SP group).
    """

    def __init__(self, options: SwapOptions, loss_type: str) -> None:
        self.options = options
        self.loss_type = loss_type

    def __call__(
        self,
        logits: Tensor,
        labels: Tensor,
        vocab_size: int | None = None,
        num_items_in_batch: Tensor | int | None = None,
        ignore_index: int = -100,
        shift_labels: Tensor | None = None,
        **kwargs: Any,
    ) -> Tensor:
        # While the position-mixing probe runs, nothing is communicated: the loss stays this rank's.
        world_size = 1 if is_probing() else sp_rank_and_size(self.options.group)[1]
        # logits split on the vocabulary over TP (tp_sequence_parallel) take seqpar's vocab-parallel loss,
        # at any SP size: transformers' would gather them
        vocab_split = vocab_sharded_logits(logits) is not None
        if (world_size == 1 and not vocab_split) or self.loss_type not in _TOKEN_LOSSES:
            return LOSS_MAPPING[self.loss_type](
                logits, labels, vocab_size=vocab_size, num_items_in_batch=num_items_in_batch,
                ignore_index=ignore_index, shift_labels=shift_labels, **kwargs,
            )
        if self.loss_type == "ForCausalLM":
            targets = shift_labels if shift_labels is not None else shift_labels_across_shards(
                labels, group=self.options.group, sharding=self.options.sharding,
                ignore_index=ignore_index,
            )
        else:
            targets = labels
        if num_items_in_batch is None:
            return sequence_parallel_loss(logits, targets, group=self.options.group,
                                          ignore_index=ignore_index, reduction="mean")
        total = sequence_parallel_loss(logits, targets, group=self.options.group,
                                       ignore_index=ignore_index, reduction="sum")
        if isinstance(num_items_in_batch, Tensor):
            num_items_in_batch = num_items_in_batch.to(total.device)
        return total / num_items_in_batch


@functools.cache
def _forward_signature(cls: type) -> inspect.Signature:
    return inspect.signature(cls.forward)


def _padding_error(where: str) -> ValueError:
    return ValueError(
        f"seqpar ({where}): the attention_mask marks padding, but seqpar attention takes no key "
        "mask. Cut batches with seqpar.sequence.batch.shard_batch, which accepts right padding under causal "
        "attention (real tokens never see later pads) and ignores the pads' labels; left padding "
        "and holes cannot be honoured"
    )


def _prepare_inputs(
    options: SwapOptions, module: nn.Module, args: tuple, kwargs: dict[str, Any]
) -> tuple[tuple, dict[str, Any]]:
    """Forward pre-hook of a swapped PreTrainedModel (see the module docstring)."""
    try:
        bound = _forward_signature(type(module)).bind_partial(module, *args, **kwargs)
    except TypeError:
        return args, kwargs  # let the model raise its own error for a bad call
    arguments = bound.arguments
    params = _forward_signature(type(module)).parameters
    ref = arguments.get("input_ids")
    if ref is None:
        ref = arguments.get("inputs_embeds")
    if not isinstance(ref, Tensor) or ref.dim() < 2:
        return args, kwargs
    where = type(module).__name__

    _refuse_cache(arguments, params, where)
    moe.take_token_mask(_var_keyword(arguments, params))  # padding the router statistics must skip
    known = _read_batch(arguments, params, options, ref)
    _fill_attention_mask(arguments, params, ref, where, known)
    _prepare_labels(arguments, params, module, options, where)
    if "position_ids" in params:
        _fill_positions(arguments, params, options, ref, where, known)
    return _as_keywords(bound, params)


def _read_batch(arguments: dict[str, Any], params: Any, options: SwapOptions, ref: Tensor) -> dict[str, Any]:
    """Everything the input checks need from the device, read in **one** host copy per batch.

    On a GPU each read waits for the device, so the checks below read nothing of their own: this
    gathers, as int64 on the inputs' device, whether ``attention_mask`` is all ones, the
    ``cu_seq_lens_q/k`` values (unless already on the host), and the ``position_ids``: for a packed
    batch their values (the expected per-document positions need the boundaries on the host first),
    else whether they equal the shard's global positions. One ``tolist()`` of their concatenation;
    the boundaries are remembered for every later :func:`host_boundaries` (the layers', the batch
    check's), the mask verdict for :func:`seqpar_mask`. Returns ``{"mask": bool, "positions": list |
    bool}`` for what was read."""
    pieces: list[tuple[str, Any, Tensor]] = []
    known: dict[str, Any] = {}
    mask = arguments.get("attention_mask") if "attention_mask" in params else None
    if isinstance(mask, Tensor) and mask.dim() == 2:
        noted = _noted(mask, "mask")
        if noted is not None:  # an inner PreTrainedModel called by the outer one with its checked inputs
            known["mask"] = noted
        else:
            pieces.append(("mask", mask, mask.bool().all().reshape(1)))
    extra = _var_keyword(arguments, params)
    cus = {k: extra[k] for k in ("cu_seq_lens_q", "cu_seq_lens_k") if isinstance(extra.get(k), Tensor)}
    for key, cu in cus.items():
        if cu.dim() == 1 and cu.dtype in (torch.int32, torch.int64) and known_boundaries(cu) is None:
            pieces.append((key, cu, cu))
    given = arguments.get("position_ids") if "position_ids" in params else None
    seq_local = ref.shape[1]
    if isinstance(given, Tensor) and given.shape[-1] == seq_local and _noted(given, "positions"):
        known["positions"] = True  # checked (or filled) by the outer model's preparer this batch
        known["unpacked"] = bool(_noted(given, "unpacked"))
    elif isinstance(given, Tensor) and given.shape[-1] == seq_local:
        if cus:  # packed: compared on the host, against positions built from the boundaries
            pieces.append(("positions", given, given.reshape(-1, seq_local)[0]))
        else:
            rank, world_size, sharding = _shard_view(options)
            expected = global_positions(seq_local * world_size, rank, world_size, sharding,
                                        device=given.device)
            pieces.append(("positions", given, (given == expected).all().reshape(1)))
    if not pieces:
        return known
    device = pieces[0][2].device
    flat = torch.cat([p.reshape(-1).to(device=device, dtype=torch.int64) for _, _, p in pieces])
    values = flat.tolist()  # the one host copy
    at = 0
    for key, source, piece in pieces:
        part, at = values[at:at + piece.numel()], at + piece.numel()
        if key == "mask":
            known["mask"] = bool(part[0])
            _note(source, "mask", bool(part[0]))
        elif key == "positions":
            known["positions"] = part if cus else bool(part[0])
            known["unpacked"] = not cus and bool(part[0])  # the shard's global positions: no restart
        else:
            remember_boundaries(source, part)
    return known


# What this batch's input checks found, by tensor: (weak reference, version counter, kind, verdict).
# The attention mask's verdict is read once per batch (_read_batch), and not again by an inner
# PreTrainedModel's preparer, nor by the mask factory transformers calls for every layer type, which
# gets the same mask converted (``.to(torch.bool)``: a new tensor of the same shape); checked or
# filled-in position_ids are not read again by the inner model's preparer. Weak references: once the
# forward that holds the tensors ends, its notes are void.
_NOTES: list[tuple[Any, int, str, bool]] = []


def _note(t: Tensor, kind: str, verdict: bool) -> None:
    try:
        version = t._version
    except RuntimeError:  # inference mode: no version counter, not noted
        return
    _NOTES[:] = [n for n in _NOTES if n[0]() is not None and n[2] != kind] + [(weakref.ref(t), version, kind, verdict)]


def _noted(t: Tensor, kind: str) -> bool | None:
    """The verdict noted for ``t`` itself (unchanged since), else None."""
    for ref, version, k, verdict in _NOTES:
        if k == kind and ref() is t and t._version == version:
            return verdict
    return None


def _all_ones(mask: Tensor) -> bool:
    """Whether a 2D attention mask marks no padding: the batch's note when ``mask`` is the batch's
    mask or its conversion (alive, unchanged, same shape and device), else read here."""
    for ref, version, kind, verdict in _NOTES:
        noted = ref()
        if (kind == "mask" and noted is not None and noted._version == version and noted.shape == mask.shape
                and noted.device == mask.device and (mask is noted or mask.dtype == torch.bool)):
            return verdict
    return bool(mask.bool().all())


def _refuse_cache(arguments: dict[str, Any], params: Any, where: str) -> None:
    """A KV cache of a sharded sequence is meaningless: refuse one, and turn ``use_cache`` off."""
    if arguments.get("past_key_values") is not None:
        raise ValueError(
            f"seqpar ({where}): past_key_values given; a KV cache of a sequence-sharded model is "
            "not supported (generate with the unswapped model)"
        )
    if "use_cache" in params:
        if arguments.get("use_cache"):
            raise ValueError(
                f"seqpar ({where}): use_cache=True is not supported on a sequence-sharded model; "
                "pass use_cache=False"
            )
        arguments["use_cache"] = False


def _fill_attention_mask(arguments: dict[str, Any], params: Any, ref: Tensor, where: str,
                         known: dict[str, Any]) -> None:
    """An all-ones mask when none is given (see the module docstring); a padding mask is refused."""
    if "attention_mask" not in params:
        return
    mask = arguments.get("attention_mask")
    if mask is None:
        batch, seq_local = ref.shape[0], ref.shape[1]
        arguments["attention_mask"] = torch.ones(batch, seq_local, dtype=torch.long, device=ref.device)
        _note(arguments["attention_mask"], "mask", True)
    elif isinstance(mask, Tensor) and mask.dim() == 2 and not known.get("mask", True):
        raise _padding_error(where)


def _fill_positions(
    arguments: dict[str, Any], params: Any, options: SwapOptions, ref: Tensor, where: str,
    known: dict[str, Any],
) -> None:
    """Fill in ``position_ids`` (global, or per document for a packed batch) or check given ones
    (against the values or verdict of :func:`_read_batch`: no host read of its own)."""
    batch, seq_local = ref.shape[0], ref.shape[1]
    rank, world_size, sharding = _shard_view(options)
    bounds = _packed_boundaries(arguments, params, batch, seq_local, world_size, where,
                                unpacked=bool(known.get("unpacked")))
    given = arguments.get("position_ids")
    if bounds is not None:
        # built on the host from host ints, then one asynchronous copy (no device read, no blocking copy)
        host = _document_positions(global_positions(seq_local * world_size, rank, world_size, sharding,
                                                    device="cpu", cu_seqlens=bounds)[None], bounds)
        expected = host.to(ref.device, non_blocking=True)
        if given is None:
            arguments["position_ids"] = expected
        elif given.shape[-1] != seq_local or not _packed_positions_ok(given, host, known):
            raise ValueError(
                f"seqpar ({where}): position_ids on SP rank {rank} of {world_size} are not the "
                f"per-document positions of this rank's {sharding} shard of the packed "
                f"sequence with boundaries {_short(torch.tensor(bounds))} (expected "
                f"{_short(expected[0])}, got {_short(given.reshape(-1, given.shape[-1])[0])}). "
                "Cut packed batches with seqpar.sequence.batch.shard_batch"
            )
        _note(arguments["position_ids"], "positions", True)
        return
    expected = global_positions(seq_local * world_size, rank, world_size, sharding,
                                device=ref.device)[None]  # (1, S_local)
    if given is None:
        arguments["position_ids"] = expected.expand(batch, seq_local)
    elif given.shape[-1] != seq_local or not known.get("positions", True):
        _refuse_positions(given, expected, rank, world_size, sharding, where)
    _note(arguments["position_ids"], "positions", True)
    _note(arguments["position_ids"], "unpacked", True)  # an inner model's preparer reads no restarts


def _shard_view(options: SwapOptions) -> tuple[int, int, str]:
    """``(rank, world_size, sharding)`` of the call being prepared. While the position-mixing probe runs
    (:mod:`seqpar.swap.probe`) nothing is communicated and its call (13 tokens, or the first forward's
    batch cut to them, with its documents and positions made to describe the cut) is a whole sequence on
    one process: ``(0, 1, "contiguous")``, as for the probe's loss."""
    if is_probing():
        return 0, 1, "contiguous"
    rank, world_size = sp_rank_and_size(options.group)
    return rank, world_size, options.sharding


def _packed_positions_ok(given: Tensor, expected: Tensor, known: dict[str, Any]) -> bool:
    """``given`` (``(B, S_local)``) equals the host ``expected`` (``(1, S_local)``) in every row; the
    first row's values come from the batch's one read, further rows (rare: packed batches have one) are
    compared on the device."""
    first = known.get("positions")
    if first is True:  # checked this batch already (the outer model's preparer)
        return True
    if not isinstance(first, list):  # not read with the batch (e.g. on the host already): compare here
        return bool((given == expected.to(given.device)).all())
    if first != expected[0].tolist():
        return False
    return given.shape[0] == 1 or bool((given == expected.to(given.device)).all())


def _refuse_positions(
    given: Tensor, expected: Tensor, rank: int, world_size: int, sharding: str, where: str
) -> None:
    """Raise for ``position_ids`` that are not the shard's global positions, saying why they may be wrong."""
    row = given.reshape(-1, given.shape[-1])[0]
    restarts = bool((row.diff() < 0).any())
    what = (
        "they restart (packed sequences): on shards the global document boundaries are "
        "needed; cut packed batches (batch 1) with seqpar.sequence.batch.shard_batch, which passes "
        "them as cu_seq_lens_q/k"
        if restarts else
        "pass the global positions of the shard, or none (seqpar fills them in)"
    )
    raise ValueError(
        f"seqpar ({where}): position_ids on SP rank {rank} of {world_size} are not the global "
        f"positions of this rank's {sharding} shard (expected "
        f"{_short(expected[0])}, got {_short(row)}): {what}. seqpar.sequence.batch.shard_batch makes "
        "them right"
    )


def _as_keywords(bound: inspect.BoundArguments, params: Any) -> tuple[tuple, dict[str, Any]]:
    """The bound arguments (less ``self``) handed back by keyword: transformers' forward decorators
    also inject keywords (e.g. use_cache), which would collide with a positional copy."""
    new_kwargs: dict[str, Any] = {}
    self_name = next(iter(params))
    for pname, value in bound.arguments.items():
        kind = params[pname].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            new_kwargs.update(value)
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            return bound.args[1:], bound.kwargs  # cannot be passed by keyword; rare
        elif pname != self_name:
            new_kwargs[pname] = value
    return (), new_kwargs


def _var_keyword(arguments: dict[str, Any], params: Any) -> dict[str, Any]:
    """The forward's ``**kwargs`` dict inside ``arguments`` (created when absent; ``{}`` if none)."""
    name = next((n for n, p in params.items() if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    if name is None:
        return {}
    return arguments.setdefault(name, {})


def _packed_boundaries(
    arguments: dict[str, Any], params: Any, batch: int, seq_local: int, world_size: int, where: str,
    *, unpacked: bool = False,
) -> tuple[int, ...] | None:
    """The global document boundaries of a packed batch, put on the host once for all layers.

    From ``cu_seq_lens_q/k`` (as :func:`seqpar.sequence.batch.shard_batch` or DataCollatorWithFlattening
    give them); on one rank also from restarting ``position_ids`` (the shard is the whole sequence).
    The boundaries are written back as one host int32 tensor under both keys, which transformers
    hands to every attention layer; its host ints are known (:func:`seqpar.sequence.boundaries.
    boundary_tensor`), so the batch's one device-to-host copy is the one made here, none per layer.
    """
    extra = _var_keyword(arguments, params)
    found = {k: extra[k] for k in PACKED_KEYS if k in extra}
    if "cu_seq_lens_q" not in found and "cu_seq_lens_k" not in found:
        if world_size > 1:
            return None  # restarting positions are refused by the caller with the fix
        if unpacked:  # the batch's read (or the outer preparer) found the plain positions: no restart
            return None
        found["position_ids"] = arguments.get("position_ids")
    full = {"input_ids": torch.empty(batch, seq_local * world_size, dtype=torch.long, device="meta"),
            **found}
    try:
        bounds = document_boundaries(full, seq_local * world_size)
    except ValueError as e:
        raise ValueError(f"seqpar ({where}): {e}") from None
    if bounds is None:
        return None
    cu = boundary_tensor(bounds)  # its host ints known: no layer copies it again
    longest = max(b - a for a, b in zip(bounds, bounds[1:]))
    extra.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
    return bounds


def _document_positions(global_pos: Tensor, bounds: tuple[int, ...]) -> Tensor:
    # (1, S_local) global positions (on the host) -> positions inside their document.
    edges = torch.tensor(bounds, dtype=global_pos.dtype)
    doc = torch.searchsorted(edges, global_pos, right=True) - 1
    return global_pos - edges[doc]


def _prepare_labels(
    arguments: dict[str, Any], params: Any, module: nn.Module, options: SwapOptions, where: str
) -> None:
    """``shift_labels`` alone still yields a loss; ``labels`` of a non-token loss are refused on shards."""
    if "labels" not in params:
        return
    var_kw = next((n for n, p in params.items() if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    extra = arguments.get(var_kw) or {} if var_kw else {}
    shift = arguments.get("shift_labels", extra.get("shift_labels"))
    if arguments.get("labels") is None and isinstance(shift, Tensor):
        arguments["labels"] = shift  # transformers computes a loss only when labels are given
    if arguments.get("labels") is None:
        return
    loss_type = _loss_type(module)
    if loss_type not in _TOKEN_LOSSES and sp_rank_and_size(options.group)[1] > 1:
        raise ValueError(
            f"seqpar ({where}): labels= with a {loss_type} loss on sequence shards would give each "
            "rank a loss of its own shard only. Call the model without labels and compute the loss "
            "from the gathered outputs, or for token-level losses use seqpar.sequence_parallel_loss "
            "with the shift_labels of seqpar.sequence.batch.shard_batch"
        )


def _short(x: Tensor) -> str:
    values = x.tolist()
    return str(values) if len(values) <= 8 else f"[{', '.join(map(str, values[:4]))}, ..., {values[-1]}]"


# ----------------------------------------------------------------------------- called by transformers
def seqpar_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable = masking_utils.causal_mask_function,
    attention_mask: Tensor | None = None,
    local_size: int | None = None,
    allow_is_causal_skip: bool = True,
    **kwargs: Any,
) -> WindowMask | None:
    """transformers' mask factory for ``"seqpar"``: checks, then returns ``None`` (no mask).

    Raises ``ValueError`` for padding (a 2D mask with zeros) and for any pattern other than plain
    causal, bidirectional or sliding window (run by the attention function from its
    ``sliding_window``): block-wise or custom ``or``/``and`` masks. Packed documents never reach
    here as a mask: the input preparer passes an all-ones ``attention_mask`` (so transformers does
    not build its packed mask) and the boundaries as ``cu_seq_lens_q/k``.
    """
    if attention_mask is not None and not _all_ones(attention_mask):  # read once per batch (_read_batch)
        raise _padding_error("mask")
    plain = mask_function in (masking_utils.causal_mask_function, masking_utils.bidirectional_mask_function)
    # create_sliding_window_causal_mask passes the window as local_size; it keeps
    # allow_is_causal_skip only when nothing (packing, or/and masks, blocks) was added to it.
    sliding_only = local_size is not None and allow_is_causal_skip
    if not (plain or sliding_only):
        raise ValueError(
            "seqpar: the model asked for an attention mask other than causal/bidirectional/sliding "
            "(packed-sequence document mask, block-wise mask, or a custom and/or mask function); "
            "seqpar attention does not honour it. Pass packed documents as cu_seq_lens_q/k "
            "(seqpar.sequence.batch.shard_batch derives them) and use a model without custom masks"
        )
    # A sliding-window mask: pass the window itself on, because some attention modules (PhiMoE) do not
    # hand their sliding_window to the attention function and rely on this mask alone.
    return WindowMask(int(local_size)) if local_size is not None else None


class WindowMask:
    """What :func:`seqpar_mask` returns for a sliding-window mask: the model's window (key j visible to
    query i iff ``i - j < window``), which :func:`seqpar_attention_forward` applies globally."""

    def __init__(self, window: int) -> None:
        self.window = window

    def __repr__(self) -> str:
        return f"WindowMask({self.window})"


def seqpar_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention function for ``"seqpar"``.

    Args:
        module: the attention layer (its ``is_causal`` gives causality unless ``is_causal`` is passed).
        query: ``(batch, q_heads, seq_local, head_dim)``; key, value:
            ``(batch, kv_heads, seq_local, head_dim)``, this rank's shard.
        attention_mask: whatever the mask function returned (``None``), or a 4D mask the caller
            passed itself, accepted only when it masks nothing.

    Returns:
        ``(out (batch, seq_local, q_heads, head_dim), None)``.
    """
    options: SwapOptions | None = getattr(module, _OPTIONS_ATTR, None)
    if options is None and is_probing():
        # Left out by the swap's name patterns: refused at run time on shards (below); the probe
        # judges the rest of the model around it.
        return self_only_attention(query, value).transpose(1, 2).contiguous(), None
    if options is None:
        # A layer the swap config left out (name patterns): transformers' own SDPA path, which is
        # only right while the sequence is not sharded.
        try:
            _, world_size = sp_rank_and_size(None)
        except ValueError:  # no manager on a world > 1: the SP group is unknown, so the world may be shards
            world_size = dist.get_world_size()  # (a refusal either way; this one names the left-out layer)
        if world_size > 1:
            raise ValueError(
                f"seqpar: attention layer {type(module).__name__} (layer_idx "
                f"{getattr(module, 'layer_idx', '?')}) was left out by sequence_parallel.swap, but "
                f"the model runs on sequence shards of {world_size} ranks, where it would see only "
                "this rank's keys. Include every attention layer in sequence_parallel.swap"
            )
        if isinstance(attention_mask, WindowMask):  # the unsharded sequence: the window as a tensor
            i = torch.arange(query.shape[2], device=query.device)[:, None]
            j = torch.arange(key.shape[2], device=query.device)[None, :]
            attention_mask = ((j <= i) & (i - j < attention_mask.window))[None, None]
        return transformers.AttentionInterface._global_mapping["sdpa"](
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
            is_causal=is_causal, **kwargs,
        )
    layer = _name(module)
    _refuse_unknown_kwargs(kwargs, layer, module)
    if kwargs.get("output_attentions"):
        raise ValueError(f"seqpar (layer '{layer}'): output_attentions=True is not supported")
    if kwargs.get("position_bias") is not None:
        raise ValueError(f"seqpar (layer '{layer}'): a position bias (position_bias=...) is not supported")
    if dropout:
        raise ValueError(
            f"seqpar (layer '{layer}'): attention dropout {dropout} in training is not supported; "
            "set the config's attention dropout to 0.0"
        )
    seq_local = query.shape[2]
    if key.shape[2] != seq_local:
        raise ValueError(
            f"seqpar (layer '{layer}'): {seq_local} queries but {key.shape[2]} keys; a KV cache or "
            "cross-attention is not supported on a sharded sequence"
        )
    sliding_window = kwargs.get("sliding_window")
    if isinstance(attention_mask, WindowMask):
        if sliding_window is not None and sliding_window != attention_mask.window:
            raise ValueError(
                f"seqpar (layer '{layer}'): the layer passed sliding_window={sliding_window} but its mask "
                f"is a window of {attention_mask.window}; the model is inconsistent"
            )
        sliding_window, attention_mask = attention_mask.window, None
    if attention_mask is not None:
        if not isinstance(attention_mask, Tensor) or not _masks_nothing(attention_mask):
            raise ValueError(
                f"seqpar (layer '{layer}'): got a custom attention mask ({type(attention_mask).__name__}"
                f"{tuple(attention_mask.shape) if isinstance(attention_mask, Tensor) else ''}); seqpar "
                "attention honours only causal or bidirectional attention with no mask"
            )
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    query = _global_temperature(module, query, options, kwargs.get("cu_seq_lens_q"))
    latent = take_latent(module, key, value)
    if latent is not None:  # an MLA layer whose ring moves the latent (seqpar.swap.mla)
        out = options.latent_attention(query, latent, causal=causal, scale=scaling, layer=layer,
                                       cu_seqlens=kwargs.get("cu_seq_lens_q"),
                                       window=_window(sliding_window, causal),
                                       sinks=kwargs.get("s_aux"), chunk_size=_chunk_size(module),
                                       softcap=kwargs.get("softcap"))
        return out.transpose(1, 2).contiguous(), None
    out = options.attention(query, key, value, causal=causal, scale=scaling, layer=layer,
                            cu_seqlens=kwargs.get("cu_seq_lens_q"),
                            window=_window(sliding_window, causal),
                            sinks=kwargs.get("s_aux"), chunk_size=_chunk_size(module),
                            softcap=kwargs.get("softcap"))
    return out.transpose(1, 2).contiguous(), None  # (B, H, S, D) -> (B, S, H, D)


def _global_temperature(module: nn.Module, query: Tensor, options: SwapOptions, cu_seqlens: Any) -> Tensor:
    """Llama 4's attention temperature tuning, at the rows' global positions.

    Its NoPE layers scale query row t by ``log1p(floor((t + 1) / floor_scale)) * attn_scale + 1`` with
    ``t`` numbered from 0 on the tensor it sees (``torch.arange``, not ``position_ids``): on a shard that
    is the local row. Each row is rescaled here by ``scale(global t) / scale(local t)`` (the scales in
    fp32 as transformers computes them, their ratio in float64): ``query`` ``(batch, q_heads,
    seq_local, head_dim)``, and its gradient flows through the same factor.
    """
    if not getattr(module, "attn_temperature_tuning", False) or getattr(module, "use_rope", True):
        return query
    if is_probing():  # self-only attention returns the values: the queries' scale cannot matter
        return query
    rank, world_size = sp_rank_and_size(options.group)
    if world_size == 1:
        return query
    seq_local = query.shape[2]
    glob = global_positions(seq_local * world_size, rank, world_size, options.sharding, device=query.device,
                            cu_seqlens=host_boundaries(cu_seqlens))

    def temperature(pos: Tensor) -> Tensor:
        return torch.log1p(torch.floor((pos.float() + 1.0) / module.floor_scale)) * module.attn_scale + 1.0

    local = torch.arange(seq_local, device=query.device)
    factor = temperature(glob).double() / temperature(local).double()  # (seq_local,)
    return query * factor.to(query.dtype).view(1, 1, seq_local, 1)


# The keyword arguments transformers' decoders pass to the attention function, found by running the
# installed transformers (5.24) decoders and reading their attention calls. Any other one with a value is
# refused by name: seqpar would ignore it and silently compute plain attention (DSA's ``indices=``, the
# top-k keys each query may see, is the known case).
_HONOURED_KWARGS = {
    "cu_seq_lens_q": "packed-document boundaries (seqpar attention's cu_seqlens)",
    "cu_seq_lens_k": "packed-document boundaries (the same as cu_seq_lens_q)",
    "max_length_q": "the longest document (implied by the boundaries)",
    "max_length_k": "the longest document (implied by the boundaries)",
    "sliding_window": "the layer's window (seqpar attention's window)",
    "s_aux": "attention sinks (seqpar attention's sinks)",
    "position_ids": "positions (already applied by rotary embeddings; packing comes as cu_seq_lens_q/k)",
    "output_attentions": "refused when True",
    "softcap": "logit soft-capping (seqpar attention's softcap)",
    "position_bias": "refused when set",
}
# Model-level flags that transformers threads through the layers' **kwargs down to the attention call;
# none of them changes what attention computes.
_PASS_THROUGH_KWARGS = frozenset({
    "use_cache", "output_hidden_states", "output_router_logits", "return_dict", "num_items_in_batch",
    "cache_position", "past_key_values", "past_key_value", "labels", "shift_labels", "seq_idx",
    "token_type_ids", "layer_idx",
})
ATTENTION_KWARGS = frozenset(_HONOURED_KWARGS) | _PASS_THROUGH_KWARGS
"""Keyword arguments seqpar's attention function accepts (besides ``dropout``, ``scaling``, ``is_causal``);
any other one with a value other than None is refused, naming it and the layer."""

_KWARG_HINTS = {
    "indices": "DeepSeek-V3.2 / GLM-MoE-DSA sparse attention: an indexer picks the top-k keys each query "
               "attends to, which seqpar's dense attention cannot honour",
    "sinks": "attention sinks under another name than s_aux",
    "block_indices": "block-sparse attention, which seqpar's dense attention cannot honour",
}


def _refuse_unknown_kwargs(kwargs: dict[str, Any], layer: str, module: nn.Module) -> None:
    unknown = sorted(k for k, v in kwargs.items() if k not in ATTENTION_KWARGS and v is not None)
    if not unknown:
        return
    hints = "; ".join(f"{k}: {_KWARG_HINTS[k]}" for k in unknown if k in _KWARG_HINTS)
    raise ValueError(
        f"seqpar (layer '{layer}', {type(module).__name__}): the attention function got keyword "
        f"argument(s) {', '.join(f'{k}=' for k in unknown)} that seqpar does not know"
        f"{f' ({hints})' if hints else ''}; seqpar attention would ignore them and compute plain dense "
        "attention, a silently different model. Run this model without sequence parallelism, or teach "
        "seqpar.swap.hf the argument (seqpar attention must honour it on shards)"
    )


def _window(sliding_window: int | None, causal: bool) -> int | None:
    """transformers' ``sliding_window`` as seqpar's ``window``.

    Causal: key j is visible to query i iff ``0 <= i - j < sliding_window``, which is seqpar's
    window exactly. Bidirectional: transformers keeps ``|i - j| <= sliding_window`` (inclusive),
    seqpar's ``|i - j| < window``, so one more.
    """
    if sliding_window is None:
        return None
    return int(sliding_window) if causal else int(sliding_window) + 1


def _masks_nothing(mask: Tensor) -> bool:
    if mask.dtype == torch.bool:
        return bool(mask.all())
    return bool((mask == 0).all())
