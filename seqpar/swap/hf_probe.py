"""The position-mixing probe of the ``"hf"`` route, at swap time (:func:`probe_at_swap`).

Before anything is changed, :func:`probe_at_swap` runs the position-mixing probe
(:mod:`seqpar.swap.probe`) on 13 synthetic tokens, with the attention routed to seqpar (self-only) for
the probe alone: a module mixing positions outside attention, or a refused keyword argument, is a
:class:`SwapError` naming it, and the model is left as it was.

The routing is the probe's alone: the layers' options and names, ALiBi forwards and every config's
attention implementation are put back afterwards (:func:`_probe_routing`). Models whose parameters are
not materialised yet (meta device, ZeRO-3 partitions) are probed at their first forward instead.

A third run, on the same tokens as two packed documents, finds the attention layers a packed batch's
boundaries do not reach (their decoder layer drops the model's keyword arguments: Nemotron, StableLM);
the swap makes their layers documents carriers (:func:`_mark_dropping`), else seqpar, like transformers
itself there, would attend across the documents of a packed row.
"""

from __future__ import annotations

import contextlib
import dis
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
import transformers
from torch import Tensor, nn

from seqpar.mixers.documents import DROPS_DOCUMENTS_ATTR, batch_documents, carry_to
from seqpar.swap.hf_alibi import install as install_alibi
from seqpar.swap.hf_alibi import is_alibi_attention
from seqpar.swap.hf_attention import register
from seqpar.swap.hf_inputs import forward_signature
from seqpar.swap.hf_route import ATTN_IMPLEMENTATION, OPTIONS_ATTR, top_pretrained
from seqpar.swap.options import SwapError, SwapOptions
from seqpar.swap.probe import (
    PROBE_LENGTH,
    PROBE_POSITION,
    ProbeFailed,
    find_mixers,
    is_materialised,
    is_simulated,
    isolated,
    mixing_refusal,
    raised_by_seqpar,
)
from seqpar.swap.probe_batch import first_forward_probe

__all__ = ["probe_at_swap", "FirstForward"]

logger = logging.getLogger("seqpar")

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
        return functools.partial(_first_forward_tops, tops, modules)
    with _probe_routing([top for _, top in tops], modules, options) as routed:
        if not routed:
            return None  # apply() refuses: transformers kept another attention implementation
        failure = _probe_tops(tops, "Nothing was changed.")
        if failure is None:
            _mark_dropping(model, tops, modules)
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
    tops = {id(m) for m in top_pretrained(model)}
    seen: set[int] = set()
    named = []
    for name, module in model.named_modules():
        if id(module) in tops and id(module) not in seen:
            seen.add(id(module))
            named.append((name, module))
    return named


def _first_forward_tops(tops: list[tuple[str, nn.Module]], modules: list[tuple[str, nn.Module]], model: nn.Module,
                        args: tuple, kwargs: dict) -> None:
    failure = _probe_tops(tops, "The model stays swapped, and refuses every forward.")
    if failure is not None:
        logger.warning("seqpar: %s did not run on %d synthetic tokens for the position-mixing probe (%s); "
                       "probing this batch instead", type(failure[0]).__name__, PROBE_LENGTH, failure[1])
        first_forward_probe(model, args, kwargs)
        return
    # The swap is done: the carriers are put in here, before the first forward's layers run (the model holds
    # each forward's boundaries for them: walk.apply feeds documents to a model whose probe is deferred).
    carry_to(model, list(_mark_dropping(model, tops, modules)))


