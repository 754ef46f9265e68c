"""DeepSpeed ZeRO-3 with a manual backward (``engine.scale(loss).backward()``, DeepSpeed's documented alternative to
``engine.backward(loss)``) under sequence parallelism: the reduced gradients are one process's on the whole sequence.

ZeRO-3 divides the sum of the SP ranks' gradient shares by ``dp x sp`` where seqpar needs ``dp``; the adapter makes
up the factor ``sp`` in both ``engine.backward`` and ``engine.scale`` (``integrations/deepspeed.py::
_compensate_gradient_average``). tests/test_engines.py covers ``engine.backward``; this covers ``engine.scale``
(mutation audit, session 20: the factor dropped from ``engine.scale`` alone passed every other test).
"""

from __future__ import annotations

import pytest
import torch

from seqpar.testing.deepspeed_teardown import releases_deepspeed_engines

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")


@releases_deepspeed_engines
def _manual_backward_task(rank: int, world: int) -> dict[str, torch.Tensor]:
    """Every rank (SP = world, ZeRO-3): one manual backward; the full reduced gradients."""
    from deepspeed.utils import safe_get_full_grad
    from test_deepspeed_reentrant import Toy, _batch, _config, _loss

    from seqpar.integrations.deepspeed import initialize
    from seqpar.sequence.batch import shard_batch

    engine, *_ = initialize(model=Toy(), config=_config(3, world), optimizer=lambda p: torch.optim.SGD(p, lr=0.0))
    manager = engine.seqpar_manager
    try:
        loss = _loss(engine, shard_batch(_batch(), group=manager.sp_group), manager.sp_group)
        engine.scale(loss).backward()
        return {n: safe_get_full_grad(p).detach().clone() for n, p in engine.module.named_parameters()}
    finally:
        manager.destroy()


@pytest.mark.timeout(300)
def test_zero3_manual_backward_sp2_gradients_equal_one_process(dist_pool) -> None:
    """ZeRO-3 on 2 ranks (SP 2), ``engine.scale(loss).backward()``: every reduced gradient equals one process's on
    the whole sequence, each on its own scale.

    Seen failing: with ``scale_sp_scaled`` returning ``scale(loss)`` (the factor sp dropped from the manual path)
    every gradient was half the reference's."""
    from test_deepspeed_reentrant import Toy, _batch, _loss

    from seqpar.sequence.batch import shard_batch

    ref = Toy()
    _loss(ref, shard_batch(_batch())).backward()
    for rank, grads in enumerate(dist_pool.run(2, _manual_backward_task, timeout=240)):
        assert set(grads) == {n for n, _ in ref.named_parameters()}
        for n, p in ref.named_parameters():
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-6 * float(p.grad.abs().max()),
                                       msg=lambda m, n=n, r=rank: f"rank {r} {n}: {m}")
