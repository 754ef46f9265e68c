"""The once-per-batch cross-rank check of a swapped model (see :mod:`seqpar.runtime.verified` for why).

:func:`install_batch_check` puts a forward pre-hook on the swapped model. Every rank of the SP group
runs the model's forward together, once per batch, so the hook is a point where a collective is
safe. It compares, across the ranks, one row of integers:

- this rank's verdict on its own inputs (the input preparers, e.g. the Hugging Face one that fills
  in global ``position_ids``, run first; a rank that refuses its batch makes every rank raise,
  instead of leaving its peers waiting in the first attention collective);
- the structure, shapes, dtypes and devices of every tensor argument, and the values of bools;
- the values of the small integer tensors that describe packed documents (``cu_seq_lens_q`` ...,
  :data:`VALUE_KEYS`), which every rank must hold identically;
- the attention options (:meth:`SwapOptions.digest`) and which modules were swapped.

Other integers (ints, floats, strings) are compared by type only: a rank-dependent offset passed as
an ``int`` is legitimate. When the rows agree, the forward runs in the verified scope and the
swapped layers make no collective or host sync of their own for checking.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from seqpar.comm.agree import flagged_ranks, rows_across_ranks
from seqpar.runtime.forward_group import forward_group
from seqpar.runtime.groups import resolve_group
from seqpar.runtime.verified import enter_verified, exit_verified, mark_unverified
from seqpar.sequence.boundaries import host_boundaries
from seqpar.sequence.call_group import call_group
from seqpar.swap.options import SwapError, SwapOptions
from seqpar.swap.state import is_probing
from seqpar.swap.together import raise_together
from seqpar.swap.traced import tracing

__all__ = ["install_batch_check", "input_row", "describe_inputs", "VALUE_KEYS", "Preparer", "FirstForward"]

# Keyword inputs whose *values* every rank must share (packed-document boundaries and lengths).
VALUE_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "cu_seqlens", "max_length_q", "max_length_k")
_MAX_VALUES = 1 << 16  # a cu_seqlens longer than this is compared by shape only

Preparer = Callable[[nn.Module, tuple, dict], tuple[tuple, dict]]
"""``(module, args, kwargs) -> (args, kwargs)``: fills in or validates inputs before the check;
raising refuses the batch (on every rank, see the module docstring)."""

FirstForward = Callable[[nn.Module, tuple, dict], None]
"""``(module, args, kwargs) -> None``: a check put off to the first forward (the position-mixing probe
of :mod:`seqpar.swap.probe`), run once after the preparers; raising refuses this and every later batch."""

_TENSOR, _NONE, _BOOL, _SEQ, _MAP, _OTHER = range(6)
_HOOK_ATTR = "_seqpar_batch_check"


def _code(text: str) -> int:
    return zlib.crc32(text.encode())


def _leaf_row(value: Any, name: str) -> list[int]:
    if isinstance(value, Tensor):
        row = [_TENSOR, value.dim(), *value.shape, _code(str(value.dtype)), _code(value.device.type)]
        if name in VALUE_KEYS and value.numel() <= _MAX_VALUES and not value.is_floating_point():
            if value.dim() == 1 and value.dtype in (torch.int32, torch.int64):
                values = list(host_boundaries(value))  # the batch's one host copy, shared with the layers
            else:
                values = value.reshape(-1).tolist()  # one host read per batch, only for packed batches
            row += [len(values), *values]
        return row
    if value is None:
        return [_NONE]
    if isinstance(value, bool):
        return [_BOOL, int(value)]
    return [_OTHER, _code(type(value).__qualname__)]


def input_row(value: Any, name: str = "", depth: int = 0) -> list[int]:
    """Integers describing a model input (tuples, lists and dicts walked, up to 8 levels)."""
    if depth < 8 and isinstance(value, (tuple, list)):
        row = [_SEQ, len(value)]
        for item in value:
            row += input_row(item, name, depth + 1)
        return row
    if depth < 8 and isinstance(value, Mapping):
        row = [_MAP, len(value)]
        for key in sorted(value, key=str):
            row += [_code(str(key)), *input_row(value[key], str(key), depth + 1)]
        return row
    return _leaf_row(value, name)


def describe_inputs(args: tuple, kwargs: Mapping[str, Any]) -> str:
    """A short, human description of the tensor inputs: ``input_ids(2, 8) int64, ...``."""
    parts = []

    def walk(value: Any, name: str, depth: int) -> None:
        if isinstance(value, Tensor):
            shown = f"{name}{tuple(value.shape)} {str(value.dtype).replace('torch.', '')}"
            if name in VALUE_KEYS and value.numel() <= 16:
                shown += f" = {value.tolist()}"
            parts.append(shown)
        elif depth < 8 and isinstance(value, (tuple, list)):
            for i, item in enumerate(value):
                walk(item, f"{name}[{i}]", depth + 1)
        elif depth < 8 and isinstance(value, Mapping):
            for key in sorted(value, key=str):
                walk(value[key], f"{name}.{key}" if name else str(key), depth + 1)
        elif isinstance(value, bool):
            parts.append(f"{name}={value}")

    for i, a in enumerate(args):
        walk(a, f"arg{i}", 0)
    walk(dict(kwargs), "", 0)
    return ", ".join(parts) or "no tensor inputs"


class _BatchCheck:
    """The pre-hook / post-hook pair of one swapped model."""

    def __init__(self, options: SwapOptions, swapped: Sequence[str], preparers: list[Preparer],
                 first_forward: FirstForward | None = None) -> None:
        self.options = options
        self.preparers = preparers
        self.first_forward = first_forward
        self.refused: BaseException | None = None  # the first-forward check's refusal, raised again each batch
        self.first_verdict = True  # no forward has passed the checks on every rank yet (see pre_hook)
        # Which modules were swapped, by route and name: ranks that swapped different models
        # would run different collectives.
        self.structure = [_code("\n".join(swapped)), len(swapped)]
        self.handles: tuple[Any, ...] = ()
        self.active: list[bool] = []  # one entry per running forward: did it enter the scope?

    def _prepare(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.refused is not None:
            raise self.refused
        for prepare in self.preparers:
            args, kwargs = prepare(module, args, kwargs)
        if self.first_forward is not None:
            check, self.first_forward = self.first_forward, None
            try:
                check(module, args, kwargs)
            except SwapError as e:
                self.refused = e
                raise
        return args, kwargs

    def pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if is_probing():  # the probe's own forwards: no check, no collective
            return None
        if tracing():
            return self._prepare_traced(module, args, kwargs)
        mark_unverified()
        self.active.append(False)
        if not self.options.check_inputs and not self.first_verdict:  # the user switched checking off
            return self._prepare(module, args, kwargs)
        group = resolve_group(call_group(kwargs, self.options.group))  # dynamic CP: the call's group
        world = 1 if group is None else dist.get_world_size(group)
        wide = _wider_forward_group(module, world)
        refusal: BaseException | None = None
        try:
            args, kwargs = self._prepare(module, args, kwargs)
        except (ValueError, TypeError) as e:
            if world == 1 and wide is None:
                raise
            refusal = e
        checking = self.options.check_inputs
        try:
            if world == 1:
                if refusal is not None:
                    raise refusal
            elif checking:
                self._agree(module, group, args, kwargs, refusal)
            else:
                # Until a forward passes on every rank (the first, normally), a refusal is collective even with
                # checking off: a rank whose first-forward probe has no verdict (its shard all padding) or whose
                # preparers accept its shard would otherwise wait in its first collective for ranks that raised.
                self._agree_verdict(module, group, refusal)
        except (ValueError, TypeError) as e:
            if wide is None:
                raise
            self._agree_wide(module, wide, e)
        if wide is not None:
            self._agree_wide(module, wide, None)
        self.first_verdict = False
        if not checking:
            return args, kwargs
        enter_verified()
        self.active[-1] = True
        return args, kwargs

    def _prepare_traced(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """While torch.compile traces the forward: the preparers only (their traced form), no collective,
        no verified scope (see :mod:`seqpar.swap.traced`: the batch comes prepared by shard_batch)."""
        if self.refused is not None:
            raise self.refused
        if self.first_forward is not None:
            raise SwapError(
                f"seqpar ({type(module).__name__}): torch.compile before the position-mixing probe ran: it runs "
                "at the swapped model's first forward (its parameters were not materialised at swap time) and "
                "cannot run in a traced forward. Run one eager forward of the swapped model first, then compile"
            )
        for prepare in self.preparers:
            args, kwargs = prepare(module, args, kwargs)
        return args, kwargs

    def _agree(self, module: nn.Module, group: dist.ProcessGroup, args: tuple, kwargs: dict,
               refusal: BaseException | None) -> None:
        ok = refusal is None
        row = [int(ok), *self.structure, *self.options.digest()]
        if ok:
            row += input_row(args) + input_row(kwargs)
        rows = rows_across_ranks(row, group)
        if rows is None:
            if refusal is not None:
                raise refusal  # every rank refused its batch, each with its own message
            return
        where = type(module).__name__
        refused = [r for r, other in enumerate(rows) if not other[0]]
        if refused:
            raise_together(group, refused, refusal, f"seqpar ({where}): SP rank(s) {refused} refused this batch",
                            "a collective")
        notes: list[str | None] = [None] * len(rows)
        dist.all_gather_object(notes, describe_inputs(args, kwargs), group=group)
        detail = "; ".join(f"rank {r}: {note}" for r, note in enumerate(notes))
        head = 1 + len(self.structure) + len(self.options.digest())  # verdict, model, options
        if all(other[:head] == rows[0][:head] for other in rows):
            what = "different inputs"
        else:
            what = "a different model or different sequence_parallel options"
        raise ValueError(
            f"seqpar ({where}): the ranks of the sequence-parallel group called the swapped model with "
            f"{what} ({detail}). Every rank of an SP group must pass its own shard of the same batch "
            "(same batch size, shard length, dtypes and packed-document boundaries): cut batches with "
            "seqpar.sequence.batch.shard_batch, and build and swap the same model with the same config on every rank"
        )

    def _agree_verdict(self, module: nn.Module, group: dist.ProcessGroup, refusal: BaseException | None) -> None:
        """The verdicts of a forward before any passed, with ``check_inputs`` off: one all-reduce of one
        flag per rank; on a refusal (then only) every rank's message, and every rank raises the same
        error. A first-forward check's refusal (the probe's) then refuses every later forward on every
        rank, with no collective."""
        refused = flagged_ranks(refusal is not None, group)
        if not refused:
            return
        said: list[Any] = [None] * dist.get_world_size(group)
        mine = None if refusal is None else (isinstance(refusal, SwapError), refusal is self.refused, str(refusal))
        dist.all_gather_object(said, mine, group=group)
        swap_error, lasting, text = said[refused[0]]
        error = (SwapError if swap_error else ValueError)(
            f"seqpar ({type(module).__name__}): SP rank(s) {refused} refused this batch (check_inputs is off, but "
            "until a forward passes, every refusal is collective); every rank stops here instead of waiting for "
            f"them in a collective. Rank {refused[0]} said: {text}"
        )
        if any(s is not None and s[1] for s in said):
            self.refused = error  # the probe's verdict holds for good: later forwards raise it at once
            self.first_verdict = False
        raise error from refusal

    def _agree_wide(self, module: nn.Module, wide: dist.ProcessGroup, error: BaseException | None) -> None:
        """The verdict of this forward over the group its forward gathers parameters over, wider than the SP
        (or call) group (ZeRO-3 or FSDP over DP x SP, a dynamic-CP pool): one all-reduce of one flag per rank.
        A rank whose SP group refused raises its own error; every other rank raises one naming the first
        refusing rank and its message, instead of waiting in the forward's first parameter gather."""
        refused = flagged_ranks(error is not None, wide)
        if refused:
            raise_together(wide, refused, error, f"seqpar ({type(module).__name__}): rank(s) {refused} of the "
                            f"{dist.get_world_size(wide)} ranks this model's forward gathers parameters over (ZeRO-3 "
                            "or FSDP over data and sequence parallelism) refused their batch", "a gather")

    def post_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        # always_call: also runs when the forward (or the pre-hook) raised.
        if is_probing() or tracing():
            return
        if self.active and self.active.pop():
            exit_verified()