def _mark_dropping(model: nn.Module, tops: list[tuple[str, nn.Module]],
                   modules: list[tuple[str, nn.Module]]) -> dict[str, bool]:
    """Find the attention modules of ``modules`` (names relative to ``model``) that a packed forward
    reaches without its boundaries, and mark them (:data:`DROPS_DOCUMENTS_ATTR`): their layers drop the
    model's keyword arguments (Nemotron's and StableLM's decoder layers call their attention with the
    hidden states, mask and positions only), so seqpar would attend across the documents of a packed
    row, as transformers itself does there with any attention. Returns ``{name: whether its parent layer
    got the boundaries}`` for each one found.

    Each top model runs once more on the probe's tokens, as two documents of 6 and 7 tokens
    (``cu_seq_lens_q/k`` and ``max_length_q/k``, as transformers' ``DataCollatorWithFlattening`` passes
    them; no ``position_ids``, from which transformers would build a packed mask: only where the keyword
    arguments reach matters). A model that does not take them is left unmarked: a packed batch fails the
    same way."""
    parents = {name: name.rpartition(".")[0] for name, _ in modules if "." in name}
    watched = {**{name: module for name, module in modules},
               **{f"{parent}/": model.get_submodule(parent) for parent in parents.values()}}
    got: dict[str, list[bool]] = {}
    handles = []

    def record(key: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            got.setdefault(key, []).append(batch_documents(kwargs) is not None)
        return hook

    try:
        for key, module in watched.items():
            handles.append(module.register_forward_pre_hook(record(key), with_kwargs=True))
        for _, top in tops:
            ids, extra = _probe_ids(top)
            first = PROBE_LENGTH // 2
            cu = torch.tensor([0, first, PROBE_LENGTH], dtype=torch.int32, device=ids.device)
            longest = PROBE_LENGTH - first
            with isolated(top):
                try:
                    top(input_ids=ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest,
                        max_length_k=longest, **extra)
                except Exception:  # noqa: BLE001 - it does not take packed documents; a packed batch says so
                    continue
    finally:
        for handle in handles:
            handle.remove()
    dropping = {name: all(got.get(f"{parents[name]}/", [False])) for name, _ in modules
                if name in parents and got.get(name) and not any(got[name])}
    for name, module in modules:
        if name in dropping:
            setattr(module, DROPS_DOCUMENTS_ATTR, True)
    return dropping


def _probe_tops(tops: list[tuple[str, nn.Module]], after: str) -> tuple[nn.Module, ProbeFailed] | None:
    """Probe each model on synthetic tokens; raises SwapError naming what it found (``after`` ends the
    message). Returns the first model that raised, with the failure (not a seqpar refusal), or None."""
    for prefix, top in tops:
        try:
            mixers = find_mixers(top, _synthetic_run(top), PROBE_LENGTH, PROBE_POSITION)
        except ProbeFailed as failed:
            if not raised_by_seqpar(failed.error):
                return top, failed
            if not _raise_statement(failed.error):
                # A torch op that seqpar's code called failed (a shape or index error): a bug of seqpar's, not a
                # refusal; worded as one it read as a limit of the model (case 1410858051). Raised as it is.
                raise failed.error from None
            raise SwapError(
                f"{type(top).__name__}: seqpar refused a layer while probing the model: {failed.error}. {after}"
            ) from failed.error
        if mixers:
            raise SwapError(f"{mixing_refusal(mixers, type(top).__name__, prefix)} {after}")
    return None


def _raise_statement(error: BaseException) -> bool:
    """Whether ``error`` came from a ``raise`` statement in the innermost frame of its traceback (a refusal
    seqpar's code wrote), not from an operation that frame ran (a torch op's IndexError or RuntimeError)."""
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and any(ins.offset == tb.tb_lasti and ins.opname in ("RAISE_VARARGS", "RERAISE")
                                  for ins in dis.get_instructions(tb.tb_frame.f_code))


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
    ids, extra = _probe_ids(top)
    changed = ids.clone()
    changed[0, PROBE_POSITION] = (ids[0, PROBE_POSITION] + 1) % _vocab(top)

    def run(perturbed: bool) -> Any:
        return top(input_ids=changed if perturbed else ids, **extra)

    return run


def _vocab(top: nn.Module) -> int:
    vocab = getattr(top.get_input_embeddings(), "num_embeddings", None)
    return top.config.get_text_config().vocab_size if vocab is None else vocab


def _probe_ids(top: nn.Module) -> tuple[Tensor, dict[str, Any]]:
    """``top``'s probe tokens ``(1, PROBE_LENGTH)`` (seeded ids of its vocabulary, on its device) and the
    keyword arguments every probe call adds (no cache)."""
    weight = getattr(top.get_input_embeddings(), "weight", None)
    device = weight.device if isinstance(weight, Tensor) else next(top.parameters()).device
    ids = torch.randint(0, _vocab(top), (1, PROBE_LENGTH), generator=torch.Generator().manual_seed(0)).to(device)
    return ids, {"use_cache": False} if "use_cache" in forward_signature(type(top)).parameters else {}


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
    saved = [(m, m.__dict__.get(OPTIONS_ATTR, _MISSING), m.__dict__.get("_seqpar_name", _MISSING),
              m.__dict__.get("forward", _MISSING)) for _, m in modules]
    # ALiBi modules (BLOOM, MPT, Falcon) compute their own scores: they get seqpar's forward for the
    # probe, as apply() gives them for good; the others are routed through transformers' interface.
    interfaced = [m for _, m in modules if not is_alibi_attention(m)]
    try:
        for name, module in modules:
            setattr(module, OPTIONS_ATTR, options)
            module._seqpar_name = name
            if is_alibi_attention(module):
                install_alibi(module, options)
        for top in tops if interfaced else ():
            top.set_attn_implementation(ATTN_IMPLEMENTATION)
        yield all(getattr(getattr(m, "config", None), "_attn_implementation", None) == ATTN_IMPLEMENTATION
                  for m in interfaced)
    finally:
        for module, old_options, old_name, old_forward in saved:
            for attr, old in ((OPTIONS_ATTR, old_options), ("_seqpar_name", old_name), ("forward", old_forward)):
                if old is _MISSING:
                    module.__dict__.pop(attr, None)
                else:
                    setattr(module, attr, old)
        for config, old in configs:
            if old is _MISSING:
                config.__dict__.pop("_attn_implementation_internal", None)
            else:
                config._attn_implementation_internal = old
