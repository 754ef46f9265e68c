"""MoE models under the Hugging Face swap: router losses and expert counts of the whole sequence.

Routing is token by token, so a mixture-of-experts layer is exact on shards; its *statistics* over
the tokens of a call are not (see :mod:`seqpar.sequence.router`). transformers 5.x computes them in
two places seqpar takes over while a swapped model runs:

- **Load-balancing loss.** Every decoder that has one calls ``load_balancing_loss_func`` by name from
  its own modeling module (about 30 share one form: softmax, top-k, per-expert counts and probability
  sums; Doge has a product-key form). :func:`install` replaces that module-level name, once per
  modeling module of the swapped model, by a dispatcher: outside a swapped model's forward (an
  unswapped copy, a reference model) it *is* the original; inside one on an SP group of more than
  one rank it computes the same loss from the statistics summed over the SP group. Before replacing,
  the original is probed on random router logits (with and without an attention mask, value and
  gradient) against seqpar's version of its form, so a changed or unknown function is never
  replaced by a wrong one: it is refused by name under SP instead (at swap time when the config
  already asks for router logits).
- **Bamba's z-loss** (``z_loss_coefficient``: ``mean(logsumexp(logits)**2)`` added inline in the
  forward): a forward hook replaces the shard's mean by the sequence's.

Convention (as for the SP cross-entropy): ``out.loss`` (and ``out.aux_loss``) is the same on every SP
rank, and rank gradients summed over the SP group are one process's gradients.

**Aux-loss-free balancing** (DeepSeek-V3 and kin: ``e_score_correction_bias``, which transformers does
not update): :class:`ExpertCounter` records, per router, the tokens routed to each expert in a forward,
summed over the SP group, for a trainer's bias update to see the counts of one process.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from seqpar.sequence.batch import TOKEN_MASK_KEY
from seqpar.sequence.router import (
    pkm_routing_statistics,
    routing_statistics,
    sequence_parallel_expert_counts,
    sequence_parallel_z_loss,
)
from seqpar.swap import frame as call_frame
from seqpar.swap.options import SwapError
from seqpar.swap.state import is_probing

__all__ = ["install", "install_dispatcher", "router_loss_problem", "ExpertCounter", "FUNCTION_NAME"]

FUNCTION_NAME = "load_balancing_loss_func"
_ORIGINAL_ATTR = "__seqpar_original__"
_HOOKS_ATTR = "_seqpar_router_hooks"
# Bamba's inline z-loss, as transformers 5.x writes it; another form is refused under SP.
_Z_LOSS_SOURCE = "logits.logsumexp(dim=-1).to(dtype=loss.dtype).pow(2).mean()"


def take_token_mask(kwargs: dict[str, Any]) -> None:
    """Remove :data:`~seqpar.sequence.batch.TOKEN_MASK_KEY` from a swapped model's keyword arguments
    and keep it on the running call's frame (:mod:`seqpar.swap.frame`) for its router statistics (called by
    the input preparer)."""
    mask = kwargs.pop(TOKEN_MASK_KEY, None)
    frame = call_frame.innermost()
    if frame is not None and mask is not None:
        frame.token_mask = mask


def _masked(attention_mask: Tensor | None, token_mask: Tensor | None) -> Tensor | None:
    # (B, S_local) both; the model's mask is all ones under the swap, the token mask drops padding.
    if token_mask is None:
        return attention_mask
    if attention_mask is None:
        return token_mask
    return attention_mask * token_mask.to(attention_mask.device)


def _world(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


# ----------------------------------------------------------------------------- the two known forms
# A form takes the running model's SP group as resolved (None: no group, as in the probe).
def _switch_form(original: Callable, group: dist.ProcessGroup | None, token_mask: Tensor | None = None) -> Callable:
    def sp_loss(gate_logits: Any, num_experts: int | None = None, top_k: int = 2,
                attention_mask: Tensor | None = None) -> Tensor | int:
        attention_mask = _masked(attention_mask, token_mask)
        if gate_logits is None or not isinstance(gate_logits, tuple):
            return 0
        stats = routing_statistics(gate_logits, num_experts, top_k, attention_mask)
        return stats.over(group, resolve=False).loss(num_experts)
    return sp_loss


def _pkm_form(original: Callable, group: dist.ProcessGroup | None, token_mask: Tensor | None = None) -> Callable:
    def sp_loss(gate_logits: Any, num_experts: int | None = None, num_keys: int | None = None,
                top_k: int = 2, attention_mask: Tensor | None = None) -> Tensor | int:
        attention_mask = _masked(attention_mask, token_mask)
        if gate_logits is None or not isinstance(gate_logits, tuple):
            return 0
        stats = pkm_routing_statistics(gate_logits, num_experts, num_keys, top_k, attention_mask)
        return stats.over(group, resolve=False).loss(num_experts)
    return sp_loss


def _matches_original(original: Callable, form: Callable, logits_shape: tuple[int, ...],
                      call: Callable[[Callable, tuple, Tensor | None], Tensor]) -> bool:
    """Whether ``form(original)`` gives ``original``'s value and gradients (float64) on random router
    logits of ``logits_shape`` (two layers), with and without an attention mask ``(2, 6)``."""
    g = torch.Generator().manual_seed(7)
    logits = tuple(torch.randn(*logits_shape, generator=g, dtype=torch.float64).requires_grad_() for _ in range(2))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, 4:] = 0
    for m in (None, mask):
        for fn in (original, form(original, None)):
            value = call(fn, logits, m)
            grads = torch.autograd.grad(value, logits)
            if fn is original:
                want = (value.detach(), grads)
            elif not (torch.allclose(value.double(), want[0].double(), rtol=1e-6, atol=1e-9)
                      and all(torch.allclose(a, b, rtol=1e-6, atol=1e-9) for a, b in zip(grads, want[1]))):
                return False
    return True


def _probe_switch(original: Callable) -> bool:
    # (tokens, experts) logits per layer: 6 experts, top 2
    return _matches_original(original, _switch_form, (12, 6), lambda fn, x, m: fn(x, 6, 2, m))


def _probe_pkm(original: Callable) -> bool:
    # Doge's product keys: (2, tokens, keys) logits per layer, 9 experts from 3 keys, top 2
    return _matches_original(original, _pkm_form, (2, 12, 3), lambda fn, x, m: fn(x, 9, 3, 2, m))


# (parameter names, probe, sequence-parallel form)
_FORMS = (
    (("gate_logits", "num_experts", "top_k", "attention_mask"), _probe_switch, _switch_form),
    (("gate_logits", "num_experts", "num_keys", "top_k", "attention_mask"), _probe_pkm, _pkm_form),
)


def _form_of(original: Callable) -> Callable | None:
    """The sequence-parallel form of ``original`` (None: not one seqpar knows, checked by a probe)."""
    known = getattr(original, "__seqpar_form__", "unset")
    if known != "unset":
        return known
    form = None
    try:
        names = tuple(inspect.signature(original).parameters)
    except (TypeError, ValueError):
        names = ()
    for params, probe, make in _FORMS:
        if names == params:
            try:
                ok = probe(original)
            except Exception:  # noqa: BLE001 - any failure means: not this form
                ok = False
            if ok:
                form = make
            break
    try:
        original.__seqpar_form__ = form
    except AttributeError:
        pass
    return form


def _dispatcher(original: Callable, module_name: str) -> Callable:
    form = _form_of(original)

    def load_balancing_loss_func(*args: Any, **kwargs: Any) -> Any:
        # The position-mixing probe's runs (:mod:`seqpar.swap.probe`) attend self-only on their own synthetic
        # tokens, with no collective: their loss is the original's. A probe put off to the first forward
        # (ZeRO-3) runs inside that forward's frame, whose token mask is the real batch's, not the probe's.
        if is_probing():
            return original(*args, **kwargs)
        frame = call_frame.innermost()  # the running swapped call's: its group, the batch's token mask
        token_mask = call_frame.token_mask()
        if frame is None or (_world(frame.group) == 1 and token_mask is None):
            return original(*args, **kwargs)
        if form is None:
            raise ValueError(f"seqpar: {router_loss_problem_of(module_name)}")
        return form(original, frame.group, token_mask)(*args, **kwargs)

    setattr(load_balancing_loss_func, _ORIGINAL_ATTR, original)
    load_balancing_loss_func.__doc__ = (
        f"seqpar's dispatcher for {module_name}.{FUNCTION_NAME}: the original outside a swapped "
        "model's forward; the whole sequence's loss on an SP group inside one.")
    return load_balancing_loss_func


def router_loss_problem_of(module_name: str) -> str:
    return (
        f"{module_name}.{FUNCTION_NAME} is not a router loss seqpar knows (it differs from "
        "transformers' softmax-top-k and product-key forms), so on sequence shards it would be each "
        "rank's shard-local value. Pass output_router_logits=False (and set "
        "config.output_router_logits=False) to train without it under seqpar"
    )


def _modeling_modules(model: nn.Module) -> list[ModuleType]:
    """The modeling modules whose globals the model's classes read (their MROs, de-duplicated)."""
    seen: dict[str, ModuleType] = {}
    for m in model.modules():
        for cls in type(m).__mro__:
            mod = sys.modules.get(cls.__module__)
            if mod is not None and cls.__module__.startswith("transformers.models."):
                seen.setdefault(cls.__module__, mod)
    return list(seen.values())