def _wider_forward_group(module: nn.Module, world: int) -> dist.ProcessGroup | None:
    """The group ``module``'s forward gathers parameters over (:func:`seqpar.runtime.forward_group.forward_group`)
    when it has more ranks than the SP (or call) group of ``world`` ranks, else None."""
    wide = forward_group(module)
    return wide if wide is not None and dist.get_world_size(wide) > world else None


def install_batch_check(
    model: nn.Module, options: SwapOptions, swapped: Sequence[str], preparers: Sequence[Preparer] = (),
    first_forward: FirstForward | None = None,
) -> None:
    """Check ``model``'s inputs across the SP group once per forward (replacing an earlier check).

    Args:
        model: the module the user calls once per batch (the one given to ``swap_attention``).
        options: the swapped layers' options (compared across ranks, and their group is used).
        swapped: ``"route name"`` of every swapped module (compared across ranks).
        preparers: input fillers/validators run before the check (e.g. the Hugging Face one).
        first_forward: run once, at the first forward, after the preparers (the position-mixing probe
            when it could not run at swap time); a refusal is raised on every rank of the SP group.
    """
    old: _BatchCheck | None = getattr(model, _HOOK_ATTR, None)
    if old is not None:
        for handle in old.handles:
            handle.remove()
    check = _BatchCheck(options, list(swapped), list(preparers), first_forward)
    check.handles = (
        model.register_forward_pre_hook(check.pre_hook, with_kwargs=True),
        model.register_forward_hook(check.post_hook, always_call=True),
    )
    setattr(model, _HOOK_ATTR, check)


def installed_check(model: nn.Module) -> Any | None:
    """The batch check installed on ``model``, if any (for tests and tools)."""
    return getattr(model, _HOOK_ATTR, None)

