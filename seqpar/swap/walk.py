"""The model walk: find the attention modules of a model and route each to seqpar attention.

One route per module (``"hf"``, ``"sdpa"``, ``"mha"``; see :mod:`seqpar.swap`). Nothing is changed
unless every matched module can be swapped exactly; then the batch check
(:mod:`seqpar.swap.batch`) goes on the model.

Attention is not the only thing that mixes information across positions: state-space scans, linear
attention, causal convolutions, cumulative sums would run on each rank's shard and compute something
else. The position-mixing probe (:mod:`seqpar.swap.probe`) accounts for every such module: with the
swapped attention self-only, the model must be position-wise, and each module that is not is named in a
:class:`SwapError` with its path and class. Hugging Face models are probed at swap time on 13 synthetic
tokens (one extra pair of tiny forwards); models of the other routes, and models whose parameters are
not materialised yet (meta device, ZeRO-3 partitions), at their first forward, before any communication.
"""

from __future__ import annotations

import fnmatch
import importlib
import logging
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch.distributed as dist
from torch import nn

from seqpar.config import SeqParConfig
from seqpar.mixers.documents import DROPS_DOCUMENTS_ATTR, feed_documents
from seqpar.mixers.registry import family_of
from seqpar.swap.batch import FirstForward, Preparer, install_batch_check
from seqpar.swap.hf_alibi import is_alibi_attention
from seqpar.swap.mha import SeqParMultiheadAttention, mha_problems
from seqpar.swap.options import SwapError, SwapOptions
from seqpar.swap.probe_batch import first_forward_probe
from seqpar.swap.sdpa import class_calls_sdpa, track_module
from seqpar.swap.state import is_probing

__all__ = ["swap_attention", "SwapReport", "SwappedModule", "ROUTES", "MIXER_ROUTE"]

logger = logging.getLogger("seqpar")

ROUTES = ("hf", "sdpa", "mha")
MIXER_ROUTE = "mixer"
"""The report's route of a swapped non-attention mixer (:mod:`seqpar.mixers`: LFM2 short convolutions)."""
# The oldest transformers the 'hf' route is tested with (setup.cfg's floor says the same).
TRANSFORMERS_FLOOR = "5.17"
_ROUTE_HELP = {
    "hf": "Hugging Face transformers attention modules (dispatching through ALL_ATTENTION_FUNCTIONS)",
    "sdpa": "modules whose code calls torch.nn.functional.scaled_dot_product_attention",
    "mha": "torch.nn.MultiheadAttention modules",
}


@dataclass(frozen=True)
class SwappedModule:
    name: str
    """Qualified name in the model (``""`` for the model itself)."""
    route: str
    """``"hf"``, ``"sdpa"`` or ``"mha"`` (attention), or ``"mixer"`` (a sequence-parallel mixer of
    :mod:`seqpar.mixers`)."""
    cls: str
    """Class name of the module before the swap."""


@dataclass
class SwapReport:
    """What :func:`swap_attention` changed."""

    swapped: list[SwappedModule] = field(default_factory=list)
    tiling: Any = None
    """What :func:`seqpar.memory.tiling.apply_tiling` did (tiled loss / MLP, offload), or None."""

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.swapped]

    @property
    def routes(self) -> dict[str, str]:
        """Module name -> route."""
        return {m.name: m.route for m in self.swapped}

    def __len__(self) -> int:
        return len(self.swapped)

    def __iter__(self) -> Iterator[SwappedModule]:
        return iter(self.swapped)

    def __str__(self) -> str:
        if not self.swapped:
            return "seqpar swap: nothing swapped"
        counts = {r: sum(m.route == r for m in self.swapped) for r in ROUTES}
        head = ", ".join(f"{n} via {r}" for r, n in counts.items() if n)
        width = max(len(m.name or "<model>") for m in self.swapped)
        attention = sum(counts.values())
        mixers = len(self.swapped) - attention
        extra = f", {mixers} mixer(s) made sequence-parallel" if mixers else ""
        lines = [f"seqpar swap: {attention} attention module(s) swapped ({head}){extra}"]
        lines += [f"  {(m.name or '<model>'):<{width}}  {m.cls} -> {m.route}" for m in self.swapped]
        return "\n".join(lines)


def _hf_glue() -> ModuleType | None:
    """The transformers glue (:mod:`seqpar.swap.hf`), or None when transformers is not installed
    (or too old for it: then the 'hf' route is off, with a warning saying why)."""
    try:
        transformers = importlib.import_module("transformers")
    except ImportError:
        return None
    try:
        return importlib.import_module("seqpar.swap.hf")
    except ImportError as e:
        logger.warning(
            "seqpar: transformers %s is too old for the 'hf' swap route (%s); install "
            "transformers>=%s", getattr(transformers, "__version__", "?"), e, TRANSFORMERS_FLOOR,
        )
        return None


