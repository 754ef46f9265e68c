"""MLA layers of transformers under the ring: send the latent, not the expanded K/V (:mod:`seqpar.attn.latent`).

transformers 5.x MLA attention modules (DeepSeek-V2/V3, Kimi, GLM-4.5 lite, MiniCPM3, ...) build K/V
with ``key, value = self.expand_kv(kv_nope, k_rot)`` from the normalised latent ``kv_nope`` ``(batch, 1,
seq, kv_lora_rank)`` and the rotated rope key ``k_rot`` ``(batch, 1, seq, qk_rope_head_dim)``, and pass
them straight to the attention function. The swap wraps ``expand_kv`` of each such module (one instance
attribute, a method bound to the module: a deep copy of the model rebinds it to the copy): when the layer's
call will run the ring or the all-gather (``mode="ring"`` or ``"allgather"``, more than one rank in the
call's SP group, the dense pattern; under dynamic CP the group the layer's call carries), the wrapper keeps
the latent on the layer call's frame and returns zero-cost stand-ins of K/V's shapes (broadcast views, no
storage); seqpar's attention function takes the latent back (:func:`take_latent`, matching the stand-in by
identity) and runs :class:`~seqpar.attn.latent.LatentRingAttention` (or ``LatentAllGatherAttention``).
Otherwise ``expand_kv`` runs as the model wrote it.

transformers calls ``expand_kv`` without the layer's keyword arguments, so each call of the layer holds a
frame (:mod:`seqpar.swap.frame`, forward hooks) with the group the call carries and, between ``expand_kv``
and the attention call, the latent: nothing of one call stays on the module, so two forwards before their
backwards, a recompute under activation checkpointing (which replays the call's keyword arguments) and two
threads each see their own call's. A latent no attention call took by the end of the layer's call (the
stand-ins went elsewhere: they hold zeros) raises.

``kv_b_proj``'s weight is read only inside a call of ``kv_b_proj`` itself (:meth:`LatentCall.run`: the
latent attention runs as that module's forward), so an engine that materialises a module's parameters
around its own forward sees the use: ZeRO-3 gathers the weight (and again before the backward, whose
weight gradient its hooks reduce-scatter), FSDP2 unshards a separately wrapped ``kv_b_proj``. Under
tensor parallelism (transformers' ``colwise`` on ``kv_b_proj``, a DTensor weight ``Shard(0)`` over the TP
mesh) the rank expands its own heads with its own rows, and the latent's gradient, a partial sum over
the rank's heads, is summed over TP (as ``colwise`` sums its input's gradient); the rope key's is
summed by the plan's ``mla_kv_a_proj``, as on the expanded path.

The wrapper checks once per layer (host sync once), on a fixed seeded input, that the layer's own
``expand_kv`` equals the latent expansion seqpar does (:class:`~seqpar.attn.latent.MLAExpander`) with
the weight as ``kv_b_proj``'s forward sees it (this rank's heads under TP); a layer whose expansion
differs (a future transformers release) keeps the expanded path, and so does one with a bias on
``kv_b_proj`` or GQA (:func:`mla_dims`): each fallback logs a warning naming why (once per reason). The
verdict depends on the weights only, which every SP rank holds alike, so every rank takes the same path.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from seqpar.attn.latent import MLADims, MLAExpander
from seqpar.swap.frame import CallFrame, frame_of, hold_calls
from seqpar.swap.state import is_probing

__all__ = ["mla_dims", "install_latent_transfer", "take_latent", "LatentCall", "LatentBody", "run_in_projection"]

logger = logging.getLogger(__name__)
_warned: set[str] = set()  # fallback messages already logged (once per process, not once per layer)


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)

_ORIGINAL_ATTR = "_seqpar_expand_kv"  # the module's own expand_kv
_VERDICT_ATTR = "_seqpar_latent_ok"  # None: not probed yet
_HEADS_ATTR = "_seqpar_latent_heads"  # this rank's head count, as kv_b_proj's forward sees its weight
_PROJ_ATTR = "_seqpar_kv_b_forward"  # kv_b_proj's own forward, under the one that takes seqpar_latent


def _untaken_latent(frame: CallFrame) -> None:
    """The end of an MLA layer's call (:func:`~seqpar.swap.frame.hold_calls`): its ``expand_kv`` stashed a
    latent and returned zero stand-ins, so an attention call that did not take the latent back attended zeros."""
    if frame.latent is not None:
        raise RuntimeError(
            f"seqpar: {type(frame.owner).__name__}'s expand_kv stashed an MLA latent, but no seqpar attention call "
            "of the layer took it (its K/V stand-ins hold zeros); set sequence_parallel.mla_transfer to "
            '"expanded" for this model'
        )


LatentBody = Callable[[Tensor, Tensor, Tensor], Any]
"""``body(weight, c, r)``: the latent computation, with ``weight`` ``(heads_local * (d_nope + d_v),
kv_lora_rank)`` a plain tensor (this rank's heads) and ``c``, ``r`` as :class:`LatentCall` holds them."""


class LatentCall:
    """One layer call's latent: ``c`` ``(batch, 1, seq_local, kv_lora_rank)``, ``r`` ``(batch, 1,
    seq_local, d_rope)``, the layer's ``kv_b_proj`` (whose weight only :meth:`run` reads), the head dims
    (``heads``: this rank's) and the stand-ins handed to the model."""

    def __init__(self, c: Tensor, r: Tensor, proj: nn.Module, dims: MLADims, key: Tensor, value: Tensor,
                 expand: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]) -> None:
        self.c, self.r, self.proj, self.dims = c, r, proj, dims
        self.key, self.value, self.expand = key, value, expand

    def run(self, body: LatentBody) -> Any:
        """``body(weight, c, r)`` run as ``kv_b_proj``'s forward (:func:`run_in_projection`)."""
        return run_in_projection(self.proj, body, self.c, self.r)


