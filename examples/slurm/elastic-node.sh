#!/bin/bash
# One node of an elastic HPP run (started once per node by hpp-elastic.sbatch, or by hand):
# torchrun's elastic agent with a c10d rendezvous; the plan is made at start-up for the
# nodes present (pretrain_gpt.py --hpp-cluster) and every (re)start resumes from the
# newest intact checkpoint in SAVE.  When a node dies the survivors restart, re-plan and
# resume; when a node (re)joins, the running nodes stop their workers (SIGTERM: they save
# first, --exit-signal-handler) and all go on under the plan for the larger membership.
#   FLEET           cluster YAML of the fleet's device types and links
#   SAVE            checkpoint folder every node reads and writes (the plans are kept there)
#   RDZV_ENDPOINT   host:port of the rendezvous; the agent on that host serves it, so pick
#                   a node expected to stay
#   NNODES          MIN:MAX nodes of a membership (torchrun --nnodes)
#   NPROC_PER_NODE  processes on this node (default 1); MAX_RESTARTS (default 3);
#   RUN_ID          rendezvous id (default hpp); RDZV_CONF (default last_call_timeout=5,join_timeout=600)
#   HPP_DEVICE_TYPE this node's device type when the CUDA device name does not tell it
#   HPP_HOST        this node's name (default: hostname); PYTHON (default: python)
# Arguments go to pretrain_gpt.py (--model, --global-batch-size, --train-iters, --save-interval, ...).
set -euo pipefail
cd "$(dirname "$0")/../.."
: "${FLEET:?set FLEET=fleet.yaml}" "${SAVE:?set SAVE=shared/checkpoint/folder}"
: "${RDZV_ENDPOINT:?set RDZV_ENDPOINT=host:port}" "${NNODES:?set NNODES=MIN:MAX}"
PYTHON=${PYTHON:-python}
export HPP_HOST=${HPP_HOST:-$(hostname)}
# A fresh store for every rendezvous round: with the store shared across rounds (torch's
# default) a restarted group reads the previous round's addresses and cannot connect.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
exec "$PYTHON" -m torch.distributed.run --nnodes "$NNODES" --nproc-per-node "${NPROC_PER_NODE:-1}" \
    --max-restarts "${MAX_RESTARTS:-3}" --rdzv-backend c10d --rdzv-endpoint "$RDZV_ENDPOINT" \
    --rdzv-id "${RUN_ID:-hpp}" --rdzv-conf "${RDZV_CONF:-last_call_timeout=5,join_timeout=600}" \
    --monitor-interval "${MONITOR_INTERVAL:-1}" \
    pretrain_gpt.py --hpp-cluster "$FLEET" --save "$SAVE" --load "$SAVE" --exit-signal-handler "$@"
