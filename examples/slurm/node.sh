#!/bin/bash
# One node of a multi-node HPP run (started once per node by hpp.sbatch, or by hand):
# torchrun with this host's node rank and process count, taken from the plan.
#   PLAN          plan JSON (tools/search_hpp.py -o)
#   HPP_HOSTS     hosts in the cluster YAML's node order, comma-separated (a plan whose
#                 fleet leaves nodes out: every host of the cluster file; a host left out exits 0)
#   MASTER_ADDR   host of node 0 (default: the plan's first host); MASTER_PORT (29500)
#   HPP_HOST      this host's name in HPP_HOSTS (default: hostname)
#   PYTHON        the Python with this package installed (default: python)
# Static rendezvous (--node-rank): a c10d rendezvous numbers nodes in the order they
# join, which need not be the plan's.  Arguments go to pretrain_gpt.py.
set -euo pipefail
cd "$(dirname "$0")/../.."
: "${PLAN:?set PLAN=path/to/plan.json}" "${HPP_HOSTS:?set HPP_HOSTS=host1,host2,...}"
PYTHON=${PYTHON:-python}
eval "$("$PYTHON" -m megatron.hpp.parallel.launch node --plan "$PLAN" --hosts "$HPP_HOSTS" \
        --host "${HPP_HOST:-$(hostname)}")"   # HPP_LEFT_OUT NNODES NODE_RANK NPROC_PER_NODE WORLD_SIZE MASTER_HOST
if [ "$HPP_LEFT_OUT" = 1 ]; then
    echo "${HPP_HOST:-$(hostname)}: not in the plan (its fleet leaves this node out)"
    exit 0
fi
exec "$PYTHON" -m torch.distributed.run --nnodes "$NNODES" --node-rank "$NODE_RANK" \
    --nproc-per-node "$NPROC_PER_NODE" --master-addr "${MASTER_ADDR:-$MASTER_HOST}" \
    --master-port "${MASTER_PORT:-29500}" pretrain_gpt.py --hpp-plan "$PLAN" "$@"
