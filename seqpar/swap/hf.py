"""The ``"hf"`` route of :func:`seqpar.swap.swap_attention`: Hugging Face transformers models.

transformers is a model library, not an engine, so its glue lives with the swap; the swap imports
this module only when transformers is installed (``import seqpar`` does not need it).

This module owns :func:`apply`, the swap itself: it points the routed attention modules (and the models
holding them) at seqpar, installs the loss and the input preparers, and MoE router losses and Bamba's
z-loss over the whole sequence (:mod:`seqpar.swap.moe`; the input preparer hands it the batch's
``seqpar_token_mask``, padding to leave out of the router statistics, and removes it from the call).
The steps live in their own modules, whose public names are re-exported here:

- :mod:`seqpar.swap.hf_route`: the route table: which modules take the route (ALiBi ones included,
  :mod:`seqpar.swap.hf_alibi`), which layers are refused and why, which attention keyword arguments
  are honoured;
- :mod:`seqpar.swap.hf_probe`: the position-mixing probe at swap time (:mod:`seqpar.swap.probe`);
- :mod:`seqpar.swap.hf_inputs`: the input preparer (global positions, packed documents, masks, caches,
  labels);
- :mod:`seqpar.swap.hf_loss`: the loss, exact under SP (:class:`SequenceParallelLMLoss`);
- :mod:`seqpar.swap.hf_attention`: what transformers calls, the attention function and the mask
  function registered as ``"seqpar"``.
"""

from __future__ import annotations

import functools
import logging

import transformers
from torch import nn

from seqpar.swap import moe
from seqpar.swap.batch import Preparer
from seqpar.swap.hf_alibi import install as install_alibi
from seqpar.swap.hf_alibi import is_alibi_attention
from seqpar.swap.hf_attention import WindowMask, register, seqpar_attention_forward, seqpar_mask
from seqpar.swap.hf_inputs import forward_signature, prepare_inputs
from seqpar.swap.hf_loss import SequenceParallelLMLoss, model_loss_type
from seqpar.swap.hf_probe import probe_at_swap
from seqpar.swap.hf_route import (
    ATTENTION_KWARGS,
    ATTN_IMPLEMENTATION,
    OPTIONS_ATTR,
    is_hf_attention,
    swap_problems,
    top_pretrained,
)
from seqpar.swap.mla import install_latent_transfer
from seqpar.swap.options import SwapError, SwapOptions
from seqpar.swap.traced import remember_forward_names

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

_HOOK_ATTR = "_seqpar_input_hook"


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
        setattr(module, OPTIONS_ATTR, options)
        module._seqpar_name = name
        if options.mla_transfer == "latent":
            install_latent_transfer(module, options)  # MLA layers only: their ring moves the latent
        if is_alibi_attention(module):
            install_alibi(module, options)  # its own forward: no attention interface to switch
    modules = [(name, module) for name, module in modules if not is_alibi_attention(module)]
    tops = top_pretrained(model)
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
        remember_forward_names(type(pm))  # for torch.compile, which cannot bind the call by inspect
        if "labels" in forward_signature(type(pm)).parameters:
            pm.loss_function = SequenceParallelLMLoss(options, model_loss_type(pm))
        old = getattr(pm, _HOOK_ATTR, None)
        if old is not None:
            old.remove()
            delattr(pm, _HOOK_ATTR)
        # under torch.compile(model) the outermost model's hooks are a frame of their own: its preparer then
        # leaves creating tensors to the nested models' hooks, traced inline (seqpar.swap.hf_traced)
        nested = any(isinstance(m, transformers.PreTrainedModel) for m in pm.modules() if m is not pm)
        prepare = functools.partial(prepare_inputs, options, nested=nested)
        if pm is model:
            preparers.append(prepare)
        else:
            setattr(pm, _HOOK_ATTR, pm.register_forward_pre_hook(prepare, with_kwargs=True))
    return preparers
