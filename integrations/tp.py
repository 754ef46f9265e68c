"""Tensor parallelism for Hugging Face models, from the model's own plan, on seqpar's ``"tp"`` mesh dim.

transformers (5.24) carries each model's tensor-parallel plan (``config.base_model_tp_plan``, plus the
head's entries: ``model.tp_plan``, e.g. Llama's ``q/k/v/gate/up_proj -> "colwise"``,
``o/down_proj -> "rowwise"``, ``lm_head -> "colwise_gather_output"``) and applies it with its own
DTensor styles (``transformers.distributed.tensor_parallel.apply_tensor_parallelism``): this module
expands the plan's ``*`` layer wildcards to the model's module names and hands it, with the manager's
TP sub-mesh (``manager.dp_sp_tp_mesh["tp"]``, whose ``"dp_sp"`` dim FSDP2 shards over), to that
function. Nothing here re-implements a style.

Only the styles checked against one process (tests/test_tp_train.py, tests/test_tp_compose.py) are accepted; any other style in
a plan is refused by name, before anything is sharded. ``replicated_with_grad_allreduce`` (Qwen3's
``q_norm`` / ``k_norm``, which see only the rank's heads) is transformers' own: it sums the weight's
gradient over the TP group in a post-accumulate hook. torch's plain ``parallelize_module`` has no such
style and would leave those gradients per-rank partial sums.

Tied parameters (``tie_word_embeddings``: SmolLM3's, MiniCPM3's head holds the embedding's weight; Zamba's
shared block) are one parameter with one layout: it is sharded once, under the name ``named_parameters`` keeps
(transformers' ``apply_tensor_parallelism`` looks parameters up there, and raised ``KeyError: 'lm_head.weight'``
for the other name), then set again on every other module holding it, so both uses add to one gradient. The
plan's styles for its names must agree (``embedding_rowwise`` and ``colwise_gather_output`` both shard the
vocabulary, ``Shard(0)``); a plan that would lay it out two ways is refused by name before anything is sharded.

Torch 2.13 caches DTensor sharding plans keyed by meshes that compare equal when they cover the same
ranks, whatever their process groups: ``ProcessGroupManager.destroy`` drops those plans, so a later
manager of the same layout in the same process is not handed the destroyed groups.

With ``sequence_parallel=True`` (``sequence_parallel.tp_sequence_parallel``) the residual stream is split
along the sequence over TP as well, Megatron-style (:func:`apply_tp_sequence_parallel`: torch's
``SequenceParallel`` on the norms, torch's ``RowwiseParallel(output_layouts=Shard(1))`` on the embedding,
transformers' own row-parallel style with ``Shard(1)`` outputs on o_proj / down_proj, an all-gather into each
attention / MLP block), and the LM head's output stays split on the vocabulary (``vocab_parallel``): a
DTensor ``Shard(-1)`` that :func:`seqpar.sequence.loss.sequence_parallel_loss` and the tiled loss reduce
vocab-parallel (:mod:`seqpar.sequence.vocab_parallel`), so no rank holds ``(seq_local, vocab)`` logits.

Layering: an integration (``seqpar.integrations.tp``); it imports the core, the core never imports it.
Sequence parallelism composes with it unchanged: the attention inputs a TP rank sees are
``(batch, heads / tp, seq_local, head_dim)``, and seqpar's attention runs on them over the SP group.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from seqpar.runtime.groups import ProcessGroupManager, default_manager, tp_heads_problem
from seqpar.swap.state import is_probing

__all__ = [
    "SUPPORTED_STYLES", "expand_tp_plan", "split_feature_activations", "feature_statistics_problem", "apply_tensor_parallel", "apply_tp_sequence_parallel",
    "SequenceParallelLayout", "sequence_parallel_layout", "clip_grad_norm",
]

SUPPORTED_STYLES = (
    "colwise",  # weight Shard(0): output features split, input replicated
    "rowwise",  # weight Shard(1): input features split, output all-reduced
    "colwise_gather_output",  # the LM head: output gathered (replicated logits)
    "embedding_rowwise",  # vocab-parallel embedding: partial lookups summed
    "replicated_with_grad_allreduce",  # per-head norms (Qwen3 q_norm/k_norm): gradient summed over TP
    "mla_kv_a_proj",  # MLA's kv_a_proj_with_mqa (replicated): the rope key's gradient summed over TP
)
"""The transformers tensor-parallel styles seqpar applies (each checked against one process)."""


def expand_tp_plan(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """``plan`` (names with ``*`` for layer numbers, as transformers writes them) as the model's own module
    and parameter names: ``{"model.layers.0.self_attn.q_proj.weight": "colwise",
    "model.layers.0.self_attn.q_proj": "colwise", ...}`` (a parameter entry shards it, a module entry
    hooks the module's forward).

    Raises:
        ValueError: a style outside :data:`SUPPORTED_STYLES`, naming the style and its plan entry.
    """
    from transformers.distributed.parallel_utils import replace_layer_number_by_wildcard

    for key, style in plan.items():
        if style not in SUPPORTED_STYLES:
            raise ValueError(
                f"tensor parallelism: the model's tp plan maps {key!r} to style {style!r}, which seqpar does not "
                f"apply yet (supported: {list(SUPPORTED_STYLES)}); pass plan= to seqpar.integrations.tp."
                f"apply_tensor_parallel without it (that part then stays replicated on every TP rank), or run "
                "tp_size 1"
            )
    expanded: dict[str, str] = {}
    for module_name, module in model.named_modules():
        module_style = plan.get(replace_layer_number_by_wildcard(module_name)) if module_name else None
        # a module's own parameters first (sharded by its style, or by their own entry), then the module
        # (hooked): transformers' order (PreTrainedModel._expand_parallel_plan)
        for param_name, _ in module.named_parameters(recurse=False):
            name = f"{module_name}.{param_name}" if module_name else param_name
            style = plan.get(replace_layer_number_by_wildcard(name), module_style)
            if style is not None:
                expanded[name] = style
        if module_style is not None:
            expanded[module_name] = module_style
    return expanded


def _check_transformers_tp_api() -> None:
    """Refuse, naming the version, a transformers whose tensor-parallel API is not the one this module calls
    (every rank reads the same installed package, so every rank refuses alike). transformers 5.17, seqpar's floor
    for everything else, has no ``transformers.distributed.parallel_utils`` and an ``apply_tensor_parallelism(model,
    tp_mesh)`` without the plan argument: TP there failed on an ImportError or a TypeError deep inside."""
    import importlib.util

    import transformers

    if importlib.util.find_spec("transformers.distributed.parallel_utils") is None:
        raise ImportError(
            f"tensor parallelism (tp_size > 1) calls transformers' tensor-parallel API as of transformers 5.24 "
            f"(transformers.distributed.parallel_utils, apply_tensor_parallelism(model, mesh, plan)), which the "
            f"installed transformers {transformers.__version__} does not have: pip install -U 'transformers>=5.24', "
            "or run tp_size 1 (sequence parallelism alone works from transformers 5.17)"
        )


def apply_tensor_parallel(
    model: nn.Module, manager: ProcessGroupManager | None = None, *, plan: dict[str, str] | None = None,
    sequence_parallel: bool = False, vocab_parallel: bool | None = None,
) -> dict[str, str]:
    """Shard ``model`` over the manager's TP group with transformers' own styles, in place; return the
    expanded plan applied (empty when ``tp_size`` is 1: nothing changes).

    Call it on every rank of the TP group with the same model (same seed: each rank keeps its slice of
    the weights it already holds, so no weight is sent), after :func:`seqpar.swap.swap_attention` (whose
    probe must see the model without TP sequence parallelism) and before FSDP2 and the optimizer
    (:func:`seqpar.integrations.fsdp.wrap` does both when ``tp_size`` > 1). Sharded parameters become
    DTensors on ``manager.dp_sp_tp_mesh["tp"]``; replicated ones stay plain tensors.

    Args:
        model: a transformers ``PreTrainedModel`` (anything with ``tp_plan``, or pass ``plan``).
        manager: the groups (default: :func:`seqpar.runtime.groups.default_manager`).
        plan: overrides ``model.tp_plan`` (transformers' own: ``base_model_tp_plan`` plus the head).
        sequence_parallel: Megatron-style TP sequence parallelism (``sequence_parallel.tp_sequence_parallel``),
            see :func:`apply_tp_sequence_parallel`.
        vocab_parallel: keep the LM head's output split on the vocabulary, a DTensor ``Shard(-1)`` of
            ``(batch, seq_local, vocab / tp)`` local logits, which seqpar's losses reduce vocab-parallel
            (:mod:`seqpar.sequence.vocab_parallel`) instead of gathering ``(seq_local, vocab)`` on every
            rank. Default: on with ``sequence_parallel`` (Megatron's layout), off otherwise (the plan's
            ``colwise_gather_output``: plain, full logits). ``sequence_parallel.tp_loss_parallel`` (true / false /
            ``"auto"`` = None), which :func:`seqpar.integrations.fsdp.wrap` passes here.

    Raises:
        ValueError: no manager; a model without a plan; head counts TP cannot split; an unsupported style;
            a tied parameter the plan lays out two ways; a statistic over features the plan splits
            (:func:`feature_statistics_problem`); with ``sequence_parallel``, a model whose layout it does not
            know; ``vocab_parallel=True`` with a plan that has no ``colwise_gather_output`` head.
    """
    manager = manager if manager is not None else default_manager()
    if manager is None:
        raise ValueError("apply_tensor_parallel needs the process groups: call seqpar.init_process_groups("
                         "tp_size=...) first or pass manager=")
    if manager.tp_size == 1:
        return {}
    _check_transformers_tp_api()
    if plan is None:
        plan = dict(getattr(model, "tp_plan", None) or {})
    if not plan:
        raise ValueError(
            f"tensor parallelism: {type(model).__name__} has no tensor-parallel plan (config.base_model_tp_plan); "
            "pass plan={module name pattern: style} or run tp_size 1"
        )
    config: Any = getattr(model, "config", None)
    if config is not None and hasattr(config, "num_attention_heads"):
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        if problem := tp_heads_problem(heads, kv_heads, manager.tp_size):
            raise ValueError(f"tensor parallelism: {problem}")
    expanded = expand_tp_plan(model, plan)
    expanded.update(split_feature_activations(model, expanded))
    if problem := feature_statistics_problem(model, expanded):
        raise ValueError(f"tensor parallelism: {problem}")
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    # the "tp" dim of the (dp x sp, tp) mesh, so FSDP2 can shard the same DTensors over "dp_sp"
    mesh = manager.dp_sp_tp_mesh["tp"]
    tied = _tied_parameters(model)
    _check_tied_layouts(model, tied, expanded, mesh)
    # a tied parameter is sharded once, under its first name (the one named_parameters keeps, and the only one
    # transformers' apply_tensor_parallelism can look up: the others raised KeyError 'lm_head.weight'), then
    # handed to its other holders (below)
    duplicates = {name for names in tied for name in names[1:]}
    asked_vocab_parallel = vocab_parallel is True
    vocab_parallel = sequence_parallel if vocab_parallel is None else vocab_parallel
    layout = sequence_parallel_layout(model, expanded) if sequence_parallel else None
    # module entries whose forward takes other layouts (transformers' own classes with other placements);
    # their parameters are sharded by the plan as usual
    relaid = _relaid_styles(model, expanded, vocab_parallel=vocab_parallel, layout=layout)
    if asked_vocab_parallel and not any(expanded.get(name) == "colwise_gather_output" for name in relaid):
        # asked for by name (tp_loss_parallel true) and nothing to keep split: say so rather than run without it
        raise ValueError(
            f"tp_loss_parallel: {type(model).__name__}'s tensor-parallel plan has no LM head to keep split on the "
            "vocabulary (no module with the style colwise_gather_output); set sequence_parallel.tp_loss_parallel "
            '"auto" (or false), or pass a plan with the head'
        )
    skip = set(relaid) | (set(layout.embedding) if layout is not None else set())
    apply_tensor_parallelism(model, mesh, {k: v for k, v in expanded.items() if k not in skip | duplicates})
    modules = dict(model.named_modules())
    for name, style in relaid.items():
        style.install_forward(modules[name], mesh)
        modules[name]._is_hooked = True
    if layout is not None:
        apply_tp_sequence_parallel(model, mesh, layout)
    for names in tied:  # tie again: every holder of a tied parameter holds its one sharded copy
        first_module, _, first_param = names[0].rpartition(".")
        shared = getattr(modules[first_module], first_param)
        for name in names[1:]:
            module_name, _, param_name = name.rpartition(".")
            setattr(modules[module_name], param_name, shared)
    return expanded


def split_feature_activations(model: nn.Module, expanded: dict[str, str]) -> dict[str, str]:
    """``{name: "replicated_with_grad_allreduce"}`` for every MLP activation with learnable parameters that
    the plan leaves out: the ``act_fn`` of a module whose children ``expanded`` splits column-wise and
    row-wise (Apertus' XIELU, scalars ``alpha_p`` / ``alpha_n``). transformers' MLPs apply ``act_fn`` to the
    column-parallel projections' output, so each TP rank's gradient of its parameters covers that rank's
    features only: a partial sum, which transformers' own style sums over the TP group (as for Qwen3's
    ``q_norm``). Without it the loss was exact and ``alpha_p``'s gradient 60% off under TP 2 (fuzzer case
    880891029: tiny Apertus, with and without ``tp_sequence_parallel``)."""
    out = {}
    for name, module in model.named_modules():
        act = getattr(module, "act_fn", None)
        if not isinstance(act, nn.Module) or not any(p.requires_grad for p in act.parameters(recurse=False)):
            continue
        prefix = f"{name}." if name else ""
        styles = {expanded.get(prefix + child) for child, _ in module.named_children()}
        if "colwise" in styles and "rowwise" in styles and prefix + "act_fn" not in expanded:
            out[prefix + "act_fn"] = "replicated_with_grad_allreduce"
    return out


def feature_statistics_problem(model: nn.Module, expanded: dict[str, str]) -> str | None:
    """Why ``expanded`` (:func:`expand_tp_plan`) cannot shard ``model`` exactly, or None: a module that
    takes a statistic over the features a column-wise style splits would take it over its rank's slice only.
    Gemma 3n's MLP with activation sparsity (``Gemma3nTextMLP._gaussian_topk``: the mean and standard
    deviation of ``gate_proj``'s output over its features set the cutoff; the fuzzer's case 1320238728,
    loss 7.2e-3 off at TP 2) is the one such module among transformers' TP plans."""
    split = [name for name, module in model.named_modules()
             if (getattr(module, "activation_sparsity", 0) or 0) > 0
             and expanded.get(f"{name}.gate_proj", "").startswith("colwise")]
    if not split:
        return None
    return (f"{type(model).__name__}'s {split} take the mean and standard deviation of gate_proj's output over "
            "its features (activation sparsity), which the plan's 'colwise' gate_proj splits over the TP ranks, "
            "so each rank would set its cutoff from its own slice. Pass plan= without the mlp entries (every "
            "layer's MLP then stays replicated on the TP ranks), set config.activation_sparsity_pattern to "
            "zeros, or run tp_size 1")


