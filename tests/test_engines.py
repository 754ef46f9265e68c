"""Engines with sequence parallelism: DeepSpeed (ZeRO 0-3), FSDP2, FSDP1, FairScale wrapping, apex.

Every parity test trains a small causal LM whose attention calls ``seqpar.attention`` itself (so the
engine logic is tested apart from the attention swap) on P gloo ranks, and compares the per-step
losses and the first step's reduced gradients with plain single-process PyTorch on the same global
batch (fp32, AdamW, no clipping).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import seqpar

VOCAB, DIM, HEADS, KV_HEADS, SEQ = 61, 32, 4, 2, 48
LR = 1e-2
RTOL = 1e-4

# ------------------------------------------------------------------------ the toy model


class _Block(nn.Module):
    def __init__(self, mode: str, sharding: str) -> None:
        super().__init__()
        self.mode, self.sharding = mode, sharding
        self.norm1 = nn.LayerNorm(DIM)
        self.q = nn.Linear(DIM, DIM, bias=False)
        self.kv = nn.Linear(DIM, 2 * DIM * KV_HEADS // HEADS, bias=False)
        self.o = nn.Linear(DIM, DIM, bias=False)
        self.norm2 = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.norm1(x)
        hd = DIM // HEADS
        q = self.q(h).view(b, s, HEADS, hd).transpose(1, 2)  # (B, H, S_local, hd)
        k, v = self.kv(h).view(b, s, 2, KV_HEADS, hd).permute(2, 0, 3, 1, 4)  # (B, KV, S_local, hd) each
        a = seqpar.attention(q, k, v, causal=True, mode=self.mode, sharding=self.sharding)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, DIM))
        return x + self.mlp(self.norm2(x))


class ToyLM(nn.Module):
    """Embedding + learned positions (indexed by global position ids) + 2 GQA blocks + LM head."""

    def __init__(self, mode: str = "ring", sharding: str = "contiguous", layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(SEQ + 8, DIM)
        self.blocks = nn.ModuleList(_Block(mode, sharding) for _ in range(layers))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids) + self.pos(position_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))  # (B, S_local, V)


def _global_batch(step: int, size: int, seq: int = SEQ) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(1, VOCAB, (size, seq), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def _rows(batch: dict[str, torch.Tensor], start: int, n: int) -> dict[str, torch.Tensor]:
    return {k: v[start:start + n] for k, v in batch.items()}


def _clean(name: str) -> str:
    for junk in ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "module."):
        name = name.replace(junk, "")
    return name


def _reference(steps: int, global_bs: int, seq: int = SEQ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process fp32 training on the full global batch: the ground truth."""
    from seqpar.data import shard_batch
    from seqpar.loss import sequence_parallel_loss

    torch.manual_seed(0)
    model = ToyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses, grads = [], {}
    for step in range(steps):
        b = shard_batch(_global_batch(step, global_bs, seq))
        loss = sequence_parallel_loss(model(b["input_ids"], b["position_ids"]), b["shift_labels"])
        loss.backward()
        if step == 0:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grads


_REF_CACHE: dict[tuple, Any] = {}


def reference(steps: int, global_bs: int, seq: int = SEQ):
    key = (steps, global_bs, seq)
    if key not in _REF_CACHE:
        _REF_CACHE[key] = _reference(*key)
    return _REF_CACHE[key]


def _check(ref, got, rtol: float = RTOL) -> None:
    ref_losses, ref_grads = ref
    losses, grads = got
    assert len(losses) == len(ref_losses)
    for i, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
        assert abs(a - b) <= rtol * abs(b), f"step {i}: loss {a} vs single-device {b}"
    assert set(grads) == set(ref_grads), (sorted(grads), sorted(ref_grads))
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def _sp_step_loss(model, batch, manager, sharding):
    from seqpar.data import shard_batch
    from seqpar.loss import sequence_parallel_loss

    b = shard_batch(batch, group=manager.sp_group, sharding=sharding)
    logits = model(b["input_ids"], b["position_ids"])
    return sequence_parallel_loss(logits, b["shift_labels"], group=manager.sp_group)


def _dp_mean(x: float, manager) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, group=manager.dp_group)
    return t.item() / manager.dp_size


# ------------------------------------------------------------------------ DeepSpeed


def ds_config(sp: int, mode: str, stage: int, dp: int, micro: int = 1, ga: int = 1,
              sharding: str = "contiguous") -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": ga,
        "train_batch_size": micro * ga * dp,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 0.0,
        "steps_per_print": 10**6,
        "sequence_parallel": {"size": sp, "mode": mode, "sharding": sharding, "swap": "none"},
    }


