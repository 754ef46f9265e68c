"""Phase profile of ring, seqpar Ulysses and the 2 x 2 hybrid at P = 4 (S, 8 heads, head_dim 64, fp32).

    python bench/cpu-ulysses-p4/phase_profile.py S ROUNDS CAUSAL(yes|no|both) METHODS OUT.json [HEAD_CHUNKS]

Per round and method (interleaved, so load changes hit every method alike): one warm-up step, one
timed step, one profiled step (``seqpar.bench.attention._profile_step`` via ``run_case``), every rank.
Reported per phase: exclusive thread-CPU seconds, averaged over the 4 ranks, median over rounds; and
the step's CPU seconds (largest rank, as the suite reports it), median over rounds. CPU time, not wall
time: 4 ranks on 2 shared cores wait for a core, and waiting costs no CPU time.
"""
import json
import statistics
import sys

from seqpar.bench.attention import BenchShape, Settings, run_case
from seqpar.bench.runner import RankPool


def summarize(rounds: list[list[dict]]) -> dict:
    """rounds: per round, the 4 ranks' records -> medians over rounds of rank-mean phase CPU seconds."""
    phases = sorted({p for per in rounds for r in per for p in r["profile"]["phases_cpu_s"]})
    mean = lambda per, p: statistics.mean(r["profile"]["phases_cpu_s"].get(p, 0.0) for r in per)  # noqa: E731
    return {
        "step_cpu_s": statistics.median(max(r["timing"]["cpu_s"][0] for r in per) for per in rounds),
        "step_cpu_s_rounds": [max(r["timing"]["cpu_s"][0] for r in per) for per in rounds],
        "profiled_cpu_s": statistics.median(statistics.mean(r["profile"]["cpu_s"] for r in per) for per in rounds),
        "phases_cpu_s": {p: statistics.median(mean(per, p) for per in rounds) for p in phases},
        "calls_rank0": rounds[0][0]["profile"]["calls"],
    }


def main() -> None:
    seq_len, n_rounds = int(sys.argv[1]), int(sys.argv[2])
    causals = {"yes": [True], "no": [False], "both": [False, True]}[sys.argv[3]]
    methods = sys.argv[4].split(",")
    head_chunks = int(sys.argv[6]) if len(sys.argv) > 6 and sys.argv[6] != "auto" else "auto"
    shape = BenchShape(batch=1, q_heads=8, kv_heads=8, head_dim=64, head_chunks=head_chunks)
    settings = Settings(warmup=1, repeats=1, seed=0, memory=False, profile=True)
    raw: dict[str, list] = {}
    with RankPool(4, device="cpu") as pool:
        for rnd in range(n_rounds):
            for causal in causals:
                for m in methods:
                    per = pool.run(run_case, m, seq_len, causal, shape, settings)
                    key = f"{m} causal={causal}"
                    raw.setdefault(key, []).append(per)
                    print(rnd, key, "step cpu", max(r["timing"]["cpu_s"][0] for r in per),
                          {p: round(statistics.mean(r["profile"]["phases_cpu_s"].get(p, 0) for r in per), 3)
                           for p in per[0]["profile"]["phases_cpu_s"]}, flush=True)
            out = {"S": seq_len, "P": 4, "head_chunks": head_chunks, "rounds_done": rnd + 1, "summary": {k: summarize(v) for k, v in raw.items()},
                   "raw": {k: [[{"timing": r["timing"], "profile": r["profile"]} for r in per] for per in v]
                           for k, v in raw.items()}}
            with open(sys.argv[5], "w") as f:
                json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
