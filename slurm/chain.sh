#!/usr/bin/env bash
# Submit N jobs that each continue the run where the previous one stopped: for runs longer
# than the partition's time limit on clusters that do not allow requeueing.
#
#   slurm/chain.sh N [sbatch options] slurm/train.sbatch CONFIG [key=value ...]
#   e.g. slurm/chain.sh 4 -N 2 --gpus-per-node=8 --time=24:00:00 \
#          slurm/train.sbatch configs/wmt14_en_de_base.yaml run_dir=runs/base
#
# Each job waits for the previous one to end in any state (--dependency=afterany), so a job
# that ran out of time or was stopped still hands on. --no-requeue: a job that receives the
# time-limit warning (USR1) saves and ends instead of requeueing itself, and the next one
# resumes from the run_dir's latest checkpoint. Jobs that start after the run is complete load
# the last checkpoint and end at once. `scancel` the printed ids to stop the chain.
set -euo pipefail
if [ $# -lt 2 ] || ! [ "$1" -gt 0 ] 2>/dev/null; then
  echo "usage: $0 N [sbatch options] slurm/train.sbatch CONFIG [key=value ...]" >&2
  exit 2
fi
n=$1
shift
prev=""
for ((i = 1; i <= n; i++)); do
  cmd=(sbatch --parsable --no-requeue ${prev:+--dependency=afterany:$prev} "$@")
  echo "+ ${cmd[*]}" >&2
  prev=$("${cmd[@]}")
  prev=${prev%%;*} # --parsable prints JOBID[;CLUSTER]
  echo "$prev"
done
