"""Audit 36 (session 37), ``resolve_group``'s non-member check (``seqpar.runtime.factory``) on objects torch has not
registered as process groups: a stand-in group (a test's, a wrapper library's own group object) is passed through as
before the check existed, on every rank of an initialised P = 2 gloo world, while a real group this rank is not in is
still refused. torch raises ``ValueError`` ("is not registered") for the membership lookup of such an object.

Seen failing: the lookup's except clause narrowed to ``RuntimeError`` (audit 36's F4) -> torch's "Group ... is not
registered" ValueError from resolve_group on both ranks."""

from __future__ import annotations

import torch.distributed as dist


def _resolve(rank: int, world: int) -> tuple[bool, str]:
    from seqpar.runtime.factory import resolve_group

    stand_in = object()
    passed = resolve_group(stand_in) is stand_in
    outside = dist.new_group([0])  # every rank makes every group (torch's rule)
    try:
        resolve_group(outside)
        refused = ""
    except ValueError as e:
        refused = str(e)
    return passed, refused


def test_a_stand_in_group_passes_and_a_foreign_group_is_refused(dist_pool) -> None:
    (passed0, refused0), (passed1, refused1) = dist_pool.run(2, _resolve, timeout=120)
    assert passed0 and passed1
    assert refused0 == ""  # rank 0 is the group's member
    assert "global rank 1" in refused1 and "not in" in refused1, refused1
