"""The tiled loss on a head split over the vocabulary as a plain tensor (``vocab_split=``,
:class:`seqpar.sequence.vocab_parallel.VocabSplitHead`, what DeepSpeed AutoTP's ``VocabParallelLinear`` carries) and the
tiled forward's loss group under length-aware dynamic CP, on 4 gloo ranks without DeepSpeed: each pair ``{0, 1}``,
``{2, 3}`` is one TP group (or one call's SP group) holding its own data, so a reduction over the wrong group mixes
the pairs' numbers. Everything in float64 against one process.

The DeepSpeed test (tests/test_deepspeed_tp_tiled.py) reaches the same path through ``deepspeed.initialize`` with
tiles of 3 rows on both TP ranks; here the automatic tile of uneven slices (6 + 5 rows), where a tile sized by the
rank's own slice gives the two TP ranks different tile counts, and the refusals of ``tiled_lm_loss``.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

VOCAB, HIDDEN, LARGEST = 11, 8, 6  # slices of 6 and 5 rows


def one_process_reference(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> tuple:
    """``(loss sum, hidden with its grad, weight with its grad)``: float64 cross entropy over the whole head."""
    h_ref, w_ref = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = F.cross_entropy((h_ref @ w_ref.T).reshape(-1, weight.shape[0]), targets.reshape(-1), ignore_index=-100,
                          reduction="sum")
    ref.backward()
    return ref, h_ref, w_ref


def assert_slice_matches(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, piece: tuple[int, int],
                         split: object, chunk_rows: int | None, reference: tuple) -> None:
    """``tiled_lm_loss`` on this rank's slice ``piece = (vocab_start, rows)`` of ``weight`` (``vocab_split=split``)
    against :func:`one_process_reference`: the loss sum, the count, the hidden states' gradient and the slice's."""
    from seqpar.memory import tiling

    (start, rows), (ref, h_ref, w_ref) = piece, reference
    h = hidden.clone().requires_grad_()
    w = weight[start:start + rows].clone().requires_grad_()
    loss_sum, count = tiling.tiled_lm_loss(h, w, targets, chunk_rows=chunk_rows, vocab_split=split)
    loss_sum.backward()
    torch.testing.assert_close(loss_sum.detach().double(), ref.detach(), rtol=1e-10, atol=0)
    assert int(count) == int((targets != -100).sum()), (count, chunk_rows)
    torch.testing.assert_close(h.grad, h_ref.grad, rtol=1e-10, atol=1e-12,
                               msg=lambda m, c=chunk_rows: f"hidden grad, chunk_rows={c}: {m}")
    torch.testing.assert_close(w.grad, w_ref.grad[start:start + rows], rtol=1e-10, atol=1e-12,
                               msg=lambda m, c=chunk_rows: f"head slice grad, chunk_rows={c}: {m}")


def _slice(tp_rank: int) -> tuple[int, int]:
    """``(vocab_start, rows)`` of this TP rank's slice."""
    return (0, LARGEST) if tp_rank == 0 else (LARGEST, VOCAB - LARGEST)


