"""DeepSpeed ZeRO-2/3 with reentrant activation checkpointing and a parameter used both inside one checkpointed
call and outside every checkpointed layer (the open question of session 21, mut21r point 3).

``integrations/deepspeed_reuse.py::refuse_reentrant_reuse`` refuses a parameter two reentrantly checkpointed calls use in
one forward (each call's recompute runs a backward of its own, so ZeRO-2/3's per-parameter reduction hook would
fire twice). Is a parameter used by *one* checkpointed call and once more outside any checkpointed layer safe?
Two shapes, each trained one SGD step at SP 2 under ZeRO-2 and ZeRO-3:

- a tiny Llama with ``tie_word_embeddings=True`` and ``gradient_checkpointing_enable(use_reentrant=True)``: the
  tied weight is used by the embedding and the LM head, both outside the checkpointed decoder layers, so its two
  uses meet in the outer backward's one ``AccumulateGrad``;
- a toy whose ``shared`` Linear is used inside the checkpointed layer 0 *and* by the model after the layers: the
  recompute's inner backward accumulates one gradient, the outer backward the other.

Found: the Llama is exact; the toy crashed in the backward (ZeRO-2: DeepSpeed's "Gradient computed twice" naming
the parameter; ZeRO-3: a bare AssertionError), so the adapter's rule now counts such an outside use too and
refuses it by name in the forward, on every rank.
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

VOCAB, DIM, SEQ, ROWS = 37, 16, 12, 2
LR = 0.5


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=True, use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


def _layer_class() -> type[nn.Module]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    class Layer(GradientCheckpointingLayer):
        """``(B, S, D) -> (B, S, D)``: a residual MLP, plus (layer 0 only) the model's ``shared`` Linear."""

        def __init__(self, shared: nn.Module | None) -> None:
            super().__init__()
            self.mlp = nn.Linear(DIM, DIM)
            self.scale = nn.Parameter(torch.full((DIM,), 0.9))  # a parameter of the layer itself
            self.shared = shared

        def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
            x = x + self.scale * torch.tanh(self.mlp(x))
            return x if self.shared is None else x + torch.tanh(self.shared(x))

    return Layer


class Toy(nn.Module):
    """Embedding, 2 checkpointable layers, then ``shared`` once more outside them, LM head. ``shared`` is held by
    layer 0 (used inside its checkpointed call) and by the model (used outside any checkpointed layer)."""

    def __init__(self, outside: str = "after") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.outside = outside  # where the model uses `shared` itself: "after" the layers, "before", or "none"
        layer = _layer_class()
        self.shared = nn.Linear(DIM, DIM)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([layer(self.shared), layer(None)])
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> Any:
        x = self.embed(input_ids)  # (B, S_local, D)
        if self.outside == "before":
            x = x + torch.tanh(self.shared(x))  # the outside use before the checkpointed one
        for layer in self.layers:
            x = layer(x)
        if self.outside == "after":
            x = x + torch.tanh(self.shared(x))  # the second use, outside every checkpointed layer
        return self.head(x)  # (B, S_local, V)


def _build(kind: str) -> nn.Module:
    return _llama() if kind == "llama" else Toy()


