#!/usr/bin/env bash
# Issue 29's GPU verification, prepared for a session that is lent one GPU (the device tool runs this in the
# repository root and brings back what is under $OUT). Two calls, each under the tool's 10-minute limit:
#
#   bash bench/scripts/gpu_issue29.sh check   # the run-book's short stages (limits: 8.5 min)
#   bash bench/scripts/gpu_issue29.sh perf    # the tests that failed at 0dbebd6, the link-priority pair, gpu-perf
#
# With less than ~15 minutes of device time left, run `perf` alone: it is the issue's measurement. What the
# figures confirm or refute: BENCHMARKS.md, "The ring on one GPU" ("What a GPU session should run").
set -uo pipefail
OUT=${OUT:-/tmp/gpu29}
case "${1:-}" in check|perf) ;; *) echo "usage: bash bench/scripts/gpu_issue29.sh check|perf" >&2; exit 2 ;; esac
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { tail "$OUT/install.log"; exit 1; }
git rev-parse HEAD > "$OUT/commit" 2>/dev/null || true
case "${1:-}" in
  check)
    python3 -m seqpar.bench gpu-check --stages choice,cuda-tests,simulate,host-sync,fairscale --out /tmp/gc
    rc=$?
    cp /tmp/gc/gpu_check.* "$OUT"/ 2>/dev/null
    exit $rc
    ;;
  perf)
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py \
      -k "strided_gqa or thread_ring or overlap_on_the_device" 2>&1 | tail -15
    for prio in normal high; do  # the stream-priority explanation of hidden50 (about 60 s in all)
      timeout 150 python3 -m seqpar.bench gpu-perf --seq-locals 16384 --head-chunks 1 --hidden-at 16384 \
        --link-priority "$prio" --device cuda --trace "$OUT/$prio" --out "$OUT/$prio" 2>&1 | tail -12
    done
    timeout 320 python3 -m seqpar.bench gpu-perf --device cuda --out "$OUT/full" --budget-s 240 2>&1 | tail -30
    ;;
esac
