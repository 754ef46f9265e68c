#!/usr/bin/env bash
# Multi-node seqpar training under SLURM: one torchrun agent per node, c10d rendezvous on the first node.
#
#   sbatch --nodes 2 --gpus-per-node 8 launch/slurm_train.sh --config configs/fsdp_ring.json --sp-size 8
#
# Every argument goes to launch/train.py. Ranks are numbered node by node, so SP groups of consecutive
# ranks (seqpar.runtime.groups) stay inside a node when the SP size divides the GPUs per node; torchrun sets
# LOCAL_WORLD_SIZE, from which seqpar warns about a layout that crosses nodes. Put "timeout_s" in the
# sequence_parallel block so that a lost or stalled rank ends the job instead of hanging it.
#SBATCH --job-name=seqpar
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
set -euo pipefail

NPROC_PER_NODE=${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-$(nvidia-smi -L 2>/dev/null | wc -l)}}
[ "${NPROC_PER_NODE}" -gt 0 ] 2>/dev/null || NPROC_PER_NODE=1
HEAD_NODE=$(scontrol show hostnames "${SLURM_JOB_NODELIST}" | head -n 1)
RDZV_PORT=${RDZV_PORT:-29500}
cd "$(dirname "$0")/.."

# --validate-only first, on one task: a config error ends the job before any node waits for a rendezvous.
python launch/train.py --validate-only "$@"

# srun starts one torchrun per node; each starts NPROC_PER_NODE ranks. --kill-on-bad-exit ends every
# node's agent when one exits non-zero (a rank that failed alone must not leave the others waiting).
srun --kill-on-bad-exit=1 --ntasks-per-node=1 \
    torchrun --nnodes "${SLURM_JOB_NUM_NODES}" --nproc-per-node "${NPROC_PER_NODE}" \
        --rdzv-backend c10d --rdzv-endpoint "${HEAD_NODE}:${RDZV_PORT}" --rdzv-id "${SLURM_JOB_ID}" \
        --max-restarts 0 \
        launch/train.py "$@"