def _tied_parameters(model: nn.Module) -> list[list[str]]:
    """The parameters held by more than one module (tied input / output embeddings, ``tie_word_embeddings``;
    Zamba's shared block), each as its holders' ``module.param`` names in module order: the first is the name
    ``model.named_parameters()`` keeps."""
    holders: dict[int, list[str]] = {}
    for module_name, module in model.named_modules():
        for param_name, p in module.named_parameters(recurse=False):
            holders.setdefault(id(p), []).append(f"{module_name}.{param_name}" if module_name else param_name)
    return [names for names in holders.values() if len(names) > 1]


def _check_tied_layouts(model: nn.Module, tied: list[list[str]], expanded: dict[str, str], mesh: Any) -> None:
    """Refuse a plan that would lay one tied parameter out two ways (sharded for one holder, replicated or
    sharded on another dim for the other): one parameter has one layout. Each holder's style is tried on an
    empty copy on the meta device (nothing allocated or sent), with transformers' own ``shard_param``.

    Raises:
        ValueError: naming the model, the tied names, their styles and layouts, and the fixes.
    """
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    params = dict(model.named_parameters())
    for names in tied:
        param = params[names[0]]
        layouts = {}
        for name in names:
            style = expanded.get(name)
            holder = nn.Module()
            holder.weight = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
            if style is not None:
                ALL_PARALLEL_STYLES[style].shard_param(holder, "weight", mesh)
            placements = getattr(holder.weight, "placements", None)
            layouts[name] = (style or "no style", "replicated" if placements is None else str(list(placements)))
        if len({layout for _, layout in layouts.values()}) > 1:
            described = ", ".join(f"{name}: {style} -> {layout}" for name, (style, layout) in layouts.items())
            raise ValueError(
                f"tensor parallelism: {type(model).__name__} ties {' and '.join(names)} (one parameter, e.g. "
                f"tie_word_embeddings), but its tp plan lays them out differently ({described}), and one parameter "
                "has one layout. Untie them (tie_word_embeddings=False in the config before building the model), "
                "pass plan= giving both the same layout (embedding_rowwise and colwise_gather_output both shard "
                "the vocabulary), or run tp_size 1"
            )


