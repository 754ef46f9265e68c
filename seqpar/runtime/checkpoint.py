"""Atomic checkpoint directories: write under a temporary name, then rename.

A checkpoint ``<save_dir>/<tag>`` is written by every rank into ``<save_dir>/<tag>.tmp``. Once every
rank has finished (the caller's barrier), rank 0 writes a ``COMPLETE`` marker into it and renames it
to ``<tag>`` (``os.replace`` of a directory on one file system is atomic on POSIX). A job killed during
the save leaves only a ``.tmp`` directory, which :func:`latest_complete` ignores, so ``--resume`` picks
the last checkpoint that was written whole. The engine's own file format inside the directory is
untouched (DeepSpeed's or torch.distributed.checkpoint's).

A re-save of a step that already exists never deletes the only complete copy: the old ``<tag>`` is
renamed aside to ``<tag>.old``, the new one renamed in, and only then is ``<tag>.old`` deleted. A
crash between the two renames leaves ``<tag>.old`` (complete, with its marker), which
:func:`latest_complete` returns in place of the missing ``<tag>``.
"""

from __future__ import annotations

import os
import re
import shutil

__all__ = ["MARKER", "staging_dir", "commit", "latest_complete", "step_of"]

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
