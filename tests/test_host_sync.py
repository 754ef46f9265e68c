"""A swapped model makes no host sync and no extra collective per layer (issue 9 §2, issue 20 §4).

The cross-rank input check reads its verdict on the host. A swapped model makes it once per batch
(seqpar.swap.batch), so a 1-layer and a 3-layer model must make the same number of host syncs per
training step, and per extra layer exactly the collectives its attention mode must make, counted
by kind and derived from the algorithm (:func:`theory_per_layer`), not measured on the attention
itself: a spurious collective in every attention call would otherwise be counted on both sides.

What counts as a host sync: on CPU, ``tolist``/``item``/``cpu`` do not reach the dispatcher, so the
Python calls are wrapped; a TorchDispatchMode flags ``_local_scalar_dense`` (``item``, ``bool(t)``)
and ``nonzero`` (data-dependent shapes), which sync on a GPU. Collectives are counted where seqpar
calls them: ``seqpar.comm.compat``'s bound all-gather / reduce-scatter, ``batch_isend_irecv`` (the
ring: each call, and each isend / irecv in it) and every other torch.distributed collective, each
under its own name. The counters are shown to work on a direct ``seqpar.attention`` call with its
per-call check on.
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
_DIST_CALLS = ("all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "all_gather_single",
               "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single",
               "broadcast", "broadcast_object_list", "reduce", "gather", "scatter", "send", "recv", "barrier")
# (isend / irecv are not wrapped: P2POp accepts only torch's own functions; counted inside batches)
# what the counters call seqpar.comm.compat's all-gather / reduce-scatter, whatever torch names them
_GATHER, _SCATTER = "all_gather_into_tensor", "reduce_scatter_tensor"


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
    """Count host syncs (``"sync"``) and collectives (``"coll"``: every call) inside the block; each
    collective also under its own name, and each op of a ``batch_isend_irecv`` as ``"isend"`` /
    ``"irecv"``."""
    counts: collections.Counter = collections.Counter()
    saved: list[tuple[object, str, object]] = []

    def wrap(owner: object, name: str, *keys: str) -> None:
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            for key in keys:
                counts[key] += 1
            if name == "batch_isend_irecv":
                for op in args[0] if args else kwargs["p2p_op_list"]:
                    counts[op.op.__name__] += 1
            return original(*args, **kwargs)

        saved.append((owner, name, original))
        setattr(owner, name, wrapper)

    for name in ("tolist", "item", "cpu"):
        wrap(torch.Tensor, name, "sync")
    wrap(compat, "_all_gather", "coll", _GATHER)
    wrap(compat, "_reduce_scatter", "coll", _SCATTER)
    for name in ("batch_isend_irecv", *_DIST_CALLS):
        if hasattr(dist, name):
            wrap(dist, name, "coll", name)
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


def _counts_per_step(rank: int, world_size: int, kind: str, mode: str, ulysses_size: int = 1) -> dict:
    group = dist.group.WORLD
    if mode == "hybrid":  # the Ulysses x ring axes come from the manager
        group = seqpar.init_process_groups(sp_size=world_size, ulysses_size=ulysses_size).sp_group
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    batch = shard_batch({"input_ids": ids}, group=group, sharding="zigzag")
    result = {}
    config = {"size": world_size, "sharding": "zigzag", "mode": mode, "ulysses_size": ulysses_size}
    for layers in (1, 3):
        model = build(kind, layers)
        swap_attention(model, config, group=group)
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
                                group=group)

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
        # layout= given: nano's 4 heads == seq_local 4 reads alike as bhsd and bshd, refused without it
        seqpar.attention(q, k, v, causal=True, sharding="zigzag", mode=mode, group=group,
                         layout="bhsd").sum().backward()
    result["checked"] = dict(counts)
    return result


def _auto_chunks(kv_heads: int) -> int:
    """head_chunks="auto": the largest divisor of the K/V heads (per rank, for Ulysses) up to 4."""
    return max(c for c in range(1, 5) if kv_heads % c == 0)


def theory_per_layer(mode: str, world: int, kv_heads: int, *, forwards: int = 1, ulysses_size: int = 1) -> dict:
    """The collectives one dense causal attention layer must make per rank, forward and backward
    (``forwards=2``: the forward runs again in a checkpoint's recompute), by kind.

    - ring over R ranks, G head passes: the forward sends K and V on for R-1 hops in one batched
      exchange per hop; the backward sends K/V again for R-1 hops and the dK/dV accumulators R-1
      hops (the last one home), one exchange per hop each. Every send has its receive.
    - all-gather: per head pass one all-gather of K|V in the forward, and again in the backward
      (not kept: O(S) memory) plus one reduce-scatter of dK|dV.
    - Ulysses over u ranks: per head pass one all-to-all of q|k|v and one of the output in the
      forward; one of dout and one of dq|dk|dv in the backward.
    - hybrid: Ulysses over u, then per Ulysses head pass the ring across R = P/u super-ranks, unchunked.
    """
    expected: collections.Counter = collections.Counter()

    def ring(ranks: int, passes: int) -> None:
        hops = ranks - 1
        expected["batch_isend_irecv"] += passes * hops * (forwards + 2)
        expected["isend"] += passes * hops * (2 * forwards + 4)  # K, V (x forwards); K, V, dK, dV
        expected["irecv"] += passes * hops * (2 * forwards + 4)

    if mode == "ring":
        ring(world, _auto_chunks(kv_heads))
    elif mode == "allgather":
        passes = _auto_chunks(kv_heads)
        expected[_GATHER] += passes * (forwards + 1)
        expected[_SCATTER] += passes
    elif mode in ("ulysses", "hybrid"):
        u = world if mode == "ulysses" else ulysses_size
        passes = _auto_chunks(max(kv_heads // u, 1))
        expected["all_to_all_single"] += passes * (2 * forwards + 2)
        for _ in range(passes if world // u > 1 else 0):
            ring(world // u, 1)
    expected["coll"] = sum(n for key, n in expected.items() if key not in ("isend", "irecv"))
    return dict(expected)


def _collectives(counts: dict) -> dict:
    return {key: n for key, n in counts.items() if key != "sync" and n}


def _assert_no_per_layer_cost(results: list[dict], mode: str, kind: str, ulysses_size: int = 1) -> None:
    world = len(results)
    kv_heads = 4 if kind.startswith("nano") else 2
    theory = theory_per_layer(mode, world, kv_heads, ulysses_size=ulysses_size)
    layer_theory = theory_per_layer(mode, world, kv_heads, ulysses_size=ulysses_size,
                                    forwards=2 if kind == "nano_ckpt" else 1)
    for rank, r in enumerate(results):
        one, three, bare, checked, layer = r[1], r[3], r["bare"], r["checked"], r["layer"]
        # The counters see the per-call check: one more all-gather (3 int64) and a host read.
        check = collections.Counter(_collectives(checked))
        check.subtract(_collectives(bare))
        assert {key: n for key, n in check.items() if n} == {"coll": 1, _GATHER: 1}, (rank, checked, bare)
        assert checked.get("sync", 0) >= bare.get("sync", 0) + 1, (rank, checked, bare)
        assert bare.get("sync", 0) == 0, f"rank {rank}: attention itself syncs with the host: {bare}"
        assert three.get("sync", 0) == one.get("sync", 0), (
            f"rank {rank}: host syncs per step grow with depth (1 layer {one}, 3 layers {three})"
        )
        assert _collectives(bare) == theory, (
            f"rank {rank}: one {mode} attention call (forward + backward) makes {_collectives(bare)}, "
            f"the algorithm needs {theory}"
        )
        assert _collectives(layer) == layer_theory, (rank, kind, _collectives(layer), layer_theory)
        per_layer = {key: (three.get(key, 0) - one.get(key, 0)) / 2 for key in {*three, *one} - {"sync"}}
        per_layer = {key: n for key, n in per_layer.items() if n}
        assert per_layer == layer_theory, (
            f"rank {rank}: {per_layer} collectives per extra layer, a {mode} layer needs {layer_theory} "
            f"(1 layer {one}, 3 layers {three})"
        )


def test_sdpa_route_no_per_layer_sync(dist_pool):
    _assert_no_per_layer_cost(dist_pool.run(2, _counts_per_step, "nano", "ring"), "ring", "nano")


def test_ring_collectives_at_four_ranks(dist_pool):
    _assert_no_per_layer_cost(dist_pool.run(4, _counts_per_step, "nano", "ring"), "ring", "nano")


def test_checkpoint_recompute_no_per_layer_sync(dist_pool):
    _assert_no_per_layer_cost(dist_pool.run(2, _counts_per_step, "nano_ckpt", "allgather"), "allgather", "nano_ckpt")


def test_hf_route_no_per_layer_sync(dist_pool):
    _assert_no_per_layer_cost(dist_pool.run(2, _counts_per_step, "llama", "ring"), "ring", "llama")


def test_ulysses_collectives_per_layer(dist_pool):
    _assert_no_per_layer_cost(dist_pool.run(2, _counts_per_step, "nano", "ulysses"), "ulysses", "nano")


def test_hybrid_collectives_per_layer(dist_pool):
    results = dist_pool.run(4, _counts_per_step, "nano", "hybrid", 2)
    _assert_no_per_layer_cost(results, "hybrid", "nano", ulysses_size=2)


def _one_rank_hf_syncs(rank: int, world_size: int) -> dict:
    """Host syncs of one steady-state step of a swapped Llama at SP = 1, per way of giving positions."""
    model = build("llama", 2)
    swap_attention(model, {"size": 1, "mode": "ring"}, group=dist.group.WORLD)
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(3))
    plain = torch.arange(SEQ)[None]
    packed = torch.cat([torch.arange(5), torch.arange(SEQ - 5)])[None]  # two documents, positions restart
    result = {}
    for name, kwargs in (("none", {}), ("plain", {"position_ids": plain}), ("packed", {"position_ids": packed})):
        def step(kwargs: dict = kwargs) -> None:
            model(input_ids=ids, **kwargs).logits.square().mean().backward()

        step()  # warm-up
        with counting() as counts:
            step()
        result[name] = counts.get("sync", 0)
    return result


def test_hf_route_one_rank_reads_nothing(dist_pool):
    """At SP = 1 with no attention mask, a swapped HF model needs no host read at all (no peer to agree
    with, no boundaries to find) when position_ids are absent or count up: an inner model's preparer
    trusts the outer one's (found on an H200 by gpu-check's host-sync stage: the inner LlamaModel read
    restarts in the positions its outer LlamaForCausalLM had just filled in). Restarting positions
    (packed documents) are read, once per batch, to find the boundaries."""
    (r,) = dist_pool.run(1, _one_rank_hf_syncs)
    assert r["none"] == 0 and r["plain"] == 0, r
    assert r["packed"] >= 1, r
