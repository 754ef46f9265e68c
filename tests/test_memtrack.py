"""seqpar.memory.tracker.TensorMemoryTracker against hand-counted bytes, in the settings MemTracker refuses:
activation checkpointing (a module recomputed in backward), gradient accumulation (a module run twice
in one window), storages resized in place (FSDP2's way of freeing unsharded parameters)."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from seqpar.memory.tracker import TensorMemoryTracker

KIB = 1024
SCALARS = 64  # loss scalars and their gradients: a few 4-byte storages, below this slack


class Block(torch.nn.Module):
    """relu(x @ w): w is 256x256 fp32 (256 KiB); a (64, 256) activation is 64 KiB."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(256, 256))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.w).relu()


def _near(got: int, expected_kib: int) -> None:
    assert expected_kib * KIB <= got <= expected_kib * KIB + SCALARS, (got, expected_kib * KIB)


def test_forward_backward_hand_counted() -> None:
    block = Block()
    with TensorMemoryTracker(count_existing=False) as tr:
        x = torch.randn(64, 256)
        block(x).sum().backward()
        del x
    # backward's worst moment is mm's backward: x (saved by mm, 64 KiB), the gradient g of the mm
    # output (64 KiB; relu's saved output was freed once its node ran) and dW = x^T g (256 KiB).
    # w itself was alive before the block: not counted.
    _near(tr.peak, 64 + 64 + 256)
    assert tr.current == 256 * KIB  # w.grad stays
    assert tr.baseline == 0


def test_counts_existing_tensors_once_per_storage() -> None:
    block = Block()
    view = block.w.detach()[:10]  # a view: the same storage, not counted twice
    with TensorMemoryTracker() as tr:
        pass
    assert tr.baseline >= 256 * KIB
    mine = TensorMemoryTracker(count_existing=False)
    mine.track(block, view)
    assert mine.current == 256 * KIB


def test_checkpointed_module_runs_twice() -> None:
    block = Block()
    with TensorMemoryTracker(count_existing=False) as tr:
        x = torch.randn(64, 256)
        checkpoint(block, x, use_reentrant=False).sum().backward()
        del x
    # forward keeps nothing but x; backward recomputes relu(x @ w), then as without checkpointing
    # the worst moment is mm's backward: x, g, dW.
    _near(tr.peak, 64 + 64 + 256)


def test_gradient_accumulation_over_micro_steps() -> None:
    block = Block()
    with TensorMemoryTracker(count_existing=False) as tr:
        for _ in range(2):
            x = torch.randn(64, 256)
            block(x).sum().backward()
            del x
    # second micro-step: w.grad (256 KiB) from the first is alive while the new dW is computed
    _near(tr.peak, 256 + 64 + 64 + 256)


def test_in_place_resize_is_followed() -> None:
    with TensorMemoryTracker(count_existing=False) as tr:
        t = torch.empty(1024, dtype=torch.float32)  # 4 KiB
        t.untyped_storage().resize_(0)
        assert tr.current == 0
        t.untyped_storage().resize_(8 * KIB)
        assert tr.current == 8 * KIB
        del t
    assert tr.current == 0
    assert tr.peak == 8 * KIB


def test_track_reachable_counts_a_jobs_state_not_other_tensors() -> None:
    class Job:
        def __init__(self) -> None:
            self.model = Block()  # 256 KiB
            self.state = {"buffers": [torch.empty(16 * 1024)]}  # 64 KiB, reachable through a dict
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)

    unrelated = torch.empty(1024 * 1024)  # 4 MiB another job holds  # noqa: F841
    job = Job()
    tr = TensorMemoryTracker(count_existing=False)
    tr.track_reachable(job)
    assert tr.current == (256 + 64) * KIB
    del job  # freed storages leave the count
    assert tr.current == 0


