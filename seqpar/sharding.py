"""How a sequence is cut across the ranks of an SP group, and the differentiable cut/gather.

Layouts (P = SP size):
- ``contiguous``: the sequence is cut into P chunks; rank r holds chunk r.
- ``zigzag``: the sequence is cut into 2P chunks; rank r holds chunks r and 2P-1-r, in that order.
  Under causal masking every rank then does the same amount of attention work.
"""

from __future__ import annotations

__all__ = ["num_chunks", "chunk_ids"]


def num_chunks(world_size: int, sharding: str) -> int:
    """How many equal chunks the full sequence is cut into."""
    if sharding == "contiguous":
        return world_size
    if sharding == "zigzag":
        return 2 * world_size
    raise ValueError(f"sharding={sharding!r} is invalid: choose 'contiguous' or 'zigzag'")


def chunk_ids(rank: int, world_size: int, sharding: str) -> list[int]:
    """The global chunk indices rank ``rank`` holds, in local (ascending) order."""
    if sharding == "contiguous":
        return [rank]
    if sharding == "zigzag":
        return [rank, 2 * world_size - 1 - rank]
    raise ValueError(f"sharding={sharding!r} is invalid: choose 'contiguous' or 'zigzag'")
