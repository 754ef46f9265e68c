"""Atomic checkpoint directories: write under a temporary name, then rename.

A checkpoint ``<save_dir>/<tag>`` is written by every rank into ``<save_dir>/<tag>.tmp``. Once every
rank has finished (the caller's barrier), rank 0 writes a ``COMPLETE`` marker into it and renames it
to ``<tag>`` (``os.replace`` of a directory on one file system is atomic on POSIX). A job killed during
the save leaves only a ``.tmp`` directory, which :func:`latest_complete` ignores, so ``--resume`` picks
the last checkpoint that was written whole. The engine's own file format inside the directory is
untouched (DeepSpeed's or torch.distributed.checkpoint's).

Sharded state (FSDP2, DTensor tensor parallelism, or plain modules): :func:`save_dcp` / :func:`load_dcp`
write and read a ``step<N>`` directory with ``torch.distributed.checkpoint`` (DCP) through torch's own
``get_state_dict`` / ``set_state_dict`` (model and optimizer, keyed by parameter name, every tensor
stored with its global shape), inside the atomic protocol above. DCP reshards on load, so a checkpoint
saved at one layout (e.g. TP2 x SP2 on 4 ranks: parameters as DTensors on a ``(dp_sp, tp)`` mesh)
resumes at another (SP2 on 2 ranks: DTensors on ``dp_sp`` only), and back; nothing here reshards by
hand. :func:`write_dcp` / :func:`read_dcp` are the same without the protocol, for one directory.

A re-save of a step that already exists never deletes the only complete copy: the old ``<tag>`` is
renamed aside to ``<tag>.old``, the new one renamed in, and only then is ``<tag>.old`` deleted. A
crash between the two renames leaves ``<tag>.old`` (complete, with its marker), which
:func:`latest_complete` returns in place of the missing ``<tag>``.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["MARKER", "staging_dir", "commit", "latest_complete", "step_of",
           "write_dcp", "read_dcp", "save_dcp", "load_dcp", "EXTRA_FILE"]

EXTRA_FILE = "seqpar_extra.pt"
"""Beside DCP's files in a checkpoint directory: the caller's small ``extra`` dict (e.g. the step)."""

_ASIDE = ".old"  # suffix of a complete step moved aside during its own re-save

MARKER = "COMPLETE"
_TAG = re.compile(r"^step(\d+)$")


def staging_dir(save_dir: str, tag: str) -> str:
    """Where every rank writes checkpoint ``tag`` before :func:`commit` publishes it."""
    return os.path.join(save_dir, f"{tag}.tmp")


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MARKER))


def commit(save_dir: str, tag: str) -> str:
    """Publish ``<tag>.tmp`` as ``<tag>`` (call on ONE rank, after every rank finished writing).

    Writes the completion marker, renames the directory (replacing an older ``<tag>`` without ever
    leaving the step without a complete copy), and points the ``latest`` file at it (itself written
    by rename). Returns the final path.
    """
    tmp, final = staging_dir(save_dir, tag), os.path.join(save_dir, tag)
    aside = final + _ASIDE
    with open(os.path.join(tmp, MARKER), "w") as f:
        f.write(tag)
        f.flush()
        os.fsync(f.fileno())
    if _complete(final):  # a re-save of the same step: the new one wins
        if os.path.exists(aside):  # left by a crash after the swap below: `final` is complete
            shutil.rmtree(aside)
        os.replace(final, aside)  # not deleted yet: until the next rename it is the step's only copy
        _fsync_dir(save_dir)
    elif os.path.exists(final):  # torn (no marker): not a checkpoint, and `aside` may be the only one
        shutil.rmtree(final)
    # (when `final` is missing but `aside` exists, a crash hit between the renames: keep `aside`)
    os.replace(tmp, final)
    _fsync_dir(save_dir)
    if os.path.exists(aside):
        shutil.rmtree(aside)
    latest_tmp = os.path.join(save_dir, "latest.tmp")
    with open(latest_tmp, "w") as f:
        f.write(tag)
        f.flush()
        os.fsync(f.fileno())
    os.replace(latest_tmp, os.path.join(save_dir, "latest"))
    _fsync_dir(save_dir)
    return final


def step_of(tag: str) -> int | None:
    """The step number of a ``step<N>`` tag, else ``None``."""
    m = _TAG.match(tag)
    return int(m.group(1)) if m else None


def latest_complete(save_dir: str) -> str | None:
    """The tag of the highest-step ``step<N>`` directory that carries the completion marker, or
    ``None``. Directories without the marker (``.tmp`` leftovers of a killed save) are skipped.

    The tag is the directory's name under ``save_dir``: ``step<N>``, or ``step<N>.old`` when a
    re-save of step N was killed between its two renames (the old copy, complete; see
    :func:`commit`)."""
    if not os.path.isdir(save_dir):
        return None

    best: tuple[int, str] | None = None
    for name in os.listdir(save_dir):
        base = name[: -len(_ASIDE)] if name.endswith(_ASIDE) else name
        step = step_of(base)
        # `<tag>.old` counts only while `<tag>` itself is not complete
        if step is None or not _complete(os.path.join(save_dir, name)) or (
            name != base and _complete(os.path.join(save_dir, base))
        ):
            continue
        if best is None or step > best[0]:
            best = (step, name)
    return best[1] if best else None


# ---------------------------------------------------------------------------- sharded state (DCP)
def _state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` from torch's ``get_state_dict`` (FQN keys, DTensors kept sharded)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer if optimizer is not None else [])
    return {"model": model_sd, **({"optim": optim_sd} if optimizer is not None else {})}


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


@contextlib.contextmanager
def _one_process_is_meant() -> Iterator[None]:
    """Without a process group DCP reads and writes as one process (``no_dist``), as meant here, yet
    warns that it assumes so: silence that one warning."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def write_dcp(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: Mapping[str, Any] | None = None,
) -> None:
    """Write ``model`` (and ``optimizer``) state into the directory ``path`` with DCP: each rank its own
    shards, tensors with their global shapes. ``extra`` (small, picklable, the same on every rank) goes
    beside them (:data:`EXTRA_FILE`, written by rank 0).

    Collective over the default group. Not atomic by itself: :func:`save_dcp` is.
    """
    import torch.distributed.checkpoint as dcp

    with _one_process_is_meant():
        dcp.save(_state(model, optimizer), checkpoint_id=os.fspath(path), no_dist=not dist.is_initialized())
    if extra is not None and _is_rank0():
        torch.save(dict(extra), os.path.join(os.fspath(path), EXTRA_FILE))
    _barrier()


