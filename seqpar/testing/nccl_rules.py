"""NCCL's rules, enforced on gloo: a test communicator that fails where NCCL would hang or corrupt.

gloo forgives what NCCL does not. While :func:`nccl_rules` is active, this rank's torch.distributed
calls (the collectives, ``batch_isend_irecv``, and :mod:`seqpar.comm.compat`'s helpers) are checked
against three of NCCL's rules:

1. **Lazy communicator set-up joins every member.** NCCL creates a group's communicator at the
   group's first operation (a collective, or a batched point-to-point exchange, which uses the
   group's communicator), and that set-up blocks until every member of the group has reached its own
   first operation on the group. Modelled exactly: a rank's first operation on a group is a
   rendezvous of all members in a side-channel store; a member that does not arrive within
   ``init_timeout_s`` (a ring rank with no hop in the step, whose first operation on the group comes
   later or never) makes the waiting ranks raise :class:`NcclRuleError`, naming the group, the ranks
   missing and the operation that waited. A group initialised at creation by a collective of all its
   members (:mod:`seqpar.runtime.communicators`) passes at creation.
2. **Point-to-point messages pair by order, not by tag.** NCCL ignores tags: between two ranks on one
   communicator, the n-th send meets the n-th receive. gloo pairs by tag, so an exchange whose two
   sides post their operations in different orders runs on gloo and corrupts (or hangs) on NCCL.
   Every ``batch_isend_irecv`` operation is recorded; on leaving the block, the ranks publish their
   records in the store and every rank checks that, for each (group, sender, receiver), the n-th send
   and the n-th receive agree in tag, shape and dtype.
3. **A buffer belongs to the communicator from post to ``wait()``.** On NCCL, ``wait()`` orders the
   streams, not the host: the transfer reads a send buffer and writes a receive buffer at any time
   between the post and the ``wait()`` (NCCL's work object keeps the tensors alive until then, so
   freeing or reusing them after ``wait()`` is safe). With ``buffers=True``: the data sent is a
   snapshot taken at the post, and a send buffer that differs from it at ``wait()`` raises (seqpar
   wrote into it before the send was complete); a receive buffer is poisoned (NaN, or the dtype's
   maximum) from the post until ``wait()`` copies the message in, so a read before the ``wait()`` gives
   poison and a write before it raises; a work never waited raises on leaving the block. The same holds
   for the asynchronous collectives seqpar pipelines (``all_to_all_single``, all-gather and
   reduce-scatter into a tensor, with ``async_op=True``): input snapshotted, output poisoned.

   With ``sends="late"`` the rule is modelled literally instead of checked: a point-to-point send
   transmits its buffer **as it is at the send's** ``wait()`` (the latest moment NCCL may read it), not
   as it was at the post. Nothing is compared: a write into a send buffer before its ``wait()`` simply
   changes what the peer receives, as it may on NCCL, and the results say so. The message travels
   through the store: the sender's ``wait()`` publishes the buffer's bytes under the (group, sender,
   receiver, message number) key, and the receiver's ``wait()`` blocks until they are there (up to
   ``init_timeout_s``; a send never waited then raises on the receiver). gloo still carries a copy made
   at the post, so that rules 1 and 2 and gloo's own pairing see the real traffic; its content is
   discarded. Receive buffers are poisoned until ``wait()`` in both modes.

Used by ``tests/test_nccl_rules.py`` over every mode x documents x windows. Not for production runs.
"""

from __future__ import annotations

import contextlib
import inspect
import pickle
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from seqpar.comm import compat

__all__ = ["NcclRuleError", "NcclRules", "nccl_rules", "COLLECTIVES"]

COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor",
    "reduce_scatter_single", "reduce_scatter", "all_to_all_single", "all_to_all", "broadcast", "barrier",
    "monitored_barrier", "all_gather_object", "broadcast_object_list", "gather", "scatter", "reduce",
    "gather_object", "scatter_object_list",
)
"""The torch.distributed collectives checked (rule 1) while :func:`nccl_rules` is active."""