def _local_weight(weight: Tensor) -> tuple[Tensor, Any]:
    """``kv_b_proj``'s weight as its forward sees it -> (this rank's rows as a plain tensor, the TP mesh
    whose ranks hold the other heads, or None). A DTensor ``Shard(0)`` on a 1-D mesh is transformers'
    ``colwise`` (whole heads per rank: the plan splits ``heads * (d_nope + d_v)`` rows evenly); a
    replicated DTensor holds every head.

    Raises:
        ValueError: any other layout, naming it and the fix.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(weight, DTensor):
        return weight, None
    placements = tuple(weight.placements)
    if all(isinstance(p, Replicate) for p in placements):
        return weight.to_local(), None
    if weight.device_mesh.ndim == 1 and placements == (Shard(0),):
        return weight.to_local(), weight.device_mesh
    raise ValueError(
        f"seqpar: an MLA kv_b_proj weight is a DTensor with placements {placements} on a {weight.device_mesh.ndim}-D "
        "mesh inside its forward; the latent transfer knows a replicated weight or transformers' colwise (Shard(0) "
        'over the TP mesh). Set sequence_parallel.mla_transfer to "expanded" for this model'
    )


def run_in_projection(proj: nn.Module, body: LatentBody, c: Tensor, r: Tensor) -> Any:
    """Call ``proj`` (an MLA ``kv_b_proj`` prepared by :func:`install_latent_transfer`) so that it runs
    ``body(weight, c, r)`` instead of its projection: whatever the engines hook around that module's
    forward (ZeRO-3's gather and release, FSDP2's unshard, their backward hooks on the output, TP's input
    and output layouts) acts on this use of the weight. Under TP, ``c`` arrives replicated and leaves
    with its gradient summed over the TP ranks (each contributes its heads' share), as transformers'
    ``colwise`` treats its input."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    def latent(weight: Tensor, c_in: Tensor, r_in: Tensor) -> Any:
        weight, mesh = _local_weight(weight)
        if mesh is not None and torch.is_grad_enabled():
            if not isinstance(c_in, DTensor):
                c_in = DTensor.from_local(c_in, mesh, [Replicate()], run_check=False)
            c_in = c_in.to_local(grad_placements=[Partial()])  # backward: the heads' partial sums, all-reduced
        elif isinstance(c_in, DTensor):
            c_in = c_in.to_local()
        return body(weight, c_in, r_in)

    return proj(c, r, seqpar_latent=latent)


def _prepare_projection(proj: nn.Module) -> None:
    """Give ``proj.forward`` a keyword ``seqpar_latent``: ``forward(c, r, seqpar_latent=f)`` returns
    ``f(proj.weight, c, r)`` (the weight as the engines hold it during the module's forward); without it,
    the module's own forward. Idempotent (a second swap keeps the first own forward)."""
    if _PROJ_ATTR in proj.__dict__:
        return
    setattr(proj, _PROJ_ATTR, proj.forward)
    proj.forward = types.MethodType(_projection_forward, proj)  # a method: a deep copy rebinds it to its copy


def _projection_forward(self: nn.Module, *args: Any, seqpar_latent: Callable[..., Any] | None = None,
                        **kwargs: Any) -> Any:
    """``forward`` of a projection prepared by :func:`_prepare_projection` (its own forward, kept in
    ``_PROJ_ATTR``, read from the module at each call)."""
    if seqpar_latent is None:
        return self.__dict__[_PROJ_ATTR](*args, **kwargs)
    return seqpar_latent(self.weight, *args)


def mla_dims(module: nn.Module) -> MLADims | None:
    """The head dims of a transformers MLA attention module, or None if it is not one seqpar can move
    latents for (no ``expand_kv``/``kv_b_proj``, a bias on ``kv_b_proj``, GQA, or other shapes)."""
    return _mla_dims_or_problem(module)[0]


def _weight_shape(weight: Tensor) -> tuple[int, ...]:
    """The full shape of a weight: ZeRO-3 keeps it in ``ds_shape`` (the tensor itself is empty outside the
    module's forward), a DTensor in ``shape``."""
    return tuple(getattr(weight, "ds_shape", None) or weight.shape)


def _mla_dims_or_problem(module: nn.Module) -> tuple[MLADims | None, str | None]:
    """(dims, None) for an MLA layer seqpar moves latents for; (None, why) for a layer that has
    ``expand_kv`` and ``kv_b_proj`` but another form; (None, None) for any other module."""
    proj = getattr(module, "kv_b_proj", None)
    if not callable(getattr(module, "expand_kv", None)) or proj is None:
        return None, None
    if not isinstance(proj, nn.Linear):
        return None, f"kv_b_proj is a {type(proj).__name__}, not an nn.Linear"
    if proj.bias is not None:
        return None, "kv_b_proj has a bias"
    try:
        dims = MLADims(
            heads=int(module.num_heads), qk_nope_head_dim=int(module.qk_nope_head_dim),
            qk_rope_head_dim=int(module.qk_rope_head_dim), v_head_dim=int(module.v_head_dim),
            kv_lora_rank=int(module.kv_lora_rank),
        )
    except (AttributeError, TypeError, ValueError) as error:
        return None, f"its head dims could not be read ({error})"
    want = (dims.heads * (dims.qk_nope_head_dim + dims.v_head_dim), dims.kv_lora_rank)
    if _weight_shape(proj.weight) != want:
        return None, (f"kv_b_proj's weight has shape {_weight_shape(proj.weight)}, not heads * (d_nope + d_v) x "
                      f"kv_lora_rank = {want} (GQA or another layout)")
    return dims, None


def _verdict(module: nn.Module, original: Callable, dims: MLADims, like: Tensor) -> tuple[int | None, str]:
    """(this rank's head count, "") when the layer's own ``expand_kv`` equals :class:`MLAExpander` with
    ``kv_b_proj``'s weight as its forward sees it, on a fixed seeded 3-token input in ``like``'s dtype and
    device (a different expansion differs by O(1), rounding by far less); (None, why) otherwise. Both
    sides call ``kv_b_proj``, so an engine that gathers its weight per module does so for each."""
    g = torch.Generator().manual_seed(0)
    c = torch.randn(1, 1, 3, dims.kv_lora_rank, generator=g).to(like.device, like.dtype)
    r = torch.randn(1, 1, 3, dims.qk_rope_head_dim, generator=g).to(like.device, like.dtype)
    width = dims.qk_nope_head_dim + dims.v_head_dim

    seen: dict[str, Any] = {}

    def expand(weight: Tensor, c_in: Tensor, r_in: Tensor) -> Tensor:
        heads, rest = divmod(weight.shape[0], width)
        if rest or weight.shape[1:] != (dims.kv_lora_rank,):
            raise ValueError(f"kv_b_proj's weight in its forward has shape {tuple(weight.shape)}, not a multiple "
                             f"of {width} rows x {dims.kv_lora_rank}")
        seen["heads"], seen["kv"] = heads, MLAExpander(weight, replace(dims, heads=heads)).expand(c_in, r_in)
        return seen["kv"][0]  # one tensor out of the module's forward, as its hooks expect

    try:
        with torch.no_grad():
            want = original(c, r)
            run_in_projection(module.kv_b_proj, expand, c, r)
            heads, got = seen["heads"], seen["kv"]
    except Exception as error:  # noqa: BLE001 - any failure means: not the expansion seqpar knows
        return None, f"its expand_kv could not be compared with the latent expansion ({type(error).__name__}: {error})"
    if all(a.shape == b.shape and bool(torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2))
           for a, b in zip(want, got, strict=True)):
        return heads, ""
    return None, "its expand_kv differs from the latent expansion seqpar does"


