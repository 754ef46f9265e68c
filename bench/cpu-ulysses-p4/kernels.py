"""Kernel work of one rank at causal P = 4 (S = 8192, 8 heads, head_dim 64, fp32), one process, one thread:

    python bench/cpu-ulysses-p4/kernels.py REPEATS

Thread-CPU seconds of the forward+backward kernel calls each mode makes on one rank, without any
communication or bookkeeping (inputs made once, the modes interleaved, median of REPEATS):
Ulysses (u = 4): 2 heads x causal 8192; hybrid 2 x 2, super-rank 0 (chunks 0, 3) and 1 (chunks 1, 2):
4 heads x (own block causal 4096 + remote block 2048 x 4096 / 4096 x 2048); ring zigzag rank 0: 4 head
chunks of 2 heads x (own causal 2048 + three half blocks).
"""
import statistics
import sys
import time

import torch

from seqpar.kernels import block_backward, block_forward

HEAD_DIM = 64
SCALE = HEAD_DIM ** -0.5
CALLS = {  # (query rows, key rows, causal, heads) per kernel call
    "ulysses": [(8192, 8192, True, 1)] * 2,
    "hybrid super-rank 0": [(4096, 4096, True, 1), (2048, 4096, False, 1)] * 4,
    "hybrid super-rank 1": [(4096, 4096, True, 1), (4096, 2048, False, 1)] * 4,
    "ring rank 0": [(2048, 2048, True, 2), (1024, 2048, False, 2), (2048, 1024, False, 2), (1024, 2048, False, 2)] * 4,
}


def prepare(calls: list[tuple[int, int, bool, int]]) -> list[tuple]:
    g = torch.Generator().manual_seed(0)
    items = []
    for nq, nk, causal, heads in calls:
        q, k, v = (torch.randn(1, heads, n, HEAD_DIM, generator=g) for n in (nq, nk, nk))
        out, _ = block_forward(q, k, v, scale=SCALE, causal=causal)
        items.append((q, k, v, causal, torch.randn_like(out)))
    return items


def run(items: list[tuple]) -> float:
    c0 = time.thread_time()
    for q, k, v, causal, dout in items:
        out, lse = block_forward(q, k, v, scale=SCALE, causal=causal)
        block_backward(dout, q, k, v, out, lse, scale=SCALE, causal=causal)
    return time.thread_time() - c0


def main() -> None:
    torch.set_num_threads(1)
    items = {name: prepare(calls) for name, calls in CALLS.items()}
    seconds: dict[str, list[float]] = {name: [] for name in CALLS}
    for _ in range(int(sys.argv[1])):
        for name in CALLS:
            seconds[name].append(run(items[name]))
    for name, s in seconds.items():
        print(f"{name}: median {statistics.median(s):.3f} s", [round(x, 3) for x in s])


if __name__ == "__main__":
    main()
