"""``integrations.trainer_checkpoint.dcp_problem``: what keeps a rank from reading a DCP checkpoint, asked on every
rank before any rank reads (a rank that cannot read would fail inside DCP's load while the others wait in its
collectives). One process writes a real DCP checkpoint with torch.distributed.checkpoint; files are then taken away.
"""

from __future__ import annotations

import os

import pytest
import torch

# one process on purpose: DCP says it assumes so
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _write(path: str) -> list[str]:
    """A one-process DCP checkpoint of two tensors at ``path``; its shard files (``.distcp``)."""
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(3)
    dcp.save({"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)}, checkpoint_id=path)
    return sorted(f for f in os.listdir(path) if f.endswith(".distcp"))


def test_an_intact_checkpoint_has_no_problem(tmp_path) -> None:  # noqa: ANN001
    from seqpar.integrations.trainer_checkpoint import dcp_problem

    path = str(tmp_path / "ckpt")
    assert _write(path), os.listdir(path)
    assert dcp_problem(path) is None
    assert dcp_problem(str(tmp_path / "absent")) == "no directory"


def test_a_missing_shard_file_is_named(tmp_path) -> None:  # noqa: ANN001
    """``.metadata`` present (e.g. copied to a node) but a shard file its metadata names absent: named, so the
    resume is refused on every rank by name rather than failing inside DCP's load on some (audit 27's survivor R14).

    Seen failing: with the shard-file walk dropped (``absent = []``): None for a checkpoint without its shard file."""
    from seqpar.integrations.trainer_checkpoint import dcp_problem

    path = str(tmp_path / "ckpt")
    shards = _write(path)
    os.remove(os.path.join(path, shards[0]))
    assert dcp_problem(path) == f"missing shard file(s) {[shards[0]]}"
    os.remove(os.path.join(path, ".metadata"))
    assert dcp_problem(path) == "no .metadata (written by rank 0)"
