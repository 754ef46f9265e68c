"""FairScale FSDP on one GPU: training steps of a seqpar-swapped Llama against the plain model.

The ``fairscale`` stage of ``python -m seqpar.bench gpu-check`` (it lives here, beside the training
entry point, because the core package never imports the engine adapters). One NCCL rank (a GPU cannot
host two), SP = 1: FairScale's CUDA-only paths (streams, flat parameters, its reduce-scatter) run
around seqpar's swapped attention, and the per-step losses must equal an unwrapped model's in fp32.

    python launch/fairscale_check.py --json result.json
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
import traceback
from typing import Any

import torch

from seqpar.bench.gpu_check import lm_step, one_rank_group, tiny_llama


def check(steps: int = 4) -> dict[str, Any]:
    """``passed`` is None (skipped) without FairScale, else whether every loss matches to 1e-4."""
    if importlib.util.find_spec("fairscale") is None:
        return {"passed": None, "skipped": "fairscale is not installed: carry its wheel (docs/gpu-runbook.md)"}
    from seqpar.integrations import fairscale as fs

    manager = one_rank_group()
    ref = tiny_llama(seed=1)
    model = fs.wrap(tiny_llama(seed=1), {"mode": "ring"}, manager=manager)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator(device="cuda").manual_seed(0)
    got, want = [], []
    for _ in range(steps):
        ids = torch.randint(0, 256, (2, 256), device="cuda", generator=g)
        want.append(float(lm_step(ref, ids, ref_opt)))
        got.append(float(lm_step(model, ids, opt)))
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, want))
    return {"passed": worst < 1e-4, "losses": got, "reference_losses": want, "max_rel_diff": worst,
            "fairscale": importlib.import_module("fairscale").__version__}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", required=True, help="write the result here")
    args = p.parse_args(argv)
    try:
        result = check()
    except Exception as e:  # recorded, so that the gpu-check summary says why
        result = {"passed": False, "error": "".join(traceback.format_exception(type(e), e, e.__traceback__))[-4000:]}
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1, default=str)
    return 0 if result.get("passed") is not False else 1


if __name__ == "__main__":
    sys.exit(main())
