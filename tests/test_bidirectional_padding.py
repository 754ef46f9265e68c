"""Bidirectional attention on a padded batch is refused by name (fuzzer case 1054415801).

The fuzzer's tiny BertGenerationDecoder has ``is_decoder=False`` (transformers' default), so its attention is
bidirectional. ``shard_batch`` pads a length the SP size does not divide at the end, which is only right under
causal attention (a real token never sees a later pad); seqpar attention takes no key mask, so under
bidirectional attention every real token attended to the pads: P = 4 on 30 tokens padded to 32, loss 8.2e-4
off, the same with or without checkpointing, one step or two (exact at P = 1 and 2, or on 32 tokens). The
same model in one process without seqpar moves by 3e-4 when the two pads are appended: the padding alone
changes it. The swapped attention now refuses a non-causal layer whose call carries ``shard_batch``'s token
mask (padding) and no packed boundaries, on every rank.

Seen failing (the check in ``seqpar_attention_forward`` disabled): the end-padded case ran and returned a loss
instead of raising (2.1e-3 off the unpadded reference, a gradient 97% off); with the check made unconditional
on padding (``token_mask()`` presence dropped), every rank raised in the swap's own probe.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from seqpar.config import SeqParConfig
from seqpar.sequence.batch import shard_batch
from seqpar.swap import swap_attention
from seqpar.testing.fuzz_models import sp_summed_grads
from seqpar.testing.tiny_models import tiny_config

transformers = pytest.importorskip("transformers")


def _model(is_decoder: bool) -> torch.nn.Module:
    config = tiny_config("bert-generation")
    config.is_decoder = is_decoder
    torch.manual_seed(0)
    return transformers.BertGenerationDecoder(config).double().train()


def _batch(seq: int, keep: int | None = None) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, 90, (2, seq), generator=torch.Generator().manual_seed(5))
    if keep is None:
        return {"input_ids": ids, "labels": ids.clone()}
    mask = torch.ones(2, seq, dtype=torch.long)
    mask[1, keep:] = 0
    ids[1, keep:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _cases(rank: int, world: int) -> dict[str, object]:
    out: dict[str, object] = {}
    for name, is_decoder, batch in (("end-padded", False, _batch(15)), ("right-padded", False, _batch(16, keep=9)),
                                    ("unpadded", False, _batch(16)), ("causal end-padded", True, _batch(15))):
        ref = _model(is_decoder)
        ref_loss = ref(**batch).loss
        ref_loss.backward()
        model = _model(is_decoder)
        swap_attention(model, SeqParConfig(size=world, mode="ring"), group=dist.group.WORLD)
        try:
            loss = model(**shard_batch(batch, group=dist.group.WORLD)).loss
        except ValueError as e:
            out[name] = str(e)
            continue
        loss.backward()
        grads = sp_summed_grads(model, dist.group.WORLD)
        # each gradient on its own scale, plus a floor far below it (the key biases' are 0 up to rounding)
        model_max = max(float(p.grad.abs().max()) for p in ref.parameters() if p.grad is not None)
        worst = max(float((grads[n] - p.grad).abs().max()) / (float(p.grad.abs().max()) + 1e-10 * model_max)
                    for n, p in ref.named_parameters() if p.grad is not None)
        out[name] = (float(loss.detach()), float(ref_loss.detach()), worst, sorted(grads) == sorted(
            n for n, p in ref.named_parameters() if p.grad is not None))
    return out


def test_bidirectional_attention_refuses_padding(dist_pool) -> None:
    """At P = 2: 15 tokens (end-padded to 16) and a right-padded row under bidirectional attention are refused on
    every rank, naming the problem and the fixes; 16 unpadded tokens run exact (loss and every gradient summed
    over the ranks, each on its own scale, against one process in float64, whose loss transformers takes in
    fp32), and so does the causal model
    (``is_decoder=True``) end-padded."""
    per_rank = dist_pool.run(2, _cases, timeout=300)
    for out in per_rank:
        for name in ("end-padded", "right-padded"):
            msg = out[name]
            assert isinstance(msg, str), (name, msg)
            assert "bidirectional (non-causal) attention on a batch with padding" in msg, msg
            assert "is_decoder=True" in msg and "DataCollatorWithFlattening" in msg, msg
        for name in ("unpadded", "causal end-padded"):
            assert not isinstance(out[name], str), (name, out[name])
            loss, ref_loss, worst, same_params = out[name]
            # transformers' ForCausalLMLoss takes the float64 logits to fp32: fp32 rounding on the reference side
            assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (name, loss, ref_loss)
            assert worst <= 1e-5, (name, worst)
            assert same_params, name