def _patch_router_losses(model: nn.Module) -> list[str]:
    """Put the dispatcher in place of every ``load_balancing_loss_func`` the model's modules read;
    returns the modules whose function seqpar does not know."""
    unknown = []
    for mod in _modeling_modules(model):
        fn = mod.__dict__.get(FUNCTION_NAME)
        if not callable(fn):
            continue
        original = getattr(fn, _ORIGINAL_ATTR, fn)
        if fn is original:
            setattr(mod, FUNCTION_NAME, _dispatcher(original, mod.__name__))
        if _form_of(original) is None:
            unknown.append(mod.__name__)
    return unknown


def install_dispatcher(module: ModuleType) -> None:
    """Put the dispatcher in place of ``module.load_balancing_loss_func`` (once; idempotent), for code
    outside a swapped model that computes the model's router loss with *another* family's function:
    TRL's fused LM head calls Mixtral's for every MoE family. Inside a swapped model's forward it then
    gives the whole sequence's loss; elsewhere it is the original.

    Raises:
        SwapError: the module has no such function, or one seqpar does not know.
    """
    fn = module.__dict__.get(FUNCTION_NAME)
    if not callable(fn):
        raise SwapError(f"{module.__name__} has no {FUNCTION_NAME} to compute router losses under SP with")
    original = getattr(fn, _ORIGINAL_ATTR, fn)
    if _form_of(original) is None:
        raise SwapError(router_loss_problem_of(module.__name__))
    if fn is original:
        setattr(module, FUNCTION_NAME, _dispatcher(original, module.__name__))


