"""The fake-CUDA host-sync checker (seqpar.testing.syncs, issue 20 §1) and the per-layer syncs it found.

The checker runs every rank of a P-rank world on fake CUDA tensors and torch's fake process group.
Whole layers run on fake CUDA tensors only on torch's CUDA build: those tests run in the CI stage
``.ci/fake_cuda`` (a cached CUDA-build venv) and are skipped on the CPU build of the main suite; the
tests of the fixes themselves run everywhere.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

import seqpar.attn.ring as ring
from seqpar.attn.dilated import DilatedOptions, kv_index, plan_dilated
from seqpar.swap.mha import _is_causal_mask
from seqpar.testing.syncs import SCENARIOS, HostSyncError, check_world, cuda_build, run_scenario

needs_cuda_build = pytest.mark.skipif(
    not cuda_build(), reason="whole layers on fake CUDA tensors need torch's CUDA build: CI stage .ci/fake_cuda"
)

RING = next(s for s in SCENARIOS if s.name == "ring-dense-zigzag")


# ------------------------------------------------------------------------ the fixes (any build)
@pytest.mark.parametrize("layout", ["mixed", "grouped"])
def test_dilated_kv_index_is_the_plans_heads(layout: str) -> None:
    """dilated.kv_index builds each offset's K/V heads on the device (an arange, no host-to-device
    copy): it must equal the plan's host tuple for every head layout, GQA group and rate."""
    checked = 0
    for (hq, hkv), rates in itertools.product([(8, 8), (8, 4), (8, 2), (8, 1), (12, 4), (6, 3)], [(1, 2), (2, 4), (3,)]):
        if layout == "grouped" and hq % len(rates):
            continue
        opts = DilatedOptions(segment_lengths=tuple(12 * r for r in rates), dilation_rates=rates, causal=True,
                              scale=0.1, head_layout=layout)
        plan = plan_dilated(opts, q_heads=hq, kv_heads=hkv, seq_local=max(opts.segment_lengths))
        for pat in plan.patterns:
            for off in pat.offsets:
                got = kv_index(off, hq, hq // hkv, torch.device("cpu")).tolist()
                assert got == list(off.kv_heads), (layout, hq, hkv, rates, off)
                checked += 1
    assert checked > 20


def test_mha_causal_mask_read_once_per_mask() -> None:
    """The MHA route reads a causal mask's values once per mask tensor (a model hands one mask to all
    its layers; on a GPU each read waits for the device), again after an in-place change, and takes
    float masks (-inf or the dtype's lowest) with one reduction."""
    reads = []
    original = torch.equal

    def counting_equal(a, b):
        reads.append(1)
        return original(a, b)

    mask = nn.Transformer.generate_square_subsequent_mask(6, dtype=torch.bool)
    torch.equal = counting_equal
    try:
        assert all(_is_causal_mask(mask) for _ in range(3))
        assert len(reads) == 1
        mask[0, 1] = False  # no longer causal: the version counter moved, so it is read again
        assert not _is_causal_mask(mask) and len(reads) == 2
    finally:
        torch.equal = original
    assert _is_causal_mask(nn.Transformer.generate_square_subsequent_mask(6))  # float -inf
    lowest = torch.zeros(6, 6).masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), torch.finfo(torch.float32).min)
    assert _is_causal_mask(lowest)
    assert not _is_causal_mask(torch.zeros(6, 6))
    assert not _is_causal_mask(nn.Transformer.generate_square_subsequent_mask(6).T.contiguous())


