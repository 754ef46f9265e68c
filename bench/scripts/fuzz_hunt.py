"""A targeted fuzzer hunt: the first N cases of a kind, among the case seeds of SEED, whose draw sets KEY.

    python bench/scripts/fuzz_hunt.py KIND KEY SEED N OUT.json
    python bench/scripts/fuzz_hunt.py dynamic dkv_wire 3323 12 /tmp/hunt.json

KIND is one of `python -m seqpar.testing.fuzz --kinds`; KEY a draw's key (``dkv_wire``, ``disagree_shape``,
``big_scale``, ...; ``disagree_shape`` counts only where the ranks' inputs really disagree). Prints one line per case
(its case seed, verdict, seconds, summary, detail) and rewrites OUT after each with the counts and records. Each case
reruns alone with ``python -m seqpar.testing.fuzz --kinds KIND --case-seed X``. The BENCHMARKS.md fuzzer tables'
"N KEY seeds of SEED" rows (sessions 32-33) were drawn this way.
"""

from __future__ import annotations

import collections
import json
import sys
import time


def main() -> None:
    from seqpar.testing import fuzz

    kind, key, seed, n, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    picked = []
    for s in fuzz.case_seeds(seed, 50000):
        d = fuzz.draw_case(s, (kind,))
        if d.get(key) and (key != "disagree_shape" or fuzz.input_disagreement(d)):
            picked.append(d)
            if len(picked) >= n:
                break
    counts: collections.Counter[str] = collections.Counter()
    recs = []
    t0 = time.time()
    with fuzz.Fuzzer(timeout=90, model_timeout=300) as f:
        for i, d in enumerate(picked):
            rec = f.run(d)
            counts[rec["verdict"]] += 1
            recs.append({k: v for k, v in rec.items() if k != "trace"})
            print(f"[{i}] {d['case_seed']} {rec['verdict']} {rec['seconds']}s {fuzz.summary(d)} | {rec['detail'][:400]}",
                  flush=True)
            with open(out, "w") as fh:
                json.dump({"kind": kind, "key": key, "seed": seed, "counts": counts, "records": recs}, fh, default=str)
    print(dict(counts), f"{time.time() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