def _is_transformers_model(model: nn.Module) -> bool:
    """Whether ``model`` is or holds a transformers ``PreTrainedModel`` (without importing transformers): a user's
    wrapper around one is probed as the model itself is (mut33b: a wrapped RWKV's ``swap="sdpa"`` refusal named
    no module, as ``"auto"``'s does)."""
    transformers = sys.modules.get("transformers")
    return transformers is not None and any(isinstance(m, transformers.PreTrainedModel) for m in model.modules())


def _matches(name: str, module: nn.Module, patterns: tuple[str, ...]) -> bool:
    cls = type(module)
    keys = (name, cls.__name__, f"{cls.__module__}.{cls.__qualname__}")
    return any(fnmatch.fnmatchcase(k, p) for p in patterns for k in keys)


def _parent_and_attr(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    parent_name, _, attr = name.rpartition(".")
    return (model.get_submodule(parent_name) if parent_name else model), attr


def swap_attention(
    model: nn.Module,
    config: SeqParConfig | dict | str | None = None,
    *,
    group: dist.ProcessGroup | None = None,
) -> SwapReport:
    """Route the attention of ``model`` to seqpar attention, in place.

    Call it on every rank, before wrapping the model in an engine and before building the
    optimizer (``nn.MultiheadAttention`` parameters are kept as the same objects either way).

    Args:
        model: any ``nn.Module``; after the swap it must be fed sequence shards
            (:func:`seqpar.sequence.batch.shard_batch`), on every rank of the SP group.
        config: a ``SeqParConfig`` (or dict / JSON path); uses ``swap``, ``mode``, ``sharding``,
            ``overlap``, ``check_inputs``; a ``size`` other than 1 must equal the SP group's size.
            ``swap="auto"`` tries every route, ``"hf"``, ``"sdpa"``,
            ``"mha"`` one route, a tuple of class names / fnmatch patterns (matched against the
            qualified module name, the class name and the dotted class path) limits the swap to
            those modules, ``"none"`` swaps nothing.
        group: the SP group (default: the default manager's SP group; without one on a world > 1: an
            error, see :func:`seqpar.runtime.groups.resolve_group`).

    Returns:
        A :class:`SwapReport` of the swapped modules and their routes.

    Raises:
        SwapError: ``size`` contradicts the SP group's size; nothing matched; or a matched module uses a feature seqpar does not honour
            (all such modules are named, and nothing is changed); or a module other than the swapped
            attention mixes information across sequence positions (a state-space, linear-attention
            or convolution layer, a cumulative sum ...), or an attention layer passes a keyword
            argument seqpar does not know: found by the position-mixing probe
            (:mod:`seqpar.swap.probe`), which costs one pair of forwards of 13 tokens. Hugging Face
            models are probed here (nothing is changed on refusal); models of the "sdpa" and "mha"
            routes, and models whose parameters are not materialised yet, at their first forward on
            every rank, which then raises this error (the model stays swapped and refuses every forward).
    """
    cfg = SeqParConfig.load(config)
    _check_config(cfg)
    _check_size(cfg, group)
    if cfg.swap == "none":
        logger.info("seqpar swap: swap='none', attention left as it is")
        return SwapReport()
    patterns = cfg.swap if isinstance(cfg.swap, tuple) else None
    routes = set(ROUTES) if cfg.swap == "auto" or patterns else {cfg.swap}
    glue = _hf_glue() if "hf" in routes else None
    plan = _plan(model, routes, patterns, glue)
    options = SwapOptions.from_config(cfg, group)
    if not plan and not (glue is not None and _has_mixers(model, patterns)):
        _refuse_nothing_found(model, cfg, routes, patterns, glue, options)
    # Mixers first: the position-mixing probe must see them in their sequence-parallel form
    # (position-wise while it probes), and every module it still finds is one seqpar does not handle.
    mixers = _swap_mixers(model, patterns, options) if glue is not None else []
    try:
        first_forward = _probe(model, plan, options, glue)
        report, preparers = _apply(model, plan, options, glue)
    except BaseException:
        _restore_mixers(model, mixers)  # a refusal changes nothing
        raise
    report.swapped += [SwappedModule(name, MIXER_ROUTE, getattr(before, "original_class", type(before).__name__))
                       for name, before in mixers]
    install_batch_check(model, options, [f"{m.route} {m.name}" for m in report], preparers, first_forward)
    # after the batch check (which fills in the boundaries): mixers whose caller drops them get them here,
    # and so do the ALiBi attention modules (BLOOM, MPT, Falcon: their models call no block with them) and
    # the attention of layers that drop them (Nemotron, StableLM; found by the probe: hf_probe)
    feed_documents(model, [name for name, _ in mixers]
                   + [name for name, module, route in plan if route == "hf" and (
                       is_alibi_attention(module) or getattr(module, DROPS_DOCUMENTS_ATTR, False))],
                   # a Hugging Face model probed at its first forward gets its carriers then: hold from now
                   hold=first_forward is not None and any(route == "hf" for _, _, route in plan))
    logger.info("%s", report)
    from seqpar.memory.tiling import apply_tiling  # tiled loss / MLP, offload: from the same config

    report.tiling = apply_tiling(model, cfg, group=group)
    return report


def _probe(model: nn.Module, plan: list[tuple[str, nn.Module, str]], options: SwapOptions,
           glue: ModuleType | None) -> FirstForward | None:
    """The position-mixing probe (:mod:`seqpar.swap.probe`): runs it now where it can (Hugging Face
    models: raises SwapError), and returns what must run at the first forward (None: nothing)."""
    hf_modules = [(name, module) for name, module, route in plan if route == "hf"]
    later: list[FirstForward] = []
    # A model of mixers alone (Mamba, Mamba2: no attention at all) is probed like one with attention:
    # every position-mixing module left must be one its mixers' families handle.
    if glue is not None and (hf_modules or not plan):
        deferred = glue.probe_at_swap(model, hf_modules, options)
        if deferred is not None:
            later.append(deferred)
    if any(route != "hf" for _, _, route in plan) and first_forward_probe not in later:
        later.append(first_forward_probe)
    if not later:
        return None
    if len(later) == 1:
        return later[0]

    def both(module: nn.Module, args: tuple, kwargs: dict) -> None:
        for check in later:
            check(module, args, kwargs)

    return both


def _swap_mixers(model: nn.Module, patterns: tuple[str, ...] | None,
                 options: SwapOptions) -> list[tuple[str, nn.Module]]:
    """Replace every handled mixer (:mod:`seqpar.mixers`) by its sequence-parallel form (one swapped
    before gets the new options); returns ``(name, module before)`` of each, for the report and for
    :func:`_restore_mixers`."""
    found = [(name, module, family) for name, module in model.named_modules()
             if (family := family_of(module)) is not None and (patterns is None or _matches(name, module, patterns))]
    swapped: list[tuple[str, nn.Module]] = []
    for name, module, family in found:
        parent, attr = _parent_and_attr(model, name)
        setattr(parent, attr, family.build(module, group=options.group, sharding=options.sharding,
                                           position_wise=is_probing, mixer_kernels=options.mixer_kernels))
        swapped.append((name, module))
    return swapped


def _has_mixers(model: nn.Module, patterns: tuple[str, ...] | None) -> bool:
    """Whether ``model`` holds a mixer seqpar handles (:mod:`seqpar.mixers`) that ``patterns`` selects."""
    return any(family_of(module) is not None and (patterns is None or _matches(name, module, patterns))
               for name, module in model.named_modules())


def _restore_mixers(model: nn.Module, mixers: list[tuple[str, nn.Module]]) -> None:
    for name, before in mixers:
        parent, attr = _parent_and_attr(model, name)
        setattr(parent, attr, before)


def _check_config(cfg: SeqParConfig) -> None:
    if cfg.pattern.type == "dilated" and cfg.sharding not in (None, "contiguous"):  # None: undeclared
        raise SwapError(
            "sequence_parallel.pattern is dilated but sharding is "
            f"{cfg.sharding!r}: dilated segments are contiguous runs of the sequence, so shard with "
            "\"sharding\": \"contiguous\" (dilated attention needs no zigzag balancing: its causal "
            "work is the same in every segment)"
        )


def _check_size(cfg: SeqParConfig, group: dist.ProcessGroup | None) -> None:
    """A ``size`` that contradicts the SP group the swap runs on is refused (as a contradicting ``sharding`` is,
    :func:`seqpar.sequence.sharding.resolve_sharding`). The group is ``group``, else the default manager's SP
    group; with neither (one process, or before any manager: the launcher's ``--validate-only``) there is no
    group to contradict. ``size`` 1, the default, reads as "not set", as ``init_process_groups`` reads it. Every
    rank raises alike: the config and the group's size are the same on every rank of a correct program."""
    if cfg.size == 1:
        return
    if group is None:
        from seqpar.runtime.factory import default_manager

        manager = default_manager()
        if manager is None:
            return
        group, whose = manager.sp_group, "the default manager's SP group (seqpar.init_process_groups)"
    else:
        whose = "the group= passed to swap_attention"
    actual = dist.get_world_size(group)
    if cfg.size != actual:
        raise SwapError(
            f"swap_attention: sequence_parallel.size = {cfg.size} contradicts the SP group it runs on, {whose}, "
            f"of {actual} rank(s); set size to {actual} or leave it out (the group decides), or make the "
            f"groups with sp_size={cfg.size}: one SP size must cut the batch and run attention"
        )


def _route_of(name: str, module: nn.Module, routes: set[str], glue: ModuleType | None,
              sdpa_prefixes: list[str]) -> tuple[str | None, list[str]]:
    """The route for one module (None: not attention) and the features that stop its swap."""
    if "mha" in routes and isinstance(module, (nn.MultiheadAttention, SeqParMultiheadAttention)):
        problems = []
        if isinstance(module, nn.MultiheadAttention):
            problems = mha_problems(module)
            if not name:
                problems.append(
                    "the model is itself an nn.MultiheadAttention, which cannot be replaced in "
                    "place; wrap it in a module, or use SeqParMultiheadAttention.from_module"
                )
        return "mha", problems
    if glue is not None and glue.is_hf_attention(module):
        return "hf", glue.swap_problems(module)
    if (
        "sdpa" in routes
        and class_calls_sdpa(type(module))
        and not any(name.startswith(p) for p in sdpa_prefixes)
    ):
        sdpa_prefixes.append(f"{name}." if name else "")  # its submodules are inside the route
        return "sdpa", []
    return None, []


def _plan(model: nn.Module, routes: set[str], patterns: tuple[str, ...] | None,
          glue: ModuleType | None) -> list[tuple[str, nn.Module, str]]:
    """``(name, module, route)`` of every module to swap; raises naming every unswappable one."""
    plan: list[tuple[str, nn.Module, str]] = []
    problems: list[str] = []
    sdpa_prefixes: list[str] = []
    for name, module in model.named_modules():
        if patterns is not None and not _matches(name, module, patterns):
            continue
        route, issues = _route_of(name, module, routes, glue, sdpa_prefixes)
        problems += [f"layer '{name}': {p}" for p in issues]
        if route is not None:
            plan.append((name, module, route))
    if problems:
        raise SwapError(
            "seqpar cannot swap this model's attention exactly:\n  - " + "\n  - ".join(problems)
            + "\nNothing was changed."
        )
    return plan


def _refuse_nothing_found(model: nn.Module, cfg: SeqParConfig, routes: set[str],
                          patterns: tuple[str, ...] | None, glue: ModuleType | None,
                          options: SwapOptions) -> None:
    looked = "; ".join(_ROUTE_HELP[r] for r in ROUTES if r in routes)
    if patterns is not None:
        looked = f"modules matching {list(patterns)} among {looked}"
    hint = ""
    if "hf" in routes and glue is None:
        hint = " (transformers is not installed, so the 'hf' route was unavailable)"
    named = ""
    if glue is None and "hf" not in routes and _is_transformers_model(model):
        glue = _hf_glue()  # swap="sdpa"/"mha" on a transformers model: name its mixers as "auto" does
    if glue is not None:
        # A transformers model whose attention seqpar cannot route (it computes its own scores: GPT-Neo,
        # xGLM, ...) or that has none (Mamba, RWKV, xLSTM): the probe, with nothing routed, names every
        # module that mixes positions, so the refusal says which ones seqpar would have to handle.
        try:
            glue.probe_at_swap(model, [], options)
        except SwapError as e:
            named = f". {e}"
    raise SwapError(
        f"swap_attention found nothing to swap in {type(model).__name__} with "
        f"swap={cfg.swap!r}: looked for {looked}{hint}. Set sequence_parallel.swap to a route "
        f"or to class names / name patterns of the attention modules{named}"
    )


def _apply(model: nn.Module, plan: list[tuple[str, nn.Module, str]], options: SwapOptions,
           glue: ModuleType | None) -> tuple[SwapReport, list[Preparer]]:
    """Swap every planned module; returns the report and the model's input preparers."""
    report = SwapReport()
    hf_modules: list[tuple[str, nn.Module]] = []
    for name, module, route in plan:
        report.swapped.append(SwappedModule(name, route, type(module).__name__))
        if route == "mha":
            if isinstance(module, SeqParMultiheadAttention):
                module.options = options
                continue
            parent, attr = _parent_and_attr(model, name)
            setattr(parent, attr, SeqParMultiheadAttention.from_module(module, options))
        elif route == "hf":
            hf_modules.append((name, module))
        else:
            track_module(module, name, options)
    # A model of mixers alone still needs its inputs prepared (labels shifted across shards, the loss
    # over the whole sequence, packed documents' boundaries), so it goes through the glue with no attention.
    preparers = glue.apply(model, hf_modules, options) if hf_modules or (not plan and glue is not None) else []
    return report, preparers
