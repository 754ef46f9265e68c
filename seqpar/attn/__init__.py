"""Softmax attention across the ranks of a sequence-parallel group: one module per algorithm.

- ``ring``: K/V blocks pass around the SP ring (point-to-point), O(S/P) memory per rank.
- ``allgather``: K/V gathered once, O(S) K/V memory; reduce-scattered dK/dV.
- ``ulysses``: all-to-all from sequence shards to head shards, local attention, all-to-all back.
- ``hybrid``: Ulysses inside groups of u ranks, the ring across them.
- ``dilated``: LongNet dilated attention, distributed the same way (its pattern plan, kernel calls, passes and
  custom ops in ``dilated_plan``, ``dilated_blocks``, ``dilated_schedule`` and ``dilated_ops``).

Shared pieces: ``common`` (options, piece kernels), ``plan`` (which (query chunk, key chunk) blocks
a rank computes), ``masks`` (documents, windows, sinks as a mask description), ``checks`` (input
checks, local and across ranks), ``choose`` (the cost model behind ``mode="auto"``), and
``dispatch``: :func:`attention`, the public entry (``seqpar.attention``), which checks a call and
hands it to one algorithm. Tensors are ``(batch, heads, seq_local, head_dim)``.
"""

from seqpar.attn.checks import AUTO_HEAD_CHUNKS, resolve_head_chunks
from seqpar.attn.common import AttentionOptions
from seqpar.attn.dispatch import attention

__all__ = ["attention", "AttentionOptions", "AUTO_HEAD_CHUNKS", "resolve_head_chunks"]