def _ring_will_run(frame: CallFrame, options: Any) -> bool:
    """The layer's call (``frame``) will be the ring or the all-gather over more than one rank (the latent
    paths): over the call's group (dynamic CP: the group it carries, else the swap's)."""
    if options.mode not in ("ring", "allgather") or options.pattern.type != "dense":
        return False
    return frame.group is not None and dist.get_world_size(frame.group) > 1


def install_latent_transfer(module: nn.Module, options: Any) -> bool:
    """Wrap ``module.expand_kv`` for latent transfer (``options``: the layer's SwapOptions); False
    when the module is no MLA layer seqpar knows (nothing installed)."""
    dims, problem = _mla_dims_or_problem(module)
    if dims is None:
        if problem is not None:
            _warn_once(f"seqpar: {type(module).__name__}: {problem}; its ring moves expanded K/V, not the latent")
        return False
    original = module.__dict__.get(_ORIGINAL_ATTR) or module.expand_kv
    setattr(module, _ORIGINAL_ATTR, original)
    setattr(module, _VERDICT_ATTR, None)
    setattr(module, _HEADS_ATTR, None)
    _prepare_projection(module.kv_b_proj)
    # each call of the layer holds a frame: its group, and the latent between expand_kv and the attention
    hold_calls(module, options.group, on_leave=_untaken_latent)

    # bound to the module (a method), not a closure over it: a deep copy of the model rebinds it to the copy,
    # whose calls then expand with the copy's kv_b_proj and read the copy's frames (a closure would keep the
    # source module: its weights, and frames the copy never pushes)
    def expand_kv(self: nn.Module, kv_nope: Tensor, k_rot: Tensor) -> tuple[Tensor, Tensor]:
        original = self.__dict__[_ORIGINAL_ATTR]
        frame = frame_of(self)  # None: called outside the layer's call, which holds no latent for it
        if frame is None or is_probing() or not _ring_will_run(frame, options):  # the probe attends self-only
            return original(kv_nope, k_rot)
        if getattr(self, _VERDICT_ATTR) is None:
            heads, why = _verdict(self, original, dims, kv_nope)
            setattr(self, _VERDICT_ATTR, heads is not None)
            setattr(self, _HEADS_ATTR, heads)
            if heads is None:
                _warn_once(f"seqpar: {type(self).__name__}: {why}; its ring moves expanded K/V, not the latent")
        if not getattr(self, _VERDICT_ATTR) or kv_nope.shape[1] != 1 or k_rot.shape[1] != 1:
            return original(kv_nope, k_rot)
        local = replace(dims, heads=getattr(self, _HEADS_ATTR))  # this rank's heads (fewer under TP)
        b, _, n, _ = kv_nope.shape
        # stand-ins of K/V's shapes and dtype: broadcast views of one element, never read
        zero = kv_nope.new_zeros(())
        key = zero.expand(b, local.heads, n, local.qk_nope_head_dim + local.qk_rope_head_dim)
        value = zero.expand(b, local.heads, n, local.v_head_dim)
        frame.latent = LatentCall(kv_nope, k_rot, self.kv_b_proj, local, key, value, original)
        return key, value

    module.expand_kv = types.MethodType(expand_kv, module)
    return True


def take_latent(module: nn.Module, key: Tensor, value: Tensor) -> LatentCall | None:
    """The latent stashed by this layer's ``expand_kv`` on its running call's frame for the attention call
    whose K/V stand-ins are ``key``, ``value`` (None: the layer passed real K/V). Raises if a stash does not
    belong to this call."""
    frame = frame_of(module)
    call: LatentCall | None = None if frame is None else frame.latent
    if call is None:
        return None
    frame.latent = None
    if call.key is not key or call.value is not value:
        raise RuntimeError(
            f"seqpar: {type(module).__name__} stashed an MLA latent, but its attention call received other "
            "K/V tensors than the stand-ins expand_kv returned; set sequence_parallel.mla_transfer to "
            '"expanded" for this model'
        )
    return call