def _ds_run(rank, world, sp, mode, stage, steps, micro=1, ga=1, sharding="contiguous"):
    from deepspeed.utils import safe_get_full_grad
    from seqpar.integrations.deepspeed import initialize

    dp = world // sp
    torch.manual_seed(0)
    model = ToyLM(mode, sharding)
    engine, _, _, _ = initialize(model=model, config=ds_config(sp, mode, stage, dp, micro, ga, sharding))
    manager = engine.seqpar_manager
    assert (engine.sequence_parallel_size, engine.seq_dp_world_size) == (sp, world)
    losses, grads = [], {}
    for step in range(steps):
        full = _global_batch(step, micro * ga * dp)
        total = 0.0
        for m in range(ga):
            rows = _rows(full, (m * dp + manager.dp_rank) * micro, micro)
            loss = _sp_step_loss(engine, rows, manager, sharding)
            engine.backward(loss)
            total += loss.item() / ga
            if step == 0 and ga == 1:  # with ga > 1 ZeRO-2 holds no gradient between micro-steps
                grads = {_clean(n): safe_get_full_grad(p).detach().clone()
                         for n, p in engine.module.named_parameters()}
            engine.step()  # DeepSpeed's rule: step after every micro-batch; it knows the boundary
        losses.append(_dp_mean(total, manager))
    # Global batch row order differs from the reference when ga > 1 (micro-major): same set of rows.
    return losses, grads


@pytest.mark.parametrize(
    "world,sp,mode,stage",
    [
        (2, 2, "ring", 2),
        (2, 2, "allgather", 2),
        (4, 4, "ring", 2),
        (4, 2, "ring", 2),
        (4, 2, "allgather", 2),
    ],
)
def test_deepspeed_zero2_parity(dist_pool, world, sp, mode, stage):
    steps = 5
    out = dist_pool.run(world, _ds_run, sp, mode, stage, steps, timeout=240)
    ref = reference(steps, world // sp)
    for rank_out in out:
        _check(ref, rank_out)


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_deepspeed_other_zero_stages(dist_pool, stage):
    out = dist_pool.run(2, _ds_run, 2, "ring", stage, 2, timeout=240)
    ref = reference(2, 1)
    for rank_out in out:
        _check(ref, rank_out)


def test_deepspeed_grad_accumulation_zigzag(dist_pool):
    # 4 ranks = dp 2 x sp 2, 2 micro-steps of 1 sample each: the global batch has 4 samples.
    out = dist_pool.run(4, _ds_run, 2, "ring", 2, 3, 1, 2, "zigzag", timeout=240)
    ref_losses, _ = reference(3, 4)
    for losses, _ in out:
        _check((ref_losses, {}), (losses, {}))


# ------------------------------------------------------------------------ FSDP


def _fsdp_run(rank, world, sp, mode, version, steps, sharding="contiguous"):
    from seqpar.integrations import fsdp
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from seqpar.config import SeqParConfig

    cfg = SeqParConfig(size=sp, mode=mode, sharding=sharding, swap="none")
    manager = seqpar.init_process_groups(config=cfg)
    dp = manager.dp_size
    torch.manual_seed(0)
    model = fsdp.wrap(ToyLM(mode, sharding), cfg, manager=manager, fsdp={"version": version}, swap=False)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses, grads = [], {}
    for step in range(steps):
        rows = _rows(_global_batch(step, dp), manager.dp_rank, 1)
        loss = _sp_step_loss(model, rows, manager, sharding)
        loss.backward()
        if step == 0:
            if version == 2:
                grads = {_clean(n): p.grad.full_tensor().clone() for n, p in model.named_parameters()}
            else:
                with FSDP.summon_full_params(model, with_grads=True):
                    grads = {_clean(n): p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(_dp_mean(loss.item(), manager))
    return losses, grads


@pytest.mark.parametrize(
    "world,sp,mode,version",
    [
        (2, 2, "ring", 2),
        (2, 2, "allgather", 2),
        (4, 4, "allgather", 2),
        (4, 2, "ring", 2),
        (2, 2, "ring", 1),
        (4, 2, "allgather", 1),
    ],
)
def test_fsdp_parity(dist_pool, world, sp, mode, version):
    steps = 5
    out = dist_pool.run(world, _fsdp_run, sp, mode, version, steps, timeout=240)
    ref = reference(steps, world // sp)
    for rank_out in out:
        _check(ref, rank_out)


def test_fsdp_default_divide_factor_would_be_wrong():
    """The arithmetic behind the divide factor: FSDP's default (1/W) undercounts by the SP size."""
    dp, sp = 2, 2
    full_grads = [torch.tensor(1.0), torch.tensor(3.0)]  # one per DP replica
    shares = [g / sp for g in full_grads for _ in range(sp)]  # each SP rank holds a share
    assert math.isclose(sum(shares).item() / (dp * sp), 1.0)  # default: mean/sp, wrong
    assert math.isclose(sum(shares).item() / dp, 2.0)  # seqpar's factor: the DP mean, right
