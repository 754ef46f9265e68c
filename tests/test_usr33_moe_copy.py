"""``ExpertCounter`` counts only its own routers: a ``copy.deepcopy`` of the model (TRL's DPO reference model)
carries the routers' forward hooks, whose closures are the original counter's, and the copy's forwards used to add
their routing into the original's counts. One process (group None): the counts are a host bincount of what each
router returned, which the test records with hooks of its own."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from seqpar.swap import moe  # noqa: E402  (needs transformers)

VOCAB, EXPERTS, TOP_K = 64, 8, 2


def _model():  # noqa: ANN202
    config = transformers.Glm4MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, n_routed_experts=EXPERTS,
        num_experts_per_tok=TOP_K, n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=0,
        tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Glm4MoeForCausalLM(config)
    with torch.no_grad():  # fresh random values, never zeros (HF leaves the correction bias at 0)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn_like(buf) * 0.1)
    return model.eval()


def _recorded(counter: moe.ExpertCounter, model: torch.nn.Module) -> tuple[dict[str, list[torch.Tensor]], list]:
    """Hooks on ``model``'s routers (named as the counter's) that keep each router's expert ids."""
    seen: dict[str, list[torch.Tensor]] = {}
    modules = dict(model.named_modules())
    handles = []
    for name in counter.routers:
        def keep(module, args, output, name=name):  # noqa: ANN001, ANN202
            ints = [t for t in output if isinstance(t, torch.Tensor) and not t.is_floating_point()]
            seen.setdefault(name, []).append(ints[-1].detach().clone())  # (logits, weights, indices): the ids
        handles.append(modules[name].register_forward_hook(keep))
    return seen, handles


def _reference(seen: dict[str, list[torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Per router: the int64 count of each expert id over every recorded call (a host bincount)."""
    return {n: sum(torch.bincount(t.reshape(-1).long(), minlength=EXPERTS) for t in ts) for n, ts in seen.items()}


def test_a_deep_copy_forward_is_not_counted_by_the_original_counter() -> None:
    model = _model()
    counter = moe.ExpertCounter(model)
    assert len(counter.routers) == 2, counter.routers
    twin = copy.deepcopy(model)  # after the counter: the copy's routers carry its hooks
    with torch.no_grad():  # the copy routes differently (a DPO reference model is another model's weights)
        for name, buf in twin.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn_like(buf))
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (2, 12), generator=g)
    seen, handles = _recorded(counter, model)
    twin_seen, twin_handles = _recorded(counter, twin)
    with torch.no_grad():
        model(input_ids=ids)
    want = _reference(seen)
    assert set(counter.counts) == set(want) == set(counter.routers)
    for name, counts in counter.counts.items():
        assert counts.dtype == torch.int64 and torch.equal(counts, want[name]), (name, counts, want[name])
        assert int(counts.sum()) == 2 * 12 * TOP_K
    before = {n: c.clone() for n, c in counter.counts.items()}
    with torch.no_grad():
        twin(input_ids=ids)  # the copy's forward: its routers run the original's hook
    twin_want = _reference(twin_seen)
    # the copy routes otherwise, so counting it would show (seen failing: the hook without its module check ->
    # every count the sum of both models' routing)
    assert any(not torch.equal(twin_want[n], want[n]) for n in want), (twin_want, want)
    for name, counts in counter.counts.items():
        assert torch.equal(counts, before[name]), (name, counts, before[name])
    # the copy's own counter counts the copy, and the original stays as it was
    twin_counter = moe.ExpertCounter(twin)
    twin_seen.clear()
    with torch.no_grad():
        twin(input_ids=ids)
    for name, counts in twin_counter.counts.items():
        assert torch.equal(counts, _reference(twin_seen)[name]), name
        assert torch.equal(counter.counts[name], before[name]), name
    # the original keeps counting its own forwards (accumulating), and remove() unhooks both
    with torch.no_grad():
        model(input_ids=ids)
    assert all(torch.equal(c, 2 * before[n]) for n, c in counter.counts.items())
    for h in handles + twin_handles:
        h.remove()
    counter.remove()
    twin_counter.remove()


def _swapped_copy(rank: int, world: int) -> tuple[float, bool, bool]:
    """A swapped model deep-copied after its ExpertCounter (and every hook the swap installs: the batch check, the
    SDPA routing, the call frames): the copy's forward on the same shards gives the original's loss, leaves the
    original's counts as they were, and a counter of the copy's own counts what the original's counted."""
    import torch.distributed as dist

    from seqpar.config import SeqParConfig
    from seqpar.sequence.batch import shard_batch
    from seqpar.swap import swap_attention

    model = _model()
    swap_attention(model, SeqParConfig(size=world, sharding="zigzag"), group=dist.group.WORLD)
    counter = moe.ExpertCounter(model, group=dist.group.WORLD)
    twin = copy.deepcopy(model)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (2, 16), generator=g)
    local = shard_batch({"input_ids": ids, "labels": ids.clone()}, group=dist.group.WORLD, sharding="zigzag")
    with torch.no_grad():
        loss = model(**local).loss
        before = {n: c.clone() for n, c in counter.counts.items()}
        twin_loss = twin(**local).loss
    unchanged = all(torch.equal(counter.counts[n], c) for n, c in before.items())
    twin_counter = moe.ExpertCounter(twin, group=dist.group.WORLD)
    with torch.no_grad():
        twin(**local)
    same = set(twin_counter.counts) == set(before) and all(torch.equal(twin_counter.counts[n], c)
                                                          for n, c in before.items())
    return float((loss - twin_loss).abs()), unchanged, same


def test_a_swapped_models_deep_copy_runs_apart_from_the_original(dist_pool) -> None:
    for err, unchanged, same in dist_pool.run(2, _swapped_copy, timeout=180):
        assert err == 0.0 and unchanged and same, (err, unchanged, same)
