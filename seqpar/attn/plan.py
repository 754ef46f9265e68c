"""Which (query rows, key rows, mask) kernel calls one rank makes against one key/value block.

Sequences are cut into equal chunks (see :mod:`seqpar.sequence.sharding`); a rank's queries and a key block
are each a list of global chunk ids in local order. Under causal masking, query chunk a sees key
chunk b fully if b < a, causally (top-left diagonal) if b == a, and not at all if b > a. The planner
turns that into as few kernel calls as it can: blocks entirely in the future are skipped, runs of
fully visible key chunks become one call, and query chunks with the same view share a call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["BlockCall", "plan_blocks", "head_chunk_slices"]


@dataclass(frozen=True)
class BlockCall:
    """One kernel call: ``q[:, :, q_rows]`` against ``k[:, :, k_rows]`` (local row ranges).

    ``causal``: row x sees key y <= x (top-left); ``anti``: row x sees key y >= x (a square whose
    rows and keys run backwards is causal: see :mod:`seqpar.attn.common`); neither: all keys.
    """

    q_rows: slice
    k_rows: slice
    causal: bool
    anti: bool = False


def plan_blocks(
    q_chunks: Sequence[int], k_chunks: Sequence[int], chunk_len: int, causal: bool
) -> list[BlockCall]:
    """Kernel calls for queries holding chunks ``q_chunks`` against keys holding ``k_chunks``."""
    nq, nk = len(q_chunks) * chunk_len, len(k_chunks) * chunk_len
    if not causal:
        return [BlockCall(slice(0, nq), slice(0, nk), False)]
    if list(q_chunks) == list(k_chunks) and list(q_chunks) == sorted(q_chunks):
        # The same ascending chunks on both sides: local order is global order, so the causal
        # mask over the local concatenation is exactly the global one (covers zigzag's own block).
        return [BlockCall(slice(0, nq), slice(0, nk), True)]

    # Per query chunk: (first k chunk, end k chunk, causal) runs.
    rows: list[list[tuple[int, int, bool]]] = []
    for a in q_chunks:
        runs: list[tuple[int, int, bool]] = []
        j = 0
        while j < len(k_chunks):
            b = k_chunks[j]
            if b == a:
                runs.append((j, j + 1, True))
                j += 1
            elif b < a:
                j0 = j
                while j < len(k_chunks) and k_chunks[j] < a:
                    j += 1
                runs.append((j0, j, False))
            else:
                j += 1
        rows.append(runs)

    calls: list[BlockCall] = []
    i = 0
    while i < len(rows):
        i0 = i
        # distinct query chunks never share a diagonal, so equal run lists are all-full runs
        while i + 1 < len(rows) and rows[i + 1] == rows[i0]:
            i += 1
        for j0, j1, diag in rows[i0]:
            calls.append(
                BlockCall(slice(i0 * chunk_len, (i + 1) * chunk_len), slice(j0 * chunk_len, j1 * chunk_len), diag)
            )
        i += 1
    return calls


def head_chunk_slices(q_heads: int, kv_heads: int, chunks: int) -> list[tuple[slice, slice]]:
    """``(q_heads slice, kv_heads slice)`` of each of ``chunks`` equal head chunks.

    Chunk c holds kv heads ``[c * kv_heads / chunks, (c + 1) * kv_heads / chunks)`` and the query heads
    that read them under GQA (query head h reads kv head ``h // (q_heads // kv_heads)``), so every
    chunk is an independent attention problem. ``chunks`` must divide ``kv_heads``.
    """
    if chunks < 1 or kv_heads % chunks:
        raise ValueError(f"head_chunks={chunks} must be a positive divisor of kv_heads={kv_heads}")
    kc, qc = kv_heads // chunks, q_heads // chunks
    return [(slice(c * qc, (c + 1) * qc), slice(c * kc, (c + 1) * kc)) for c in range(chunks)]
