"""DeepSpeed ZeRO-2/3 with reentrant activation checkpointing: a parameter that two checkpointed calls use in one
forward is refused by name, on every rank, in that forward (``integrations/deepspeed_reuse.py::refuse_reentrant_reuse``).

Under reentrant checkpointing each checkpointed call's recompute runs a backward of its own, so such a parameter's
gradient is accumulated, and ZeRO-2/3's per-parameter reduction hook fired, once per call in one backward
(DeepSpeed's "Gradient computed twice", or a bare AssertionError in ZeRO-3's stage3). The fuzzer found it twice:
Zamba's shared transformer block, held by several layers (case 1789442528), and Dory's looped layers, called
several times per forward (1601891524). Both are one rule, counted per parameter per forward.

The toys here are transformers ``GradientCheckpointingLayer``s (what the adapter looks for) around a small MLP:
per-token maths, so sequence parallelism needs no attention swap and the reference is one process on the whole
sequence.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from seqpar.config import ConfigError
from seqpar.testing.deepspeed_teardown import releases_deepspeed_engines

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")

VOCAB, DIM, SEQ = 23, 16, 8


def _layer_class() -> type[nn.Module]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    class Layer(GradientCheckpointingLayer):
        """``(B, S, D) -> (B, S, D)``: a residual MLP, plus a block it may share with other layers."""

        def __init__(self, shared: nn.Module | None = None) -> None:
            super().__init__()
            self.mlp = nn.Linear(DIM, DIM)
            self.shared = shared

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + torch.tanh(self.mlp(x))
            return x if self.shared is None else x + torch.tanh(self.shared(x))

    return Layer


class Toy(nn.Module):
    """Embedding, ``layers`` checkpointable layers run ``loops`` times, LM head; ``shared``: every layer holds one
    more Linear, the same module (Zamba's shape); ``loops`` > 1 is Dory's."""

    def __init__(self, layers: int = 2, loops: int = 1, shared: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        layer = _layer_class()
        block = nn.Linear(DIM, DIM) if shared else None
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(layer(block) for _ in range(layers))
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.loops = loops

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(input_ids)  # (B, S_local, D)
        for _ in range(self.loops):
            for layer in self.layers:
                x = layer(x)
        return self.head(x)  # (B, S_local, V)


def _checkpoint(model: nn.Module, reentrant: bool | None) -> nn.Module:
    """What transformers' ``gradient_checkpointing_enable`` sets on each layer (``None``: checkpointing off)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    for m in model.modules():
        if isinstance(m, GradientCheckpointingLayer):
            m.gradient_checkpointing = reentrant is not None
            m._gradient_checkpointing_func = functools.partial(torch.utils.checkpoint.checkpoint,
                                                               use_reentrant=bool(reentrant))
    return model


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))
    return {"input_ids": ids, "labels": ids.clone()}


def _loss(model, batch, group=None) -> torch.Tensor:
    from seqpar.sequence.loss import sequence_parallel_loss

    return sequence_parallel_loss(model(batch["input_ids"]), batch["shift_labels"], group=group)


def _refused(model: nn.Module, ids: torch.Tensor) -> str | None:
    try:
        model(ids)
    except ConfigError as e:
        return str(e)
    return None