def _direct(rank: int, world: int) -> dict:
    """``tiled_lm_loss`` with ``vocab_split`` over this rank's pair, the pair's own data: loss sum, count and the
    gradients of the hidden states and of this rank's slice of the head, at 4-row tiles and the automatic tile
    (its element cap set so the slices' own tiles would differ: 15 // 6 = 2 rows, 15 // 5 = 3); the refusals."""
    import torch.distributed as dist

    from seqpar.memory import tiling
    from seqpar.sequence.vocab_parallel import VocabSplitHead

    pair, _ = dist.new_subgroups(2)
    tp_rank = rank % 2
    start, rows = _slice(tp_rank)
    g = torch.Generator().manual_seed(100 + rank // 2)  # each pair its own numbers
    hidden = torch.randn(2, 7, HIDDEN, generator=g, dtype=torch.float64)
    weight = torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64)
    targets = torch.randint(0, VOCAB, (2, 7), generator=g)
    targets[0, 2:4] = -100
    targets[1, 6] = VOCAB - 1  # the last slice's last row
    ref, h_ref, w_ref = one_process_reference(hidden, weight, targets)
    split = VocabSplitHead(pair, start, VOCAB, LARGEST)
    out: dict = {}
    max_elements = tiling.MAX_LOSS_CHUNK_ELEMENTS
    try:
        for chunk_rows in (4, None):
            tiling.MAX_LOSS_CHUNK_ELEMENTS = 15
            assert_slice_matches(hidden, weight, targets, (start, rows), split, chunk_rows, (ref, h_ref, w_ref))
            out[chunk_rows] = "exact"
    finally:
        tiling.MAX_LOSS_CHUNK_ELEMENTS = max_elements
    # refusals (before any collective): rows past the vocabulary, a slice larger than the largest, a DTensor too
    bad = {"past_vocab": VocabSplitHead(pair, VOCAB - 3, VOCAB, LARGEST),
           "over_largest": VocabSplitHead(pair, 0, VOCAB, rows - 1)}
    for name, wrong in bad.items():
        try:
            tiling.tiled_lm_loss(hidden, weight[start:start + rows], targets, vocab_split=wrong)
            out[name] = "accepted"
        except tiling.TilingError as e:
            out[name] = str(e)
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = DeviceMesh.from_group(pair, "cpu")
    sharded = distribute_tensor(weight, mesh, [Shard(0)])
    try:
        tiling.tiled_lm_loss(hidden, sharded, targets, vocab_split=split)
        out["dtensor"] = "accepted"
    except tiling.TilingError as e:
        out["dtensor"] = str(e)
    return out


def test_tiled_lm_loss_on_a_vocab_split_plain_head_matches_one_process(dist_pool) -> None:
    """Loss sum, count and the gradients of the hidden states (summed over the pair, which holds them replicated)
    and of each rank's slice equal one process, at 4-row tiles and at the automatic tile of uneven slices; rows past
    the vocabulary, a slice over the largest, and a DTensor weight with ``vocab_split`` too are refused by name.

    Seen failing: the hidden states' gradient summed over the world instead of the TP group (``dist.all_reduce(grad)``
    in ``_EnterTPGroup.backward``); not summed (``hidden = enter_tp_group(...)`` dropped); the slice taken from id 0
    (``vocab = (0, group)``); the automatic tile sized by the rank's own slice (``tile_vocab = weight.shape[0]``: the
    TP ranks' tile counts differ); the vocabulary bound and the DTensor refusal dropped."""
    for got in dist_pool.run(4, _direct, timeout=180):
        assert got[4] == got[None] == "exact", got
        assert "do not match the vocabulary split" in got["past_vocab"], got
        assert "do not match the vocabulary split" in got["over_largest"], got
        assert "DTensor and a vocab_split" in got["dtensor"], got


def _llama():  # noqa: ANN202
    import transformers

    torch.manual_seed(3)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                   max_position_embeddings=32, use_cache=False)
    return transformers.LlamaForCausalLM(cfg).to(torch.float64)


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, shift_labels)``, each ``(2, 9)``, some targets ignored."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, 9), generator=g)
    labels = ids.clone()
    labels[1, 2:5] = -100
    return ids, F.pad(labels[:, 1:], (0, 1), value=-100)


