#!/usr/bin/env bash
# Issue 29's GPU verification, prepared for a session that is lent one GPU (the device tool runs this in the
# repository root and brings back what is under $OUT). A lent GPU has 15 minutes of device time in all,
# machine start (minutes) included, and each call at most 10 minutes; so the measurement is one call
# whose time limits add up to 270 s, leaving time for a second try:
#
#   bash bench/scripts/gpu_issue29.sh perf    # <= 270 s: hidden50 at both link priorities and on copy-engine
#                                             # links, 8K eta, failed tests
#   bash bench/scripts/gpu_issue29.sh perf-dry  # the same steps on the CPU at toy sizes (no GPU: a plumbing check)
#   bash bench/scripts/gpu_issue29.sh check   # <= 8.5 min: the run-book's short stages; only with >= 13 min left
#                                             # after `perf` (it does not fit beside perf and a rerun in 15 min)
#
# `perf`, most important first (each step's limit; every step's results land under $OUT as it ends, and
# gpu-perf rewrites its JSON after every case, whole, so a step stopped by its limit keeps what it finished):
#   1. install (20 s)
#   2. $OUT/normal, $OUT/high (70 s each): L = 16K, hc 1, both masks and layouts at 50 GB/s with the links'
#      streams at torch's default and at high priority: hidden50, max50, lag50 and a Chrome trace. Decides
#      whether the high-priority link streams bring hidden50 (0.76 / 0.79 at 0dbebd6) to the 0.85 goal.
#   2b. $OUT/copy (30 s): L = 16K, hc 1, hf, both masks at 50 GB/s and high priority (as $OUT/high but for
#      one thing) with the links held by pinned host <-> device copies (`--link-emulation copy`: the copy
#      engine, no SM) instead of sleep kernels. The sleep can wait for an SM behind an attention kernel
#      (a persistent one at any priority); a copy cannot. hidden50 on copies near max50 while the sleeps'
#      stays low: the emulation's fault; low on both: the ring's (docs/gpu-runbook.md, "Reading issue 29").
#   3. $OUT/eta8k (50 s): L = 8K, hc 1, both masks, both layouts: eta (8K full was 0.87 vs 0.92), glue with
#      the interleaved T_floor, the kernel-time split with the fused merge counted.
#   4. $OUT/tests.txt (30 s): the cuDNN bf16 strided-GQA cases that failed at 0dbebd6 (fix 56eb2f9, never run).
#   5. $OUT/table.md: every JSON as BENCHMARKS rows (`python -m seqpar.bench gpu-perf-table`; CPU, seconds).
# What the figures confirm or refute: BENCHMARKS.md, "The ring on one GPU" ("What a GPU session should run").
set -uo pipefail
OUT=${OUT:-/tmp/gpu29}
case "${1:-}" in
  check|perf) DEV=cuda L16=16384 L8=8192 TINY=() ;;
  perf-dry) DEV=cpu L16=128 L8=64 TINY=(--tiny --repeats 1) ;;
  *) echo "usage: bash bench/scripts/gpu_issue29.sh check|perf|perf-dry" >&2; exit 2 ;;
esac
mkdir -p "$OUT"
timeout 20 python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 \
  || { tail "$OUT/install.log"; exit 1; }
git rev-parse HEAD > "$OUT/commit" 2>/dev/null || true
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv > "$OUT/smi.txt" 2>&1 || true
case "${1:-}" in
  check)
    # straight into $OUT: gpu-check rewrites gpu_check.json after every stage
    python3 -m seqpar.bench gpu-check --stages choice,cuda-tests,simulate,host-sync,fairscale --out "$OUT/gc"
    ;;
  perf|perf-dry)
    for prio in normal high; do  # the stream-priority explanation of hidden50
      timeout 70 python3 -m seqpar.bench gpu-perf --device $DEV "${TINY[@]}" --seq-locals $L16 --head-chunks 1 \
        --hidden-at $L16 --link-priority "$prio" --budget-s 45 --trace "$OUT/$prio" --out "$OUT/$prio" 2>&1 | tail -8
    done
    timeout 30 python3 -m seqpar.bench gpu-perf --device $DEV "${TINY[@]}" --seq-locals $L16 --head-chunks 1 \
      --layouts hf --hidden-at $L16 --link-priority high --link-emulation copy --budget-s 20 --trace "$OUT/copy" \
      --out "$OUT/copy" 2>&1 | tail -6
    timeout 50 python3 -m seqpar.bench gpu-perf --device $DEV "${TINY[@]}" --seq-locals $L8 --head-chunks 1 \
      --profile-at $L8 --budget-s 25 --out "$OUT/eta8k" 2>&1 | tail -8
    timeout 30 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py -k "strided_gqa and cudnn and bfloat16" \
      > "$OUT/tests.txt" 2>&1
    tail -4 "$OUT/tests.txt"
    nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv,noheader \
      >> "$OUT/smi.txt" 2>&1 || true
    python3 -m seqpar.bench gpu-perf-table "$OUT/normal" "$OUT/high" "$OUT/copy" "$OUT/eta8k" > "$OUT/table.md" 2>&1
    cat "$OUT/table.md"
    ;;
esac