@dataclass(frozen=True)
class SequenceParallelLayout:
    """Where the residual stream of a decoder-only model lives, for TP sequence parallelism: module names.

    Attributes:
        embedding: the token embedding (``embedding_rowwise`` in the plan): its output is reduce-scattered
            along the sequence instead of all-reduced.
        norms: the norms on the residual stream (direct children of each decoder layer, and the final
            norm): they run on ``seq_local / tp`` tokens.
        final_norm: the last norm, whose output (a DTensor ``Shard(1)``) feeds the LM head or the tiled loss.
        regions: the decoder layers' children holding column-parallel projections (attention, MLP): their
            input is all-gathered along the sequence.
        rowwise: the row-parallel projections inside the decoder layers: their output is reduce-scattered.
    """

    embedding: list[str]
    norms: list[str]
    final_norm: str
    regions: list[str]
    rowwise: list[str]


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, nn.LayerNorm) or type(module).__name__.endswith(("RMSNorm", "LayerNorm"))


def sequence_parallel_layout(model: nn.Module, expanded: dict[str, str]) -> SequenceParallelLayout:
    """The residual stream's modules of a Llama-style decoder (embedding, ``layers.N`` blocks whose children
    are norms, attention and MLP, a final norm), from the module tree and the expanded plan.

    Raises:
        ValueError: naming what is missing (the model then cannot run with ``tp_sequence_parallel``).
    """
    from transformers.distributed.parallel_utils import replace_layer_number_by_wildcard

    modules = dict(model.named_modules())
    layers = [n for n in modules if n and replace_layer_number_by_wildcard(n).endswith("layers.*")]
    embedding = [n for n, style in expanded.items() if style == "embedding_rowwise"]
    problems = []
    if not layers:
        problems.append("no decoder layers (modules named '...layers.<n>')")
    if len([n for n in embedding if n in modules]) != 1:
        problems.append(f"the plan splits {len(embedding)} embedding entries (embedding_rowwise), expected one "
                        "module and its weight")
    norms, regions, rowwise, final = [], [], [], None
    for layer in layers:
        for child_name, child in modules[layer].named_children():
            name = f"{layer}.{child_name}"
            if _is_norm(child):
                norms.append(name)
            elif any(expanded.get(n) == "colwise" for n in modules if n.startswith(f"{name}.")):
                regions.append(name)
        rowwise += [n for n, style in expanded.items() if style == "rowwise" and n in modules
                    and n.startswith(f"{layer}.")]
    if layers:
        base = layers[0].rsplit(".", 2)[0]  # "model" of "model.layers.0"
        finals = [f"{base}.{c}" for c, m in modules[base].named_children() if _is_norm(m)]
        if len(finals) == 1:
            final = finals[0]
            norms.append(final)
        else:
            problems.append(f"{len(finals)} norms beside the decoder layers in '{base}', expected one final norm")
        if not any(n.startswith(f"{layers[0]}.") for n in norms):
            problems.append(f"no norm among the children of '{layers[0]}'")
        if not regions or not rowwise:
            problems.append(f"no column- and row-parallel projections under '{layers[0]}'")
    if problems:
        raise ValueError(
            f"tp_sequence_parallel: cannot lay out {type(model).__name__}'s residual stream along the sequence: "
            + "; ".join(problems) + ". Set sequence_parallel.tp_sequence_parallel to false (TP without it)"
        )
    assert final is not None
    return SequenceParallelLayout(embedding, norms, final, regions, rowwise)