# ------------------------------------------------------------------ the checker (CUDA build only)
@needs_cuda_build
@pytest.mark.parametrize(
    "world, name", [(w, s.name) for w in (2, 4, 8) for s in SCENARIOS if s.applies(w)],
    ids=lambda x: f"P{x}" if isinstance(x, int) else x,
)
def test_zero_syncs_per_layer(world: int, name: str) -> None:
    """Every scenario (modes, documents, windows, sinks, dilated, MHA and HF routes, tiling,
    recompute_norm, gather_sequence, offload, MoE router statistics, the mixers) on every rank, simulated
    as an H100 and as an A100: no host sync in any layer's forward or backward (check_world raises
    HostSyncError naming the op and line), and the batch's own syncs are exactly what theory says."""
    sc = next(s for s in SCENARIOS if s.name == name)
    r = check_world(world, [sc])[name]
    assert r["backward"], r  # the backward ran too
    assert r["ops"] == expected_batch_syncs(sc), r


def expected_batch_syncs(sc) -> dict[str, int]:  # noqa: ANN001
    """The host syncs a batch must make, from theory (each a device-to-host read, ``tolist``):

    - packed documents: the boundaries' one host copy (shard_batch's, or the first collective point's);
    - a swapped model (MHA / HF routes, world > 1): the cross-rank agreement's read of the all-gathered
      digests (the digest itself goes up by an asynchronous copy);
    - the HF route: one combined read of everything its input checks need (attention-mask verdict,
      position_ids verdict, or for a packed batch their values, and any boundaries not on the host yet);
      the inner PreTrainedModel and transformers' mask factory reuse it;
    - the MHA route without the ``is_causal`` hint: nn.TransformerEncoder's own read of the mask
      (``__bool__``), once per batch.
    Scenarios may add their own (``Scenario.extra["batch_syncs"]``)."""
    if "batch_syncs" in sc.extra:
        return dict(sc.extra["batch_syncs"])
    reads = int(sc.documents or sc.kind == "gather")
    if sc.kind in ("mha", "hf"):
        reads += 1  # the agreement
    if sc.kind == "hf":
        reads += 1  # the combined read of the inputs
    expected = {"tolist": reads} if reads else {}
    if sc.kind == "mha" and not sc.extra.get("hint", True):
        expected["__bool__"] = 1
    return expected


def _inject(op):  # noqa: ANN001, ANN202
    """ring_forward with ``op(q)`` run first: a layer that syncs."""
    original = ring.ring_forward

    def forward(q, k, v, comm, opts, sinks=None):  # noqa: ANN001, ANN202
        op(q)
        return original(q, k, v, comm, opts, sinks)

    return forward


INJECTED = {
    "tensor": lambda q: torch.tensor([1, 2], device=q.device),
    "__getitem__": lambda q: q[q > 0],
    "equal": lambda q: torch.equal(q, q),
    "masked_select": lambda q: torch.masked_select(q, q > 0),
    "unique": lambda q: torch.unique(q),
    "repeat_interleave": lambda q: torch.repeat_interleave(q.new_ones(3, dtype=torch.long)),
    "numpy": lambda q: q.numpy(),
    "allclose": lambda q: torch.allclose(q, q),
    "item": lambda q: q.sum().item(),
    "tolist": lambda q: q.sum(dim=(0, 1, 3)).tolist(),
    "cpu": lambda q: q.cpu(),
    "nonzero": lambda q: q.nonzero(),
    "__bool__": lambda q: bool(q.sum() > 0),
}


@needs_cuda_build
@pytest.mark.parametrize("op", list(INJECTED))
def test_injected_sync_fails_naming_op_and_line(op: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ring, "ring_forward", _inject(INJECTED[op]))
    with pytest.raises(HostSyncError) as e:
        run_scenario(RING, 2, 1)
    message = str(e.value)
    assert f": {op} at tests/test_sync_checker.py:" in message, message
    assert "attention[0]" in message, message


@needs_cuda_build
def test_injected_sync_in_backward_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    original = ring.ring_backward

    def backward(dout, *args, **kwargs):  # noqa: ANN001, ANN202
        dout.abs().max().item()
        return original(dout, *args, **kwargs)

    monkeypatch.setattr(ring, "ring_backward", backward)
    with pytest.raises(HostSyncError, match=r"RingAttention\.backward: item at tests/test_sync_checker.py"):
        run_scenario(RING, 4, 2)


