#!/usr/bin/env bash
# N processes on this machine with PyTorch DDP (gloo on CPU, NCCL on GPUs).
# Usage: NPROC=2 launch/torchrun.sh CONFIG [key=value ...]     (NPROC: default = GPUs, or 2)
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: NPROC=N $0 CONFIG [key=value ...]" >&2; exit 2; }
config=$1; shift
gpus=$(python -c 'import torch; print(torch.cuda.device_count())')
nproc=${NPROC:-$([ "$gpus" -gt 0 ] && echo "$gpus" || echo 2)}
cmd=(torchrun --standalone --nproc_per_node="$nproc" -m aiayn train --config "$config" "$@")
echo "+ ${cmd[*]}" >&2
exec "${cmd[@]}"