def _relaid_styles(model: nn.Module, expanded: dict[str, str], *, vocab_parallel: bool,
                   layout: SequenceParallelLayout | None) -> dict[str, Any]:
    """Module name -> a transformers style object with other layouts than the plan's name gives."""
    from torch.distributed.tensor import Replicate, Shard
    from transformers.distributed.tensor_parallel import ColwiseParallel, RowwiseParallel

    modules = dict(model.named_modules())
    relaid: dict[str, Any] = {}
    for name, style in expanded.items():
        if name not in modules:
            continue  # a parameter entry: sharded by the plan
        if style == "colwise_gather_output" and vocab_parallel:
            # the LM head: logits stay split on the vocabulary, as a DTensor (the loss reads its layout);
            # a DTensor input (the final norm's Shard(1) under TP sequence parallelism) is all-gathered first
            relaid[name] = ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=False)
        elif layout is not None and name in layout.rowwise:
            # partial sums reduce-scattered along the sequence (not all-reduced): the residual stays split
            relaid[name] = RowwiseParallel(input_layouts=Shard(-1), output_layouts=Shard(1))
    return relaid


def apply_tp_sequence_parallel(model: nn.Module, mesh: Any, layout: SequenceParallelLayout) -> None:
    """Megatron-style sequence parallelism in the TP group (Korthikanti et al., 2022), with torch's styles.

    Between the TP regions (the residual stream: embedding output, norms, residual adds) each TP rank holds
    ``seq_local / tp`` consecutive tokens of its SP shard, ``(batch, seq_local / tp, hidden)``, instead of
    all ``seq_local`` replicated: activation memory of those tensors divided by ``tp``. Communication is
    the same volume as plain TP's all-reduces, split in two:

    - the embedding (torch's ``RowwiseParallel(output_layouts=Shard(1))``): its partial lookups are
      reduce-scattered along the sequence;
    - each norm (torch's ``SequenceParallel``): runs on the local tokens; its weight is a replicated DTensor,
      so its gradient is summed over TP (each rank saw other tokens); the final norm's output stays a
      DTensor ``Shard(1)``, which the LM head (or the tiled loss) all-gathers;
    - before each attention / MLP block: an all-gather along the sequence (backward: a reduce-scatter),
      a DTensor ``Replicate`` handed to the column-parallel projections;
    - after each row-parallel projection: a reduce-scatter along the sequence (backward: an all-gather).

    The attention in between sees the whole SP shard, ``seq_local`` tokens, so seqpar's SP attention and
    the position ids are unchanged. ``seq_local`` must be a multiple of ``tp`` (checked at the embedding).
    Called by :func:`apply_tensor_parallel` (``sequence_parallel=True``), after the plan is applied.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    modules = dict(model.named_modules())
    tp = mesh.size()
    embedding = next(n for n in layout.embedding if n in modules)

    def check_length(module: nn.Module, args: tuple[Any, ...]) -> None:
        ids = args[0] if args else None
        if ids is not None and ids.dim() >= 2 and ids.shape[1] % tp and is_probing():
            raise ValueError(
                "tp_sequence_parallel: seqpar's position-mixing probe ran the model on a sequence the TP group "
                "cannot split; call seqpar.swap.swap_attention before apply_tensor_parallel(sequence_parallel="
                "True) (seqpar.integrations.fsdp.wrap does), so the probe sees the model without TP"
            )
        if ids is not None and ids.dim() >= 2 and ids.shape[1] % tp:
            raise ValueError(
                f"tp_sequence_parallel: this rank's sequence has {ids.shape[1]} tokens, which the TP group of "
                f"{tp} cannot split evenly; pad the sequences so that every SP shard holds a multiple of "
                f"tp = {tp} tokens (the whole sequence a multiple of sp x tp, x2 under zigzag), or set "
                "tp_sequence_parallel false"
            )

    modules[embedding].register_forward_pre_hook(check_length)
    styles: dict[str, Any] = {embedding: RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))}
    for name in layout.norms:
        # the final norm's output stays a DTensor: the LM head / the tiled loss gathers it
        styles[name] = SequenceParallel(use_local_output=name != layout.final_norm)
    parallelize_module(model, mesh, styles)

    def gather_sequence(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # the block's hidden states: the first positional argument or hidden_states=
        if args:
            return (_sequence_to_replicate(args[0], mesh), *args[1:]), kwargs
        if "hidden_states" not in kwargs:
            raise ValueError(f"tp_sequence_parallel: {type(module).__name__} was called without hidden states "
                             "(a first positional argument or hidden_states=)")
        return args, {**kwargs, "hidden_states": _sequence_to_replicate(kwargs["hidden_states"], mesh)}

    for name in layout.regions:
        modules[name].register_forward_pre_hook(gather_sequence, with_kwargs=True)


def _sequence_to_replicate(x: torch.Tensor, mesh: Any) -> Any:
    """A local ``(batch, seq_local / tp, hidden)`` shard as the DTensor of the whole ``(batch, seq_local,
    hidden)``, replicated: an all-gather along the sequence whose backward reduce-scatters the partial
    input gradients of the column-parallel projections."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, [Shard(1)], run_check=False)
    return x.redistribute(placements=[Replicate()])


