"""PyTorch FSDP (FSDP2 ``fully_shard`` and FSDP1 ``FullyShardedDataParallel``) with sequence parallelism.

Which group, and why. There is no tensor or pipeline parallelism, so every rank of the ``(dp, sp)``
grid holds a replica of the same parameters: FSDP shards parameters and reduces gradients over the
sequence-data-parallel group (all ``dp x sp`` ranks), as DeepSpeed does with seqpar's ``mpu``. The
mesh is one-dimensional over that group (:func:`build_mesh`).

Gradient scaling, worked out and checked numerically in ``tests/test_engines.py``. With
:func:`seqpar.sequence.loss.sequence_parallel_loss`, every SP rank's backward gives its *share* of the
full-sequence gradient ``g`` of its DP replica (the SP shares sum to ``g``). FSDP's default divides the
sum over its group by the group size ``W = dp x sp``::

    default:  (1/W) * sum_{d, s} share_{d,s} = (1/W) * sum_d g_d = (1/sp) * mean_d g_d   (too small)

so seqpar sets the divide factor to ``dp``, giving ``mean_d g_d``: the gradient of single-device
training on the global batch (FSDP2: ``set_gradient_divide_factor``; FSDP1: the pre/post-divide
factors of every FSDP unit). A loss whose value is averaged but whose backward is *not* a share (e.g.
each rank's local-token mean) would need a different factor: use the seqpar loss.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from seqpar.config import SeqParConfig
from seqpar.integrations.common import BlockOptions, rank_prefix, resolve_manager
from seqpar.runtime import checkpoint
from seqpar.runtime.groups import ProcessGroupManager

__all__ = [
    "FSDPOptions",
    "build_mesh",
    "wrap",
    "compile_blocks",
    "find_block_classes",
    "save_checkpoint",
    "load_checkpoint",
    "full_state_dict",
    "dtype_from_name",
    "set_fsdp1_divide_factor",
    "shard_groups",
]

logger = logging.getLogger("seqpar")

_DTYPES = {
    "fp32": torch.float32, "float32": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16,
}
# Class-name suffixes of the repeated blocks that become their own FSDP unit.
_BLOCK_SUFFIXES = ("DecoderLayer", "EncoderLayer", "Block", "TransformerBlock")


def dtype_from_name(name: str | torch.dtype | None) -> torch.dtype | None:
    """``"bf16"`` -> ``torch.bfloat16`` (also ``fp16``, ``fp32`` and the long names); None stays None."""
    if name is None or isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}: choose one of {sorted(_DTYPES)}") from None


class FSDPOptions(BlockOptions):
    """The ``"fsdp"`` section of a seqpar launcher JSON.

    Args:
        version: 2 (``fully_shard``, default) or 1 (``FullyShardedDataParallel``).
        param_dtype: compute dtype of parameters (``"bf16"``/``"fp16"``/``"fp32"``; None = as stored).
        reduce_dtype: dtype of gradient reduction (None = ``param_dtype``; ``"fp32"`` recommended).
        reshard_after_forward: free unsharded parameters after forward (ZeRO-3 like; False ~ ZeRO-2).
        wrap_classes: class names of the blocks that become FSDP units (default: found by name).
    """

    BLOCK = "fsdp"
    KEYS = ("version", "param_dtype", "reduce_dtype", "reshard_after_forward", "wrap_classes")

    def __init__(
        self,
        version: int = 2,
        param_dtype: str | None = None,
        reduce_dtype: str | None = None,
        reshard_after_forward: bool = True,
        wrap_classes: Iterable[str] | None = None,
    ) -> None:
        if version not in (1, 2):
            raise ValueError(f"fsdp.version = {version!r} is invalid: choose 1 or 2")
        self.version = version
        self.param_dtype = dtype_from_name(param_dtype)
        self.reduce_dtype = dtype_from_name(reduce_dtype)
        self.reshard_after_forward = bool(reshard_after_forward)
        self.wrap_classes = tuple(wrap_classes) if wrap_classes is not None else None


def build_mesh(manager: ProcessGroupManager, device_type: str | None = None) -> Any:
    """A 1-D ``DeviceMesh`` over the sequence-data-parallel group (all ranks of the grid).

    FSDP shards over it and reduces gradients over it; parameters are the same on every SP rank.
    With tensor parallelism: the ``"dp_sp"`` dim of ``manager.dp_sp_tp_mesh``, whose ``"tp"`` dim holds
    the TP-sharded parameters (FSDP2 + TP needs one mesh).
    """
    from torch.distributed.device_mesh import DeviceMesh

    if manager.tp_size > 1:
        return manager.dp_sp_tp_mesh["dp_sp"]

    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return DeviceMesh.from_group(manager.sp_dp_group, device_type, mesh_dim_names=("dp_sp",))


def find_block_classes(model: nn.Module, names: Iterable[str] | None = None) -> set[type[nn.Module]]:
    """Module classes to wrap as FSDP units: those named in ``names``, else the repeated blocks
    (class names ending in DecoderLayer, EncoderLayer, Block, TransformerBlock)."""
    found: set[type[nn.Module]] = set()
    wanted = set(names) if names is not None else None
    for module in model.modules():
        cls_name = type(module).__name__
        if wanted is not None:
            if cls_name in wanted:
                found.add(type(module))
        elif cls_name.endswith(_BLOCK_SUFFIXES):
            found.add(type(module))
    if wanted is not None:
        missing = wanted - {c.__name__ for c in found}
        if missing:
            raise ValueError(
                f"fsdp.wrap_classes names {sorted(missing)}, which the model does not contain; "
                f"module classes present: {sorted({type(m).__name__ for m in model.modules()})}"
            )
    return found


def wrap(
    model: nn.Module,
    config: SeqParConfig | Mapping[str, Any] | str | os.PathLike | None = None,
    *,
    manager: ProcessGroupManager | None = None,
    fsdp: FSDPOptions | Mapping[str, Any] | None = None,
    swap: bool = True,
    device: torch.device | str | None = None,
    compile: bool | Mapping[str, Any] = False,
    tp_loss_parallel: bool | str | None = None,
) -> nn.Module:
    """Swap the model's attention and shard it with FSDP over the sequence-data-parallel group (with
    ``tp_size`` > 1: first tensor parallelism from the model's own plan, :mod:`seqpar.integrations.tp`),
    then, with ``compile``, compile every block (:func:`compile_blocks`).

    Args:
        model: the model (on CPU or its device); every rank must build the same initial weights
            or FSDP1's ``sync_module_states`` / an explicit broadcast must fix them (FSDP2 keeps
            each rank's own slice of its own weights: seed the init the same on every rank).
        config: the seqpar config (object, dict, JSON path; None = defaults).
        manager: process groups (default: the default manager, made from ``config`` if needed).
        fsdp: FSDP options (see :class:`FSDPOptions`).
        swap: swap attention first (default); ``False`` when the model calls seqpar itself.
        device: FSDP1's ``device_id`` (default: the current CUDA device, else CPU).
        compile: ``True`` or ``torch.compile`` keyword arguments (``{"backend": "aot_eager"}``): each
            FSDP2 block compiled after ``fully_shard`` (:func:`compile_blocks`). FSDP2 only.
        tp_loss_parallel: the LM head's logits under TP: ``True`` split on the vocabulary (a DTensor
            ``Shard(-1)``, ``(batch, seq_local, vocab / tp)`` per rank, which seqpar's losses reduce
            vocab-parallel), ``False`` gathered (plain ``(batch, seq_local, vocab)`` on every TP rank),
            ``"auto"`` as ``tp_sequence_parallel``; ``None`` (default): the config's
            ``sequence_parallel.tp_loss_parallel``. Checked as that key is.

    Returns:
        The wrapped model: the same object for FSDP2 (now an ``FSDPModule``), an
        ``FullyShardedDataParallel`` for FSDP1. ``model.seqpar_manager`` is set on it.

    Raises:
        ConfigError / ValueError: bad config or options; seqpar.swap.SwapError from the swap.
    """
    sp_config = SeqParConfig.load(config)
    if tp_loss_parallel is not None:  # the argument overrides the key, under the key's rules
        sp_config = dataclasses.replace(sp_config, tp_loss_parallel=tp_loss_parallel)
    opts = fsdp if isinstance(fsdp, FSDPOptions) else FSDPOptions.from_dict(fsdp)
    manager = resolve_manager(sp_config, manager)
    if compile is not False and opts.version != 2:
        raise ValueError(f"compile= compiles FSDP2 blocks (torchtitan's per-block compile); fsdp.version is "
                         f"{opts.version}: set it to 2, or compile the FSDP1 model yourself")
    if manager.tp_size > 1 and opts.version != 2:
        raise ValueError(f"tensor parallelism (tp_size {manager.tp_size}) needs FSDP2 (DTensor parameters): "
                         f"set fsdp.version = 2 (got {opts.version})")
    if swap and sp_config.swap != "none":
        from seqpar.swap import swap_attention

        # before TP: the swap's position-mixing probe runs the whole model on 13 tokens, which TP sequence
        # parallelism could not split over the TP group
        swap_attention(model, sp_config, group=manager.sp_group)  # logs what it swapped
    if manager.tp_size > 1:  # tensor parallelism from the model's own plan, before FSDP2 shards over dp x sp
        from seqpar.integrations.tp import apply_tensor_parallel

        loss_parallel = sp_config.tp_loss_parallel
        apply_tensor_parallel(model, manager, sequence_parallel=sp_config.tp_sequence_parallel,
                              vocab_parallel=None if loss_parallel == "auto" else loss_parallel)
    if sp_config.apex:
        from seqpar.integrations.apex import apply_fused_norms

        apply_fused_norms(model)
    block_classes = find_block_classes(model, opts.wrap_classes)
    if opts.version == 2:
        wrapped = _wrap_fsdp2(model, manager, opts, block_classes)
    else:
        wrapped = _wrap_fsdp1(model, manager, opts, block_classes, device)
    wrapped.seqpar_manager = manager  # type: ignore[assignment]
    if compile is not False:
        compile_blocks(wrapped, block_classes, **({} if compile is True else dict(compile)))
    logger.info(
        "%s seqpar: FSDP%d over %d ranks (dp %d x sp %d), %d block class(es) wrapped, "
        "gradient divide factor %d",
        rank_prefix(), opts.version, manager.world_size, manager.dp_size, manager.sp_size,
        len(block_classes), manager.dp_size,
    )
    return wrapped


def _wrap_fsdp2(
    model: nn.Module,
    manager: ProcessGroupManager,
    opts: FSDPOptions,
    block_classes: set[type[nn.Module]],
) -> nn.Module:
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mesh = build_mesh(manager)
    mp = MixedPrecisionPolicy(param_dtype=opts.param_dtype, reduce_dtype=opts.reduce_dtype)
    kw: dict[str, Any] = {"mesh": mesh, "mp_policy": mp}
    # Innermost first: a block class can nest inside another (MiniMax's and Mixtral's SparseMoeBlock inside
    # the decoder layer, RecurrentGemma's RecurrentBlock), and sharding the outer one first would leave the
    # inner one's parameters DTensors already, which fully_shard then mistakes for tensor-parallel ones.
    blocks = [m for m in reversed(list(model.modules())) if type(m) in block_classes]
    for group in shard_groups(model, blocks):
        fully_shard(group if len(group) > 1 else group[0], reshard_after_forward=opts.reshard_after_forward, **kw)
    fully_shard(model, **kw)
    if _is_peft_model(model):
        # PeftModel.generate calls its base model's generate, which calls the base model, never the PeftModel: the
        # root's FSDP2 hooks (its lazy init, the all-gather of the root's own parameters: embeddings, final norm,
        # LM head) would not run, so generation met sharded DTensors ("aten.embedding.default got mixed
        # torch.Tensor and DTensor", GRPO's generation, fuzzer case 1720900617), and the first block called would
        # have made itself FSDP2's root. FSDP2's own hook for that: run generate as a forward of the root.
        from torch.distributed.fsdp import register_fsdp_forward_method

        register_fsdp_forward_method(model, "generate")
    # gloo has no AVG / PREMUL_SUM reduce ops: reduce with SUM and divide afterwards.
    force_sum = dist.get_backend(manager.sp_dp_group) == "gloo"
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(float(manager.dp_size))
            if force_sum:
                module.set_force_sum_reduction_for_comms(True)
    return model


def _is_peft_model(model: nn.Module) -> bool:
    """Whether ``model`` is a ``peft.PeftModel`` (False without peft installed)."""
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def shard_groups(model: nn.Module, blocks: list[nn.Module]) -> list[list[nn.Module]]:
    """``blocks`` (innermost first) as FSDP2 units: blocks that share parameters go into one unit, and a unit
    whose parameters a module outside it also holds is left to the enclosing unit (the root at the latest).

    Why: FSDP2 manages each parameter in exactly one group. Zamba's hybrid layers each hold their own
    ``shared_transf`` module whose parameters are tied (the same ``nn.Parameter`` objects) across the
    layers; one ``fully_shard`` per block would shard them twice (torch raises "is shared with a parameter
    already managed by another FSDP group" at the first forward). torch's answer is one
    ``fully_shard([module_a, module_b])`` over the modules that share them: one all-gather before the first
    of them runs, one reshard after the last, one reduce-scatter of the summed gradient. A parameter also
    held outside the blocks (tied to a non-block module) can only be managed by a unit that covers both
    holders, so such blocks stay in the enclosing unit.

    Returns:
        The units, innermost first; each a list of modules (one for an ordinary block), in model order.
    """
    order = {id(m): i for i, m in enumerate(model.modules())}
    holders: dict[int, set[int]] = {}  # parameter id -> ids of the modules holding it directly
    held: dict[int, list[int]] = {}  # module id -> ids of the parameters it holds directly
    for module in model.modules():
        for p in module.parameters(recurse=False):
            holders.setdefault(id(p), set()).add(id(module))
            held.setdefault(id(module), []).append(id(p))
    sharded = list(blocks)
    while True:  # dropping a unit hands its parameters to the enclosing one: repeat until none is dropped
        # union of the blocks that share a parameter (a block's own, not those of units nested in it)
        unit_ids = {id(b) for b in sharded}
        nested = {id(m) for b in sharded for m in b.modules() if m is not b and id(m) in unit_ids}
        parent = list(range(len(sharded)))

        owned = [_unit_modules(b, nested) for b in sharded]
        first: dict[int, int] = {}
        for i, mods in enumerate(owned):
            for p_id in (p_id for m in mods for p_id in held.get(m, ())):
                j = first.setdefault(p_id, i)
                parent[_root(parent, i)] = _root(parent, j)
        units: dict[int, list[int]] = {}
        for i in range(len(sharded)):
            units.setdefault(_root(parent, i), []).append(i)
        dropped = set()
        for members in units.values():
            mods = set().union(*(owned[i] for i in members))
            if any(not holders[p_id] <= mods for m in mods for p_id in held.get(m, ())):
                dropped.update(members)
        if not dropped:
            break
        for i in sorted(dropped):
            logger.info("%s seqpar: FSDP2 leaves %s to its enclosing unit: it shares parameters with a module "
                        "outside it", rank_prefix(), type(sharded[i]).__name__)
        sharded = [b for i, b in enumerate(sharded) if i not in dropped]
    groups = [sorted((sharded[i] for i in members), key=lambda m: order[id(m)]) for members in units.values()]
    # innermost first, as ``blocks``: by each unit's position in ``blocks`` (its first member there)
    position = {id(b): i for i, b in enumerate(blocks)}
    return sorted(groups, key=lambda g: min(position[id(m)] for m in g))


def _root(parent: list[int], i: int) -> int:
    """The representative of ``i`` in the union-find forest ``parent``."""
    while parent[i] != i:
        parent[i] = parent[parent[i]]
        i = parent[i]
    return i


def _unit_modules(block: nn.Module, nested: set[int]) -> set[int]:
    """ids of the modules whose parameters ``block``'s unit manages: its subtree less the units nested in it."""
    out: set[int] = set()
    stack = [block]
    while stack:
        m = stack.pop()
        out.add(id(m))
        stack += [c for c in m.children() if id(c) not in nested]
    return out


def compile_blocks(model: nn.Module, block_classes: Iterable[type[nn.Module]] | None = None,
                   **compile_kwargs: Any) -> list[str]:
    """torchtitan's per-block compile: each outermost block of ``model`` (of ``block_classes``, default
    :func:`find_block_classes`) compiled in place with ``module.compile(fullgraph=True, **compile_kwargs)``.

    Call it after ``fully_shard`` (:func:`wrap` with ``compile=`` does). In place, so each block keeps its
    name, its state-dict keys and FSDP2's hooks, which dynamo traces with the block (accelerate's
    ``compile_regions_fsdp2`` does the same). The model's own forward, with the swapped model's per-batch
    preparation in its pre-hooks (cross-rank checks, the boundaries' host read), stays eager; each
    block is one graph with seqpar's attention in it (``fullgraph=True`` by default: a graph break in
    a block is an error, not a silent slowdown). A block nested in another (an MoE block in a decoder
    layer) is compiled with its outer one.

    Returns:
        The compiled blocks' qualified names, in model order.
    """
    classes = tuple(block_classes) if block_classes is not None else tuple(find_block_classes(model))
    kwargs = {"fullgraph": True, **compile_kwargs}
    compiled: list[str] = []
    for name, module in model.named_modules():
        # isinstance: fully_shard gives each block a subclass of its own (FSDPLlamaDecoderLayer)
        if isinstance(module, classes) and not any(name.startswith(f"{outer}.") for outer in compiled):
            module.compile(**kwargs)
            compiled.append(name)
    if not compiled:
        raise ValueError(f"compile_blocks: no block of {sorted(c.__name__ for c in classes)} in "
                         f"{type(model).__name__}; name the blocks to compile (fsdp.wrap_classes)")
    logger.info("%s seqpar: compiled %d block(s) (%s)", rank_prefix(), len(compiled), kwargs)
    return compiled


def _wrap_fsdp1(
    model: nn.Module,
    manager: ProcessGroupManager,
    opts: FSDPOptions,
    block_classes: set[type[nn.Module]],
    device: torch.device | str | None,
) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    mixed = None
    if opts.param_dtype is not None or opts.reduce_dtype is not None:
        mixed = MixedPrecision(
            param_dtype=opts.param_dtype,
            reduce_dtype=opts.reduce_dtype or opts.param_dtype,
            buffer_dtype=opts.param_dtype,
        )
    wrapped = FSDP(
        model,
        process_group=manager.sp_dp_group,
        auto_wrap_policy=ModuleWrapPolicy(block_classes) if block_classes else None,
        sharding_strategy=(
            ShardingStrategy.FULL_SHARD if opts.reshard_after_forward else ShardingStrategy.SHARD_GRAD_OP
        ),
        mixed_precision=mixed,
        device_id=torch.device(device),
        use_orig_params=True,
        sync_module_states=torch.device(device).type != "cpu",  # CPU: needs identical init
    )
    set_fsdp1_divide_factor(wrapped, manager.dp_size)
    return wrapped


def set_fsdp1_divide_factor(model: nn.Module, factor: int) -> None:
    """Make every FSDP1 unit in ``model`` divide reduced gradients by ``factor`` in total.

    FSDP1 splits its division into a pre-divide (before the reduction, to avoid fp16 overflow) and a
    post-divide whose product is the group size; split ``factor`` the same way instead.
    """
    from torch.distributed.algorithms._comm_hooks import default_hooks
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    # FSDP1 only divides by factors > 1, so split ``factor`` itself (pre <= post, both >= 1).
    pre = default_hooks.DefaultState._get_gradient_predivide_factor(factor)
    for unit in model.modules():
        if isinstance(unit, FSDP):
            unit._gradient_predivide_factor = pre
            unit._gradient_postdivide_factor = factor / pre


# ---------------------------------------------------------------------------- checkpoints
def save_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: Mapping[str, Any] | None = None,
) -> None:
    """Save model and optimizer with ``torch.distributed.checkpoint`` (each rank writes its shards) into
    the directory ``path``: :func:`seqpar.runtime.checkpoint.write_dcp` (and
    :func:`seqpar.runtime.checkpoint.save_dcp` for the atomic ``step<N>`` protocol).

    Collective. ``extra`` (small, picklable, the same on every rank) is stored beside them.
    """
    checkpoint.write_dcp(path, model, optimizer, extra)


def load_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
) -> dict[str, Any]:
    """Load what :func:`save_checkpoint` wrote, in place; returns its ``extra`` dict (or ``{}``).

    Collective. The layout may differ from the one that saved: world size, SP size, TP size (DCP
    reshards; :func:`seqpar.runtime.checkpoint.read_dcp`).
    """
    return checkpoint.read_dcp(path, model, optimizer)


def full_state_dict(model: nn.Module, every_rank: bool = False) -> dict[str, torch.Tensor]:
    """The whole (unsharded) state dict of an FSDP2 / FSDP1 model on the CPU, on rank 0 (``every_rank``: on every
    rank, each holding a full copy on its device until moved); ``{}`` on the other ranks.

    Collective: every rank calls it (each shard is gathered). Keys are the model's own (``model.state_dict()``'s,
    a PeftModel's with its frozen base), values plain tensors, so ``save_pretrained(state_dict=...)`` and
    safetensors can write them (the model's own ``state_dict()`` holds FSDP2 DTensors, which they cannot).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if not every_rank:
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
