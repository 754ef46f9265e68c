"""ZeRO-3 leaf modules (the mixture-of-experts blocks seqpar's DeepSpeed adapter marks) called with their input by
keyword: exact, or refused by name where the input can only be a keyword.

Fuzzer case 1687718336 (ZeRO-3, tiny JetMoE, P = 2) crashed with "The size of tensor a (0) must match the size
of tensor b (32)": ``JetMoeAttention`` owns the mixture-of-attention-heads ``experts`` and so is a leaf, and
JetMoE's decoder layer calls it as ``self_attention(hidden_states=...)``. DeepSpeed reduces a leaf's gradients
in a full backward hook, which sees positional inputs only; with none it fires before the module's backward,
partitions the parameters, and the backward then accumulates into an empty one (plain ``deepspeed.initialize``,
one rank, no seqpar: the same). See ``integrations/deepspeed.py::_mark_moe_blocks_z3_leaf``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from seqpar.testing.deepspeed_teardown import releases_deepspeed_engines

pytest.importorskip("deepspeed")

VOCAB, DIM, EXPERTS, SEQ = 29, 16, 3, 12


class _Experts(nn.Module):
    """The experts' weights; read by the owning block outside this module's forward (as DBRX's block does)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(EXPERTS, DIM, DIM) / DIM ** 0.5)


class _KeywordMoE(nn.Module):
    """A dense soft mixture of experts: ``(B, S, D) -> (B, S, D)``; owns ``experts``, so seqpar marks it a leaf."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, EXPERTS)
        self.experts = _Experts()
        self.bias = nn.Parameter(torch.randn(DIM) / 4)

    def forward(self, hidden_states: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        probs = self.router(hidden_states).softmax(-1)  # (B, S, E)
        mixed = torch.einsum("bse,bsd,edf->bsf", probs, hidden_states, self.experts.w)
        return scale * mixed + self.bias


class _KeywordOnlyMoE(_KeywordMoE):
    def forward(self, *, hidden_states: torch.Tensor, scale: float = 1.0) -> torch.Tensor:  # type: ignore[override]
        return super().forward(hidden_states, scale)


class _Toy(nn.Module):
    """Embedding + learned positions (global ids) + one MoE block called by keyword + LM head."""

    def __init__(self, block: type[nn.Module]) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(SEQ, DIM)
        self.block = block()
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids) + self.pos(position_ids)
        x = x + self.block(hidden_states=x, scale=0.5)  # by keyword, as JetMoE's decoder layer calls its attention
        return self.head(x)


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    return {"input_ids": ids, "labels": ids.clone()}


def _model(block: type[nn.Module]) -> _Toy:
    torch.manual_seed(0)
    return _Toy(block)


def _loss(model, batch, group=None) -> torch.Tensor:
    from seqpar.sequence.loss import sequence_parallel_loss

    return sequence_parallel_loss(model(batch["input_ids"], batch["position_ids"]), batch["shift_labels"], group=group)


@releases_deepspeed_engines
def _zero3_task(rank: int, world: int) -> dict:
    """Every rank: the keyword-called leaf through ZeRO-3 (SP = world), its reduced gradients; then the
    keyword-only one, whose error is returned."""
    from deepspeed.utils import safe_get_full_grad

    from seqpar.integrations.deepspeed import initialize
    from seqpar.sequence.batch import shard_batch

    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True,
              "gradient_clipping": 0.0, "steps_per_print": 10 ** 9,
              "sequence_parallel": {"size": world, "mode": "ring", "swap": "none"}}
    out = {}
    for block in (_KeywordMoE, _KeywordOnlyMoE):
        engine, *_ = initialize(model=_model(block), config=config, optimizer=lambda p: torch.optim.SGD(p, lr=0.0))
        manager = engine.seqpar_manager
        try:
            engine.backward(_loss(engine, shard_batch(_batch(), group=manager.sp_group), manager.sp_group))
            out[block.__name__] = {n: safe_get_full_grad(p).detach().clone() for n, p in engine.module.named_parameters()}
        except Exception as e:  # noqa: BLE001 - returned to the test, which checks it on every rank
            out[block.__name__] = e
        finally:
            manager.destroy()
        dist.barrier()
    return out


@pytest.mark.timeout(300)
def test_zero3_leaf_called_by_keyword(dist_pool) -> None:
    """ZeRO-3 on 2 ranks (SP 2): a leaf block called with ``hidden_states=`` gives every reduced gradient of one
    process on the whole sequence (each parameter on its own scale); a leaf whose input can only be a keyword
    is refused by name on every rank.

    Seen failing: without the adapter's positional pre-hook (``m.register_forward_pre_hook(...)`` removed in
    ``_mark_moe_blocks_z3_leaf``), every rank raised torch's "The size of tensor a (0) must match the size of
    tensor b (16)" in the keyword block's backward; with the hook but its refusal disabled (``if False:``), the
    keyword-only block raised that RuntimeError instead of the ConfigError.
    """
    from seqpar.config import ConfigError
    from seqpar.sequence.batch import shard_batch

    ref_model = _model(_KeywordMoE)
    _loss(ref_model, shard_batch(_batch())).backward()
    ref = {n: p.grad for n, p in ref_model.named_parameters()}
    per_rank = dist_pool.run(2, _zero3_task, timeout=240)
    for rank, out in enumerate(per_rank):
        grads = out["_KeywordMoE"]
        assert not isinstance(grads, Exception), f"rank {rank}: {grads!r}"
        assert set(grads) == set(ref)
        for name, g in ref.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6 * float(g.abs().max()),
                                       msg=lambda m, n=name, r=rank: f"rank {r} {n}: {m}")
        refusal = out["_KeywordOnlyMoE"]
        assert isinstance(refusal, ConfigError), f"rank {rank}: {refusal!r}"
        assert "_KeywordOnlyMoE is a ZeRO-3 leaf module" in str(refusal) and "'hidden_states'" in str(refusal)
