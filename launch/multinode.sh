#!/usr/bin/env bash
# One node of a multi-node run: start it on every node with the same MASTER (host:port).
# Usage: NNODES=2 NODE_RANK=0 MASTER=node1:29500 NPROC=8 launch/multinode.sh CONFIG [key=value ...]
# A fault on any node restarts every node's group from the latest checkpoint, up to
# MAX_RESTARTS (default 3) times (aiayn.distributed.run; docs/distributed.md). The first start
# waits JOIN_TIMEOUT s (default 600) for every node; a restart RESTART_JOIN_TIMEOUT s (default
# 45), after which a node that has not come back is taken for lost and the launcher exits 1.
# NNODES=MIN:MAX (e.g. 3:4) makes the job elastic: a lost node's peers restart without it once
# MIN nodes meet, with the same global batch (train.tokens_per_step; docs/distributed.md); keep
# MASTER on a machine that outlives the nodes, since the rendezvous store lives there.
# The rendezvous id (RDZV_ID to set it) is this run's, the same on every node without their
# talking: inside a Slurm job its id, and a checksum of what every node is given (MASTER, NNODES,
# CONFIG and the overrides), so a launch never joins another run's rendezvous at the same
# endpoint. Give every node the same arguments, or the same RDZV_ID. PYTHON: the interpreter,
# or a command that runs one (e.g. "apptainer exec img.sif python"; default python).
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: NNODES=N NODE_RANK=R MASTER=host:port [NPROC=P] $0 CONFIG ..." >&2; exit 2; }
: "${NNODES:?set NNODES}" "${NODE_RANK:?set NODE_RANK}" "${MASTER:?set MASTER=host:port}"
config=$1; shift
read -ra python <<<"${PYTHON:-python}"
[ "${#python[@]}" -gt 0 ] || python=(python)
# Not random: a random id would differ between the nodes, which are started apart.
run_sum=$(printf '%s\0' "$MASTER" "$NNODES" "$config" "$@" | cksum | cut -d' ' -f1)
rdzv_id=${RDZV_ID:-aiayn-${SLURM_JOB_ID:+$SLURM_JOB_ID-}$run_sum}
cmd=("${python[@]}" -m aiayn.distributed.run --nnodes="$NNODES" --node_rank="$NODE_RANK"
     --nproc_per_node="${NPROC:-1}" --max-restarts="${MAX_RESTARTS:-3}"
     --rdzv-backend=c10d --rdzv-endpoint="$MASTER" --rdzv-id="$rdzv_id"
     --rdzv-conf="join_timeout=${JOIN_TIMEOUT:-600},restart_join_timeout=${RESTART_JOIN_TIMEOUT:-45}"
     -m aiayn train --config "$config" "$@")
echo "+ ${cmd[*]}" >&2
exec "${cmd[@]}"