def read_dcp(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
) -> dict[str, Any]:
    """Load what :func:`write_dcp` wrote into ``model`` (and ``optimizer``), in place, resharded onto
    their current layout (world size, FSDP2 / TP meshes); returns the ``extra`` dict (``{}`` if none).

    Collective over the default group. Build (wrap, shard) the model and the optimizer first, as for
    training: their state dicts say which shards this rank needs.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _state(model, optimizer)
    with _one_process_is_meant():
        dcp.load(state, checkpoint_id=os.fspath(path), no_dist=not dist.is_initialized())
    set_state_dict(model, optimizer if optimizer is not None else [],
                   model_state_dict=state["model"], optim_state_dict=state.get("optim", {}))
    extra_path = os.path.join(os.fspath(path), EXTRA_FILE)
    return torch.load(extra_path, weights_only=False) if os.path.exists(extra_path) else {}


def save_dcp(
    save_dir: str | os.PathLike,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: Mapping[str, Any] | None = None,
) -> str:
    """Save checkpoint ``step<step>`` into ``save_dir`` atomically: every rank writes its shards into
    ``step<step>.tmp`` (:func:`write_dcp`), then rank 0 publishes it (:func:`commit`). ``extra`` is
    stored with ``{"step": step}`` added. Returns the final directory.

    Collective over the default group.
    """
    save_dir = os.fspath(save_dir)
    tag = f"step{step}"
    if _is_rank0():
        os.makedirs(save_dir, exist_ok=True)
    _barrier()  # the directory exists before any rank writes into it
    write_dcp(staging_dir(save_dir, tag), model, optimizer, extra={**dict(extra or {}), "step": step})
    if _is_rank0():  # write_dcp ended with a barrier: every rank's shards are on disk
        commit(save_dir, tag)
    _barrier()
    return os.path.join(save_dir, tag)


def load_dcp(
    save_dir: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    tag: str | None = None,
) -> dict[str, Any]:
    """Load checkpoint ``tag`` of ``save_dir`` (default: :func:`latest_complete`) into ``model`` and
    ``optimizer``, in place, on whatever layout they have now (DCP reshards); returns its ``extra`` dict,
    whose ``"step"`` is the step it was saved at.

    Collective over the default group.

    Raises:
        FileNotFoundError: no complete checkpoint in ``save_dir`` (naming the directory), or ``tag``
            is not one.
    """
    save_dir = os.fspath(save_dir)
    tag = tag if tag is not None else latest_complete(save_dir)
    if tag is None:
        raise FileNotFoundError(f"no complete checkpoint (a step<N> directory with {MARKER}) in {save_dir}: "
                                "save one first, or point at the directory that holds it")
    path = os.path.join(save_dir, tag)
    if not _complete(path):
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {MARKER} marker): a save was "
                                f"interrupted; load the latest complete one ({latest_complete(save_dir)})")
    return read_dcp(path, model, optimizer)