def test_the_rule_per_parameter_per_forward() -> None:
    """One process, the adapter's hooks alone (no DeepSpeed): a shared block and a looped layer are refused by
    name in the forward, only with reentrant checkpointing in training with grad; checkpointing enabled after the
    hooks is seen; two forwards before one backward of a model whose layers are each called once pass, and so does
    the forward after a refused one (the count is per forward).

    Seen failing: with the per-forward reset dropped (``start`` not clearing the count), the second of two forwards
    was refused; with the count keyed by layer instead of by parameter (``id(module)``), the shared block passed.
    """
    from seqpar.integrations.deepspeed_reuse import refuse_reentrant_reuse

    ids = _batch()["input_ids"]
    shared, looped, plain = Toy(shared=True), Toy(loops=2), Toy()
    for model in (shared, looped, plain):
        refuse_reentrant_reuse(model, 2)
        assert _refused(model, ids) is None  # checkpointing off
        _checkpoint(model, reentrant=True)  # enabled after the hooks, as a user may
    msg = _refused(shared, ids)
    assert msg is not None and "layers.0.shared.weight" in msg and "layers.0 and layers.1 both use it" in msg
    assert "ZeRO-2" in msg and "use_reentrant': False" in msg
    msg = _refused(looped, ids)
    assert msg is not None and "layers.0.mlp.weight" in msg and "calls the checkpointed layer layers.0 more than once" in msg
    assert _refused(looped, ids) is not None  # refused again: the count of the failed forward was dropped
    plain.zero_grad()
    (plain(ids).sum() + plain(ids).sum()).backward()  # two forwards before one backward
    two = {n: p.grad.clone() for n, p in plain.named_parameters()}
    plain.zero_grad()
    (2 * plain(ids).sum()).backward()
    for n, g in two.items():
        torch.testing.assert_close(g, plain.get_parameter(n).grad)
    for model in (shared, looped):
        with torch.no_grad():
            assert _refused(model, ids) is None  # no backward, nothing reduced
        model.eval()
        assert _refused(model, ids) is None  # transformers does not checkpoint in eval
        model.train()
        _checkpoint(model, reentrant=False)
        assert _refused(model, ids) is None  # non-reentrant: one backward graph


