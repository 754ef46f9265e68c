"""The width ``complete_split_head`` gives DeepSpeed's vocabulary-split LM head (one process, no engine).

DeepSpeed 0.19.8's ``VocabParallelLinear`` keeps neither ``in_features`` nor ``out_features``;
:func:`seqpar.integrations.deepspeed_tp.complete_split_head` gives it ``nn.Linear``'s, the whole head's. The only
reader on a training path is Apertus 1.5's forward (``vocab_size=self.lm_head.out_features`` to its loss), and both
losses it can reach there ignore that value for the result (DeepSpeed's ``VocabParallelCausalLMLoss`` at SP 1 only
compares it with its own vocabulary and warns on a mismatch; seqpar's ``SplitHeadLoss`` at SP > 1 takes the
vocab-parallel path, which never reads it). So a wrong width changes no loss or gradient, and the multi-process
split-head tests cannot see it: this test pins the attributes themselves.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("deepspeed")


def test_split_head_gets_nn_linears_in_and_out_features() -> None:
    """A bare ``VocabParallelLinear`` (DeepSpeed's class, no process group or weights: ``_orig_weight_shape`` the
    whole head's ``(vocab, hidden)`` = (37, 8), this rank's slice rows 19-36 of partitions [19, 18]) gets
    ``in_features`` 8 and ``out_features`` 37, those of the ``nn.Linear(8, 37)`` it replaced, plus
    ``seqpar_vocab_split`` (start 19, vocabulary 37, largest slice 19); a head that has a width keeps it.

    Seen failing: ``complete_split_head``'s in / out features swapped (mut29/mut30's P6: ``in_features`` 37,
    ``out_features`` 8; in a run, Apertus at SP 1 would then hand DeepSpeed's loss its hidden size as
    ``vocab_size``, which that loss only warns about)."""
    from deepspeed.module_inject.layers import VocabParallelLinear

    from seqpar.integrations.deepspeed_tp import complete_split_head

    vocab, hidden = 37, 8
    whole = torch.nn.Linear(hidden, vocab, bias=False)
    group = object()  # stands for the TP group: complete_split_head only passes it on

    def bare_head() -> torch.nn.Module:
        head = VocabParallelLinear.__new__(VocabParallelLinear)
        torch.nn.Module.__init__(head)
        head._orig_weight_shape = tuple(whole.weight.shape)
        head.mp_group, head.vocab_start_index, head.vocab_size, head._partition_sizes = group, 19, vocab, [19, 18]
        return head

    model = torch.nn.Module()
    model.lm_head = bare_head()
    assert complete_split_head(model) == ["lm_head"]
    head = model.lm_head
    assert (head.in_features, head.out_features) == (whole.in_features, whole.out_features) == (hidden, vocab)
    split = head.seqpar_vocab_split
    assert (split.group, split.vocab_start, split.vocab_size, split.largest_rows) == (group, 19, vocab, 19)

    kept = torch.nn.Module()
    kept.lm_head = bare_head()
    kept.lm_head.in_features, kept.lm_head.out_features = hidden, vocab
    assert complete_split_head(kept) == []
    assert (kept.lm_head.in_features, kept.lm_head.out_features) == (hidden, vocab)