def _model_calls(rank: int, world: int) -> dict:
    """A tiny float64 Llama through ``apply_tiling(tiled_loss)``:

    - ``split``: its head replaced by this rank's slice (6 + 5 rows over the pair) with ``seqpar_vocab_split``, as
      DeepSpeed AutoTP leaves it; SP group this rank alone. The loss and every gradient against the whole model.
    - ``dynamic``: the whole head, each rank its own batch, called with ``seqpar_group=`` its pair (a dynamic CP
      micro-batch's group), the swap's group this rank alone: the loss is the pair's token-weighted mean (and with
      ``num_items_in_batch``, the pair's sum over it); ``labels=`` without ``shift_labels`` is refused by the call's
      group (2 ranks), not the swap's (1 rank)."""
    import torch.distributed as dist

    from seqpar.memory.tiling import apply_tiling
    from seqpar.sequence.vocab_parallel import VocabSplitHead

    pair, _ = dist.new_subgroups(2)
    alone, _ = dist.new_subgroups(1)
    out: dict = {}
    # split head, one SP rank: the same batch on both ranks of a pair
    model = _llama()
    ref = copy.deepcopy(model)
    apply_tiling(model, {"tiled_loss": True}, group=alone)
    start, rows = _slice(rank % 2)
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach()[start:start + rows].clone())
    model.lm_head.seqpar_vocab_split = VocabSplitHead(pair, start, VOCAB, LARGEST)
    ids, shift = _batch(7 + rank // 2)
    loss = model(input_ids=ids, shift_labels=shift).loss
    loss.backward()
    logits = ref(input_ids=ids).logits
    loss_ref = F.cross_entropy(logits.reshape(-1, VOCAB), shift.reshape(-1), ignore_index=-100)
    loss_ref.backward()
    torch.testing.assert_close(loss.detach(), loss_ref.detach(), rtol=1e-10, atol=0)
    params = dict(model.named_parameters())
    for name, p in ref.named_parameters():
        want = p.grad[start:start + rows] if name == "lm_head.weight" else p.grad
        torch.testing.assert_close(params[name].grad, want, rtol=1e-9, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")
    out["split"] = "exact"
    # dynamic CP's call group: each rank its own batch, the pair's mean
    model = _llama()
    ref = copy.deepcopy(model)
    apply_tiling(model, {"tiled_loss": True}, group=alone)
    sums, counts = [], []
    for r in (rank - rank % 2, rank - rank % 2 + 1):  # both ranks of this pair, in one process
        ids_r, shift_r = _batch(20 + r)
        logits = ref(input_ids=ids_r).logits.detach()
        sums.append(F.cross_entropy(logits.reshape(-1, VOCAB), shift_r.reshape(-1), ignore_index=-100,
                                    reduction="sum"))
        counts.append(int((shift_r != -100).sum()))
    ids, shift = _batch(20 + rank)
    got = model(input_ids=ids, shift_labels=shift, seqpar_group=pair).loss
    torch.testing.assert_close(got.detach(), sum(sums) / sum(counts), rtol=1e-10, atol=0)
    got = model(input_ids=ids, shift_labels=shift, seqpar_group=pair, num_items_in_batch=50).loss
    torch.testing.assert_close(got.detach(), sum(sums) / 50, rtol=1e-10, atol=0)
    out["dynamic"] = "exact"
    try:
        model(input_ids=ids, labels=ids, seqpar_group=pair)
        out["labels"] = "accepted"
    except ValueError as e:
        out["labels"] = str(e)
    return out


def test_tiled_forward_reads_the_split_and_the_call_group(dist_pool) -> None:
    """The tiled causal-LM forward: on a head carrying ``seqpar_vocab_split`` the loss and every gradient equal the
    whole model's (each rank's head slice against its rows); under dynamic CP the loss is reduced over the call's
    ``seqpar_group`` (the pair's token-weighted mean; with ``num_items_in_batch`` the pair's sum over it), and
    ``labels=`` alone is refused because the call's group has 2 ranks.

    Seen failing: the forward not reading the split (``split = None``: the slice taken as a whole head); the loss
    reduced over the swap's group instead of the call's (``loss_group = group``; and in the ``num_items_in_batch``
    branch alone); the ``shift_labels`` refusal asking the swap's group (``resolve_group(group)``: accepted)."""
    for got in dist_pool.run(4, _model_calls, timeout=240):
        assert got["split"] == got["dynamic"] == "exact", got
        assert "needs shift_labels=" in got["labels"], got

