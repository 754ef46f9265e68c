"""Single-process benchmark of dilated attention: forward+backward time and peak tensor memory vs S.

At fixed patterns the work per token is fixed, so time(2S) / time(S) should stay near 2 and peak
memory should grow linearly. Peak memory is exact tensor accounting (torch's ``MemTracker``: live
tensors of the device, inputs and gradients included), not RSS. On CUDA it is
``torch.cuda.max_memory_allocated``.

Usage (the lead wires it into ``python -m seqpar.bench``)::

    from seqpar.bench.dilated import bench_dilated
    for row in bench_dilated([4096, 8192, 16384]):
        print(row)
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from seqpar.attn.dilated import dilated_attention

__all__ = ["bench_dilated"]


def _peak_bytes(step, device: torch.device) -> int:  # noqa: ANN001
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    with tracker:
        step()
    return tracker.get_tracker_snapshot("peak")[device]["Total"]


def bench_dilated(
    seq_lens: Sequence[int],
    *,
    segment_lengths: Sequence[int] = (512, 1024, 2048),
    dilation_rates: Sequence[int] = (1, 2, 4),
    heads: int = 8,
    head_dim: int = 64,
    batch: int = 1,
    causal: bool = True,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    repeats: int = 3,
) -> list[dict]:
    """Time forward+backward of :func:`~seqpar.attn.dilated.dilated_attention` on one process.

    Returns one dict per length: ``seq``, ``ms`` (median of ``repeats`` timed steps after one warm-up),
    ``peak_mib`` (peak tensor memory of one step, inputs and gradients included) and ``ratio``
    (time relative to the previous length; ~2 when lengths double means linear cost).
    """
    device = torch.device(device)
    rows: list[dict] = []
    for seq in seq_lens:
        def step(seq: int = seq) -> None:
            q, k, v = (torch.randn(batch, heads, seq, head_dim, dtype=dtype, device=device, requires_grad=True)
                       for _ in range(3))
            out = dilated_attention(q, k, v, segment_lengths=segment_lengths, dilation_rates=dilation_rates,
                                    causal=causal)
            out.backward(torch.ones_like(out))

        step()  # warm-up
        times = []
        for _ in range(repeats):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
        ms = sorted(times)[len(times) // 2] * 1e3
        row = {"seq": seq, "ms": round(ms, 1), "peak_mib": round(_peak_bytes(step, device) / 2**20, 1)}
        row["ratio"] = round(ms / rows[-1]["ms"], 2) if rows else None
        rows.append(row)
    return rows


if __name__ == "__main__":
    torch.set_num_threads(1)
    for r in bench_dilated([4096, 8192, 16384, 32768, 65536], repeats=1):
        print(r)
