#!/usr/bin/env bash
# Start the shipped configs on CPU ranks (gloo). Usage:
#   bash launch/run_cpu.sh [CONFIG|all] [extra train.py flags]     # CONFIG: a name in configs/ without .json
# Examples:
#   bash launch/run_cpu.sh deepspeed_ring                    # 2 CPU ranks, SP=2, ring
#   NPROC=4 bash launch/run_cpu.sh fsdp_ring --sp-size 2     # 4 ranks = DP 2 x SP 2
#   bash launch/run_cpu.sh all --steps 5                     # every config, briefly
# Metrics land in runs/<config>.json. MASTER_PORT (default 29500) sets the rendezvous port, for a second job on one machine.
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC="${NPROC:-2}"
MASTER_PORT="${MASTER_PORT:-29500}"  # torchrun and deepspeed read their own flag, not this variable
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
which="${1:-deepspeed_ring}"
shift || true

run_one() {
  local name="$1"; shift
  local cfg="configs/${name}.json"
  [[ -f "$cfg" ]] || { echo "no such config: $cfg" >&2; exit 2; }
  mkdir -p runs
  echo ">>> ${name} on ${NPROC} CPU ranks"
  if [[ "$name" == deepspeed_* ]]; then
    deepspeed --num_gpus "$NPROC" --master_port "$MASTER_PORT" launch/train.py --config "$cfg" --metrics-out "runs/${name}.json" "$@"
  else
    torchrun --nproc_per_node "$NPROC" --master_port "$MASTER_PORT" launch/train.py --config "$cfg" --metrics-out "runs/${name}.json" "$@"
  fi
}

if [[ "$which" == all ]]; then
  for cfg in configs/deepspeed_*.json configs/fsdp_*.json; do
    run_one "$(basename "$cfg" .json)" "$@"
  done
else
  run_one "$which" "$@"
fi