class NcclRuleError(AssertionError):
    """An operation NCCL would hang on or corrupt (see the module docstring). An ``AssertionError``: a
    test failure, which seqpar's own waits do not mistake for a lost peer."""


def _poison(t: torch.Tensor) -> None:
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    else:
        t.fill_(torch.iinfo(t.dtype).max)


def _is_poison(t: torch.Tensor) -> bool:
    if t.is_floating_point() or t.is_complex():
        return bool(torch.isnan(t).all())
    if t.dtype == torch.bool:
        return bool(t.all())
    return bool((t == torch.iinfo(t.dtype).max).all())


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN payloads included), for contiguous tensors of one dtype and shape."""
    if a.numel() == 0:
        return True
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@dataclass
class _Record:
    """One point-to-point operation, as the order check sees it."""

    group: tuple[str, int]  # (group name, incarnation)
    src: int  # global ranks
    dst: int
    tag: int
    shape: tuple[int, ...]
    dtype: str
    batch: int  # the poster's batch number (for messages)


def _to_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _from_bytes(data: bytes, like: torch.Tensor) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(like.dtype).reshape(like.shape)


class _CheckedWork:
    """A work whose ``wait()`` enforces rule 3 on ``buffers=True`` (see the module docstring): its
    ``(kind, user buffer, private copy, key)`` entries are checked, and received data copied in, at
    ``wait()``. Kinds: ``"send"`` / ``"recv"`` (the private copy is what gloo carries) and, for
    ``sends="late"``, ``"late-send"`` / ``"late-recv"`` (the message goes through the store under ``key``
    at the sender's ``wait()``)."""

    def __init__(self, rules: NcclRules, work: Any, buffers: list[tuple[str, torch.Tensor, torch.Tensor, str]],
                 what: str) -> None:
        self._rules, self._work, self._buffers, self.what = rules, work, buffers, what
        self.waited = False

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        result = self._work.wait(*args, **kwargs)
        if self.waited:
            return result
        self.waited = True
        for kind, user, mine, key in self._buffers:
            if kind == "late-send":  # what the peer gets: this buffer now, at the send's wait()
                self._rules.store.set(key, _to_bytes(user))
                continue
            if kind == "late-recv":
                mine = self._rules.late_message(key, user, self.what)
                kind = "recv"
            if kind == "send" and not _same_bits(user, mine):
                raise NcclRuleError(
                    f"rank {self._rules.rank}: the send buffer of {self.what} was written between the post and its "
                    "wait(); on NCCL the transfer may still be reading it (wait() orders streams, not the host), so "
                    "the peer may receive either value. Write into a send buffer only after its wait()"
                )
            if kind == "recv":
                if not _is_poison(user):
                    raise NcclRuleError(
                        f"rank {self._rules.rank}: the receive buffer of {self.what} was written before its wait(); "
                        "on NCCL the incoming message may land after that write. Touch a receive buffer only after "
                        "wait()"
                    )
                user.copy_(mine)
        return result

    def is_completed(self) -> bool:
        return self.waited and self._work.is_completed()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


# Asynchronous collectives whose buffers rule 3 covers: name -> (output, input) positions.
_ASYNC_BUFFERS = {
    "all_to_all_single": (0, 1), "all_gather_into_tensor": (0, 1), "all_gather_single": (0, 1),
    "reduce_scatter_tensor": (0, 1), "reduce_scatter_single": (0, 1),
}


@dataclass
class NcclRules:
    """What :func:`nccl_rules` checks on this rank, and what it saw (a live record)."""

    store: dist.Store
    prefix: str
    rank: int
    world_size: int
    init_timeout_s: float
    buffers: bool
    sends: str = "checked"
    """``"checked"``: a send carries its buffer as at the post, and a write before ``wait()`` raises;
    ``"late"``: it carries the buffer as at its ``wait()`` (see the module docstring)."""
    initialized: dict[Any, tuple[str, int]] = field(default_factory=dict)
    """Group object -> (name, incarnation) for every group whose set-up rendezvous this rank passed."""
    first_ops: list[tuple[str, str]] = field(default_factory=list)
    """(group name, the operation that set it up) in order: what made each communicator."""
    records: list[_Record] = field(default_factory=list)
    works: list[_CheckedWork] = field(default_factory=list)
    _incarnations: dict[str, int] = field(default_factory=dict)
    _batches: int = 0
    _messages: dict[tuple, int] = field(default_factory=dict)  # (group, src, dst, direction) -> posted so far

    def _late_key(self, group: tuple[str, int], src: int, dst: int, sending: bool) -> str:
        """The store key of the n-th message from ``src`` to ``dst`` on ``group`` (NCCL pairs by order:
        the n-th send meets the n-th receive, which counts its own side the same way)."""
        count = (group, src, dst, sending)
        n = self._messages.get(count, 0)
        self._messages[count] = n + 1
        return f"{self.prefix}/late/{group[0]}/{group[1]}/{src}-{dst}/{n}"

    def late_message(self, key: str, like: torch.Tensor, what: str) -> torch.Tensor:
        """The message under ``key`` (published by the sender's ``wait()``), shaped like ``like``."""
        try:
            self.store.wait([key], timedelta(seconds=self.init_timeout_s))
        except RuntimeError as error:
            raise NcclRuleError(
                f"rank {self.rank}: {what}: the sender never waited its send within {self.init_timeout_s:g} s "
                "(sends='late' delivers a message at the sender's wait(); on NCCL the compute stream would "
                "never be ordered after it)"
            ) from error
        return _from_bytes(self.store.get(key), like)

    # ------------------------------------------------------------ rule 1: lazy set-up rendezvous
    def _set_up(self, group: Any, what: str) -> None:
        name = str(group.group_name)
        incarnation = self._incarnations.get(name, 0)
        self._incarnations[name] = incarnation + 1
        members = dist.get_process_group_ranks(group)
        base = f"{self.prefix}/init/{name}/{incarnation}"
        self.store.set(f"{base}/{self.rank}", what)
        try:
            self.store.wait([f"{base}/{m}" for m in members], timedelta(seconds=self.init_timeout_s))
        except RuntimeError as error:  # the store's timeout (DistStoreError is one)
            missing = [m for m in members if not self.store.check([f"{base}/{m}"])]
            if missing:
                raise NcclRuleError(
                    f"rank {self.rank}: the first operation on group {members} ({what}) is where NCCL creates the "
                    f"group's communicator, and every member must join; ranks {missing} issued no operation on it "
                    f"within {self.init_timeout_s:g} s (on NCCL: a hang until the timeout). A rank with nothing to "
                    "exchange in a step never joins: initialise the group when it is made, by a collective of all "
                    "its members (seqpar.runtime.communicators.init_communicator)"
                ) from error
        self.initialized[group] = (name, incarnation)
        self.first_ops.append((name, what))

    def before(self, what: str, group: Any) -> None:
        group = dist.group.WORLD if group is None else group
        if group not in self.initialized:
            self._set_up(group, what)

    # ------------------------------------------------------------ rules 2 and 3: batched P2P
    def batch_isend_irecv(self, original: Callable[..., Any], ops: Sequence[Any]) -> list[Any]:
        groups = []
        for op in ops:
            g = dist.group.WORLD if op.group is None else op.group
            if g not in groups:
                groups.append(g)
        for g in groups:
            self.before("batch_isend_irecv (a batched point-to-point exchange)", g)
        self._batches += 1
        posted, checks = [], []
        for op in ops:
            group = dist.group.WORLD if op.group is None else op.group
            peer = op.peer if op.peer is not None else dist.get_global_rank(group, op.group_peer)
            sending = op.op.__name__ == "isend"
            src, dst = (self.rank, peer) if sending else (peer, self.rank)
            t = op.tensor
            self.records.append(_Record(self.initialized[group], src, dst, op.tag, tuple(t.shape), str(t.dtype),
                                        self._batches))
            what = (f"{'isend to' if sending else 'irecv from'} rank {peer} (tag {op.tag}, {tuple(t.shape)} "
                    f"{t.dtype}, batch {self._batches})")
            if not self.buffers:
                posted.append(op)
                continue
            mine = t.clone(memory_format=torch.contiguous_format) if sending else torch.empty_like(t)
            if not sending:
                _poison(t)
            posted.append(dist.P2POp(op.op, mine, peer, op.group, op.tag))
            kind, key = ("send" if sending else "recv"), ""
            if self.sends == "late":
                kind, key = "late-" + kind, self._late_key(self.initialized[group], src, dst, sending)
            checks.append(([(kind, t, mine, key)], what))
        works = original(posted)
        if not self.buffers:
            return works
        if len(works) != len(checks):  # a backend returning one work for the whole batch
            raise NcclRuleError(f"batch_isend_irecv returned {len(works)} works for {len(checks)} operations")
        wrapped = [_CheckedWork(self, w, *c) for w, c in zip(works, checks)]
        self.works.extend(wrapped)
        return wrapped

    def async_collective(self, name: str, fn: Callable[..., Any], args: tuple[Any, ...],
                         kwargs: dict[str, Any]) -> Any:
        """Rule 3 for an asynchronous collective: the input snapshotted, the output poisoned until ``wait()``."""
        out_at, in_at = _ASYNC_BUFFERS[name]
        args = list(args)
        out, inp = args[out_at], args[in_at]
        mine_in = inp.clone(memory_format=torch.contiguous_format)
        mine_out = torch.empty_like(out)
        _poison(out)
        args[out_at], args[in_at] = mine_out, mine_in
        work = fn(*args, **kwargs)
        what = f"an asynchronous {name} ({tuple(inp.shape)} {inp.dtype} in, {tuple(out.shape)} out)"
        wrapped = _CheckedWork(self, work, [("send", inp, mine_in, ""), ("recv", out, mine_out, "")], what)
        self.works.append(wrapped)
        return wrapped

    def check_order(self) -> None:
        """Publish this rank's records, read every rank's, raise on the first mismatch (every rank
        raises the same error)."""
        self.store.set(f"{self.prefix}/records/{self.rank}", pickle.dumps(self.records))
        everyone: list[list[_Record]] = [pickle.loads(self.store.get(f"{self.prefix}/records/{r}"))
                                         for r in range(self.world_size)]
        self.store.set(f"{self.prefix}/done/{self.rank}", "1")  # every rank has read every record after this
        self.store.wait([f"{self.prefix}/done/{r}" for r in range(self.world_size)])
        problem = self._order_problem(everyone)
        if problem:
            raise NcclRuleError(problem)

    @staticmethod
    def _order_problem(everyone: list[list[_Record]]) -> str | None:
        sends: dict[tuple, list[_Record]] = {}
        recvs: dict[tuple, list[_Record]] = {}
        for r, records in enumerate(everyone):
            for rec in records:
                key = (rec.group, rec.src, rec.dst)
                (sends if rec.src == r else recvs).setdefault(key, []).append(rec)
        for key in sorted(set(sends) | set(recvs)):
            s, rv = sends.get(key, []), recvs.get(key, [])
            (name, _), src, dst = key
            for n, (a, b) in enumerate(zip(s, rv)):
                if (a.tag, a.shape, a.dtype) != (b.tag, b.shape, b.dtype):
                    return (
                        f"point-to-point order on group {name!r}: rank {src}'s send #{n} to rank {dst} (tag {a.tag}, "
                        f"{a.shape} {a.dtype}, its batch {a.batch}) meets rank {dst}'s receive #{n} (tag {b.tag}, "
                        f"{b.shape} {b.dtype}, its batch {b.batch}) on NCCL, which ignores tags and pairs messages "
                        "by order; post a batch's operations in the same order on both sides"
                    )
            if len(s) != len(rv):
                return (
                    f"point-to-point on group {name!r}: rank {src} sent {len(s)} messages to rank {dst}, which "
                    f"posted {len(rv)} receives from it"
                )
        return None

    def check_waited(self) -> None:
        late = [w.what for w in self.works if not w.waited]
        if late:
            raise NcclRuleError(
                f"rank {self.rank}: {len(late)} asynchronous works never waited ({late[:3]}...); on NCCL the "
                "compute stream never synchronised with them: wait() every work before using its buffers"
            )


def _group_of(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    try:
        bound = inspect.signature(fn).bind_partial(*args, **kwargs)
    except (TypeError, ValueError):
        return kwargs.get("group")
    return bound.arguments.get("group")


@contextlib.contextmanager
def nccl_rules(
    store: dist.Store, *, prefix: str = "nccl_rules", init_timeout_s: float = 30.0, buffers: bool = True,
    initialized: Sequence[Any] = (), sends: str = "checked",
) -> Iterator[NcclRules]:
    """Enforce NCCL's rules on this rank's torch.distributed calls while the block runs (every rank of
    the world enters and leaves it together); yields the live :class:`NcclRules`.

    Args:
        store: a store every rank reaches (e.g. a ``TCPStore`` made for the test), for the set-up
            rendezvous and the order check.
        prefix: key prefix, unique per use of one store.
        init_timeout_s: how long a group's first operation waits for the other members (rule 1).
        buffers: enforce rule 3 (snapshot sends, poison receives until ``wait()``).
        initialized: groups whose communicators exist already (set up before the block).
        sends: with ``buffers``, what a point-to-point send carries: ``"checked"`` (the buffer at the
            post; a write before ``wait()`` raises) or ``"late"`` (the buffer at its ``wait()``: a
            write before it changes the result, as it may on NCCL).

    Raises:
        NcclRuleError: inside the block (rules 1 and 3) or on leaving it (rule 2, unwaited works);
            the exit checks are skipped when the block raised, but the records are still published
            so that the other ranks' checks finish.
    """
    if sends not in ("checked", "late"):
        raise ValueError(f"nccl_rules: sends={sends!r}; use 'checked' or 'late'")
    rules = NcclRules(store, prefix, dist.get_rank(), dist.get_world_size(), init_timeout_s, buffers, sends)
    for g in initialized:
        rules.initialized[g] = (str(g.group_name), 0)
    depth = [0]

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            outer = depth[0] == 0
            if outer:
                rules.before(name, _group_of(fn, args, kwargs))
            depth[0] += 1
            try:
                if outer and buffers and kwargs.get("async_op") and name in _ASYNC_BUFFERS and len(args) >= 2:
                    return rules.async_collective(name, fn, args, kwargs)
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1

        return call

    original_batch = dist.batch_isend_irecv

    def batch(p2p_op_list: Sequence[Any]) -> list[Any]:
        return rules.batch_isend_irecv(original_batch, p2p_op_list)

    saved = [(name, getattr(dist, name)) for name in COLLECTIVES if hasattr(dist, name)]
    for name, fn in saved:
        setattr(dist, name, wrap(name, fn))
    dist.batch_isend_irecv = batch
    failed = True
    try:
        with compat.intercepted(wrap):
            yield rules
        failed = False
    finally:
        for name, fn in saved:
            setattr(dist, name, fn)
        dist.batch_isend_irecv = original_batch
        if failed:  # let the other ranks' order checks finish; the block's own error is the report
            store.set(f"{prefix}/records/{rules.rank}", pickle.dumps(rules.records))
            store.set(f"{prefix}/done/{rules.rank}", "1")
    rules.check_order()
    rules.check_waited()
