"""Engines with sequence parallelism: DeepSpeed (ZeRO 0-3), FSDP2, FSDP1, FairScale wrapping, apex.

Every parity test trains a small causal LM whose attention calls ``seqpar.attention`` itself (so the
engine logic is tested apart from the attention swap) on P gloo ranks, and compares the per-step
losses and the first step's reduced gradients with plain single-process PyTorch on the same global
batch (fp32, AdamW, no clipping).
"""

from __future__ import annotations

import importlib.util
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import seqpar
from seqpar.testing.deepspeed_teardown import releases_deepspeed_engines

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
    from seqpar.sequence.batch import shard_batch
    from seqpar.sequence.loss import sequence_parallel_loss

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


def _assert_parity(dist_pool, run, world: int, sp: int, mode: str, option: int, steps: int) -> None:
    """``run(rank, world, sp, mode, option, steps)`` (:func:`_ds_run` with a ZeRO stage, :func:`_fsdp_run`
    with an FSDP version) on ``world`` ranks: every rank's losses and first-step gradients equal the
    one-process reference on the same global batch (one row per DP replica, ``world // sp``).

    Seen failing: every DeepSpeed case with the mpu's DP size reported as dp * sp, and every FSDP2 case
    with the divide factor set to the world size (integrations/fsdp.py)."""
    out = dist_pool.run(world, run, sp, mode, option, steps, timeout=240)
    ref = reference(steps, world // sp)
    for rank_out in out:
        _check(ref, rank_out)


def _sp_step_loss(model, batch, manager, sharding):
    from seqpar.sequence.batch import shard_batch
    from seqpar.sequence.loss import sequence_parallel_loss

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


@releases_deepspeed_engines
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
            if step == 0 and m == ga - 1:  # ZeRO-2 holds no gradient between micro-steps: read at the boundary
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
    _assert_parity(dist_pool, _ds_run, world, sp, mode, stage, steps=5)


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_deepspeed_other_zero_stages(dist_pool, stage):
    _assert_parity(dist_pool, _ds_run, 2, 2, "ring", stage, steps=2)


def test_deepspeed_grad_accumulation_zigzag(dist_pool):
    """4 ranks = dp 2 x sp 2, 2 micro-steps of 1 sample each (the global batch has 4 samples): the losses and
    the first step's reduced gradients (read at the accumulation boundary), each parameter's against the
    one-process reference.

    Seen failing: the loss scaled by ``sp`` inside ``engine.backward`` when ``gradient_accumulation_steps > 1``
    (every gradient doubled) -> ``embed.weight`` 2x off (first in order); the losses alone (AdamW normalises a gradient's
    scale away) passed that break."""
    out = dist_pool.run(4, _ds_run, 2, "ring", 2, 3, 1, 2, "zigzag", timeout=240)
    ref = reference(3, 4)
    for rank_out in out:
        _check(ref, rank_out)


# ------------------------------------------------------------------------ FSDP


def _fsdp_run(rank, world, sp, mode, version, steps, sharding="contiguous"):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from seqpar.config import SeqParConfig
    from seqpar.integrations import fsdp

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
    _assert_parity(dist_pool, _fsdp_run, world, sp, mode, version, steps=5)


def test_fsdp_default_divide_factor_would_be_wrong():
    """The arithmetic behind the divide factor: FSDP's default (1/W) undercounts by the SP size."""
    dp, sp = 2, 2
    full_grads = [torch.tensor(1.0), torch.tensor(3.0)]  # one per DP replica
    shares = [g / sp for g in full_grads for _ in range(sp)]  # each SP rank holds a share
    assert math.isclose(sum(shares).item() / (dp * sp), 1.0)  # default: mean/sp, wrong
    assert math.isclose(sum(shares).item() / dp, 2.0)  # seqpar's factor: the DP mean, right


# ------------------------------------------------------------------------ DeepSpeed extras


class _Samples(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.arange(SEQ) + 100 * i  # sample i is recognisable from any of its tokens
        return {"input_ids": ids, "labels": ids.clone()}


@releases_deepspeed_engines
def _ds_loader(rank, world, sp):
    from seqpar.integrations.deepspeed import ShardedDeepSpeedLoader, initialize

    dp = world // sp
    cfg = ds_config(sp, "ring", 2, dp)
    engine, _, loader, _ = initialize(model=ToyLM(), config=cfg, training_data=_Samples())
    assert isinstance(loader, ShardedDeepSpeedLoader) and engine.training_dataloader is loader
    loader.loader.num_local_io_workers = 0  # pool ranks are daemonic: no loader worker processes
    batch = next(iter(loader))
    return batch["input_ids"].tolist(), batch["position_ids"].tolist(), engine.seqpar_manager.dp_rank


@pytest.mark.parametrize("world,sp", [(2, 2), (4, 2)])
def test_deepspeed_training_data_is_sharded(dist_pool, world, sp):
    out = dist_pool.run(world, _ds_loader, sp, timeout=240)
    for dp_rank in range(world // sp):
        group = [o for o in out if o[2] == dp_rank]
        samples = {ids[0][0] // 100 for ids, _, _ in group}
        assert len(samples) == 1, "every rank of an SP group gets the same sample"
        positions = [pos[0] for _, pos, _ in group]
        assert sorted(p for ps in positions for p in ps) == list(range(SEQ)), "distinct shards"
    firsts = {o[0][0][0] // 100 for o in out}
    assert len(firsts) == world // sp, "DP replicas get distinct samples"


def test_deepspeed_refusals_before_engine_start(monkeypatch):
    from seqpar.config import ConfigError
    from seqpar.integrations import deepspeed as ds

    cfg = ds_config(2, "ring", 3, 1)
    cfg["zero_optimization"]["reduce_scatter"] = False
    with pytest.raises(ConfigError, match="reduce_scatter"):
        ds.initialize(model=ToyLM(), config=cfg)
    with pytest.raises(ConfigError, match="mpu"):
        ds.initialize(model=ToyLM(), config=ds_config(2, "ring", 2, 1), mpu=object())
    bad = ds_config(2, "ring", 2, 1)
    bad["sequence_parallel"]["mode"] = "spiral"
    with pytest.raises(ConfigError, match="mode"):
        ds.initialize(model=ToyLM(), config=bad)
    monkeypatch.setitem(__import__("sys").modules, "deepspeed", None)
    with pytest.raises(ImportError, match="pip install"):
        ds.initialize(model=ToyLM(), config=ds_config(2, "ring", 2, 1))


# ------------------------------------------------------------------------ FairScale


def _fairscale_wrap(rank, world, sp):
    from seqpar.integrations import fairscale as fs

    manager = seqpar.init_process_groups(sp)
    fsdp_cls = fs.import_fairscale_fsdp()
    model = ToyLM()
    root = fs._wrap_units(fsdp_cls, model, manager, fs.FairScaleOptions(), {_Block},
                          compute_device=torch.device("cpu"))
    units = [m for m in root.modules() if isinstance(m, fsdp_cls)]
    return {
        "units": len(units),
        "group_sizes": sorted({u.process_group.size() for u in units}),
        "factors": sorted({(u.gradient_predivide_factor, u.gradient_postdivide_factor) for u in units}),
        "dp": manager.dp_size,
    }


@pytest.mark.parametrize("world,sp", [(2, 2), (4, 2), (4, 1)])
def test_fairscale_wrapping_logic_on_cpu(dist_pool, world, sp):
    pytest.importorskip("fairscale")
    out = dist_pool.run(world, _fairscale_wrap, sp, timeout=120)
    for o in out:
        assert o["units"] == 3  # two blocks + the root
        assert o["group_sizes"] == [world], "shard/reduce over the SP-DP group (all ranks)"
        (pre, post), = o["factors"]
        assert pre * post == o["dp"] and pre >= 1 and post >= 1


def test_fairscale_divide_factors_and_options():
    from seqpar.integrations import fairscale as fs

    for dp in (1, 2, 3, 4, 8, 12):
        pre, post = fs.divide_factors(dp)
        assert pre * post == dp and 1 <= pre <= post
    opts = fs.FairScaleOptions.from_dict({"mixed_precision": True, "compute_dtype": "bf16"})
    assert opts.compute_dtype is torch.bfloat16
    with pytest.raises(ValueError, match="unknown key"):
        fs.FairScaleOptions.from_dict({"mixed_precison": True})
    with pytest.raises(ValueError, match="mixed_precision"):
        fs.FairScaleOptions.from_dict({"compute_dtype": "bf16"})


def test_fairscale_refuses_cpu_and_explains_missing_package(monkeypatch):
    from seqpar.integrations import fairscale as fs

    if not torch.cuda.is_available() and importlib.util.find_spec("fairscale") is not None:
        with pytest.raises(RuntimeError, match="use seqpar.integrations.fsdp on CPU"):
            fs.wrap(ToyLM(), {"size": 1, "swap": "none"})
    monkeypatch.setitem(__import__("sys").modules, "fairscale", None)
    monkeypatch.setitem(__import__("sys").modules, "fairscale.nn.data_parallel", None)
    with pytest.raises(ImportError, match="pip install fairscale"):
        fs.wrap(ToyLM(), {"size": 1, "swap": "none"})


# ------------------------------------------------------------------------ apex


class _FakeApexNormalization:
    """Stand-ins with apex's constructor signatures, to test the replacement logic without apex."""

    class FusedLayerNorm(nn.LayerNorm):
        def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True):
            super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine)

    class FusedRMSNorm(nn.RMSNorm):
        def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True):
            super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine)


def test_apex_fallback_and_replacement(caplog):
    from transformers import LlamaConfig, LlamaForCausalLM

    from seqpar.integrations import apex

    torch.manual_seed(0)
    toy = ToyLM()
    if not apex.apex_available():
        with caplog.at_level("INFO", logger="seqpar"):
            assert apex.apply_fused_norms(toy) == 0
            assert apex.apply_fused_norms(toy) == 0
        assert sum("apex is not importable" in r.getMessage() for r in caplog.records) <= 1
    cfg = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    llama = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in llama.parameters():
            p.add_(0.01 * torch.randn_like(p))  # norms' weights away from 1
    ids = torch.randint(0, 50, (1, 12))
    before = llama(ids).logits
    n = apex.apply_fused_norms(llama, normalization=_FakeApexNormalization)
    assert n == 2 * 2 + 1  # two per layer and the final norm
    torch.testing.assert_close(llama(ids).logits, before, rtol=1e-5, atol=1e-5)
    assert apex.apply_fused_norms(toy, normalization=_FakeApexNormalization) == 5  # 2 x 2 + 1 LayerNorms


def test_deepspeed_config_sources(tmp_path):
    import argparse
    import json

    from seqpar.config import ConfigError, SeqParConfig
    from seqpar.integrations.deepspeed import load_deepspeed_config

    cfg = ds_config(2, "allgather", 2, 1)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    for kw in ({"config": cfg}, {"config": str(path)}, {"config_params": str(path)},
               {"args": argparse.Namespace(deepspeed_config=str(path))}):
        got = load_deepspeed_config(**kw)
        assert got == cfg and SeqParConfig.from_deepspeed_config(got).mode == "allgather"
    assert load_deepspeed_config(config=cfg) is not cfg  # the caller's dict is never edited
    with pytest.raises(ConfigError, match="both"):
        load_deepspeed_config(argparse.Namespace(deepspeed_config=str(path)), config=cfg)
    with pytest.raises(ConfigError, match="no DeepSpeed config"):
        load_deepspeed_config()


def test_deepspeed_init_distributed_gets_timeout_s(monkeypatch):
    """timeout_s reaches deepspeed.init_distributed (which uses it when it creates the world group)."""
    from datetime import timedelta

    from seqpar.config import SeqParConfig
    from seqpar.integrations import deepspeed as ds_glue

    calls = []

    class FakeDeepSpeed:
        @staticmethod
        def init_distributed(**kwargs):
            calls.append(kwargs)

    monkeypatch.setenv("RANK", "0")  # as under a launcher: the environment is left alone
    monkeypatch.setenv("WORLD_SIZE", "1")
    ds_glue._init_distributed(FakeDeepSpeed, SeqParConfig(timeout_s=42), None, None)
    ds_glue._init_distributed(FakeDeepSpeed, SeqParConfig(), 29501, True)
    assert calls[0]["timeout"] == timedelta(seconds=42)
    assert "timeout" not in calls[1] and calls[1]["distributed_port"] == 29501
