"""One call frame for MLA and MoE (seqpar.swap.frame): two forwards over two different groups, run before
either backward, each take their own call's group, in the forward and in the backward's recompute.

2 gloo ranks. Each rank runs forward A over the pair {0, 1} (a document sharded over both ranks) and then
forward B over its own group of one (another document, whole on the rank), as dynamic CP hands a rank two
micro-batches of different group sizes; then B's backward, then A's (the reverse order). Activation
checkpointing is on, so each backward recomputes its layers and the recompute must see its own forward's
group again. Both models are swapped over the pair, so a call that took the swap's group instead of its own
runs B over the pair.

- DeepSeek-V3 (MLA, aux-loss-free routing): A's layers move the latent over the pair, B's expand K/V
  (one rank: no ring); ``ExpertCounter`` sums A's routed counts over the pair and B's over the rank alone.
- Mixtral with its router loss: A's load-balancing loss is over the pair's statistics, B's over the rank's.

Then (DeepSeek-V3) an attention call that does not take its layer's latent back raises by name.

Each loss equals its document's float64 one-process loss; A's gradients summed over the pair and B's (the rank's
alone) equal their references, each judged on its own scale; the counts equal one process's for A plus B.

Seen failing, one break at a time (each family run alone, so that each break shows in both):

- ``seqpar.swap.frame.enter`` keeping one frame per module (a second call reusing the first call's frame, as
  state on a module attribute would): forward B's router loss and expert counts run over the pair (Mixtral's
  B loss 6.1825 vs one process's 6.1923 on rank 0; DeepSeek-V3's counts of layer 1 [16, 24, 15, 17] vs one
  process's [12, 17, 11, 12]: both ranks' B documents counted);
- the recompute taking the group of the module's latest forward instead of its own call's (a group held on
  the module): A's recompute runs after B's forward, so its MLA layers expand K/V where A's forward moved
  the latent (a CheckpointError on both ranks).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")

from seqpar.config import SeqParConfig  # noqa: E402
from seqpar.sequence.batch import shard_batch  # noqa: E402
from seqpar.sequence.call_group import GROUP_KEY  # noqa: E402
from seqpar.swap import moe, swap_attention  # noqa: E402
from seqpar.swap.mla import mla_dims  # noqa: E402

VOCAB = 61  # test_mla_models' and test_moe's tiny models both take ids below 61
LENGTHS = (16, 10)  # documents A (sharded over the pair) and B (whole on each rank)


def _documents(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``(1, 16)``, the same on both ranks (one sequence over the pair), and B ``(1, 10)``, each rank its own."""
    g = torch.Generator().manual_seed(8101)
    a = torch.randint(3, VOCAB, (1, LENGTHS[0]), generator=g)
    b = [torch.randint(3, VOCAB, (1, LENGTHS[1]), generator=g) for _ in range(2)][rank]
    return a, b


def _deepseek_v3(dtype: torch.dtype) -> torch.nn.Module:
    """test_mla_models' tiny DeepSeek-V3 (MLA, MoE after one dense layer)."""
    from test_mla_models import tiny_mla

    return tiny_mla("deepseek_v3", dtype)


def _mixtral(dtype: torch.dtype) -> torch.nn.Module:
    """test_moe's tiny Mixtral (2 MoE layers, router loss on, coefficient 1)."""
    from test_moe import make

    return make("mixtral", experts_implementation="eager").to(dtype)  # grouped_mm takes no float64


def _reference(build, ids: torch.Tensor) -> tuple[float, dict[str, torch.Tensor], torch.nn.Module]:  # noqa: ANN001
    """float64, one process: the document's loss and gradients, and the model (for its router counts)."""
    ref = build(torch.float64)
    out = ref(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    grads = {n: torch.zeros_like(p) if p.grad is None else p.grad.clone() for n, p in ref.named_parameters()}
    return float(out.loss.detach()), grads, ref


def _grads(model: torch.nn.Module, group: dist.ProcessGroup | None) -> dict[str, torch.Tensor]:
    """The model's gradients (summed over ``group`` when given), then zeroed for the next backward."""
    out = {}
    for name, p in model.named_parameters():
        grad = torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
        if group is not None:
            dist.all_reduce(grad, group=group)
        out[name] = grad
        p.grad = None
    return out


def _check(what: str, loss: float, grads: dict[str, torch.Tensor], ref: tuple) -> None:
    ref_loss, ref_grads = ref[0], ref[1]
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), f"{what}: loss {loss} vs one process {ref_loss}"
    for name, want in ref_grads.items():
        scale = float(want.abs().max()) or 1.0
        err = float((grads[name].double() - want).abs().max()) / scale
        assert err <= 1e-4, f"{what}: grad of {name} is {err:.3g} of its scale off"