def test_non_leaf_tensors_are_tracked_without_warnings() -> None:
    """A job's state holds activations (non-leaf tensors): reading their ``.grad`` makes torch print a
    UserWarning into every user's training log. The tracker reads it only where torch keeps one."""
    import warnings

    w = torch.randn(256, 256, requires_grad=True)
    hidden = torch.randn(64, 256) @ w  # non-leaf, no .grad kept: 64 KiB
    kept = torch.randn(64, 256) @ w
    kept.retain_grad()
    (hidden.sum() + kept.sum()).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for how in ("track", "track_reachable"):
            tr = TensorMemoryTracker(count_existing=False)
            getattr(tr, how)({"state": [hidden, kept]})
            assert tr.current == 3 * 64 * KIB, (how, tr.current)  # hidden, kept and kept.grad


def test_record_peak_lists_what_is_alive_at_the_peak() -> None:
    """``record_peak``: the storages alive at the peak with their labels (a ``tag``, a ``label``, else the
    seqpar function that made them), and none that was freed before it or made after it."""
    from seqpar.kernels.merge import output_like

    t = TensorMemoryTracker("cpu", count_existing=False, record_peak=True)
    with t:
        with t.tag("a"):
            a = torch.empty(1000)
        b = torch.empty(10)
        t.label(b, "b")
        freed = torch.empty(100)  # freed before the peak
        del freed
        made = output_like(torch.empty(1, 1, 2, 100))  # 800 bytes, made by seqpar.kernels.merge
        peak = t.peak
        del made
        late = torch.empty(20)
    live = sorted((label, n) for label, n, _ptr in t.peak_live)
    assert live == sorted([("a", 4000), ("b", 40), ("merge.py:output_like", 800), ("?", 800)]), live
    assert peak == t.peak == sum(n for _l, n, _p in t.peak_live)
    del a, b, late


def _reduce_scatter_copy(rank: int, world: int, n: int) -> dict:
    """One async gloo reduce-scatter of ``x`` (``world * n`` fp32) into ``y`` (``n``), tracked, its Work
    still referenced after ``wait()`` returns (as gloo's worker thread can still hold it)."""
    import torch.distributed as dist

    x, y = torch.randn(world * n), torch.empty(n)
    with TensorMemoryTracker() as tr:
        work = dist.reduce_scatter_single(y, x, async_op=True)
        work.wait()
        after_wait = tr.current - tr.baseline
        peak_in_wait = tr.peak - tr.baseline
        later = torch.empty(3 * n)  # a later op's storage: not stacked on the copy
        peak_later = tr.peak - tr.baseline
        del work, later
        after_free = tr.current - tr.baseline
    return {"after_wait": after_wait, "peak_in_wait": peak_in_wait, "peak_later": peak_later, "after_free": after_free}


def test_a_backend_copy_is_counted_until_its_wait_returns(dist_pool) -> None:  # noqa: ANN001
    """gloo's reduce-scatter copies its whole input (``world * n`` fp32) into a buffer of its own, which the
    waiting thread splits through the dispatcher; gloo drops the buffer when its Work goes, which for a
    synchronous call is gloo's worker thread, some time after the wait has returned. The tracker counts the
    copy while the wait runs and not after it, however long the Work lives, and subtracts it once.

    Seen failing: without the ``Work.wait`` rule (the tracker before session 30, flk30b) ``after_wait`` was
    the copy's 32,768 B and ``peak_later`` 81,920 B (the copy plus the later tensor's 49,152 B).
    """
    n = 4096
    for got in dist_pool.run(2, _reduce_scatter_copy, n, timeout=120):
        copy = 2 * n * 4
        assert got["peak_in_wait"] == copy, got  # real memory while the collective runs: counted
        assert got["after_wait"] == 0, got  # the Work still holds it; the wait has returned: not counted
        assert got["peak_later"] == 3 * n * 4, got  # the later tensor alone, not the copy under it
        assert got["after_free"] == 0, got  # subtracted once: the copy's own free takes nothing more