@needs_cuda_build
def test_what_does_not_sync_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same ops in their sync-free forms pass: repeat_interleave with output_size, a
    non-blocking copy, an index built on the device."""
    def fine(q):  # noqa: ANN001, ANN202
        torch.repeat_interleave(q.new_ones(3, dtype=torch.long), output_size=3)
        q.to("cpu", non_blocking=True)
        q.index_select(1, torch.arange(2, device=q.device))

    monkeypatch.setattr(ring, "ring_forward", _inject(fine))
    assert run_scenario(RING, 2, 0)["backward"] == ["RingAttention", "RingAttention"]


@needs_cuda_build
def test_batch_syncs_are_counted_not_failed() -> None:
    """Documents: the boundaries' one host copy happens at the batch's start (counted), the layers
    read the cached ints."""
    sc = next(s for s in SCENARIOS if s.name == "ring-documents")
    res = run_scenario(sc, 4, 3, gpu="a100")
    assert res["batch_syncs"] == {"tolist": 1}, res
    assert any("boundaries.py" in w for w in res["where"]), res


@needs_cuda_build
def test_offload_blocking_copy_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """The offload scenario runs CudaTransfer's own code on stubbed streams: its copies must stay
    asynchronous; a blocking device-to-host copy in to_host is caught in the layer."""
    from seqpar.memory import offload

    def to_host(self, t):  # noqa: ANN001, ANN202
        return t.to("cpu"), None, t.device  # blocking: waits for the device

    monkeypatch.setattr(offload.CudaTransfer, "to_host", to_host)
    sc = next(s for s in SCENARIOS if s.name == "offload")
    with pytest.raises(HostSyncError, match=r"offload\[0\]: (to|aten\._to_copy) at tests/test_sync_checker.py"):
        run_scenario(sc, 2, 0)


@needs_cuda_build
def test_mixer_host_read_per_layer_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """A mixer that reads the boundaries again in every layer (no per-batch cache) fails the check."""
    from seqpar.mixers import scan_layout

    original = scan_layout.host_boundaries

    def uncached(cu):  # noqa: ANN001, ANN202
        return None if cu is None else tuple(cu.tolist())

    monkeypatch.setattr(scan_layout, "host_boundaries", uncached)
    sc = next(s for s in SCENARIOS if s.name == "mixer-lightning-zigzag-documents")
    with pytest.raises(HostSyncError, match=r"lightning\[0\]: tolist at tests/test_sync_checker.py"):
        run_scenario(sc, 2, 1)
    assert original is not uncached


@needs_cuda_build
@pytest.mark.parametrize("world", [1, 2])
def test_steady_state_clip_and_router_make_no_sync(world: int) -> None:
    """Issue 28 §1: TP gradient clipping (main read the norm with ``.item()``), the z-loss without a
    mask (main built its count with ``torch.tensor(n, device="cuda")``, a blocking copy) and Doge's
    product-key statistics, each as a layer on bf16 fake CUDA tensors: no sync at all, not even per batch."""
    import torch.distributed as dist
    from test_steady_syncs import clip_layer
    from torch._subclasses.fake_tensor import FakeTensorMode

    from seqpar.sequence.router import pkm_routing_statistics, sequence_parallel_z_loss
    from seqpar.testing.syncs import SyncChecker, fake_rank, simulated_gpu

    with fake_rank(0, world), simulated_gpu("h100"), FakeTensorMode(allow_non_fake_inputs=True), \
            SyncChecker() as checker:
        clip_layer(checker)
        logits = torch.empty(1, 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        with checker.layer("z_loss"):
            sequence_parallel_z_loss(logits, group=dist.group.WORLD)
        gates = tuple(torch.empty(2, 8, 4, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        with checker.layer("pkm_statistics"):
            pkm_routing_statistics(gates, 16, 4, 2).over(dist.group.WORLD, resolve=False).loss(16)
    assert not checker.events, checker.events
