"""A swapped model makes no host sync and no extra collective per layer (issue 9 §2).

The cross-rank input check reads its verdict on the host. A swapped model makes it once per batch
(seqpar.swap.batch), so a 1-layer and a 3-layer model must make the same number of host syncs per
training step, and the 3-layer model exactly the attention's own collectives more, nothing else.

What counts as a host sync: on CPU, ``tolist``/``item``/``cpu`` do not reach the dispatcher, so the
Python calls are wrapped; a TorchDispatchMode flags ``_local_scalar_dense`` (``item``, ``bool(t)``)
and ``nonzero`` (data-dependent shapes), which sync on a GPU. Collectives are counted where seqpar
calls them: ``seqpar.comm.compat``'s bound all-gather / reduce-scatter, ``batch_isend_irecv`` (the
ring), and torch.distributed's object and all-reduce calls. The counters are shown to work on a
direct ``seqpar.attention`` call with its per-call check on.
"""

from __future__ import annotations

import collections
import contextlib

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import seqpar
import seqpar.comm.compat as compat
from seqpar.sequence.batch import shard_batch
from seqpar.swap import swap_attention

VOCAB, HIDDEN, SEQ = 32, 32, 16
_SYNC_OPS = ("_local_scalar_dense", "nonzero")
_DIST_CALLS = ("batch_isend_irecv", "all_reduce", "all_gather", "all_gather_object", "broadcast",
               "broadcast_object_list", "barrier")


class _SyncOps(TorchDispatchMode):
    def __init__(self, counts: collections.Counter) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in _SYNC_OPS:
            self.counts["sync"] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counting() -> collections.Counter:
    """Count host syncs (``"sync"``) and collectives (``"coll"``) inside the block."""
    counts: collections.Counter = collections.Counter()
    saved: list[tuple[object, str, object]] = []

    def wrap(owner: object, name: str, key: str) -> None:
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            counts[key] += 1
            return original(*args, **kwargs)

        saved.append((owner, name, original))
        setattr(owner, name, wrapper)

    for name in ("tolist", "item", "cpu"):
        wrap(torch.Tensor, name, "sync")
    wrap(compat, "_all_gather", "coll")
    wrap(compat, "_reduce_scatter", "coll")
    for name in _DIST_CALLS:
        wrap(dist, name, "coll")
    try:
        with _SyncOps(counts):
            yield counts
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)


# ----------------------------------------------------------------------------- tiny models
class Block(nn.Module):
    """nanoGPT-style block: the "sdpa" route."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(HIDDEN)
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.proj = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, 4, C // 4).transpose(1, 2) for t in (q, k, v))  # (B, 4, T, C/4)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.proj(y.transpose(1, 2).reshape(B, T, C))  # (B, T, C)


class Nano(nn.Module):
    def __init__(self, layers: int, checkpointed: bool) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, HIDDEN)
        self.wpe = nn.Embedding(SEQ, HIDDEN)
        self.blocks = nn.ModuleList([Block() for _ in range(layers)])
        self.checkpointed = checkpointed

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(input_ids) + self.wpe(position_ids)
        for block in self.blocks:
            if self.checkpointed:  # recompute in backward, outside the model's forward
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return x


def build(kind: str, layers: int) -> nn.Module:
    torch.manual_seed(0)
    if kind.startswith("nano"):
        return Nano(layers, checkpointed=kind == "nano_ckpt")
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                                   num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2)
    return transformers.LlamaForCausalLM(cfg)


def _step(model: nn.Module, batch: dict) -> None:
    out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
    out = out if isinstance(out, torch.Tensor) else out.logits
    out.square().mean().backward()


def _counts_per_step(rank: int, world_size: int, kind: str, mode: str) -> dict:
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    batch = shard_batch({"input_ids": ids}, group=dist.group.WORLD, sharding="zigzag")
    result = {}
    for layers in (1, 3):
        model = build(kind, layers)
        swap_attention(model, {"size": world_size, "sharding": "zigzag", "mode": mode}, group=dist.group.WORLD)
        _step(model, batch)  # warm-up: first-call work (caches, lazy imports) is not steady state
        with counting() as counts:
            _step(model, batch)
        result[layers] = dict(counts)
    # The collectives of one attention layer (forward + backward, same heads) with no check at all.
    kv_heads = 4 if kind.startswith("nano") else 2
    q, k, v = (torch.randn(2, n, SEQ // world_size, HIDDEN // 4, requires_grad=True)
               for n in (4, kv_heads, kv_heads))
    def bare(q, k, v):
        return seqpar.attention(q, k, v, causal=True, sharding="zigzag", mode=mode, check_inputs=False,
                                group=dist.group.WORLD)

    with counting() as counts:
        if kind == "nano_ckpt":  # the recompute repeats the forward's exchange
            out = torch.utils.checkpoint.checkpoint(bare, q, k, v, use_reentrant=False)
        else:
            out = bare(q, k, v)
        out.sum().backward()
    result["layer"] = dict(counts)
    with counting() as counts:
        bare(q, k, v).sum().backward()
    result["bare"] = dict(counts)
    with counting() as counts:
        seqpar.attention(q, k, v, causal=True, sharding="zigzag", mode=mode, group=dist.group.WORLD).sum().backward()
    result["checked"] = dict(counts)
    return result


def _assert_no_per_layer_cost(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        one, three, bare, checked, layer = r[1], r[3], r["bare"], r["checked"], r["layer"]
        # The counters see the per-call check: one more collective and a host read.
        assert checked.get("coll", 0) == bare.get("coll", 0) + 1, (rank, checked, bare)
        assert checked.get("sync", 0) >= bare.get("sync", 0) + 1, (rank, checked, bare)
        assert bare.get("sync", 0) == 0, f"rank {rank}: attention itself syncs with the host: {bare}"
        assert three.get("sync", 0) == one.get("sync", 0), (
            f"rank {rank}: host syncs per step grow with depth (1 layer {one}, 3 layers {three})"
        )
        per_layer = (three.get("coll", 0) - one.get("coll", 0)) / 2
        assert per_layer == layer.get("coll", 0), (
            f"rank {rank}: {per_layer} collectives per extra layer, the attention itself makes "
            f"{layer.get('coll', 0)} (1 layer {one}, 3 layers {three})"
        )


def test_sdpa_route_no_per_layer_sync(dist_pool):
    _assert_no_per_layer_cost(dist_pool.run(2, _counts_per_step, "nano", "ring"))


def test_checkpoint_recompute_no_per_layer_sync(dist_pool):
    _assert_no_per_layer_cost(dist_pool.run(2, _counts_per_step, "nano_ckpt", "allgather"))


def test_hf_route_no_per_layer_sync(dist_pool):
    _assert_no_per_layer_cost(dist_pool.run(2, _counts_per_step, "llama", "ring"))