def _call_as_transformers_5_17(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """transformers 5.17's ``GradientCheckpointingLayer.__call__`` (seqpar's floor): the whole module call, its
    hooks included, runs inside the checkpoint, whose reentrant forward runs without grad (played here by
    ``torch.no_grad``); 5.24 checkpoints ``forward`` only, so the hooks run outside it, with grad."""
    if self.gradient_checkpointing and self.training:
        with torch.no_grad():
            return nn.Module.__call__(self, *args, **kwargs)
    return nn.Module.__call__(self, *args, **kwargs)


def test_the_rule_when_the_layer_hooks_run_inside_the_checkpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    """On transformers 5.17 a layer's hooks run inside its reentrant checkpoint, without grad: the rule reads grad
    at the model's forward, so a shared block and a looped layer are refused there too, and a forward under
    ``torch.no_grad`` still is not. Seen failing: with the layer hook reading the grad mode it runs in (the code
    before session 39, which let every reuse through on transformers 5.17), neither was refused."""
    from seqpar.integrations.deepspeed_reuse import refuse_reentrant_reuse

    ids = _batch()["input_ids"]
    for model, fragment in ((Toy(shared=True), "both use it"), (Toy(loops=2), "more than once")):
        monkeypatch.setattr(type(model.layers[0]), "__call__", _call_as_transformers_5_17)
        refuse_reentrant_reuse(model, 2)
        _checkpoint(model, reentrant=True)
        msg = _refused(model, ids)
        assert msg is not None and fragment in msg, msg
        with torch.no_grad():
            assert _refused(model, ids) is None


def test_the_rule_under_torch_compile() -> None:
    """``torch.compile`` (aot_eager) of a model carrying the hooks: dynamo traces them (the closure's count is a
    side effect it replays), and the refusal still comes, at every call, and not for a model whose layers are
    each called once (whose compiled graph then refuses when the loop count changes and dynamo retraces).

    Seen failing: with the hook's ``raise`` replaced by ``return`` the compiled looped model ran through."""
    from seqpar.integrations.deepspeed_reuse import refuse_reentrant_reuse

    ids = _batch()["input_ids"]
    torch._dynamo.reset()
    try:
        model = _checkpoint(Toy(), reentrant=True)
        refuse_reentrant_reuse(model, 3)
        compiled = torch.compile(model, backend="aot_eager")
        for _ in range(2):
            assert _refused(compiled, ids) is None
        model.loops = 2
        for _ in range(2):
            msg = _refused(compiled, ids)
            assert msg is not None and "more than once" in msg and "ZeRO-3" in msg
    finally:
        torch._dynamo.reset()


_SGD_LR = 0.5


def _config(stage: int, world: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
            "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0, "steps_per_print": 10 ** 9,
            "sequence_parallel": {"size": world, "mode": "ring", "swap": "none"}}


@releases_deepspeed_engines
def _engine_task(rank: int, world: int) -> dict:
    """Every rank (SP = world): the shared block under ZeRO-3 and the looped layers under ZeRO-2 compiled with
    ``engine.compile`` (aot_eager), reentrant, their errors; then the looped layers non-reentrant under ZeRO-2, one
    SGD step's parameters."""
    from seqpar.integrations.deepspeed import initialize
    from seqpar.sequence.batch import shard_batch

    out: dict = {}
    cases = {"shared zero3": (Toy(shared=True), 3, True, False), "looped zero2 compiled": (Toy(loops=2), 2, True, True),
             "looped zero2 non-reentrant": (Toy(loops=2), 2, False, False)}
    for name, (model, stage, reentrant, compile_) in cases.items():
        engine, *_ = initialize(model=_checkpoint(model, reentrant), config=_config(stage, world),
                                optimizer=lambda p: torch.optim.SGD(p, lr=_SGD_LR))
        manager = engine.seqpar_manager
        try:
            if compile_:
                from torch._dynamo.utils import counters

                torch._dynamo.reset()
                engine.compile(backend="aot_eager")
                graphs = int(counters["stats"]["unique_graphs"])
            engine.train()
            try:
                loss = _loss(engine, shard_batch(_batch(), group=manager.sp_group), manager.sp_group)
            finally:  # dynamo made graphs of the forward (up to the refusal): it was not run eagerly
                if compile_:
                    out[f"{name} graphs"] = int(counters["stats"]["unique_graphs"]) - graphs
            engine.backward(loss)
            engine.step()
            from deepspeed.utils import safe_get_full_fp32_param

            out[name] = {n: safe_get_full_fp32_param(p).detach().clone() for n, p in engine.module.named_parameters()}
        except Exception as e:  # noqa: BLE001 - returned to the test, which checks it on every rank
            out[name] = e
        finally:
            torch._dynamo.reset()
            manager.destroy()
        dist.barrier()
    return out


@pytest.mark.timeout(400)
def test_refused_on_every_rank_and_non_reentrant_exact(dist_pool) -> None:
    """DeepSpeed on 2 ranks (SP 2): the shared block (ZeRO-3) and the looped layers (ZeRO-2, ``engine.compile``d)
    are refused with the same ConfigError on both ranks at the first forward (no hang: the count is the model's
    structure); the looped layers with non-reentrant checkpointing train one SGD step to the parameters of one
    process on the whole sequence (every parameter on its own scale).

    The compiled case also asserts dynamo made graphs of the forward: the refusal is not left to an eager fallback.

    Seen failing: without the adapter's hooks (``refuse_reentrant_reuse`` not called in ``initialize``) the shared
    block raised ZeRO-3's bare AssertionError in the backward and the looped layers DeepSpeed's "Gradient computed
    twice"."""
    ref = Toy(loops=2)
    from seqpar.sequence.batch import shard_batch

    _loss(ref, shard_batch(_batch())).backward()
    with torch.no_grad():
        expected = {n: p - _SGD_LR * p.grad for n, p in ref.named_parameters()}
    per_rank = dist_pool.run(2, _engine_task, timeout=360)
    messages = {"shared zero3": set(), "looped zero2 compiled": set()}
    for rank, out in enumerate(per_rank):
        for name, fragment in (("shared zero3", "both use it"), ("looped zero2 compiled", "more than once")):
            assert isinstance(out[name], ConfigError), f"rank {rank} {name}: {out[name]!r}"
            assert fragment in str(out[name]), str(out[name])
            messages[name].add(str(out[name]))
        got = out["looped zero2 non-reentrant"]
        assert not isinstance(got, Exception), f"rank {rank}: {got!r}"
        for n, want in expected.items():
            step = (want - ref.get_parameter(n)).detach()  # judged on the step's own scale
            torch.testing.assert_close(got[n] - ref.get_parameter(n).detach(), step, rtol=1e-4,
                                       atol=1e-6 * float(step.abs().max()), msg=lambda m, n=n, r=rank: f"rank {r} {n}: {m}")
        assert out["looped zero2 compiled graphs"] > 0, f"rank {rank}: engine.compile made no graph"
    assert all(len(m) == 1 for m in messages.values()), messages