def router_loss_problem(model: nn.Module, config: Any) -> str | None:
    """Why the model's router losses cannot be made exact under SP (None: they can, or are off)."""
    if not getattr(config, "output_router_logits", False):
        return None
    unknown = [m for m in _modeling_modules(model)
               if callable(m.__dict__.get(FUNCTION_NAME))
               and _form_of(getattr(m.__dict__[FUNCTION_NAME], _ORIGINAL_ATTR, m.__dict__[FUNCTION_NAME])) is None]
    if unknown:
        return f"config.output_router_logits=True: {router_loss_problem_of(unknown[0].__name__)}"
    return None


# ----------------------------------------------------------------------------- z-loss
def _z_loss_problem(model: nn.Module) -> str | None:
    coef = getattr(model, "z_loss_coefficient", 0) or 0
    if coef <= 0:
        return None
    try:
        source = inspect.getsource(type(model).forward)
    except (OSError, TypeError):
        source = ""
    if _Z_LOSS_SOURCE not in source:
        return (
            f"z_loss_coefficient={coef} but {type(model).__name__}.forward does not compute the z-loss "
            "as seqpar knows it (mean of logsumexp(logits)**2), so on shards it would be each rank's "
            "shard-local mean; set z_loss_coefficient=0 to train under seqpar"
        )
    return None