def _reentrant(model: nn.Module) -> nn.Module:
    """Reentrant checkpointing of every ``GradientCheckpointingLayer``, as ``gradient_checkpointing_enable(
    gradient_checkpointing_kwargs={"use_reentrant": True})`` sets it (transformers' own call for the Llama)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    if hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    else:
        for m in model.modules():
            if isinstance(m, GradientCheckpointingLayer):
                m.gradient_checkpointing = True
                m._gradient_checkpointing_func = functools.partial(torch.utils.checkpoint.checkpoint,
                                                                   use_reentrant=True)
    assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    return model


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(3))
    return {"input_ids": ids, "labels": ids.clone()}


def _logits(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


def _expected(kind: str) -> dict[str, torch.Tensor]:
    """One process, float64, no checkpointing, the whole sequence: every parameter after one SGD step."""
    from seqpar.sequence.batch import shard_batch
    from seqpar.sequence.loss import sequence_parallel_loss

    model = _build(kind).double()
    b = shard_batch(_batch())
    loss = sequence_parallel_loss(_logits(model(input_ids=b["input_ids"], position_ids=b["position_ids"])),
                                  b["shift_labels"])
    loss.backward()
    with torch.no_grad():
        return {n: (p - LR * p.grad).float() for n, p in model.named_parameters()}


def _config(stage: int, world: int, kind: str) -> dict:
    return {"train_micro_batch_size_per_gpu": ROWS, "zero_optimization": {"stage": stage},
            "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0, "steps_per_print": 10 ** 9,
            "sequence_parallel": {"size": world, "mode": "ring", **({"swap": "none"} if kind == "toy" else {})}}


@releases_deepspeed_engines
def _engine_task(rank: int, world: int, cases: list[tuple[str, int]]) -> dict:
    """Every rank (SP = world): each case ``(kind, stage)`` one SGD step under DeepSpeed with reentrant
    checkpointing; returns every parameter after it (its full fp32 value), or the exception."""
    from deepspeed.utils import safe_get_full_fp32_param

    from seqpar.integrations.deepspeed import initialize
    from seqpar.sequence.batch import shard_batch
    from seqpar.sequence.loss import sequence_parallel_loss

    out: dict = {}
    for kind, stage in cases:
        engine, *_ = initialize(model=_reentrant(_build(kind)), config=_config(stage, world, kind),
                                optimizer=lambda p: torch.optim.SGD(p, lr=LR))
        manager = engine.seqpar_manager
        try:
            engine.train()
            b = shard_batch(_batch(), group=manager.sp_group)
            logits = _logits(engine(input_ids=b["input_ids"], position_ids=b["position_ids"]))
            loss = sequence_parallel_loss(logits, b["shift_labels"], group=manager.sp_group)
            engine.backward(loss)
            engine.step()
            out[f"{kind} zero{stage}"] = {n: safe_get_full_fp32_param(p).detach().clone()
                                          for n, p in engine.module.named_parameters()}
        except Exception as e:  # noqa: BLE001 - returned to the test, which names it per rank
            out[f"{kind} zero{stage}"] = e
        finally:
            manager.destroy()
        dist.barrier()
    return out


CASES = [("llama", 2), ("llama", 3), ("toy", 2), ("toy", 3)]


@pytest.mark.timeout(500)
def test_tied_exact_and_outside_use_refused_by_name(dist_pool) -> None:
    """DeepSpeed ZeRO-2 and ZeRO-3 on 2 ranks (SP 2), reentrant checkpointing, SGD.

    - The tiny Llama with tied input / output embeddings trains exactly: after one step every parameter equals one
      process's (float64, whole sequence, no checkpointing), each judged on its own step's scale (the tied weight's
      two uses are outside the checkpointed layers: one outer backward sums them before ZeRO's hook fires once).
    - The toy whose Linear is used in checkpointed layer 0 and again outside the layers is refused, with the same
      ConfigError naming the parameter on both ranks, in the forward (before this rule: ZeRO-2 raised DeepSpeed's
      "The parameter shared.weight has already been reduced. Gradient computed twice" and ZeRO-3 a bare
      AssertionError, both in the backward).

    Seen failing: without the outside count (``count_outside`` hooks not registered in ``refuse_reentrant_reuse``)
    the toy's cases ended in those two backward AssertionErrors; with the Llama's gradient doubled (``engine.backward
    (2 * loss)``) "llama zero2: model.embed_tokens.weight"."""
    per_rank = dist_pool.run(2, _engine_task, CASES, timeout=420)
    expected = _expected("llama")
    init = {n: p.detach() for n, p in _build("llama").named_parameters()}
    messages = set()
    for rank, out in enumerate(per_rank):
        for stage in (2, 3):
            got = out[f"llama zero{stage}"]
            assert not isinstance(got, Exception), f"rank {rank} llama zero{stage}: {got!r}"
            assert set(got) == set(expected), (sorted(got), sorted(expected))
            for n, want in expected.items():
                step = want - init[n]
                # the step on its own scale, less the fp32 rounding of the parameter it was added to
                atol = 1e-4 * float(step.abs().max()) + 4 * torch.finfo(torch.float32).eps * float(init[n].abs().max())
                torch.testing.assert_close(got[n] - init[n], step, rtol=1e-4, atol=atol,
                                           msg=lambda m, n=n, r=rank, s=stage: f"rank {r} llama zero{s}: {n}: {m}")
            refused = out[f"toy zero{stage}"]
            assert isinstance(refused, ConfigError), f"rank {rank} toy zero{stage}: {refused!r}"
            assert f"ZeRO-{stage}" in str(refused) and "shared.weight" in str(refused), str(refused)
            assert "layers.0 uses it and so does a module outside every checkpointed layer" in str(refused), str(refused)
            messages.add(str(refused).replace(f"ZeRO-{stage}", "ZeRO-n"))
    assert len(messages) == 1, messages


def test_the_outside_rule_in_one_process() -> None:
    """The adapter's hooks alone (no DeepSpeed): the toy's Linear, used in checkpointed layer 0 and outside the
    layers, is refused by name in the forward whichever use comes first, only with reentrant checkpointing in
    training with grad; the tied Llama (both uses outside the layers), the toy without the outside use (its layers'
    own ``scale`` parameters included) and the toy without checkpointing are not.

    Seen failing: with ``count_outside``'s refusal dropped (its ``refuse(first, outside)`` a ``pass``) the toy
    ran ("DID NOT RAISE"); with the walk entering the layers (``id(module) in layer_ids`` dropped from its skip) the
    toy without the outside use was refused for ``layers.0.scale``."""
    from seqpar.integrations.deepspeed_reuse import refuse_reentrant_reuse

    ids = _batch()["input_ids"]
    plain = Toy("none")
    refuse_reentrant_reuse(plain, 2)
    _reentrant(plain)(ids).sum().backward()
    for where in ("after", "before"):
        toy = Toy(where)
        refuse_reentrant_reuse(toy, 3)
        toy(ids)  # checkpointing off: one backward graph
        _reentrant(toy)
        with pytest.raises(ConfigError, match="layers.0 uses it and so does a module outside every checkpointed"):
            toy(ids)
        with torch.no_grad():
            toy(ids)  # no backward, nothing reduced
        toy.eval()
        toy(ids)  # transformers does not checkpoint in eval
    llama = _llama()
    refuse_reentrant_reuse(llama, 2)
    _reentrant(llama).train()
    llama(input_ids=ids).logits.sum().backward()
    assert llama.model.embed_tokens.weight.grad is not None
