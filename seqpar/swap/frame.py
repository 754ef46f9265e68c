"""One call's state, carried by a frame for the length of the call: the state the swap's hooks hand to
code that transformers calls without the call's arguments.

transformers threads a swapped model's keyword arguments (dynamic CP's :data:`~seqpar.sequence.call_group.GROUP_KEY`
among them) to every attention call and to the loss function, but not to everything seqpar takes over:
an MLA layer's ``expand_kv`` (:mod:`seqpar.swap.mla`) and the router losses and expert counts
(:mod:`seqpar.swap.moe`) are called without them. So the swapped module's call pushes a
:class:`CallFrame` (a forward pre-hook, :func:`hold_calls`) and pops it when the call ends (a forward hook
that runs even when the forward raised); the code inside reads the call's group, the batch's token mask and
(MLA) the layer's latent from the frame. The frame lives on a per-thread stack (innermost last) and never on
a module attribute, so:

- two forwards before their backwards each hold their own frame (the backward reads nothing from it: what a
  backward needs, autograd saved in the forward);
- a recompute under activation checkpointing, which replays the layer's call and its keyword arguments,
  pushes a frame of its own with its own micro-batch's group;
- a deep copy of a model holds its own hooks, and its calls their own frames.

Who pushes: every ``transformers.PreTrainedModel`` of a swapped model (the group its call carries; the token
mask, which the input preparer hands over) and every MLA attention layer whose K/V move as the latent.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch import Tensor, nn

from seqpar.runtime.groups import resolve_group
from seqpar.runtime.thread_state import ThreadState
from seqpar.sequence.call_group import GROUP_KEY, call_group

__all__ = ["CallFrame", "frames", "enter", "leave", "frame_of", "innermost", "carried_group", "token_mask",
           "hold_calls"]

_HOOKS_ATTR = "_seqpar_call_frame_hooks"  # the handles of hold_calls' two hooks on a module

# this thread's running calls (list[CallFrame], innermost last), set on the thread's first use (ThreadState:
# torch.compile guards on it, and a missing one on a new thread would recompile)
_local = ThreadState(stack=list)


class CallFrame:
    """One running call of a swapped module (``owner``: a model, or an MLA layer).

    ``group``: the SP group the call runs over, resolved (the group the call carries, else the swap's);
    ``carried``: the group the call carries (dynamic CP, :data:`GROUP_KEY`), None when it carries none;
    ``token_mask``: ``(batch, seq_local)`` the batch's token mask (0 on padding), given to a model's call;
    ``latent``: an MLA layer's latent, stashed by its ``expand_kv`` for its attention call to take."""

    def __init__(self, owner: nn.Module, group: dist.ProcessGroup | None,
                 carried: dist.ProcessGroup | None = None) -> None:
        self.owner = owner
        self.group = group
        self.carried = carried
        self.token_mask: Tensor | None = None
        self.latent: Any = None


def frames() -> list[CallFrame]:
    """This thread's stack of running calls (innermost last)."""
    return _local.stack


def enter(owner: nn.Module, kwargs: dict[str, Any], default: dist.ProcessGroup | None) -> CallFrame:
    """Push the frame of ``owner``'s call with keyword arguments ``kwargs``; ``default``: the swap's group,
    for a call that carries none."""
    frame = CallFrame(owner, resolve_group(call_group(kwargs, default)), kwargs.get(GROUP_KEY))
    frames().append(frame)
    return frame


def leave(owner: nn.Module) -> CallFrame | None:
    """Pop the innermost frame if it is ``owner``'s (else nothing: a pre-hook that raised pushed none) and
    return it."""
    stack = frames()
    if stack and stack[-1].owner is owner:
        return stack.pop()
    return None


def frame_of(owner: nn.Module) -> CallFrame | None:
    """The frame of ``owner``'s innermost running call on this thread, None outside one."""
    return next((f for f in reversed(frames()) if f.owner is owner), None)


def innermost() -> CallFrame | None:
    """The innermost running call's frame, None outside every swapped call."""
    stack = frames()
    return stack[-1] if stack else None


def carried_group() -> dist.ProcessGroup | None:
    """The group the running calls carry (innermost first; nested calls share the outermost's), None outside
    one or when none carries one."""
    return next((f.carried for f in reversed(frames()) if f.carried is not None), None)


def token_mask() -> Tensor | None:
    """The running batch's token mask (given to the outermost model's call; nested calls share it)."""
    return next((f.token_mask for f in reversed(frames()) if f.token_mask is not None), None)


def hold_calls(module: nn.Module, group: dist.ProcessGroup | None,
               on_leave: Callable[[CallFrame], None] | None = None) -> None:
    """Hook ``module`` so that each of its calls holds a frame (:func:`enter` with ``group``, the swap's) for
    its length. Again on the same module: the earlier hooks are replaced (a second swap's group wins).
    ``on_leave(frame)`` runs as the frame is popped, also when the forward raised (then what it raises is
    only warned about by torch). Forward hooks registered on ``module`` *before* this run inside the frame;
    those registered after it run outside."""
    for handle in module.__dict__.get(_HOOKS_ATTR, ()):
        handle.remove()

    def pre(mod: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        enter(mod, kwargs, group)

    def post(mod: nn.Module, args: tuple, output: Any) -> None:
        frame = leave(mod)
        if frame is not None and on_leave is not None:
            on_leave(frame)

    setattr(module, _HOOKS_ATTR, (module.register_forward_pre_hook(pre, with_kwargs=True),
                                  module.register_forward_hook(post, always_call=True)))
