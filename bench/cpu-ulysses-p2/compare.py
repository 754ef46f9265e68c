"""Interleaved P=2 S=8192 8 heads hd64 fp32: seqpar ulysses vs DeepSpeed ulysses, CPU time per step."""
import json
import sys

from seqpar.bench.attention import BenchShape, Settings, run_case
from seqpar.bench.peers import run_ulysses
from seqpar.bench.runner import RankPool, combine


def main():
    S, world, rounds = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    methods = sys.argv[4].split(",")
    shape = BenchShape(batch=1, q_heads=8, kv_heads=8, head_dim=64)
    settings = Settings(warmup=1, repeats=2, seed=0, memory=False)
    out = {}
    with RankPool(world, device="cpu") as pool:
        for rnd in range(rounds):
            for causal in (False, True):
                for m in methods:
                    if m == "ulysses":
                        per = pool.run(run_ulysses, S, causal, shape, settings)
                    else:
                        per = pool.run(run_case, m, S, causal, shape, settings)
                    out.setdefault(f"{m} causal={causal}", []).append(combine([r["timing"] for r in per]))
                    print(m, causal, rnd, out[f"{m} causal={causal}"][-1]["cpu_s"], out[f"{m} causal={causal}"][-1]["time_s"], flush=True)
    json.dump(out, open(sys.argv[5], "w"), indent=1)

if __name__ == "__main__":
    main()
