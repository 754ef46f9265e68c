"""Host syncs and low-precision sums in a steady-state step (issue 28 §1): TP gradient clipping reads
nothing on the host, the router z-loss builds no tensor from host data, and router counts are exact
in bf16 beyond 256 tokens.

The clipping runs under the fake-CUDA checker (seqpar.testing.syncs) on any torch build: its ops are
kernel-level. The router's ops need torch's CUDA build on fake CUDA tensors (tests/test_sync_checker.py,
CI stage .ci/fake_cuda); here, on CPU, the same host work is counted directly.
"""

from __future__ import annotations

import collections
import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode

from seqpar.integrations.tp import clip_grad_norm
from seqpar.sequence.router import (
    pkm_routing_statistics,
    routing_statistics,
    sequence_parallel_z_loss,
)
from seqpar.testing.syncs import SyncChecker, fake_rank, simulated_gpu


class _HostWork(TorchFunctionMode):
    """Counts the Python calls that sync a CUDA host or copy host data to the device."""

    NAMES = ("item", "tolist", "__bool__", "__float__", "__int__", "tensor", "as_tensor", "cpu", "numpy")

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        name = getattr(func, "__name__", "")
        if name in self.NAMES:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _host_work() -> collections.Counter:
    mode = _HostWork()
    with mode:
        yield mode.counts


# ----------------------------------------------------------------------------------- TP clipping
def clip_layer(checker: SyncChecker) -> None:
    """TP gradient clipping as ``checker``'s layer "clip_grad_norm": an fp32 and a bf16 parameter with
    gradients, made under the caller's FakeTensorMode on fake CUDA (also used by tests/test_sync_checker.py)."""
    params = [torch.empty(4, 3, device="cuda", requires_grad=True),
              torch.empty(5, device="cuda", dtype=torch.bfloat16, requires_grad=True)]
    for p in params:
        p.grad = torch.empty_like(p)
    with checker.layer("clip_grad_norm"):
        clip_grad_norm(params, 1.0)


def test_tp_clip_makes_no_sync_on_fake_cuda() -> None:
    """clip_grad_norm as a layer of the fake-CUDA checker: any host read (main's ``total.item()``)
    raises HostSyncError naming the line."""
    with fake_rank(0, 2), simulated_gpu("h100"), FakeTensorMode(allow_non_fake_inputs=True), \
            SyncChecker() as checker:
        clip_layer(checker)
    assert not checker.events, checker.events


@pytest.mark.parametrize("max_norm", [0.3, 1e3])  # clipping, and a norm below the limit (scaled by 1)
def test_tp_clip_equals_torch_without_host_reads(max_norm: float) -> None:
    """Plain (one-mesh) gradients: the same norm and clipped gradients as torch's clip_grad_norm_,
    in fp32 and bf16, with no .item() / bool / tolist / host tensor on the way."""
    g = torch.Generator().manual_seed(3)
    grads = [torch.randn(7, 5, generator=g), torch.randn(11, generator=g).bfloat16(), torch.randn(3, 2, generator=g)]
    ours = [torch.zeros_like(x, requires_grad=True) for x in grads]
    ref = [torch.zeros_like(x, requires_grad=True) for x in grads]
    for p, r, x in zip(ours, ref, grads):
        p.grad, r.grad = x.clone(), x.clone()
    with _host_work() as counts:
        norm = clip_grad_norm(ours, max_norm)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref, max_norm)
    assert not counts, counts
    torch.testing.assert_close(norm, ref_norm.float(), rtol=0, atol=0)
    for p, r in zip(ours, ref):
        torch.testing.assert_close(p.grad, r.grad, rtol=0, atol=0)
    if max_norm < 1:
        assert ref_norm > max_norm  # the clip acted


# --------------------------------------------------------------------------------------- router
def test_z_loss_builds_nothing_from_host_data() -> None:
    """Main made ``torch.tensor(float(n), device=...)`` per forward (a blocking host-to-device copy
    on CUDA): the count is now filled on the device. Same value as the plain mean."""
    logits = torch.randn(2, 5, 7, dtype=torch.float64)
    with _host_work() as counts:
        z = sequence_parallel_z_loss(logits, group=None)
    assert not counts, counts
    torch.testing.assert_close(z, logits.logsumexp(-1).pow(2).mean(), rtol=1e-15, atol=0)


def _pkm_logits(rows: int, num_keys: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(2, rows, num_keys, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _pkm_experts(logits: torch.Tensor, num_keys: int, top_k: int) -> torch.Tensor:
    """Doge's expert choice, exactly as pkm_routing_statistics makes it: ``(rows, top_k)``."""
    (sx, sy), (ix, iy) = logits.topk(num_keys, dim=-1)
    scores = (sx.unsqueeze(-1) + sy.unsqueeze(-2)).flatten(-2)
    indices = (ix.unsqueeze(-1) * num_keys + iy.unsqueeze(-2)).flatten(-2)
    return indices.gather(-1, scores.topk(top_k, dim=-1).indices)


@pytest.mark.parametrize("masked", [False, True])
def test_pkm_counts_exact_in_bf16_beyond_256(masked: bool) -> None:
    """Doge's product-key statistics from bf16 logits over 3 layers x 700 rows: each expert's count,
    the rows and the assignments equal integer counts (main summed them in bf16, exact only to 256)."""
    num_keys, top_k, rows = 2, 2, 700
    experts = num_keys ** 2
    layers = tuple(_pkm_logits(rows, num_keys, torch.bfloat16, seed) for seed in range(3))
    mask = torch.ones(1, rows, dtype=torch.long)
    if masked:
        mask[0, -37:] = 0
    stats = pkm_routing_statistics(layers, experts, num_keys, top_k, mask if masked else None)
    keep = mask.reshape(-1).bool()
    want = sum(torch.bincount(_pkm_experts(x, num_keys, top_k)[keep].reshape(-1), minlength=experts)
               for x in layers)
    assert want.max() > 512  # far beyond bf16's exact integers
    assert stats.counts.dtype == torch.float32
    assert stats.counts.tolist() == want.tolist()
    assert stats.rows.item() == 3 * int(keep.sum())
    assert stats.count_rows.item() == 3 * int(keep.sum()) * top_k


def test_switch_counts_exact_in_bf16_beyond_256() -> None:
    """The softmax-top-k form (about 30 decoders) from bf16 logits: counts already fp32; kept so."""
    experts, top_k = 4, 2
    layers = tuple(torch.randn(900, experts, generator=torch.Generator().manual_seed(s)).bfloat16() for s in range(2))
    stats = routing_statistics(layers, experts, top_k)
    want = sum(torch.bincount(F.softmax(x, -1).topk(top_k, -1).indices.reshape(-1), minlength=experts) for x in layers)
    assert want.max() > 512
    assert stats.counts.tolist() == want.tolist()