def _z_loss_hook(module: nn.Module, args: Any, output: Any) -> Any:
    """Runs inside the model call's frame (registered before :func:`~seqpar.swap.frame.hold_calls`' hooks)."""
    frame = call_frame.frame_of(module)
    if frame is None or is_probing():  # the probe's runs: their own tokens, no collective (see the dispatcher)
        return output
    group = frame.group  # dynamic CP: the micro-batch's group, which its call carries
    coef = getattr(module, "z_loss_coefficient", 0) or 0
    loss = getattr(output, "loss", None)
    token_mask = call_frame.token_mask()
    if coef <= 0 or loss is None or (_world(group) == 1 and token_mask is None):
        return output
    logits = output.logits
    # The forward added coef * (this shard's mean); replace it by the sequence's mean. Both terms
    # are computed here the same way as the forward did, so their gradients cancel.
    local = logits.logsumexp(dim=-1).to(dtype=loss.dtype).pow(2).mean()
    whole = sequence_parallel_z_loss(logits.to(loss.dtype), group=group, mask=token_mask)
    output.loss = loss + coef * (whole - local)
    return output


# ----------------------------------------------------------------------------- install
def install(model: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Make the swapped ``model``'s router losses and z-loss those of the whole sequence.

    Raises:
        SwapError: the config asks for router logits (or a z-loss) in a form seqpar does not know.
    """
    _patch_router_losses(model)
    for pm in _pretrained(model):
        problem = router_loss_problem(pm, getattr(pm, "config", None)) or _z_loss_problem(pm)
        if problem is not None:
            raise SwapError(f"{type(pm).__name__}: {problem}")
    for pm in _pretrained(model):
        for handle in getattr(pm, _HOOKS_ATTR, ()):
            handle.remove()
        handles = []
        if getattr(pm, "z_loss_coefficient", None) is not None:  # before the frame's hooks: it reads the frame
            handles.append(pm.register_forward_hook(_z_loss_hook))
        setattr(pm, _HOOKS_ATTR, tuple(handles))
        # each call holds a frame: its group (dynamic CP: the micro-batch's) and the batch's token mask
        call_frame.hold_calls(pm, group)


def _pretrained(model: nn.Module) -> list[nn.Module]:
    import transformers  # the swap imports this module only with transformers installed

    return [m for m in model.modules() if isinstance(m, transformers.PreTrainedModel)]


# ----------------------------------------------------------------------------- expert counts
def _expert_count(module: nn.Module) -> int:
    for attr in ("num_experts", "n_routed_experts", "num_local_experts"):
        value = getattr(module, attr, None)
        if isinstance(value, int):
            return value
    weight = getattr(module, "weight", None)
    if isinstance(weight, Tensor) and weight.dim() == 2:
        return int(weight.shape[0])
    raise ValueError(f"seqpar: cannot tell the expert count of router {type(module).__name__}")


def _routed_indices(output: Any) -> Tensor | None:
    items = output if isinstance(output, (tuple, list)) else (output,)
    found = [t for t in items if isinstance(t, Tensor) and not t.is_floating_point() and t.dim() >= 1]
    return found[-1] if found else None


class ExpertCounter:
    """Whole-sequence per-expert token counts of a model's routers, for aux-loss-free balancing.

    Hooks every router (default: every module holding an ``e_score_correction_bias``, or else each
    module whose class name ends in ``Router``; or the ``routers`` given) and, after each forward,
    holds per router the tokens routed to each expert, summed over the SP group (under dynamic CP the group
    each micro-batch's call carries, :mod:`seqpar.sequence.call_group`, not ``group``): the counts one
    process would see for the same batch (not summed over DP: a replica's bias update sees its own
    batch, as without SP). Recomputation during backward (activation checkpointing) is not counted
    twice. A router's output must hold the routed expert ids as its last integer tensor (the
    ``(logits, weights, indices)`` form of transformers 5.x routers)::

        counter = ExpertCounter(model, group=manager.sp_group)
        loss = model(**shard_batch(batch)).loss; loss.backward()
        for name, counts in counter.counts.items():   # (E,) int64, equal on every SP rank
            bias = routers[name].e_score_correction_bias
            bias += rate * torch.sign(counts.float().mean() - counts)
        counter.reset()

    Counts accumulate over forwards (gradient accumulation) until :meth:`reset`; ``remove()`` unhooks.
    Only the routers given (or found) are counted: a ``copy.deepcopy`` of the model (a DPO reference model) carries
    the hooks but not the counter; count a copy's routing with an ``ExpertCounter`` of its own.
    """

    def __init__(self, model: nn.Module, *, group: dist.ProcessGroup | None = None,
                 routers: Iterable[tuple[str, nn.Module]] | None = None) -> None:
        self.group = group
        if routers is None:
            found = [(n, m) for n, m in model.named_modules() if isinstance(getattr(m, "e_score_correction_bias", None), Tensor)]
            # A bias held by the MoE block while its gate routes (MiniMax-M2): count the gate.
            found = [(f"{n}.gate", m.gate) if isinstance(getattr(m, "gate", None), nn.Module)
                     and not isinstance(getattr(m.gate, "e_score_correction_bias", None), Tensor)
                     else (n, m) for n, m in found]
            routers = found or [(n, m) for n, m in model.named_modules()
                                if type(m).__name__.lower().endswith("router")]
        self.routers = dict(routers)
        if not self.routers:
            raise ValueError(
                f"seqpar: found no MoE router in {type(model).__name__}; pass routers=[(name, module)] "
                "whose outputs hold the routed expert ids")
        self.counts: dict[str, Tensor] = {}
        self._handles = [m.register_forward_hook(self._hook(name, _expert_count(m)))
                         for name, m in self.routers.items()]

    def _hook(self, name: str, num_experts: int) -> Callable:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if module is not self.routers[name]:
                # a copy of the router (copy.deepcopy(model): TRL's DPO reference model) keeps this hook, whose
                # closure is this counter's; its routing is another model's, not counted here. Every rank runs
                # the same copy, so every rank skips the count's collective alike
                return
            if torch._C._current_graph_task_id() != -1:
                return  # a backward's recompute of a checkpointed layer: counted in the forward
            if is_probing():
                return  # the position-mixing probe's synthetic tokens are no batch's (and take no collective)
            indices = _routed_indices(output)
            if indices is None:
                raise ValueError(
                    f"seqpar: router '{name}' ({type(module).__name__}) returned no integer expert ids; "
                    "ExpertCounter needs routers returning (logits, weights, indices)")
            # dynamic CP: over the micro-batch's group, which its call's frame carries; else the counter's
            carried = call_frame.carried_group()
            counts = sequence_parallel_expert_counts(indices.detach(), num_experts, mask=call_frame.token_mask(),
                                                     group=self.group if carried is None else carried)
            self.counts[name] = counts + self.counts[name] if name in self.counts else counts
        return hook

    def reset(self) -> None:
        """Forget the counts (call after each optimizer step's bias update)."""
        self.counts = {}

    def remove(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
