#!/usr/bin/env bash
# N processes on this machine with PyTorch DDP (gloo on CPU, NCCL on GPUs), under torchrun with
# aiayn's restart policy: a fault (a rank killed, an exception, out of memory, a stalled rank)
# restarts the group from the latest checkpoint, up to MAX_RESTARTS times; a preemption (exit
# 75) or an error to fix (exit 2) ends the job (docs/distributed.md, "Faults and restarts").
# Usage: NPROC=2 [MAX_RESTARTS=3] launch/torchrun.sh CONFIG [key=value ...]
#        (NPROC: default = GPUs, or 2)
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: NPROC=N $0 CONFIG [key=value ...]" >&2; exit 2; }
config=$1; shift
if [ -n "${NPROC:-}" ]; then
  nproc=$NPROC
else  # asking torch takes a second of CPU: only when NPROC does not say
  gpus=$(python -c 'import torch; print(torch.cuda.device_count())')
  nproc=$([ "$gpus" -gt 0 ] && echo "$gpus" || echo 2)
fi
cmd=(python -m aiayn.distributed.run --standalone --nproc_per_node="$nproc"
     --max-restarts="${MAX_RESTARTS:-3}" -m aiayn train --config "$config" "$@")
echo "+ ${cmd[*]}" >&2
exec "${cmd[@]}"
