"""Whole models in bf16 under SP (issue 28 §2): one model per mixer family, and an MoE, an MLA and an ALiBi model,
at SP=2 and SP=4, err against float64 at most twice as much as the same model in bf16 on one process does.

Each model is the tiny config of tests/all_models.py (one layer of each kind, every window below the shard),
fed that file's batch (2 x 48 tokens), ring attention, zigzag. The error of a run is its loss's difference from
the float64 loss of one process (relative), and its largest gradient difference (gradients summed over the ranks
in float64) on the float64 model's gradient scale. The SP run passes when each error is at most
``2 x`` one process's bf16 error ``+`` :data:`FLOOR` (bf16 keeps 8 bits: one rounding is 4e-3 relative). Float64
reference and one-process bf16 run are made once per model, here; the pools run the SP side.

BLOOM (ALiBi) rounds its bias to the model dtype per key and needs seqpar to apply that rounded bias (issue 28
§1); MPT applies its ALiBi bias in the attention's dtype as seqpar does, so it stands for ALiBi here.

What it cannot see (measured on the 2-core machine, 2026-11-27): a break of the attention's own precision.
The one-process bf16 error is the whole model's bf16 arithmetic (gradient error 2.5e-2 of the gradient scale
for Mixtral, 1.8e-2 for MPT), and an lse rounded to bf16 before each merge (``seqpar/kernels/merge.py``'s
``merge_into`` taking ``block_lse.to(block_out.dtype)``) moved the SP errors only within it: Mixtral SP=2 grad
3.3e-2 -> 3.4e-2, SP=4 2.8e-2 -> 3.1e-2, MPT SP=2 1.9e-2 -> 2.2e-2, losses 1e-5..2e-4 both ways; the test
passed. A clean SP run already sits at 1.3x one process's error (Mixtral SP=2), so no tighter factor
separates them: attention-level precision is the business of tests/test_low_precision_ring.py, and this
test guards against model-level mistakes (a rounded bias applied exactly, a bf16 sum of counts).

Each parameter's gradient is also judged on its own scale (:func:`_param_errors`): the model-wide error alone
passed with one small parameter's gradient doubled. Seen failing (2026-11-29): ``A = A + (A - A.detach())`` after
``A = -torch.exp(self.A_log.float())`` in ``seqpar/mixers/mamba2.py`` (Falcon-H1's A_log gradient x2, 1.7e-3 of
the model's gradient scale): the model-wide check passed at SP=2 and 4, the per-parameter one fails. Blind spots
(one process's bf16 error on that parameter is over 0.45, so twice it plus the floor reaches the 1.0 a doubled
gradient shows): Jamba's embedding, input norm and Mamba mixer (D, conv1d, in/x_proj, b/c norms) and
Qwen3-Next's A_log and dt_bias; bf16 cannot resolve those gradients on one process either.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import all_models  # noqa: E402 - tests/ is on sys.path, as for dist_harness

# model type -> what it stands for
MODELS = {
    "qwen3_next": "gated DeltaNet",
    "kimi_linear": "Kimi delta attention (KDA)",
    "falcon_h1": "Mamba2 / SSD",
    "jamba": "Mamba (selective scan); MoE",
    "minimax": "lightning attention",
    "lfm2": "short convolution",
    "recurrent_gemma": "RG-LRU",
    "mixtral": "MoE with router loss",
    "deepseek_v3": "MLA",
    "mpt": "ALiBi",
}
FACTOR = 2.0
FLOOR = 1e-3  # relative: a quarter of one bf16 rounding
# Per parameter (norm-relative, own scale): the worst clean SP run measured sits 0.055 above twice one process's
# error (qwen3_next SP=4, its MoE router's gate: 0.153 vs 2 x 0.049, routing flips in bf16); every other
# parameter of every model below it. A gradient doubled errs by 1.0.
PARAM_FLOOR = 0.1


def _errors(ref: dict[str, Any], loss: float, grads: dict[str, torch.Tensor]) -> tuple[float, float]:
    """(loss error relative to the float64 loss, largest gradient error on the float64 model's gradient scale)."""
    scale = max(float(g.abs().max()) for g in ref["grads"].values())
    grad_err = max(float((grads[n].double() - g).abs().max()) for n, g in ref["grads"].items()) / scale
    return abs(loss - ref["loss"]) / abs(ref["loss"]), grad_err


def _param_errors(ref: dict[str, Any], grads: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per parameter, its gradient's error on its own scale: ``||g - g_ref|| / ||g_ref||`` (Frobenius norms,
    the float64 model's gradient as ``g_ref``). A gradient off by a factor of two errs by 1.0 here however small
    it is beside the model's largest; bf16 rounding errs by ~1e-2 on most parameters (see :data:`PARAM_FLOOR`)."""
    return {n: float((grads[n].double() - g).norm() / g.norm()) for n, g in ref["grads"].items()}


def _one_process(model_type: str, dtype: torch.dtype) -> dict[str, Any]:
    model = all_models.build_model(model_type, dtype)
    out = model(**all_models.make_batch())
    out.loss.backward()
    return {"loss": float(out.loss.detach()),
            "grads": {n: p.grad.detach().double() for n, p in model.named_parameters() if p.grad is not None}}


def _sp_bf16(rank: int, world: int, model_type: str) -> dict[str, Any] | None:
    """The bf16 model at SP=``world`` (ring, zigzag): rank 0 returns its loss and the gradients summed over the
    ranks (in float64, so that the sum adds no rounding)."""
    import torch.distributed as dist

    import seqpar

    config = {"size": world, "mode": "ring", "sharding": "zigzag"}
    manager = seqpar.init_process_groups(config=config)
    try:
        model = all_models.build_model(model_type, torch.bfloat16)
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
        seqpar.swap_attention(model, config)
        out = model(**seqpar.shard_batch(all_models.make_batch()))
        out.loss.backward()
        grads = {}
        for name, p in model.named_parameters():
            if p.grad is not None:
                g = p.grad.detach().double()
                dist.all_reduce(g, group=manager.sp_group)
                grads[name] = g
        return {"loss": float(out.loss.detach()), "grads": grads} if rank == 0 else None
    finally:
        seqpar.destroy_process_groups()


@pytest.fixture(scope="module")
def one_process() -> dict[str, tuple[dict[str, Any], tuple[float, float], dict[str, float]]]:
    """model type -> (float64 loss and gradients, the bf16 model's errors against them, and its per-parameter
    gradient errors), on one process."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models are dispatch-bound; one thread, as on the pool's ranks
    try:
        out = {}
        for model_type in MODELS:
            ref = _one_process(model_type, torch.float64)
            own = _one_process(model_type, torch.bfloat16)
            out[model_type] = (ref, _errors(ref, own["loss"], own["grads"]), _param_errors(ref, own["grads"]))
        return out
    finally:
        torch.set_num_threads(threads)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("model_type", list(MODELS))
def test_bf16_model_errs_no_more_than_one_process_bf16(dist_pool, one_process, model_type, world):
    ref, (own_loss, own_grad), own_params = one_process[model_type]
    got = dist_pool.run(world, _sp_bf16, model_type, timeout=300)[0]
    assert set(got["grads"]) == set(ref["grads"]), sorted(set(got["grads"]) ^ set(ref["grads"]))
    loss_err, grad_err = _errors(ref, got["loss"], got["grads"])
    what = (f"{model_type} ({MODELS[model_type]}) SP={world} bf16: loss err {loss_err:.1e}, grad err {grad_err:.1e}; "
            f"one process bf16: {own_loss:.1e}, {own_grad:.1e}")
    assert loss_err <= FACTOR * own_loss + FLOOR, what
    assert grad_err <= FACTOR * own_grad + FLOOR, what
    # each parameter on its own scale: the model-wide error above cannot see a small parameter's gradient doubled
    params = _param_errors(ref, got["grads"])
    bad = {n: f"{e:.2e} > {FACTOR} x {own_params[n]:.2e} + {PARAM_FLOOR}" for n, e in params.items()
           if not e <= FACTOR * own_params[n] + PARAM_FLOOR}
    assert not bad, f"{what}; gradients off on their own scale (||g - g_ref|| / ||g_ref||): {bad}"
