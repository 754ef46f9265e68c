"""One rank of the two-"node" failure tests (tests/test_failures.py), started by torchrun.

SP=2 x DP=2 ring attention steps with ``timeout_s`` from argv; at step 3 the global rank named by
``--victim`` is SIGKILLed, SIGSTOPped or raises, right before entering the ring exchange its SP peer
is already waiting in. Every rank prints ``step N`` as it finishes a step.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import torch
import torch.distributed as dist

from seqpar.attn import attention
from seqpar.config import SeqParConfig
from seqpar.runtime.groups import init_process_groups


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--victim", type=int, required=True)
    p.add_argument("--how", choices=["kill", "stop", "raise"], required=True)
    p.add_argument("--timeout-s", type=int, required=True)
    args = p.parse_args()
    manager = init_process_groups(config=SeqParConfig(size=2, mode="ring", timeout_s=args.timeout_s))
    rank = manager.rank
    g = torch.Generator().manual_seed(rank)
    for step in range(1000):
        q, k, v = (torch.randn(1, 2, 64, 16, generator=g, requires_grad=True) for _ in range(3))
        if step == 3 and rank == args.victim:
            print(f"rank {rank}: {args.how} at step {step}", flush=True)
            if args.how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif args.how == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            else:
                raise RuntimeError(f"rank {rank}: injected failure in forward at step {step}")
        out = attention(q, k, v, causal=True, mode="ring", group=manager.sp_group)
        out.sum().backward()
        dist.all_reduce(q.grad, group=manager.dp_group)  # the DP exchange crosses the two "nodes"
        print(f"rank {rank}: step {step}", flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
