"""The recall task of ``launch/train.py``: deterministic long-range key/value recall samples, their packed rows
of long-tailed document lengths, and the greedy recall accuracy (the task itself: ``launch/train.py``'s module
docstring)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["IGNORE", "RecallTask", "recall_accuracy"]

IGNORE = -100
"""The label of a token that carries no loss."""


class RecallTask:
    """Deterministic long-range key/value recall samples (see the module docstring)."""

    PAD, BOS, SEP = 0, 1, 2

    def __init__(self, s: Any) -> None:
        """``s``: the launcher's ``TrainSettings`` (the ``train`` block)."""
        self.s = s
        self.key0 = 3
        self.value0 = self.key0 + s.num_keys
        self.filler0 = self.value0 + s.num_values
        self.vocab_size = self.filler0 + s.filler_vocab

    @property
    def min_len(self) -> int:
        """The shortest valid sample: BOS, the pairs, the queries and one filler token."""
        return 1 + 2 * self.s.num_pairs + 3 * self.s.num_queries + 1

    def sample(self, index: int, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample ``index``: ``(input_ids (L,), labels (L,))`` with ``L = length or seq_len``; labels
        are ``-100`` except answers."""
        s = dataclasses.replace(self.s, seq_len=length) if length is not None else self.s
        g = torch.Generator().manual_seed(s.seed * 1_000_003 + index)
        keys = torch.randperm(s.num_keys, generator=g)[: s.num_pairs] + self.key0
        values = torch.randint(0, s.num_values, (s.num_pairs,), generator=g) + self.value0
        asked = torch.randint(0, s.num_pairs, (s.num_queries,), generator=g)
        head = torch.stack([keys, values], dim=1).flatten()  # k1 v1 k2 v2 ...
        tail = torch.stack(
            [torch.full((s.num_queries,), self.SEP), keys[asked], values[asked]], dim=1
        ).flatten()  # SEP k v SEP k v ...
        n_fill = s.seq_len - 1 - head.numel() - tail.numel()
        filler = torch.randint(0, s.filler_vocab, (n_fill,), generator=g) + self.filler0
        ids = torch.cat([torch.tensor([self.BOS]), head, filler, tail])
        labels = torch.full_like(ids, IGNORE)
        answer_pos = torch.arange(s.seq_len - tail.numel() + 2, s.seq_len, 3)
        labels[answer_pos] = ids[answer_pos]
        return ids, labels

    def batch(self, first: int, n: int) -> dict[str, torch.Tensor]:
        """Samples ``first .. first+n-1`` stacked: ``input_ids``/``labels`` ``(n, S)``."""
        pairs = [self.sample(first + i) for i in range(n)]
        return {
            "input_ids": torch.stack([p[0] for p in pairs]),
            "labels": torch.stack([p[1] for p in pairs]),
        }


    def packed_lengths(self, first: int) -> list[int]:
        """Document lengths of packed row ``first``: log-uniform in ``[min_len, seq_len]`` (a long
        tail of short samples), or log-normal (``train.packed_lengths``), the last one taking what is
        left so they sum to ``seq_len``."""
        g = torch.Generator().manual_seed(self.s.seed * 7_000_003 + first)
        lo, hi, left = math.log(self.min_len), math.log(self.s.seq_len), self.s.seq_len
        lengths: list[int] = []
        while left:
            if self.s.packed_lengths == "log-normal":  # median packed_median, clipped to [packed_min, seq_len]
                z = float(torch.randn((), generator=g))
                n = int(math.exp(math.log(self.s.packed_median) + self.s.packed_sigma * z))
                n = min(left, self.s.seq_len, max(n, self.s.packed_min, self.min_len))
            else:
                n = min(left, int(math.exp(lo + (hi - lo) * float(torch.rand((), generator=g)))))
            if left - n < self.min_len:
                n = left
            lengths.append(n)
            left -= n
        return lengths

    def packed_docs(self, first: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The documents of packed row ``first``: ``(input_ids (n,), labels (n,))`` each."""
        return [self.sample(first * 1_000 + i, n) for i, n in enumerate(self.packed_lengths(first))]

    def packed_batch(self, first: int) -> dict[str, torch.Tensor]:
        """Packed row ``first``: ``input_ids``/``labels``/``position_ids`` ``(1, seq_len)`` as
        ``transformers.DataCollatorWithFlattening`` makes them (positions restart per document;
        each document starts with BOS, whose label is already -100)."""
        docs = self.packed_docs(first)
        return {
            "input_ids": torch.cat([d[0] for d in docs])[None],
            "labels": torch.cat([d[1] for d in docs])[None],
            "position_ids": torch.cat([torch.arange(d[0].numel()) for d in docs])[None],
        }



@torch.no_grad()
def recall_accuracy(engine: Any, task: RecallTask, plan: Any, first: int) -> float:
    """Greedy accuracy on the answers of ``eval_samples`` held-out samples (every rank returns it)."""
    from seqpar.sequence.batch import shard_batch

    manager = engine.manager
    n = plan.train.eval_samples
    correct = torch.zeros(2, dtype=torch.float64)
    engine.eval()
    per_replica = math.ceil(n / manager.dp_size)
    for i in range(per_replica):
        idx = first + i * manager.dp_size + manager.dp_rank
        b = shard_batch(task.batch(idx, 1), group=manager.sp_group, sharding=plan.sp.sharding)
        logits = engine.forward(b)
        if hasattr(logits, "full_tensor"):  # tp_sequence_parallel: split on the vocabulary (DTensor); whole here
            logits = logits.full_tensor()
        labels = b["shift_labels"]
        mask = labels != IGNORE
        pred = logits.argmax(-1)
        correct[0] += (pred[mask] == labels[mask]).sum().item()
        correct[1] += mask.sum().item()
    dist.all_reduce(correct)
    return float(correct[0] / correct[1].clamp(min=1))
