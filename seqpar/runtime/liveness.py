"""Liveness: when a collective fails, name the rank that was lost.

A peer that dies (SIGKILL, preemption), stalls (SIGSTOP, an endless loop) or raises leaves the others
with only their backend's error: gloo's ``Connection closed by peer [127.0.0.1]:port`` or ``Timed out
waiting ...``, NCCL's watchdog timeout. None of them says which rank was lost, and on many nodes that
is the first thing to know. So every rank of a world of more than one runs a :class:`Heartbeat`:

- a daemon thread writes this rank's wall time into the rendezvous store (the ``TCPStore`` that
  torch.distributed was initialised from, reached through a client connection of its own) every
  ``interval_s`` (``timeout_s / 10``, between 0.1 and 2 s);
- a rank dying of an uncaught Python exception records ``"rank R: <ExcType>: <message>"`` there;
- when a collective fails, :meth:`Heartbeat.diagnose` reads every rank's heartbeat twice, a little
  more than two intervals apart, and names the ranks whose heartbeat stood still ("killed, preempted
  or stopped"), the exceptions recorded, and whether the timeout elapsed. When the store itself does
  not answer, it says so and names the store's host (the lost one, most likely).

How the diagnosis reaches the user: seqpar's own exchanges (:class:`seqpar.comm.ring.Pending`)
re-raise a failed wait as :class:`PeerFailure` carrying it, and for a collective that fails in other
code (the user's DP all-reduce, DeepSpeed's gradient reduce) a chained ``sys.excepthook``, installed
while a heartbeat runs, prints ``seqpar: rank R: a collective failed ...`` before the traceback.

Cost: one small store write per rank per interval, from a thread that holds the GIL for microseconds;
no tensor, no collective and no host sync on the training step. Every store call is bounded by the
client's own timeout, so neither the heartbeat nor the diagnosis can hang.

Public surface: :func:`start` / :meth:`Heartbeat.release` (called by
:func:`seqpar.runtime.groups.init_process_groups` and :meth:`seqpar.runtime.groups.ProcessGroupManager.destroy`),
:func:`active`, :func:`explain`, :class:`PeerFailure`, and the pure :func:`describe` for tests.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from types import TracebackType
from typing import Any, NoReturn

import torch.distributed as dist

__all__ = [
    "Heartbeat",
    "PeerFailure",
    "Observation",
    "active",
    "describe",
    "explain",
    "heartbeat_interval",
    "is_collective_failure",
    "reraise",
    "start",
]

logger = logging.getLogger("seqpar")

PREFIX = "seqpar/liveness/"
_DONE = "done"
_FAILED = "failed"  # "R1 R2 ...": the ranks that recorded an exception
_MAX_MESSAGE = 400
# What the backends say when a peer is gone or late: gloo ("Connection closed by peer", "Timed out
# waiting 5000ms for recv operation"), NCCL ("Watchdog caught collective operation timeout", "NCCL
# error"), the store ("Socket Timeout"), and torch's own DistError family (checked by type too).
_COLLECTIVE_RE = re.compile(
    r"connection (closed|reset|refused)|broken pipe|timed out|timeout|gloo|nccl|processgroup|socket", re.IGNORECASE
)
_TIMEOUT_RE = re.compile(r"timed out|timeout", re.IGNORECASE)


class PeerFailure(RuntimeError):
    """A collective of seqpar failed because a peer was lost or late; the message names them.

    Raised from the backend's own error (``raise PeerFailure(...) from error``)."""


def heartbeat_interval(timeout_s: float | None) -> float:
    """Seconds between two heartbeats: a tenth of the collective timeout, within [0.1, 2] s (torch's
    default timeout when ``timeout_s`` is None), so a lost rank shows well inside the timeout."""
    return min(max((timeout_s or 1800.0) / 10.0, 0.1), 2.0)