def _interleaved(rank: int, world: int) -> dict:
    pair = dist.group.WORLD
    alone = [dist.new_group([r]) for r in range(world)][rank]  # every rank creates every group
    doc_a, doc_b = _documents(rank)
    counts = {}
    for family, build in (("deepseek_v3", _deepseek_v3), ("mixtral", _mixtral)):
        ref_a, ref_b = _reference(build, doc_a), _reference(build, doc_b)
        model = build(torch.float32).train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        swap_attention(model, SeqParConfig(size=world, mode="ring", sharding="zigzag", mla_transfer="latent"),
                       group=pair)
        counter = ref_counter = None
        if family == "deepseek_v3":
            counter = moe.ExpertCounter(model, group=pair)
            ref_counter = moe.ExpertCounter(ref_a[2], group=alone)  # one process: A's counts, then B's
            with torch.no_grad():
                for ids in (doc_a, doc_b):
                    ref_a[2](input_ids=ids, use_cache=False)
        local_a = shard_batch({"input_ids": doc_a, "labels": doc_a}, group=pair, sharding="zigzag")
        local_b = shard_batch({"input_ids": doc_b, "labels": doc_b}, group=alone, sharding="zigzag")
        out_a = model(**local_a, use_cache=False, **{GROUP_KEY: pair})
        out_b = model(**local_b, use_cache=False, **{GROUP_KEY: alone})
        out_b.loss.backward()  # B first: each recompute runs after the other call's forward
        grads_b = _grads(model, None)
        out_a.loss.backward()
        grads_a = _grads(model, pair)
        _check(f"{family} A (pair) rank {rank}", float(out_a.loss), grads_a, ref_a)
        _check(f"{family} B (alone) rank {rank}", float(out_b.loss), grads_b, ref_b)
        if family == "deepseek_v3":
            layers = [m for m in model.modules() if mla_dims(m) is not None]
            assert len(layers) == 2 and all(m.__dict__.get("_seqpar_latent_ok") is True for m in layers), \
                "A's latent ring ran over the pair"
            assert counter.counts and set(counter.counts) == set(ref_counter.counts), counter.counts
            for name, got in counter.counts.items():
                want = ref_counter.counts[name]
                assert torch.equal(got, want), f"rank {rank} {name}: counts {got.tolist()} vs {want.tolist()}"
            counts = {n: c.tolist() for n, c in counter.counts.items()}
            _untaken_latent_raises(model, local_a, pair)
    return counts


def _untaken_latent_raises(model: torch.nn.Module, local: dict, pair: dist.ProcessGroup) -> None:
    """An MLA layer whose attention call does not take the latent back (it would attend the zero stand-ins)
    raises at the end of the layer's call, naming the fix. Seen failing: with the frame's ``on_leave`` check
    removed (seqpar.swap.mla.install_latent_transfer), the forward returns a loss from zero K/V."""
    import seqpar.swap.hf_attention as hf_attention

    take = hf_attention.take_latent
    hf_attention.take_latent = lambda module, key, value: None  # the attention runs on the stand-ins
    try:
        with torch.no_grad():
            model(**local, use_cache=False, **{GROUP_KEY: pair})
    except RuntimeError as error:
        assert "no seqpar attention call of the layer took it" in str(error) and "mla_transfer" in str(error), error
    else:
        raise AssertionError("an MLA latent no attention call took went unnoticed")
    finally:
        hf_attention.take_latent = take
    from seqpar.swap.frame import frames

    assert frames() == [], "every call's frame was popped on the way out of the error"


@pytest.mark.timeout(240)
def test_two_forwards_of_two_groups_before_their_backwards(dist_pool) -> None:
    counts = dist_pool.run(2, _interleaved, timeout=200)
    assert counts[0] != counts[1], "each rank's B document is its own: the counts differ between ranks"