def clip_grad_norm(parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for gradients that are DTensors on different meshes (FSDP2 x TP:
    the TP-sharded ones on ``(dp_sp, tp)``, the replicated ones on ``dp_sp``), which torch's own refuses
    to stack. The 2-norm of each mesh's gradients (``get_total_norm``: reduced over that mesh, then a
    plain tensor by ``full_tensor``) is squared, the squares are summed, and every gradient is scaled by ``min(1, max_norm / (norm + 1e-6))``,
    as torch does, without reading the norm on the host. Returns the total norm (a plain tensor, the same on every rank)."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in parameters if p.grad is not None]
    by_mesh: dict[Any, list[torch.Tensor]] = {}
    for g in grads:
        by_mesh.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    squares = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(group)
        squares.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).float() ** 2)
    total = torch.stack(squares).sum().sqrt() if squares else torch.zeros(())
    # The coefficient stays on the device, clamped rather than compared, and every gradient is scaled
    # (by 1 when no clip is due), as torch's clip_grads_with_norm_ does: no host read of the norm, so
    # a GPU step does not wait for the device here.
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    # Scaled shard by shard (a DTensor's local tensor is a view of its data), one fused multiply per
    # (device, dtype): foreach takes like tensors, and DTensors on different meshes do not mix.
    by_kind: dict[Any, list[torch.Tensor]] = {}
    for g in grads:
        local = g.to_local() if isinstance(g, DTensor) else g
        by_kind.setdefault((local.device, local.dtype), []).append(local)
    for (device, _), group in by_kind.items():
        torch._foreach_mul_(group, coef.to(device))
    return total