def is_collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` looks like a failed collective or store call (a peer lost or late), as
    opposed to an error of the rank's own (which :class:`Heartbeat` records for the others)."""
    if isinstance(exc, PeerFailure):
        return True
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(exc, dist_error):
        return True
    return isinstance(exc, RuntimeError) and bool(_COLLECTIVE_RE.search(str(exc)))


# ---------------------------------------------------------------------------- the diagnosis (pure)
@dataclass
class Observation:
    """What one rank saw of the others' heartbeats. Values are the store's strings: a wall time in
    seconds, ``"done"`` (the rank left cleanly) or ``None`` (never written)."""

    before: dict[int, str | None]
    after: dict[int, str | None]
    now: float
    """This rank's wall time at the second read."""
    window_s: float
    """Seconds between the two reads."""
    errors: dict[int, str] = field(default_factory=dict)
    """rank -> the exception it recorded before it exited."""


def describe(obs: Observation, me: int) -> str:
    """The exceptions the peers recorded, the ranks not heard from during ``obs`` (the stalest first,
    the likely first loss) and the ranks that left: one line, ``""`` when every peer's heartbeat advanced and
    none recorded an exception."""
    lost: list[tuple[float, str]] = []
    left = []
    for rank in sorted(obs.after):
        if rank == me or rank in obs.errors:
            continue
        before, after = obs.before.get(rank), obs.after[rank]
        if after == _DONE:
            left.append(rank)
        elif after is None:
            lost.append((float("inf"), f"rank {rank} was never heard from (it died or hung before its first heartbeat)"))
        elif after == before:
            age = obs.now - float(after)
            lost.append((age, f"rank {rank} was lost (no heartbeat for {age:.1f} s; killed, preempted or stopped)"))
    parts = [f"{obs.errors[r]} (an exception this rank recorded before it exited)" for r in sorted(obs.errors) if r != me]
    parts += [text for _, text in sorted(lost, key=lambda item: -item[0])]
    if left:
        parts.append(f"rank{'s' if len(left) > 1 else ''} {', '.join(map(str, left))} had already left "
                     "(destroyed its process groups)")
    return "; ".join(parts)


# ---------------------------------------------------------------------------- the store
def _store_address() -> tuple[str, int] | None:
    """Host and port of the TCPStore torch.distributed was initialised from, or None.

    The default store is reached through a private torch name (``_get_default_store``), kept to this
    one function: it gives the exact store whatever the init method (``env://``, ``tcp://``, torchrun's
    agent store). Without it, ``MASTER_ADDR`` / ``MASTER_PORT`` (env:// and every launcher) name it.
    """
    try:
        from torch.distributed.distributed_c10d import _get_default_store  # private; fallback below

        store = _get_default_store()
        while isinstance(store, dist.PrefixStore):
            store = store.underlying_store
        if isinstance(store, dist.TCPStore):
            return store.host, int(store.port)
    except Exception:  # noqa: BLE001 - renamed or absent in this torch, or no default group: use the environment
        pass
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
    return (addr, int(port)) if addr and port.isdigit() else None


_CLIENTS: dict[tuple[str, int], dist.Store] = {}


def _connect(host: str, port: int, timeout_s: float) -> dist.Store:
    """A client connection of our own to the store (its own timeout bounds every call on it), kept
    for the process: init / destroy cycles reuse it instead of opening a socket each time."""
    client = _CLIENTS.get((host, port))
    if client is None:
        client = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s),
                               wait_for_workers=False)
        _CLIENTS[(host, port)] = client
    client.set_timeout(timedelta(seconds=timeout_s))
    return dist.PrefixStore(PREFIX, client)


def _read(store: dist.Store, keys: dict[int, str]) -> dict[int, str | None]:
    """rank -> value of each key, None when unset. One round trip when every key is set (the usual
    case for heartbeats); else ``check`` each first, since ``get`` of a missing key waits."""
    names = list(keys.values())
    if names and store.check(names):
        return {rank: value.decode() for rank, value in zip(keys, store.multi_get(names))}
    return {rank: store.get(key).decode() if store.check([key]) else None for rank, key in keys.items()}


# ---------------------------------------------------------------------------- the heartbeat
class Heartbeat:
    """This rank's heartbeat in ``store`` and the diagnosis of the others' (see the module docstring).

    Args:
        store: the shared store, any ``torch.distributed.Store`` (keys are written under it as given).
        rank, world_size: this rank's global rank and the world size.
        timeout_s: the collectives' timeout, named in the diagnosis; sets the interval.
        store_host: ``"host:port"`` of the store, named when it does not answer.
        interval_s: seconds between heartbeats (default :func:`heartbeat_interval`).
    """

    def __init__(
        self, store: dist.Store, rank: int, world_size: int, *, timeout_s: float | None = None,
        store_host: str = "the rendezvous store", interval_s: float | None = None,
    ) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.timeout_s = timeout_s
        self.store_host = store_host
        self.interval_s = interval_s if interval_s is not None else heartbeat_interval(timeout_s)
        self.users = 0  # managers holding it (see start / release)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._store_error: BaseException | None = None

    @staticmethod
    def key(rank: int) -> str:
        return f"hb/{rank}"

    @staticmethod
    def error_key(rank: int) -> str:
        return f"error/{rank}"

    # ---- life cycle
    def beat(self) -> None:
        """Write this rank's wall time (what the thread does every interval)."""
        self.store.set(self.key(self.rank), f"{time.time():.3f}")

    def start(self) -> Heartbeat:
        """Write the first heartbeat now (peers can tell a rank that never started), then keep
        writing from a daemon thread."""
        self.beat()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=f"seqpar-heartbeat-{self.rank}", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.beat()
                self._store_error = None
            except Exception as e:  # noqa: BLE001 - the store is gone: the diagnosis will say so
                if self._store_error is None:
                    logger.debug("[rank %d] seqpar heartbeat: store write failed: %s", self.rank, e)
                self._store_error = e

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, *, left: bool = True) -> None:
        """Stop the thread (bounded join); ``left``: mark this rank as gone cleanly, not lost."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 5.0)
            self._thread = None
        if left:
            try:
                self.store.set(self.key(self.rank), _DONE)
            except Exception:  # noqa: BLE001 - best effort: the store may already be gone
                pass

    def release(self) -> None:
        """One holder fewer (:meth:`ProcessGroupManager.destroy`); the last one stops the heartbeat
        and removes the exception hook."""
        self.users -= 1
        if self.users <= 0:
            _shutdown(self)

    # ---- the failure side
    def record_exception(self, exc: BaseException) -> None:
        """Record ``"rank R: <ExcType>: <message>"`` for the peers' diagnosis (bounded; best effort)."""
        message = " ".join(str(exc).split())[:_MAX_MESSAGE]
        try:
            self.store.set(self.error_key(self.rank), f"rank {self.rank}: {type(exc).__name__}: {message}")
            self.store.append(_FAILED, f"{self.rank} ")  # the index: readers need not scan every rank
        except Exception:  # noqa: BLE001 - the store may be gone; the traceback still prints
            pass

    def observe(self, window_s: float | None = None) -> Observation:
        """Read every rank's heartbeat, wait ``window_s`` (default two intervals and a bit), read again.
        Raises what the store raises when it does not answer (within its timeout)."""
        window_s = 2 * self.interval_s + 0.1 if window_s is None else window_s
        keys = {r: self.key(r) for r in range(self.world_size)}
        before = _read(self.store, keys)
        time.sleep(window_s)
        after = _read(self.store, keys)
        failed = self.store.get(_FAILED).decode().split() if self.store.check([_FAILED]) else []
        errors = {r: v for r, v in _read(self.store, {int(r): self.error_key(int(r)) for r in set(failed)}).items() if v}
        return Observation(before=before, after=after, now=time.time(), window_s=window_s, errors=errors)

    def diagnose(self, exc: BaseException | None = None) -> str:
        """``"seqpar: rank R: a collective failed (...): <who was lost>"``, in bounded time."""
        what = "a collective failed"
        if exc is not None and _TIMEOUT_RE.search(str(exc)):
            limit = f"timeout_s={self.timeout_s:g}" if self.timeout_s else "process group's timeout"
            what = f"a collective timed out (the {limit} elapsed)"
        elif exc is not None:
            what = "a collective failed (a peer's connection closed or failed)"
        try:
            found = describe(self.observe(), self.rank)
        except Exception as e:  # noqa: BLE001 - a store that does not answer is itself the finding
            found = (f"the rendezvous store at {self.store_host} did not answer ({' '.join(str(e).split())[:200]}); "
                     "its host was probably lost (node 0's launcher agent, or rank 0 when no agent hosts it)")
        if not found:
            found = ("every peer's heartbeat is still running and none recorded an exception: a rank is alive "
                     "but did not reach this collective in time (a stall in Python, a deadlock, or ranks calling "
                     "different collectives)")
        return f"seqpar: rank {self.rank}: {what}: {found}"


# ---------------------------------------------------------------------------- process-wide instance
_ACTIVE: Heartbeat | None = None
_LOCK = threading.Lock()
_PREVIOUS_HOOK: Any = None


def active() -> Heartbeat | None:
    """The heartbeat running in this process, if any."""
    return _ACTIVE


def start(rank: int, world_size: int, timeout_s: float | None) -> Heartbeat | None:
    """Start (or join) this process's heartbeat in the rendezvous store, and chain the exception hook.

    Returns None for a world of one, or when no TCPStore can be found or reached (the diagnosis is then
    simply absent: failures still raise, as before). Each call must be matched by one
    :meth:`Heartbeat.release`.
    """
    global _ACTIVE, _PREVIOUS_HOOK
    if world_size <= 1:
        return None
    with _LOCK:
        hb = _ACTIVE
        if hb is not None and hb.rank == rank and hb.world_size == world_size and hb.running:
            hb.users += 1
            if timeout_s is not None:
                # The joining manager's collectives run now, with its timeout: the diagnosis names it, and the
                # beat is kept fast enough for the shortest timeout of the managers sharing the heartbeat
                hb.timeout_s = timeout_s
                hb.interval_s = min(hb.interval_s, heartbeat_interval(timeout_s))
            return hb
        if hb is not None:
            _shutdown(hb, locked=True)
        address = _store_address()
        if address is None:
            logger.debug("[rank %d] seqpar liveness: no TCPStore address; failures will not name the lost rank", rank)
            return None
        interval = heartbeat_interval(timeout_s)
        try:
            store = _connect(*address, timeout_s=max(2.0, 2 * interval))
            hb = Heartbeat(store, rank, world_size, timeout_s=timeout_s, store_host=f"{address[0]}:{address[1]}",
                           interval_s=interval).start()
        except Exception as e:  # noqa: BLE001 - liveness is a diagnosis aid, never a reason to fail training
            _CLIENTS.pop(address, None)
            logger.warning("[rank %d] seqpar liveness: store %s:%s not reachable (%s); failures will not name "
                           "the lost rank", rank, address[0], address[1], e)
            return None
        hb.users = 1
        _ACTIVE = hb
        if sys.excepthook is not _excepthook:
            _PREVIOUS_HOOK = sys.excepthook
            sys.excepthook = _excepthook
        return hb


def _shutdown(hb: Heartbeat, *, locked: bool = False, left: bool = True) -> None:
    global _ACTIVE, _PREVIOUS_HOOK
    if not locked:
        with _LOCK:
            return _shutdown(hb, locked=True, left=left)
    hb.stop(left=left)
    if _ACTIVE is hb:
        _ACTIVE = None
        if sys.excepthook is _excepthook and _PREVIOUS_HOOK is not None:
            sys.excepthook = _PREVIOUS_HOOK  # a hook chained after ours stays; ours then passes through
            _PREVIOUS_HOOK = None
    return None


def explain(error: BaseException) -> PeerFailure | None:
    """The :class:`PeerFailure` to raise from ``error`` (a failed wait in seqpar's own collectives),
    naming the lost ranks; None when ``error`` is not a collective failure or no heartbeat runs."""
    hb = _ACTIVE
    if hb is None or isinstance(error, PeerFailure) or not is_collective_failure(error):
        return None
    return PeerFailure(f"{hb.diagnose(error)}\n{error}")


def reraise(error: BaseException) -> NoReturn:
    """Raise :func:`explain`'s :class:`PeerFailure` from ``error`` when there is one, else ``error``
    itself (use in an ``except`` around a wait of seqpar's own collectives)."""
    failure = explain(error)
    if failure is None:
        raise error
    raise failure from error


def _explained(exc: BaseException) -> bool:
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, PeerFailure):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _excepthook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    """Before the traceback: diagnose a failed collective, or record this rank's own exception."""
    hb = _ACTIVE
    try:
        if hb is not None and isinstance(exc, Exception):
            if not is_collective_failure(exc):
                hb.record_exception(exc)
            elif not _explained(exc):
                print(hb.diagnose(exc), file=sys.stderr, flush=True)
    except Exception:  # noqa: BLE001 - never hide the original traceback
        pass
    (_PREVIOUS_HOOK or sys.__excepthook__)(exc_type, exc, tb)


def _forget_in_child() -> None:
    # A forked child (a DataLoader worker) has no heartbeat thread and must not write on the parent's
    # store connection: it starts with no heartbeat, no client and the hook it inherited passing through.
    global _ACTIVE, _LOCK
    _ACTIVE = None
    _CLIENTS.clear()
    _LOCK = threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)


@atexit.register
def _stop_at_exit() -> None:
    # A daemon thread inside a store call at interpreter shutdown can abort the process: stop it first.
    hb = _ACTIVE
    if hb is not None:
        _shutdown(hb, left=False)
