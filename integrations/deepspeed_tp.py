"""DeepSpeed AutoTP under sequence parallelism: what :func:`seqpar.integrations.deepspeed.initialize` checks, refuses
and fixes when ``sequence_parallel.tp_size`` > 1 (``"tensor_parallel": {"autotp_size": N}``).

DeepSpeed 0.19.8's AutoTP replaces every ``nn.Linear`` it splits by its own layers and, under AutoTP, its own groups
replace the ``mpu``. This module owns what that means for seqpar, one function per step, each called by
``initialize`` on every rank alike (every rank holds the same model and config, so a refusal raises everywhere):

- the groups: DeepSpeed's TP group must be seqpar's and its DP group seqpar's SP-DP group
  (:func:`check_autotp_groups`), and its loader samples over the DP axis only (:func:`dp_axis_loader`);
- the vocabulary-split LM head (``tensor_parallel.vocab_parallel_lm_head``): seqpar's loss put back, vocab-parallel
  over TP and token-weighted over SP x DP (:class:`SplitHeadLoss`, :func:`seqpar_loss_on_split_head`), the head's
  width where a model reads it (:func:`complete_split_head`); what that head cannot honour is refused by name
  (:func:`refuse_tiled_loss_on_split_head` where the head is split without ``vocab_parallel_lm_head``; under ZeRO-3
  it has the split head's weight gathered for the tiled loss, :func:`gather_split_head_for_tiled_loss`),
  :func:`refuse_z_loss_on_split_head`, and before any engine
  :func:`refuse_unsplittable_tied_embedding`);
- what AutoTP itself trains wrong, refused by name: a model type (:func:`refuse_autotp_model_type`), a split
  activation-sparse gate (:func:`refuse_split_sparse_gate`), parameters it dropped
  (:func:`refuse_parameters_autotp_dropped`), parameters it keeps whole on split features without summing their
  gradients (:func:`refuse_unreduced_parameters_on_split_features`), except the MLP activations' own parameters,
  whose gradients are summed over TP here (:func:`sum_split_activation_gradients`).

Functions whose name ends in ``_rows`` snapshot the model before ``deepspeed.initialize`` for a check after it.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from seqpar.config import ConfigError
from seqpar.integrations.common import rank_prefix

__all__ = [
    "SplitHeadLoss",
    "check_autotp_groups",
    "complete_split_head",
    "dp_axis_loader",
    "gather_split_head_for_tiled_loss",
    "lm_head_rows",
    "refuse_autotp_model_type",
    "refuse_parameters_autotp_dropped",
    "refuse_split_sparse_gate",
    "refuse_tiled_loss_on_split_head",
    "refuse_unreduced_parameters_on_split_features",
    "refuse_unsplittable_tied_embedding",
    "refuse_z_loss_on_split_head",
    "seqpar_loss_on_split_head",
    "sparse_gate_rows",
    "sum_split_activation_gradients",
]

logger = logging.getLogger("seqpar")


def check_autotp_groups(engine: Any, manager: Any) -> None:
    """Under AutoTP DeepSpeed uses its own groups (``deepspeed.utils.groups``), not the mpu: its TP group
    must be seqpar's and its DP group (where ZeRO partitions and reduces) seqpar's SP-DP group, so
    that each SP group lies inside it. Decided on every rank together (one all-reduce), so a layout
    that matches on some ranks only raises everywhere instead of hanging the others."""
    import torch.distributed as dist
    from deepspeed.utils import groups

    ds_tp = dist.get_process_group_ranks(groups.get_tensor_model_parallel_group())
    ds_dp = dist.get_process_group_ranks(engine.seq_data_parallel_group)
    sp_dp = dist.get_process_group_ranks(manager.sp_dp_group)
    mine = (sorted(ds_tp) == sorted(manager.tp_ranks) and sorted(ds_dp) == sorted(sp_dp)
            and set(manager.sp_ranks) <= set(ds_dp) and engine.seq_dp_world_size == manager.dp_size * manager.sp_size)
    from deepspeed.accelerator import get_accelerator

    # on the device the world's backend reduces on (NCCL: the rank's GPU; gloo: the CPU)
    ok = torch.tensor([int(mine)], dtype=torch.int64, device=get_accelerator().current_device_name())
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if not ok.item():
        raise RuntimeError(
            f"DeepSpeed AutoTP's groups are not seqpar's (rank {manager.rank}: DeepSpeed TP group {sorted(ds_tp)} "
            f"vs seqpar's {sorted(manager.tp_ranks)}, DeepSpeed DP group {sorted(ds_dp)} vs seqpar's SP-DP group "
            f"{sorted(sp_dp)}). DeepSpeed puts TP on consecutive ranks: build the manager with TP innermost "
            "(init_process_groups(config=...) does; a user mesh needs its 'tp' dim last), and do not create "
            "DeepSpeed's TP groups before seqpar.integrations.deepspeed.initialize"
        )


def lm_head_rows(model: torch.nn.Module) -> dict[str, int]:
    """The output rows (vocabulary) of every ``lm_head`` weight in ``model``, by the owning module's name (ZeRO-3's
    partitioned parameters by their full ``ds_shape``)."""
    rows = {}
    for name, module in model.named_modules():
        weight = getattr(getattr(module, "lm_head", None), "weight", None)
        if isinstance(weight, torch.Tensor):
            rows[name] = int(getattr(weight, "ds_shape", weight.shape)[0])
    return rows


def refuse_tiled_loss_on_split_head(model: torch.nn.Module, before: dict[str, int]) -> None:
    """Refuse ``tiled_loss`` where DeepSpeed's AutoTP split an LM head over the vocabulary in a way the tiled loss
    cannot follow (``before``: the head rows before ``deepspeed.initialize``; empty when there is nothing to check).
    The tiled loss computes the logits from ``lm_head.weight`` itself, which AutoTP replaced by this TP rank's slice
    of the vocabulary (a plain tensor, unlike FSDP2's TP, whose DTensor weight the tiled loss reduces vocab-parallel).

    - ``vocab_parallel_lm_head: true`` (a ``VocabParallelLinear``): exact, not refused. :func:`complete_split_head`
      attaches where the rows sit (``seqpar_vocab_split``), and the tiled loss is vocab-parallel over TP with the
      hidden states' gradient summed over TP (:func:`seqpar.memory.tiling.tiled_lm_loss`). Under ZeRO-3 the tiled
      loss reads the head's partitioned weight outside the head's forward: it is registered for the causal LM's
      forward and backward (:func:`gather_split_head_for_tiled_loss`), exact too.
    - any other split head: each rank's loss would be over its own slice, silently wrong (fuzzer case 756378705: the
      loss 13% off); refused.

    A head AutoTP keeps whole (a tied embedding) is exact and not refused. Every TP rank splits alike, so every rank
    raises."""
    try:
        from deepspeed.module_inject.layers import VocabParallelLinear
    except ImportError:  # a DeepSpeed without a vocabulary-parallel head
        VocabParallelLinear = ()  # noqa: N806
    after = lm_head_rows(model)
    modules = dict(model.named_modules())
    for name, rows in before.items():
        where = f"{name}.lm_head" if name else "lm_head"
        head = getattr(modules.get(name), "lm_head", None)
        if isinstance(head, VocabParallelLinear):
            # vocab-parallel: complete_split_head describes the slice, the tiled loss reduces over TP
            if hasattr(head.weight, "ds_id"):  # ZeRO-3's partitioned parameter
                gather_split_head_for_tiled_loss(modules[name], head)
            continue
        if after.get(name, rows) == rows:
            continue
        raise ConfigError(
            f"sequence_parallel.tiled_loss computes the logits from the LM head's weight, which DeepSpeed AutoTP "
            f"split over the vocabulary ({where}: {after[name]} of its {rows} rows on this TP rank), so the loss "
            "would cover this rank's slice of the vocabulary only. Set tiled_loss false, tp_size 1, or "
            "tensor_parallel.vocab_parallel_lm_head true (the tiled loss is then vocab-parallel), or use FSDP2's "
            "tensor parallelism (seqpar.integrations.fsdp.wrap)"
        )


def gather_split_head_for_tiled_loss(owner: torch.nn.Module, head: torch.nn.Module) -> None:
    """Under ZeRO-3, have DeepSpeed gather the split head's weight for ``owner``'s forward and backward: ``owner``
    (the causal LM) runs the tiled loss, which reads ``head.weight`` (this TP rank's rows, partitioned over ZeRO's
    DP group) outside the head's own forward, where ZeRO-3 would hand it over empty.

    DeepSpeed's own mechanism for a parameter read outside its module, ``deepspeed.zero.register_external_parameter``:
    ``owner``'s forward pre-hook then gathers the weight with ``owner``'s own parameters and keeps it while ``owner``
    is active (a tied embedding's release inside the decoder does not drop it); its pre-backward hook (on the loss)
    gathers it again before the tiled loss's backward, which recomputes every tile from it. The tiled loss keeps the
    weight as the ``Parameter`` itself, not a saved tensor, so the backward reads the refilled storage, and returns
    the whole slice's gradient once, to the parameter's own accumulator, where ZeRO-3's hook reduce-scatters it into
    its partitioned gradient as for any parameter. (``GatheredParameters(modifier_rank=None)`` around the read alone
    would release it at the forward's end; the backward needs it again.) DeepSpeed 0.19.8 also discovers such a read
    by itself during a forward (its ``ZeROOrderedDict`` getter registers the parameter with the module then running:
    checked, the ZeRO-3 test passes without this call, and with forward-only ``GatheredParameters`` hooks, by that
    discovery); registering it explicitly, DeepSpeed's documented way, does not depend on that."""
    from deepspeed.runtime.zero import register_external_parameter

    register_external_parameter(owner, head.weight)
    logger.info("%s seqpar: ZeRO-3 gathers the vocabulary-split LM head's weight for %s's forward and backward "
                "(the tiled loss reads it there)", rank_prefix(), type(owner).__name__)


class SplitHeadLoss:
    """The ``loss_function`` of a model whose LM head DeepSpeed AutoTP split over the vocabulary, under SP > 1:
    seqpar's loss (``loss``, the swap's :class:`~seqpar.swap.hf_loss.SequenceParallelLMLoss`) on this TP rank's
    logits ``(batch, seq_local, vocab_local)``, passed as a :class:`~seqpar.sequence.vocab_parallel.VocabSlicedLogits`
    (columns ``[vocab_start, vocab_start + vocab_local)`` of ``vocab_size``, split over ``group``)."""

    def __init__(self, loss: Any, group: Any, vocab_start: int, vocab_size: int) -> None:
        self.loss, self.group, self.vocab_start, self.vocab_size = loss, group, vocab_start, vocab_size

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor | None = None, vocab_size: int | None = None,
                 **kwargs: Any) -> torch.Tensor:
        from seqpar.sequence.vocab_parallel import VocabSlicedLogits

        sliced = VocabSlicedLogits(logits, self.group, self.vocab_start, self.vocab_size)
        return self.loss(sliced, labels, vocab_size=vocab_size, **kwargs)


def seqpar_loss_on_split_head(model: torch.nn.Module, manager: Any) -> None:
    """Under AutoTP x SP > 1, make the loss of a head DeepSpeed split over the vocabulary seqpar's, exact.

    With ``tensor_parallel.vocab_parallel_lm_head`` (``true``, or DeepSpeed's default ``None`` for a tied head whose
    transformers tp plan has ``embedding_rowwise``, which :func:`seqpar.integrations.deepspeed.initialize` turns to ``false`` under SP) DeepSpeed
    0.19.8 replaces the head by a ``VocabParallelLinear`` whose output is this TP rank's slice of the logits
    (``(batch, seq_local, vocab_local)``, no gather; the head's input gradient is all-reduced over TP by its
    column-parallel backward) and the model's ``loss_function`` by its ``VocabParallelCausalLMLoss`` built with
    ``sp_group=None``, the mean over this rank's sequence shard only (fuzzer case 222158336: each SP rank's loss its
    own shard's mean, silently wrong). Here ``loss_function`` becomes seqpar's loss again (DeepSpeed kept it as
    ``_deepspeed_original_loss_function``), given the slice with its place in the vocabulary
    (:class:`SplitHeadLoss`): the cross-entropy is vocab-parallel over the TP group, the mean token-weighted over
    the SP group, so no rank holds ``(seq_local, vocab)`` logits. Nothing changes at SP 1 (DeepSpeed's loss is then
    exact) or with the head whole.

    Raises:
        ConfigError: (on every rank alike: the model and config are) the model's loss was not seqpar's token loss
            before DeepSpeed replaced it (``swap=False``, or a loss that is not a mean over tokens).
    """
    if manager.sp_size == 1 or manager.tp_size == 1:
        return
    try:
        from deepspeed.module_inject.layers import VocabParallelLinear
    except ImportError:  # a DeepSpeed without a vocabulary-parallel head
        return
    heads = [(name, m) for name, m in model.named_modules() if isinstance(m, VocabParallelLinear)]
    if not heads:
        return
    from seqpar.swap.hf_loss import TOKEN_LOSSES, SequenceParallelLMLoss

    name, head = heads[0]  # DeepSpeed refuses more than one
    original = getattr(model, "_deepspeed_original_loss_function", None)
    if not isinstance(original, SequenceParallelLMLoss) or original.loss_type not in TOKEN_LOSSES:
        raise ConfigError(
            f"DeepSpeed AutoTP split the LM head '{name}' over the vocabulary (tensor_parallel.vocab_parallel_lm_head) "
            f"and replaced the model's loss_function by its VocabParallelCausalLMLoss, which averages over this rank's "
            f"sequence shard only; seqpar puts its own sequence-parallel loss back, but the model's loss before was "
            f"{type(original).__name__}, not seqpar's token loss (initialize(swap=False), or a loss that is no mean "
            "over tokens). Set tensor_parallel.vocab_parallel_lm_head false, or let initialize swap the model"
        )
    model.loss_function = SplitHeadLoss(original, head.mp_group, int(head.vocab_start_index), int(head.vocab_size))
    logger.info("%s seqpar: DeepSpeed AutoTP split %s over the vocabulary (columns %d-%d of %d here): the loss is "
                "seqpar's, vocab-parallel over TP", rank_prefix(), name or "lm_head", head.vocab_start_index,
                head.vocab_end_index, head.vocab_size)


def refuse_unsplittable_tied_embedding(model: torch.nn.Module, ds_config: dict[str, Any]) -> None:
    """Refuse, before any engine, ``tensor_parallel.vocab_parallel_lm_head: true`` on a model whose LM head is tied to
    an input embedding DeepSpeed cannot split: DeepSpeed 0.19.8 splits the tied embedding with the head
    (``VocabParallelEmbedding``), whose lookup is ``nn.Embedding``'s alone, so a custom embedding ``forward`` (the
    Gemma family's ``*ScaledWordEmbedding``, which multiplies by ``sqrt(hidden)``; Gemma 3's aside, which DeepSpeed
    handles) would be lost; DeepSpeed itself raises ``NotImplementedError`` inside ``deepspeed.initialize`` without
    saying what to set (fuzzer case 491650326 of seed 952; gemma, gemma2, gemma3n_text, vaultgemma). Asked of
    DeepSpeed's own check (``VocabParallelEmbedding.validate_embedding``). Every rank holds the same model and
    config, so every rank raises. Nothing is checked when the key is unset or false (DeepSpeed's own choice for a
    tied head then falls back to a whole head on this error)."""
    if (ds_config.get("tensor_parallel") or {}).get("vocab_parallel_lm_head") is not True:
        return
    try:
        from deepspeed.module_inject.layers import VocabParallelEmbedding
    except ImportError:  # a DeepSpeed without a vocabulary-parallel head
        return
    outputs, inputs = getattr(model, "get_output_embeddings", None), getattr(model, "get_input_embeddings", None)
    head = outputs() if callable(outputs) else None
    embedding = inputs() if callable(inputs) else None
    if head is None or embedding is None or getattr(head, "weight", None) is not getattr(embedding, "weight", 1):
        return
    try:
        VocabParallelEmbedding.validate_embedding(embedding)
    except NotImplementedError as e:
        model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        raise ConfigError(
            f"tensor_parallel.vocab_parallel_lm_head is true, but {model_type}'s LM head is tied to its input "
            f"embedding {type(embedding).__name__}, which DeepSpeed AutoTP would split over the vocabulary with the "
            f"head and cannot: {e} (its lookup is nn.Embedding's alone, so the embedding's own forward, e.g. a "
            "scale, would be lost). Set tensor_parallel.vocab_parallel_lm_head false (the head stays whole; "
            "seqpar's loss is exact)"
        ) from None


def complete_split_head(model: torch.nn.Module) -> list[str]:
    """Give every LM head DeepSpeed AutoTP split over the vocabulary (``VocabParallelLinear``) ``nn.Linear``'s
    ``in_features`` / ``out_features``, the whole head's (``out_features`` = the whole vocabulary), where it has none;
    returns the heads' names. DeepSpeed 0.19.8's layer keeps neither, and a causal LM that reads its head's width
    fails in its first forward: Apertus 1.5 passes ``vocab_size=self.lm_head.out_features`` to ``loss_function``
    (``AttributeError``, fuzzer case 60306700 of seed 951). That width is the vocabulary of the logits the loss
    covers (:class:`SplitHeadLoss` under SP, DeepSpeed's ``VocabParallelCausalLMLoss`` at SP 1, each across the TP
    slices; DeepSpeed's compares it with its own global vocabulary), so the whole head's is the honest value. Each
    such head also gets ``seqpar_vocab_split`` (:class:`~seqpar.sequence.vocab_parallel.VocabSplitHead`: its TP
    group, first row, vocabulary and largest slice), which the tiled loss reads to be vocab-parallel."""
    try:
        from deepspeed.module_inject.layers import VocabParallelLinear
    except ImportError:  # a DeepSpeed without a vocabulary-parallel head
        return []
    from seqpar.sequence.vocab_parallel import VocabSplitHead

    named = []
    for name, head in model.named_modules():
        if not isinstance(head, VocabParallelLinear):
            continue
        if not hasattr(head, "out_features"):
            rows, columns = (int(n) for n in head._orig_weight_shape)
            head.in_features, head.out_features = columns, rows
            named.append(name)
        # where this rank's rows sit, for the tiled loss (which reads the weight, not the head's output); DeepSpeed's
        # partition sizes are the same list on every TP rank, so the largest slice is too
        head.seqpar_vocab_split = VocabSplitHead(head.mp_group, int(head.vocab_start_index), int(head.vocab_size),
                                                 max(int(n) for n in head._partition_sizes))
    return named


def sparse_gate_rows(model: torch.nn.Module) -> dict[str, int]:
    """The ``gate_proj`` output rows of every module with activation sparsity (Gemma 3n's MLPs), by name."""
    rows = {}
    for name, module in model.named_modules():
        weight = getattr(getattr(module, "gate_proj", None), "weight", None)
        if (getattr(module, "activation_sparsity", 0) or 0) > 0 and isinstance(weight, torch.Tensor):
            rows[name] = int(getattr(weight, "ds_shape", weight.shape)[0])
    return rows


def refuse_split_sparse_gate(model: torch.nn.Module, before: dict[str, int]) -> None:
    """Refuse an activation-sparse MLP whose ``gate_proj`` AutoTP split over its output features (``before``: the
    rows before ``deepspeed.initialize``). Its cutoff is the mean and standard deviation of ``gate_proj``'s output
    over those features, so each TP rank would set it from its own slice: silently wrong (fuzzer case 1709044604,
    tiny gemma3n_text, AutoTP 2 x SP 2: the loss 5.5e-3 off), as under FSDP2's TP, which refuses it the same
    (``seqpar.integrations.tp``). Every TP rank splits alike, so every rank raises."""
    after = sparse_gate_rows(model)
    split = [name for name, rows in before.items() if after.get(name, rows) != rows]
    if split:
        raise ConfigError(
            f"{type(model).__name__}'s {split} take the mean and standard deviation of gate_proj's output over its "
            "features (activation sparsity), which DeepSpeed AutoTP split over the TP ranks, so each rank would set "
            "its cutoff from its own slice. Set config.activation_sparsity_pattern to zeros, keep the MLPs whole "
            "(tensor_parallel.partition_config without them), or run tp_size 1"
        )


def refuse_autotp_model_type(model: torch.nn.Module, manager: Any) -> None:
    """Refuse, before any engine, a model type DeepSpeed's AutoTP trains wrong by itself. CodeGen: AutoTP splits its
    fused ``qkv_proj`` (the ``codegentype`` layout of ``deepspeed.module_inject.fusedqkv_utils``, four interleaved
    blocks) and the loss is wrong without seqpar (DeepSpeed 0.19.8, plain ``deepspeed.initialize``,
    ``autotp_size`` 2, ZeRO-1, tiny CodeGen in float64 on 2 gloo ranks: 7% off one process; fuzzer case 292734181
    under seqpar at SP 1, ZeRO-2 and -3: 12%). Every rank holds the same model, so every rank raises."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if manager.tp_size > 1 and model_type == "codegen":
        raise ConfigError(
            f"DeepSpeed AutoTP trains {type(model).__name__} wrong by itself: its split of CodeGen's fused qkv_proj "
            "gives a loss several percent off one process's (DeepSpeed 0.19.8, without seqpar too). Run tp_size 1 "
            "(sequence parallelism alone) for CodeGen"
        )


def refuse_z_loss_on_split_head(model: torch.nn.Module) -> None:
    """Refuse a z-loss (``z_loss_coefficient`` > 0: Bamba's ``mean(logsumexp(logits) ** 2)``, added inside the model's
    forward, outside ``loss_function``) on an LM head DeepSpeed AutoTP split over the vocabulary: the logsumexp is
    then over this TP rank's slice only, silently wrong at any SP size (fuzzer case 1297835562, tiny Bamba, TP 2 x
    SP 1: the loss 8% off; plain DeepSpeed without seqpar: 8.22 one process, 7.56 and 7.54 on the TP ranks).
    Every TP rank splits alike, so every rank raises."""
    try:
        from deepspeed.module_inject.layers import VocabParallelLinear
    except ImportError:  # a DeepSpeed without a vocabulary-parallel head
        return
    if not any(isinstance(m, VocabParallelLinear) for m in model.modules()):
        return
    coefs = sorted({c for m in model.modules() if (c := getattr(m, "z_loss_coefficient", 0) or 0) > 0})
    if coefs:
        raise ConfigError(
            f"{type(model).__name__} adds a z-loss (z_loss_coefficient={coefs[0]}, the logsumexp of the logits over "
            "the vocabulary) inside its forward, and DeepSpeed AutoTP split the LM head over the vocabulary "
            "(tensor_parallel.vocab_parallel_lm_head), so each TP rank would take it over its own slice. Set "
            "vocab_parallel_lm_head false, or z_loss_coefficient 0"
        )


def refuse_parameters_autotp_dropped(model: torch.nn.Module, before: list[str]) -> None:
    """Refuse a model some of whose parameters DeepSpeed's AutoTP dropped (``before``: the parameter names before
    ``deepspeed.initialize``; empty when there is nothing to check). AutoTP replaces each ``nn.Linear`` it splits,
    a subclass included, by its own layer, which keeps ``weight`` and ``bias`` and loses the subclass's own
    parameters and ``forward``: Dory's ``DoryLMHead`` (a Linear scaling its logits by a trained ``logit_scale``)
    becomes a plain ``LinearLayer``, so the scale is neither applied nor trained, silently (fuzzer case 543632810:
    ``lm_head.logit_scale`` without a gradient; with a trained scale the loss 1.5% off, DeepSpeed 0.19.8's own
    without seqpar: plain ``deepspeed.initialize``, ``autotp_size`` 2, tiny dory, 2 gloo ranks). Every TP rank
    replaces alike, so every rank raises."""
    after = {name for name, _ in model.named_parameters()}
    lost = [name for name in before if name not in after]
    if lost:
        raise ConfigError(
            f"DeepSpeed AutoTP replaced modules of {type(model).__name__} and dropped their parameters {lost}: it "
            "swaps each nn.Linear it splits, a subclass too, for its own layer with the weight and bias alone, so "
            "the subclass's own parameters and forward (e.g. a head's logit scale) are lost and the model computes "
            "something else. Keep those modules whole (tensor_parallel.partition_config / the model's tp plan "
            "without them), or run tp_size 1"
        )


def sum_split_activation_gradients(model: torch.nn.Module, manager: Any) -> list[str]:
    """Sum over the TP group the gradient of every MLP activation's own parameters that AutoTP left whole (returns
    their names). transformers' MLPs apply ``act_fn`` to the column-parallel projections' output, so each TP rank's
    gradient of its parameters (Apertus' xIELU ``alpha_p`` / ``alpha_n``) covers that rank's features only, and
    transformers' tp plan leaves ``act_fn`` out, so DeepSpeed 0.19.8 neither sums it nor warns (fuzzer case
    1878399021: ``alpha_p``'s gradient 0.0268 and 0.0142 on the two TP ranks, one process's 0.0410 their sum,
    DeepSpeed's own without seqpar). The hook is DeepSpeed's own for the parameters its partition config marks
    ``grad_allreduce`` (Qwen3's ``q_norm``): an all-reduce of the gradient when autograd computes it, before it is
    accumulated, marked ``_ds_grad_allreduce_registered``. FSDP2's TP does the same with transformers'
    ``replicated_with_grad_allreduce`` (:func:`seqpar.integrations.tp.split_feature_activations`)."""
    if manager.tp_size == 1:
        return []
    try:
        from deepspeed.module_inject.layers import (
            LinearAllreduce,
            LinearAllreduceWithReplicatedInput,
            LinearLayer,
        )
    except ImportError:  # pragma: no cover - a DeepSpeed without AutoTP's layers
        return []

    def summed_over(group: Any) -> Any:
        def hook(grad: torch.Tensor) -> torch.Tensor:
            grad = grad.contiguous()
            torch.distributed.all_reduce(grad, group=group)
            return grad
        return hook

    summed = []
    for name, module in model.named_modules():
        act = getattr(module, "act_fn", None)
        if not isinstance(act, torch.nn.Module):
            continue
        children = list(module.children())
        rows = [c for c in children if isinstance(c, LinearAllreduce)
                and not isinstance(c, LinearAllreduceWithReplicatedInput)]
        if not rows or not any(isinstance(c, LinearLayer) for c in children):
            continue
        for pname, p in act.named_parameters(recurse=False):
            if p.requires_grad and not getattr(p, "_ds_grad_allreduce_registered", False):
                p.register_hook(summed_over(rows[0].mp_group))
                p._ds_grad_allreduce_registered = True
                summed.append(f"{name}.act_fn.{pname}" if name else f"act_fn.{pname}")
    if summed:
        logger.info("%s seqpar: DeepSpeed AutoTP splits the features of %d MLP activations with parameters; their "
                    "gradients are summed over TP (e.g. %s)", rank_prefix(), len(summed), summed[0])
    return summed


def refuse_unreduced_parameters_on_split_features(model: torch.nn.Module, manager: Any) -> None:
    """Refuse a trained parameter that DeepSpeed's AutoTP keeps whole but that acts on features it split.

    Inside a module one of whose direct children AutoTP made row-parallel (``LinearAllreduce``: the MLP's
    ``down_proj``, the attention's ``o_proj``), the activations between its column-parallel and row-parallel layers
    are this TP rank's slice of the features. A parameter of another child there (or of the module itself) is
    replicated, but its gradient on each TP rank covers that rank's slice only: the gradient is the sum over the TP
    group, which DeepSpeed 0.19.8 takes only for the parameters its partition config marks ``grad_allreduce`` (a
    hook, ``_ds_grad_allreduce_registered``: Qwen3's ``q_norm`` / ``k_norm``). Any other such parameter trains on a
    partial gradient, silently: Apertus' xIELU activation (``mlp.act_fn.alpha_p`` / ``alpha_n``, applied to the split
    ``up_proj`` output; fuzzer case 1878399021, ``alpha_p``'s gradient on the two TP ranks 0.0268 and 0.0142 where one
    process has their sum 0.0410, DeepSpeed's own without seqpar), which :func:`sum_split_activation_gradients` now
    sums: this refuses what is left. Every TP rank splits alike, so every rank raises."""
    if manager.tp_size == 1:
        return
    try:
        from deepspeed.module_inject.layers import (
            LinearAllreduce,
            LinearAllreduceWithReplicatedInput,
            TensorParallel_Layer,
        )
    except ImportError:  # pragma: no cover - a DeepSpeed without AutoTP's layers
        return
    unreduced = []
    for prefix, module in model.named_modules():
        children = dict(module.named_children())
        if not any(isinstance(c, LinearAllreduce) and not isinstance(c, LinearAllreduceWithReplicatedInput)
                   for c in children.values()):
            continue
        owners = [("", module, False)] + [(n, c, True) for n, c in children.items()
                                          if not isinstance(c, TensorParallel_Layer)]
        for name, owner, recurse in owners:
            for pname, p in owner.named_parameters(recurse=recurse):
                if p.requires_grad and not getattr(p, "_ds_grad_allreduce_registered", False):
                    unreduced.append(".".join(x for x in (prefix, name, pname) if x))
    if unreduced:
        raise ConfigError(
            f"DeepSpeed AutoTP keeps {type(model).__name__}'s parameters {unreduced} whole, but they act on features "
            "it split over the TP ranks (between a column-parallel and a row-parallel layer), and it does not sum "
            "their gradients over the TP group: each rank would train them on its own slice's share, silently "
            "wrong. Freeze them (requires_grad False), keep those modules whole (tensor_parallel.partition_config "
            "/ the model's tp plan without them), or run tp_size 1"
        )


def dp_axis_loader(engine: Any, training_data: Any, collate_fn: Any, manager: Any) -> Any:
    """DeepSpeed's training loader sampling over seqpar's DP axis: under AutoTP the engine's own loader
    would sample over its DP group (``dp x sp`` ranks), giving the ranks of one SP group different
    samples. Every rank of one DP replica (its SP and TP ranks) gets the same samples."""
    from torch.utils.data import DistributedSampler

    sampler = DistributedSampler(training_data, num_replicas=manager.dp_size, rank=manager.dp_rank)
    loader = engine.deepspeed_io(training_data, collate_fn=collate_fn, data_sampler=sampler)
    engine.training_dataloader = loader
    return loader
