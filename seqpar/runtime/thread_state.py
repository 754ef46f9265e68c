"""Per-thread state that ``torch.compile`` can guard without recompiling on every new thread.

Code dynamo traced guards on the thread-local attributes it read. A ``threading.local`` whose attributes are
created lazily (``getattr(local, "stack", None)``, then set) lacks them on a thread's first call, so a
compiled call on a new thread fails the guard and recompiles (seen: 35 s per thread for a tiny model).
:class:`ThreadState` creates every attribute on each thread's first use.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

__all__ = ["ThreadState"]


class ThreadState(threading.local):
    """``ThreadState(stack=list, depth=int)``: on each thread, ``stack`` is its own ``list()`` and ``depth`` its
    own ``int()`` from the first access on (``threading.local`` calls ``__init__`` once per thread with the
    constructor's arguments)."""

    def __init__(self, **factories: Callable[[], Any]) -> None:
        for name, make in factories.items():
            setattr(self, name, make())
